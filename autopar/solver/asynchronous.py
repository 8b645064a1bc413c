"""Delayed updates as the planner sees them (`autopar.plan(..., sync=...)`, `compile(plan=..., sync=...)`): the
sync modes and their delay, what in a plan each runtime runs (`plan_problems`, `flushless_problems`), which
program class trains it (`runtime_of`), its predicted wave (`predicted_wave`, `flushless_wave`: predictions
from the plan's simulated schedule), and the choice between synchronous and delayed training
(`choose_async`, `force_async`). Their memory is solver/async_memory.py and solver/flushless_memory.py; what
runs is runtime/asynchronous.py (AsyncProgram) and runtime/flushless.py (FlushlessProgram), which read this
module and never the other way round.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from ..errors import PlanError
from ..ir.schedule_waves import steady_wave_time

SYNC_MODES = ("sync", "2bw", "wsp")


def delay_of(sync: str, staleness: int | None) -> int:
    """The update delay D of a sync mode (0: synchronous); PlanError on a bad mode or staleness."""
    if sync not in SYNC_MODES:
        raise PlanError(f"sync={sync!r}: choose one of {', '.join(map(repr, SYNC_MODES))} ('sync' trains "
                        f"synchronously; '2bw' and 'wsp' apply delayed updates, autopar/runtime/asynchronous.py).")
    if staleness is not None and (isinstance(staleness, bool) or not isinstance(staleness, int)):
        raise PlanError(f"staleness={staleness!r}: give a whole number of waves (>= 1), or None.")
    if sync == "sync":
        if staleness not in (None, 0):
            raise PlanError(f"staleness={staleness} with sync='sync': synchronous training has no staleness; "
                            f"pass sync='wsp' to train with a delay of {staleness} waves.")
        return 0
    if sync == "2bw":
        if staleness not in (None, 1):
            raise PlanError(f"sync='2bw' applies updates exactly one step late (staleness 1), got "
                            f"staleness={staleness}; use sync='wsp', staleness={staleness} for a longer delay.")
        return 1
    d = 1 if staleness is None else staleness
    if d < 1:
        raise PlanError(f"sync='wsp' needs staleness >= 1 (waves a pipeline may run ahead), got {d}; "
                        f"staleness 0 is synchronous training: sync='sync'.")
    return d


def flushless_problems(plan: Any, sync: str) -> list[str]:
    """What in (plan, sync) the flushless runtime does not run (empty: FlushlessProgram runs it)."""
    problems = [] if sync == "2bw" else [f"sync={sync!r} (the flushless schedule runs sync='2bw')"]
    if plan.schedule != "1f1b":
        problems.append(f"the {plan.schedule!r} schedule (flushless runs 1f1b)")
    if any(len(p.stages) < 2 for p in plan.pipelines):
        problems.append("a pipeline of one stage (nothing to overlap)")
    return problems + plan_problems(plan)  # ZeRO 0/1 and any tensor-parallel degree run, as in AsyncProgram


def flushless_wave(plan: Any) -> float | None:
    """Predicted seconds per wave of `plan` under the flushless schedule (a prediction: the steady state of
    `schedule_waves.steady_wave_time` from the stages' predicted fwd/bwd (a micro-batch's mean over the
    full and one-sample-smaller ones), send and gradient-sync seconds, the sync on the comm stream);
    the slowest pipeline sets the pace. None where the flushless runtime does not run the plan."""
    if flushless_problems(plan, "2bw"):
        return None
    waves = []
    for pipe in plan.pipelines:
        m, r = pipe.num_microbatches, pipe.batch_share % pipe.num_microbatches
        full = m if r == 0 else r

        def mean(st: Any, key: str, full: int = full, m: int = m) -> float:
            p = st.predicted
            return (full * p[key] + (m - full) * p.get(key.replace("_s", "_small_s"), p[key])) / m

        st = pipe.stages
        waves.append(steady_wave_time(len(st), m, [mean(s, "fwd_s") for s in st], [mean(s, "bwd_s") for s in st],
                                      [s.predicted.get("send_s", 0.0) for s in st],
                                      [s.predicted.get("sync_s", 0.0) for s in st]))
    return max(waves)


def plan_problems(plan: Any) -> list[str]:
    """What in `plan` delayed updates do not run in this version (empty: AsyncProgram runs it)."""
    stages = [st for p in plan.pipelines for st in p.stages]
    problems = []
    if plan.experts:
        problems.append("expert parallelism")
    if any(st.zero > 1 for st in stages):
        problems.append(f"ZeRO level {max(st.zero for st in stages)}")
    if any(st.offload for st in stages):
        problems.append("CPU offload")
    if plan.precision == "fp16":
        problems.append("fp16 loss scaling (a wave's gradient would be unscaled and inf-checked D updates after "
                        "the scale it was computed with, which this version does not track; bf16 needs no loss "
                        "scale: precision='bf16')")
    return problems


def refusal(sync: str, problems: list[str]) -> str:
    return (f"sync={sync!r} does not support {', '.join(problems)} in this version: delayed updates run with "
            f"ZeRO 0 or 1, no offload, no expert parallelism and fp32/tf32/bf16 (any tensor-parallel degree, "
            f"pipeline depth and data-parallel replicas). Use such a plan (e.g. autopar.Strategy(dp=2, pp=2, "
            f"zero=1)) or sync='sync'.")


def predicted_wave(plan: Any, delay: int, sync: str | None = None) -> float:
    """The predicted seconds per wave of `plan` with updates `delay` waves late (a prediction from the plan's
    simulated schedule): each pipeline's wave ends at its last forward or backward; the gradient sync and
    optimizer step after it (the simulated tail) overlap the next `delay` waves, so the pipeline's wave takes
    max(compute, tail / delay); the staleness bound keeps every pipeline at the slowest one's pace. Where
    `sync` runs the flushless 2BW schedule (runtime/flushless.py), that schedule's steady wave instead."""
    flushless = flushless_wave(plan) if sync == "2bw" else None
    if flushless is not None:
        return flushless
    waves = []
    for r in plan.simulate():
        compute_end = max((end for _, _, name, _, end in r.events if name[:2] in ("F ", "B ")), default=0.0)
        waves.append(max(compute_end, (r.step_time - compute_end) / delay) if delay else r.step_time)
    return max(waves)


