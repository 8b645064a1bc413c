"""Intra-operator parallelism for one pipeline stage: a sharding strategy per op, chosen by an ILP (Alpa).

The stage's `tp` devices form a 1-D mesh. Every op node gets a set of strategies (`intra_op.strategies`):
replicated, sharded along a dim, Megatron's column-/row-parallel matmuls, head-sharded attention,
vocab-parallel embedding and loss. Views, getitems and other ops that can follow every layout their
producer may emit are merged into that producer ("groups", `merge_followers`), so the ILP has one choice
per group. Identical blocks (same signature and surroundings, `Context.layer_key`) are solved once, and
solutions are cached across calls by that key and the mesh's links.

The ILP, for groups v with strategies i and group edges (u, v) (v reads a tensor a group u produces):

    variables   s[v,i] in {0,1}            group v runs strategy i
                e[u,v,i,j] in {0,1}        u runs i and v runs j (the product s[u,i] * s[v,j])
    minimize    W * ( sum_v,i c[v,i] s[v,i] + sum_uv,i,j r[u,v,i,j] e[u,v,i,j] + sum_x,i q[x,i] z[x,i] )
                + sum_v,i i * s[v,i]
    subject to  sum_i s[v,i] = 1                                   for every v      (_one_hot)
                sum_j e[u,v,i,j] = s[u,i],  sum_i e[u,v,i,j] = s[v,j]  for every edge  (_linearize)
                                                                   with a nonzero r
                sum_v,i m[v,i] s[v,i] <= budget                  when a budget is given (_memory_limit)
                z[x,i] >= s[u,i] + sum_j in need(x,v) s[v,j] - 1  for every shared resharding x of a
                                   tensor u produces and reader v of it (`intra_op.shared`, _needed)

c[v,i] (`intra_op.build._group_costs`) is the compute time of the group's ops, forward + backward, re-priced with the
kernels' FLOPs and bytes divided by the split (launch overheads stay), plus the collectives the strategy
runs itself: an all-reduce of every replicated weight whose gradient is partial (batch-sharded ops), and
vocab-parallel cross-entropy's statistics. Reads of tensors from outside the layer (the boundary layout)
and writes to it are folded into c. r[u,v,i,j] (`intra_op.build._edge_costs`) is resharding u's output layout to the
layout v's strategy reads, forward, plus resharding the gradient v returns to what u's backward needs:

    R -> S   free (slice)       S(d) -> R   all-gather      S(d) -> S(e)   all-to-all
    P -> R   all-reduce         P -> S(d)   reduce-scatter  (P = partial sums)

priced with `comm.collective_time` over `group`. A tensor several groups read gets its partial-sum gradients
summed by autograd first, so their reduction q[x,i] is paid once (a `Shared` x), as is, outside runtime mode,
one gather serving several readers. m[v,i] is the training state of the parameters the group
reads (weights, gradients, AdamW moments; divided by tp where sharded) plus the activations its ops save
for backward in the layout they are produced in. Costs are integer picoseconds and bytes; W exceeds the
tie-break sum, which prefers earlier (simpler) strategies among equal-cost optima and makes the answer
deterministic. Tensors crossing a layer boundary all use one layout (R, S(0) or S(1) of batch-leading
activations), enumerated in `solve_intra_op`; CP-SAT solves each case (`intra_op.ilp`).

Micro-batch sizes: `solve_intra_op(batch=n)` (and `Context.frac` = n / captured batch) re-prices every
kernel at n samples (FLOPs and bytes scaled, as `pricing.CostModel.layer_compute` does) and scales the
activations, their resharding collectives and the strategies' own collectives; parameters do not scale.
The planner prices tensor-parallel blocks through `intra_op.pricing.LayerPricer`, which solves at the
micro-batch size buckets and prices a known answer with `build_problem(..., choice)`; it solves in runtime mode
(`Context.runtime`: only the strategies and reshardings the DTensor runtime performs; see intra_op.pricing).

Where the parts are, from the bottom up (every name below is re-exported here):

    intra_op/strategies.py  the strategies of single ops (`enumerate_strategies`, `op_spec`, layouts R, P, S(d))
    intra_op/problem.py     the ILP's data: `Problem`, its groups (`Group`, `NodeStrategy`), `Cost`, `Shared`,
                            a solved layer (`Solution`) and the stage's answer (`IntraOpResult`)
    intra_op/context.py     `Context`: what a (graph, mesh, device type) is priced with (tensor bytes, collectives,
                            reshardings, re-priced compute, strategies, the block key)
    intra_op/shared.py      the reshardings several groups share (`shared_reshards`)
    intra_op/build.py       one layer's problem (`merge_followers`, c and r above, `build_problem`)
    intra_op/ilp.py         the CP-SAT model (`solve_problems`) and the answer cache (`cached`, `cache_info`)
    intra_op.py             this entry point: `solve_intra_op` over the boundary layouts, with a memory budget
    intra_op/pricing.py     the planner's price of a tensor-parallel layer (`LayerPricer`, `tp_layer_cost`)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ...cluster import Cluster
from ...cost_models.comm import collective_time  # noqa: F401  (tests/test_tp_pricing_forms.py reads it here)
from ...cost_models.memory import state_bytes_per_param
from ...errors import InfeasibleError, PlanError
from ...ir.graph import Layer, TrainingGraph
from .build import build_layer_problem, build_problem, check_args
from .context import FORBIDDEN, Context
from .ilp import cache_info, cached, clear_cache, solve_problems
from .problem import PS, IntraOpResult, Problem, Shared, Solution, result_of, solution_of
from .strategies import R

_build = build_problem  # the name tests/test_intra_op.py, test_tp_pricing_forms.py, test_tp_sharding.py use


def solve_intra_op(graph: TrainingGraph, layer_indices: Sequence[int], tp: int, device_type: str,
                   cluster: Cluster, group: Sequence[int], memory_budget: float | None = None,
                   time_limit_s: float = 10.0, batch: int | None = None) -> IntraOpResult:
    """Best per-op sharding of `graph.layers[layer_indices]` over the `tp` devices `group` of `cluster`.

    Times are for `batch` samples (default: the graph's captured global batch; the kernels' FLOPs and bytes,
    activations and their collectives scale with it) on `device_type`; `memory_budget` bounds the bytes per
    device of parameter training state (AdamW) plus saved activations. Raises InfeasibleError when no
    strategy fits the budget.
    """
    check_args(graph, layer_indices, tp, device_type, cluster, group)
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise PlanError(f"batch must be a positive integer, got {batch!r}.")
    layers = [graph.layers[i] for i in layer_indices]
    if tp == 1 and batch in (None, graph.batch_size):
        return _unsharded(graph, layers, device_type, memory_budget)
    ctx = Context(graph, tp, device_type, cluster, group, (batch or graph.batch_size) / graph.batch_size)
    base = [ctx.layer_key(layer) for layer in layers]
    plain = [ctx.boundary_key(layer, R) for layer in layers]
    best: tuple[int, IntraOpResult] | None = None
    min_memory = 0.0
    for boundary in (R, 0, 1):
        bkeys = [ctx.boundary_key(layer, boundary) for layer in layers]
        if boundary != R and bkeys == plain:
            continue  # no boundary tensor can take this layout
        keys = [(*k, b) for k, b in zip(base, bkeys, strict=True)]
        reps = dict(zip(keys, layers, strict=True))
        counts = Counter(keys)
        sols = {k: _solve_cached(ctx, (k,), [reps[k]], [1], boundary, None, time_limit_s)[0] for k in reps}
        if memory_budget is not None and sum(counts[k] * sols[k].memory for k in reps) > memory_budget:
            try:  # the budget couples the layers: one ILP over the distinct ones, weighted by count
                joint = _solve_cached(ctx, tuple(reps), list(reps.values()), [counts[k] for k in reps],
                                      boundary, memory_budget, time_limit_s)
            except InfeasibleError:
                min_memory = min(min_memory or float("inf"), _min_memory(ctx, reps, counts, boundary))
                continue
            sols = dict(zip(reps, joint, strict=True))
        objective = sum(counts[k] * sols[k].objective for k in reps)
        if best is None or objective < best[0]:
            best = (objective, result_of(tp, layers, keys, sols))
    if best is None:
        raise InfeasibleError(
            f"layers {list(layer_indices)} need at least {min_memory / 2**30:.2f} GiB per device at tp={tp} "
            f"(AdamW state + saved activations), over the budget of {memory_budget / 2**30:.2f} GiB; "
            f"raise tp, use fewer layers per stage or a smaller micro-batch.")
    return best[1]


def _solve_cached(ctx: Context, keys: tuple, layers: list[Layer], weights: list[int], boundary: int,
                  budget: float | None, time_limit_s: float) -> tuple[Solution, ...]:
    """The layers' optimal solutions (one ILP over all of them, weighted, under `budget`), cached by `keys`."""
    def solve() -> tuple[Solution, ...]:
        probs = [build_problem(ctx, layer, boundary) for layer in layers]
        choices = solve_problems(list(zip(probs, weights, strict=True)), budget, time_limit_s)
        return tuple(solution_of(p, layer, c) for p, layer, c in zip(probs, layers, choices, strict=True))

    return cached((keys, tuple(weights), budget), solve)


