"""GNN workloads (issue 6): graph partitioning vs sampled data parallelism for GraphSAGE.

gnn_workloads(): predicted throughput (labelled nodes trained per second) of both modes for GraphSAGE on a
    generated 1M-node, 20M-edge graph on 4 mixed GPUs (2 A100-80GB + 2 V100-32GB on two nodes), from
    the graph cost model (autopar/graphs/cost.py) on meta tensors (nothing materialised; halos from the
    random-graph expectation), and the mode autopar.plan chooses.
gnn_measured(): measured nodes/s of both modes on 2 local gloo processes for a small generated graph, next
    to the cost model's prediction for a 2-CPU cluster.

Run: cd bench && python wl_gnn.py
"""

from __future__ import annotations

import time
from typing import Any

import torch
from common import print_table, write_results

import autopar
from autopar.graphs.cost import GraphCostModel
from autopar.graphs.models import GRAPH_CASES
from autopar.graphs.planner import graph_stats
from autopar.runtime.launch import spawn_local

BIG = {"nodes": 1_000_000, "edges": 20_000_000, "features": 128, "hidden": 256, "layers": 2, "classes": 47}
MIXED = "1x2xA100-80GB+1x2xV100-32GB"
SMALL = {"nodes": 8_000, "avg_degree": 10.0, "features": 64, "hidden": 64, "layers": 2}
SMALL_SAMPLED = {"batch_size": 1024, "fanout": 10}


def gnn_workloads(cluster: str = MIXED, batch_per_device: int = 1024, fanout: int = 10) -> list[dict[str, Any]]:
    """One row per mode: predicted samples/s (labelled nodes/s), step time, shares, memory; plus the choice."""
    case = GRAPH_CASES["sage"](seed=0, nodes=64, features=BIG["features"], hidden=BIG["hidden"],
                               layers=BIG["layers"], classes=BIG["classes"])
    x = torch.empty(BIG["nodes"], BIG["features"], device="meta")
    edge_index = torch.empty(2, BIG["edges"], dtype=torch.long, device="meta")
    world = autopar.Cluster.load(cluster).world_size
    options = {"batch_size": batch_per_device * world, "fanout": fanout}
    t0 = time.perf_counter()
    plan = autopar.plan(case.model, cluster, (x, edge_index), None, case.loss_fn, graph_options=options)
    plan_s = time.perf_counter() - t0
    rows = []
    for mode, c in plan.graph["candidates"].items():
        rows.append({
            "workload": f"graphsage {BIG['layers']}x{BIG['hidden']} on 1M nodes / 20M edges, F={BIG['features']}",
            "cluster": cluster, "mode": mode, "chosen": mode == plan.graph["mode"], "fits": c["fits"],
            "predicted_nodes_per_s": c["samples_per_s"], "step_time_s": c["step_time_s"],
            "samples_per_step": c["samples_per_step"], "shares": c["shares"],
            "comm_s": c["comm_s"], "peak_memory_GiB": max(c["peak_memory_bytes"] or [0]) / 2**30,
            "halo": c.get("halo"), "features_on": c.get("features_on"), "plan_s": plan_s,
        })
    return rows


def _measure(rank: int, world: int, mode: str, steps: int) -> dict[str, Any]:
    case = GRAPH_CASES["sage"](seed=0, **SMALL)
    cluster = {"nodes": [{"device": "cpu", "devices_per_node": world}]}
    opts = {"mode": mode, **(SMALL_SAMPLED if mode == "sampled_dp" else {})}
    prog = autopar.compile(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn,
                           graph_options=opts, timeout_s=120)
    prog.step(*case.example_inputs, target=case.example_target)  # warm-up (partitioning, first allocations)
    torch.distributed.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        prog.step(*case.example_inputs, target=case.example_target)
    torch.distributed.barrier()
    return {"seconds": time.perf_counter() - t0, "plan": prog.plan.to_json()}


def gnn_measured(steps: int = 3) -> list[dict[str, Any]]:
    """Measured labelled nodes/s on 2 local gloo processes, partition vs sampled data parallel (< 60 s)."""
    rows = []
    for mode in ("partition", "sampled_dp"):
        out = spawn_local(_measure, 2, mode, steps, timeout_s=120)[0]
        plan = autopar.Plan.from_json(out["plan"])
        per_step = plan.global_batch
        case = GRAPH_CASES["sage"](seed=0, **SMALL)
        stats = graph_stats(*case.example_inputs, case.example_target)
        cm = GraphCostModel(case.model, stats, autopar.Cluster.load(plan.cluster), plan.precision)
        rows.append({
            "workload": f"graphsage on {SMALL['nodes']} nodes, degree {SMALL['avg_degree']:.0f}, 2 gloo ranks",
            "mode": mode, "measured_nodes_per_s": per_step * steps / out["seconds"],
            "predicted_nodes_per_s": plan.predicted["samples_per_s"], "samples_per_step": per_step,
            "step_time_s": out["seconds"] / steps, "shares": plan.graph["shares"],
            "halo": plan.graph.get("halo"), "cost_model_params": cm.params,
        })
    return rows


def main() -> None:
    predicted = gnn_workloads()
    print_table(predicted, ["mode", "chosen", "fits", "predicted_nodes_per_s", "step_time_s", "comm_s",
                            "peak_memory_GiB", "shares"])
    measured = gnn_measured()
    print_table(measured, ["mode", "measured_nodes_per_s", "predicted_nodes_per_s", "step_time_s", "shares",
                           "halo"])
    chosen = next(r["mode"] for r in predicted if r["chosen"])
    path = write_results("wl_gnn", predicted + measured, {"chosen_mode_1M": chosen})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
