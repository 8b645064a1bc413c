"""Planning graph workloads: detect them, price both modes, return a Plan with `plan.graph` set.

`autopar.plan` / `autopar.compile` route here when an example input is an integer (2, E) edge_index and the
model has message-passing layers (torch_geometric MessagePassing or autopar.models.GraphConv), or the model
is a temporal GNN (tgn.TGN).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..cluster import Cluster
from ..errors import InfeasibleError, PlanError
from ..plan import Pipeline, Plan, Stage
from ..report import fmt_bytes, fmt_time, render_table
from .cost import Candidate, GraphCostModel, GraphStats
from .layers import message_passing_layers
from .sampling import labelled_nodes

MODES = ("auto", "partition", "sampled_dp")
DEFAULTS = {"mode": "auto", "batch_size": None, "fanout": 10, "seed": 0}


def graph_kind(model: nn.Module, example_inputs: Any) -> str | None:
    """'graph' (node-level GNN on x, edge_index), 'temporal' (tgn.TGN) or None (not a graph workload)."""
    from .tgn import TGN

    if isinstance(model, TGN):
        return "temporal"
    inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    has_edges = any(isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] == 2 and not t.dtype.is_floating_point
                    and not t.dtype.is_complex for t in inputs)
    if has_edges and message_passing_layers(model):
        return "graph"
    return None


def split_inputs(example_inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, edge_index) of a graph model's inputs."""
    if len(example_inputs) != 2:
        raise PlanError(f"a graph model is called as model(x, edge_index); got {len(example_inputs)} example "
                        f"inputs.")
    x, edge_index = example_inputs
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise PlanError(f"edge_index must have shape (2, E), got {tuple(edge_index.shape)}.")
    return x, edge_index


def graph_stats(x: torch.Tensor, edge_index: torch.Tensor, target: Any) -> GraphStats:
    """Sizes of the graph; exact structure when the tensors hold data (not meta)."""
    real = not edge_index.is_meta
    if isinstance(target, torch.Tensor) and not target.is_meta:
        labelled = int(labelled_nodes(target).numel())
    else:
        labelled = int(x.shape[0])
    return GraphStats(int(x.shape[0]), int(edge_index.shape[1]), int(x.shape[1]) if x.dim() > 1 else 1, labelled,
                      edge_index if real else None, x.element_size())


def plan_graph(model: nn.Module, cluster: Cluster | str | dict, example_inputs: tuple = (),
               example_target: Any = None, optimizer: object = "adamw", precision: str | None = None, *,
               memory_reserve: float = 0.1, options: dict | None = None) -> Plan:
    """The faster of partitioned full-graph and sampled data-parallel training that fits memory.

    `options`: mode ("auto" | "partition" | "sampled_dp"), batch_size (seeds per sampled step; default
    min(labelled nodes, 1024 per device)), fanout (sampled in-edges per node, default 10), seed.
    """
    from ..api import default_precision

    opts = {**DEFAULTS, **(options or {})}
    unknown = set(opts) - set(DEFAULTS)
    if unknown or opts["mode"] not in MODES:
        raise PlanError(f"graph options {sorted(unknown) or opts['mode']!r} not understood; options are "
                        f"{sorted(DEFAULTS)} with mode in {MODES}.")
    cluster = Cluster.load(cluster)
    precision = precision or default_precision(cluster)
    x, edge_index = split_inputs(tuple(example_inputs))
    stats = graph_stats(x, edge_index, example_target)
    cost = GraphCostModel(model, stats, cluster, precision, optimizer, memory_reserve)
    batch = int(opts["batch_size"] or min(stats.labelled, 1024 * cluster.world_size))
    cands = {"partition": cost.partition(), "sampled_dp": cost.sampled_dp(batch, int(opts["fanout"]))}
    wanted = [m for m in cands if opts["mode"] in ("auto", m)]
    fitting = [cands[m] for m in wanted if cands[m].fits]
    if not fitting:
        raise InfeasibleError("no graph training mode fits memory: " + "; ".join(
            f"{m}: {', '.join(cands[m].problems)}" for m in wanted))
    best = max(fitting, key=lambda c: c.samples_per_s)
    return to_plan(model, cluster, cost, best, cands, opts, precision, memory_reserve)


