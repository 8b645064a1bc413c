"""Discrete-event simulation of a pipeline schedule, with a Chrome/Perfetto trace of the result.

The execution model is the one of `ir.schedule` (see its docstring): per rank, F/B run in list order
on a compute stream, SENDs and (overlapped) ALLREDUCEs in list order on a comm stream; a transfer takes
the p2p time on the sender's comm stream and its RECV completes when it does. Streams are FIFOs, so
every action starts at max(end of its stream predecessor, end of its dependencies):
F(s, m) needs F(s-1, m) (same rank) or RECV_F(s, m); B(s, m) needs F(s, m) and B(s+1, m) or
RECV_B(s, m); ALLREDUCE(s) needs every B(s, *). Memory actions (GATHER_F, FREE_F, GATHER_B, REDUCE,
FREE_B: ZeRO gathers and reductions, streamed offload, per layer) run on the compute stream around their
F/B and take `memory_time(action)`; a send waits for the memory actions after the F/B it sends from.

Split backward (zero-bubble schedules, `schedule.splits_backward`): `bwd_time` stays the whole backward of
a micro-batch; W takes `wgrad_time` of it (default WGRAD_FRACTION of it) and B the rest. W(s, m) needs
B(s, m), ALLREDUCE(s) every W(s, *).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PlanError
from .schedule import Action, Schedule, compiled, execute, no_gc, splits_backward

StageTime = Callable[[int, int], float] | Sequence[float] | float
P2PTime = Callable[[int, int], float] | float
Event = tuple[int, str, str, float, float]  # (rank, stream, name, start, end), seconds

_TIDS = {"compute": 0, "comm": 1, "recv": 2}

# The weight-gradient share of a backward when the caller gives none: a linear layer's backward is two
# matmuls of equal FLOPs, dX = dY W^T and dW = X^T dY (2 n d_in d_out each), so matmul-dominated layers
# split it about half and half; Qi et al. 2023 ("Zero Bubble Pipeline Parallelism", section 2) take
# T_B ~ T_W for the same reason. The planner prices the split from the graph (solver/pricing/pricing.py, bwd_w_s).
WGRAD_FRACTION = 0.5


@dataclass
class SimResult:
    """Outcome of one simulated training step (times in seconds)."""

    step_time: float
    per_rank_busy: dict[int, float]
    per_rank_bubble: dict[int, float]
    events: list[Event] = field(repr=False)

    @property
    def bubble_fraction(self) -> float:
        """1 - busy/step_time, averaged over ranks."""
        return sum(self.per_rank_bubble.values()) / max(len(self.per_rank_bubble), 1)

    def to_chrome_trace(self) -> dict[str, Any]:
        """Trace-event JSON (ph "X", microseconds): pid = rank, tid = stream."""
        trace: list[dict[str, Any]] = []
        for r in sorted(self.per_rank_busy):
            trace.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                          "args": {"name": f"rank {r}"}})
            for stream, tid in _TIDS.items():
                trace.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid,
                              "args": {"name": stream}})
        for rank, stream, name, start, end in self.events:
            trace.append({"ph": "X", "cat": stream, "name": name, "pid": rank, "tid": _TIDS[stream],
                          "ts": start * 1e6, "dur": (end - start) * 1e6})
        return {"traceEvents": trace, "displayTimeUnit": "ms"}

    def write_trace(self, path: str | Path) -> None:
        """Write the Chrome trace; open it in chrome://tracing or ui.perfetto.dev."""
        Path(path).write_text(json.dumps(self.to_chrome_trace()))


def _per_stage(value: StageTime, num_stages: int, what: str) -> Callable[[int, int], float]:
    if callable(value):
        return value
    if isinstance(value, int | float):
        v = float(value)
        return lambda s, m: v
    times = [float(x) for x in value]
    if len(times) != num_stages:
        raise PlanError(f"{what} has {len(times)} entries for {num_stages} stages; give one time per stage")
    return lambda s, m: times[s]


