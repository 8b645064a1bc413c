"""The plan checks itself: each rank measures its peak memory and its step times against the plan's predictions.

A `PlanCheck` opens a measurement window on the rank's device before the program is built and closes it after
the first `steps` training steps:

* on a CUDA device, the caching allocator's own counters (`max_memory_allocated` above what was allocated when
  the window opened; no profiler, so no cost beyond two synchronizations);
* on the CPU, the allocator's events (torch.profiler with `profile_memory=True`, runtime/memtrace.py): the
  running sum of live tensor bytes allocated inside the window. The profiler costs time while the window is
  open (compile and the first steps only; bench/runtime.py measures it). When a profiler is already running
  (a user's, or a benchmark's own window) the CPU window is not opened: torch's profiler does not nest.

The window's peak is compared with `plan.predicted["peak_memory_bytes"][rank]`, plus, on a rank computing on
the CPU, `predicted["host_overlap_bytes"][rank]`: what the device offloads to the host is then in the same
allocator (an accelerator's stages on a machine without CUDA, the gloo stand-in, measures its offloaded
optimizer's host copies with its device tensors; solver/pricing/plan.py `rank_shared` prices how they overlap).
A rank whose peak exceeds its prediction by more than `tolerance` (15 %) plus FIXED_BYTES (1 MiB), or the
capacity of a device the plan said it fits on, gets a `PlanDriftWarning` naming the rank, the figures and the
plan options of its stages. Step times are wall seconds per `step()` call (the loss read at its end waits for
the device), against `predicted["step_time_s"]`, and each stage's forward + backward compute seconds per step
(the program's StageTimer, runtime/straggler.py: CUDA events on a GPU) against the stage's
`predicted["compute_s"]`; times are for the report only: a cost model's time on a shared host is not a promise
the way memory is.

`Program.report()` gathers every rank's figures (a collective: call it on every rank) and returns a
`RunReport`, printed as a table by `str()`.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import PlanDriftWarning
from .memtrace import OPEN_WINDOWS, MemoryTrace, end_open_windows, track_memory

TOLERANCE = 0.15
# bytes a rank allocates whatever the plan (captured constants, index and scalar tensors, the loss): on a model
# whose whole plan is a few MiB they are a large fraction that no per-tensor price rounds to
FIXED_BYTES = 2**20
STEPS = 3  # steps inside the memory window: the optimizer's state exists from the first step's end


@dataclass
class StageFigures:
    """One stage a rank computes: its predicted and measured forward + backward compute seconds per step."""

    stage: str  # "stage 1" or "replica 0 stage 1"
    predicted_compute_s: float | None  # the plan's `compute_s` of the stage (None: the plan has none)
    measured_compute_s: float | None  # median over the timed steps (StageTimer; None: no step ran)


@dataclass
class RankFigures:
    """One rank's predicted and measured figures."""

    rank: int
    device: str  # the cluster's device name
    stages: list[str]  # "stage 0 layers [0, 3): zero 1, recompute" per stage the rank computes
    predicted_peak_bytes: int
    capacity_bytes: int
    measured_peak_bytes: int | None  # None: not measured (window not opened, or still open)
    predicted_step_s: float
    step_seconds: list[float] = field(default_factory=list)  # the latest steps' wall seconds
    window_steps: int = 0  # steps run while the memory window was open (the profiler slows them on the CPU)
    not_measured: str = ""  # why the memory was not measured
    peak_in: str = ""  # the allocation that reached the peak (CPU only)
    stage_times: list[StageFigures] = field(default_factory=list)  # filled by `Program.report()`

    @property
    def ratio(self) -> float | None:
        if self.measured_peak_bytes is None or not self.predicted_peak_bytes:
            return None
        return self.measured_peak_bytes / self.predicted_peak_bytes

    @property
    def timed_steps(self) -> list[float]:
        """The steps after the window when there are any (the first steps also warm up), else all."""
        after = self.step_seconds[self.window_steps:]
        return after or self.step_seconds

    @property
    def measured_step_s(self) -> float | None:
        return statistics.median(self.timed_steps) if self.step_seconds else None

    def drift(self, tolerance: float = TOLERANCE) -> str:
        """Why this rank's memory drifted from the plan ("" when it did not)."""
        m = self.measured_peak_bytes
        if m is None:
            return ""
        problems = []
        p, cap = self.predicted_peak_bytes, self.capacity_bytes
        if p and m > (1 + tolerance) * p + FIXED_BYTES:
            problems.append(f"{m / p:.2f}x its predicted peak")
        if cap and m > cap and p <= cap:  # a plan priced over capacity was already refused or warned about
            problems.append(f"over the device's capacity of {_mib(cap)}")
        return " and ".join(problems)


def of_rank(per_device: dict, rank: int) -> int:
    """`rank`'s entry of a predicted per-device figure (int keys, or str ones from JSON), 0 without one."""
    return int(per_device.get(rank, per_device.get(str(rank), 0)) or 0)


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


