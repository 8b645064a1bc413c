"""Pipeline schedules at run time: 1F1B vs ZB-H1 vs GPipe on gloo ranks (pp 2 and pp 4), measured vs predicted.

A small GPT (CFG) trains pipeline-parallel on `pp` local gloo processes, each schedule under the plan
`autopar.estimate` makes of `Strategy(pp=pp, schedule=s, microbatch_size=MB)` on "1x{pp}xcpu" (so the
timed plan is the priced plan: same layer split, same micro-batches). All schedules of one pp run in the
same processes (one Program each), WARMUP steps each, then REPS blocks of STEPS timed steps per schedule in
alternating order; a step is timed on every rank between barriers and the step time is the slowest rank's;
step_s is the median over the schedule's timed steps, vs_1f1b the median over blocks of the ratio of the
block's median to the adjacent 1F1B block's. Also measured: each rank's compute seconds per step (F, B and W actions,
runtime/straggler.py's StageTimer): compute_s, the ranks' mean, and bubble = 1 - compute_s / step_s.

Two settings per pp. "cpu": the ranks compute on this machine's cores (few, shared: with more ranks than
free cores, a rank waiting in a bubble frees its core for another, so bubbles cost less wall time than on
devices of their own). "emulated": every rank's compute actions also sleep (SLOW - 1) x their duration
(AUTOPAR_EMULATE_SLOWDOWN, straggler.py), i.e. devices SLOW times slower whose time is mostly their own,
not the host's; there the schedules' bubbles show as they would on separate devices.

Predicted columns are the cost model's (`plan.predicted["step_time_s"]`, "bubble_fraction") for the plan on
"cpu" devices: predictions, not measurements; compare their ratios (zb_h1 / 1f1b) with the measured ratios.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from common import print_table, write_results

import autopar
from autopar import models
from autopar.errors import AutoparError
from autopar.ir.plan import Strategy
from autopar.runtime.launch import spawn_local
from autopar.runtime.program import Program
from autopar.runtime.straggler import SLOWDOWN_ENV

CFG = dict(hidden=256, layers=4, heads=4, seq=32, batch=16, vocab=128)
MB = 2  # micro-batch size: 8 micro-batches per step
SCHEDULES = ("1f1b", "zb_h1", "gpipe")
WARMUP = 1  # steps per schedule before timing
STEPS = 2  # timed steps per block
REPS = 6  # blocks per schedule, alternating ABC CBA ...: drift of a loaded machine spreads over all three
SLOW = 4.0  # "emulated": compute actions take SLOW x their time, (SLOW - 1) / SLOW of it asleep
SETTINGS = [(2, 1.0), (4, 1.0), (2, SLOW), (4, SLOW)]


def build() -> models.ModelCase:
    return models.gpt(**CFG, seed=0)


def optimizer(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def estimates(pp: int) -> dict[str, Any]:
    """Schedule -> the plan `autopar.estimate` prices for it (fp32, on pp cpu devices)."""
    case = build()
    out = {}
    for s in SCHEDULES:
        est = autopar.estimate(case.model, f"1x{pp}xcpu", Strategy(pp=pp, schedule=s, microbatch_size=MB),
                               case.example_inputs, case.example_target, case.loss_fn, precision="fp32")
        out[s] = est.plan
    return out


def worker(rank: int, world: int, plans: dict[str, Any], slow: float) -> dict[str, dict[str, list]]:
    if slow > 1.0:
        os.environ[SLOWDOWN_ENV] = ",".join(f"{r}:{slow}" for r in range(world))
    progs = {}
    for s in SCHEDULES:
        case = build()
        progs[s] = (case, Program(case.model, plans[s], case.example_inputs, case.example_target, case.loss_fn,
                                  optimizer, rank, world, timeout_s=120, kernels="torch"))
    out: dict[str, dict[str, list]] = {s: {"times": [], "compute": []} for s in SCHEDULES}

    def step(s: str, timed: bool) -> None:
        case, prog = progs[s]
        dist.barrier()
        t = time.perf_counter()
        prog.step(*case.example_inputs, target=case.example_target)
        dist.barrier()
        if timed:
            out[s]["times"].append(time.perf_counter() - t)
            out[s]["compute"].append(prog.timer.steps[-1])

    for s in SCHEDULES:
        for _ in range(WARMUP):
            step(s, False)
    for rep in range(REPS):  # blocks of STEPS steps per schedule, the order reversed every other repetition
        for s in (SCHEDULES if rep % 2 == 0 else SCHEDULES[::-1]):
            for _ in range(STEPS):
                step(s, True)
    return out


def measure(pp: int, slow: float, plans: dict[str, Any]) -> list[dict]:
    per_rank = spawn_local(worker, pp, plans, slow, timeout_s=600)
    n = REPS * STEPS
    # a step lasts as long as its slowest rank's (the barriers make them about equal)
    steps = {s: [max(per_rank[r][s]["times"][k] for r in range(pp)) for k in range(n)] for s in SCHEDULES}
    rows = []
    for s in SCHEDULES:
        busy = [statistics.mean(per_rank[r][s]["compute"][k] for r in range(pp)) for k in range(n)]
        step = statistics.median(steps[s])
        # the ratio to 1F1B: median over repetitions of the paired per-block medians (drift cancels)
        blocks = [statistics.median(steps[s][i:i + STEPS]) / statistics.median(steps["1f1b"][i:i + STEPS])
                  for i in range(0, n, STEPS)]
        p = plans[s].predicted
        rows.append({"pp": pp, "setting": "cpu" if slow == 1.0 else f"emulated x{slow:g}", "schedule": s,
                     "step_s": step, "vs_1f1b": statistics.median(blocks), "vs_1f1b_blocks": blocks,
                     "compute_s": statistics.median(busy), "bubble": 1.0 - statistics.median(busy) / step,
                     "pred_step_s": p["step_time_s"], "pred_bubble": p.get("bubble_fraction")})
    for r in rows:
        r["pred_vs_1f1b"] = r["pred_step_s"] / rows[0]["pred_step_s"]
    return rows


def main() -> None:
    start = time.perf_counter()
    rows: list[dict] = []
    priced = {pp: estimates(pp) for pp in sorted({pp for pp, _ in SETTINGS})}
    try:
        for pp, slow in SETTINGS:
            rows += measure(pp, slow, priced[pp])
    except AutoparError as e:
        print(e, file=sys.stderr)
        raise SystemExit(1) from None
    print(f"GPT hidden {CFG['hidden']}, {CFG['layers']} blocks, batch {CFG['batch']} x {CFG['seq']} tokens, "
          f"micro-batches of {MB} ({CFG['batch'] // MB} per step), fp32, one gloo rank per stage; median step over "
          f"{REPS * STEPS} timed steps per schedule ({REPS} alternating blocks of {STEPS} after {WARMUP} warm-up; "
          f"vs_1f1b: median of the blocks' paired ratios); "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; pred_*: the cost model's predictions "
          f"for 'cpu' devices")
    print_table(rows, ["pp", "setting", "schedule", "step_s", "vs_1f1b", "compute_s", "bubble", "pred_step_s",
                       "pred_vs_1f1b", "pred_bubble"])
    summary = {f"pp{r['pp']}-{r['setting']}-{r['schedule']}": {k: r[k] for k in (
        "step_s", "vs_1f1b", "compute_s", "bubble", "pred_step_s", "pred_vs_1f1b", "pred_bubble")} for r in rows}
    summary["setup"] = {**CFG, "microbatch_size": MB, "warmup": WARMUP, "steps": STEPS, "reps": REPS, "slowdown": SLOW,
                        "cores": os.cpu_count(), "load_average": os.getloadavg()[0],
                        "seconds": time.perf_counter() - start}
    print("wrote", write_results("zero_bubble", rows, summary))


if __name__ == "__main__":
    main()