def to_plan(model: nn.Module, cluster: Cluster, cost: GraphCostModel, best: Candidate,
            cands: dict[str, Candidate], opts: dict, precision: str, memory_reserve: float) -> Plan:
    s, L = cost.stats, cost.layers
    graph = {"mode": best.mode, "unit": "nodes" if best.mode == "partition" else "seeds",
             "num_nodes": s.num_nodes, "num_edges": s.num_edges, "features": s.features, "labelled": s.labelled,
             "layers": L, "shares": best.shares, "seed": int(opts["seed"]), "order": "bfs",
             "candidates": {m: c.summary() for m, c in cands.items()}}
    if best.mode == "sampled_dp":
        graph.update(batch_size=best.extra["batch_size"], fanout=best.extra["fanout"])
    else:
        graph.update(halo=best.extra["halo"], local_edges=best.extra["local_edges"])
    pipes = []
    for r, share in enumerate(best.shares):
        c = best.compute_s[r]
        pred = {"fwd_s": c / 3, "bwd_s": 2 * c / 3, "compute_s": c, "comm_s": best.comm_s,
                "sync_s": best.sync_s, "bubble_s": max(best.compute_s) - c}
        pipes.append(Pipeline(share, share, 1, [Stage([0, L], [r], predicted=pred)]))
    peak_flops = sum(d.spec.flops(precision) for d in cluster.devices)
    predicted = {"step_time_s": best.step_time_s, "samples_per_s": best.samples_per_s,
                 "tflops_per_device": best.flops / best.step_time_s / cluster.world_size / 1e12,
                 "mfu": best.flops / best.step_time_s / peak_flops,
                 "bubble_fraction": sum(max(best.compute_s) - c for c in best.compute_s)
                 / cluster.world_size / best.step_time_s,
                 "peak_memory_bytes": dict(enumerate(best.peak_memory_bytes)),
                 "memory_capacity_bytes": {d.index: d.spec.memory for d in cluster.devices}}
    names = [n for n, _ in message_passing_layers(model)]
    summary = {"name": type(model).__name__, "num_layers": L, "layer_names": names,
               "params": sum(p.numel() for p in model.parameters())}
    return Plan(best.samples_per_step, precision, cost.optimizer, "gpipe", 1, cluster.to_dict(), summary, pipes,
                predicted, memory_reserve, graph=graph)


def explain_graph(graph: dict) -> str:
    """The graph section of Plan.explain(): mode, per-rank shares, and both modes' predictions."""
    mode = graph.get("mode", "?")
    if mode == "temporal_dp":
        lines = [f"temporal graph: {graph.get('num_nodes', '?')} nodes; mode {mode}"]
    else:
        lines = [f"graph: {graph.get('num_nodes', '?')} nodes, {graph.get('num_edges', '?')} edges, "
                 f"{graph.get('labelled', '?')} labelled; mode {mode}"]
    if mode == "partition":
        lines[0] += (f" (each rank owns a {graph.get('order', 'bfs')}-ordered node range, halo exchange before "
                     f"each of {graph.get('layers')} message-passing layers)")
    elif mode == "sampled_dp":
        lines[0] += f" ({graph.get('batch_size')} seeds/step, fanout {graph.get('fanout')})"
    elif mode == "temporal_dp":
        lines[0] += f" ({graph.get('batch_size')} events/step split across ranks, node memory replicated)"
    cand = graph.get("candidates", {})
    chosen = cand.get(mode, {})
    if "shares" in graph:
        head = ["rank", graph.get("unit", "share"), "halo", "compute", "peak mem"]
        rows = [head]
        for r, share in enumerate(graph["shares"]):
            halo = graph.get("halo", [])
            rows.append([str(r), str(share), str(halo[r]) if r < len(halo) else "-",
                         fmt_time(chosen.get("compute_s", [0.0] * (r + 1))[r]) if chosen else "-",
                         fmt_bytes(chosen.get("peak_memory_bytes", [0] * (r + 1))[r]) if chosen else "-"])
        lines.append(render_table(rows, right={1, 2, 3, 4}))
    for m, c in cand.items():
        status = "fits" if c.get("fits") else "does not fit: " + "; ".join(c.get("problems", []))
        rate = f"{c['samples_per_s']:.4g} samples/s, {fmt_time(c['step_time_s'])}/step" if c.get("fits") else ""
        lines.append(f"  {m}{' (chosen)' if m == mode else ''}: {rate} {status}".rstrip())
    return "\n".join(lines)


__all__ = ["DEFAULTS", "MODES", "explain_graph", "graph_kind", "graph_stats", "plan_graph", "split_inputs", "to_plan"]
