"""Measured blocks (issue 25 part 2): does a plan priced from a CPU block profile predict its measured step time?

For each case (a small GPT on 2 gloo ranks standing in for 2 CPU devices), in one run:
  1. `autopar profile`'s `profile_blocks` times every distinct layer on this CPU at micro-batch sizes 1..batch;
  2. each strategy is priced twice: from the analytic cost model, and with `profile=` (measured layers);
  3. and a third time with the profile and the link `autopar probe` measured between the 2 ranks (gloo);
  4. the strategy is compiled and trained on 2 gloo processes; the step time is the median of ROUNDS rounds'
     medians of STEPS timed steps (after the plan check's window and a warm-up), the plans' rounds interleaved;
     `measured_spread` is the rounds' (max - min) / median, the host's noise on that row.
Printed: predicted (analytic), predicted (profile), measured, and each ratio; target: the profile's
prediction within 10 % of the measured step. Also, per case, the optimizer step: the sum of the profile's
per-layer steps against one AdamW step over the whole model after a backward, timed here (what a one-stage
rank runs). Predictions are the cost model's beliefs; the measured column is
the truth. Each rank runs on one thread (launch.spawn_local), as the profile was timed.

Run: cd bench && python measured_blocks.py
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from common import print_table, write_results

import autopar
from autopar import models
from autopar.runtime.block_profiler import profile_blocks
from autopar.runtime.launch import spawn_local

CLUSTER = "1x2xcpu"
STEPS = 8  # timed steps per round
ROUNDS = 3  # rounds per plan, interleaved with the other plans'
WARMUP = 5  # untimed steps first: the plan check's memory window (3) and 2 more
CASES = {
    "gpt-small": dict(layers=4, hidden=128, heads=4, seq=32, batch=8, vocab=512),
    "gpt-wide": dict(layers=4, hidden=256, heads=8, seq=64, batch=8, vocab=1024),
}
STRATEGIES = {
    "pp2 m4": dict(pp=2, microbatch_size=2),
    "pp2 m2": dict(pp=2, microbatch_size=4),
    "dp2": dict(dp=2),
}


def build(cfg: dict) -> models.ModelCase:
    return models.gpt(**cfg, seed=0)


def whole_model_step_s(cfg: dict, repeats: int = 10) -> float:
    """Median seconds of one AdamW step over the whole model right after a forward + backward (eager)."""
    case = build(cfg)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3, eps=1e-6)
    times = []
    for _ in range(repeats + 2):
        models.loss_of(case).backward()
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
        opt.zero_grad()
    return statistics.median(times[2:])


def probe_worker(rank: int, world: int) -> dict | None:
    """`autopar probe`'s measurement of the 2 ranks' link (gloo all_reduce and send/recv), as a cluster dict."""
    from autopar.cluster import Cluster
    from autopar.runtime.probe import cluster_with_measurements, measure

    c = Cluster.load(CLUSTER)
    records = measure(c, rank, 8 * 2**20, 10)
    return cluster_with_measurements(c, records, "gloo") if rank == 0 else None


def worker(rank: int, world: int, cfg: dict, plans: dict[str, str]) -> dict[str, list[float]]:
    """Per plan, the median step of each of ROUNDS rounds of STEPS timed steps; the plans' rounds interleaved
    (A B C A B C ...), so that a change in the host's load falls on every plan alike."""
    progs = {}
    for name, plan in plans.items():
        case = build(cfg)
        prog = autopar.compile(case.model, CLUSTER, case.example_inputs, case.example_target, case.loss_fn,
                               plan=plan, precision="fp32", timeout_s=120)
        for _ in range(WARMUP):  # the plan check's memory window (3 steps) and a warm-up
            prog.step(*case.example_inputs, target=case.example_target)
        progs[name] = (case, prog)
    out: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(ROUNDS):
        for name, (case, prog) in progs.items():
            times = []
            for _ in range(STEPS):
                t = time.perf_counter()
                prog.step(*case.example_inputs, target=case.example_target)
                times.append(time.perf_counter() - t)
            out[name].append(statistics.median(times))
    return out


