"""PipeDream-2BW's flushless cross-wave 1F1B: the wave-schedule IR (schedule_waves.py) and its runtime
(runtime/flushless.py), which must train exactly what the flushed AsyncProgram and the single-process
replay of W[c+1] = W[c] - opt(grad L_c(W[max(0, c-1)])) train."""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

import autopar
from autopar.errors import PlanError
from autopar.ir.schedule import one_f_one_b
from autopar.ir.schedule_waves import (
    WaveAction,
    WaveSchedule,
    peak_versions,
    simulate_waves,
    steady_wave_time,
    step_cuts,
    validate_waves,
    waves_1f1b,
)
from autopar.runtime.asynchronous import AsyncProgram
from autopar.runtime.flushless import FlushlessProgram, async_program
from autopar.runtime.launch import spawn_local
from autopar.runtime.memtrace import tensor_bytes
from autopar.solver.asynchronous import flushless_problems, flushless_wave
from autopar.solver.flushless_memory import flushless_inflight, second_version_bytes
from tests.runtime_cases import (
    assert_matches_reference,
    assert_work_split,
    build,
    compile_case,
    optimizer,
    plan_for,
    work_of,
)
from tests.test_async import delayed_reference

# ---- the IR ----------------------------------------------------------------------------------------------


def test_actions_and_schedules_round_trip() -> None:
    for text in ("r0:s1F3@w2", "r1:s0UPDATE@w0", "r2:s2ALLREDUCE@w5", "r0:s1RECV_B0@w1"):
        assert str(WaveAction.parse(text)) == text
    assert WaveAction.parse("s1B2@w3", rank=1) == WaveAction(1, "B", 1, 2, 3)
    for flush in (False, True):
        ws = waves_1f1b(3, 4, 3, 1, flush)
        assert WaveSchedule.parse(str(ws)) == ws
    for bad, words in [("r0:s1F3", "cannot parse"), ("r0:s1UPDATE2@w0", "take no micro-batch"),
                       ("s1F3@w0", "no rank prefix")]:
        with pytest.raises(PlanError, match=words):
            WaveAction.parse(bad)
    with pytest.raises(PlanError, match="micro-batch -1"):
        WaveAction(0, "UPDATE", 0, 2, 0)


def test_one_flushed_wave_is_the_plans_1f1b() -> None:
    """Projected onto schedule.py's IR, one wave is exactly one_f_one_b (its one ALLREDUCE aside)."""
    for p, m in itertools.product(range(1, 5), range(1, 6)):
        ref = one_f_one_b(p, m)
        for flush in (False, True):
            flat = waves_1f1b(p, m, 1, 1, flush).flat()
            assert flat.actions == {r: [a for a in acts if a.kind != "ALLREDUCE"] for r, acts in ref.actions.items()}


def test_generated_schedules_validate() -> None:
    for p, m, k, d in itertools.product(range(1, 5), range(1, 6), range(1, 4), range(3)):
        for flush in (False, True):
            validate_waves(waves_1f1b(p, m, k, d, flush))


def test_validate_names_a_broken_update_rule() -> None:
    ws = waves_1f1b(2, 2, 3, 1)
    acts = ws.actions[0]
    update = acts.pop(next(i for i, a in enumerate(acts) if a.kind == "UPDATE"))
    acts.insert(acts.index(WaveAction(0, "F", 0, 0, 2)) + 1, update)  # after wave 2's first forward: on W[0]
    with pytest.raises(PlanError, match=r"r0:s0F0@w2 runs before r0:s0UPDATE@w0"):
        validate_waves(ws)
    ws = waves_1f1b(2, 2, 3, 1)
    ws.actions[1] = [a for a in ws.actions[1] if (a.kind, a.wave) != ("ALLREDUCE", 1)]
    with pytest.raises(PlanError, match=r"r1:s1ALLREDUCE@w1 is missing"):
        validate_waves(ws)


def test_flushless_removes_the_bubble_between_waves() -> None:
    """Uniform stages, F = 1, B = 2, free transfers and syncs: k flushed waves take k (m + p - 1)(F + B), the
    flushless ones (k m + p - 1)(F + B) (one fill and drain), (p - 1)(F + B) less per wave boundary."""
    F, B = 1.0, 2.0
    for p, m, k in [(2, 4, 3), (4, 4, 5), (4, 3, 4), (3, 6, 2)]:
        flushed = simulate_waves(waves_1f1b(p, m, k, 1, flush=True), F, B).step_time
        flushless = simulate_waves(waves_1f1b(p, m, k, 1), F, B).step_time
        assert flushed == pytest.approx(k * (m + p - 1) * (F + B))
        assert flushless == pytest.approx((k * m + p - 1) * (F + B))
        assert flushed - flushless == pytest.approx((k - 1) * (p - 1) * (F + B))
        assert steady_wave_time(p, m, F, B) == pytest.approx(m * (F + B))
        assert steady_wave_time(p, m, F, B, flush=True) == pytest.approx((m + p - 1) * (F + B))


