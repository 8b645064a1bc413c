"""Asynchronous training on a 2-speed emulated cluster: sync vs 2bw (flushed and flushless) vs wsp
(runtime/asynchronous.py, runtime/flushless.py), measured next to the planner's predictions.

Two gloo ranks train a small GPT; rank 1 emulates a device SLOW times slower (AUTOPAR_EMULATE_SLOWDOWN:
each of its forwards and backwards sleeps (SLOW - 1) x its duration, straggler.py). Layouts:

* "pp2": a 2-stage 1F1B pipeline (M micro-batches; the slow rank holds stage 1). Modes: synchronous
  (Program), 2bw flushed (AsyncProgram: each wave the plan's 1F1B, drained), 2bw flushless (FlushlessProgram:
  2BW's cross-wave 1F1B, what `compile(sync="2bw")` runs on this layout), wsp with staleness 2.
* "dp2": two one-stage replicas (HetPipe's setting: replicas of different speed). Modes: sync, 2bw
  (AsyncProgram: the flushless schedule needs >= 2 stages), wsp D=2.

Each run trains STEPS steps from the same initial weights on the same stream of batches (a fixed pool of
synthetic next-token sequences with structure to learn: token t+1 = (a * token t + b) mod vocab per
sequence). Measured: samples/s over the timed steps (after WARMUP; an asynchronous mode's pending updates are
flushed inside the timed window, so no work is left out), the median of RUNS alternating runs (drift of a
loaded machine spreads evenly), the global loss of the last wave and the mean of the last 5 (a convergence
benchmark: what each update rule reaches after STEPS steps, no claim that the rules converge alike in
general). Predicted (labelled so: predictions of the cost model, not measurements): the step time of the
same plan priced by `autopar.estimate` on a cluster whose device 1 is the measured CPU at 1/SLOW of its
compute and memory rates (the emulation's figure), and each mode's wave from `predicted_wave`.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
from common import print_table, write_results

import autopar
from autopar import Strategy, models
from autopar.cluster import device_spec
from autopar.errors import AutoparError
from autopar.ir.plan import Plan
from autopar.runtime.asynchronous import AsyncProgram
from autopar.runtime.flushless import FlushlessProgram
from autopar.runtime.launch import spawn_local
from autopar.runtime.program import Program
from autopar.runtime.straggler import SLOWDOWN_ENV
from autopar.solver.asynchronous import flushless_problems, predicted_wave

CFG = dict(hidden=128, layers=2, seq=32, batch=16, vocab=64)
SLOW = 2.0  # rank 1 emulates a device this many times slower
STEPS = int(os.environ.get("ASYNC_BENCH_STEPS", 40))
WARMUP = 2
RUNS = 3
POOL = 8  # distinct batches, cycled
LR = 3e-3
M = 4  # micro-batches per wave in the pipeline layout
LAYOUTS = {"pp2": Strategy(pp=2, microbatch_size=CFG["batch"] // M), "dp2": Strategy(dp=2)}
# (mode label, program class, sync, staleness), per layout
MODES: dict[str, list[tuple[str, type, str, int | None]]] = {
    "pp2": [("sync", Program, "sync", None), ("2bw flushed", AsyncProgram, "2bw", None),
            ("2bw flushless", FlushlessProgram, "2bw", None), ("wsp D=2", AsyncProgram, "wsp", 2)],
    "dp2": [("sync", Program, "sync", None), ("2bw", AsyncProgram, "2bw", None), ("wsp D=2", AsyncProgram, "wsp", 2)],
}


def cluster() -> dict:
    """The emulated cluster as the planner sees it: the measured CPU, and one at 1/SLOW of its rates."""
    fast = device_spec("cpu").to_dict()
    slow = {"name": "cpu-slow", "based_on": "cpu", "memory_GiB": fast["memory_GiB"],
            "memory_bandwidth_GBps": fast["memory_bandwidth_GBps"] / SLOW,
            **{k: fast[k] / SLOW for k in ("tflops_fp32", "tflops_tf32", "tflops_bf16", "tflops_fp16")}}
    return {"nodes": [{"device": "cpu", "devices_per_node": 1}, {"device": slow, "devices_per_node": 1}]}


def batches(vocab: int, batch: int, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(POOL):
        a = torch.randint(1, vocab, (batch, 1), generator=g)
        b = torch.randint(0, vocab, (batch, 1), generator=g)
        x0 = torch.randint(0, vocab, (batch, 1), generator=g)
        seqs = [x0]
        for _ in range(seq):
            seqs.append((a * seqs[-1] + b) % vocab)
        toks = torch.cat(seqs, dim=1)
        out.append((toks[:, :-1].contiguous(), toks[:, 1:].contiguous()))
    return out


def optimizer(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def predictions() -> dict[str, tuple[str, dict[str, float]]]:
    """Per layout: the estimated plan (JSON) and each mode's predicted seconds per step (predictions)."""
    out = {}
    for layout, strategy in LAYOUTS.items():
        case = models.gpt(**CFG, seed=0)
        plan = autopar.estimate(case.model, cluster(), strategy, case.example_inputs, case.example_target,
                                case.loss_fn, optimizer="adamw").plan
        steps = {}
        for label, cls, sync, staleness in MODES[layout]:
            if cls is Program:
                steps[label] = plan.predicted["step_time_s"]
            elif cls is FlushlessProgram:
                why = flushless_problems(plan, sync)
                if why:
                    raise AutoparError(f"{layout}: the flushless schedule does not run {', '.join(why)}")
                steps[label] = predicted_wave(plan, 1, sync)
            else:  # flushed: each wave the plan's schedule, its sync tail hidden behind the next D waves
                steps[label] = predicted_wave(plan, staleness or 1)
        out[layout] = (plan.to_json(), steps)
    return out


