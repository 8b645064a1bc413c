"""Pipeline-schedule IR: string/JSON round trips, generators, validator, peak in-flight micro-batches."""

from __future__ import annotations

import json

import pytest

from autopar.errors import PlanError
from autopar.ir.schedule import (
    Action,
    Schedule,
    compute_actions,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    peak_inflight,
)
from autopar.ir.schedule_check import validate

CASES = [("gpipe", p, m, 1) for p in (1, 2, 4) for m in (1, 3, 8)] + \
        [("1f1b", p, m, 1) for p in (1, 2, 4, 5) for m in (1, 3, 8)] + \
        [("interleaved_1f1b", p, m, v) for p in (1, 2, 3) for m in (p, 2 * p, 4 * p) for v in (1, 2, 3)] + \
        [("zb_h1", p, m, 1) for p in (1, 2, 4) for m in (1, 3, 8)]


def _all_actions(s: Schedule) -> list[Action]:
    return [a for acts in s.actions.values() for a in acts]


@pytest.mark.parametrize("text", ["r0:s1F3", "r1:s2SEND_B0", "r0:s0ALLREDUCE", "r12:s30RECV_F255",
                                  "r3:s7B0", "r2:s5SEND_F11", "r4:s4RECV_B2"])
def test_action_string_round_trip(text: str) -> None:
    a = Action.parse(text)
    assert str(a) == text
    assert Action.parse(str(a)) == a


def test_action_fields_and_compact_form() -> None:
    a = Action.parse("r0:s1F3")
    assert (a.rank, a.kind, a.stage, a.microbatch) == (0, "F", 1, 3)
    assert Action.parse("r0:s0ALLREDUCE").microbatch == -1
    assert Action.parse("s1B2", rank=5) == Action(5, "B", 1, 2)
    assert Action(5, "B", 1, 2).compact() == "s1B2"


@pytest.mark.parametrize("bad", ["r0:s1X3", "r0:F3", "s1F3", "r0:s0ALLREDUCE3", "r0:s1F", ""])
def test_action_parse_rejects(bad: str) -> None:
    with pytest.raises(PlanError):
        Action.parse(bad)


def test_action_constructor_rejects_bad_kind_and_microbatch() -> None:
    with pytest.raises(PlanError, match="unknown action kind"):
        Action(0, "X", 0, 0)  # (W is a kind since zero-bubble schedules: the weight-gradient backward)
    with pytest.raises(PlanError):
        Action(0, "ALLREDUCE", 0, 3)
    with pytest.raises(PlanError):
        Action(0, "F", 0, -1)


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_schedule_round_trips(name: str, p: int, m: int, v: int) -> None:
    s = make_schedule(name, p, m, chunks=v)
    text = str(s)
    assert Schedule.parse(text) == s
    assert str(Schedule.parse(text)) == text
    assert Schedule.from_json(s.to_json()) == s
    assert Schedule.from_json(json.loads(s.to_json())) == s
    assert len(text.splitlines()) == 1 + s.num_ranks


def test_schedule_text_format() -> None:
    s = one_f_one_b(2, 2)
    assert str(s).splitlines() == [
        'schedule "1f1b" stages=2 microbatches=2 stage_to_rank=0,1',
        "r0: s0F0 s0SEND_F0 s0F1 s0SEND_F1 s0RECV_B0 s0B0 s0RECV_B1 s0B1 s0ALLREDUCE",
        "r1: s1RECV_F0 s1F0 s1B0 s1SEND_B0 s1RECV_F1 s1F1 s1B1 s1SEND_B1 s1ALLREDUCE",
    ]


def test_schedule_name_with_spaces_round_trips() -> None:
    s = gpipe(2, 2)
    s.name = 'my "custom" schedule'
    assert Schedule.parse(str(s)) == s


def test_schedule_parse_errors() -> None:
    with pytest.raises(PlanError, match="header"):
        Schedule.parse("r0: s0F0")
    with pytest.raises(PlanError, match="cannot parse"):
        Schedule.parse('schedule "x" stages=1 microbatches=1 stage_to_rank=0\nr0: s0Q0')
    with pytest.raises(PlanError, match="lacks the field"):
        Schedule.from_json({"name": "x"})