def test_a_long_sync_sets_the_pace() -> None:
    """p = 2, m = 2, F = B = 1: wave c + 2's first forward waits for wave c's gradient sum (it starts the
    moment the sum ends), and stage 0's last backward of wave c + 1 follows that forward (1F1B keeps one
    backward of the previous wave behind it), so the next sum starts F + B after the last one ended: the
    steady wave is max(m (F + B), sync + F + B)."""
    sim = simulate_waves(waves_1f1b(2, 2, 6, 1), 1.0, 1.0, allreduce=10.0)
    start = {name: t for _, _, name, t, _ in sim.events}
    end = {name: t for _, _, name, _, t in sim.events}
    assert start["r0:s0F0@w2"] == pytest.approx(end["r0:s0ALLREDUCE@w0"])
    assert start["r0:s0ALLREDUCE@w1"] == pytest.approx(end["r0:s0B1@w1"])
    for sync, wave in [(0.5, 4.0), (3.0, 5.0), (5.0, 7.0), (10.0, 12.0)]:
        assert steady_wave_time(2, 2, 1.0, 1.0, allreduce=sync) == pytest.approx(wave)


def test_two_weight_versions_and_in_flight_bound() -> None:
    for p, m in [(2, 1), (2, 3), (4, 2), (4, 4)]:
        assert max(peak_versions(waves_1f1b(p, m, 4, 1)).values()) == 2  # 2BW's double buffering
        assert max(peak_versions(waves_1f1b(p, m, 4, 1, flush=True)).values()) == 1
        assert flushless_inflight(p, m) == [p - s for s in range(p)]  # the continuous 1F1B's cap


def test_calls_cut_the_schedule_one_wave_each() -> None:
    """What the runtime's call of wave c runs: on the last stage all of wave c; on stage 0 of a 3-stage
    pipeline with m = 3, wave c's last two backwards wait for the next call."""
    ws = waves_1f1b(3, 3, 3, 1)
    cuts = step_cuts(ws, 0)
    first = ws.actions[0][:cuts[0]]
    assert [a.compact() for a in first if a.kind == "B"] == ["s0B0@w0"]
    second = ws.actions[0][cuts[0]:cuts[1]]
    assert [a.compact() for a in second if a.kind in ("B", "UPDATE")] == \
        ["s0B1@w0", "s0B2@w0", "s0B0@w1"]
    last = ws.actions[2][:step_cuts(ws, 2)[0]]
    assert sorted(a.microbatch for a in last if a.kind == "B") == [0, 1, 2]


def test_calls_then_a_drain_run_the_shorter_schedule() -> None:
    """What the runtime runs for r + 1 waves and a drain (flush, eval_step): the calls of the long schedule,
    then the deferred actions, is in order the (r + 1)-wave schedule (its final updates aside)."""
    for p, m in [(2, 1), (2, 3), (3, 2), (4, 2), (4, 5)]:
        long = waves_1f1b(p, m, 5, 1)
        for s in range(p):
            for r in range(4):
                short = [a for a in waves_1f1b(p, m, r + 1, 1).actions[s] if a.kind != "UPDATE" or a.wave < r - 1]
                prefix = long.actions[s][:step_cuts(long, s)[r]]
                assert short[:len(prefix)] == prefix, (p, m, s, r)


# ---- the runtime on gloo ranks ---------------------------------------------------------------------------

WAVES = 6
# (model kwargs, plan spec): m >= p - 1, uneven replicas (shares 3 and 1: 2 and 1 micro-batches), m < p - 1
CASES_2 = [({}, {"pp": 2, "m": 3})]
CASES_4 = [({}, {"dp": 2, "pp": 2, "m": 2, "batch_split": [3, 1]}), ({"layers": 4}, {"pp": 4, "m": 2}),
           # ZeRO-1 (owners step and broadcast into the newest version) and tensor parallelism (DTensor stages:
           # the local shards are double-buffered)
           ({}, {"dp": 2, "pp": 2, "m": 2, "zero": 1}), ({}, {"pp": 2, "tp": 2, "m": 2})]
EVAL_AFTER = 3  # an eval_step after this many waves: the pipeline drains, the updates stay pending


