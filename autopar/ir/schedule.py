"""Pipeline-schedule IR shared by the planner, the simulator and the runtime.

A schedule is, per pipeline rank (a pipeline position / stage group, not a process), an ordered list
of actions. Each action has a one-token string form, e.g. ``r0:s1F3`` (rank 0, stage 1, forward of
micro-batch 3), ``r1:s2SEND_B0`` or ``r0:s0ALLREDUCE``; ``Action.parse(str(a)) == a``.

Zero-bubble schedules (``zb_h1``, Qi et al. 2023, "Zero Bubble Pipeline Parallelism") split the backward:
``B`` computes only the stage's input gradients (what the previous stage waits for) and ``W`` the weight
gradients of the same micro-batch later (``r0:s1W3``), from the graph B retained; a schedule with any W
(`splits_backward`) has one W per B, after it. There ALLREDUCE waits for the W's, and REDUCE belongs to
the W of its micro-batch (`memory_owner`); the activations of a micro-batch live until its W.

Transfer actions are named after the stage that owns them, the stage on the acting rank:
``SEND_F(s, m)`` sends stage s's output to stage s+1, ``RECV_F(s, m)`` receives stage s's input from
stage s-1, ``SEND_B(s, m)`` sends stage s's input gradient to stage s-1 and ``RECV_B(s, m)`` receives
stage s's output gradient from stage s+1. Transfers exist only between stages on different ranks.

Memory actions (inserted by `autopar.lowering.memory_actions`, one per layer that has any) name a layer
too: ``r0:s1GATHER_F3L5`` brings layer 5's parameters in (ZeRO-3 gather, offloaded parameters streamed
from the host) for the forward of stage 1's micro-batch 3, ``FREE_F`` frees them after it, ``GATHER_B``
brings them in again for the backward, ``REDUCE`` reduces the layer's gradients to their owner (and
moves streamed gradients to the host) once its backward ends, ``FREE_B`` frees the layer. A compute
action's memory actions are listed around it (GATHER_* before, FREE_F / REDUCE / FREE_B after) and run at
its layer boundaries (runtime/zero_layers.py).

Execution model (used by schedule_check.validate and by `ir.simulate`): on each rank F/B and memory actions run in
list order on a compute stream (the planner prices gathers and reductions inside the stage's step time,
not overlapped) and SEND/ALLREDUCE in list order on a comm stream; a RECV completes when its matching
SEND does (transfers are eager, so a RECV holds no stream); an action waits for its data dependencies.
A GATHER waits for what its compute action waits for, and a SEND for the last memory action after the
compute action that produced its data (the runtime sends once the layer's reductions have completed).
"""

from __future__ import annotations

import gc
import json
import re
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..errors import PlanError

Key = tuple  # (kind, stage, micro-batch), memory actions (kind, stage, micro-batch, layer)

