"""Intra-operator parallelism for one pipeline stage: a sharding strategy per op, chosen by an ILP (Alpa).

The stage's `tp` devices form a 1-D mesh. Every op node gets a set of strategies (`intra_op_strategies`):
replicated, sharded along a dim, Megatron's column-/row-parallel matmuls, head-sharded attention,
vocab-parallel embedding and loss. Views, getitems and other ops that can follow every layout their
producer may emit are merged into that producer ("groups", `_merge_followers`), so the ILP has one choice
per group. Identical blocks (same signature and surroundings, `_Context.layer_key`) are solved once, and
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
                                   tensor u produces and reader v of it (`intra_op_shared`, _needed)

c[v,i] (`_group_costs`) is the compute time of the group's ops, forward + backward, re-priced with the
kernels' FLOPs and bytes divided by the split (launch overheads stay), plus the collectives the strategy
runs itself: an all-reduce of every replicated weight whose gradient is partial (batch-sharded ops), and
vocab-parallel cross-entropy's statistics. Reads of tensors from outside the layer (the boundary layout)
and writes to it are folded into c. r[u,v,i,j] (`_edge_costs`) is resharding u's output layout to the
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
activations), enumerated in `solve_intra_op`; CP-SAT solves each case (`intra_op_ilp`).

Micro-batch sizes: `solve_intra_op(batch=n)` (and `_Context.frac` = n / captured batch) re-prices every
kernel at n samples (FLOPs and bytes scaled, as `pricing.CostModel.layer_compute` does) and scales the
activations, their resharding collectives and the strategies' own collectives; parameters do not scale.
The planner prices tensor-parallel blocks through `intra_op_pricing.LayerPricer`, which solves at the
micro-batch size buckets and prices a known answer with `_build(..., choice)`; it solves in runtime mode
(`_Context.runtime`: only the strategies and reshardings the DTensor runtime performs; see intra_op_pricing).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Container, Sequence
from dataclasses import dataclass, field

from ..cluster import Cluster
from ..cost_models.comm import collective_time
from ..cost_models.compute import ComputeModel, kernel_flops
from ..cost_models.memory import state_bytes_per_param
from ..errors import InfeasibleError, PlanError
from ..graph import Layer, OpNode, TensorMeta, TrainingGraph
from ..passes.annotate import PRECISIONS
from ..passes.tp_patterns import attention_cores
from .intra_op_ilp import _STATS, solve_problems
from .intra_op_shared import PS, Shared, shared_reshards
from .intra_op_strategies import OpSpec, P, R, Strategy, enumerate_strategies, layout_name, op_spec

FORBIDDEN = 1.0  # seconds: the price of a resharding the runtime would not do (runtime mode)


@dataclass
class IntraOpResult:
    tp: int
    time_fwd: float  # seconds per global batch, compute + communication
    time_bwd: float
    comm_time: float  # the communication part of time_fwd + time_bwd
    param_bytes_per_device: float  # weights only, comparable to Layer.param_bytes
    activation_bytes_per_device: float  # saved for backward per global batch, like Layer.saved_bytes
    strategies: dict[str, str]  # node name -> strategy name
    comm_fwd: float = 0.0  # the communication parts of time_fwd and time_bwd
    comm_bwd: float = 0.0
    # model parameter name -> "replicate" | "shard(d)": what the runtime runs (intra_op_pricing, runtime mode)
    sharding: dict[str, str] | None = None
    source: str = ""  # LayerPricer: which candidate placements won (intra_op_pricing.SOURCES)


@dataclass
class _Cost:
    compute_fwd: float = 0.0
    compute_bwd: float = 0.0
    comm_fwd: float = 0.0
    comm_bwd: float = 0.0
    param_bytes: float = 0.0
    state_bytes: float = 0.0
    act_bytes: float = 0.0

    def add(self, other: _Cost, weight: float = 1.0) -> None:
        for k, v in vars(other).items():
            setattr(self, k, getattr(self, k) + weight * v)

    @property
    def seconds(self) -> float:
        return self.compute_fwd + self.compute_bwd + self.comm_fwd + self.comm_bwd


@dataclass(frozen=True)
class _NodeStrategy:
    """A Strategy with inputs keyed by argument name (an argument read twice must agree)."""

    base: Strategy
    ins: dict[str, int]
    grads: dict[str, int]


@dataclass
class _Group:
    members: list[str]  # root first
    choices: list[dict[str, _NodeStrategy]]  # per strategy of the root: member -> its strategy


@dataclass
class Problem:
    """One layer's ILP data: per group, per strategy costs; per group pair, resharding matrices; the
    gradient reductions shared by several readers (`Shared`)."""

    groups: list[_Group]
    cost: list[list[int]]  # picoseconds
    memory: list[list[int]]  # bytes
    edges: dict[tuple[int, int], list[list[int]]]
    detail: list[list[_Cost]]
    edge_detail: dict[tuple[int, int], list[list[tuple[float, float]]]]
    const: _Cost = field(default_factory=_Cost)
    shared: list[Shared] = field(default_factory=list)

    def objective(self, choice: Sequence[int]) -> int:
        return sum(c[i] for c, i in zip(self.cost, choice, strict=True)) + sum(
            m[choice[u]][choice[v]] for (u, v), m in self.edges.items()) + sum(
            round(g.paid(choice) * PS) for g in self.shared)

    @property
    def const_memory(self) -> int:
        return round(self.const.state_bytes + self.const.act_bytes)

    def memory_of(self, choice: Sequence[int]) -> int:
        return self.const_memory + sum(
            m[i] for m, i in zip(self.memory, choice, strict=True))

    def breakdown(self, choice: Sequence[int]) -> _Cost:
        total = _Cost()
        total.add(self.const)
        for d, i in zip(self.detail, choice, strict=True):
            total.add(d[i])
        for (u, v), m in self.edge_detail.items():
            f, b = m[choice[u]][choice[v]]
            total.comm_fwd += f
            total.comm_bwd += b
        total.comm_fwd += sum(g.paid(choice) for g in self.shared if not g.backward)
        total.comm_bwd += sum(g.paid(choice) for g in self.shared if g.backward)
        return total

    def names(self, choice: Sequence[int]) -> dict[str, str]:
        out = {}
        for g, i in zip(self.groups, choice, strict=True):
            for m, s in g.choices[i].items():
                out[m] = s.base.name if m == g.members[0] else layout_name(s.base.out)
        return out


@dataclass(frozen=True)
class _Solution:
    objective: int
    memory: int
    cost: _Cost
    names: tuple[str, ...]  # by position in the layer's node list ("" for nodes without outputs)


_CACHE: dict[tuple, tuple[_Solution, ...]] = {}


def cache_info() -> dict[str, int]:
    """Counters of the solution cache: ILP solves run, cache hits and misses (per layer signature)."""
    return {**_STATS, "entries": len(_CACHE)}


def clear_cache() -> None:
    _CACHE.clear()
    for k in _STATS:
        _STATS[k] = 0


# ---- problem construction -------------------------------------------------------------------------


class _Context:
    """Everything one (graph, mesh, device type) needs, with memo tables for op strategies and collectives."""

    def __init__(self, graph: TrainingGraph, tp: int, device_type: str, cluster: Cluster,
                 group: Sequence[int], frac: float = 1.0, runtime: bool = False) -> None:
        self.graph, self.tp, self.device_type = graph, tp, device_type
        self.runtime = runtime  # only what the DTensor runtime runs as priced (`reshard`, `strategies`)
        self.forbid = runtime  # price the reshardings the runtime would not do FORBIDDEN (off: a known answer)
        self.frac = frac  # micro-batch / captured batch: activations, FLOPs and their bytes scale by it
        self.cluster, self.group = cluster, tuple(group)
        self.model = ComputeModel(cluster.spec(device_type), dtype=graph.dtype)
        self.scale = PRECISIONS.get(graph.dtype, 4) / 4
        self.state = state_bytes_per_param("adamw", graph.dtype)
        self.fx = {n.name: n for n in graph.gm.graph.nodes} if graph.gm is not None else {}
        self.consumers: dict[str, list[str]] = {}
        self.saved_by_layer: dict[int, set[str]] = {}
        for n in graph.nodes.values():
            for a in n.args:
                self.consumers.setdefault(a, []).append(n.name)
            for r in n.saved:
                base = r.split("#")[0]
                if base in graph.params:
                    continue
                home = graph.nodes[base].layer if base in graph.nodes else 0
                self.saved_by_layer.setdefault(home, set()).add(r)
        self._strategies: dict[str, list[_NodeStrategy]] = {}
        self._comm: dict[tuple, float] = {}
        # node -> the attention core it belongs to (SDPA, or the two matmuls of matmul + softmax attention)
        self.cores = {m: c for c in attention_cores(graph, graph.nodes) for m in c.nodes}

    # -- tensors
    def meta(self, name: str) -> TensorMeta:
        g = self.graph
        if name in g.nodes:
            return g.nodes[name].outputs[0]
        return g.params[name].meta if name in g.params else g.input_meta[name]

    def tensor_bytes(self, meta: TensorMeta) -> float:
        """Bytes of an activation (never called on parameters) at the micro-batch."""
        return meta.nbytes * self.frac * (self.scale if meta.dtype.startswith(("float", "bfloat")) else 1.0)

    def needs_grad(self, name: str) -> bool:
        return name in self.graph.nodes and self.graph.nodes[name].requires_grad

    def boundary_layout(self, name: str, boundary: int) -> int:
        meta = self.meta(name)
        ok = (boundary != R and len(meta.shape) > boundary and meta.shape[0] == self.graph.batch_size
              and meta.shape[boundary] % self.tp == 0 and meta.dtype.startswith(("float", "bfloat")))
        return boundary if ok else R

    # -- costs
    def collective(self, kind: str, nbytes: float) -> float:
        key = (kind, nbytes)
        if key not in self._comm:
            self._comm[key] = float(collective_time(kind, nbytes, self.group, self.cluster))
        return self._comm[key]

    def reshard(self, src: int, dst: int, nbytes: float, forced: bool | None = None,
                takes: Container[int] = ()) -> float:
        """Seconds to turn layout `src` into `dst`. For an op's input (`forced` given) in runtime mode, the
        transitions DTensor does not make before an op cost FORBIDDEN: a partial sum or a shard into another
        shard (it replicates them), a slice of a replicated input unless the op needs it (`_forced`), and
        gathering a shard or partial sum the op can take as it is (`takes`)."""
        if self.forbid and forced is not None and src != dst and (
                (dst >= 0 and (src != R or not forced)) or (dst == R and src != R and src in takes)):
            return FORBIDDEN
        if src == dst or src == R or dst == P:
            return 0.0
        if src == P:
            return self.collective("all_reduce" if dst == R else "reduce_scatter", nbytes)
        if dst == R:
            return self.collective("all_gather", nbytes)
        return self.collective("all_to_all", nbytes / self.tp)  # each rank sends its slice

    def compute(self, node: OpNode, split_fwd: int, split_bwd: int) -> tuple[float, float]:
        def priced(kernels: list, base: dict[str, float], split: int) -> float:
            if split == 1 and self.frac == 1:
                return base.get(self.device_type, 0.0)
            scale = self.frac / split
            return sum(self.model.op_time(k.kind, kernel_flops(k) * scale, k.nbytes * scale) for k in kernels)

        return (priced(node.kernels_fwd, node.time_fwd, split_fwd),
                priced(node.kernels_bwd, node.time_bwd, split_bwd))

    # -- strategies
    def strategies(self, name: str) -> list[_NodeStrategy]:
        if name not in self._strategies:
            spec, names = self.op_spec(name)
            found = []
            for s in enumerate_strategies(spec, self.tp, self.runtime):
                ins: dict[str, int] = {}
                grads: dict[str, int] = {}
                if all(ins.setdefault(a, x) == x for a, x in zip(names, s.ins, strict=True)):
                    for a, gl in zip(names, s.in_grads, strict=True):
                        grads[a] = P if P in (gl, grads.get(a)) else gl
                    found.append(_NodeStrategy(s, ins, grads))
            self._strategies[name] = found
        return self._strategies[name]

    def op_spec(self, name: str) -> tuple[OpSpec, list[str]]:
        return op_spec(self.graph.nodes[name], self.fx.get(name), self.meta, set(self.graph.params))

    def layer_key(self, layer: Layer) -> tuple:
        """Everything the layer's problem depends on but the boundary layout, positionally (node names
        differ between identical blocks)."""
        g, pos = self.graph, {n: i for i, n in enumerate(layer.nodes)}
        h = hashlib.sha1()
        for name in layer.nodes:
            n = g.nodes[name]
            args = []
            for a in n.args:
                if a in pos:
                    args.append(("L", pos[a]))
                elif a in g.params:
                    p = g.params[a]
                    args.append(("W", p.meta, p.is_buffer, (p.tied_to or a) in layer.params))
                else:
                    args.append(("X", self.meta(a), self.needs_grad(a), a in g.nodes))
            spec = self.op_spec(name)[0] if n.outputs else None
            h.update(repr((n.target, n.outputs, args, spec and (spec.args, spec.kwargs),
                           n.time_fwd.get(self.device_type), n.time_bwd.get(self.device_type),
                           n.requires_grad, n.saved_internal_bytes, self.leaves(name, pos))).encode())
        saved = sorted((pos[r.split("#")[0]], r.partition("#")[2]) if r.split("#")[0] in pos else (-1, r)
                       for r in self.saved_by_layer.get(layer.index, ()))
        h.update(repr(saved).encode())
        spec = self.cluster.spec(self.device_type)
        ring = zip(self.group, self.group[1:] + self.group[:1], strict=True)
        links = tuple(self.cluster.link(a, b) for a, b in ring)
        nodes = [self.cluster.devices[i].node for i in self.group]
        return (h.hexdigest(), self.tp, self.frac, self.runtime, self.graph.dtype, repr(spec), links, tuple(nodes),
                tuple(self.cluster.nodes[i].intra_node for i in nodes), self.cluster.network)

    def leaves(self, name: str, inside: Container[str]) -> bool:
        """Whether a node's output is read outside `inside` (so it is written in the boundary layout)."""
        return any(c not in inside and self.graph.nodes[c].outputs for c in self.consumers.get(name, ()))

    def boundary_key(self, layer: Layer, boundary: int) -> tuple[int, ...]:
        """Layouts of the tensors crossing the layer's boundary, in node order."""
        inside = set(layer.nodes)
        ext = [a for n in layer.nodes for a in self.graph.nodes[n].args
               if a not in inside and a in self.graph.nodes]
        out = [n for n in layer.nodes if self.graph.nodes[n].outputs and self.leaves(n, inside)]
        return tuple(self.boundary_layout(a, boundary) for a in ext + out)


