"""Beyond dense transformers (issue 6): MoE, GNN and edge workloads, predicted at scale and measured small.

Predicted (cost model only, nothing runs; each against the baseline a user would otherwise pick):
  moe    8-expert top-2 MoE GPT (GPT-1.3B dense shape) on 2x8 A100-80GB and on 1x8 A100 + 1x8 V100:
         autopar's plan (expert parallelism among its choices) vs data parallel only   (wl_moe.py)
  gnn    GraphSAGE on a 1M-node / 20M-edge graph on 4 mixed GPUs: graph partitioning with halo exchange
         vs sampled mini-batch data parallel; the cost model picks                       (wl_gnn.py)
  edge   BERT-base on 4 Jetson-AGX-Orin boards over 1 Gb/s Ethernet and 100 Mb/s Wi-Fi: autopar vs
         data parallel only vs the best uniform (Megatron-grid) plan                     (wl_edge.py)
Measured on local gloo processes (2 ranks, small versions; CPU stand-ins, so these measure overheads
such as all-to-all and halo latency, not the GPU-scale trade-offs above):
  moe    small moe_gpt, expert-parallel (dp2 x ep2) vs data-parallel plan
  gnn    GraphSAGE on an 8k-node graph, partition vs sampled data parallel
  edge   small BERT: the plan autopar picks for 2 Wi-Fi boards (a 2-stage pipeline, bf16 on the wire)
         vs data parallel, both run on 2 gloo processes. Local links are not Wi-Fi, so each row also gives
         the cost model's view of the links it ran on (`note`): the plan autopar makes for 2 local CPU
         ranks (1x2xcpu) and both plans priced there, i.e. whether the measured order is the one the
         cost model predicts for the cluster the programs really ran on
The predicted ratios compare predictions of one cost model with each other (autopar vs baselines priced
by it); the measured rows are measurements.

    cd bench && python workloads.py        # writes results/workloads.json (about 5 minutes on 2 cores)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from common import print_table, samples_per_s, write_results
from wl_edge import edge_workloads
from wl_gnn import gnn_measured, gnn_workloads
from wl_moe import measured_moe, moe_workloads

import autopar
from autopar.api import cost_model
from autopar.hf_models import hf_bert
from autopar.runtime.launch import spawn_local
from autopar.solver.pricing.pricing import price

EDGE_SMALL = {"batch": 8, "seq": 32, "vocab": 512, "hidden": 128, "layers": 4, "heads": 4}
# Two Orin boards on Wi-Fi: the plan is derived for this cluster, then run by two local gloo processes.
EDGE_PAIR = {"name": "orin-pair-wifi", "nodes": [{"device": "Jetson-AGX-Orin", "devices_per_node": 1, "count": 2}],
             "network": {"bandwidth_GBps": 0.0125, "latency_us": 3000}}
LOCAL_PAIR = "1x2xcpu"  # what the measured programs really run on: 2 gloo processes on this machine


def _small_bert() -> Any:
    return hf_bert(seed=0, **EDGE_SMALL)


def _edge_train(rank: int, world: int, plans: dict[str, str], steps: int) -> dict[str, float]:
    return samples_per_s(_small_bert, EDGE_PAIR, plans, steps, EDGE_SMALL["batch"])


def edge_measured(steps: int = 5) -> list[dict[str, Any]]:
    """Measured samples/s of a small BERT on 2 gloo processes: autopar's plan for 2 Wi-Fi boards vs DP."""
    case = hf_bert(seed=0, **EDGE_SMALL)
    args = (case.model, EDGE_PAIR)
    kwargs = {"example_inputs": case.example_inputs, "example_target": case.example_target,
              "loss_fn": case.loss_fn, "precision": "fp32"}
    ours = autopar.plan(*args, time_limit_s=30, compress="bf16", **kwargs)  # the Wi-Fi plan may compress
    dp = autopar.estimate(*args, autopar.Strategy(dp=2), **kwargs)
    plans = {"autopar": ours.to_json(), "dp2": dp.plan.to_json()}
    torch.set_num_threads(1)
    per_rank = spawn_local(_edge_train, 2, plans, steps, timeout_s=300)
    compressed = [st.compress for p in ours.pipelines for st in p.stages if st.compress]
    local = autopar.plan(case.model, LOCAL_PAIR, time_limit_s=30, **kwargs)
    cm = cost_model(case.model, LOCAL_PAIR, case.example_inputs, case.example_target, case.loss_fn, precision="fp32")
    here = {k: price(cm, replace(p, cluster=cm.cluster.to_dict(), predicted={})).plan.predicted["samples_per_s"]
            for k, p in (("autopar", ours), ("dp2", dp.plan))}
    local_desc = (f"{len(local.pipelines)} replica(s) x {len(local.pipelines[0].stages)} stage(s), ZeRO-"
                  f"{max(st.zero for p in local.pipelines for st in p.stages)}")
    note = (f"planned for 2 Orin boards on 100 Mb/s Wi-Fi, where it predicts {ours.predicted['samples_per_s']:.0f} "
            f"vs dp2 {dp.predicted['samples_per_s']:.1f} samples/s (dp2 all-reduces every gradient over Wi-Fi); "
            f"measured on 2 local gloo processes, where autopar plans {local_desc} "
            f"({local.predicted['samples_per_s']:.0f} predicted) and predicts the Wi-Fi plan at "
            f"{here['autopar']:.0f} vs dp2 {here['dp2']:.0f} samples/s")
    return [{"case": "bert-small autopar plan", "plan": f"{len(ours.pipelines)} pipeline(s) x "
             f"{len(ours.pipelines[0].stages)} stage(s), send as {compressed or 'fp32'}",
             "predicted_samples_per_s": ours.predicted["samples_per_s"],
             "predicted_local_samples_per_s": here["autopar"], "local_plan": local_desc,
             "local_plan_samples_per_s": local.predicted["samples_per_s"], "note": note,
             "measured_samples_per_s": min(r["autopar"] for r in per_rank)},
            {"case": "bert-small dp2", "plan": "2 replicas",
             "predicted_samples_per_s": dp.predicted["samples_per_s"],
             "predicted_local_samples_per_s": here["dp2"], "note": note,
             "measured_samples_per_s": min(r["dp2"] for r in per_rank)}]


