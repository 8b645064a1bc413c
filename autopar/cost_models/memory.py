"""Training-state memory: parameters, gradients and optimizer state per parameter.

Mixed precision ("bf16"/"fp16") keeps low-precision weights and gradients plus an fp32 master copy
(2 + 2 + 4 bytes per parameter, Micikevicius et al.); fp32 training keeps 4 + 4. Optimizer state on top:
SGD with momentum 4 bytes per parameter (plain SGD 0), Adam/AdamW 8 (exp_avg, exp_avg_sq in fp32).
Mixed-precision AdamW therefore costs 16 bytes per parameter, as in the ZeRO paper.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PlanError
from ..graph import TrainingGraph

OPTIMIZER_STATE_BYTES = {"sgd": 0, "sgd_momentum": 4, "momentum": 4, "adam": 8, "adamw": 8, "adagrad": 4,
                         "rmsprop": 4}


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each kind of training state."""

    weights: int
    grads: int
    optimizer: int  # optimizer moments plus the fp32 master copy in mixed precision

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


def optimizer_name(optimizer: object) -> str:
    """Normalize an optimizer given as a name, a torch.optim class/instance, or a factory lambda."""
    if isinstance(optimizer, str):
        name = optimizer.lower()
    else:
        name = getattr(optimizer, "__name__", type(optimizer).__name__).lower()
        if name == "<lambda>" or callable(optimizer) and name in ("function", "partial"):
            return "adamw"  # a factory we cannot inspect without parameters: price the common case
    if name not in OPTIMIZER_STATE_BYTES:
        raise PlanError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_STATE_BYTES)}.")
    return name


def state_bytes_per_param(optimizer: object = "adamw", precision: str = "fp32") -> StateBytes:
    opt = OPTIMIZER_STATE_BYTES[optimizer_name(optimizer)]
    if precision in ("bf16", "fp16"):
        return StateBytes(weights=2, grads=2, optimizer=opt + 4)
    return StateBytes(weights=4, grads=4, optimizer=opt)


def training_state_bytes(graph: TrainingGraph, optimizer: object = "adamw", precision: str = "fp32") -> dict:
    """Bytes of weights, gradients and optimizer state for the whole model on one device, unsharded.

    Matches torch.optim exactly in fp32: Adam/AdamW also keep a 4-byte `step` tensor per parameter tensor.
    """
    per = state_bytes_per_param(optimizer, precision)
    counted = [p for p in graph.params.values() if p.counts]
    numel = sum(p.meta.numel for p in counted)
    step_bytes = 4 * len(counted) if optimizer_name(optimizer) in ("adam", "adamw") else 0
    return {"weights": per.weights * numel, "grads": per.grads * numel,
            "optimizer": per.optimizer * numel + step_bytes}