def _merge_followers(ctx: _Context, members: list[str]) -> list[_Group]:
    """Group each op that can follow every layout its single producer emits with that producer."""
    graph = ctx.graph
    groups: list[_Group] = []
    group_of: dict[str, _Group] = {}
    for v in members:
        strategies = ctx.strategies(v)
        node = graph.nodes[v]
        u = node.args[0] if len(node.args) == 1 else None
        if u is not None and u in group_of:
            g = group_of[u]
            by_in: dict[int, _NodeStrategy] = {}
            for s in strategies:
                by_in.setdefault(s.ins[u], s)
            produced = {c[u].base.out for c in g.choices}
            if all(x in by_in and by_in[x].grads[u] == (R if x == P else x) for x in produced):
                g.members.append(v)
                for c in g.choices:
                    c[v] = by_in[c[u].base.out]
                group_of[v] = g
                continue
        g = _Group([v], [{v: s} for s in strategies])
        groups.append(g)
        group_of[v] = g
    return groups


def _group_costs(ctx: _Context, layer: Layer, g: _Group, inside: set[str], boundary: int,
                 first_use: dict[str, str], shared: Container[tuple[str, int, bool]] = ()) -> list[_Cost]:
    """Compute, own collectives, boundary resharding and memory of each strategy of one group."""
    graph, tp = ctx.graph, ctx.tp
    saved = ctx.saved_by_layer.get(layer.index, set())
    owned = {m: [r for r in saved if r.split("#")[0] == m] for m in g.members}
    costs = []
    for choice in g.choices:
        c = _Cost()
        for m, s in choice.items():
            node = graph.nodes[m]
            f, b = ctx.compute(node, s.base.split_fwd, s.base.split_bwd)
            c.compute_fwd += f
            c.compute_bwd += b
            c.comm_fwd += sum(ctx.collective(kind, nbytes * ctx.frac) for kind, nbytes in s.base.comm_fwd)
            c.comm_fwd += sum(ctx.collective(kind, ctx.tensor_bytes(node.outputs[i])) for kind, i in s.base.comm_out)
            partial_grads = 0.0  # bytes of replicated weights whose gradients are partial: one all-reduce
            forced = _forced(ctx, m, s)
            for a, layout in s.ins.items():
                if a in graph.params:
                    p = graph.params[a]
                    shard = tp if layout >= 0 else 1
                    if first_use.get(p.tied_to or a) == m:  # the storage, once, in the layer that owns it
                        c.param_bytes += p.meta.nbytes / shard if not p.is_buffer else 0.0
                        per_param = p.meta.nbytes if p.is_buffer else p.meta.numel * ctx.state.total
                        c.state_bytes += per_param / shard
                    if s.grads[a] == P and not p.is_buffer:
                        partial_grads += p.meta.numel * ctx.state.grads / shard
                elif a not in inside:  # read from another layer (boundary layout) or a graph input (R)
                    src = ctx.boundary_layout(a, boundary) if a in graph.nodes else R
                    nbytes = ctx.tensor_bytes(ctx.meta(a))
                    if (a, layout, False) not in shared:  # (else paid once, in a Shared)
                        c.comm_fwd += ctx.reshard(src, layout, nbytes, forced)
                    if ctx.needs_grad(a) and (a, s.grads[a], True) not in shared:
                        c.comm_bwd += ctx.reshard(s.grads[a], src, nbytes)
            if partial_grads:
                c.comm_bwd += ctx.collective("all_reduce", partial_grads)
            out = s.base.out
            shard = tp if out >= 0 else 1
            for r in owned[m]:
                idx = int(r.partition("#")[2] or 0)
                c.act_bytes += ctx.tensor_bytes(node.outputs[idx]) / shard
            c.act_bytes += node.saved_internal_bytes * ctx.frac / s.base.split_fwd
            if ctx.leaves(m, inside):
                dst = ctx.boundary_layout(m, boundary)
                nbytes = ctx.tensor_bytes(node.outputs[0])
                c.comm_fwd += ctx.reshard(out, dst, nbytes)
                if node.requires_grad:
                    c.comm_bwd += ctx.reshard(dst, R if out == P else out, nbytes)
        costs.append(c)
    return costs


