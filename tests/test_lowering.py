"""`lower(plan, graph, rank)`: one pure function from the plan to what a rank executes, whose action list
the simulator prices and the executor runs (lowering.py, schedule.py, runtime/zero_layers.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import autopar
from autopar import models
from autopar.errors import PlanError
from autopar.ir.plan import Strategy, simulate_stages, stage_times
from autopar.ir.schedule import MEMORY_OF, Action, Schedule
from autopar.ir.schedule_check import validate
from autopar.lowering import lower, priced_schedule
from autopar.runtime.program import Program

from .runtime_cases import STEPS, assert_matches_reference, optimizer, plan_for, reference


@pytest.fixture(scope="module")
def gpt() -> Any:
    case = models.CASES["gpt"](seed=0, layers=4, batch=8)
    return autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)


def _memory(actions: tuple[Action, ...]) -> list[Action]:
    return [a for a in actions if a.kind in MEMORY_OF]


def test_zero3_layers_get_gather_free_and_reduce_around_every_compute_action(gpt: Any) -> None:
    blocks = [i for i, layer in enumerate(gpt.layers) if layer.kind == "block"]
    for rank in (0, 1):
        low = lower(plan_for(gpt, 2, {"dp": 2, "m": 2, "zero": 3}), gpt, rank)
        acts = list(low.actions)
        r = low.position.group  # actions name the pipeline rank (the device group in the pipeline)
        assert set(low.layer_gathered) == set(low.layer_reduced) and low.layer_gathered
        layers = sorted(set(low.layer_gathered.values()))
        assert set(blocks) <= set(layers)  # every block's parameters are per layer (the tied embedding is not)
        for m in range(2):
            f = acts.index(Action(r, "F", 0, m))
            assert acts[f - len(layers):f] == [Action(r, "GATHER_F", 0, m, lay) for lay in layers]
            assert acts[f + 1:f + 1 + len(layers)] == [Action(r, "FREE_F", 0, m, lay) for lay in layers]
            b = acts.index(Action(r, "B", 0, m))
            down = layers[::-1]
            assert acts[b - len(layers):b] == [Action(r, "GATHER_B", 0, m, lay) for lay in down]
            assert acts[b + 1:b + 1 + 2 * len(layers)] == ([Action(r, "REDUCE", 0, m, lay) for lay in down]
                                                          + [Action(r, "FREE_B", 0, m, lay) for lay in down])
        # both holders run the same memory actions in the same order: their collectives pair up
        if rank == 0:
            first = [(a.kind, a.microbatch, a.layer) for a in _memory(low.actions)]
        else:
            assert [(a.kind, a.microbatch, a.layer) for a in _memory(low.actions)] == first


def test_zero2_reduces_per_layer_without_gathering(gpt: Any) -> None:
    low = lower(plan_for(gpt, 2, {"dp": 2, "m": 2, "zero": 2}), gpt, 0)
    kinds = {a.kind for a in _memory(low.actions)}
    assert kinds == {"REDUCE"} and not low.layer_gathered


@pytest.mark.parametrize("spec", [
    {"dp": 2, "m": 4, "batch_split": [6, 2], "zero": 3},  # holders run different schedules: whole-step ZeRO
    {"tp": 2, "zero": 0, "offload": ("optimizer", "params")},  # DTensor stages: whole-step
    {"dp": 2, "m": 2, "zero": 1},  # ZeRO-1 has nothing per layer
])
def test_no_memory_actions_where_the_runtime_keeps_whole_step_zero(gpt: Any, spec: dict) -> None:
    world = 2
    for rank in range(world):
        low = lower(plan_for(gpt, world, spec), gpt, rank)
        assert _memory(low.actions) == [] and not low.layer_reduced and not low.streamed


def test_offloaded_parameters_stream_per_layer(gpt: Any) -> None:
    low = lower(plan_for(gpt, 1, {"offload": ("optimizer", "params")}), gpt, 0)
    assert set(low.streamed) == set(low.params)  # untied: every parameter is read by one layer
    case = models.CASES["gpt"](seed=0, layers=4, batch=8, tie_embeddings=True)
    tied = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    streamed = lower(plan_for(tied, 1, {"offload": ("optimizer", "params")}), tied, 0).streamed
    assert streamed and "wte.weight" not in streamed  # tied: read by two layers, moved whole
    kinds = {a.kind for a in _memory(low.actions)}
    assert kinds == {"GATHER_F", "FREE_F", "GATHER_B", "REDUCE", "FREE_B"}
    # without the optimizer offloaded a single holder updates its device copy: nothing streams
    assert not lower(plan_for(gpt, 1, {"offload": ("params",)}), gpt, 0).streamed


def test_lower_is_pure_and_its_schedule_round_trips(gpt: Any) -> None:
    plan = plan_for(gpt, 4, {"dp": 2, "pp": 2, "m": 2, "zero": 3})
    before = copy.deepcopy(plan)
    a, b = lower(plan, gpt, 1), lower(plan, gpt, 1)
    assert plan == before and a == b
    text = str(a.schedule)
    assert "GATHER_F" in text and Schedule.parse(text) == a.schedule
    validate(a.schedule)
    assert Schedule.from_json(a.schedule.to_json()) == a.schedule
    assert lower(plan, gpt, 1).eval_actions == tuple(x for x in a.actions if x.kind in ("F", "SEND_F", "RECV_F"))
    with pytest.raises(PlanError, match="outside the plan's world"):
        lower(plan, gpt, 4)


def test_memory_action_strings_and_checks() -> None:
    a = Action.parse("r0:s1GATHER_F3L5")
    assert (a.kind, a.stage, a.microbatch, a.layer) == ("GATHER_F", 1, 3, 5) and str(a) == "r0:s1GATHER_F3L5"
    with pytest.raises(PlanError, match="name a layer"):
        Action(0, "REDUCE", 0, 0)
    with pytest.raises(PlanError, match="name a layer"):
        Action(0, "F", 0, 0, 2)
    late = Schedule.parse('schedule "x" stages=1 microbatches=1 stage_to_rank=0\nr0: s0F0 s0GATHER_F0L1 s0B0')
    with pytest.raises(PlanError, match="before its memory action"):
        validate(late)
    orphan = Schedule.parse('schedule "x" stages=1 microbatches=1 stage_to_rank=0\nr0: s0F0 s0B0 s0REDUCE0L1 '
                            's0FREE_F1L1')
    with pytest.raises(PlanError):
        validate(orphan)


def test_the_simulator_prices_the_lowered_actions_as_the_planner_does() -> None:
    """Plan.simulate runs the action list with the memory actions (their seconds from the plan's gather_s /
    reduce_s); the planner's memoised path folds them into F/B. Same step time, and the actions are there."""
    case = models.CASES["gpt"](seed=0, layers=4, batch=8)
    for strategy in (Strategy(dp=2, zero=3, microbatch_size=2), Strategy(dp=2, zero=2, microbatch_size=1),
                     Strategy(dp=1, offload=("optimizer", "params"), microbatch_size=4)):
        world = strategy.dp
        est = autopar.estimate(case.model, f"1x{world}xcpu", strategy, case.example_inputs, case.example_target,
                               case.loss_fn)
        plan = est.plan
        pipe = plan.pipelines[0]
        sched, memory = priced_schedule(plan, pipe)
        assert _memory(tuple(sched.actions[0])) and sum(memory.values()) > 0, strategy
        lowered = plan.simulate()[0].step_time
        folded = simulate_stages(plan.schedule, plan.chunks, pipe.batch_share, pipe.num_microbatches,
                                 [stage_times(s) for s in pipe.stages]).step_time
        assert lowered == pytest.approx(folded, rel=1e-9) and lowered == pytest.approx(
            plan.predicted["step_time_s"], rel=1e-6)