def _duration(schedule: Schedule, fwd_time: StageTime, bwd_time: StageTime, p2p_time: P2PTime,
              allreduce_time: Sequence[float] | float, memory_time: Callable[[Action], float] | float,
              wgrad_time: StageTime | None) -> Callable[[Action], float]:
    """Each action's seconds under `simulate`'s arguments."""
    S = schedule.num_stages
    fwd = _per_stage(fwd_time, S, "fwd_time")
    bwd = _per_stage(bwd_time, S, "bwd_time")
    if splits_backward(schedule):
        full_bwd = bwd
        wgrad = (lambda s, m: WGRAD_FRACTION * full_bwd(s, m)) if wgrad_time is None \
            else _per_stage(wgrad_time, S, "wgrad_time")
        bwd = lambda s, m: full_bwd(s, m) - wgrad(s, m)
    else:
        wgrad = bwd
    if callable(p2p_time):
        p2p = p2p_time
    else:
        t = float(p2p_time)
        p2p = lambda src, dst: t
    if isinstance(allreduce_time, int | float):
        ar = [float(allreduce_time)] * S
    else:
        ar = [float(x) for x in allreduce_time]
        if len(ar) != S:
            raise PlanError(f"allreduce_time has {len(ar)} entries for {S} stages; give one time per stage")

    memory = memory_time if callable(memory_time) else (lambda a, t=float(memory_time): t)
    # Transfer times depend only on the stage pair, so they are looked up once per pair.
    send_f = [p2p(s, s + 1) for s in range(S - 1)]
    send_b = [0.0] + [p2p(s, s - 1) for s in range(1, S)]

    def duration(a: Action) -> float:
        k = a.kind
        if k == "F":
            return fwd(a.stage, a.microbatch)
        if k == "B":
            return bwd(a.stage, a.microbatch)
        if k == "W":
            return wgrad(a.stage, a.microbatch)
        if k == "SEND_F":
            return send_f[a.stage]
        if k == "SEND_B":
            return send_b[a.stage]
        if k == "ALLREDUCE":
            return ar[a.stage]
        return memory(a)

    return duration


def step_time(
    schedule: Schedule,
    fwd_time: StageTime,
    bwd_time: StageTime,
    p2p_time: P2PTime = 0.0,
    allreduce_time: Sequence[float] | float = 0.0,
    overlap_allreduce: bool = True,
    memory_time: Callable[[Action], float] | float = 0.0,
    wgrad_time: StageTime | None = None,
) -> float:
    """`simulate(...).step_time` without recording the events (the planner's hot path): the latest end of any
    action, the same float."""
    duration = _duration(schedule, fwd_time, bwd_time, p2p_time, allreduce_time, memory_time, wgrad_time)
    with no_gc():
        done = execute(compiled(schedule, overlap_allreduce), duration)
    return max(0.0, *done.values())


def simulate(
    schedule: Schedule,
    fwd_time: StageTime,
    bwd_time: StageTime,
    p2p_time: P2PTime = 0.0,
    allreduce_time: Sequence[float] | float = 0.0,
    overlap_allreduce: bool = True,
    memory_time: Callable[[Action], float] | float = 0.0,
    wgrad_time: StageTime | None = None,
) -> SimResult:
    """Simulate one step of `schedule`.

    fwd_time/bwd_time: f(stage, microbatch) -> seconds, a per-stage list, or one number for all.
    p2p_time: seconds per transfer, or f(src_stage, dst_stage). allreduce_time: per-stage list or number.
    overlap_allreduce: ALLREDUCE on the comm stream (overlapping later compute) instead of the compute stream.
    memory_time: seconds of a memory action (f(action) or one number); F/B times exclude them.
    wgrad_time: with a split backward, the part of bwd_time that W takes (f(stage, microbatch), per-stage
    list or number; default WGRAD_FRACTION of bwd_time); B takes the rest. Ignored without W actions.
    Raises PlanError if the schedule deadlocks.
    """
    duration = _duration(schedule, fwd_time, bwd_time, p2p_time, allreduce_time, memory_time, wgrad_time)

    events: list[Event] = []
    busy = dict.fromkeys(schedule.actions, 0.0)
    append = events.append

    def on_event(a: Action, stream: str, start: float, end: float) -> None:
        k = a.kind
        if k == "F" or k == "B" or k == "W":
            busy[a.rank] += end - start
            append((a.rank, stream, f"{k} s{a.stage} mb{a.microbatch}", start, end))
        elif k == "ALLREDUCE":
            append((a.rank, stream, f"ALLREDUCE s{a.stage}", start, end))
        elif a.layer >= 0:
            busy[a.rank] += end - start
            append((a.rank, stream, f"{k} s{a.stage} mb{a.microbatch} layer{a.layer}", start, end))
        else:
            append((a.rank, stream, f"{k} s{a.stage} mb{a.microbatch}", start, end))

    with no_gc():
        execute(compiled(schedule, overlap_allreduce), duration, on_event)
    rank_end = dict.fromkeys(schedule.actions, 0.0)
    for rank, _, _, _, end in events:
        if end > rank_end[rank]:
            rank_end[rank] = end
    step = max(rank_end.values(), default=0.0)
    bubble = {r: (1.0 - busy[r] / step) if step > 0 else 0.0 for r in busy}
    return SimResult(step, busy, bubble, events)


__all__ = ["WGRAD_FRACTION", "SimResult", "simulate", "step_time"]