# (plan, delay, mode, flushless) -> solver.async_memory.AsyncMemory; flushless: the plan runs the flushless
# 2BW schedule (runtime/flushless.py), whose second weight version and in-flight activations are priced
MemoryPricer = Callable[[Any, int, str, bool], Any]


def runs_flushless(plan: Any, sync: str) -> bool:
    """Whether `compile` trains `plan` with `sync` on the flushless 2BW schedule (FlushlessProgram)."""
    return not flushless_problems(plan, sync)


def runtime_of(plan: Any, sync: str) -> str:
    """The program class that trains `plan` with `sync`, by name (what `predicted["async"]["runtime"]` and
    `explain()` say runs)."""
    return "Program" if sync == "sync" else "FlushlessProgram" if runs_flushless(plan, sync) else "AsyncProgram"


def _record(out: Any, asked: str, delay: int, step: float, sync_step: float, global_batch: int, reason: str,
            mem: Any) -> Any:
    """Write `out.predicted["async"]` (choose_async's docstring); where the asynchronous mode is the one that
    runs (`delay` > 0), `predicted["peak_memory_bytes"]` becomes its peak with the pending wave gradients
    (the synchronous figure kept as the block's "sync_peak_memory_bytes")."""
    block = {"sync": asked if delay else "sync", "asked": asked, "staleness": delay, "step_time_s": step,
             "sync_step_time_s": sync_step, "speedup": sync_step / step, "samples_per_s": global_batch / step,
             "runtime": runtime_of(out, asked) if delay else "Program", "reason": reason,
             "note": "a prediction from the simulated schedule, not a measurement"}
    if mem is not None:  # per device; keys are device indices as strings, as JSON keeps them
        block.update(delay_priced=mem.delay, fits=mem.fits, memory_problems=list(mem.problems),
                     flushless_priced=mem.flushless,
                     pending_gradient_bytes={str(d): b for d, b in mem.pending.items()},
                     second_version_bytes={str(d): b for d, b in mem.versions.items()},
                     peak_memory_bytes={str(d): b for d, b in mem.peak.items()})
        if delay:
            block["sync_peak_memory_bytes"] = {str(d): b for d, b in out.predicted.get("peak_memory_bytes", {}).items()}
            out.predicted["peak_memory_bytes"] = dict(mem.peak)
    out.predicted["async"] = block
    return out


