"""The intra-op ILP (`intra_op`) as the planner's price of a tensor-parallel layer (`tp_layer_cost`, below).

Plans are run by the DTensor runtime (runtime/tensor_parallel.py), which takes parameter placements
(`Stage.sharding`, from `IntraOpResult.sharding`) and lets DTensor's sharding propagation lay the
activations out. So the planner prices what that runs (`LayerPricer(runtime=True)`, the default):

* the ILP runs in runtime mode (`Context.runtime`): only strategies and input reshardings DTensor makes
  (views keep a shard on a split's first factor; attention, SDPA or matmul + softmax (`tp_patterns`), is
  replicated or head-parallel; no partial sum or shard turns into another shard before an op, a replicated
  input is sliced only for an op whose sharded parameters ask for it or an attention core run by heads),
  tensors crossing the layer replicated (the runtime replicates them);
* the ILP's parameter layouts are then run through `runtime_choice`, a model of the propagation (each op
  takes the strategy its inputs' layouts reach cheapest: same layout free, a free slice of a replicated
  input where a sharded parameter or an input already so sharded asks for it, else a partial sum or
  shard replicated), and that strategy set is priced with the ILP's cost model
  (`intra_op.build.build_problem(..., choice)`). Fully replicated parameters and Megatron's placements are
  priced the same way, and the fastest is the layer's price and sharding (`IntraOpResult.source`;
  `tp_reason` says which, next to Megatron's closed form, in the plan). Where propagation agrees with the ILP
  (the usual case) the price is the ILP's optimum.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from ...cluster import Cluster
from ...errors import PlanError
from ...ir.graph import Layer, TrainingGraph
from ...passes.tp_patterns import attention_cores, attention_projection, fused_qkv, loss_heads, megatron_placements
from ...report import fmt_time
from .build import build_problem, check_args, merge_followers
from .context import FORBIDDEN, Context
from .ilp import cached, solve_problems
from .problem import PS, Group, IntraOpResult, NodeStrategy, Problem, result_of, solution_of
from .strategies import P, R

if TYPE_CHECKING:
    from ...cost_models.compute import Profile
    from ..pricing.model import CostModel

_merge_followers = merge_followers  # the name tests/test_tp_sharding.py uses


class LayerPricer:
    """Per-micro-batch costs of single layers on one tensor-parallel group, for the planner's pricing.

    The ILP is solved per (layer signature, micro-batch size bucket): at the powers of two just below and
    above the size (`buckets`), and both optima are priced at the exact size, the faster kept. So a size
    that is a power of two gets the ILP's optimum there (never worse than Megatron's sharding: in runtime
    mode the runtime's `megatron_spec` placements are priced alongside), and the planner, which meets dozens
    of sizes (every share of a batch split), runs a few solves per layer class and group (~0.1 s each).
    Solutions are kept in the module cache. `cost` returns None when the ILP finds no solution in time.
    """

    def __init__(self, graph: TrainingGraph, tp: int, device_type: str, cluster: Cluster, group: Sequence[int],
                 time_limit_s: float = 2.0, runtime: bool = True, profile: Profile | None = None) -> None:
        check_args(graph, [0], tp, device_type, cluster, group)
        self.ctx = Context(graph, tp, device_type, cluster, group, runtime=runtime, profile=profile)
        self.time_limit_s = time_limit_s
        self._megatron: dict[int, dict[str, int]] = {}  # layer index -> megatron_layouts
        self._heads: list[str] | None = None  # `loss_heads` of the graph

    def _loss_heads(self) -> list[str]:
        if self._heads is None:
            self._heads = loss_heads(self.ctx.graph)
        return self._heads

    def _at(self, batch: int) -> Context:
        ctx = copy.copy(self.ctx)  # shares the strategy and collective memo tables: neither depends on frac
        ctx.frac = batch / ctx.graph.batch_size
        return ctx

    @staticmethod
    def problem(ctx: Context, layer: Layer, boundary: int = R) -> Problem:
        """The ILP the pricer solves for `layer` (in runtime mode with `couple_attention`)."""
        prob = build_problem(ctx, layer, boundary)
        if ctx.runtime:
            couple_attention(ctx, layer, prob)
        return prob

    def _choice(self, layer: Layer, batch: int) -> tuple[int, tuple[int, ...]] | None:
        """(boundary layout, strategy index per group) of the ILP optimum for `layer` at `batch` samples."""
        ctx = self._at(batch)

        def solve() -> tuple[int, tuple[int, ...]] | None:
            plain = ctx.boundary_key(layer, R)
            best: tuple[int, int, tuple[int, ...]] | None = None
            for boundary in (R,) if ctx.runtime else (R, 0, 1):
                if boundary != R and ctx.boundary_key(layer, boundary) == plain:
                    continue
                prob = self.problem(ctx, layer, boundary)
                try:
                    (choice,) = solve_problems([(prob, 1)], None, self.time_limit_s)
                except PlanError:
                    continue
                value = prob.objective(choice)
                if best is None or value < best[0]:
                    best = (value, boundary, choice)
            return None if best is None else best[1:]  # type: ignore[return-value]

        return cached(("choice", ctx.layer_key(layer)), solve)

    def cost(self, layer_index: int, batch: int) -> IntraOpResult | None:
        """The layer's times and memory per device for one micro-batch of `batch` samples; in runtime mode
        with `sharding`, the parameter placements the runtime is to run it with (module docstring)."""
        layer = self.ctx.graph.layers[layer_index]
        ctx = self._at(batch)
        key = ctx.layer_key(layer)
        # (boundary, strategy per group, parameter layouts, what they are: SOURCES keys)
        options: list[tuple[int, tuple[int, ...], dict[str, int] | None, set[str]]] = []
        groups = ctx.merged([n for n in layer.nodes if ctx.graph.nodes[n].outputs], merge_followers)

        def add(layouts: dict[str, int], label: str) -> None:
            same = next((o for o in options if o[2] == layouts), None)
            if same is None:
                options.append((R, runtime_choice(ctx, layer, groups, layouts), layouts, {label}))
            else:
                same[3].add(label)

        for size in buckets(batch):
            picked = self._choice(layer, size)
            if picked is None:
                continue
            if not ctx.runtime:
                options.append((*picked, None, {"ilp"}))
                continue
            layouts = param_layouts(ctx, groups, picked[1])
            if layouts is not None:
                add(layouts, "ilp")
        if ctx.runtime and options:  # also replicated parameters (no communication) and Megatron's placements
            if layer.index not in self._megatron:
                self._megatron[layer.index] = megatron_layouts(ctx, layer, self._loss_heads())
            add(dict.fromkeys(param_layouts(ctx, groups, (0,) * len(groups)) or {}, R), "replicated")
            add(self._megatron[layer.index], "megatron")
        best: tuple[float, IntraOpResult] | None = None
        ctx.forbid = False  # a known answer: every resharding at its price
        for boundary, choice, layouts, labels in options:
            sol = solution_of(build_problem(ctx, layer, boundary, choice), layer, (0,) * len(choice))
            res = result_of(ctx.tp, [layer], [key], {key: sol})
            res.source = "+".join(k for k in SOURCES if k in labels)
            if layouts is not None:
                res.sharding = sharding_of(ctx, layer, layouts)
            if best is None or res.time_fwd + res.time_bwd < best[0]:
                best = (res.time_fwd + res.time_bwd, res)
        return None if best is None else best[1]


# what a LayerPricer answer is (IntraOpResult.source, "+"-joined where several coincide)
SOURCES = {"ilp": "the ILP's optimum", "megatron": "Megatron's placements", "replicated": "replicated parameters"}


def param_layouts(ctx: Context, groups: list[Group], choice: Sequence[int]) -> dict[str, int] | None:
    """Parameter placeholder -> the layout the chosen strategies read it in (None where two reads differ)."""
    out: dict[str, int] = {}
    for g, i in zip(groups, choice, strict=True):
        for s in g.choices[i].values():
            for a, layout in s.ins.items():
                if a in ctx.graph.params and out.setdefault(a, layout) != layout:
                    return None
    return out


def _heads(ctx: Context, m: str, s: NodeStrategy) -> bool:
    """Whether op `m`'s strategy `s` runs its attention core head-parallel."""
    return s.base.name != "R" and ctx.cores[m].heads(s.ins)


