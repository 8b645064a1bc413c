"""The plan does not depend on the wall clock (solver/budget.py): work budgets decide it, the wall clock only guards
and warns where it cuts something short (issue 25 part 4)."""

from __future__ import annotations

import time
import warnings

import pytest
from ortools.sat.python import cp_model

from autopar.api import cost_model
from autopar.models import gpt
from autopar.solver import budget
from autopar.solver.search.search import Search, search

GENEROUS_S = 1e12  # a wall-clock guard that never fires, even on a clock running 1e4 s per reading


def _cm():
    """Two nodes of two small A100s and one of two small V100s, an 8-block GPT: by-type pipelines (the batch
    split's CP-SAT) and splits past the enumeration (the refinement's CP-SAT stage models)."""
    mc = gpt(batch=7, seq=64, vocab=512, hidden=256, layers=8, heads=4)
    cluster = {"nodes": [
        {"device": {"name": "small-A", "based_on": "A100-80GB", "memory_GiB": 0.03}, "devices_per_node": 2,
         "count": 2},
        {"device": {"name": "small-V", "based_on": "V100-16GB", "memory_GiB": 0.03}, "devices_per_node": 2,
         "count": 1}]}
    return cost_model(mc.model, cluster, mc.example_inputs, mc.example_target, mc.loss_fn)


def _plan_on_clock(monkeypatch: pytest.MonkeyPatch, cm, tick: float) -> tuple[str, list[str], list[tuple]]:
    """The plan's JSON under a clock advancing `tick` seconds per reading (0: frozen), the CP-SAT solves the
    search ran (but the intra-op ILP's, memoised across searches) and every CP-SAT solve's parameters."""
    now = [1000.0]

    def clock() -> float:
        now[0] += tick
        return now[0]

    whats: list[str] = []
    params: list[tuple] = []
    inner_solve, inner_cpsat = budget.solve, cp_model.CpSolver.solve

    def record_what(solver, model, what: str) -> int:
        if "intra-op" not in what:
            whats.append(what)
        return inner_solve(solver, model, what)

    def record_params(solver, *args, **kwargs):
        prm = solver.parameters
        params.append((prm.max_time_in_seconds, prm.max_deterministic_time, prm.num_workers, prm.random_seed))
        return inner_cpsat(solver, *args, **kwargs)

    with monkeypatch.context() as mp:
        mp.setattr(time, "perf_counter", clock)
        mp.setattr(budget, "solve", record_what)
        mp.setattr(cp_model.CpSolver, "solve", record_params)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no guard fires: any "planning stopped" warning fails the test
            plan = search(cm, time_limit_s=GENEROUS_S)
    return plan.to_json(), whats, params


def test_plan_does_not_depend_on_the_wall_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frozen clock and one running 1e4 s a reading give the same plan and the same CP-SAT solves, each
    single-threaded with a fixed seed and a deterministic limit, its wall-clock limit only the generous guard."""
    cm = _cm()
    frozen, whats_frozen, params_frozen = _plan_on_clock(monkeypatch, cm, 0.0)
    fast, whats_fast, params_fast = _plan_on_clock(monkeypatch, cm, 1e4)
    assert any("stage model" in w for w in whats_frozen) and any("batch split" in w for w in whats_frozen)
    assert fast == frozen
    assert whats_fast == whats_frozen
    for wall, det, workers, seed in params_frozen + params_fast:
        assert workers == 1 and seed == 0 and 0 < det <= budget.WALL_FLOOR_S
        assert wall >= budget.WALL_FLOOR_S  # the guard's time left (or, unguarded, the floor): never what stops


def test_refinement_cut_by_the_guard_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    cm = _cm()
    refine = Search._refine

    def late(self: Search, finalists: list) -> None:
        self.guard.deadline = -float("inf")  # the guard passes once the search loop is done
        refine(self, finalists)

    monkeypatch.setattr(Search, "_refine", late)
    with pytest.warns(UserWarning, match=r"wall-clock guard .* while refining: (\d+) of its \1 finalists were not "
                                         r"re-solved, so this plan depends on the machine's speed and load"):
        plan = Search(cm, time_limit_s=GENEROUS_S).run()
    assert plan.predicted["step_time_s"] > 0


def _golomb(n: int = 11) -> cp_model.CpModel:
    """A Golomb ruler of n marks: CP-SAT needs far more than a second to prove its optimum."""
    md = cp_model.CpModel()
    x = [md.new_int_var(0, n * n, f"x{i}") for i in range(n)]
    md.add(x[0] == 0)
    for i in range(n - 1):
        md.add(x[i] < x[i + 1])
    diffs = []
    for i in range(n):
        for j in range(i + 1, n):
            d = md.new_int_var(1, n * n, f"d{i}_{j}")
            md.add(d == x[j] - x[i])
            diffs.append(d)
    md.add_all_different(diffs)
    md.minimize(x[-1])
    return md


def test_cpsat_cut_by_the_guard_warns_and_by_its_work_budget_not() -> None:
    solver = budget.cpsat(100.0, budget.WallGuard(0.0))
    with pytest.warns(UserWarning, match=r"stopped at the wall-clock guard: the test model ran out of its .* s of "
                                         r"wall-clock time .* depends on the machine's speed and load; raise "
                                         r"time_limit_s"):
        status = budget.solve(solver, _golomb(), "the test model")
    assert status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE)

    solver = budget.cpsat(0.05, budget.WallGuard(GENEROUS_S))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        status = budget.solve(solver, _golomb(), "the test model")
    assert status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE) and solver.deterministic_time >= 0.05