def _train(cls: type, kwargs: dict, spec: dict, rank: int, world: int) -> tuple:
    case, prog = compile_case("gpt", kwargs, spec, rank, world, program=cls, sync="2bw")
    losses, evaluated = [], None
    for c in range(WAVES):
        losses.append(prog.step(*case.example_inputs, target=case.example_target))
        if c + 1 == EVAL_AFTER:
            evaluated = prog.eval_step(*case.example_inputs)
    opt = prog.optimizer
    opt_bytes = tensor_bytes(v for st in (opt.state.values() if opt else ()) for v in st.values()
                             if isinstance(v, torch.Tensor) and v.dim() > 0)
    return type(prog).__name__, losses, evaluated, prog.state_dict()["model"], work_of(prog), opt_bytes


def run_cases(rank: int, world: int, cases: list) -> list:
    os.environ.pop("AUTOPAR_SLOWDOWN", None)
    return [(_train(FlushlessProgram, kw, spec, rank, world), _train(AsyncProgram, kw, spec, rank, world))
            for kw, spec in cases]


@pytest.fixture(scope="module")
def results() -> dict[int, list]:
    return {2: spawn_local(run_cases, 2, CASES_2, timeout_s=300), 4: spawn_local(run_cases, 4, CASES_4, timeout_s=600)}


def _reference(kwargs: dict) -> tuple[list[float], dict, torch.Tensor]:
    """The replay, and the model output after EVAL_AFTER waves: on the newest version then, W[EVAL_AFTER - 2]
    (the updates of waves <= EVAL_AFTER - 3 applied; those of the last two are pending)."""
    ref_losses, ref_params = delayed_reference(build("gpt", **kwargs), 1, WAVES)
    early = build("gpt", **kwargs)
    delayed_reference(early, 1, EVAL_AFTER - 2)  # trains early.model in place to W[EVAL_AFTER - 2]
    with torch.no_grad():
        out = early.model(*early.example_inputs)
    return ref_losses, ref_params, out


@pytest.mark.parametrize("world,index", [(2, 0), (4, 0), (4, 1), (4, 2), (4, 3)])
def test_flushless_equals_async_program_and_the_replay(results: dict, world: int, index: int) -> None:
    kwargs, spec = (CASES_2 if world == 2 else CASES_4)[index]
    ref_losses, ref_params, ref_out = _reference(kwargs)
    for rank, per_case in enumerate(results[world]):
        (name, losses, out, params, _, _), (_, a_losses, a_out, a_params, _, _) = per_case[index]
        assert name == "FlushlessProgram"
        who = f"{spec} rank {rank}"
        assert_matches_reference(losses, params, ref_losses, ref_params, who)
        assert losses == pytest.approx(a_losses, rel=1e-6, abs=1e-7), who  # the same rule, the same numbers
        for k, v in a_params.items():
            torch.testing.assert_close(params[k], v, rtol=1e-6, atol=1e-7, msg=f"{who} {k}")
        torch.testing.assert_close(out, a_out, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    case = build("gpt", **kwargs)
    works = [per_case[index][0][4] for per_case in results[world]]
    assert_work_split(works, spec, case.example_inputs[0].shape[0], case.model.state_dict())
    if spec.get("zero"):  # AdamW's two fp32 moments of every parameter held once over the replicas (ZeRO-1)
        for layers in {tuple(w["layers"]) for w in works}:  # the replicas of one stage: the same layers
            ranks = [r for r, w in enumerate(works) if tuple(w["layers"]) == layers]
            held = [results[world][r][index][0][5] for r in ranks]
            state = 8 * sum(math.prod(shape) for shape in works[ranks[0]]["params"].values())
            assert len(ranks) == 2 and sum(held) == state and all(0 < h < state for h in held), (ranks, held, state)


# ---- dispatch and predictions ----------------------------------------------------------------------------


def _plan(world: int, spec: dict) -> autopar.Plan:
    case = build("gpt")
    return plan_for(autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target), world,
                    spec)


def test_dispatch_runs_flushless_only_where_it_runs() -> None:
    assert async_program(_plan(2, {"pp": 2, "m": 2}), "2bw") is FlushlessProgram
    for spec in ({"pp": 2, "dp": 2, "m": 2}, {"pp": 2, "dp": 2, "m": 2, "zero": 1}, {"pp": 2, "tp": 2, "m": 2}):
        assert async_program(_plan(4, spec), "2bw") is FlushlessProgram, spec
    for world, spec, sync, words in [(2, {"pp": 2, "m": 2}, "wsp", "sync='wsp'"),
                                     (2, {"dp": 2, "m": 2}, "2bw", "one stage"),
                                     (4, {"pp": 2, "dp": 2, "m": 2, "zero": 2}, "2bw", "ZeRO level 2"),
                                     (2, {"pp": 2, "m": 2, "schedule": "gpipe"}, "2bw", "'gpipe' schedule")]:
        plan = _plan(world, spec)
        assert async_program(plan, sync) is AsyncProgram
        assert any(words in p for p in flushless_problems(plan, sync))