def worker(rank: int, world: int, plans: dict[str, str]) -> list[dict]:
    os.environ[SLOWDOWN_ENV] = f"1:{SLOW}"
    data = batches(CFG["vocab"], CFG["batch"], CFG["seq"])
    rows = []
    for run in range(RUNS):
        for layout, plan_json in plans.items():
            modes = MODES[layout] if run % 2 == 0 else MODES[layout][::-1]
            for label, cls, sync, staleness in modes:
                case = models.gpt(**CFG, seed=0)
                g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
                args = (case.model, Plan.from_json(plan_json), case.example_inputs, case.example_target,
                        case.loss_fn, optimizer, rank, world)
                prog = cls(*args, timeout_s=120, graph=g) if cls is Program else \
                    cls(*args, timeout_s=120, graph=g, sync=sync, staleness=staleness)
                losses = []
                t0 = 0.0
                for step in range(STEPS):
                    if step == WARMUP:
                        torch.distributed.barrier()
                        t0 = time.perf_counter()
                    x, y = data[step % POOL]
                    losses.append(prog.step(x, target=y))
                if isinstance(prog, AsyncProgram):
                    prog.flush()
                    losses = [prog.losses[c] for c in range(STEPS)]
                elapsed = time.perf_counter() - t0
                rows.append({"layout": layout, "mode": label, "runtime": type(prog).__name__, "run": run,
                             "seconds": elapsed, "final_loss": losses[-1], "last5_loss": sum(losses[-5:]) / 5})
                torch.distributed.barrier()
    return rows


def main() -> None:
    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    predicted = predictions()
    try:
        per_rank = spawn_local(worker, 2, {k: v[0] for k, v in predicted.items()}, timeout_s=600)
    except AutoparError as e:
        print(e, file=sys.stderr)
        raise SystemExit(1) from None
    rows = []
    timed = (STEPS - WARMUP) * CFG["batch"]
    for layout in LAYOUTS:
        for label, _, _, _ in MODES[layout]:
            runs = [(a, b) for a, b in zip(*per_rank, strict=True) if (a["layout"], a["mode"]) == (layout, label)]
            # a run ends when the slower rank's work is done; samples/s: the median over the runs
            rates = [timed / max(a["seconds"], b["seconds"]) for a, b in runs]
            r0 = runs[0][0]
            if any(r[0]["final_loss"] != r0["final_loss"] for r in runs):
                raise AutoparError(f"{layout} {label}: runs of the same rule ended at different losses "
                                   f"({[r[0]['final_loss'] for r in runs]}): the run is not deterministic")
            rate = statistics.median(rates)
            pred = predicted[layout][1][label]
            rows.append({"layout": layout, "mode": label, "runtime": r0["runtime"], "samples_per_s": rate,
                         "samples_per_s_runs": rates, "step_s": CFG["batch"] / rate, "predicted_step_s": pred,
                         "predicted_samples_per_s": CFG["batch"] / pred, "final_loss": r0["final_loss"],
                         "last5_loss": r0["last5_loss"]})
    for layout in LAYOUTS:
        same = [r for r in rows if r["layout"] == layout]
        for r in same:
            r["throughput_vs_sync"] = r["samples_per_s"] / same[0]["samples_per_s"]
            r["predicted_speedup_vs_sync"] = same[0]["predicted_step_s"] / r["predicted_step_s"]
    wall = time.perf_counter() - t_start
    print(f"GPT hidden {CFG['hidden']}, {CFG['layers']} blocks, batch {CFG['batch']} x {CFG['seq']} tokens on 2 "
          f"gloo ranks, rank 1 emulated {SLOW:g}x slower; pp2: 2 stages, {M} micro-batches; dp2: 2 replicas. "
          f"{STEPS} steps; measured: samples/s over the last {STEPS - WARMUP} (median of {RUNS} alternating runs), "
          f"loss of the last step and mean of the last 5. predicted_*: the cost model's predictions for the same "
          f"plan on a cluster whose device 1 has 1/{SLOW:g} of the measured CPU's rates (predictions, not "
          f"measurements). Load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; wall {wall:.0f} s")
    print_table(rows, ["layout", "mode", "runtime", "samples_per_s", "throughput_vs_sync", "step_s",
                       "predicted_step_s", "predicted_speedup_vs_sync", "final_loss", "last5_loss"])
    summary = {f"{r['layout']} {r['mode']}": {k: r[k] for k in ("runtime", "samples_per_s", "throughput_vs_sync",
                                                                 "predicted_step_s", "predicted_speedup_vs_sync",
                                                                 "final_loss", "last5_loss")} for r in rows}
    summary["setup"] = {**CFG, "slowdown": SLOW, "steps": STEPS, "warmup": WARMUP, "runs": RUNS, "lr": LR,
                        "microbatches_pp2": M, "load_average": load_before, "wall_s": wall,
                        "note": "predicted_* are cost-model predictions, not measurements"}
    print("wrote", write_results("async", rows, summary))


if __name__ == "__main__":
    main()
