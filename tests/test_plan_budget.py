"""The plan does not depend on the wall clock (solver/budget.py): work budgets decide it, the wall clock only guards
and warns where it cuts something short (issue 25 part 4)."""

from __future__ import annotations

import json
import re
import time
import warnings

import pytest
from ortools.sat.python import cp_model

from autopar.api import cost_model
from autopar.models import gpt, moe_gpt
from autopar.solver import budget
from autopar.solver.search import search as search_module
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
        # the solves are recorded in this process: the search runs in it (with workers, each step it takes is the
        # one-process search's, tests/test_speculative.py)
        mp.setattr(search_module, "workers_for", lambda configs, requested: 0)
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

    def late(self: Search, finalists: list, spec=None) -> None:
        self.guard.deadline = -float("inf")  # the guard passes once the search loop is done
        refine(self, finalists, spec)

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



# plans through the device-subset searches (solver/search/subsets.py): (GPT sizes, cluster, the Search run that
# finds the plan returned, the first being the whole cluster's)
SUBSET_CASES = {
    # the Jetson and the T4s do not pay for themselves: `without_slow_types` searches A100+T4, then the A100s alone
    "slow-types": (dict(batch=8, layers=4, hidden=256, seq=128),
                   {"nodes": [{"device": "A100-80GB", "devices_per_node": 2},
                              {"device": "T4", "devices_per_node": 2},
                              {"device": "Jetson-AGX-Orin", "devices_per_node": 1}],
                    "network": {"bandwidth_GBps": 1, "latency_us": 5}}, 3),
    # one sample, 9 devices: no layout uses them all, `fallback_plan` searches 34 subsets, the 4th is the fastest
    "fallback": (dict(vocab=512, seq=64, hidden=128, heads=4, layers=3, batch=1),
                 {"nodes": [{"device": "RTX-3090", "devices_per_node": 2, "count": 1},
                            {"device": "RTX-3090", "devices_per_node": 3, "count": 2},
                            {"device": "Jetson-AGX-Orin", "devices_per_node": 1, "count": 1}],
                  "network": {"bandwidth_GBps": 1, "latency_us": 5}}, 5),
}
JUMP_S = 1e9  # a load spike: the clock jumps this far inside one subset search


def _spiked(monkeypatch: pytest.MonkeyPatch, cm, tick: float, limit_s: float, spike: int | None
            ) -> tuple[str, int, list[str]]:
    """`cm` planned by `search(time_limit_s=limit_s)` under a clock advancing `tick` seconds a reading and JUMP_S
    more as Search run number `spike` starts (after that search's guard is set): the plan's JSON, how many
    searches ran and the warnings."""
    now, runs = [1000.0], [0]
    inner = Search.run

    def clock() -> float:
        now[0] += tick
        return now[0]

    def run(self: Search):
        runs[0] += 1
        if runs[0] == spike:
            now[0] += JUMP_S
        return inner(self)

    with monkeypatch.context() as mp, warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        mp.setattr(time, "perf_counter", clock)
        mp.setattr(Search, "run", run)
        plan = search(cm, time_limit_s=limit_s)
    return plan.to_json(), runs[0], [str(w.message) for w in record]


def _subset_plan_on_clock(monkeypatch: pytest.MonkeyPatch, name: str, tick: float, limit_s: float,
                          spike: int | None) -> tuple[str, int, list[str]]:
    """SUBSET_CASES[name] planned on a spiking clock (`_spiked`)."""
    sizes, cluster, _ = SUBSET_CASES[name]
    case = gpt(device="meta", **sizes)
    cm = cost_model(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn)
    return _spiked(monkeypatch, cm, tick, limit_s, spike)