def _min_memory(ctx: Context, reps: dict[tuple, Layer], counts: Counter, boundary: int) -> float:
    total = 0.0
    for k, layer in reps.items():
        prob = build_problem(ctx, layer, boundary)
        total += counts[k] * (prob.const_memory + sum(min(m) for m in prob.memory))
    return total


def _unsharded(graph: TrainingGraph, layers: list[Layer], device_type: str,
               memory_budget: float | None) -> IntraOpResult:
    state = state_bytes_per_param("adamw", graph.dtype)
    params = [graph.params[p] for layer in layers for p in layer.params if graph.params[p].counts]
    acts = sum(layer.saved_bytes for layer in layers)
    need = sum(p.meta.numel for p in params) * state.total + acts
    if memory_budget is not None and need > memory_budget:
        raise InfeasibleError(f"layers need {need / 2**30:.2f} GiB per device without tensor parallelism "
                              f"(AdamW state + saved activations), over the budget of "
                              f"{memory_budget / 2**30:.2f} GiB; use tp > 1 or fewer layers per stage.")
    return IntraOpResult(1, sum(layer.time_fwd.get(device_type, 0.0) for layer in layers),
                         sum(layer.time_bwd.get(device_type, 0.0) for layer in layers), 0.0,
                         float(sum(layer.param_bytes for layer in layers)), float(acts),
                         {n: "R" for layer in layers for n in layer.nodes if graph.nodes[n].outputs})


__all__ = ["FORBIDDEN", "PS", "Context", "IntraOpResult", "Problem", "Shared", "build_layer_problem", "build_problem",
           "cache_info", "clear_cache", "solve_intra_op", "solve_problems"]
