"""A model case (a model, one batch, its loss) and the helpers every zoo builds its cases with: the loss of a
case, its single-process reference training, seeded building, the language-model loss and batch. Below
models.py (autopar's own zoo) and hf_models.py (the Hugging Face clients), which both use it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelCase:
    model: nn.Module
    example_inputs: tuple
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    example_target: torch.Tensor | None
    name: str
    # Parameters that legitimately receive no gradient from the example loss (documented per case).
    unused_params: tuple[str, ...] = field(default=())


def loss_of(case: ModelCase, *inputs: Any, target: torch.Tensor | None = None) -> torch.Tensor:
    """Scalar loss of ``case`` on ``inputs`` (default: its example inputs and target)."""
    if not inputs:
        inputs = case.example_inputs
    out = case.model(*inputs)
    if case.loss_fn is None:
        return out.loss if hasattr(out, "loss") else out
    return case.loss_fn(out, case.example_target if target is None else target)


def train_reference(case: ModelCase, make_optimizer: Any, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process training of ``case`` on its example batch: per-step losses and the final state,
    the reference every parallel run is compared with."""
    opt = make_optimizer(list(case.model.parameters()))
    losses = []
    for _ in range(steps):
        loss = loss_of(case)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in case.model.state_dict().items()}


@contextmanager
def building(device: str | torch.device, seed: int) -> Iterator[torch.device]:
    """Build under ``device`` with the RNG seeded, leaving the caller's global RNG state untouched."""
    dev = torch.device(device)
    forked = [dev.index or 0] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=forked), dev:
        torch.manual_seed(seed)
        yield dev


def lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Token cross-entropy; accepts raw logits or a Hugging Face output carrying ``.logits``."""
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten())


def token_batch(batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random next-token batch for the language-model cases (models.py and hf_models.py): `(ids, target)`, each
    `(batch, seq)`, target the ids shifted by one."""
    ids = torch.randint(0, vocab, (batch, seq + 1))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


__all__ = ["ModelCase", "building", "lm_loss", "loss_of", "token_batch", "train_reference"]
