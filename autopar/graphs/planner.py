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

# partition: full-graph training, the model as written (the default). layer_pipeline: the same full-graph training
# with the message-passing layers split into stages over the ranks (layer_pipeline.py), on request or, by default,
# where it can pay (plan_graph). sampled_dp: mini-batch training on sampled neighbourhoods, a different estimator,
# only when graph_options asks for it. sampled_pipeline: the same sampled algorithm with a division of labour (cpu
# ranks sample and gather, accelerator ranks train), on request.
GRAPH_MODES = ("partition", "sampled_dp", "sampled_pipeline", "layer_pipeline")
FULL_GRAPH_MODES = ("partition", "layer_pipeline")  # one algorithm (the model as written), two divisions of work
DEFAULTS = {"mode": "partition", "batch_size": None, "fanout": 10, "seed": 0, "chunks": None, "stages": None}


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
    and train data parallel among themselves, sampling step k + 1 while they train step k. mode
    "layer_pipeline" is partition's full-graph training with the message-passing layers split into consecutive
    stages, one per rank, the nodes flowing through them in chunks (layer_pipeline.py); `chunks` (default: the
    fastest of 1, 2, 4, 8 that fits) and `stages` (layers per rank; default: the most balanced split that fits)
    pin its shape. The modes are priced (`plan.graph["candidates"]`); only the requested one is considered,
    except that without a mode the planner also prices layer_pipeline where it can pay, i.e. when partition does
    not fit memory or its step is bound by the halo exchange, and takes the faster of the two full-graph modes
    that fits (`plan.graph["mode_why"]`).
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
    chunks = None if opts["chunks"] is None else int(opts["chunks"])
    stages = None if opts["stages"] is None else list(opts["stages"])
    why = ""
    if opts["mode"] == "layer_pipeline":
        cands["layer_pipeline"] = cost.layer_pipeline(chunks, stages)  # PlanError: what cannot be pipelined
        best = cands["layer_pipeline"]
        why = "asked for with graph_options mode='layer_pipeline'"
    else:
        best = cands[opts["mode"]]
        pays = _pipeline_pays(cands["partition"])
        if "mode" not in given and cluster.world_size > 1 and pays:
            try:
                cands["layer_pipeline"] = cost.layer_pipeline(chunks, stages)
            except PlanError as e:  # this model cannot be pipelined: partition stays
                cands["layer_pipeline"] = cost.infeasible("layer_pipeline", [str(e)])
            lp = cands["layer_pipeline"]
            if lp.fits and (not best.fits or lp.step_time_s < best.step_time_s):
                best = lp
            if best is lp:
                why = (f"layer_pipeline priced because {pays}; it "
                       + ("fits where partition does not" if not cands["partition"].fits else
                          "has the faster predicted step"))
            else:
                why = (f"layer_pipeline priced because {pays}; partition stays: layer_pipeline "
                       + ("does not fit either" if not lp.fits else "is not faster"))
    if not best.fits:
        other = "partition" if best.mode != "partition" else "sampled_dp"
        if cands[other].fits and other in FULL_GRAPH_MODES:
            alt = f" {other} would fit: ask for it with graph_options={{'mode': {other!r}}}."
        elif cands[other].fits:
            alt = (f" {other} would fit, but it trains a different algorithm; ask for it with "
                   f"graph_options={{'mode': {other!r}}} if that is what you want.")
        else:
            alt = ""
        if best.mode == "partition" and "layer_pipeline" in cands:
            alt += f" layer_pipeline cannot help: {', '.join(cands['layer_pipeline'].problems)}."
        raise InfeasibleError(f"graph training mode {best.mode} does not fit memory: {', '.join(best.problems)}."
                              + alt)
    return to_plan(model, cluster, cost, best, cands, opts, precision, memory_reserve, why)


def _pipeline_pays(partition: Candidate) -> str:
    """Why the default full-graph plan also prices layer_pipeline ("" when it cannot pay): partition does not fit
    memory, or its step is bound by the halo exchange (a layer pipeline moves one layer output per stage
    boundary instead of two exchanges per layer)."""
    if not partition.fits:
        return "partition does not fit memory"
    if partition.comm_s > max(partition.compute_s, default=0.0):
        return "partition's step is bound by the halo exchange"
    return ""