@pytest.mark.parametrize("name", sorted(SUBSET_CASES))
def test_subset_plans_do_not_depend_on_the_wall_clock(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Each subset search runs on its work budget, the time left of the overall limit only its guard: a clock
    running 1 s a reading with a 1e9 s spike inside the subset search that finds the plan, within a limit of
    1.5e9 s in all, gives the frozen clock's plan, every subset searched and no warning (an equal share of the
    limit per subset would cut the spiking search)."""
    frozen, runs_frozen, said_frozen = _subset_plan_on_clock(monkeypatch, name, 0.0, 1.5 * JUMP_S, None)
    slow, runs_slow, said_slow = _subset_plan_on_clock(monkeypatch, name, 1.0, 1.5 * JUMP_S, SUBSET_CASES[name][2])
    assert json.loads(frozen)["predicted"]["idle_devices"]  # the plan leaves devices out
    assert slow == frozen
    assert runs_slow == runs_frozen >= SUBSET_CASES[name][2]
    assert said_frozen == said_slow == []


@pytest.mark.parametrize("name", sorted(SUBSET_CASES))
def test_subset_searches_cut_by_the_guard_warn(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """The spike, in the first subset search, outruns the limit (0.5e9 s): that search warns that the guard
    stopped it before its work budget, and the loop over the subsets that it stopped after that one."""
    _, runs, said = _subset_plan_on_clock(monkeypatch, name, 1.0, 0.5 * JUMP_S, 2)
    assert runs == 2
    assert any(re.search(r"wall-clock guard .* before its work budget.* depends on the machine's speed and load", s)
               for s in said), said
    assert any(re.search(r"wall-clock guard .* after 1 of the \d+ (subsets without the slowest device types|device "
                         r"subsets): this plan depends on the machine's speed and load; raise time_limit_s", s)
               for s in said), said


def _cp_plan_on_clock(monkeypatch: pytest.MonkeyPatch, tick: float, limit_s: float, spike: int | None
                      ) -> tuple[str, int, list[str]]:
    """A sequence one device cannot hold (tests/test_cp_pricing.py's): its cp = 1 search, then one per
    context-parallel degree (solver/search/context.py `choose`), on a spiking clock (`_spiked`)."""
    from tests.test_cp_pricing import LONG, short_of_one_sample

    case = gpt(device="meta", **LONG)
    cm = cost_model(case.model, short_of_one_sample(**LONG), case.example_inputs, case.example_target, case.loss_fn)
    return _spiked(monkeypatch, cm, tick, limit_s, spike)


def test_context_parallel_degrees_do_not_depend_on_the_wall_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each cp degree's search runs on its work budget, the time left of the overall limit only its guard: a 1e9 s
    spike inside the cp = 2 search, within 1.5e9 s in all, gives the frozen clock's plan (cp 4) and every degree
    searched, without a warning (half of the limit per degree would cut it); a limit the spike outruns stops the
    loop over the degrees after that search, and says so."""
    frozen, runs_frozen, said_frozen = _cp_plan_on_clock(monkeypatch, 0.0, 1.5 * JUMP_S, None)
    slow, runs_slow, said_slow = _cp_plan_on_clock(monkeypatch, 1.0, 1.5 * JUMP_S, 2)
    assert json.loads(frozen)["predicted"]["cp"]["chosen"] == 4
    assert slow == frozen and runs_slow == runs_frozen == 3
    assert said_frozen == said_slow == []
    _, runs, said = _cp_plan_on_clock(monkeypatch, 1.0, 0.5 * JUMP_S, 2)
    assert runs == 2
    assert any(re.search(r"wall-clock guard .* after 1 of the 2 context-parallel degrees > 1: this plan depends on "
                         r"the machine's speed and load; raise time_limit_s", s) for s in said), said


def _ep_plan_on_clock(monkeypatch: pytest.MonkeyPatch, tick: float, limit_s: float, spike: int | None
                      ) -> tuple[str, int, list[str]]:
    """A mixture-of-experts GPT on 4 devices: one search per expert-parallel degree (solver/pricing/experts.py
    `choose`), on a spiking clock (`_spiked`)."""
    case = moe_gpt(device="meta", batch=8, seq=64, hidden=128, layers=2, heads=4, experts=4, top_k=2)
    cm = cost_model(case.model, "1x4xA100-80GB", case.example_inputs, case.example_target, case.loss_fn)
    return _spiked(monkeypatch, cm, tick, limit_s, spike)


def test_expert_parallel_degrees_do_not_depend_on_the_wall_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """As for the cp degrees: a 1e9 s spike inside the first degree's search, within 1.5e9 s in all, gives the
    frozen clock's plan with every degree searched and no warning (a third of the limit per degree would cut
    it); a limit the spike outruns stops the loop after that search, and says so."""
    frozen, runs_frozen, said_frozen = _ep_plan_on_clock(monkeypatch, 0.0, 1.5 * JUMP_S, None)
    slow, runs_slow, said_slow = _ep_plan_on_clock(monkeypatch, 1.0, 1.5 * JUMP_S, 1)
    assert runs_frozen == 3  # ep 4, 2 and 1
    assert slow == frozen and runs_slow == runs_frozen
    assert said_frozen == said_slow == []
    _, runs, said = _ep_plan_on_clock(monkeypatch, 1.0, 0.5 * JUMP_S, 1)
    assert runs == 1
    assert any(re.search(r"wall-clock guard .* after 1 of the 3 expert-parallel degrees: this plan depends on the "
                         r"machine's speed and load; raise time_limit_s", s) for s in said), said
