"""The backward of a zero-bubble schedule split in two: B (input gradients) now, W (weight gradients) later.

`backward_input` runs B of one micro-batch of a stage: the gradients of the stage's received inputs (what
SEND_B sends upstream, accumulated into their `.grad` as a plain backward does), keeping the autograd graph
and, for every group of parameters, the gradients that reached the graph nodes where the parameters'
branches join the input-gradient graph ("intermediates"). `backward_weight` runs W: from those nodes and
gradients down to the parameters, accumulating into `.grad` (post-accumulate-grad hooks fire then, so
grad_sync.py's buckets launch during the last W). This is torch.distributed.pipelining's split
(`stage_backward_input` / `stage_backward_weight`, the one its ZB schedules run; W here lets autograd
accumulate, so the hooks run): W re-runs only the
parameters' own branches, so the two cost about one backward together, and each gradient is the same
sum of the same products as in one backward: the result equals 1F1B's (tests/test_zero_bubble.py).

When the split does not apply the whole backward runs in one of the two, which gives the same gradients:
in W when no stage input needs a gradient (the first stage: nothing to send upstream), in B when some
parameter's gradient does not flow through the input-gradient graph (its branch never joins it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc,
    construct_reverse_graph,
    get_param_groups,
    stage_backward_input,
)


@dataclass
class PendingWeights:
    """What B of one micro-batch leaves for its W: the parameter groups, or a whole deferred backward."""

    params: list[torch.Tensor]
    groups: list[dict[str, Any]] | None = None
    deferred: tuple[list[torch.Tensor], list[torch.Tensor] | None] | None = field(default=None, repr=False)


def _splits(outputs: list[torch.Tensor], inputs: list[torch.Tensor], params: list[torch.Tensor]) -> bool:
    """Whether every parameter the outputs depend on joins the input-gradient graph (module docstring)."""
    reverse = construct_reverse_graph([fn for o in outputs if (fn := _get_grad_fn_or_grad_acc(o)) is not None])
    weights = [fn for p in params if (fn := _get_grad_fn_or_grad_acc(p)) is not None and fn in reverse]
    ins = [fn for x in inputs if (fn := _get_grad_fn_or_grad_acc(x)) is not None]
    covered = set().union(*(g["params"] for g in get_param_groups(ins, weights, reverse)))
    return covered >= set(weights)


def backward_input(outputs: list[torch.Tensor], grads: list[torch.Tensor] | None, inputs: list[torch.Tensor],
                   params: list[torch.Tensor]) -> PendingWeights:
    """B: the input gradients of `inputs` (into their .grad) from `outputs` (the loss: `grads` None);
    returns what W needs. `params`: the stage's trainable parameters."""
    params = [p for p in params if p.requires_grad]
    inputs = [x for x in inputs if x.requires_grad]
    if not inputs:  # nothing goes upstream: the whole backward is W's
        return PendingWeights(params, deferred=(outputs, grads))
    if not _splits(outputs, inputs, params):
        torch.autograd.backward(outputs, grads)
        return PendingWeights(params)
    _, groups = stage_backward_input(outputs, grads, inputs, iter(params))
    return PendingWeights(params, groups=groups)


def backward_weight(pending: PendingWeights) -> None:
    """W: the parameter gradients B left, accumulated into .grad by autograd (so post-accumulate-grad hooks
    fire); a no-op when B ran the whole backward. As torch's `stage_backward_weight`, but accumulating."""
    if pending.deferred is not None:
        outputs, grads = pending.deferred
        torch.autograd.backward(outputs, grads)
        return
    by_node = {_get_grad_fn_or_grad_acc(p): p for p in pending.params}
    for group in pending.groups or ():
        edges, grads = [], []
        for saved, node in zip(group["grads"], group["intermediates"], strict=True):
            for i, g in enumerate(saved):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        # an intermediate below another one gets its saved gradient, not the sum through the other again
        handles = [node.register_prehook(lambda _outs, saved=saved: saved)
                   for saved, node in zip(group["grads"], group["intermediates"], strict=True)] \
            if len(group["intermediates"]) > 1 else []
        try:
            if edges:
                torch.autograd.backward(edges, grads, inputs=[by_node[n] for n in group["params"]])
        finally:
            for h in handles:
                h.remove()
        group.clear()  # drops the graph nodes and the saved gradients


__all__ = ["PendingWeights", "backward_input", "backward_weight"]
