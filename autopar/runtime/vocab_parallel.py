"""Vocabulary parallelism: the embedding table and the LM head sharded along the vocabulary, and a
cross-entropy that never gathers the logits.

* Embedding: the weight is `Shard(0)`; DTensor's embedding strategy looks up the rows a rank holds, masks
  the others (`MaskPartial`) and all-reduces the partial result when a replicated value is needed.
* LM head: a linear layer feeding the loss is column-parallel along the vocabulary (weight `Shard(0)`),
  so its logits are sharded on the last dimension. A tied head shares the embedding's placement.
* Loss: `aten.cross_entropy_loss` on logits sharded along the classes runs `VocabParallelCrossEntropy`
  (Megatron's formulation): all-reduce MAX of the row maxima, all-reduce SUM of the exponential sums and of
  the target logit (each rank contributes the targets inside its vocabulary slice), so each rank only
  ever holds (rows, vocab / tp) logits; the backward is local: softmax - one_hot, scaled.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .dist import wait

_MEAN, _SUM = 1, 2  # at::Reduction


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of (rows, vocab-slice) local logits against full targets; the loss is replicated."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int, group: Any,  # noqa: ANN401
                ignore_index: int, reduction: int) -> torch.Tensor:
        x = logits.float()
        row_max = x.max(dim=1).values
        wait(dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group, async_op=True),
             "vocab-parallel loss (all-reduce of row maxima)", "in its group", group=group, device=row_max.device)
        shifted = x - row_max[:, None]
        exp = shifted.exp()
        sum_exp = exp.sum(dim=1)
        local_t = target - start
        inside = (local_t >= 0) & (local_t < x.shape[1])
        idx = local_t.clamp(0, x.shape[1] - 1)
        picked = torch.where(inside, shifted.gather(1, idx[:, None])[:, 0], 0.0)
        both = torch.stack([sum_exp, picked])
        wait(dist.all_reduce(both, group=group, async_op=True), "vocab-parallel loss (all-reduce of sums)",
             "in its group", group=group, device=both.device)
        sum_exp, picked = both[0], both[1]
        valid = target != ignore_index
        per_row = torch.where(valid, sum_exp.log() - picked, 0.0)
        count = valid.sum()
        scale = 1.0 / count.clamp(min=1).to(x.dtype) if reduction == _MEAN else torch.ones((), dtype=x.dtype)
        ctx.save_for_backward(exp / sum_exp[:, None], idx, inside & valid, valid, scale)
        ctx.in_dtype = logits.dtype
        # a mean over no valid target is nan, as in torch
        return (per_row.sum() / count.to(x.dtype)) if reduction == _MEAN else per_row.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # noqa: ANN401
        softmax, idx, hit, valid, scale = ctx.saved_tensors
        g = softmax
        g[torch.arange(g.shape[0]), idx] -= hit.to(g.dtype)
        g *= (valid.to(g.dtype) * scale * grad)[:, None]
        return g.to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_loss(mesh: DeviceMesh, args: tuple, kwargs: dict) -> Any:
    """`aten.cross_entropy_loss` on class-sharded DTensor logits, or None when it does not apply (then the
    caller runs the op as DTensor would)."""
    logits, target = args[0], args[1]
    rest = list(args[2:]) + [None] * (4 - len(args[2:]))
    weight = kwargs.get("weight", rest[0])
    reduction = kwargs.get("reduction", rest[1] if rest[1] is not None else _MEAN)
    ignore_index = kwargs.get("ignore_index", rest[2] if rest[2] is not None else -100)
    smoothing = kwargs.get("label_smoothing", rest[3] if rest[3] is not None else 0.0)
    if not (isinstance(logits, DTensor) and logits.dim() == 2 and logits.placements == (Shard(1),)
            and weight is None and smoothing == 0.0 and reduction in (_MEAN, _SUM)):
        return None
    if isinstance(target, DTensor):
        if target.placements != (Replicate(),):
            return None
        target = target.to_local()
    _, offset = compute_local_shape_and_global_offset(logits.shape, mesh, logits.placements)
    loss = VocabParallelCrossEntropy.apply(logits.to_local(), target, offset[1], mesh.get_group(),
                                           ignore_index, reduction)
    return DTensor.from_local(loss, mesh, [Replicate()], run_check=False)


def vocab_parallel_embedding(mesh: DeviceMesh, args: tuple, kwargs: dict) -> Any:
    """`aten.embedding` with a `Shard(0)` weight: each rank looks up the ids inside its rows (others give
    zeros), and the partial results are summed into a replicated value; None when it does not apply.
    (Done here rather than by DTensor's own `MaskPartial` rule, whose mask lives on a cached placement
    object and is lost when the sharding cache hands the same placement to another call.)"""
    weight, ids = args[0], args[1]
    padding_idx = kwargs.get("padding_idx", args[2] if len(args) > 2 else -1)
    scale_by_freq = kwargs.get("scale_grad_by_freq", args[3] if len(args) > 3 else False)
    sparse = kwargs.get("sparse", args[4] if len(args) > 4 else False)
    if not (isinstance(weight, DTensor) and weight.placements == (Shard(0),)) or scale_by_freq or sparse:
        return None
    if isinstance(ids, DTensor):
        if ids.placements != (Replicate(),):
            return None
        ids = ids.to_local()
    local_w = weight.to_local()
    _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    start, rows = offset[0], local_w.shape[0]
    local_ids = ids - start
    inside = (local_ids >= 0) & (local_ids < rows)
    pad = padding_idx - start if padding_idx is not None and 0 <= padding_idx - start < rows else -1
    out = torch.ops.aten.embedding.default(local_w, local_ids.clamp(0, max(rows - 1, 0)), pad)
    out = out * inside.unsqueeze(-1).to(out.dtype)
    return DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()])