def test_whole_step_zero3_is_priced_as_it_runs() -> None:
    """Uneven replicas keep whole-step ZeRO (one gather per step, one reduction after the schedule): the
    plan prices no per-micro-batch gathers for them, so ZeRO-3 there costs what ZeRO-1 costs."""
    case = models.CASES["gpt"](seed=0, layers=4, batch=8)
    times = {}
    for z in (1, 3):
        s = Strategy(dp=2, zero=z, batch_split=[6, 2], microbatch_size=2)
        plan = autopar.estimate(case.model, "1x2xcpu", s, case.example_inputs, case.example_target, case.loss_fn).plan
        assert all(st.predicted["gather_s"] == 0 for p in plan.pipelines for st in p.stages)
        times[z] = plan.predicted["step_time_s"]
    assert times[3] == pytest.approx(times[1], rel=1e-9)


def _streamed_program() -> tuple[Any, Program]:
    case = models.CASES["gpt"](seed=0, layers=4, batch=8)
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    plan = plan_for(g, 1, {"m": 2, "offload": ("optimizer", "params")})
    return case, Program(case.model, plan, case.example_inputs, case.example_target, case.loss_fn, optimizer, 0, 1,
                         graph=g)


def test_the_executor_runs_exactly_the_listed_memory_actions() -> None:
    case, prog = _streamed_program()
    ran: dict[Action, list[Action]] = {}
    real_end = prog.layers.end

    def end(action: Action) -> None:
        ran[action] = list(prog.layers._ran)
        real_end(action)

    prog.layers.end = end
    losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(STEPS)]
    listed = {}
    for a in prog.lowered.actions:
        if a.kind in MEMORY_OF:
            listed.setdefault(Action(a.rank, MEMORY_OF[a.kind], a.stage, a.microbatch), []).append(a)
    assert listed and set(listed) == {k for k, v in ran.items() if v}
    for compute, acts in listed.items():
        assert sorted(ran[compute], key=str) == sorted(acts, key=str), compute
        reduces = [a.layer for a in ran[compute] if a.kind == "REDUCE"]
        assert reduces == sorted(reduces, reverse=True)  # issued in descending layer order
    ref_losses, ref_params = reference("gpt", {"layers": 4, "batch": 8})
    assert_matches_reference(losses, prog.state_dict()["model"], ref_losses, ref_params, "streamed")


def test_an_action_the_executor_cannot_reach_is_an_error() -> None:
    case, prog = _streamed_program()
    prog._memory[("F", 0, 0)].append(Action(0, "GATHER_F", 0, 0, 999))
    with pytest.raises(PlanError, match="did not run"):
        prog.step(*case.example_inputs, target=case.example_target)


def test_eval_runs_through_the_training_executor() -> None:
    case, prog = _streamed_program()
    seen = []
    real = prog._run

    def run(actions: Any, *a: Any, **kw: Any) -> Any:
        seen.append(kw.get("train", True))
        return real(actions, *a, **kw)

    prog._run = run
    out = prog.eval_step(*case.example_inputs)
    with torch.no_grad():
        ref = case.model(*case.example_inputs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert seen == [False]