def main() -> None:
    moe, gnn, edge = moe_workloads(), gnn_workloads(), edge_workloads()
    print("MoE (predicted)")
    print_table(moe, ["cluster", "autopar_samples_per_s", "dp_zero_samples_per_s", "dp_zero", "ratio", "ep", "dp",
                      "tp", "pp", "plan_s"])
    print("\nGraphSAGE 1M nodes / 20M edges (predicted)")
    print_table(gnn, ["mode", "chosen", "fits", "predicted_nodes_per_s", "step_time_s", "comm_s", "shares"])
    print("\nBERT-base on 4 Jetson-AGX-Orin (predicted, fp32)")
    print_table(edge, ["cluster", "autopar_sps", "dp_sps", "uniform_sps", "vs_uniform", "compression"])
    measured = ([{"workload": "moe", "note": "forced strategies (dp2 x ep2 vs dp2), not autopar's plan", **r}
                 for r in measured_moe()]
                + [{"workload": "gnn", "case": r["mode"], "measured_samples_per_s": r["measured_nodes_per_s"],
                    "predicted_samples_per_s": r["predicted_nodes_per_s"]} for r in gnn_measured()]
                + [{"workload": "edge", **r} for r in edge_measured()])
    print("\nMeasured on 2 local gloo processes (small versions)")
    print_table(measured, ["workload", "case", "measured_samples_per_s", "predicted_samples_per_s",
                           "predicted_local_samples_per_s"])
    for note in dict.fromkeys(r["note"] for r in measured if r.get("note")):
        print(f"  {note}")
    rows = ([{"workload": "moe", **r} for r in moe] + [{"workload": "gnn", **r} for r in gnn]
            + [{"workload": "edge", **r} for r in edge] + [{"measured": True, **r} for r in measured])
    summary = {
        "moe_ratio_vs_dp": {r["cluster"]: r["ratio"] for r in moe},
        "gnn_chosen_mode": next(r["mode"] for r in gnn if r["chosen"]),
        "gnn_partition_vs_sampled": _ratio(gnn),
        "edge_vs_uniform": {r["cluster"]: r["vs_uniform"] for r in edge},
        "edge_vs_dp": {r["cluster"]: r["autopar_sps"] / r["dp_sps"] for r in edge if r["dp_sps"]},
    }
    print("\n", summary)
    print("wrote", write_results("workloads", rows, summary))


def _ratio(gnn: list[dict[str, Any]]) -> float | None:
    by = {r["mode"]: r["predicted_nodes_per_s"] for r in gnn}
    return by["partition"] / by["sampled_dp"] if by.get("sampled_dp") else None


if __name__ == "__main__":
    main()