def choose_async(plan: Any, sync: str, staleness: int | None, reprice: Any, memory: MemoryPricer | None = None
                 ) -> Any:
    """The plan for a user who allows `sync`: `plan` (the synchronous search's best) or, where delayed updates
    do not run it (ZeRO 2/3, offload), the same layout at ZeRO <= 1 without offload, `reprice(plan)` returning
    it priced (or None when it does not fit); the asynchronous variant is chosen only when its D pending wave
    gradients fit on every device (`memory`, solver/async_memory.py, when given) and it is predicted faster
    than `plan` synchronously. The chosen plan carries `predicted["async"]` = {"sync": the mode chosen
    ("sync" when not), "asked", "staleness", "step_time_s", "sync_step_time_s" (the synchronous plan's),
    "speedup", "samples_per_s", "runtime" (the program class that trains it: "Program", "AsyncProgram" or
    "FlushlessProgram"), "reason"; with `memory`: "fits", "memory_problems", "flushless_priced",
    "pending_gradient_bytes", "second_version_bytes" (the flushless schedule's; empty where it does not run)
    and "peak_memory_bytes" per device of the asynchronous candidate, and, when it is chosen,
    "sync_peak_memory_bytes" (the top-level figure is then the asynchronous one)}."""
    delay = delay_of(sync, staleness)
    sync_step = plan.predicted["step_time_s"]
    candidate, reason = plan, ""
    problems = plan_problems(plan)
    cp = max((st.cp for p in plan.pipelines for st in p.stages), default=1)
    if cp > 1:  # neither priced nor run with delayed updates
        candidate, reason = None, f"the plan splits sequences (cp={cp}), which trains synchronously"
    elif problems and all(p.startswith(("ZeRO", "CPU offload")) for p in problems):
        variant = copy.deepcopy(plan)
        for st in (st for p in variant.pipelines for st in p.stages):
            st.zero, st.offload = min(st.zero, 1), []
        candidate = reprice(variant)
        reason = "" if candidate is not None else "the plan at ZeRO <= 1 without offload does not fit in memory"
    elif problems:
        candidate, reason = None, refusal(sync, problems)
    mem = (memory(candidate, delay, f"sync={sync!r}", runs_flushless(candidate, sync))
           if candidate is not None and memory is not None else None)
    step = predicted_wave(candidate, delay, sync) if candidate is not None else sync_step
    if mem is not None and not mem.fits:
        what = "pending wave gradients and second weight version" if mem.flushless else "pending wave gradients"
        reason = f"its {what} do not fit: {mem.problems[0]}"
    elif candidate is not None and step >= sync_step:
        reason = "predicted no faster than synchronous training"
    chosen = candidate is not None and step < sync_step and (mem is None or mem.fits)
    out = candidate if chosen else plan
    return _record(out, sync, delay if chosen else 0, step if chosen else sync_step, sync_step, plan.global_batch,
                   reason, mem)


def force_async(plan: Any, sync: str, staleness: int | None, memory: MemoryPricer) -> Any:
    """`plan` to be trained with `sync` whatever the planner would choose (`compile(plan=..., sync=...)`): its
    `predicted["async"]` for that mode and its peak with the pending wave gradients (`_record`); PlanError
    naming each device that does not fit and its bytes."""
    delay = delay_of(sync, staleness)
    problems = plan_problems(plan)
    if problems:
        raise PlanError(refusal(sync, problems))
    mem = memory(plan, delay, f"sync={sync!r}", runs_flushless(plan, sync))
    if not mem.fits:
        raise PlanError(f"{' '.join(mem.problems)} Lower the staleness, shard the optimizer state (zero=1), use more "
                        f"pipeline stages, or train synchronously (sync='sync').")
    sync_step = plan.predicted.get("step_time_s")
    step = predicted_wave(plan, delay, sync) if sync_step is not None else float("nan")
    return _record(plan, sync, delay, step, sync_step if sync_step is not None else float("nan"), plan.global_batch,
                   "forced (compile(sync=...) with a given plan)", mem)


__all__ = ["SYNC_MODES", "MemoryPricer", "choose_async", "delay_of", "flushless_problems", "flushless_wave",
           "force_async", "plan_problems", "predicted_wave", "refusal", "runs_flushless",
           "runtime_of"]