def couple_attention(ctx: Context, layer: Layer, prob: Problem) -> None:
    """Make head-parallel attention (every op of each attention core) and a row-parallel output projection
    go together in `prob`, as the runtime runs them (`tensor_parallel.sharding_spec`): the other pairings
    cost FORBIDDEN."""
    g = ctx.graph
    index = {m: i for i, grp in enumerate(prob.groups) for m in grp.members}
    for core in attention_cores(g, layer.nodes):
        proj = attention_projection(g, core.output, layer.nodes)
        v = next((i for i, grp in enumerate(prob.groups) if proj and proj[0] in grp.choices[0][grp.members[0]].ins),
                 None)
        if v is None or proj is None:
            continue
        root = prob.groups[v].members[0]
        for m in (x for x in core.nodes if x in index):
            u, pen = index[m], round(FORBIDDEN * PS)
            mat = prob.edges.setdefault((u, v), [[0] * len(prob.groups[v].choices) for _ in prob.groups[u].choices])
            for i, cu in enumerate(prob.groups[u].choices):
                for j, cv in enumerate(prob.groups[v].choices):
                    if _heads(ctx, m, cu[m]) != (cv[root].ins[proj[0]] == proj[1]):
                        mat[i][j] += pen


def megatron_layouts(ctx: Context, layer: Layer, heads: list[str] | None = None) -> dict[str, int]:
    """The layouts the runtime's `megatron_spec` gives the layer's parameters (placeholder -> layout); `heads`: as
    in `megatron_placements`."""
    spec = megatron_placements(ctx.graph, (layer.index, layer.index + 1), heads)
    return {p: spec.params.get(name, R) for p, name in layer_params(ctx.graph, layer)}