def test_make_schedule_errors() -> None:
    with pytest.raises(PlanError, match="gpipe, 1f1b, interleaved_1f1b"):
        make_schedule("zero_bubble", 2, 4)
    with pytest.raises(PlanError, match=r"multiple of the number of pipeline ranks \(4\)"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(PlanError):
        gpipe(0, 4)


def test_interleaved_placement() -> None:
    s = interleaved_1f1b(3, 6, 2)
    assert s.num_stages == 6 and s.stage_to_rank == (0, 1, 2, 0, 1, 2)
    # stage 3 (rank 0) receives from stage 2 (rank 2): the wrap-around transfer exists
    assert Action(0, "RECV_F", 3, 0) in s.actions[0]
    assert Action(2, "SEND_F", 2, 0) in s.actions[2]


def test_generators_insert_comms_and_one_allreduce_per_stage() -> None:
    for s in (gpipe(3, 4), one_f_one_b(3, 4), interleaved_1f1b(2, 4, 2)):
        acts = _all_actions(s)
        kinds = [a.kind for a in acts]
        n_cross = sum(1 for i in range(s.num_stages - 1) if s.stage_to_rank[i] != s.stage_to_rank[i + 1])
        for k in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"):
            assert kinds.count(k) == n_cross * s.num_microbatches
        assert sorted(a.stage for a in acts if a.kind == "ALLREDUCE") == list(range(s.num_stages))
        for rank_acts in s.actions.values():
            for i, a in enumerate(rank_acts):
                if a.kind == "ALLREDUCE":
                    assert all(b.stage != a.stage for b in rank_acts[i:] if b.kind == "B")


def test_single_rank_interleaved_has_no_transfers() -> None:
    s = interleaved_1f1b(1, 3, 3)
    validate(s)
    assert {a.kind for a in s.actions[0]} == {"F", "B", "ALLREDUCE"}


def test_validate_accepts_all_generated() -> None:
    for p in range(1, 7):
        for m in range(1, 13):
            validate(gpipe(p, m))
            validate(one_f_one_b(p, m))
            if m % p == 0:
                for v in (1, 2, 3):
                    validate(interleaved_1f1b(p, m, v))


def _edit(s: Schedule, rank: int, new: list[str]) -> Schedule:
    return Schedule(s.name, s.num_stages, s.num_microbatches, s.stage_to_rank,
                    {**s.actions, rank: [Action.parse(t, rank) for t in new]})


def test_validate_rejects_backward_before_forward() -> None:
    s = one_f_one_b(3, 2)
    last = [a.compact() for a in s.actions[2]]
    i, j = last.index("s2F0"), last.index("s2B0")
    last[i], last[j] = last[j], last[i]
    with pytest.raises(PlanError, match="r2:s2B0 is scheduled before its forward r2:s2F0"):
        validate(_edit(s, 2, last))


def test_validate_rejects_missing_forward() -> None:
    s = gpipe(2, 3)
    r0 = [a.compact() for a in s.actions[0] if a.compact() not in ("s0F1", "s0SEND_F1")]
    with pytest.raises(PlanError, match="r0:s0F1 is missing"):
        validate(_edit(s, 0, r0))


def test_validate_rejects_duplicate() -> None:
    s = gpipe(2, 2)
    r1 = [a.compact() for a in s.actions[1]] + ["s1F0"]
    with pytest.raises(PlanError, match="r1:s1F0 appears twice"):
        validate(_edit(s, 1, r1))


def test_validate_rejects_wrong_rank() -> None:
    s = gpipe(2, 2)
    moved = Schedule(s.name, 2, 2, s.stage_to_rank, {
        0: [a for a in s.actions[0] if a.compact() != "s0F1"],
        1: [Action(1, "F", 0, 1)] + s.actions[1],
    })
    with pytest.raises(PlanError, match="r1:s0F1 runs on rank 1, but stage 0 lives on rank 0"):
        validate(moved)


def test_validate_rejects_recv_without_send() -> None:
    s = one_f_one_b(2, 2)
    r0 = [a.compact() for a in s.actions[0] if a.compact() != "s0SEND_F1"]
    with pytest.raises(PlanError, match=r"r1:s1RECV_F1 has no matching send r0:s0SEND_F1"):
        validate(_edit(s, 0, r0))


def test_validate_rejects_forward_without_recv() -> None:
    s = one_f_one_b(2, 2)
    r1 = [a.compact() for a in s.actions[1] if a.compact() != "s1RECV_F0"]
    with pytest.raises(PlanError, match="r0:s0SEND_F0 has no matching receive|r1:s1F0 has no receive"):
        validate(_edit(s, 1, r1))


def test_validate_rejects_cross_rank_deadlock() -> None:
    # Each rank is locally consistent, but rank 1 wants micro-batch 1 first while rank 0 sends it only
    # after the backward of micro-batch 0, which rank 1 has not started yet.
    s = one_f_one_b(2, 2)
    s = _edit(s, 0, "s0F0 s0SEND_F0 s0RECV_B0 s0B0 s0F1 s0SEND_F1 s0RECV_B1 s0B1".split())
    s = _edit(s, 1, "s1RECV_F1 s1F1 s1B1 s1SEND_B1 s1RECV_F0 s1F0 s1B0 s1SEND_B0".split())
    with pytest.raises(PlanError, match=r"deadlocks.*r1:s1F1 waits for r1:s1RECV_F1"):
        validate(s)


def test_validate_rejects_allreduce_before_last_backward() -> None:
    s = gpipe(1, 2)
    with pytest.raises(PlanError, match="r0:s0ALLREDUCE is scheduled before the backward r0:s0B1"):
        validate(_edit(s, 0, "s0F0 s0F1 s0B0 s0ALLREDUCE s0B1".split()))


@pytest.mark.parametrize("p,m", [(1, 1), (2, 5), (4, 4), (4, 8), (6, 3)])
def test_peak_inflight_gpipe_and_1f1b(p: int, m: int) -> None:
    assert peak_inflight(gpipe(p, m)) == dict.fromkeys(range(p), m)
    assert peak_inflight(one_f_one_b(p, m)) == {r: min(p - r, m) for r in range(p)}


def test_compute_actions_filters_comms() -> None:
    s = one_f_one_b(2, 2)
    assert [str(a) for a in compute_actions(s, 1)] == ["r1:s1F0", "r1:s1B0", "r1:s1F1", "r1:s1B1"]
