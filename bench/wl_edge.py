"""Edge workloads (issue 6): BERT-base on four Jetson-class boards over 1 Gb/s Ethernet and 100 Mb/s Wi-Fi.

Per cluster file in examples/clusters, the predicted samples/s of
  autopar     `search` on the cost model (as `autopar.plan`), fp32 training
  DP-only     `baselines.dp_only`: every board a replica, the smallest ZeRO stage that fits
  uniform     the best of DP-only, DP-speed (`baselines.dp_speed`; the boards are alike, so it equals
              DP-only here) and `baselines.megatron_grid` (uniform dp x tp x pp, even splits, each plan
              also with bf16 stage sends where autopar's plan may send bf16: the same option)
and whether autopar's plan and the best grid plan compress the activations/gradients sent between stages
(bf16 on the wire). `plan_time_limited` marks a search that stopped at its time limit.

fp32 because that is where compression can pay: in bf16/fp16 mixed precision the boundary activations
already travel in 2 bytes (`pricing.compress_choice`). Everything is priced by the same cost model.

Run: cd bench && python wl_edge.py
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

from baselines import dp_only, dp_speed, megatron_grid
from common import print_table, write_results
from planner import describe, strategy_label, time_limit_configs

from autopar import models
from autopar.api import cost_model
from autopar.solver.search.search import search

CLUSTERS = Path(__file__).resolve().parent.parent / "examples" / "clusters"
BERT_BASE = dict(layers=12, hidden=768, heads=12, seq=128, vocab=30522)
BATCH = 32
PRECISION = "fp32"


def edge_workloads(batch: int = BATCH, clusters: tuple[str, ...] = ("edge_orin_ethernet", "edge_orin_wifi"),
                   time_limit_s: float = 60.0) -> list[dict[str, Any]]:
    """One row per cluster: autopar vs data-parallel-only vs the best uniform plan (predicted samples/s),
    and the stage boundaries autopar compresses."""
    rows = []
    for name in clusters:
        mc = models.hf_bert(**BERT_BASE, batch=batch, device="meta")
        cm = cost_model(mc.model, str(CLUSTERS / f"{name}.yaml"), mc.example_inputs, mc.example_target,
                        mc.loss_fn, precision=PRECISION, compress="bf16")  # compression allowed: the rows compare it
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = search(cm, time_limit_s)
        plan_s = time.perf_counter() - t0
        limit = next((str(w.message) for w in caught if "planning stopped" in str(w.message)), None)
        dp_est, _, _ = dp_only(cm)
        speed_est, _, _ = dp_speed(cm)
        grid_est, grid_st, _, _ = megatron_grid(cm)
        dp_sps = dp_est.predicted["samples_per_s"] if dp_est else None
        uniform = [e.predicted["samples_per_s"] for e in (dp_est, speed_est, grid_est) if e is not None]
        compressed = [f"p{i}s{j}:{st.compress}" for i, p in enumerate(plan.pipelines)
                      for j, st in enumerate(p.stages) if st.compress]
        sps = plan.predicted["samples_per_s"]
        rows.append({
            "workload": f"bert-base seq {BERT_BASE['seq']} batch {batch} {PRECISION}", "cluster": name,
            "plan_s": plan_s, "plan_time_limited": limit is not None, "plan_configs": time_limit_configs(limit),
            "autopar_sps": sps, "dp_sps": dp_sps,
            "dpspeed_sps": speed_est.predicted["samples_per_s"] if speed_est else None,
            "grid_sps": grid_est.predicted["samples_per_s"] if grid_est else None,
            "grid_plan": f"{strategy_label(grid_st)} | {describe(grid_est.plan)}" if grid_est and grid_st else None,
            "grid_compressed": bool(grid_st and grid_st.compress),
            "uniform_sps": max(uniform) if uniform else None,
            "vs_uniform": sps / max(uniform) if uniform else None,
            "compression": bool(compressed), "compressed_boundaries": compressed,
            "peak_memory_GiB": max(plan.predicted["peak_memory_bytes"].values()) / 2**30,
            "autopar_plan": describe(plan),
        })
    return rows


def main() -> None:
    rows = edge_workloads()
    print_table(rows, ["cluster", "plan_s", "plan_time_limited", "autopar_sps", "dp_sps", "grid_sps", "vs_uniform",
                       "compression", "grid_compressed", "peak_memory_GiB"])
    for r in rows:
        print(f"  {r['cluster']}: {r['autopar_plan']}  compressed: {', '.join(r['compressed_boundaries']) or '-'}")
        print(f"  {'':{len(r['cluster'])}}  best grid plan: {r['grid_plan']}")
    print("wrote", write_results("wl_edge", rows, {"precision": PRECISION, "batch": BATCH}))


if __name__ == "__main__":
    main()
