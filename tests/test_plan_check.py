"""The plan checks itself (runtime/plan_check.py): each rank's measured peak memory against its prediction."""

from __future__ import annotations

import json
import warnings

import pytest

import autopar
from autopar import models
from autopar.runtime.launch import spawn_local

from .runtime_cases import optimizer


def _case() -> models.ModelCase:
    return models.gpt(seed=0, batch=4, seq=16, vocab=128, hidden=64, layers=2, heads=4)


def _plan(case: models.ModelCase, cluster: str, strategy: autopar.Strategy, scale: float = 1.0) -> str:
    """The priced plan of `strategy`, its predicted peaks multiplied by `scale` (a memory model that is off)."""
    plan = json.loads(autopar.estimate(case.model, cluster, strategy, case.example_inputs, case.example_target,
                                       case.loss_fn, precision="fp32").plan.to_json())
    peaks = plan["predicted"]["peak_memory_bytes"]
    plan["predicted"]["peak_memory_bytes"] = {k: int(v * scale) for k, v in peaks.items()}
    return json.dumps(plan)


def _train(plan: str, cluster: str, steps: int = 4) -> autopar.Program:
    case = _case()
    prog = autopar.compile(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn, optimizer,
                           plan=plan, timeout_s=60)
    for _ in range(steps):
        prog.step(*case.example_inputs, target=case.example_target)
    return prog


def test_a_plan_that_holds_reports_its_figures() -> None:
    case = _case()
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.PlanDriftWarning)
        prog = _train(_plan(case, "1x1xcpu", autopar.Strategy()), "1x1xcpu")
    report = prog.report()
    (r,) = report.ranks
    assert r.measured_peak_bytes is not None and 0.5 < r.ratio <= 1.15, r  # drift is the over-side only
    assert len(r.step_seconds) == 4 and r.window_steps == 3 and r.measured_step_s > 0
    assert report.drifted() == []
    text = str(report)
    assert "measured peak" in text and "DRIFT" not in text


def test_drift_warns_naming_the_rank_figures_and_plan() -> None:
    """A prediction a fifth of what the rank holds: the warning names the rank, the figures and the plan; the
    report marks it."""
    case = _case()
    with pytest.warns(autopar.PlanDriftWarning, match=r"rank 0 \(cpu\) peaked at .* MiB .*x its predicted peak "
                                                      r".*its plan: stage 0 layers \[0, 4\)"):
        prog = _train(_plan(case, "1x1xcpu", autopar.Strategy(), scale=0.2), "1x1xcpu")
    report = prog.report()
    assert report.drifted() == [0]
    assert "DRIFT" in str(report)


def test_check_off_measures_nothing() -> None:
    case = _case()
    prog = autopar.compile(case.model, "1x1xcpu", case.example_inputs, case.example_target, case.loss_fn,
                           optimizer, plan=_plan(case, "1x1xcpu", autopar.Strategy(), scale=0.2), check_plan=False)
    prog.step(*case.example_inputs, target=case.example_target)
    (r,) = prog.report().ranks
    assert r.measured_peak_bytes is None and "not built by autopar.compile" in r.not_measured


def _two_ranks(rank: int, world: int, plan: str) -> tuple[str, list[int], list[str], list[list]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        prog = _train(plan, "1x2xcpu", steps=5)
    report = prog.report()
    drift = [str(w.message) for w in seen if issubclass(w.category, autopar.PlanDriftWarning)]
    stages = [[(t.stage, t.predicted_compute_s, t.measured_compute_s) for t in r.stage_times] for r in report.ranks]
    return str(report), report.drifted(), drift, stages


def test_report_gathers_every_rank_and_drift_is_an_error_in_ranks() -> None:
    case = _case()
    results = spawn_local(_two_ranks, 2, _plan(case, "1x2xcpu", autopar.Strategy(pp=2, microbatch_size=2)),
                          timeout_s=120)
    for text, drifted, drift, stages in results:
        assert drifted == [] and drift == []
        # both ranks' rows, on every rank: one in the memory table, one per stage in the stage table
        assert text.count("\n0 ") == 2 and text.count("\n1 ") == 2, text
        assert "predicted compute" in text
        # each rank computes its own stage; measured over the 2 steps after the memory window
        assert [[t[0] for t in r] for r in stages] == [["stage 0"], ["stage 1"]]
        assert all(p > 0 and m > 0 for r in stages for _, p, m in r), stages
    # the suite's filter makes drift an error; spawn_local gives the ranks the caller's filters
    with pytest.raises(autopar.AutoparError, match="PlanDriftWarning"):
        spawn_local(_train_expecting_error, 2, _plan(case, "1x2xcpu", autopar.Strategy(pp=2, microbatch_size=2),
                                                      scale=0.01), timeout_s=120)


def test_a_stage_waiting_for_its_gradient_is_not_timed_as_computing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 emulates a device 8x slower (its forwards and backwards sleep): rank 0's backwards wait for rank 1's
    gradients, and that wait is no compute, so rank 0's measured compute stays its own, far below rank 1's."""
    from autopar.runtime.straggler import SLOWDOWN_ENV

    case = _case()
    monkeypatch.setenv(SLOWDOWN_ENV, "1:8")
    results = spawn_local(_two_ranks, 2, _plan(case, "1x2xcpu", autopar.Strategy(pp=2, microbatch_size=2)),
                          timeout_s=120)
    (_, _, _, stages), _ = results
    (_, _, fast), (_, _, slow) = stages[0][0], stages[1][0]
    assert fast < 0.4 * slow, stages


def _train_expecting_error(rank: int, world: int, plan: str) -> None:
    _train(plan, "1x2xcpu")


def test_a_second_program_is_measured_after_the_first_gives_way() -> None:
    """A program compiled while an earlier one's window is still open (fewer steps than the window's): the
    earlier window ends with what it saw, and the new program is measured."""
    case = _case()
    plan = _plan(case, "1x1xcpu", autopar.Strategy())
    first = _train(plan, "1x1xcpu", steps=1)
    second = _train(plan, "1x1xcpu", steps=3)
    (a,), (b,) = first.report().ranks, second.report().ranks
    assert a.measured_peak_bytes is not None and a.window_steps == 1
    assert b.measured_peak_bytes is not None and not b.not_measured and b.window_steps == 3