def layer_params(graph: TrainingGraph, layer: Layer) -> list[tuple[str, str]]:
    """(placeholder, model name) of a layer's parameters, in the layer's order (identical blocks align)."""
    return [(p, graph.canonical(p)) for p in layer.params if not graph.params[p].is_buffer]


def sharding_of(ctx: Context, layer: Layer, layouts: dict[str, int]) -> dict[str, str]:
    """`Stage.sharding` entries of one layer: the model's name of each of its parameters -> placement."""
    return {name: "replicate" if layouts.get(p, R) < 0 else f"shard({layouts[p]})"
            for p, name in layer_params(ctx.graph, layer)}


def runtime_choice(ctx: Context, layer: Layer, groups: list[Group], layouts: dict[str, int]) -> tuple[int, ...]:
    """Strategy index per group that DTensor's propagation reaches from parameter `layouts` with the
    layer's inputs replicated (module docstring); a group whose members do not follow their root takes
    the replicated strategy of every member."""
    g = ctx.graph
    out: dict[str, int] = {}
    picked: dict[str, object] = {}
    for m in (n for grp in groups for n in grp.members):
        heads = False
        if m in ctx.cores:
            proj = attention_projection(g, ctx.cores[m].output, layer.nodes)
            heads = proj is not None and layouts.get(proj[0]) == proj[1]
        best: tuple[float, int, int] | None = None
        strategies = ctx.strategies(m)
        for k, s in enumerate(strategies):
            if heads and not _heads(ctx, m, s):
                continue  # the runtime re-lays the core's inputs out by heads
            acts = {a: out.get(a, R) for a in s.ins if a not in g.params}
            forced = heads or any(layouts.get(a, R) >= 0 for a in s.ins if a in g.params)
            comm, inexact = 0.0, 0
            for a, need in s.ins.items():
                have = layouts.get(a, R) if a in g.params else acts[a]
                if a in g.params or have == need:
                    comm += 0.0 if have == need else float("inf")
                elif have == R and (need == P or need >= 0 and (forced or need in (x for b, x in acts.items()
                                                                                   if b != a))):
                    inexact += 1  # a local slice, or a local share of a partial sum
                elif need == R and have != R:
                    comm += ctx.reshard(have, R, ctx.tensor_bytes(ctx.meta(a)))
                else:
                    comm = float("inf")
            if comm < float("inf") and (best is None or (comm, inexact, k) < best):
                best = (comm, inexact, k)
        s = strategies[best[2] if best is not None else 0]
        picked[m], out[m] = s, s.base.out
    choice = []
    for grp in groups:
        i = next((i for i, c in enumerate(grp.choices) if all(c[m] == picked[m] for m in grp.members)), 0)
        choice.append(i)
    return tuple(choice)