MEMORY_KINDS = ("GATHER_F", "FREE_F", "GATHER_B", "REDUCE", "FREE_B")
KINDS = ("F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "ALLREDUCE") + MEMORY_KINDS
COMPUTE_KINDS = frozenset({"F", "B", "W"})
MEMORY_OF = {"GATHER_F": "F", "FREE_F": "F", "GATHER_B": "B", "REDUCE": "B", "FREE_B": "B"}
_GATHER_KINDS = frozenset({"GATHER_F", "GATHER_B"})
_COMPUTE_STREAM = COMPUTE_KINDS | set(MEMORY_KINDS)  # what runs on a rank's compute stream (ALLREDUCE aside)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
SPLIT_SCHEDULES = frozenset({"zb_h1"})  # schedules whose backward is split into B (input grads) and W

_ACTION_RE = re.compile(r"^(?:r(\d+):)?s(\d+)(GATHER_F|FREE_F|GATHER_B|REDUCE|FREE_B|SEND_F|RECV_F|SEND_B|RECV_B"
                        r"|ALLREDUCE|F|B|W)(\d*)(?:L(\d+))?$")


def memory_owner(kind: str, split: bool = False) -> str:
    """The compute kind a memory action of `kind` runs around: `MEMORY_OF`, except that REDUCE follows the
    W of its micro-batch in a schedule that splits the backward (`split`; the weight gradients exist then)."""
    return "W" if split and kind == "REDUCE" else MEMORY_OF[kind]


_HEADER_RE = re.compile(r'^schedule (".*") stages=(\d+) microbatches=(\d+) stage_to_rank=([\d,]*)$')
_RANK_RE = re.compile(r"^r(\d+):(.*)$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of a pipeline schedule; ALLREDUCE (a stage's data-parallel grad sync) has micro-batch -1;
    memory actions (MEMORY_KINDS) name a layer, every other kind has layer -1."""

    rank: int
    kind: str
    stage: int
    microbatch: int = -1
    layer: int = -1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PlanError(f"unknown action kind {self.kind!r}; valid kinds are {', '.join(KINDS)}")
        if (self.kind == "ALLREDUCE") != (self.microbatch == -1):
            raise PlanError(
                f"action kind {self.kind} with micro-batch {self.microbatch}: ALLREDUCE takes micro-batch -1,"
                " every other kind a micro-batch >= 0"
            )
        if (self.kind in MEMORY_OF) != (self.layer >= 0):
            raise PlanError(f"action kind {self.kind} with layer {self.layer}: memory actions "
                            f"({', '.join(MEMORY_KINDS)}) name a layer >= 0, other kinds none")

    def compact(self) -> str:
        """The string form without the rank prefix, as written inside a schedule line."""
        mb = "" if self.kind == "ALLREDUCE" else str(self.microbatch)
        layer = f"L{self.layer}" if self.layer >= 0 else ""
        return f"s{self.stage}{self.kind}{mb}{layer}"

    def __str__(self) -> str:
        return f"r{self.rank}:{self.compact()}"

    @classmethod
    def parse(cls, text: str, rank: int | None = None) -> Action:
        """Parse ``r0:s1F3``; the compact ``s1F3`` form needs `rank`."""
        m = _ACTION_RE.match(text.strip())
        if m is None:
            raise PlanError(f"cannot parse action {text!r}; expected e.g. 'r0:s1F3', 'r0:s0ALLREDUCE' or "
                            f"'r0:s1GATHER_F3L5'")
        r, stage, kind, mb, layer = m.groups()
        if r is None:
            if rank is None:
                raise PlanError(f"action {text!r} has no rank prefix ('r<rank>:') and no rank was given")
            r = rank
        if (kind == "ALLREDUCE") == (mb != ""):
            raise PlanError(f"cannot parse action {text!r}: ALLREDUCE takes no micro-batch, others need one")
        return cls(int(r), kind, int(stage), int(mb) if mb else -1, int(layer) if layer else -1)

    @property
    def key(self) -> Key:
        """Identity within a schedule: the rank is implied by the stage (memory actions add their layer)."""
        if self.layer >= 0:
            return (self.kind, self.stage, self.microbatch, self.layer)
        return (self.kind, self.stage, self.microbatch)


@dataclass
class Schedule:
    """Per-rank ordered action lists. ``Schedule.parse(str(s)) == s``."""

    name: str
    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: dict[int, list[Action]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.stage_to_rank = tuple(int(r) for r in self.stage_to_rank)
        for r in range(self.num_ranks):
            self.actions.setdefault(r, [])
        self.actions = {r: list(self.actions[r]) for r in sorted(self.actions)}

    @property
    def num_ranks(self) -> int:
        return max(self.stage_to_rank, default=-1) + 1

    def __str__(self) -> str:
        s2r = ",".join(map(str, self.stage_to_rank))
        lines = [f"schedule {json.dumps(self.name)} stages={self.num_stages} "
                 f"microbatches={self.num_microbatches} stage_to_rank={s2r}"]
        for r, acts in self.actions.items():
            lines.append(" ".join([f"r{r}:"] + [a.compact() for a in acts]))
        return "\n".join(lines)

    @classmethod
    def parse(cls, text: str) -> Schedule:
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        if not lines or (h := _HEADER_RE.match(lines[0])) is None:
            raise PlanError(
                "a schedule text starts with a header line like "
                "'schedule \"1f1b\" stages=4 microbatches=8 stage_to_rank=0,1,2,3'"
            )
        name = json.loads(h.group(1))
        s2r = tuple(int(x) for x in h.group(4).split(",") if x)
        actions: dict[int, list[Action]] = {}
        for ln in lines[1:]:
            m = _RANK_RE.match(ln)
            if m is None:
                raise PlanError(f"cannot parse schedule line {ln!r}; expected 'r<rank>: s0F0 s0F1 ...'")
            rank = int(m.group(1))
            if rank in actions:
                raise PlanError(f"rank {rank} has two lines in the schedule text")
            actions[rank] = [Action.parse(tok, rank) for tok in m.group(2).split()]
        return cls(name, int(h.group(2)), int(h.group(3)), s2r, actions)

    def to_json(self) -> str:
        return json.dumps({
            "name": self.name,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "stage_to_rank": list(self.stage_to_rank),
            "actions": {str(r): [a.compact() for a in acts] for r, acts in self.actions.items()},
        })

    @classmethod
    def from_json(cls, data: str | dict[str, Any]) -> Schedule:
        d = json.loads(data) if isinstance(data, str) else data
        try:
            actions = {int(r): [Action.parse(t, int(r)) for t in acts] for r, acts in d["actions"].items()}
            return cls(d["name"], int(d["num_stages"]), int(d["num_microbatches"]),
                       tuple(d["stage_to_rank"]), actions)
        except KeyError as e:
            raise PlanError(f"schedule JSON lacks the field {e.args[0]!r}") from None


# ----------------------------------------------------------------------------------------------- generators

def with_comms(name: str, num_stages: int, num_microbatches: int, stage_to_rank: Sequence[int],
                compute: dict[int, list[tuple[str, int, int]]]) -> Schedule:
    """Build a schedule from per-rank compute orders, inserting transfers and one ALLREDUCE per stage (the
    generators here and schedule_waves.py build on it)."""
    s2r = tuple(stage_to_rank)
    last = num_stages - 1
    actions: dict[int, list[Action]] = {}
    for r, order in compute.items():
        last_b = {s: i for i, (k, s, _) in enumerate(order) if k in ("B", "W")}  # the stage's last backward
        out: list[Action] = []
        for i, (kind, s, m) in enumerate(order):
            if kind == "F":
                if s > 0 and s2r[s - 1] != r:
                    out.append(Action(r, "RECV_F", s, m))
                out.append(Action(r, "F", s, m))
                if s < last and s2r[s + 1] != r:
                    out.append(Action(r, "SEND_F", s, m))
            elif kind == "W":
                out.append(Action(r, "W", s, m))
                if last_b[s] == i:
                    out.append(Action(r, "ALLREDUCE", s, -1))
            else:
                if s < last and s2r[s + 1] != r:
                    out.append(Action(r, "RECV_B", s, m))
                out.append(Action(r, "B", s, m))
                if s > 0 and s2r[s - 1] != r:
                    out.append(Action(r, "SEND_B", s, m))
                if last_b[s] == i:
                    out.append(Action(r, "ALLREDUCE", s, -1))
        actions[r] = out
    return Schedule(name, num_stages, num_microbatches, s2r, actions)


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise PlanError(f"a pipeline needs >= 1 stage and >= 1 micro-batch, got {num_stages} stages and "
                        f"{num_microbatches} micro-batches")


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards (in micro-batch order); stage s on rank s."""
    _check_sizes(num_stages, num_microbatches)
    mbs = range(num_microbatches)
    compute = {s: [("F", s, m) for m in mbs] + [("B", s, m) for m in mbs] for s in range(num_stages)}
    return with_comms("gpipe", num_stages, num_microbatches, range(num_stages), compute)


def one_f_one_b_orders(p: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    """Per stage, 1F1B's compute order: min(p-s-1, m) warm-up forwards, then alternate F/B, then drain the Bs
    (`one_f_one_b`, `zb_h1` and schedule_waves.py's waves start from it)."""
    compute: dict[int, list[tuple[str, int, int]]] = {}
    for s in range(p):
        warmup = min(p - s - 1, m)
        order = [("F", s, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", s, warmup + i), ("B", s, i)]
        order += [("B", s, i) for i in range(m - warmup, m)]
        compute[s] = order
    return compute


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """PipeDream-flush 1F1B: min(p-s-1, m) warm-up forwards, then alternate F/B, then drain the Bs."""
    _check_sizes(num_stages, num_microbatches)
    return with_comms("1f1b", num_stages, num_microbatches, range(num_stages),
                       one_f_one_b_orders(num_stages, num_microbatches))


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1): 1F1B's warm-up and steady
    state with the backward split into B (input gradients, sent upstream at once) and W (weight gradients).

    Stage s runs min(p-s-1, m) warm-up forwards and then F/B pairs as 1F1B does, but keeps up to s of its
    W's pending: W(i) runs after B(i+s) in the steady state, one pending W after each cool-down B, the rest
    after the stage's last B. The later stages' B's of the last micro-batches thus run early (their W's
    fill the cool-down bubbles), and with F = B = W the step is (m + (p-1)/3)(F+B+W) instead of 1F1B's
    (m + p - 1)(F+B+W): bubble (p-1)(F+B-W) per stage, the paper's figure. A micro-batch's activations
    live from its F to its W, so stage s holds at most min(p, m): 1F1B's peak (on stage 0) on every stage."""
    _check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    compute: dict[int, list[tuple[str, int, int]]] = {}
    for s, order in one_f_one_b_orders(p, m).items():
        cool = m - min(p - s - 1, m)  # B(i) with i >= cool is a cool-down B (no F after it)
        pending: deque[int] = deque()
        compute[s] = []
        for kind, _, i in order:
            compute[s].append((kind, s, i))
            if kind == "B":
                pending.append(i)
                if len(pending) > s or i >= cool:  # steady state: W lags B by s; cool-down: one per B
                    compute[s].append(("W", s, pending.popleft()))
        compute[s] += [("W", s, i) for i in pending]
    return with_comms("zb_h1", p, m, range(p), compute)


def interleaved_1f1b(num_ranks: int, num_microbatches: int, chunks: int) -> Schedule:
    """Megatron-LM interleaved 1F1B: `chunks` model chunks per rank, stage s on rank s % num_ranks.

    Micro-batches go through a rank's chunks in groups of `num_ranks`, which is why m % p == 0 is required.
    Warm-up length follows Megatron: 2*(p-r-1) + (v-1)*p forwards (capped at m*v).
    """
    p, m, v = num_ranks, num_microbatches, chunks
    if v < 1:
        raise PlanError(f"interleaved_1f1b needs chunks >= 1, got {v}")
    _check_sizes(p * v, m)
    if m % p:
        raise PlanError(
            f"interleaved_1f1b needs the number of micro-batches ({m}) to be a multiple of the number of "
            f"pipeline ranks ({p}): micro-batches go through each rank's {v} chunks in groups of {p}. "
            f"Use {m + p - m % p} (or {m - m % p}) micro-batches, or the '1f1b' schedule."
        )
    total = m * v

    def fwd(k: int, r: int) -> tuple[str, int, int]:
        chunk = (k % (p * v)) // p
        return ("F", chunk * p + r, (k // (p * v)) * p + k % p)

    def bwd(k: int, r: int) -> tuple[str, int, int]:
        chunk = v - 1 - (k % (p * v)) // p
        return ("B", chunk * p + r, (k // (p * v)) * p + k % p)

    compute: dict[int, list[tuple[str, int, int]]] = {}
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        order = [fwd(k, r) for k in range(warmup)]
        for i in range(total - warmup):
            order += [fwd(warmup + i, r), bwd(i, r)]
        order += [bwd(k, r) for k in range(total - warmup, total)]
        compute[r] = order
    return with_comms("interleaved_1f1b", p * v, m, [s % p for s in range(p * v)], compute)


def make_schedule(name: str, num_ranks: int, num_microbatches: int, chunks: int = 1) -> Schedule:
    """Dispatch on the schedule name: 'gpipe' | '1f1b' | 'interleaved_1f1b' | 'zb_h1'."""
    if name == "gpipe":
        return gpipe(num_ranks, num_microbatches)
    if name == "1f1b":
        return one_f_one_b(num_ranks, num_microbatches)
    if name == "interleaved_1f1b":
        return interleaved_1f1b(num_ranks, num_microbatches, chunks)
    if name == "zb_h1":
        return zb_h1(num_ranks, num_microbatches)
    raise PlanError(f"unknown pipeline schedule {name!r}; valid names are {', '.join(SCHEDULES)}")


# ----------------------------------------------------------------------------------------------- execution


@dataclass
class Compiled:
    """A schedule lowered to per-(rank, stream) FIFO queues of (action, its key, dependency keys)."""

    queues: list[tuple[int, str, list[tuple[Action, Key, tuple[Key, ...]]]]]
    recv_of_send: dict[Key, Action]  # SEND key -> the RECV action it completes
    stage_to_rank: tuple[int, ...]


def dependencies(a: Action, stage_to_rank: Sequence[int], num_stages: int, num_microbatches: int,
                 split: bool = False) -> tuple[Key, ...]:
    """Keys of the actions `a` waits for (besides its stream predecessor), before `compile_schedule`
    moves a dependency on a compute action to the last memory action listed after it. `split`: the
    schedule splits the backward into B and W (`splits_backward`)."""
    s, m, kind = a.stage, a.microbatch, a.kind
    if kind == "F":
        if s == 0:
            return ()
        return (("F", s - 1, m),) if stage_to_rank[s - 1] == a.rank else (("RECV_F", s, m),)
    if kind == "B":
        if s == num_stages - 1:
            return (("F", s, m),)
        up = ("B", s + 1, m) if stage_to_rank[s + 1] == a.rank else ("RECV_B", s, m)
        return (("F", s, m), up)
    if kind == "SEND_F":
        return (("F", s, m),)
    if kind == "SEND_B":
        return (("B", s, m),)
    if kind == "RECV_F":
        return (("SEND_F", s - 1, m),)
    if kind == "RECV_B":
        return (("SEND_B", s + 1, m),)
    if kind == "W":
        return (("B", s, m),)
    if kind in MEMORY_OF:
        own = memory_owner(kind, split)
        if kind in _GATHER_KINDS:  # runs at the start of its compute action: waits for its inputs
            return dependencies(Action(a.rank, own, s, m), stage_to_rank, num_stages, num_microbatches, split)
        return ((own, s, m),)
    return tuple(("W" if split else "B", s, i) for i in range(num_microbatches))  # ALLREDUCE


_COMPILED: dict[tuple[int, bool], tuple[Schedule, Compiled]] = {}
COMPILED_KEPT = 64


def compiled(schedule: Schedule, overlap_allreduce: bool = True) -> Compiled:
    """`compile_schedule`, memoised per schedule object (the planner simulates the memoised schedules of
    `plan_simulate.cached_schedule` many times; neither is mutated), the last COMPILED_KEPT kept."""
    key = (id(schedule), overlap_allreduce)
    hit = _COMPILED.get(key)
    if hit is None or hit[0] is not schedule:
        if len(_COMPILED) >= COMPILED_KEPT:
            del _COMPILED[next(iter(_COMPILED))]
        hit = _COMPILED[key] = (schedule, compile_schedule(schedule, overlap_allreduce))
    return hit[1]


def compile_schedule(schedule: Schedule, overlap_allreduce: bool = True) -> Compiled:
    """Split each rank's list into its compute and comm FIFOs; RECVs are completed by their SENDs."""
    s2r, ns, nm = schedule.stage_to_rank, schedule.num_stages, schedule.num_microbatches
    split, after = False, []  # one pass: does it split the backward, and its memory actions after a compute
    for acts in schedule.actions.values():
        for a in acts:
            if a.kind == "W":
                split = True
            elif a.layer >= 0 and a.kind not in _GATHER_KINDS:
                after.append(a)
    # compute action -> the last memory action listed after it (what its dependents wait for)
    end_of: dict[Key, Key] = {(memory_owner(a.kind, split), a.stage, a.microbatch): a.key for a in after}
    queues = []
    recv_of_send: dict[Key, Action] = {}
    for r, acts in schedule.actions.items():
        compute, comm = [], []
        for a in acts:
            kind = a.kind
            if kind == "RECV_F" or kind == "RECV_B":
                recv_of_send[(("SEND_F", a.stage - 1, a.microbatch) if kind == "RECV_F"
                              else ("SEND_B", a.stage + 1, a.microbatch))] = a
                continue
            deps = dependencies(a, s2r, ns, nm, split)
            if a.layer < 0:
                key = (kind, a.stage, a.microbatch)
                if end_of:
                    deps = tuple(end_of.get(d, d) for d in deps)
            else:
                key = (kind, a.stage, a.microbatch, a.layer)
                if end_of and kind in _GATHER_KINDS:
                    deps = tuple(end_of.get(d, d) for d in deps)
            entry = (a, key, deps)
            if kind in _COMPUTE_STREAM or (kind == "ALLREDUCE" and not overlap_allreduce):
                compute.append(entry)
            else:
                comm.append(entry)
        queues.append((r, "compute", compute))
        queues.append((r, "comm", comm))
    return Compiled(queues, recv_of_send, s2r)


@contextmanager
def no_gc() -> Iterator[None]:
    """Pause the cyclic GC: lowering and running a schedule allocate ~10 small acyclic objects per action,
    and collections triggered by them took ~40% of a 64x256 simulation."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def execute(compiled: Compiled, duration: Callable[[Action], float],
            on_event: Callable[[Action, str, float, float], None] | None = None) -> dict[Key, float]:
    """Run the queues to completion (dataflow order); returns each action's end time.

    No arbitration happens (each stream is a FIFO), so the result does not depend on the processing order.
    Raises PlanError naming the stuck actions when the schedule deadlocks. Callers wrap it in `no_gc()`.
    """
    queues = compiled.queues
    recv_of_send = compiled.recv_of_send
    done: dict[Key, float] = {}
    ptr = [0] * len(queues)
    free = [0.0] * len(queues)
    waiters: dict[Key, list[int]] = {}
    ready = deque(range(len(queues)))
    while ready:
        q = ready.pop()
        ops = queues[q][2]
        i, t = ptr[q], free[q]
        n = len(ops)
        while i < n:
            a, key, deps = ops[i]
            start = t
            missing = None
            for d in deps:
                e = done.get(d)
                if e is None:
                    missing = d
                    break
                if e > start:
                    start = e
            if missing is not None:
                waiters.setdefault(missing, []).append(q)
                break
            end = start + duration(a)
            done[key] = end
            if on_event is not None:
                on_event(a, queues[q][1], start, end)
            w = waiters.pop(key, None)
            if w:
                ready.extend(w)
            recv = recv_of_send.get(key)
            if recv is not None:
                rkey = (recv.kind, recv.stage, recv.microbatch)
                done[rkey] = end
                if on_event is not None:
                    on_event(recv, "recv", start, end)
                w = waiters.pop(rkey, None)
                if w:
                    ready.extend(w)
            t = end
            i += 1
        ptr[q], free[q] = i, t
    stuck = [(queues[q][0], queues[q][2][ptr[q]]) for q in range(len(queues)) if ptr[q] < len(queues[q][2])]
    if stuck:
        parts = []
        for _, (a, _key, deps) in stuck[:8]:
            waits = [d for d in deps if d not in done]
            names = [f"r{compiled.stage_to_rank[d[1]]}:{format_key(d)}" for d in waits[:3]]
            parts.append(f"{a} waits for {', '.join(names)}")
        raise PlanError("schedule deadlocks: every rank is blocked; " + "; ".join(parts))
    return done


def format_key(k: Key) -> str:
    """An action key as error messages name it (here and in schedule_check.py): `s1F0` (stage 1's forward of
    micro-batch 0), `s1ALLREDUCE`, `s1F0L2` for a key with a layer index."""
    kind, s, m = k[:3]
    if len(k) > 3:
        return f"s{s}{kind}{m}L{k[3]}"
    return f"s{s}{kind}" if kind == "ALLREDUCE" else f"s{s}{kind}{m}"


# ----------------------------------------------------------------------------------------------- checks

def splits_backward(schedule: Schedule) -> bool:
    """Whether the schedule splits the backward into B (input gradients) and W (weight gradients)."""
    return any(a.kind == "W" for acts in schedule.actions.values() for a in acts)


def peak_inflight(schedule: Schedule) -> dict[int, int]:
    """Per rank, the most (stage, micro-batch) pairs whose forward has run and backward has not (with a
    split backward: whose W has not, as W reads the activations B left)."""
    peaks = {}
    end = "W" if splits_backward(schedule) else "B"
    for r, acts in schedule.actions.items():
        live = peak = 0
        for a in acts:
            if a.kind == "F":
                live += 1
                peak = max(peak, live)
            elif a.kind == end:
                live -= 1
        peaks[r] = peak
    return peaks


def compute_actions(schedule: Schedule, rank: int) -> list[Action]:
    """The F/B/W actions of `rank` in order (transfers and ALLREDUCE left out)."""
    return [a for a in schedule.actions.get(rank, []) if a.kind in COMPUTE_KINDS]


__all__ = [
    "Action", "Schedule", "KINDS", "MEMORY_KINDS", "MEMORY_OF", "SCHEDULES", "SPLIT_SCHEDULES", "gpipe", "one_f_one_b",
    "interleaved_1f1b", "zb_h1", "memory_owner", "splits_backward",
    "make_schedule", "peak_inflight", "compute_actions", "no_gc",
    "Compiled", "compile_schedule", "execute", "dependencies",
]