@dataclass
class RunReport:
    """Every rank's figures; `str()` is the table `Program.report()` prints."""

    ranks: list[RankFigures]
    tolerance: float = TOLERANCE

    def drifted(self) -> list[int]:
        return [r.rank for r in self.ranks if r.drift(self.tolerance)]

    def table(self) -> str:
        from ..report import render_table

        rows = [["rank", "device", "stages", "predicted peak", "measured peak", "measured/predicted",
                 "predicted step", "measured step", ""]]
        for r in self.ranks:
            ratio = r.ratio
            step = r.measured_step_s
            rows.append([str(r.rank), r.device, "; ".join(r.stages), _mib(r.predicted_peak_bytes),
                         _mib(r.measured_peak_bytes) if r.measured_peak_bytes is not None else
                         f"n/a ({r.not_measured})", f"{ratio:.2f}" if ratio is not None else "",
                         f"{r.predicted_step_s * 1e3:.3g} ms",
                         f"{step * 1e3:.3g} ms" if step is not None else "n/a",
                         "DRIFT: " + r.drift(self.tolerance) if r.drift(self.tolerance) else ""])
        n = max((len(r.timed_steps) for r in self.ranks), default=0)
        stage_rows = [["rank", "stage", "predicted compute", "measured compute", "measured/predicted"]]
        for r in self.ranks:
            for t in r.stage_times:
                p, m = t.predicted_compute_s, t.measured_compute_s
                stage_rows.append([str(r.rank), t.stage, f"{p * 1e3:.3g} ms" if p is not None else "n/a",
                                   f"{m * 1e3:.3g} ms" if m is not None else "n/a",
                                   f"{m / p:.2f}" if p and m is not None else ""])
        stages = ("\n" + render_table(stage_rows, right={2, 3, 4})
                  + "\n(compute: forward + backward seconds of the stage per step, median over the timed steps; "
                    "waits for transfers and collectives excluded)") if len(stage_rows) > 1 else ""
        return render_table(rows, right={3, 4, 5, 6, 7}) + stages + (
            f"\n(peak: live tensor bytes over compile and the first steps, at the allocator; step: median wall "
            f"time of {n} step(s); drift: measured peak over {1 + self.tolerance:.2f}x the prediction or over "
            f"the device's capacity)")

    def __str__(self) -> str:
        return self.table()


def stage_options(plan: Any, rank: int) -> list[str]:
    """The plan's options for each stage `rank` computes, as the drift warning names them."""
    out = []
    for p_idx, pipe in enumerate(plan.pipelines):
        for s_idx, st in enumerate(pipe.stages):
            if rank not in st.devices:
                continue
            opts = [f"schedule {plan.schedule}"] if len(pipe.stages) > 1 else []
            if st.tp > 1:
                opts.append(f"tp {st.tp}")
            if st.cp > 1:
                opts.append(f"cp {st.cp} {st.cp_attention}")
            if st.zero:
                opts.append(f"zero {st.zero}")
            if st.recompute:
                opts.append("recompute" if st.recompute is True else f"recompute {st.recompute}")
            if st.offload:
                opts.append("offload " + "+".join(st.offload))
            if pipe.num_microbatches > 1:
                opts.append(f"m={pipe.num_microbatches}")
            where = f"replica {p_idx} " if len(plan.pipelines) > 1 else ""
            out.append(f"{where}stage {s_idx} layers [{st.layers[0]}, {st.layers[1]})"
                       + (": " + ", ".join(opts) if opts else ""))
    return out


def stage_times(plan: Any, pipeline: int, rank: int, stage_steps: list[dict[Any, float]]
                ) -> list[StageFigures]:
    """Predicted vs measured compute of each stage of `plan.pipelines[pipeline]` that `rank` computes, from
    `stage_steps` (StageTimer.stage_steps: the steps to take the median of, seconds by stage index)."""
    pipe = plan.pipelines[pipeline]
    where = f"replica {pipeline} " if len(plan.pipelines) > 1 else ""
    out = []
    for s_idx, st in enumerate(pipe.stages):
        if rank not in st.devices:
            continue
        predicted = st.predicted.get("compute_s") if st.predicted else None
        measured = statistics.median(step.get(s_idx, 0.0) for step in stage_steps) if stage_steps else None
        out.append(StageFigures(f"{where}stage {s_idx}", float(predicted) if predicted is not None else None,
                                measured))
    return out


