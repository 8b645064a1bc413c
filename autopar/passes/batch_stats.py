"""Modules whose forward depends on the whole batch, and what a split batch does to them.

A plan splits the global batch whenever it has several data-parallel replicas or several micro-batches
per pipeline. Most layers compute each sample on its own (linear, attention, LayerNorm, GroupNorm,
RMSNorm, dropout), so splitting changes nothing: micro-batch losses weighted by size give the
single-device gradient exactly. Batch normalization in training mode does not: it normalizes with the
mean and variance of the samples it sees, and updates its running statistics from them. Under a split
batch each piece normalizes by its own statistics (the math of "ghost batch norm"), so losses, gradients
and running statistics differ from one device's.

autopar does not silently change that math: `compile` warns (`BatchStatisticsWarning`), naming the
modules, when the plan splits the batch, and says how to get single-device math back. Synchronizing the
statistics across replicas (SyncBatchNorm) would not be enough, because micro-batches of one replica run
at different times; the ways to keep the math are a plan with one replica and one micro-batch
(`Strategy(dp=1, pp=1, microbatch_size=<global batch>)`), or per-sample normalization (GroupNorm / LayerNorm) in the
model. Modules in eval mode use their running statistics and are per-sample: they are not reported.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn


class BatchStatisticsWarning(UserWarning):
    """The plan splits the batch and the model normalizes with batch statistics: training differs from one
    device's."""


def batch_statistics_modules(model: nn.Module) -> list[str]:
    """Names of the modules (in training mode) that normalize with the statistics of their batch."""
    return [name or type(model).__name__ for name, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]


def warn_if_batch_split(model: nn.Module, pieces: int, batch: int, how: str) -> list[str]:
    """Warn when `model` has batch-statistics modules and the batch runs in `pieces` > 1 pieces; returns
    the modules named."""
    names = batch_statistics_modules(model)
    if not names or pieces <= 1:
        return []
    labels = [f"{name} ({type(model if name == type(model).__name__ else model.get_submodule(name)).__name__})"
              for name in names]  # a Sequential's children are named "1", "4": say what they are
    shown = ", ".join(labels[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    warnings.warn(
        f"{how} splits the global batch into {pieces} pieces, and the module(s) {shown} normalize with batch "
        f"statistics: "
        f"each piece uses its own mean and variance (and updates the running statistics from it), so training "
        f"differs from one device's. For single-device math, train with plan=autopar.Strategy(dp=1, pp=1, "
        f"microbatch_size={batch}), or use GroupNorm/LayerNorm in the model; to accept per-piece statistics, silence "
        f"autopar.BatchStatisticsWarning.", BatchStatisticsWarning, stacklevel=3)
    return names


def pieces_of(plan: Any) -> int:
    """How many pieces a plan cuts the global batch into: every replica's micro-batches."""
    return sum(p.num_microbatches for p in plan.pipelines)