def _forced(ctx: _Context, node: str, s: _NodeStrategy) -> bool:
    """Whether the strategy may slice a replicated input: it shards one of its parameters (DTensor slices
    the input to match), or is an op of a head-parallel attention core, SDPA or matmul + softmax (the
    runtime re-lays the core's inputs out by heads, `tp_patterns.AttentionCore`). DTensor also slices a
    replicated input to match another, sharded one; that depends on two edges at once, so the ILP does not
    choose it (FORBIDDEN) and `runtime_choice` prices it."""
    core = ctx.cores.get(node)
    if core is not None and s.base.name != "R" and core.heads(s.ins):
        return True
    return any(layout >= 0 for a, layout in s.ins.items() if a in ctx.graph.params)


def _edge_costs(ctx: _Context, gu: _Group, gv: _Group, shared: Container[tuple[str, int, bool]] = ()
                ) -> list[list[tuple[float, float]]]:
    """(forward, backward) seconds of resharding every tensor group v's root reads from group u, but the
    `shared` ones ((tensor, layout, backward): paid once, in a Shared)."""
    root = gv.members[0]
    reads = [a for a in gv.choices[0][root].ins if a in gu.choices[0]]
    takes = {a: {c[root].ins[a] for c in gv.choices} for a in reads}
    out = []
    for cu in gu.choices:
        row = []
        for cv in gv.choices:
            f = b = 0.0
            s = cv[root]
            forced = _forced(ctx, root, s)
            for a in reads:
                src, nbytes = cu[a].base.out, ctx.tensor_bytes(ctx.graph.nodes[a].outputs[0])
                if (a, s.ins[a], False) not in shared:
                    f += ctx.reshard(src, s.ins[a], nbytes, forced, takes[a])
                if ctx.needs_grad(a) and (a, s.grads[a], True) not in shared:
                    b += ctx.reshard(s.grads[a], R if src == P else src, nbytes)
            row.append((f, b))
        out.append(row)
    return out


