"""Cross-wave pipeline schedules: k consecutive waves (training steps) of 1F1B, flushed or not, with the
delayed-update rule of runtime/asynchronous.py written into the schedule.

A wave schedule is, per pipeline rank, an ordered list of `WaveAction`s: schedule.py's F, B and transfer
actions tagged with their wave, plus two per-(stage, wave) actions: ``ALLREDUCE`` launches the wave's
gradient sum over the stage's holders (on the comm stream, after the stage's last backward of the wave) and
``UPDATE`` applies it (waits for that sum, steps the optimizer: W[c+1] = W[c] - opt(G_c), on the compute
stream). String form: ``r0:s1F3@w2`` (rank 0, stage 1, forward of micro-batch 3 of wave 2),
``r0:s1UPDATE@w0``; ``WaveAction.parse(str(a)) == a`` and ``WaveSchedule.parse(str(s)) == s``.

The update rule with delay D (asynchronous.py: wave c computes on W[max(0, c - D)]) is an order on each
rank: UPDATE(s, c) runs before the stage's first action of wave c + D + 1 and after every backward of wave c;
every forward of wave c runs after the updates of waves <= c - D - 1 and before UPDATE(s, c - D), so all
of a wave's forwards (and its backwards, which reuse the forward's weights) see one version.

* `waves_1f1b(p, m, k, delay, flush=True)`: each wave is the plan's flushed 1F1B (what
  `AsyncProgram.step` runs wave by wave): the pipeline drains between waves.
* `waves_1f1b(p, m, k, delay, flush=False)`: PipeDream-2BW's flushless schedule (Narayanan et al. 2021,
  "Memory-Efficient Pipeline-Parallel DNN Training", section 3): stage s runs one continuous 1F1B over the
  k*m micro-batches (at most p - s in flight), so micro-batches of wave c + 1 enter stage 0 while wave c's
  backwards are still in flight; a forward of wave c waits only for the stage's UPDATE of wave c - D - 1
  (with D = 1 and m >= p - 1 that update is never late: it is ready when the forward's turn comes). On a
  uniform pipeline (F and B the same on every stage, free transfers) k waves take (k m + p - 1)(F + B)
  instead of k (m + p - 1)(F + B): the bubble of (p - 1)(F + B) is paid once, not per wave.

With D = 1 a stage holds at most two weight versions at a time (`peak_versions`): the one its in-flight wave
computes on and the newest one (2BW's double-buffered weights).

`validate` checks a wave schedule (its projection onto schedule.py's IR, with micro-batch c*m + j for
micro-batch j of wave c, goes through `schedule_check.validate`; then the per-wave actions, the update rule and
the cut into one-wave calls the runtime makes, `step_cuts`); `simulate_waves` times one on the execution
model of schedule.py, with UPDATE on the compute stream and ALLREDUCE on a sync stream (`compile_waves`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import PlanError
from .schedule import (
    Action,
    Compiled,
    Schedule,
    dependencies,
    execute,
    no_gc,
    one_f_one_b_orders,
    with_comms,
)
from .schedule_check import validate
from .simulate import SimResult

WAVE_KINDS = ("F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "ALLREDUCE", "UPDATE")
PER_WAVE = frozenset({"ALLREDUCE", "UPDATE"})  # one per (stage, wave): micro-batch -1
_COMPUTE = frozenset({"F", "B", "UPDATE"})
_TOKEN_RE = re.compile(r"^(?:r(\d+):)?s(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|ALLREDUCE|UPDATE|F|B)(\d*)@w(\d+)$")
_HEADER_RE = re.compile(r'^waves (".*") stages=(\d+) microbatches=(\d+) waves=(\d+) delay=(\d+) '
                        r'stage_to_rank=([\d,]*)$')
_RANK_RE = re.compile(r"^r(\d+):(.*)$")


@dataclass(frozen=True, slots=True)
class WaveAction:
    """One action of a wave schedule: a schedule.py action of wave `wave`, or ALLREDUCE / UPDATE of it."""

    rank: int
    kind: str
    stage: int
    microbatch: int = -1
    wave: int = 0

    def __post_init__(self) -> None:
        if self.kind not in WAVE_KINDS:
            raise PlanError(f"unknown wave-schedule action kind {self.kind!r}; valid kinds are {', '.join(WAVE_KINDS)}")
        if (self.kind in PER_WAVE) != (self.microbatch == -1):
            raise PlanError(f"action kind {self.kind} with micro-batch {self.microbatch}: ALLREDUCE and UPDATE "
                            f"take micro-batch -1 (one per stage and wave), every other kind a micro-batch >= 0")
        if self.wave < 0:
            raise PlanError(f"action {self.kind} of wave {self.wave}: waves are numbered from 0")

    def compact(self) -> str:
        mb = "" if self.kind in PER_WAVE else str(self.microbatch)
        return f"s{self.stage}{self.kind}{mb}@w{self.wave}"

    def __str__(self) -> str:
        return f"r{self.rank}:{self.compact()}"

    @classmethod
    def parse(cls, text: str, rank: int | None = None) -> WaveAction:
        """Parse ``r0:s1F3@w2``; the compact ``s1F3@w2`` form needs `rank`."""
        m = _TOKEN_RE.match(text.strip())
        if m is None:
            raise PlanError(f"cannot parse wave action {text!r}; expected e.g. 'r0:s1F3@w2' or 'r0:s1UPDATE@w0'")
        r, stage, kind, mb, wave = m.groups()
        if r is None and rank is None:
            raise PlanError(f"wave action {text!r} has no rank prefix ('r<rank>:') and no rank was given")
        if (kind in PER_WAVE) == (mb != ""):
            raise PlanError(f"cannot parse {text!r}: ALLREDUCE and UPDATE take no micro-batch, others need one")
        return cls(int(r if r is not None else rank), kind, int(stage), int(mb) if mb else -1, int(wave))

    def flat(self, num_microbatches: int) -> Action:
        """schedule.py's action for this one, micro-batch j of wave c numbered c * m + j (F, B, transfers)."""
        return Action(self.rank, self.kind, self.stage, self.wave * num_microbatches + self.microbatch)