def to_plan(model: nn.Module, cluster: Cluster, cost: GraphCostModel, best: Candidate,
            cands: dict[str, Candidate], opts: dict, precision: str, memory_reserve: float, why: str = "") -> Plan:
    s, L = cost.stats, cost.layers
    unit = {"partition": "nodes", "layer_pipeline": "layers"}.get(best.mode, "seeds")
    graph = {"mode": best.mode, "unit": unit, "mode_why": why,
             "num_nodes": s.num_nodes, "num_edges": s.num_edges, "features": s.features, "labelled": s.labelled,
             "layers": L, "shares": best.shares, "seed": int(opts["seed"]), "order": "bfs",
             "candidates": {m: c.summary() for m, c in cands.items()}, "idle": best.extra.get("idle", [])}
    if best.mode == "sampled_dp":
        graph.update(batch_size=best.extra["batch_size"], fanout=best.extra["fanout"])
    elif best.mode == "sampled_pipeline":
        graph.update({k: best.extra[k] for k in ("batch_size", "fanout", "samplers", "trainers", "sampler_of",
                                                 "stages")})
    elif best.mode == "layer_pipeline":
        graph.update({k: best.extra[k] for k in ("stage_layers", "chunks", "chunk_sizes", "chunk_halo",
                                                 "chunk_reads", "stage_params", "boundary_bytes", "pipeline",
                                                 "chunk_options", "chunks_why", "order")})
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
    idle = [max(best.compute_s) - c for c in best.compute_s]
    if best.mode == "layer_pipeline":  # one pipeline, a stage per rank, the node chunks its micro-batches
        idle = list(best.extra["pipeline"]["idle_s"])
        stages = [Stage(list(r), [d], predicted={"fwd_s": c / 3, "bwd_s": 2 * c / 3, "compute_s": c,
                                                  "comm_s": best.comm_s, "sync_s": best.sync_s,
                                                  "bubble_s": idle[d]})
                  for d, (r, c) in enumerate(zip(best.extra["stage_layers"], best.compute_s, strict=True))]
        sizes = best.extra["chunk_sizes"]
        pipes.append(Pipeline(s.num_nodes, max(sizes), len(sizes), stages))
    for r, share in enumerate(best.shares if best.mode != "layer_pipeline" else []):
        c = best.compute_s[r]
        pred = {"fwd_s": c / 3, "bwd_s": 2 * c / 3, "compute_s": c, "comm_s": best.comm_s,
                "sync_s": best.sync_s, "bubble_s": max(best.compute_s) - c}
        pipes.append(Pipeline(share, share, 1, [Stage([0, L], [r], predicted=pred)]))
    peak_flops = sum(d.spec.flops(precision) for d in cluster.devices)
    predicted = {"step_time_s": best.step_time_s, "samples_per_s": best.samples_per_s,
                 "tflops_per_device": best.flops / best.step_time_s / cluster.world_size / 1e12,
                 "mfu": best.flops / best.step_time_s / peak_flops,
                 "bubble_fraction": sum(idle) / cluster.world_size / best.step_time_s,
                 "peak_memory_bytes": dict(enumerate(best.peak_memory_bytes)),
                 "memory_capacity_bytes": {d.index: d.spec.memory for d in cluster.devices}}
    names = [n for n, _ in message_passing_layers(model)]
    summary = {"name": type(model).__name__, "num_layers": L, "layer_names": names,
               "params": sum(p.numel() for p in model.parameters())}
    return Plan(best.samples_per_step, precision, cost.optimizer, "gpipe", 1, cluster.to_dict(), summary, pipes,
                predicted, memory_reserve, graph=graph)


__all__ = ["DEFAULTS", "FULL_GRAPH_MODES", "GRAPH_MODES", "graph_kind", "graph_stats", "plan_graph",
           "split_inputs", "to_plan"]
