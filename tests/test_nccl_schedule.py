"""NCCL's point-to-point rules (schedule_nccl.py) over every schedule family's lowered transfers, the batching
pass that makes them complete, compile's check, and the executor issuing exactly the lowering's batches."""

from __future__ import annotations

import pytest

from autopar import lowering
from autopar.errors import PlanError
from autopar.ir.lowered import PipelineLayout, StageLayout
from autopar.ir.schedule_nccl import Batch, P2POp, batch_transfers, nccl_problems, unbatched
from autopar.ir.schedule_waves import call_of_wave, wave_calls
from autopar.lowering import (
    check_transfers,
    eval_steps,
    flushless_steps,
    layout_programs,
    make_layout,
    pipeline_schedule,
    train_steps,
)


def layout(schedule: str, degrees: tuple[int, ...], m: int, chunks: int = 1, dp: int = 1):
    pipes, base = [], 0
    g = len(degrees)
    for d in range(dp):
        firsts = [base + sum(degrees[:i]) for i in range(g)]
        stages = tuple(StageLayout((s, s + 1), tuple(range(firsts[s % g], firsts[s % g] + degrees[s % g])))
                       for s in range(g * chunks))
        pipes.append(PipelineLayout(d, stages, d * m, m, m, schedule, chunks))
        base += sum(degrees)
    return make_layout(pipes, base, m * dp, g * chunks)


FAMILIES = [
    ("gpipe", (1, 1, 1), 4, 1),
    ("1f1b", (1, 1), 4, 1),
    ("1f1b", (1, 1, 1, 1), 8, 1),
    ("zb_h1", (1, 1, 1), 6, 1),
    ("interleaved_1f1b", (1, 1), 4, 2),
    ("interleaved_1f1b", (1, 1, 1, 1), 8, 3),
    ("1f1b", (1, 2, 1), 6, 1),  # one sender into several receivers and back
    ("1f1b", (2, 1, 4), 5, 1),
    ("zb_h1", (1, 2), 4, 1),
]


def today(pipe, g):  # main's executor: every transfer alone, in list order
    return unbatched(pipeline_schedule(pipe).actions[g])


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f"{f[0]}-{f[1]}-m{f[2]}-v{f[3]}")
def test_batched_transfers_complete_under_nccl_rules(family) -> None:
    lay = layout(*family, dp=2)  # two data-parallel replicas
    for steps_of in (train_steps, eval_steps):
        assert nccl_problems(layout_programs(lay, steps_of)) == []
    check_transfers(lay)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f[0] != "gpipe"], ids=lambda f: f"{f[0]}-{f[1]}")
def test_unbatched_transfers_deadlock(family) -> None:
    problems = nccl_problems(layout_programs(layout(*family), today))
    assert problems and problems[-1].startswith("deadlock: rank 0 blocks in [r0:s0SEND_F")


def test_gpipe_and_one_microbatch_complete_even_unbatched() -> None:
    assert nccl_problems(layout_programs(layout("gpipe", (1, 1, 1), 4), today)) == []
    assert nccl_problems(layout_programs(layout("1f1b", (1, 1), 1), today)) == []


def test_interleaved_needs_receives_pulled_earlier() -> None:
    lay = layout("interleaved_1f1b", (1, 1), 4, 2)
    adjacent = lambda pipe, g: batch_transfers(pipeline_schedule(pipe).actions[g])  # noqa: E731
    assert any(p.startswith("deadlock") for p in nccl_problems(layout_programs(lay, adjacent)))
    assert nccl_problems(layout_programs(lay, train_steps)) == []


@pytest.mark.parametrize("degrees,m", [((1, 1), 4), ((1, 1, 1, 1), 4), ((1, 2, 1), 3), ((1, 1, 1), 2)])
def test_flushless_2bw_calls(degrees, m) -> None:
    lay = layout("1f1b", degrees, m)
    for k in (1, 2, 3, 4):
        assert nccl_problems(layout_programs(lay, flushless_steps(k))) == []

    def unbatched_calls(pipe, g):
        calls, drains = wave_calls(len(pipe.stages), pipe.num_microbatches, g)
        return [st for r in range(3) for st in unbatched(call_of_wave(calls, r))] + list(
            unbatched(call_of_wave(drains, 2)))
    assert any(p.startswith("deadlock") for p in nccl_problems(layout_programs(lay, unbatched_calls)))
    check_transfers(lay, flushless=True)


