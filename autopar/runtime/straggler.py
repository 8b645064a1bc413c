"""Stragglers: measured per-rank compute against the plan's prediction, and re-planning around them.

Every Program times its forward and backward actions (`StageTimer`; waits for transfers and collectives
are not counted) and keeps the compute seconds of each step. `Program.straggler_report()` all-gathers the
median over recent steps and sets it against the plan's `compute_s` of the rank's stages: `ratio` =
measured / predicted. Cost models are off by some constant on any machine, so a straggler is a rank
whose ratio stands out from the others: `relative` = ratio / median ratio, a straggler when >= threshold.

`autopar.compile(..., adapt=True)` returns an `AdaptiveProgram`: after a warm-up and a measurement
window it checks the report and, when a rank straggles, plans again on a cluster in which that device
is `relative` times slower (its own device type: FLOP/s and memory bandwidth divided by the factor, its
per-kernel overhead multiplied by it through a compute profile passed to the planner as `profiles=`:
solver/reshare.py `scaled_cluster`, `scaled_profiles`), builds the new program and moves the
full training state into it (`state_dict` / `load_state_dict`), so training continues exactly.

Smaller slowdowns (relative < `AdaptPolicy.shed_below`, default 3) on a plan with several pipelines are
handled without re-planning the cluster: the slow rank's pipeline sheds micro-batches to its
data-parallel peers (solver/reshare.py `shed_plan`: every pipeline's batch share in proportion to its measured speed,
share / its slowest rank's compute seconds per step; the same global batch, micro-batch sizes kept, stages
and devices unchanged), the program is rebuilt for that plan (compile's `reshare`) and the full state moved
over, as for a re-plan, so training still equals single-process training. See reroute.py.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..cluster import Cluster
from ..errors import AutoparError
from ..ir.plan import Plan
from ..solver.reshare import scaled_cluster, scaled_profiles, shed_plan
from .dist import wait
from .protocol import Wrapping

SLOWDOWN_ENV = "AUTOPAR_EMULATE_SLOWDOWN"


def emulated_slowdown(rank: int) -> float:
    """The factor by which this rank emulates a slower device: AUTOPAR_EMULATE_SLOWDOWN="1:4,3:2" makes
    rank 1 four times and rank 3 twice slower (each forward and backward sleeps (f - 1) x its duration)."""
    spec = os.environ.get(SLOWDOWN_ENV, "").strip()
    if not spec:
        return 1.0
    for part in spec.split(","):
        try:
            r, f = part.split(":")
            if int(r) == rank:
                return max(1.0, float(f))
        except ValueError:
            raise AutoparError(f"{SLOWDOWN_ENV}={spec!r}: write rank:factor pairs separated by commas, e.g. "
                               f"'1:4'.") from None
    return 1.0


class StageTimer:
    """Compute seconds of this rank's forward and backward actions, per step and per stage.

    On CUDA the host only launches kernels, so host clocks would time the launches: each compute section
    records a pair of timing events on the current stream instead, and a step's seconds are read from them
    when `steps` is asked for (one wait for the newest event then, none inside a step). Elsewhere (and
    while emulating a slowdown, which sleeps for real time) `time.perf_counter` times the section.
    `device`: where the rank computes (default: CUDA when it is in use in this process); `event`: the timing
    event type (`torch.cuda.Event`). `compute(stage)` charges the section to that stage of the rank's
    pipeline (`stage_steps`: the seconds of each step by stage, what `Program.report()` sets against the
    plan's per-stage `compute_s`)."""

    def __init__(self, rank: int, history: int = 64, device: torch.device | str | None = None,
                 event: Callable[..., Any] | None = None) -> None:
        self.slowdown = emulated_slowdown(rank)
        self.device = torch.device(device) if device is not None else None
        self.event = event
        self.current: dict[int | None, float] = {}  # this step's host-timed seconds by stage
        self._pairs: list[tuple[int | None, Any, Any]] = []  # this step's CUDA sections, read later
        # each step: host-timed seconds by stage, and the CUDA sections not read yet
        self._steps: deque[tuple[dict[int | None, float], list[tuple[int | None, Any, Any]]]] = \
            deque(maxlen=history)

    def _on_cuda(self) -> bool:
        if self.slowdown > 1.0:
            return False
        if self.device is not None:
            return self.device.type == "cuda"
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    @contextlib.contextmanager
    def compute(self, stage: int | None = None) -> Iterator[None]:
        if self._on_cuda():
            make = self.event or torch.cuda.Event
            start, end = make(enable_timing=True), make(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pairs.append((stage, start, end))
            return
        start_s = time.perf_counter()
        yield
        if self.slowdown > 1.0:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the emulated device is as slow as its kernels' real time
            time.sleep((time.perf_counter() - start_s) * (self.slowdown - 1.0))
        self.current[stage] = self.current.get(stage, 0.0) + time.perf_counter() - start_s

    def end_step(self) -> None:
        self._steps.append((self.current, self._pairs))
        self.current, self._pairs = {}, []

    @property
    def stage_steps(self) -> list[dict[int | None, float]]:
        """Compute seconds of the recent steps by stage (reading the CUDA events waits for the newest one)."""
        pending = [pairs for _, pairs in self._steps if pairs]
        if pending:
            pending[-1][-1][2].synchronize()  # a stream's events complete in order: the newest is last
        out = []
        for by_stage, pairs in self._steps:
            for stage, a, b in pairs:
                by_stage[stage] = by_stage.get(stage, 0.0) + a.elapsed_time(b) / 1e3
            pairs.clear()
            out.append(dict(by_stage))
        return out

    @property
    def steps(self) -> deque[float]:
        """Compute seconds of the recent steps, all stages together."""
        return deque((sum(s.values()) for s in self.stage_steps), maxlen=self._steps.maxlen)


# ---- the report -------------------------------------------------------------------------------------------


@dataclass
class RankTiming:
    rank: int
    device: str  # device type name from the plan's cluster ("" without a plan)
    measured_s: float  # median forward + backward seconds per step
    predicted_s: float | None  # the plan's compute_s of the rank's stages (None: idle, or no plan)
    ratio: float | None  # measured / predicted
    relative: float | None  # ratio / median ratio over the ranks (measured / median without predictions)


@dataclass
class StragglerReport:
    ranks: list[RankTiming]
    steps: int  # steps averaged
    threshold: float

    def stragglers(self) -> list[int]:
        return [t.rank for t in self.ranks if t.relative is not None and t.relative >= self.threshold]

    def table(self) -> str:
        from ..report import render_table

        fmt = lambda x, unit="": "-" if x is None else f"{x * 1e3:.3g}ms" if unit == "s" else f"{x:.2f}"
        rows = [["rank", "device", "measured", "predicted", "measured/predicted", "vs median", ""]]
        slow = set(self.stragglers())
        for t in self.ranks:
            rows.append([str(t.rank), t.device, fmt(t.measured_s, "s"), fmt(t.predicted_s, "s"), fmt(t.ratio),
                         fmt(t.relative), "straggler" if t.rank in slow else ""])
        return render_table(rows, right={2, 3, 4, 5}) + \
            f"\n(forward + backward compute per step, median of the last {self.steps} steps)"

    def __str__(self) -> str:
        return self.table()


def predicted_compute(plan: Any, rank: int) -> float | None:
    """The plan's predicted compute seconds per step of `rank` (sum over its stages), None when idle."""
    if plan is None:
        return None
    total, found = 0.0, False
    for pipe in plan.pipelines:
        for st in pipe.stages:
            if rank in st.devices and "compute_s" in st.predicted:
                total += float(st.predicted["compute_s"])
                found = True
    return total if found else None


def report(prog: Any, window: int | None = None, threshold: float = 1.5) -> StragglerReport:
    """Collective: every rank calls it and gets the same report. `window`: steps to take the median of
    (default: all recorded but the first, which includes warm-up)."""
    steps = list(prog.timer.steps)
    if window is None:
        window = max(1, len(steps) - 1)
    recent = steps[-window:] if steps else []
    measured = statistics.median(recent) if recent else 0.0  # one step stalled by the host is not a trend
    predicted = predicted_compute(prog.plan, prog.rank)
    mine = torch.tensor([measured, -1.0 if predicted is None else predicted,
                         1.0 if prog.position is not None else 0.0], dtype=torch.float64)
    parts = [mine]
    if prog.world_size > 1:
        mine = mine.to(prog.comm.world)  # NCCL collectives take device tensors only; a mixed world, host ones
        parts = [torch.zeros_like(mine) for _ in range(prog.world_size)]
        wait(dist.all_gather(parts, mine, async_op=True), "straggler report all-gather", "in the job",
             prog.timeout_s, device=mine.device)  # the host reads `parts` below (.cpu()): the report's sync
    names = prog.plan.device_names() if prog.plan is not None else {}
    rows = []
    for r, t in enumerate(parts):
        m, p, has_stages = (float(x) for x in t.cpu())
        pred = p if p > 0 else None
        rows.append(RankTiming(r, names.get(r, ""), m, pred, m / pred if pred and has_stages else None, None))
    active = [t for t in rows if t.measured_s > 0]
    if active and all(t.ratio is not None for t in active):
        med = statistics.median(t.ratio for t in active)  # type: ignore[misc]
        for t in active:
            t.relative = t.ratio / med if med > 0 else None  # type: ignore[operator]
    elif active:
        med = statistics.median(t.measured_s for t in active)
        for t in active:
            t.relative = t.measured_s / med if med > 0 else None
    return StragglerReport(rows, len(recent), threshold)


@dataclass
class AdaptPolicy:
    """When `AdaptiveProgram` measures and re-plans."""

    warmup: int = 1  # steps not measured (first-step allocation and caching)
    window: int = 3  # steps measured per check (their median)
    threshold: float = 1.5  # relative slowdown that counts as a straggler
    max_replans: int = 1  # plan changes (re-plans and sheds together)
    shed_below: float = 3.0  # slower than threshold but below this: shed micro-batches to peers, no re-plan


@dataclass
class AdaptiveProgram(Wrapping):
    """A Program that re-plans around stragglers (see the module docstring); otherwise it behaves like the
    Program it wraps (`program`), to which it forwards the rest of the protocol (protocol.py). Collective like
    `step()`."""

    program: Any
    rebuild: Callable[[Cluster, dict], Any]  # compiles a new Program for a cluster and its compute profiles
    cluster: Cluster
    policy: AdaptPolicy = field(default_factory=AdaptPolicy)
    slowdown: dict[int, float] = field(default_factory=dict)  # device -> factor applied so far
    reports: list[StragglerReport] = field(default_factory=list)
    replans: int = 0
    # builds a Program for a plan on the same devices (shed batch shares); None: stragglers are re-planned
    reshare: Callable[[Plan], Any] | None = None
    # compute profiles by device type the job was planned with (`compile(profiles=)`), scaled for re-plans
    profiles: dict = field(default_factory=dict)
    sheds: int = 0
    _since: int = 0

    def step(self, *inputs: Any, target: Any = None) -> float:
        loss = self.program.step(*inputs, target=target)
        self._since += 1
        p = self.policy
        if self.replans < p.max_replans and self._since >= p.warmup + p.window:
            rep = report(self.program, window=p.window, threshold=p.threshold)
            self.reports.append(rep)
            self._since = p.warmup  # the next check measures a fresh window
            slow = rep.stragglers()
            worst = max((float(rep.ranks[r].relative) for r in slow), default=0.0)  # type: ignore[arg-type]
            shed = shed_plan(self.program.plan, {t.rank: t.measured_s for t in rep.ranks}) \
                if slow and self.reshare is not None and worst < p.shed_below else None
            if shed is not None:
                self._move(lambda: self.reshare(shed))  # type: ignore[misc]
                self.sheds += 1
            elif slow:
                for r in slow:
                    t = rep.ranks[r]
                    self.slowdown[r] = self.slowdown.get(r, 1.0) * float(t.relative)  # type: ignore[arg-type]
                self._replan()
        return loss

    def _replan(self) -> None:
        cluster = scaled_cluster(self.cluster, self.slowdown)
        profiles = scaled_profiles(self.cluster, self.slowdown, self.profiles)
        self._move(lambda: self.rebuild(cluster, profiles))

    def _move(self, build: Callable[[], Any]) -> None:
        """Continue on the program `build()` makes, with the full training state moved over."""
        state = self.program.state_dict()
        new = build()
        new.load_state_dict(state)
        self.program = new
        self.replans += 1
        self._since = 0

    def straggler_report(self, window: int | None = None, threshold: float | None = None) -> StragglerReport:
        return report(self.program, window, self.policy.threshold if threshold is None else threshold)



__all__ = ["AdaptPolicy", "AdaptiveProgram", "RankTiming", "StageTimer", "StragglerReport",
           "emulated_slowdown", "predicted_compute", "report"]
