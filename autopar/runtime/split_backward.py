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
parameter's gradient does not flow only through the input-gradient graph: its branch never joins it, or
also reaches a stage output that does not depend on the stage's inputs (W starts from the join nodes, so
that part of the gradient would be lost; torch's own split has this gap), or it joins it at two nodes one
below the other (W would re-run the input-gradient graph between them: `_nested_joins`).

Recomputed blocks (`torch.utils.checkpoint`, non-reentrant: layered.py, and whole-stage checkpoints)
recompute their forward once per backward call that unpacks their saved tensors. B is one call and
recomputes each block once, as a plain backward does. W runs one call per parameter group; when the groups
cover disjoint parts of the graph (each joins the input-gradient graph at one node, so no node runs in two
of the calls) they share one `torch.utils.checkpoint.GraphExecGroup` and W recomputes each block once more,
not once per group (a GPT block has ~6 groups). W must recompute: its join nodes ran in B already, and a
checkpointed tensor unpacks once per backward call. A recomputed block therefore runs its forward three
times under a zero-bubble schedule (F, B, W) against twice under 1F1B, and keeps, between its B and its W,
about what recompute keeps (the block's input and what only W's nodes saved), not its activations. During
W the recomputed tensors that only B's nodes read stay until the W ends (checkpoint frees a recomputed
tensor when it is unpacked, and the graph lives until then): for one micro-batch, up to that part of the
activations of every recomputed block of the stage.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc,
    construct_reverse_graph,
    reverse_closure,
    stage_backward_input,
)
from torch.utils.checkpoint import GraphExecGroup


@dataclass
class PendingWeights:
    """What B of one micro-batch leaves for its W: the parameter groups, or a whole deferred backward."""

    params: list[torch.Tensor]
    groups: list[dict[str, Any]] | None = None
    deferred: tuple[list[torch.Tensor], list[torch.Tensor] | None] | None = field(default=None, repr=False)

    @property
    def mode(self) -> str:
        """How B split this micro-batch's backward: "split" (B input gradients, W weight gradients),
        "deferred" (all of it in W) or "whole" (all of it in B)."""
        return "split" if self.groups is not None else "deferred" if self.deferred is not None else "whole"


def _splits(outputs: list[torch.Tensor], inputs: list[torch.Tensor], params: list[torch.Tensor]) -> bool:
    """Whether every parameter the outputs depend on gets its whole gradient through the input-gradient
    graph: its branch joins it, and reaches no output the inputs do not feed (module docstring)."""
    roots = {fn for o in outputs if (fn := _get_grad_fn_or_grad_acc(o)) is not None}
    reverse = construct_reverse_graph(list(roots))
    ins = [fn for x in inputs if (fn := _get_grad_fn_or_grad_acc(x)) is not None]
    fed, _ = reverse_closure(ins, set(), reverse)  # the nodes whose gradient reaches an input
    join_sets = []
    for p in params:
        fn = _get_grad_fn_or_grad_acc(p)
        if fn is None or (fn not in reverse and fn not in roots):
            continue  # the outputs do not depend on it: no gradient
        branch, joins = reverse_closure([fn], fed, reverse)
        if not joins or branch & roots:
            return False
        join_sets.append(joins)
    return not _nested_joins(join_sets, fed)


def _nested_joins(join_sets: list[set[Any]], fed: set[Any]) -> bool:
    """Whether a W would run part of the input-gradient graph: a group (parameters whose join sets overlap,
    as W groups them) joins it at two nodes one of which is below the other there (T5's relative position
    bias, computed once and added to every layer's scores). W's backward from the upper node would go down
    the input-gradient graph to the lower one: B's work again, through nodes an earlier W call has already
    freed ("Trying to backward through the graph a second time")."""
    groups: list[set[Any]] = []
    for joins in join_sets:
        overlapping = [g for g in groups if g & joins]
        merged = set(joins).union(*overlapping)
        groups = [g for g in groups if not g & joins] + [merged]
    for group in groups:
        if len(group) < 2:
            continue
        seen, stack = set(), [f for j in group for f, _ in j.next_functions if f is not None]
        while stack:  # down the input-gradient graph from the group's join nodes
            node = stack.pop()
            if node in group:
                return True
            if node in seen or node not in fed:
                continue
            seen.add(node)
            stack.extend(f for f, _ in node.next_functions if f is not None)
    return False


def _shared_recompute(groups: list[dict[str, Any]]) -> contextlib.AbstractContextManager:
    """One checkpoint recompute for all of W's calls, when no graph node runs in two of them (module
    docstring): every group joins the input-gradient graph at one node (distinct groups' branches are then
    disjoint, or torch would have merged them). Not inside another GraphExecGroup (they do not nest)."""
    if len(groups) > 1 and all(len(g["intermediates"]) == 1 for g in groups) \
            and GraphExecGroup._get_current_group() is None:
        return GraphExecGroup()
    return contextlib.nullcontext()


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
    return PendingWeights(params, groups=_merged(groups))


def _merged(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """torch's groups made disjoint: groups that share a parameter or a join node become one.

    `get_param_groups` merges a parameter's group into the existing group of each join node it reaches, one
    after the other, and leaves the earlier ones in place: a parameter whose branch joins the input-gradient
    graph at nodes of two groups (Qwen2's attention: one parameter's branch reaching what two others reach)
    ends up in both, and W would run the shared part of the graph twice ("Trying to backward through the
    graph a second time"; or count those gradients twice). Each join node's saved gradient is the same in
    every group that lists it (B's hook saw one gradient per node)."""
    parent = list(range(len(groups)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = i = parent[parent[i]]
        return i

    owner: dict[Any, int] = {}
    for i, group in enumerate(groups):
        for key in (*group["params"], *group["intermediates"]):
            j = owner.setdefault(key, i)
            parent[root(i)] = root(j)
    if len({root(i) for i in range(len(groups))}) == len(groups):
        return groups
    out: dict[int, dict[str, Any]] = {}
    for i, group in enumerate(groups):
        merged = out.setdefault(root(i), {"params": set(), "intermediates": [], "grads": []})
        merged["params"] |= set(group["params"])
        saved = group.get("grads") or [None] * len(group["intermediates"])
        for node, g in zip(group["intermediates"], saved, strict=True):
            if node not in merged["intermediates"]:
                merged["intermediates"].append(node)
                merged["grads"].append(g)
    return list(out.values())


def backward_weight(pending: PendingWeights) -> None:
    """W: the parameter gradients B left, accumulated into .grad by autograd (so post-accumulate-grad hooks
    fire); a no-op when B ran the whole backward. As torch's `stage_backward_weight`, but accumulating."""
    if pending.deferred is not None:
        outputs, grads = pending.deferred
        torch.autograd.backward(outputs, grads)
        return
    by_node = {_get_grad_fn_or_grad_acc(p): p for p in pending.params}
    groups = pending.groups or []
    with _shared_recompute(groups):
        for group in groups:
            _weights_of(group, by_node)


def _weights_of(group: dict[str, Any], by_node: dict[Any, torch.Tensor]) -> None:
    """One parameter group's W: from its join nodes' saved gradients down to its parameters' .grad."""
    edges, grads = [], []
    for saved, node in zip(group["grads"], group["intermediates"], strict=True):
        for i, g in enumerate(saved or ()):
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