class PlanCheck:
    """One rank's measurement window over program construction and the first `steps` steps."""

    def __init__(self, plan: Any, rank: int, device: torch.device, steps: int = STEPS,
                 tolerance: float = TOLERANCE) -> None:
        self.plan, self.rank, self.device = plan, rank, torch.device(device)
        self.steps, self.tolerance = steps, tolerance
        predicted = plan.predicted or {}
        peaks = predicted.get("peak_memory_bytes") or {}
        caps = predicted.get("memory_capacity_bytes") or {}
        peak = of_rank(peaks, rank)
        # the host's share is in this allocator too
        self._overlap = of_rank(predicted.get("host_overlap_bytes") or {}, rank) if self.device.type == "cpu" else 0
        if peak:
            peak += self._overlap
        self.figures = RankFigures(
            rank, plan.device_names().get(rank, "?"), stage_options(plan, rank), peak, of_rank(caps, rank),
            None, float(predicted.get("step_time_s") or 0.0))
        self._window: contextlib.ExitStack | None = None
        self._trace: MemoryTrace | None = None
        self._step_start: float | None = None

    def open(self) -> PlanCheck:
        end_open_windows()  # an earlier program's window gives way; only a foreign profiler stops this one
        if self.device.type != "cuda" and torch.autograd._profiler_enabled():
            self.figures.not_measured = "another profiler was running"
            return self
        if self.device.type == "cuda" and not torch.cuda.is_available():
            self.figures.not_measured = "no CUDA"
            return self
        trace = contextlib.ExitStack()
        self._trace = trace.enter_context(track_memory(self.device))
        self._window = trace
        if self.device.type != "cuda":
            OPEN_WINDOWS.add(self.give_way)
        return self

    def abandon(self, why: str = "the program was not built") -> None:
        """Close the window without a verdict: what it held is not the plan's to answer for (`why`)."""
        OPEN_WINDOWS.discard(self.give_way)
        if self._window is not None:
            self._window.close()
            self._window = None
            self.figures.not_measured = why

    def give_way(self) -> None:
        """End the window early for another profiler window: its figures are kept, without a verdict (the
        other window's owner measures what it wants; the steps after are not in this one)."""
        self.close(warn=False)

    def predict(self, peak_bytes: int, what: str) -> None:
        """A wrapper of the program holds `what` too (re-routing's pre-step copy): its priced peak, which
        includes it, is the one to compare with."""
        self.figures.predicted_peak_bytes = int(peak_bytes) + self._overlap
        self.figures.stages.append(what)

    def step_started(self) -> None:
        self._step_start = time.perf_counter()

    def step_done(self) -> None:
        if self._step_start is not None:
            self.figures.step_seconds.append(time.perf_counter() - self._step_start)
            self._step_start = None
            if len(self.figures.step_seconds) > 64 + self.figures.window_steps:
                del self.figures.step_seconds[self.figures.window_steps]
        if self._window is not None and len(self.figures.step_seconds) >= self.steps:
            self.close()

    def close(self, warn: bool = True) -> None:
        """End the window, record its peak and warn when it drifted from the plan: after `steps` steps, at
        `report()`, when the program is garbage-collected, or when another window opens (the profiler does
        not nest: a second program's compile, a benchmark's own `track_memory`)."""
        OPEN_WINDOWS.discard(self.give_way)
        if self._window is None:
            return
        self._window.close()
        self._window = None
        self.figures.window_steps = len(self.figures.step_seconds)
        assert self._trace is not None
        self.figures.measured_peak_bytes = int(self._trace.peak_bytes)
        self.figures.peak_in = self._trace.peak_label
        why = self.figures.drift(self.tolerance)
        if why and warn:
            f = self.figures
            warnings.warn(PlanDriftWarning(
                f"rank {f.rank} ({f.device}) peaked at {_mib(f.measured_peak_bytes or 0)} of live tensors over "
                f"compile and {len(f.step_seconds)} step(s), {why} ({_mib(f.predicted_peak_bytes)} predicted, "
                f"capacity {_mib(f.capacity_bytes)}); its plan: {'; '.join(f.stages) or 'no stage'}"
                f"{'; the peak was reached in ' + f.peak_in if f.peak_in else ''}. The memory model priced this "
                f"plan wrong: please report it with prog.report(); zero=, recompute= or offload= leave more "
                f"room."), stacklevel=3)

    def report(self, world: int, group: Any = None) -> RunReport:
        """Every rank's figures (gathered over `group`, a gloo group of the world, when world > 1)."""
        return gathered_report(self.figures, world, group, self.tolerance)


def gathered_report(mine: RankFigures, world: int, group: Any = None, tolerance: float = TOLERANCE) -> RunReport:
    """Every rank's figures, this rank's `mine` among them (all-gathered over `group` when world > 1)."""
    if world <= 1:
        return RunReport([mine], tolerance)
    import torch.distributed as dist

    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    return RunReport(sorted(gathered, key=lambda r: r.rank), tolerance)


__all__ = ["PlanCheck", "PlanDriftWarning", "RankFigures", "RunReport", "STEPS", "StageFigures", "TOLERANCE",
           "gathered_report", "of_rank", "stage_options", "stage_times"]
