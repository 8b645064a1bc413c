"""Fallback for models autopar cannot capture (data-dependent control flow, ops without a meta kernel):
run the eager model replicated on every rank, each on a share of the batch proportional to its device's
speed, and sum the share-weighted gradients, so training still equals single-device training."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..cluster import Cluster
from ..errors import CaptureError
from ..passes.capture import LossFn, model_loss
from .dist import DEFAULT_TIMEOUT_S, all_reduce, broadcast
from .program import OptimizerFactory, make_optimizer
from .whole_model import WholeModelState


def speed_shares(cluster: Cluster, batch: int) -> list[int]:
    """Integer batch shares proportional to each device's peak FLOP/s (largest remainders), each >= 1."""
    speeds = [d.spec.flops("fp16" if d.spec.kind != "cpu" else "fp32") for d in cluster.devices]
    if batch < len(speeds):
        raise CaptureError(f"the replicated fallback needs a global batch of at least {len(speeds)} samples "
                           f"(one per device), got {batch}.")
    raw = [1 + (batch - len(speeds)) * s / sum(speeds) for s in speeds]
    shares = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - shares[i], reverse=True)[: batch - sum(shares)]:
        shares[i] += 1
    return shares


class ReplicatedProgram(WholeModelState):
    """Data-parallel eager training: the model as written, replicated on every rank."""

    def __init__(self, model: nn.Module, cluster: Cluster, batch: int, loss_fn: LossFn | None,
                 optimizer: str | OptimizerFactory, rank: int, world_size: int, reason: CaptureError,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.model, self.loss_fn, self.rank, self.world_size = model, loss_fn, rank, world_size
        self.reason, self.timeout_s, self.step_count, self.plan = reason, timeout_s, 0, None
        self.shares = speed_shares(cluster, batch)
        self.batch = batch
        self.offset = sum(self.shares[:rank])
        self.optimizer = make_optimizer(optimizer, list(model.parameters()))
        if world_size > 1:
            for p in model.parameters():  # every replica starts from rank 0's weights
                broadcast(p.data, 0, "broadcasting the replicated fallback's parameters from rank 0", timeout_s)
        warnings.warn(f"autopar could not capture the model, so it runs replicated (data parallel, eager): "
                      f"{reason}", stacklevel=3)

    def _slice(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == self.batch:
            return x[self.offset:self.offset + self.shares[self.rank]]
        return x

    def step(self, *inputs: Any, target: Any = None) -> float:
        with self.timed_step():
            return self._step(inputs, target)

    def what_runs(self) -> str:
        return f"the whole model, eager, on {self.shares[self.rank]} of {self.batch} samples (replicated fallback)"

    def _step(self, inputs: tuple, target: Any) -> float:
        out = self.model(*[self._slice(x) for x in inputs])
        loss = self.loss_fn(out, self._slice(target)) if self.loss_fn is not None else model_loss(out)
        weight = self.shares[self.rank] / self.batch
        (loss * weight).backward()
        params = [p for p in self.model.parameters() if p.requires_grad]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                         + [loss.detach().reshape(1) * weight])
        if self.world_size > 1:
            all_reduce(flat, dist.group.WORLD, "gradient all-reduce of the replicated fallback", self.timeout_s)
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p)  # flat is fresh each step
            offset += p.numel()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        return float(flat[-1])

    def eval_step(self, *inputs: Any) -> Any:
        """Forward only: the model's full output for the global batch on every rank (each replica runs its
        share; the shares are broadcast and concatenated in batch order). Collective."""
        from .eval import concat_from

        with torch.no_grad():
            out = self.model(*[self._slice(x) for x in inputs])
        leaves, spec = torch.utils._pytree.tree_flatten(out)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        full = iter(concat_from(tensors, list(range(self.world_size)), self.world_size, self.timeout_s))
        return torch.utils._pytree.tree_unflatten(
            [next(full) if isinstance(x, torch.Tensor) else x for x in leaves], spec)