def build_layer_problem(graph: TrainingGraph, layer_index: int, tp: int, device_type: str, cluster: Cluster,
                        group: Sequence[int], boundary: int = R, batch: int | None = None) -> Problem:
    """The ILP data of one layer, with tensors crossing its boundary in layout `boundary` (R, 0 or 1), for
    `batch` samples (default the captured batch)."""
    _check(graph, [layer_index], tp, device_type, cluster, group)
    frac = (batch or graph.batch_size) / graph.batch_size
    return _build(_Context(graph, tp, device_type, cluster, group, frac), graph.layers[layer_index], boundary)


def _build(ctx: _Context, layer: Layer, boundary: int, choice: Sequence[int] | None = None) -> Problem:
    """The layer's ILP data; with `choice`, only those strategies (one per group: pricing a known answer)."""
    graph = ctx.graph
    members = [n for n in layer.nodes if graph.nodes[n].outputs]
    inside = set(members)
    first_use: dict[str, str] = {}  # owned parameter storage -> the first node reading it
    for m in members:
        for a in graph.nodes[m].args:
            if a in graph.params and (graph.params[a].tied_to or a) in layer.params:
                first_use.setdefault(graph.params[a].tied_to or a, m)
    groups = _merge_followers(ctx, members)
    if choice is not None:
        groups = [_Group(g.members, [g.choices[i]]) for g, i in zip(groups, choice, strict=True)]
    index = {m: i for i, g in enumerate(groups) for m in g.members}
    found = shared_reshards(ctx, groups, index, boundary)
    shared = {k for k, _ in found}
    detail = [_group_costs(ctx, layer, g, inside, boundary, first_use, shared) for g in groups]
    edge_detail = {}
    for iv, gv in enumerate(groups):
        for iu in sorted({index[a] for a in gv.choices[0][gv.members[0]].ins if a in index}):
            edge_detail[iu, iv] = _edge_costs(ctx, groups[iu], gv, shared)
    edges = {k: [[round((f + b) * PS) for f, b in row] for row in m] for k, m in edge_detail.items()}
    const = _Cost(act_bytes=sum(ctx.tensor_bytes(graph.input_meta[r]) for r in
                                ctx.saved_by_layer.get(layer.index, ()) if r in graph.input_meta))
    return Problem(groups, [[round(c.seconds * PS) for c in d] for d in detail],
                   [[round(c.state_bytes + c.act_bytes) for c in d] for d in detail], edges, detail,
                   edge_detail, const, [g for _, g in found])