def main() -> None:
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    probed = spawn_local(probe_worker, 2, timeout_s=300)[0]
    probed.pop("probe", None)
    link = probed["nodes"][0]["intra_node"]
    print(f"probed link between the 2 gloo ranks: {link['bandwidth_GBps']:.3g} GB/s, {link['latency_us']:.3g} us")
    for case_name, cfg in CASES.items():
        case = build(cfg)
        prof = profile_blocks(case.model, CLUSTER, case.example_inputs, case.example_target, case.loss_fn,
                              budget_s=60)
        profiled = sum(e.step_s or 0.0 for e in prof.entries)
        whole = whole_model_step_s(cfg)
        steps.append({"case": case_name, "profile_step_sum_ms": profiled * 1e3, "whole_model_step_ms": whole * 1e3,
                      "ratio": profiled / whole})
        plans, priced = {}, {}
        for name, kw in STRATEGIES.items():
            s = autopar.Strategy(**kw)
            analytic = autopar.estimate(case.model, CLUSTER, s, case.example_inputs, case.example_target,
                                        case.loss_fn, precision="fp32")
            measured = autopar.estimate(case.model, CLUSTER, s, case.example_inputs, case.example_target,
                                        case.loss_fn, precision="fp32", profile=prof)
            both = autopar.estimate(case.model, probed, s, case.example_inputs, case.example_target,
                                    case.loss_fn, precision="fp32", profile=prof)
            plans[name] = measured.plan.to_json()
            priced[name] = (analytic.plan.predicted["step_time_s"], measured.plan.predicted["step_time_s"],
                            both.plan.predicted["step_time_s"])
        runs = spawn_local(worker, 2, cfg, plans, timeout_s=600)
        for name in STRATEGIES:
            rounds = [max(r[name][i] for r in runs) for i in range(ROUNDS)]  # the slower rank is the step
            meas = statistics.median(rounds)
            a, p, q = priced[name]
            rows.append({"case": case_name, "strategy": name, "predicted_analytic_ms": a * 1e3,
                         "predicted_profile_ms": p * 1e3, "predicted_profile_probe_ms": q * 1e3,
                         "measured_ms": meas * 1e3, "measured_spread": (max(rounds) - min(rounds)) / meas,
                         "analytic_ratio": a / meas, "profile_ratio": p / meas,
                         "profile_probe_ratio": q / meas, "within_10pct": abs(p / meas - 1) <= 0.10,
                         "probe_within_10pct": abs(q / meas - 1) <= 0.10})
    print("== step time on 2 gloo ranks (1 thread each): predicted (analytic / from the CPU block profile) vs "
          "measured ==")
    print_table(rows, ["case", "strategy", "predicted_analytic_ms", "predicted_profile_ms",
                       "predicted_profile_probe_ms", "measured_ms", "measured_spread", "analytic_ratio",
                       "profile_ratio",
                       "profile_probe_ratio"])
    print("== optimizer step (AdamW): the profile's per-layer steps summed vs one step over the whole model ==")
    print_table(steps, ["case", "profile_step_sum_ms", "whole_model_step_ms", "ratio"])
    med = {k: statistics.median(abs(r[f"{k}_ratio"] - 1) for r in rows) for k in ("analytic", "profile",
                                                                                  "profile_probe")}
    hit = {k: sum(r[c] for r in rows)
           for k, c in (("profile", "within_10pct"), ("profile_probe", "probe_within_10pct"))}
    print(f"within 10 % of the measured step: profile {hit['profile']}/{len(rows)}, profile + probed link "
          f"{hit['profile_probe']}/{len(rows)}; median |error|: analytic {100 * med['analytic']:.1f} %, profile "
          f"{100 * med['profile']:.1f} %, profile + probed link {100 * med['profile_probe']:.1f} %")
    summary = {"optimizer_step": steps, "within_10pct": hit, "rows": len(rows), "median_abs_err": med,
               "probed_link": link, "elapsed_s": time.perf_counter() - t0}
    print(f"wrote {write_results('measured_blocks', rows, summary)} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