def buckets(batch: int) -> tuple[int, ...]:
    """The micro-batch sizes the ILP is solved at for `batch` samples: the powers of two around it."""
    lo = 1 << (batch.bit_length() - 1)
    return (lo,) if lo == batch else (lo, 2 * lo)


__all__ = ["SOURCES", "LayerPricer", "buckets", "closed_form", "layer_params", "param_layouts", "runtime_choice",
           "sharding_of", "tp_reason"]


# ---- the planner's price of one tensor-parallel layer (re-exported by pricing) ---------------------


class LayerCost(NamedTuple):
    fwd: float  # compute seconds, one micro-batch
    bwd: float
    fwd_comm: float  # tensor-parallel communication seconds
    bwd_comm: float
    param_frac: float = 1.0  # the share of the layer's own parameters each tensor-parallel rank holds
    act: float = -1.0  # saved activation bytes per device per micro-batch (< 0: saved x n / B / t)
    ilp: bool = False  # priced from the intra-op ILP's strategies (else the Megatron closed form)
    # with ilp: the placements priced for the layer's parameters, in `layer_params` order (identical blocks
    # share one LayerCost, so names come from the layer at hand; `stage_sharding`)
    sharding: tuple[str, ...] = ()
    source: str = ""  # with ilp: which candidate placements won (SOURCES keys, "+"-joined)


def tp_layer_cost(cm: CostModel, layer: int, dtype: str, n: int, tp_group: tuple[int, ...]) -> LayerCost:
    """One layer on a tensor-parallel group: a repeated block from the intra-op ILP's strategies
    (`intra_op.LayerPricer`, memoised per block class, device type, group and micro-batch size), else (the
    layers around the blocks, or no ILP solution in time) the Megatron closed form: compute / t plus
    all-reduces. The single place where tensor parallelism is priced.
    """
    tp = len(tp_group)
    if tp > 1 and cm.is_block[layer]:
        hit = cm.memoised(("ilp", cm.cls[layer], dtype, n, cm.group_sig(tp_group)),
                          lambda: _ilp_cost(cm, layer, dtype, n, tp_group))
        if hit is not None:
            return hit
    return closed_form(cm, layer, dtype, n, tp_group)


def _ilp_cost(cm: CostModel, layer: int, dtype: str, n: int, tp_group: tuple[int, ...]) -> LayerCost | None:
    """`tp_layer_cost` of a repeated block from the intra-op ILP (`LayerPricer.cost`); None without an answer
    (the ILP is switched off, or found none in time)."""
    pricer = cm.layer_pricer(dtype, tp_group)
    res = pricer.cost(layer, n) if pricer is not None else None
    if res is None:
        return None
    params = cm.graph.layers[layer].param_bytes
    return LayerCost(res.time_fwd - res.comm_fwd, res.time_bwd - res.comm_bwd, res.comm_fwd, res.comm_bwd,
                     res.param_bytes_per_device / params if params else 1 / len(tp_group),
                     res.activation_bytes_per_device, True,
                     tuple(res.sharding[name] for _, name in layer_params(cm.graph, cm.graph.layers[layer]))
                     if res.sharding else (), res.source)


def closed_form(cm: CostModel, layer: int, dtype: str, n: int, tp_group: tuple[int, ...]) -> LayerCost:
    """Megatron's closed form of one layer on a tensor-parallel group: every kernel split t ways, 2
    all-reduces of the block's output activation in forward and 2 in backward (1 + 1 around the blocks)."""
    tp = len(tp_group)
    fwd, bwd = cm.layer_compute(layer, dtype, n, tp)
    if tp == 1:
        return LayerCost(fwd, bwd, 0.0, 0.0)
    nbytes = (cm.boundary[layer] or cm.in_bytes[layer]) * n / cm.B
    ar = (2 if cm.is_block[layer] else 1) * cm.collective("all_reduce", nbytes, tp_group)
    if cm.tp_dp_sync == "shards":
        # pricing Megatron-LM's own runs (bench/measured.py): it shards every matmul weight of a block (a fused
        # QKV by heads) and the vocabulary tables, which autopar's runtime placements do not all do
        return LayerCost(fwd, bwd, ar, ar, 1 / tp)
    frac = cm.memoised(("megatron-param-frac", layer, tp), lambda: megatron_param_frac(
        cm.graph, layer, tp, cm.memoised(("loss-heads",), lambda: loss_heads(cm.graph))))
    return LayerCost(fwd, bwd, ar, ar, frac)