# ---- entry point ------------------------------------------------------------------------------------


def _solution(prob: Problem, layer: Layer, choice: Sequence[int]) -> _Solution:
    names = prob.names(choice)
    return _Solution(prob.objective(choice), prob.memory_of(choice), prob.breakdown(choice),
                     tuple(names.get(n, "") for n in layer.nodes))


def _check(graph: TrainingGraph, layer_indices: Sequence[int], tp: int, device_type: str, cluster: Cluster,
           group: Sequence[int]) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise PlanError(f"tp must be a positive integer, got {tp!r}.")
    if len(group) != tp:
        raise PlanError(f"the tensor-parallel group must list tp={tp} device indices, got {list(group)}.")
    if device_type not in graph.device_types:
        raise PlanError(f"the graph has no times for device type {device_type!r} (it has "
                        f"{graph.device_types}); annotate it with a cluster that contains that type.")
    if device_type not in cluster.device_types():
        raise PlanError(f"device type {device_type!r} is not in cluster {cluster.name!r}.")
    bad = [i for i in layer_indices if not 0 <= i < len(graph.layers)]
    if bad or not layer_indices:
        raise PlanError(f"layer indices {bad or 'none given'} are not in 0..{len(graph.layers) - 1}.")


def solve_intra_op(graph: TrainingGraph, layer_indices: Sequence[int], tp: int, device_type: str,
                   cluster: Cluster, group: Sequence[int], memory_budget: float | None = None,
                   time_limit_s: float = 10.0, batch: int | None = None) -> IntraOpResult:
    """Best per-op sharding of `graph.layers[layer_indices]` over the `tp` devices `group` of `cluster`.

    Times are for `batch` samples (default: the graph's captured global batch; the kernels' FLOPs and bytes,
    activations and their collectives scale with it) on `device_type`; `memory_budget` bounds the bytes per
    device of parameter training state (AdamW) plus saved activations. Raises InfeasibleError when no
    strategy fits the budget.
    """
    _check(graph, layer_indices, tp, device_type, cluster, group)
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise PlanError(f"batch must be a positive integer, got {batch!r}.")
    layers = [graph.layers[i] for i in layer_indices]
    if tp == 1 and batch in (None, graph.batch_size):
        return _unsharded(graph, layers, device_type, memory_budget)
    ctx = _Context(graph, tp, device_type, cluster, group, (batch or graph.batch_size) / graph.batch_size)
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
            best = (objective, _result(tp, layers, keys, sols))
    if best is None:
        raise InfeasibleError(
            f"layers {list(layer_indices)} need at least {min_memory / 2**30:.2f} GiB per device at tp={tp} "
            f"(AdamW state + saved activations), over the budget of {memory_budget / 2**30:.2f} GiB; "
            f"raise tp, use fewer layers per stage or a smaller micro-batch.")
    return best[1]