def test_flushless_wave_prices_the_steady_state() -> None:
    """Two stages at fwd F = 1 s and bwd B = 2 s, m = 4 micro-batches, x = 0.5 s transfers and syncs. In the
    steady 1F1B of two stages, stage 1's next forward waits for stage 0's, which follows stage 0's backward
    of the micro-batch before, which waits for stage 1's gradient: two micro-batches per 2 (F + B + x), so a
    wave takes m (F + B + x) = 14 s (the sync, 0.5 s + F + B < 14 s, hides). None where it does not run."""
    plan = _plan(2, {"pp": 2, "m": 4})
    for st in plan.pipelines[0].stages:
        st.predicted = {"fwd_s": 1.0, "bwd_s": 2.0, "send_s": 0.5, "sync_s": 0.5}
    assert flushless_wave(plan) == pytest.approx(14.0)
    assert flushless_wave(_plan(2, {"dp": 2, "m": 2})) is None


def test_second_version_is_one_more_copy_of_the_stage_weights() -> None:
    """`second_version_bytes`: the stage's parameter elements times the weight bytes, per device, 0 where
    the plan does not run flushless."""
    assert second_version_bytes({0: 1000, 1: 250}, weight_bytes=4, runs=True) == {0: 4000, 1: 1000}
    assert second_version_bytes({0: 1000}, weight_bytes=4, runs=False) == {0: 0}


# ---- autopar.compile end to end --------------------------------------------------------------------------


def compile_2bw(rank: int, world: int) -> list[tuple]:
    """Worker body: `autopar.compile(..., sync="2bw")` with a 2-stage pipeline (the flushless schedule runs)
    and with data parallelism (one stage: it does not, AsyncProgram runs); per case the program class, the
    AsyncUpdateWarning texts (rank 0 warns), what the plan says runs, the losses and the flushed state."""
    import warnings

    from autopar import Strategy
    from autopar.runtime.asynchronous import AsyncUpdateWarning

    out = []
    for strategy in (Strategy(pp=2, microbatch_size=2), Strategy(dp=2)):
        case = build("gpt")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", AsyncUpdateWarning)
            prog = autopar.compile(case.model, "1x2xcpu", case.example_inputs, case.example_target, case.loss_fn,
                                   optimizer, plan=strategy, sync="2bw", timeout_s=60)
        said = [str(w.message) for w in caught if issubclass(w.category, AsyncUpdateWarning)]
        losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(WAVES)]
        out.append((type(prog).__name__, said, prog.plan.predicted["async"], losses, prog.state_dict()["model"]))
    return out


@pytest.fixture(scope="module")
def compiled() -> list:
    return spawn_local(compile_2bw, 2, timeout_s=300)


def test_compile_2bw_runs_the_flushless_program_and_says_so(compiled: list) -> None:
    """compile(plan=Strategy(pp=2), sync="2bw") on 2 gloo ranks trains on FlushlessProgram, the warning and
    `predicted["async"]` say so (with the second weight version priced), and it trains exactly the replay
    of the 2BW rule; a one-stage layout runs AsyncProgram, and the warning says why not flushless."""
    ref_losses, ref_params = delayed_reference(build("gpt"), 1, WAVES)
    for rank, ((name, said, a, losses, params), (dp_name, dp_said, dp_a, dp_losses, dp_params)) in \
            enumerate(compiled):
        assert name == "FlushlessProgram" and a["runtime"] == "FlushlessProgram", (rank, name, a.get("runtime"))
        assert a["flushless_priced"] and all(int(b) > 0 for b in a["second_version_bytes"].values())
        assert dp_name == "AsyncProgram" and dp_a["runtime"] == "AsyncProgram" and not dp_a["second_version_bytes"]
        if rank == 0:
            assert len(said) == 1 and "runs on FlushlessProgram" in said[0], said
            assert len(dp_said) == 1 and "runs on AsyncProgram" in dp_said[0], dp_said
            assert "does not run a pipeline of one stage" in dp_said[0], dp_said
        else:
            assert said == [] and dp_said == []
        assert_matches_reference(losses, params, ref_losses, ref_params, f"flushless rank {rank}")
        assert_matches_reference(dp_losses, dp_params, ref_losses, ref_params, f"dp AsyncProgram rank {rank}")