def test_mismatch_and_unmatched_are_reported() -> None:
    f0, f1 = ("F", 0, 0, 0), ("F", 0, 1, 0)
    swapped = {0: [Batch("a", (P2POp(1, True, f0), P2POp(1, True, f1)))],
               1: [Batch("b", (P2POp(0, False, f1), P2POp(0, False, f0)))]}
    problems = nccl_problems(swapped)
    assert sum(p.startswith("mismatch") for p in problems) == 2 and not any("deadlock" in p for p in problems)
    sizes = {0: [Batch("a", (P2POp(1, True, f0, 8),))], 1: [Batch("b", (P2POp(0, False, f0, 16),))]}
    assert "(8 B)" in nccl_problems(sizes)[0]
    lonely = {0: [Batch("a", (P2POp(1, True, f0),))], 1: []}
    assert [p.split(":")[0] for p in nccl_problems(lonely)] == ["unmatched", "deadlock"]


def test_memory_actions_do_not_change_the_batches() -> None:
    sched = pipeline_schedule(layout("1f1b", (1, 1), 4).pipelines[0])
    with_memory = lowering.memory_actions(sched, 0, {0: {0}}, {0: {0}})
    kinds = lambda steps: [[a for a in st] for st in steps if st[0].kind.startswith(("SEND", "RECV"))]  # noqa: E731
    assert kinds(batch_transfers(with_memory.actions[0])) == kinds(batch_transfers(sched.actions[0]))


def test_check_raises_naming_ranks_when_the_pass_is_skipped(monkeypatch) -> None:
    monkeypatch.setattr(lowering, "batch_transfers", unbatched)  # main's executor: no batches, no repair
    monkeypatch.setattr(lowering, "settle", lambda steps, *args: dict(steps))
    lowering._transfer_steps.cache_clear()
    lowering._shape_ok.cache_clear()
    try:
        with pytest.raises(PlanError, match=r"would hang on NCCL.*rank 0 blocks in \[r0:s0SEND_F"):
            check_transfers(layout("1f1b", (1, 1), 4))
    finally:
        lowering._transfer_steps.cache_clear()
        lowering._shape_ok.cache_clear()


# ---- the executor issues exactly the lowering's batches -------------------------------------------------

def recorded_run(rank: int, world: int) -> tuple[list, list]:
    """A 2-stage 1F1B step on this gloo rank: the batch_isend_irecv calls it made, and the lowering's batches."""
    import torch.distributed as dist

    from tests.runtime_cases import compile_case

    calls: list = []
    real = dist.batch_isend_irecv

    def spy(ops):
        calls.append([("send" if op.op is dist.isend else "recv", op.peer) for op in ops])
        return real(ops)
    dist.batch_isend_irecv = spy
    try:
        case, prog = compile_case("gpt", {"layers": 2, "batch": 4}, {"pp": 2, "m": 2, "schedule": "1f1b"}, rank, world)
        calls.clear()
        prog.step(*case.example_inputs, target=case.example_target)
    finally:
        dist.batch_isend_irecv = real
    low = prog.lowered
    want = [[(op.peer, op.send) for op in b.ops] for b in lowering.p2p_batches(low.pipeline, low.position.tp_index,
                                                                            low.steps)]
    return calls, want


def test_executor_issues_the_lowered_batches() -> None:
    pytest.importorskip("transformers")
    from autopar.runtime.launch import spawn_local

    for calls, want in spawn_local(recorded_run, 2, timeout_s=120):
        assert [[(peer, kind == "send") for kind, peer in c] for c in calls] == want
        assert len(calls) >= 3 and any(len(c) == 2 for c in calls)  # 1F1B's paired exchange is one batch