def megatron_param_frac(graph: TrainingGraph, layer: int, tp: int, heads: list[str] | None = None) -> float:
    """The share of layer `layer`'s own parameters a rank of `tp` holds under Megatron's placements, as the runtime
    places them (runtime/tensor_parallel.py `megatron_spec`): the sharded ones 1/tp, the rest whole (norms, biases
    of row-parallel linears, position and other tables not vocabulary-sized); 1/tp for a layer without
    parameters. `heads`: as in `megatron_placements`."""
    sharded = megatron_placements(graph, (layer, layer + 1), heads).params
    sizes = [(graph.params[p].meta.nbytes, name in sharded) for p, name in layer_params(graph, graph.layers[layer])]
    total = sum(b for b, _ in sizes)
    return sum(b / tp if s else b for b, s in sizes) / total if total else 1 / tp


def tp_reason(cm: CostModel, a: int, e: int, dtype: str, n: int, tp_group: tuple[int, ...]) -> str:
    """Why the blocks of layers [a, e) got their tensor-parallel price (a plan stage's `tp_reason`): the
    ILP's answer and which candidate won, with its time next to Megatron's closed form, or why the
    closed form was used. "" without tensor parallelism or blocks."""
    blocks = [i for i in range(a, e) if cm.is_block[i]]
    t = len(tp_group)
    if t < 2 or not blocks:
        return ""
    c, ideal = tp_layer_cost(cm, blocks[0], dtype, n, tp_group), closed_form(cm, blocks[0], dtype, n, tp_group)
    total = lambda x: x.fwd + x.bwd + x.fwd_comm + x.bwd_comm
    if not c.ilp:
        why = ("the intra-op ILP is switched off" if not cm.intra_op else
               f"the intra-op ILP found no solution within {cm.intra_op_time_limit_s:g} s")
        return (f"Megatron's closed form ({fmt_time(total(c))} per block and micro-batch): {why}; the runtime "
                f"runs Megatron's placements")
    picked = " = ".join(SOURCES[k] for k in c.source.split("+") if k in SOURCES) or SOURCES["ilp"]
    ratio = total(c) / total(ideal)
    layer = cm.graph.layers[blocks[0]]
    fused = any(fused_qkv(cm.graph, core) for core in attention_cores(cm.graph, layer.nodes))
    gap = (f"; the closed form splits every op {t} ways, the runtime replicates norms and elementwise ops"
           + (" and gathers the fused QKV's output" if fused else "") if ratio > 1.05 else "")
    return (f"intra-op ILP, {picked} (the fastest of the ILP's optimum, Megatron's placements and replicated "
            f"parameters, as the DTensor runtime runs them): {fmt_time(total(c))} per block and micro-batch, "
            f"{ratio:.2f}x Megatron's closed form {fmt_time(total(ideal))} (predictions{gap})")


def stage_sharding(cm: CostModel, a: int, e: int, dtype: str, n: int, tp_group: tuple[int, ...]
                   ) -> dict[str, str] | None:
    """`Stage.sharding` of layers [a, e): the ILP's parameter placements for every block, when all of them
    were priced by the ILP (tp_source "ilp"); else None (the runtime's Megatron placements, closed form)."""
    if len(tp_group) < 2 or not any(cm.is_block[a:e]) or cm.base(a, e, dtype, n, tp_group).moe_layers:
        return None  # (expert-parallel stages run Megatron's placements with their MoE adaptations)
    out: dict[str, str] = {}
    for i in range(a, e):
        if cm.is_block[i]:
            c, names = tp_layer_cost(cm, i, dtype, n, tp_group), layer_params(cm.graph, cm.graph.layers[i])
            if not c.ilp or len(c.sharding) != len(names):
                return None
            out.update(zip((name for _, name in names), c.sharding, strict=True))
    return out
