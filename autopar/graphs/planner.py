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

# partition: full-graph training, the model as written (the default). sampled_dp: mini-batch training on
# sampled neighbourhoods, a different estimator, only when graph_options asks for it.
MODES = ("partition", "sampled_dp")
DEFAULTS = {"mode": "partition", "batch_size": None, "fanout": 10, "seed": 0}


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
    """The plan of the training the user asked for, on the devices and shares the cost model prices fastest.

    `options` (graph_options): mode "partition" (default) trains on the full graph as the model is written:
    each rank owns a node range and exchanges halo rows before every message-passing layer, so losses and
    gradients equal one process's full-graph training. mode "sampled_dp" is mini-batch training on sampled
    neighbourhoods (a different estimator, only on request): each step takes batch_size labelled seeds
    (default min(labelled nodes, 1024 per device)), every node aggregates at most `fanout` (default 10)
    in-neighbours drawn per step from `seed`; it equals one process training model(x, sampled_graph(...)) on
    the same seeds (sampling.py). Both modes are priced (`plan.graph["candidates"]`); only the requested one
    is considered.
    """
    from ..api import resolve_precision

    given = dict(options or {})
    opts = {**DEFAULTS, **given}
    unknown = set(opts) - set(DEFAULTS)
    if unknown or opts["mode"] not in MODES:
        hint = (" ('auto' no longer exists: the planner does not swap full-graph training for sampled mini-batch "
                "training, a different algorithm; ask for 'sampled_dp' explicitly)" if opts["mode"] == "auto"
                else "")
        raise PlanError(f"graph options {sorted(unknown) or opts['mode']!r} not understood; options are "
                        f"{sorted(DEFAULTS)} with mode in {MODES}{hint}.")
    cluster = Cluster.load(cluster)
    precision = resolve_precision(cluster, precision)
    x, edge_index = split_inputs(tuple(example_inputs))
    stats = graph_stats(x, edge_index, example_target)
    cost = GraphCostModel(model, stats, cluster, precision, optimizer, memory_reserve)
    batch = int(opts["batch_size"] or min(stats.labelled, 1024 * cluster.world_size))
    cands = {"partition": cost.partition(), "sampled_dp": cost.sampled_dp(batch, int(opts["fanout"]))}
    best = cands[opts["mode"]]
    if not best.fits:
        other = "sampled_dp" if best.mode == "partition" else "partition"
        alt = (f" {other} would fit, but it trains a different algorithm; ask for it with "
               f"graph_options={{'mode': {other!r}}} if that is what you want." if cands[other].fits else "")
        raise InfeasibleError(f"graph training mode {best.mode} does not fit memory: {', '.join(best.problems)}."
                              + alt)
    return to_plan(model, cluster, cost, best, cands, opts, precision, memory_reserve)


def to_plan(model: nn.Module, cluster: Cluster, cost: GraphCostModel, best: Candidate,
            cands: dict[str, Candidate], opts: dict, precision: str, memory_reserve: float) -> Plan:
    s, L = cost.stats, cost.layers
    graph = {"mode": best.mode, "unit": "nodes" if best.mode == "partition" else "seeds",
             "num_nodes": s.num_nodes, "num_edges": s.num_edges, "features": s.features, "labelled": s.labelled,
             "layers": L, "shares": best.shares, "seed": int(opts["seed"]), "order": "bfs",
             "candidates": {m: c.summary() for m, c in cands.items()}, "idle": best.extra.get("idle", [])}
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
        lines[0] += (f" (full-graph training, the model as written: each rank owns a {graph.get('order', 'bfs')}"
                     f"-ordered node range, halo exchange before each of {graph.get('layers')} message-passing "
                     f"layers)")
    elif mode == "sampled_dp":
        lines[0] += f" ({graph.get('batch_size')} seeds/step, fanout {graph.get('fanout')})"
        lines.append(f"sampled mini-batch training with fanout {graph.get('fanout')}: a different estimator than "
                     f"full-graph training (each step trains {graph.get('batch_size')} seeds, every node "
                     f"aggregating at most {graph.get('fanout')} in-neighbours sampled per step with seed "
                     f"{graph.get('seed')}); it equals one process training model(x, sampled_graph(...)) on the "
                     f"same seeds, not full-graph training. Asked for with graph_options mode='sampled_dp'.")
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
    lines += idle_lines(graph.get("idle", []), graph.get("unit", "share"))
    for m, c in cand.items():
        status = "fits" if c.get("fits") else "does not fit: " + "; ".join(c.get("problems", []))
        rate = f"{c['samples_per_s']:.4g} samples/s, {fmt_time(c['step_time_s'])}/step" if c.get("fits") else ""
        tag = " (chosen)" if m == mode else (
            " (not considered: a different algorithm than the one asked for; graph_options "
            f"mode={m!r} asks for it)" if mode in MODES else "")
        lines.append(f"  {m}{tag}: {rate} {status}".rstrip())
    return "\n".join(lines)


