"""`validate`: a schedule's completeness, placement and order checks, then a deadlock-finding run."""

from __future__ import annotations

from ..errors import PlanError
from .schedule import (
    MEMORY_OF,
    Key,
    Schedule,
    compile_schedule,
    execute,
    format_key,
    memory_owner,
    no_gc,
    splits_backward,
)


def validate(schedule: Schedule) -> None:
    """Raise PlanError naming the offending action if `schedule` is incomplete, misplaced or can deadlock."""
    S, M, s2r = schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank
    if S < 1 or M < 1:
        raise PlanError(f"schedule {schedule.name!r} has {S} stages and {M} micro-batches; both must be >= 1")
    if len(s2r) != S:
        raise PlanError(f"stage_to_rank has {len(s2r)} entries for {S} stages")
    if sorted(set(s2r)) != list(range(schedule.num_ranks)):
        raise PlanError(f"stage_to_rank {s2r} leaves a rank without stages; ranks must be 0..n-1, all used")
    pos: dict[Key, tuple[int, int]] = {}  # key -> (rank, index in the rank's list)
    for r, acts in schedule.actions.items():
        if not 0 <= r < schedule.num_ranks:
            raise PlanError(f"schedule has actions for rank {r}, but stage_to_rank only uses ranks "
                            f"0..{schedule.num_ranks - 1}")
        for i, a in enumerate(acts):
            if a.rank != r:
                raise PlanError(f"action {a} is listed under rank {r}")
            if not 0 <= a.stage < S:
                raise PlanError(f"action {a} names stage {a.stage}; the schedule has stages 0..{S - 1}")
            if a.kind != "ALLREDUCE" and a.microbatch >= M:
                raise PlanError(f"action {a} names micro-batch {a.microbatch}; the schedule has 0..{M - 1}")
            if s2r[a.stage] != r:
                raise PlanError(f"action {a} runs on rank {r}, but stage {a.stage} lives on rank "
                                f"{s2r[a.stage]}")
            if a.key in pos:
                raise PlanError(f"action {a} appears twice (first at position {pos[a.key][1]} of rank {r})")
            pos[a.key] = (r, i)
    split = splits_backward(schedule)
    for s in range(S):
        for m in range(M):
            for kind in ("F", "B", "W") if split else ("F", "B"):
                if (kind, s, m) not in pos:
                    raise PlanError(f"action r{s2r[s]}:s{s}{kind}{m} is missing from the schedule")

    def before(first: Key, then: Key, what: str) -> None:
        if pos[first][1] > pos[then][1]:
            r = pos[then][0]
            raise PlanError(f"action r{r}:{format_key(then)} is scheduled before {what} r{r}:{format_key(first)}")

    for key, (r, _) in pos.items():
        kind, s, m = key[:3]
        a = f"r{r}:{format_key(key)}"
        if kind in MEMORY_OF:
            own = (memory_owner(kind, split), s, m)
            if own not in pos or pos[own][0] != r:
                raise PlanError(f"memory action {a} has no compute action r{r}:{format_key(own)} on its rank")
            if kind.startswith("GATHER"):
                before(key, own, "its memory action")
            else:
                before(own, key, "its compute action")
            continue
        if kind in ("SEND_F", "RECV_B"):
            if s == S - 1 or s2r[s + 1] == r:
                raise PlanError(f"action {a} has no peer: stage {s + 1} is not on another rank")
        if kind in ("SEND_B", "RECV_F"):
            if s == 0 or s2r[s - 1] == r:
                raise PlanError(f"action {a} has no peer: stage {s - 1} is not on another rank")
        if kind == "RECV_F" and ("SEND_F", s - 1, m) not in pos:
            raise PlanError(f"action {a} has no matching send r{s2r[s - 1]}:s{s - 1}SEND_F{m}")
        if kind == "RECV_B" and ("SEND_B", s + 1, m) not in pos:
            raise PlanError(f"action {a} has no matching send r{s2r[s + 1]}:s{s + 1}SEND_B{m}")
        if kind == "SEND_F" and ("RECV_F", s + 1, m) not in pos:
            raise PlanError(f"action {a} has no matching receive r{s2r[s + 1]}:s{s + 1}RECV_F{m}")
        if kind == "SEND_B" and ("RECV_B", s - 1, m) not in pos:
            raise PlanError(f"action {a} has no matching receive r{s2r[s - 1]}:s{s - 1}RECV_B{m}")
        if kind == "F":
            if s > 0 and s2r[s - 1] != r:
                if ("RECV_F", s, m) not in pos:
                    raise PlanError(f"action {a} has no receive r{r}:s{s}RECV_F{m} of its input")
                before(("RECV_F", s, m), (kind, s, m), "its receive")
        elif kind == "B":
            before(("F", s, m), (kind, s, m), "its forward")
            if s < S - 1 and s2r[s + 1] != r:
                if ("RECV_B", s, m) not in pos:
                    raise PlanError(f"action {a} has no receive r{r}:s{s}RECV_B{m} of its output gradient")
                before(("RECV_B", s, m), (kind, s, m), "its receive")
        elif kind == "W":
            before(("B", s, m), (kind, s, m), "its input-gradient backward")
        elif kind == "SEND_F":
            before(("F", s, m), (kind, s, m), "its forward")
        elif kind == "SEND_B":
            before(("B", s, m), (kind, s, m), "its backward")
        elif kind == "ALLREDUCE":
            for i in range(M):
                before(("W" if split else "B", s, i), (kind, s, m), "the backward")
    with no_gc():
        execute(compile_schedule(schedule), lambda a: 1.0)


__all__ = ["validate"]