@dataclass
class WaveSchedule:
    """Per-rank ordered wave actions of `num_waves` waves of `num_microbatches` each, updates `delay` late."""

    name: str
    num_stages: int
    num_microbatches: int
    num_waves: int
    delay: int
    stage_to_rank: tuple[int, ...]
    actions: dict[int, list[WaveAction]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.stage_to_rank = tuple(int(r) for r in self.stage_to_rank)
        ranks = max(self.stage_to_rank, default=-1) + 1
        self.actions = {r: list(self.actions.get(r, [])) for r in sorted(set(range(ranks)) | set(self.actions))}

    def __str__(self) -> str:
        s2r = ",".join(map(str, self.stage_to_rank))
        lines = [f"waves {json.dumps(self.name)} stages={self.num_stages} microbatches={self.num_microbatches} "
                 f"waves={self.num_waves} delay={self.delay} stage_to_rank={s2r}"]
        lines += [" ".join([f"r{r}:"] + [a.compact() for a in acts]) for r, acts in self.actions.items()]
        return "\n".join(lines)

    @classmethod
    def parse(cls, text: str) -> WaveSchedule:
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        if not lines or (h := _HEADER_RE.match(lines[0])) is None:
            raise PlanError("a wave-schedule text starts with a header line like 'waves \"1f1b_flushless\" "
                            "stages=2 microbatches=4 waves=3 delay=1 stage_to_rank=0,1'")
        actions: dict[int, list[WaveAction]] = {}
        for ln in lines[1:]:
            m = _RANK_RE.match(ln)
            if m is None:
                raise PlanError(f"cannot parse wave-schedule line {ln!r}; expected 'r<rank>: s0F0@w0 ...'")
            if int(m.group(1)) in actions:
                raise PlanError(f"rank {m.group(1)} has two lines in the wave-schedule text")
            actions[int(m.group(1))] = [WaveAction.parse(t, int(m.group(1))) for t in m.group(2).split()]
        s2r = tuple(int(x) for x in h.group(6).split(",") if x)
        return cls(json.loads(h.group(1)), int(h.group(2)), int(h.group(3)), int(h.group(4)), int(h.group(5)),
                   s2r, actions)

    def flat(self) -> Schedule:
        """The projection onto schedule.py's IR: k*m micro-batches, ALLREDUCE and UPDATE left out."""
        m = self.num_microbatches
        acts = {r: [a.flat(m) for a in acts if a.kind not in PER_WAVE] for r, acts in self.actions.items()}
        return Schedule(self.name, self.num_stages, m * self.num_waves, self.stage_to_rank, acts)


# ----------------------------------------------------------------------------------------------- generators


def _continuous_order(p: int, s: int, m: int, k: int, delay: int) -> list[tuple[str, int, int]]:
    """Stage s's flushless compute order over the k*m micro-batches (numbered c*m + j): a forward whenever
    fewer than p - s micro-batches are in flight and the stage's update of wave c - delay - 1 can have run
    (every backward of that wave done), a backward otherwise."""
    order: list[tuple[str, int, int]] = []
    f = b = 0
    while b < k * m:
        if f < k * m and f - b < p - s and b >= (f // m - delay) * m:
            order.append(("F", s, f))
            f += 1
        else:
            order.append(("B", s, b))
            b += 1
    return order


def waves_1f1b(num_stages: int, num_microbatches: int, num_waves: int, delay: int = 1,
               flush: bool = False) -> WaveSchedule:
    """`num_waves` waves of 1F1B on `num_stages` stages (stage s on rank s), updates `delay` waves late;
    `flush`: each wave the flushed 1F1B (schedule.one_f_one_b), else 2BW's flushless order (module docstring)."""
    p, m, k = num_stages, num_microbatches, num_waves
    if p < 1 or m < 1 or k < 1:
        raise PlanError(f"a wave schedule needs >= 1 stage, micro-batch and wave, got {p} stages, {m} "
                        f"micro-batches and {k} waves")
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
        raise PlanError(f"delay={delay!r}: give the update delay as a whole number of waves >= 0")
    if flush:
        one = one_f_one_b_orders(p, m)
        orders = {s: [(kind, s, c * m + j) for c in range(k) for kind, _, j in one[s]] for s in range(p)}
    else:
        orders = {s: _continuous_order(p, s, m, k, delay) for s in range(p)}
    base = with_comms("", p, k * m, range(p), orders)
    actions: dict[int, list[WaveAction]] = {}
    for r, acts in base.actions.items():
        out: list[WaveAction] = []
        updated = 0  # waves whose UPDATE is listed
        for i, a in enumerate(acts):
            if a.kind == "ALLREDUCE":
                continue
            c, j = divmod(a.microbatch, m)
            if a.kind in ("RECV_F", "F") and j == 0 and (a.kind == "RECV_F" or a.stage == 0):
                while updated <= c - delay - 1:  # the first action of wave c: the updates it needs first
                    out.append(WaveAction(r, "UPDATE", a.stage, -1, updated))
                    updated += 1
            out.append(WaveAction(r, a.kind, a.stage, j, c))
            nxt = acts[i + 1] if i + 1 < len(acts) else None
            if a.kind in ("B", "SEND_B") and j == m - 1 and not (a.kind == "B" and nxt is not None
                                                                  and nxt.kind == "SEND_B"):
                out.append(WaveAction(r, "ALLREDUCE", a.stage, -1, c))  # after the wave's last B (and its send)
        out += [WaveAction(r, "UPDATE", r, -1, c) for c in range(updated, k)]  # the pending ones, at the end
        actions[r] = out
    return WaveSchedule("1f1b" if flush else "1f1b_flushless", p, m, k, delay, tuple(range(p)), actions)


# ----------------------------------------------------------------------------------------------- checks


def step_wave(a: WaveAction, delay: int) -> int:
    """The wave whose runtime call (`step()`) runs `a`: its own, except an UPDATE, which prepares wave
    a.wave + delay + 1 and runs in that wave's call."""
    return a.wave + delay + 1 if a.kind == "UPDATE" else a.wave


def step_cuts(schedule: WaveSchedule, rank: int) -> list[int]:
    """Per wave c, the index in the rank's list where wave c + 1's call begins (the first action of a later
    call); the runtime's call for wave c runs the actions between cut c - 1 and cut c."""
    acts = schedule.actions[rank]
    cuts, i = [], 0
    for c in range(schedule.num_waves):
        while i < len(acts) and step_wave(acts[i], schedule.delay) <= c:
            i += 1
        cuts.append(i)
    return cuts


def shift_waves(actions: Sequence[WaveAction], by: int) -> list[WaveAction]:
    """`actions` with every wave number moved by `by`."""
    return [WaveAction(a.rank, a.kind, a.stage, a.microbatch, a.wave + by) for a in actions]


def wave_calls(num_stages: int, num_microbatches: int, stage: int, delay: int = 1
               ) -> tuple[list[list[WaveAction]], list[list[WaveAction]]]:
    """What runtime/flushless.py runs on `stage`'s rank of the flushless schedule: its calls of waves 0, 1 and
    2 (wave r >= 2's is wave 2's shifted by r - 2: wave 2's is the first with an UPDATE) and the drains after
    them (likewise), cut from 5-wave and short schedules; PlanError unless periodic (wave 3's call and the
    drain after it are the shifts). Relative wave numbers: wave r of the current run."""
    p, m, s = num_stages, num_microbatches, stage
    long = waves_1f1b(p, m, 5, delay).actions[s]
    cuts = [0] + step_cuts(waves_1f1b(p, m, 5, delay), s)
    calls = [long[cuts[i]:cuts[i + 1]] for i in range(4)]
    drains = []
    for r in range(4):
        done = set(long[:cuts[r + 1]])
        drains.append([a for a in waves_1f1b(p, m, r + 1, delay).actions[s]
                       if a not in done and step_wave(a, delay) <= r])
    if calls[3] != shift_waves(calls[2], 1) or drains[3] != shift_waves(drains[2], 1):
        raise PlanError(f"internal: the flushless schedule of {p} stages and {m} micro-batches is not periodic "
                        f"from wave 2 on (schedule_waves.waves_1f1b)")
    return calls[:3], drains[:3]


def call_of_wave(templates: Sequence[Sequence[WaveAction]], r: int) -> list[WaveAction]:
    """Wave r's entry of `wave_calls`' calls or drains (the third shifted for r > 2)."""
    return list(templates[r]) if r < 2 else shift_waves(templates[2], r - 2)


def validate_waves(schedule: WaveSchedule) -> None:
    """Raise PlanError naming what is wrong: the projection (schedule_check.validate: completeness, placement,
    transfers, order, deadlock), the per-wave ALLREDUCE/UPDATE, the update rule, that every call of the
    runtime (one wave) needs only actions of calls so far, and a deadlock-finding run with the updates."""
    validate(schedule.flat())
    m, k, d = schedule.num_microbatches, schedule.num_waves, schedule.delay
    for r, acts in schedule.actions.items():
        seen: dict[tuple, int] = {}
        for i, a in enumerate(acts):
            if a.wave >= k:
                raise PlanError(f"action {a} names wave {a.wave}; the schedule has waves 0..{k - 1}")
            if a.kind in PER_WAVE and schedule.stage_to_rank[a.stage] != r:
                raise PlanError(f"action {a} runs on rank {r}, but stage {a.stage} lives on rank "
                                f"{schedule.stage_to_rank[a.stage]}")
            if (a.kind, a.stage, a.microbatch, a.wave) in seen:
                raise PlanError(f"action {a} appears twice on rank {r}")
            seen[(a.kind, a.stage, a.microbatch, a.wave)] = i
        for s in (s for s, rank in enumerate(schedule.stage_to_rank) if rank == r):
            for c in range(k):
                for kind in PER_WAVE:
                    if (kind, s, -1, c) not in seen:
                        raise PlanError(f"action r{r}:s{s}{kind}@w{c} is missing from the wave schedule")
                sync, update = seen[("ALLREDUCE", s, -1, c)], seen[("UPDATE", s, -1, c)]
                last_b = max(seen[("B", s, j, c)] for j in range(m))
                if not last_b < sync < update:
                    raise PlanError(f"on rank {r} stage {s} wave {c}: ALLREDUCE must follow the wave's last "
                                    f"backward and precede its UPDATE (r{r}:s{s}UPDATE@w{c})")
                if c > 0 and seen[("UPDATE", s, -1, c - 1)] > update:
                    raise PlanError(f"r{r}:s{s}UPDATE@w{c} runs before the update of wave {c - 1}")
                for j in range(m):
                    f = seen[("F", s, j, c)]
                    if c - d - 1 >= 0 and seen[("UPDATE", s, -1, c - d - 1)] > f:
                        raise PlanError(f"r{r}:s{s}F{j}@w{c} runs before r{r}:s{s}UPDATE@w{c - d - 1}: wave {c} "
                                        f"computes on W[{c - d}] (delay {d}), which that update makes")
                    if c - d >= 0 and seen[("UPDATE", s, -1, c - d)] < f:
                        raise PlanError(f"r{r}:s{s}F{j}@w{c} runs after r{r}:s{s}UPDATE@w{c - d}: wave {c} must "
                                        f"compute on W[{c - d}], not a newer version")
    _check_cuts(schedule)
    with no_gc():
        execute(compile_waves(schedule), lambda a: 1.0)


def _check_cuts(schedule: WaveSchedule) -> None:
    """Every action that wave c's call runs (on any rank) waits only for actions of calls <= c: the
    runtime, which gets one wave's inputs per call, can stop each rank at its cut without a deadlock."""
    compiled = compile_waves(schedule)
    call_of: dict[tuple, int] = {}
    cuts = {r: step_cuts(schedule, r) for r in schedule.actions}
    for r, acts in schedule.actions.items():
        for i, a in enumerate(acts):
            call_of[_key(a, schedule.num_microbatches)] = next(
                (c for c, cut in enumerate(cuts[r]) if i < cut), schedule.num_waves)  # after: the flush
    for send, recv in compiled.recv_of_send.items():
        rkey = (recv.kind, recv.stage, recv.microbatch)
        if call_of[send] > call_of[rkey]:
            raise PlanError(f"{recv} runs in the call of wave {call_of[rkey]} but its send runs in the call of "
                            f"wave {call_of[send]}: a one-wave-per-call runtime would deadlock")
    for _, _, entries in compiled.queues:
        for a, key, deps in entries:
            late = [d for d in deps if call_of[d] > call_of[key]]
            if late:
                raise PlanError(f"{a} runs in the call of wave {call_of[key]} but waits for {late[0]}, which "
                                f"runs in the call of wave {call_of[late[0]]}: a one-wave-per-call runtime "
                                f"would deadlock")


def peak_versions(schedule: WaveSchedule) -> dict[int, int]:
    """Per rank, the most weight versions alive at once: the newest one (the optimizer's, what the next
    wave computes on) and that of every wave from its first forward to its last backward on the rank. With
    delay 1 it is 2 for the flushless schedule once waves overlap (2BW's double buffering), 1 flushed."""
    out = {}
    for r, acts in schedule.actions.items():
        last_b = {a.wave: i for i, a in enumerate(acts) if a.kind == "B"}
        newest, version, peak = 0, {}, 1
        for i, a in enumerate(acts):
            if a.kind == "UPDATE":
                newest += 1
            elif a.kind == "F":
                version.setdefault(a.wave, newest)
            live = {v for c, v in version.items() if last_b[c] >= i}
            peak = max(peak, len(live | {newest}))
        out[r] = peak
    return out


# ----------------------------------------------------------------------------------------------- timing


def _key(a: WaveAction, m: int) -> tuple:
    if a.kind in PER_WAVE:
        return (a.kind, a.stage, a.wave)
    return (a.kind, a.stage, a.wave * m + a.microbatch)


def compile_waves(schedule: WaveSchedule) -> Compiled:
    """The execution-model queues (schedule.compile_schedule's, per-wave actions added): F, B and UPDATE on
    a rank's compute stream, SENDs on its comm stream, ALLREDUCE on a sync stream of its own (the runtime
    sums gradients on the parameters' process groups, apart from the stage transfers, so a wave's sum in
    flight does not hold the next wave's sends back); ALLREDUCE(s, c) waits for the stage's backwards of
    wave c, UPDATE(s, c) for that ALLREDUCE. Keys: (kind, stage, c*m + j), (kind, stage, c)."""
    m, s2r, n_s = schedule.num_microbatches, schedule.stage_to_rank, schedule.num_stages
    total = m * schedule.num_waves
    queues = []
    recv_of_send: dict[tuple, Action] = {}
    for r, acts in schedule.actions.items():
        compute, comm, sync = [], [], []
        for a in acts:
            if a.kind == "ALLREDUCE":
                deps: tuple = tuple(("B", a.stage, a.wave * m + j) for j in range(m))
            elif a.kind == "UPDATE":
                deps = (("ALLREDUCE", a.stage, a.wave),)
            else:
                flat = a.flat(m)
                if a.kind in ("RECV_F", "RECV_B"):
                    up = a.stage - 1 if a.kind == "RECV_F" else a.stage + 1
                    recv_of_send[("SEND" + a.kind[4:], up, flat.microbatch)] = flat
                    continue
                deps = dependencies(flat, s2r, n_s, total)
            (compute if a.kind in _COMPUTE else sync if a.kind == "ALLREDUCE" else comm).append((a, _key(a, m), deps))
        queues += [(r, "compute", compute), (r, "comm", comm), (r, "sync", sync)]
    return Compiled(queues, recv_of_send, s2r)


Seconds = Callable[[int], float] | Sequence[float] | float


def _per_stage(value: Seconds, n: int) -> Callable[[int], float]:
    if callable(value):
        return value
    if isinstance(value, int | float):
        return lambda s, v=float(value): v
    vals = [float(x) for x in value]
    if len(vals) != n:
        raise PlanError(f"{len(vals)} per-stage times for {n} stages; give one per stage")
    return lambda s: vals[s]


def simulate_waves(schedule: WaveSchedule, fwd: Seconds, bwd: Seconds, p2p: Seconds = 0.0,
                   allreduce: Seconds = 0.0, update: Seconds = 0.0) -> SimResult:
    """Time `schedule` (seconds per stage: forward and backward of a micro-batch, the transfer from stage s
    to s + 1 (and the gradient back), the wave's gradient sum, the optimizer step); `step_time` is the end
    of the last action of all k waves."""
    n = schedule.num_stages
    f, b, x, ar, up = (_per_stage(v, n) for v in (fwd, bwd, p2p, allreduce, update))
    times = {"F": f, "B": b, "SEND_F": x, "SEND_B": lambda s: x(s - 1), "ALLREDUCE": ar, "UPDATE": up}
    events: list = []
    busy = dict.fromkeys(schedule.actions, 0.0)

    def on_event(a: WaveAction | Action, stream: str, start: float, end: float) -> None:
        if stream == "compute":
            busy[a.rank] += end - start
        events.append((a.rank, stream, str(a), start, end))

    with no_gc():
        execute(compile_waves(schedule), lambda a: times[a.kind](a.stage), on_event)
    step = max((e[4] for e in events), default=0.0)
    return SimResult(step, busy, {r: 1.0 - busy[r] / step if step else 0.0 for r in busy}, events)


def steady_wave_time(num_stages: int, num_microbatches: int, fwd: Seconds, bwd: Seconds, p2p: Seconds = 0.0,
                     allreduce: Seconds = 0.0, update: Seconds = 0.0, delay: int = 1, flush: bool = False,
                     waves: int = 4) -> float:
    """Seconds per wave once the pipeline is full: (T(2n) - T(n)) / n for n = `waves`, T(k) the simulated
    time of k waves; the fill and the final drain cancel out."""
    t = [simulate_waves(waves_1f1b(num_stages, num_microbatches, k, delay, flush), fwd, bwd, p2p, allreduce,
                        update).step_time for k in (waves, 2 * waves)]
    return (t[1] - t[0]) / waves


__all__ = ["PER_WAVE", "WAVE_KINDS", "WaveAction", "WaveSchedule", "call_of_wave", "compile_waves", "peak_versions",
           "shift_waves", "simulate_waves", "steady_wave_time", "step_cuts", "step_wave", "validate_waves",
           "wave_calls", "waves_1f1b"]
