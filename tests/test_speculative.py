"""The search on several processes (solver/search/speculative.py) takes exactly the one-process search's steps.

Every configuration the branch and bound takes must get the result the one-process search gets (the same step
or None, in the same order), hence the same finalists and plan, whatever the workers do: solve ahead with
cutoffs that turn out wrong, die, or raise. The work must also leave the searching process: its own solves
are counted (the workers' are not seen there).
"""

from __future__ import annotations

import os

import pytest

from autopar.api import cost_model
from autopar.errors import InfeasibleError
from autopar.models import gpt
from autopar.solver.search import search as search_module
from autopar.solver.search import speculative
from autopar.solver.search.search import Search

pytestmark = pytest.mark.timeout(300)
TAKEN_MODES: set[int] = set()  # how the last `_trace`'s results solved ahead were solved


def _cm(cluster: str, layers: int = 8, hidden: int = 64, batch: int = 16):
    mc = gpt(batch=batch, seq=32, vocab=256, hidden=hidden, layers=layers, heads=4, device="meta")
    return cost_model(mc.model, cluster, mc.example_inputs, mc.example_target, mc.loss_fn)


@pytest.fixture(scope="module")
def mixed():
    return _cm("1x4xA100-80GB+1x4xV100-16GB", layers=8)  # 369 configurations taken, every mode solved ahead


@pytest.fixture(scope="module")
def mixed_one_process(mixed):
    """`_trace` of the one-process search on `mixed`, which several tests compare with."""
    with pytest.MonkeyPatch.context() as mp:
        return _trace(mp, mixed, 0)


@pytest.fixture(scope="module")
def deep():
    """Single-class finalists whose refinement passes change their results (solved ahead too)."""
    mc = gpt(batch=64, seq=1024, vocab=50257, hidden=2048, layers=24, heads=16, device="meta")
    return cost_model(mc.model, "1x8xA100-80GB", mc.example_inputs, mc.example_target, mc.loss_fn)


def _trace(monkeypatch, cm, workers: int) -> tuple[str, list, int]:
    """(plan JSON, [(config index, how it was solved, shares, step)] in the order the search and its refinement took
    them, solves run in this process during the loop) of one search."""
    taken: list = []
    here = {"solves": 0, "loop": False}
    consider, take, solve, loop = (Search._consider, Search._take, Search._solve, Search._loop)
    pid = os.getpid()

    def counted_solve(self, *a, **k):
        if os.getpid() == pid and here["loop"]:
            here["solves"] += 1
        return solve(self, *a, **k)

    def in_loop(self, *a, **k):
        here["loop"] = True
        try:
            return loop(self, *a, **k)
        finally:
            here["loop"] = False

    def traced_consider(self, cfg, shares=None):
        step = consider(self, cfg, shares)
        if os.getpid() == pid:
            mode = search_module.SEARCH if not self.refining else \
                search_module.REFINE_MODEL if self.model_splits else search_module.REFINE_SPLITS
            taken.append((cfg.index, mode, shares, step))
        return step

    def traced_take(self, spec, cfg, mode):
        step = take(self, spec, cfg, mode)
        taken.append((cfg.index, mode, None, step))
        here.setdefault("taken_modes", set()).add(mode)
        return step

    monkeypatch.setattr(Search, "_solve", counted_solve)
    monkeypatch.setattr(Search, "_loop", in_loop)
    monkeypatch.setattr(Search, "_consider", traced_consider)
    monkeypatch.setattr(Search, "_take", traced_take)
    try:
        plan = Search(cm, workers=workers).run()
    finally:
        for name, fn in (("_solve", solve), ("_loop", loop), ("_consider", consider), ("_take", take)):
            monkeypatch.setattr(Search, name, fn)
    TAKEN_MODES.clear()
    TAKEN_MODES.update(here.get("taken_modes", set()))
    return plan.to_json(), taken, here["solves"]


@pytest.mark.parametrize("case", ["mixed", "deep"])
def test_workers_take_the_one_process_steps_and_plan(monkeypatch, request, case: str) -> None:
    cm = request.getfixturevalue(case)
    want_plan, want, solved_here = request.getfixturevalue("mixed_one_process") if case == "mixed" else \
        _trace(monkeypatch, cm, 0)
    got_plan, got, parallel_here = _trace(monkeypatch, cm, 2)
    assert len(want) >= 20, "too small a search to say anything"
    assert got == want
    assert got_plan == want_plan
    loop = [x for x in want if x[1] == search_module.SEARCH]
    assert solved_here == len(loop) and parallel_here == 0  # every solve of the loop ran in a worker
    assert TAKEN_MODES == {search_module.SEARCH, search_module.REFINE_SPLITS, search_module.REFINE_MODEL}


def test_wrong_predictions_are_solved_again_with_the_right_cutoff(monkeypatch, mixed, mixed_one_process) -> None:
    """Every configuration sent with no cutoff at all: each result comes back with the wrong one and must be
    solved again, not used."""
    _, want, _ = mixed_one_process
    monkeypatch.setattr(speculative.Speculative, "_predicted",
                        lambda self, cutoff: [(i, b, float("inf")) for i, b in self.ahead])
    _, got, _ = _trace(monkeypatch, mixed, 2)
    assert got == want


