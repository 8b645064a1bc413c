"""The search runs on a work budget (issue 25 part 4): the same inputs give the same plan however loaded the
machine is; the wall-clock limit only guards, and says when it decided the plan."""

from __future__ import annotations

import time
import warnings

import pytest

import autopar
from autopar import models
from autopar.errors import PlanError

CLUSTER = "1x2xA100-80GB+1x2xT4"


def _plan(slow_s: float, **kw) -> tuple[autopar.Plan, list[str]]:
    case = models.gpt(layers=4, hidden=256, heads=4, seq=64, batch=16, vocab=1024, device="meta")

    def progress(done: int, total: int, best: float | None) -> None:
        time.sleep(slow_s)  # a loaded machine: every configuration takes longer

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.plan(case.model, CLUSTER, case.example_inputs, case.example_target, case.loss_fn,
                            progress=progress, **kw)
    return plan, [str(w.message) for w in caught if "planning stopped" in str(w.message)]


def _shape(plan: autopar.Plan) -> tuple:
    return (plan.predicted["step_time_s"],
            tuple((p.batch_share, p.microbatch_size, tuple((tuple(s.layers), tuple(s.devices), s.zero, s.recompute)
                                                           for s in p.stages)) for p in plan.pipelines))


def test_the_work_budget_gives_the_same_plan_under_any_load():
    quiet, said_quiet = _plan(0.0, work_limit=6)
    loaded, said_loaded = _plan(0.02, work_limit=6)
    assert _shape(quiet) == _shape(loaded)
    assert said_quiet and said_loaded and all("work budget (work_limit=6" in m for m in said_quiet + said_loaded)
    whole, said = _plan(0.0, work_limit=None)
    assert not said and whole.predicted["step_time_s"] <= quiet.predicted["step_time_s"]


def test_the_wall_clock_guard_warns_that_the_plan_depends_on_the_machine():
    _, said = _plan(0.3, work_limit=None, time_limit_s=4)
    assert said and "wall-clock guard (" in said[0] and "depends on the machine's speed and load" in said[0]


def test_a_bad_work_limit_is_named():
    case = models.mlp()
    with pytest.raises(PlanError, match="work_limit must be an integer"):
        autopar.plan(case.model, "1x1xcpu", case.example_inputs, case.example_target, case.loss_fn, work_limit=0)