def _count(n: int, unit: str) -> str:
    return f"{n} {unit[:-1] if n == 1 and unit.endswith('s') else unit}"


def idle_lines(idle: list[dict], unit: str) -> list[str]:
    """One line per device type and reason for the devices the plan gives a zero share, in the cost model's
    numbers (GraphCostModel._idle)."""
    groups: dict[tuple, list[dict]] = {}
    for i in idle:
        groups.setdefault((i["type"], i["why"]), []).append(i)
    lines = []
    for (kind, why), members in groups.items():
        ids = ", ".join(str(i["device"]) for i in members)
        head = f"{kind} device{'s' if len(members) > 1 else ''} {ids} get{'' if len(members) > 1 else 's'} no {unit}"
        i = members[0]
        if why == "memory":
            lines.append(f"{head}: not enough memory for a single one (holds at most {i['cap']})")
        elif why == "too_small":
            lines.append(f"{head}: there is too little work to split")
        elif why == "no_gain":
            lines.append(f"{head}: giving {'them' if len(members) > 1 else 'it'} work does not make the step "
                         f"faster (device {i['device']} with {_count(i['share'], unit)}: {fmt_time(i['step_s'])}/step "
                         f"against {fmt_time(i['chosen_step_s'])}): the step is bound by costs paid whatever the "
                         f"share (kernel launches: {fmt_time(i['busiest_fixed_s'])} of device {i['busiest']}'s "
                         f"{fmt_time(i['chosen_compute_s'])} compute) and by the exchanges every rank joins")
        elif why == "balance":
            lines.append(f"{head}: the balancer's per-rank time model (fixed + per item) left it out, though "
                         f"giving device {i['device']} {_count(i['share'], unit)} prices "
                         f"{fmt_time(i['step_s'])}/step against {fmt_time(i['chosen_step_s'])}")
        else:
            if i["own_compute_s"] >= i["chosen_compute_s"]:
                cause = (f"its compute for them, {fmt_time(i['own_compute_s'])} (of which "
                         f"{fmt_time(i['fixed_s'])} is paid whatever the share: kernel launches), exceeds the "
                         f"{fmt_time(i['chosen_compute_s'])} the working ranks take")
            elif i["comm_s"] > i["chosen_comm_s"]:
                cause = (f"the halo exchange grows from {fmt_time(i['chosen_comm_s'])} to {fmt_time(i['comm_s'])}, "
                         f"more than its compute saves ({fmt_time(i['chosen_compute_s'])} -> "
                         f"{fmt_time(i['compute_s'])})")
            else:
                cause = f"the busiest rank's compute goes to {fmt_time(i['compute_s'])}"
            lines.append(f"{head}: adding {'them' if len(members) > 1 else 'it'} makes the step slower (device "
                         f"{i['device']} with {_count(i['share'], unit)}: {fmt_time(i['step_s'])}/step instead of "
                         f"{fmt_time(i['chosen_step_s'])}; {cause})")
    return lines


__all__ = ["DEFAULTS", "MODES", "explain_graph", "graph_kind", "graph_stats", "idle_lines", "plan_graph",
           "split_inputs", "to_plan"]
