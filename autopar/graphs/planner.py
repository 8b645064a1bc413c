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
from ..ir.plan import Pipeline, Plan, Stage
from .cost import Candidate, GraphCostModel, GraphStats
from .layers import message_passing_layers
from .sampling import labelled_nodes

# partition: full-graph training, the model as written (the default). sampled_dp: mini-batch training on
# sampled neighbourhoods, a different estimator, only when graph_options asks for it. sampled_pipeline: the same
# sampled algorithm with a division of labour (cpu ranks sample and gather, accelerator ranks train), on request.
GRAPH_MODES = ("partition", "sampled_dp", "sampled_pipeline")
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
               memory_reserve: float = 0.1, options: dict | None = None, profiles: dict | None = None) -> Plan:
    """The plan of the training the user asked for, on the devices and shares the cost model prices fastest.

    `options` (graph_options): mode "partition" (default) trains on the full graph as the model is written:
    each rank owns a node range and exchanges halo rows before every message-passing layer, so losses and
    gradients equal one process's full-graph training. mode "sampled_dp" is mini-batch training on sampled
    neighbourhoods (a different estimator, only on request): each step takes batch_size labelled seeds
    (default min(labelled nodes, 1024 per device)), every node aggregates at most `fanout` (default 10)
    in-neighbours drawn per step from `seed`; it equals one process training model(x, sampled_graph(...)) on
    the same seeds (sampling.py). mode "sampled_pipeline" trains the same sampled algorithm (same options, the
    same one-process equivalent) with a division of labour on a cluster with cpu devices beside accelerators:
    the cpu ranks sample each step's mini-batches and gather their features, the accelerator ranks receive them
    and train data parallel among themselves, sampling step k + 1 while they train step k. The modes are priced
    (`plan.graph["candidates"]`); only the requested one is considered.
    """
    from ..ir.precision import resolve_precision

    given = dict(options or {})
    opts = {**DEFAULTS, **given}
    unknown = set(opts) - set(DEFAULTS)
    temporal = sorted(unknown & {"staleness", "max_staleness", "memory_ranks"})
    if temporal or str(opts["mode"]).startswith("temporal"):
        raise PlanError(f"graph_options {temporal or opts['mode']!r} apply to temporal GNNs (autopar.graphs.TGN, "
                        f"mode 'temporal_pipeline'); this is a node-level GNN ({type(model).__name__}): drop them, "
                        f"or use mode in {GRAPH_MODES}.")
    if unknown or opts["mode"] not in GRAPH_MODES:
        hint = (" ('auto' no longer exists: the planner does not swap full-graph training for sampled mini-batch "
                "training, a different algorithm; ask for 'sampled_dp' explicitly)" if opts["mode"] == "auto"
                else "")
        raise PlanError(f"graph options {sorted(unknown) or opts['mode']!r} not understood; options are "
                        f"{sorted(DEFAULTS)} with mode in {GRAPH_MODES}{hint}.")
    cluster = Cluster.load(cluster)
    precision = resolve_precision(cluster, precision)
    x, edge_index = split_inputs(tuple(example_inputs))
    stats = graph_stats(x, edge_index, example_target)
    cost = GraphCostModel(model, stats, cluster, precision, optimizer, memory_reserve, profiles)
    batch = int(opts["batch_size"] or min(stats.labelled, 1024 * cluster.world_size))
    if opts["mode"] == "sampled_pipeline":
        samplers, trainers = cost.pipeline_roles()  # PlanError naming the fix on a cluster without both kinds
        batch = int(opts["batch_size"] or min(stats.labelled, 1024 * len(trainers)))
    cands = {"partition": cost.partition(), "sampled_dp": cost.sampled_dp(batch, int(opts["fanout"]))}
    kinds = {d.spec.kind == "cpu" for d in cluster.devices}
    if opts["mode"] == "sampled_pipeline" or (opts["mode"] == "sampled_dp" and kinds == {True, False}):
        # the same sampled algorithm with cpu ranks sampling for the accelerators: priced beside sampled_dp on
        # the same mini-batch, planned only when asked for (its ranks do different work: samplers return no
        # loss and hold no trained model between eval_step / save)
        cands["sampled_pipeline"] = cost.sampled_pipeline(batch, int(opts["fanout"]))
    best = cands[opts["mode"]]
    if not best.fits:
        other = "partition" if best.mode != "partition" else "sampled_dp"
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
    elif best.mode == "sampled_pipeline":
        graph.update({k: best.extra[k] for k in ("batch_size", "fanout", "samplers", "trainers", "sampler_of",
                                                 "stages")})
    else:
        graph.update(halo=best.extra["halo"], local_edges=best.extra["local_edges"])
        # which partitioner cut the nodes (partitioners.py), why, and every one's figures; METIS's inputs
        # let every rank recompute the same parts
        name = best.extra.get("partitioner", "locality")
        graph.update(partitioner=name, order={"locality": "bfs"}.get(name, name),
                     partitioners=best.extra.get("partitioners", {}),
                     partitioner_why=best.extra.get("partitioner_why", ""), partition_seed=0)
        if "metis" in best.extra:
            graph["metis"] = best.extra["metis"]
        # per rank: its graph bytes (part + exchange buffers) and its part alone (what graph_data files hold)
        graph.update(graph_bytes=best.extra.get("graph_bytes", []),
                     graph_part_bytes=best.extra.get("graph_part_bytes", []))
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


__all__ = ["DEFAULTS", "GRAPH_MODES", "graph_kind", "graph_stats", "plan_graph",
           "split_inputs", "to_plan"]