def _solve_cached(ctx: _Context, keys: tuple, layers: list[Layer], weights: list[int], boundary: int,
                  budget: float | None, time_limit_s: float) -> tuple[_Solution, ...]:
    key = (keys, tuple(weights), budget)
    if key in _CACHE:
        _STATS["hits"] += 1
        return _CACHE[key]
    _STATS["misses"] += 1
    probs = [_build(ctx, layer, boundary) for layer in layers]
    choices = solve_problems(list(zip(probs, weights, strict=True)), budget, time_limit_s)
    _CACHE[key] = tuple(_solution(p, layer, c) for p, layer, c in zip(probs, layers, choices, strict=True))
    return _CACHE[key]


def _min_memory(ctx: _Context, reps: dict[tuple, Layer], counts: Counter, boundary: int) -> float:
    total = 0.0
    for k, layer in reps.items():
        prob = _build(ctx, layer, boundary)
        total += counts[k] * (prob.const_memory + sum(min(m) for m in prob.memory))
    return total


def _result(tp: int, layers: list[Layer], keys: list[tuple], sols: dict[tuple, _Solution]) -> IntraOpResult:
    total = _Cost()
    names: dict[str, str] = {}
    for layer, k in zip(layers, keys, strict=True):
        total.add(sols[k].cost)
        names.update((n, s) for n, s in zip(layer.nodes, sols[k].names, strict=True) if s)
    return IntraOpResult(tp, total.compute_fwd + total.comm_fwd, total.compute_bwd + total.comm_bwd,
                         total.comm_fwd + total.comm_bwd, total.param_bytes, total.act_bytes, names,
                         total.comm_fwd, total.comm_bwd)


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


__all__ = ["IntraOpResult", "Problem", "build_layer_problem", "cache_info", "clear_cache",
           "solve_intra_op", "solve_problems"]