def test_a_worker_that_dies_or_raises_hands_its_configurations_back(monkeypatch, mixed, mixed_one_process) -> None:
    want_plan, want, _ = mixed_one_process
    parent = os.getpid()
    ahead = Search._solve_ahead
    calls = {"n": 0}

    def failing(self, index, bound, cutoff):
        if os.getpid() != parent:
            calls["n"] += 1  # (per worker: its own copy)
            if calls["n"] == 3:
                os._exit(1)  # the first worker to reach its third solve dies
            if index % 5 == 0:
                raise RuntimeError("a worker's solve failed")
        return ahead(self, index, bound, cutoff)

    monkeypatch.setattr(Search, "_solve_ahead", failing)
    got_plan, got, _ = _trace(monkeypatch, mixed, 2)
    assert got == want
    assert got_plan == want_plan


def test_a_solve_that_fails_everywhere_raises_as_in_one_process(monkeypatch, mixed) -> None:
    solve = Search._solve
    first = {}

    def broken(self, cfg, shares=None):
        first.setdefault("index", cfg.index)
        if cfg.index == first["index"]:
            raise ValueError("broken solve")
        return solve(self, cfg, shares)

    monkeypatch.setattr(Search, "_solve", broken)
    with pytest.raises(ValueError, match="broken solve"):
        Search(mixed, workers=0).run()
    with pytest.raises(ValueError, match="broken solve"):
        Search(mixed, workers=2).run()


def test_nothing_fits_names_the_same_nearest_miss() -> None:
    cm = _cm("1x2xT4", layers=16, hidden=8192, batch=64)
    with pytest.raises(InfeasibleError) as one:
        Search(cm, workers=0).run()
    with pytest.raises(InfeasibleError) as two:
        Search(cm, workers=2).run()
    assert str(two.value) == str(one.value)


def test_workers_only_where_they_pay_and_are_safe(monkeypatch) -> None:
    many = speculative.PARALLEL_MIN_CONFIGS
    monkeypatch.setattr(speculative.os, "sched_getaffinity", lambda pid: {0, 1})
    assert speculative.workers_for(many, None) == 2
    assert speculative.workers_for(many - 1, None) == 0
    assert speculative.workers_for(3, 2) == 2  # asked for
    assert speculative.workers_for(many, 1) == 0
    monkeypatch.setattr(speculative.os, "sched_getaffinity", lambda pid: {0})
    assert speculative.workers_for(many, None) == 0
    monkeypatch.setattr(speculative.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert speculative.workers_for(many, None) == speculative.MAX_WORKERS
    monkeypatch.setattr(speculative, "_in_process_group", lambda: True)
    assert speculative.workers_for(many, None) == 0


def test_in_a_process_group_the_search_runs_in_one_process() -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert speculative._in_process_group()
        assert speculative.workers_for(10 * speculative.PARALLEL_MIN_CONFIGS, None) == 0
    finally:
        dist.destroy_process_group()
    assert not speculative._in_process_group()


def test_search_module_uses_workers_for_by_default(monkeypatch, mixed) -> None:
    """`Search()` without `workers` asks `workers_for` with its configuration count (the default path `plan`
    takes)."""
    asked = []
    monkeypatch.setattr(search_module, "workers_for", lambda n, requested: asked.append((n, requested)) or 0)
    Search(mixed).run()
    assert asked and asked[0][1] is None and asked[0][0] > 0


def test_solved_ahead_as_the_search_or_each_refinement_pass_solves(deep) -> None:
    """`_solve_ahead` solves a config as the loop or one of `_refine`'s passes does (what a worker runs)."""
    search = Search(deep, workers=0)
    configs = search._configs()
    search._by_index = {c.index: c for c in configs}
    modes = {search_module.SEARCH: (False, False), search_module.REFINE_SPLITS: (True, False),
             search_module.REFINE_MODEL: (True, True)}
    checked = set()
    for cfg in configs:
        if len(checked) >= 2:
            break
        want = {}
        for mode, (refining, model) in modes.items():
            search.best_step, search.refining, search.model_splits = float("inf"), refining, model
            got = search._evaluate(cfg)
            want[mode] = None if got is None else got[0]
        search.refining = search.model_splits = False
        for mode in modes:
            step, plan = search._solve_ahead((cfg.index, mode), cfg.bound, float("inf"))
            assert step == want[mode]
            assert (plan is None) == (step is None)
        assert not search.refining and not search.model_splits
        if len(set(want.values())) > 1:
            checked.add(cfg.index)
    assert checked, "no config whose passes differ: the check cannot tell them apart"


def test_warnings_a_solve_raises_reach_the_caller_as_in_one_process(monkeypatch, mixed) -> None:
    """A solve's warning (the wall-clock guard cutting a CP-SAT solve, say) raised in a worker is raised again when
    the search takes that result: the caller sees the one-process search's warnings."""
    import warnings

    evaluate = Search._evaluate

    def noisy(self, cfg, shares=None):
        if cfg.index % 7 == 0:
            warnings.warn(f"solve of config {cfg.index}", UserWarning, stacklevel=2)
        return evaluate(self, cfg, shares)

    monkeypatch.setattr(Search, "_evaluate", noisy)
    said = {}
    for workers in (0, 2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Search(mixed, workers=workers).run()
        said[workers] = sorted(str(w.message) for w in caught if str(w.message).startswith("solve of config"))
    assert said[0] and said[2] == said[0]
