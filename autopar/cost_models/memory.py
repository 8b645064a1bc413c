"""Training-state memory: parameters, gradients and optimizer state per parameter.

What the runtime keeps (runtime/precision.py). fp32/tf32 training: 4-byte weights and 4-byte gradients.
Mixed precision ("bf16"/"fp16") runs the forward under torch.autocast: the parameters stay fp32 and are
the master weights themselves, their gradients arrive and are reduced in fp32, so the state is the same
4 + 4 bytes (not 2 + 2 + a 4-byte master copy as in Micikevicius et al.'s scheme, which the runtime does
not use). Optimizer state on top: SGD with momentum 4 bytes per parameter (plain SGD 0), Adam/AdamW 8
(exp_avg, exp_avg_sq in fp32); AdamW therefore costs 16 bytes per parameter in every precision.

Besides the state, autocast makes a 2-byte copy of each weight a matmul / linear / convolution uses, once
per stage forward, and the op keeps it for its backward: `cast_copy` = 2 bytes per such parameter per
micro-batch in flight (0 in fp32/tf32); it is not part of `total`. Activations in mixed precision are
priced at 2 bytes per element (passes/annotate.py PRECISIONS): autocast's matmul outputs are bf16/fp16,
but ops on its fp32 list (softmax, log-softmax, cross-entropy, norms on CUDA) and type promotion (a
residual add of an fp32 stream) keep some activations in fp32, so the 2-byte figure is a lower bound
there; stage transfers do travel in 2 bytes (runtime/precision.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PlanError
from ..graph import TrainingGraph

# bytes one ZeRO / gradient-sync collective packs into a flat buffer at a time (runtime/zero.py's buckets):
# the transient on top of the training state while gradients are reduced and updated values broadcast
SYNC_BUCKET_BYTES = 64 << 20

OPTIMIZER_STATE_BYTES = {"sgd": 0, "sgd_momentum": 4, "momentum": 4, "adam": 8, "adamw": 8, "adagrad": 4,
                         "rmsprop": 4}


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each kind of training state."""

    weights: int
    grads: int
    optimizer: int  # optimizer moments (the fp32 weights are the master weights in mixed precision)
    cast_copy: int = 0  # autocast's low-precision weight copy, per parameter and micro-batch in flight

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
    """Bytes per parameter the runtime keeps for `optimizer` in `precision` (module docstring)."""
    opt = OPTIMIZER_STATE_BYTES[optimizer_name(optimizer)]
    return StateBytes(weights=4, grads=4, optimizer=opt, cast_copy=2 if precision in ("bf16", "fp16") else 0)


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
