"""Building one layer's intra-op ILP (`intra_op` has the formulation): ops merged into groups with one choice
each (`merge_followers`), each group strategy's compute, own collectives, boundary resharding and memory
(`_group_costs`), the resharding matrices between groups (`_edge_costs`) and the shared reshardings
(`intra_op.shared`), into a `Problem` (`build_problem`, `build_layer_problem`).
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from ...cluster import Cluster
from ...errors import PlanError
from ...ir.graph import Layer, TrainingGraph
from .context import Context
from .problem import PS, Cost, Group, NodeStrategy, Problem
from .shared import shared_reshards
from .strategies import P, R


def merge_followers(ctx: Context, members: list[str]) -> list[Group]:
    """Group each op that can follow every layout its single producer emits with that producer."""
    graph = ctx.graph
    groups: list[Group] = []
    group_of: dict[str, Group] = {}
    for v in members:
        strategies = ctx.strategies(v)
        node = graph.nodes[v]
        u = node.args[0] if len(node.args) == 1 else None
        if u is not None and u in group_of:
            g = group_of[u]
            by_in: dict[int, NodeStrategy] = {}
            for s in strategies:
                by_in.setdefault(s.ins[u], s)
            produced = {c[u].base.out for c in g.choices}
            if all(x in by_in and by_in[x].grads[u] == (R if x == P else x) for x in produced):
                g.members.append(v)
                for c in g.choices:
                    c[v] = by_in[c[u].base.out]
                group_of[v] = g
                continue
        g = Group([v], [{v: s} for s in strategies])
        groups.append(g)
        group_of[v] = g
    return groups


def _group_costs(ctx: Context, layer: Layer, g: Group, inside: set[str], boundary: int,
                 first_use: dict[str, str], shared: Container[tuple[str, int, bool]] = ()) -> list[Cost]:
    """Compute, own collectives, boundary resharding and memory of each strategy of one group."""
    graph, tp = ctx.graph, ctx.tp
    saved = ctx.saved_by_layer.get(layer.index, set())
    owned = {m: [r for r in saved if r.split("#")[0] == m] for m in g.members}
    costs = []
    for choice in g.choices:
        c = Cost()
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


def _forced(ctx: Context, node: str, s: NodeStrategy) -> bool:
    """Whether the strategy may slice a replicated input: it shards one of its parameters (DTensor slices
    the input to match), or is an op of a head-parallel attention core, SDPA or matmul + softmax (the
    runtime re-lays the core's inputs out by heads, `tp_patterns.AttentionCore`). DTensor also slices a
    replicated input to match another, sharded one; that depends on two edges at once, so the ILP does not
    choose it (FORBIDDEN) and `runtime_choice` prices it."""
    core = ctx.cores.get(node)
    if core is not None and s.base.name != "R" and core.heads(s.ins):
        return True
    return any(layout >= 0 for a, layout in s.ins.items() if a in ctx.graph.params)


def _edge_costs(ctx: Context, gu: Group, gv: Group, shared: Container[tuple[str, int, bool]] = ()
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
    check_args(graph, [layer_index], tp, device_type, cluster, group)
    frac = (batch or graph.batch_size) / graph.batch_size
    return build_problem(Context(graph, tp, device_type, cluster, group, frac), graph.layers[layer_index], boundary)


def build_problem(ctx: Context, layer: Layer, boundary: int, choice: Sequence[int] | None = None) -> Problem:
    """The layer's ILP data; with `choice`, only those strategies (one per group: pricing a known answer)."""
    graph = ctx.graph
    members = [n for n in layer.nodes if graph.nodes[n].outputs]
    inside = set(members)
    first_use: dict[str, str] = {}  # owned parameter storage -> the first node reading it
    for m in members:
        for a in graph.nodes[m].args:
            if a in graph.params and (graph.params[a].tied_to or a) in layer.params:
                first_use.setdefault(graph.params[a].tied_to or a, m)
    groups = ctx.merged(members, merge_followers)
    if choice is not None:
        groups = [Group(g.members, [g.choices[i]]) for g, i in zip(groups, choice, strict=True)]
    index = {m: i for i, g in enumerate(groups) for m in g.members}
    found = shared_reshards(ctx, groups, index, boundary)
    shared = {k for k, _ in found}
    detail = [_group_costs(ctx, layer, g, inside, boundary, first_use, shared) for g in groups]
    edge_detail = {}
    for iv, gv in enumerate(groups):
        for iu in sorted({index[a] for a in gv.choices[0][gv.members[0]].ins if a in index}):
            edge_detail[iu, iv] = _edge_costs(ctx, groups[iu], gv, shared)
    edges = {k: [[round((f + b) * PS) for f, b in row] for row in m] for k, m in edge_detail.items()}
    const = Cost(act_bytes=sum(ctx.tensor_bytes(graph.input_meta[r]) for r in
                                ctx.saved_by_layer.get(layer.index, ()) if r in graph.input_meta))
    return Problem(groups, [[round(c.seconds * PS) for c in d] for d in detail],
                   [[round(c.state_bytes + c.act_bytes) for c in d] for d in detail], edges, detail,
                   edge_detail, const, [g for _, g in found])


def check_args(graph: TrainingGraph, layer_indices: Sequence[int], tp: int, device_type: str, cluster: Cluster,
               group: Sequence[int]) -> None:
    """PlanError naming the argument of an intra-op request that the graph or cluster cannot serve."""
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


__all__ = ["build_layer_problem", "build_problem", "check_args", "merge_followers"]
