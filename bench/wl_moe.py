"""MoE workloads: autopar's plan (expert parallelism among its choices) vs data parallelism only.

`moe_workloads()` prices, without running anything, an 8-expert top-2 MoE GPT with GPT-1.3B's dense shape
(24 layers, hidden 2048, 16 heads, seq 2048, every MLP replaced by 8 experts; built on meta) on two
clusters: autopar's plan (the searcher tries ep = 1 and every admissible ep > 1, see solver/pricing/experts.py),
data parallelism only as a user would run it (one replica per device, experts replicated, the smallest
ZeRO stage that fits: `planner.dp_only`, the ratio's baseline), plain DP without ZeRO, and expert
parallelism across all replicas (`Strategy(dp=world, ep=8)`), each with its predicted samples/s and
whether it fits in memory (a plan that does not fit is priced anyway; its speed is not attainable).

`measured_moe()` trains a small moe_gpt on 2 local gloo processes under an expert-parallel plan
(dp=2, ep=2) and a data-parallel one (dp=2), through autopar.estimate -> autopar.compile, and reports
measured samples/s (median step over a few steps). On CPU with a tiny model this measures the overheads
(all-to-all latency), not the GPU-scale trade-off the predictions are about.

    python bench/wl_moe.py            # both; writes bench/results/wl_moe.json
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
from common import print_table, samples_per_s, write_results
from planner import dp_only

import autopar
from autopar import models
from autopar.api import cost_model
from autopar.ir.plan import Plan, Strategy
from autopar.runtime.launch import spawn_local
from autopar.solver.pricing.pricing import price_strategy
from autopar.solver.search.search import search

CLUSTERS = ["2x8xA100-80GB", "1x8xA100-80GB+1x8xV100-32GB"]
GLOBAL_BATCH = 64


def _summary(plan: Plan) -> dict[str, int]:
    pipe = plan.pipelines[0]
    return {"ep": int((plan.experts or {}).get("degree", 1)), "dp": len(plan.pipelines),
            "tp": len(pipe.stages[0].devices), "pp": len(pipe.stages) // plan.chunks}


def moe_workloads(time_limit_s: float = 60.0) -> list[dict[str, Any]]:
    """One row per cluster: predicted samples/s of autopar's plan, of DP only, their ratio, the plan."""
    case = models.moe_gpt(batch=GLOBAL_BATCH, experts=8, top_k=2, device="meta", **models.gpt_config("gpt-1.3b"))
    rows = []
    for cluster in CLUSTERS:
        cm = cost_model(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn)
        world = cm.cluster.world_size
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a time-limited search warns; the row says how long it took
            plan = search(cm, time_limit_s)
        plan_s = time.perf_counter() - t0
        dp = price_strategy(cm, Strategy(dp=world))
        ep = price_strategy(cm, Strategy(dp=world, ep=8))
        dp_fit, dp_fit_strategy, _ = dp_only(cm)  # the baseline: DP with the smallest ZeRO stage that fits
        ours = plan.predicted["samples_per_s"]
        base = dp_fit.predicted["samples_per_s"] if dp_fit is not None else None
        rows.append({"case": "moe-gpt-1.3b-8e-top2", "cluster": cluster, "autopar_samples_per_s": ours,
                     "dp_zero_samples_per_s": base, "dp_zero": dp_fit_strategy.zero if dp_fit_strategy else None,
                     "ratio": ours / base if base else None,
                     "dp_samples_per_s": dp.predicted["samples_per_s"], "dp_fits": dp.fits,
                     "ep8_dp_samples_per_s": ep.predicted["samples_per_s"], "ep8_dp_fits": ep.fits,
                     **_summary(plan), "plan_s": plan_s,
                     "autopar_peak_gb": max(plan.predicted["peak_memory_bytes"].values()) / 1e9,
                     "dp_peak_gb": max(dp.predicted["peak_memory_bytes"].values()) / 1e9})
    return rows


# ---- measured on local gloo processes ------------------------------------------------------------------

SMALL = {"layers": 2, "batch": 8, "seq": 32, "hidden": 64, "experts": 4, "top_k": 2}
MEASURE_CLUSTER = "1x2xA100-80GB"  # two stand-in devices: one gloo process each


def _small_moe() -> models.ModelCase:
    return models.moe_gpt(seed=0, **SMALL)


def _train(rank: int, world: int, plans: dict[str, str], steps: int) -> dict[str, float]:
    return samples_per_s(_small_moe, MEASURE_CLUSTER, plans, steps, SMALL["batch"])


def measured_moe(steps: int = 5) -> list[dict[str, Any]]:
    """Measured samples/s of a small moe_gpt on 2 gloo processes: expert-parallel vs data-parallel plan."""
    case = models.moe_gpt(seed=0, **SMALL)
    plans = {}
    for name, strategy in (("ep2", Strategy(dp=2, ep=2)), ("dp2", Strategy(dp=2))):
        est = autopar.estimate(case.model, MEASURE_CLUSTER, strategy, case.example_inputs, case.example_target,
                               case.loss_fn)
        plans[name] = est.plan.to_json()
    torch.set_num_threads(1)
    per_rank = spawn_local(_train, 2, plans, steps, timeout_s=120)
    return [{"case": f"moe_gpt-small {name}", "measured_samples_per_s": min(r[name] for r in per_rank)}
            for name in plans]


def main() -> None:
    rows = moe_workloads()
    print_table(rows, ["cluster", "autopar_samples_per_s", "dp_zero_samples_per_s", "dp_zero", "ratio",
                       "dp_samples_per_s", "dp_fits",
                       "ep8_dp_samples_per_s", "ep8_dp_fits", "ep", "dp", "tp", "pp", "plan_s"])
    measured = measured_moe()
    print_table(measured, ["case", "measured_samples_per_s"])
    print("wrote", write_results("wl_moe", rows + measured, {"clusters": CLUSTERS, "global_batch": GLOBAL_BATCH}))


if __name__ == "__main__":
    main()
