"""The search's larger space and its bounds (issue 14): selective recompute, a tensor-parallel degree per
device type, and the config lower bounds (solver/search/bounds.py) that branch and bound prunes with.

Expectations come from `price_strategy` over strategies enumerated here (not from the search's own
enumerators) and from the search run with the new dimension switched off. The runtime side of each
dimension has its own gloo tests: tests/test_selective_recompute.py (k of a stage's blocks) and
tests/test_tp_per_class.py (pipelines and stages of different tensor-parallel degrees).
"""

from __future__ import annotations

import itertools
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autopar.ir.plan import Strategy
from autopar.solver.pricing.pricing import price, price_strategy
from autopar.solver.search.search import Search, search
from autopar.solver.split.monotone import largest_true

from .test_planner import _custom, cm_for

CONFIGS = sys.modules["autopar.solver.search.configs"]  # where the search's layouts come from
SELECTIVE = dict(layers=8, batch=16, seq=128, hidden=256)


def _peak(plan) -> float:  # noqa: ANN001
    return max(plan.predicted["peak_memory_bytes"].values())


def test_planner_recomputes_the_fewest_blocks_that_fit() -> None:
    roomy = cm_for({"nodes": [_custom("roomy", "A100-80GB", 80, 1)]}, **SELECTIVE)
    peaks = {k: _peak(price_strategy(roomy, Strategy(recompute=k)).plan) for k in range(1, 8)}
    # a budget between k = 3 and k = 4 blocks recomputed: no recompute does not fit, all eight would
    budget = (peaks[3] + peaks[4]) / 2
    assert peaks[4] < budget < peaks[3]
    tight = cm_for({"nodes": [_custom("tight", "A100-80GB", budget / 0.9 / 2**30, 1)]}, **SELECTIVE)
    fitting = {}
    for k in [*range(0, 8), True]:
        e = price_strategy(tight, Strategy(recompute=k))
        if e.fits:
            fitting[k] = e.plan.predicted["step_time_s"]
    assert 0 not in fitting and 4 in fitting and True in fitting
    plan = search(tight)
    stage = plan.pipelines[0].stages[0]
    assert stage.recompute == 4  # the fewest that fit: each recomputed block costs its forward again
    assert plan.predicted["step_time_s"] <= min(fitting.values()) * (1 + 1e-9)
    assert plan.predicted["step_time_s"] < fitting[True]


def test_planner_gives_device_types_their_own_tensor_parallel_degree(monkeypatch: pytest.MonkeyPatch) -> None:
    cm = cm_for("1x2xA100-80GB+1x2xV100-16GB", layers=8, batch=8, hidden=4096, seq=1024, vocab=8192)
    mixed = search(cm)
    degrees = {len(st.devices) for pipe in mixed.pipelines for st in pipe.stages}
    assert degrees == {1, 2}
    assert price(cm, mixed).fits
    monkeypatch.setattr(CONFIGS, "mixed_tp_layouts", lambda cm: [])
    uniform = search(cm)
    assert len({len(st.devices) for pipe in uniform.pipelines for st in pipe.stages}) == 1
    assert mixed.predicted["step_time_s"] < uniform.predicted["step_time_s"]


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    return [tuple(b - a for a, b in zip((0, *cut), (*cut, total), strict=True))
            for cut in itertools.combinations(range(1, total), parts - 1)]


def test_config_bounds_never_exceed_a_priced_plan() -> None:
    """Every priced, fitting strategy of a memory-pressed 4-device cluster steps no faster than the bound of
    the search config with its layout (the bounds would otherwise prune plans that could win)."""
    layers = 6
    cm = cm_for({"nodes": [_custom("small", "A100-80GB", 0.35, 4)]}, layers=layers, batch=8, hidden=512, seq=256)
    s = Search(cm, 60)
    bounds = {}
    for cfg in s._configs():
        if cfg.grouping == "stage-major" or len(cfg.pipelines) == 1 or len(cfg.pipelines[0]) == 1:
            key = (len(cfg.pipelines), len(cfg.pipelines[0]), cfg.schedule, cfg.chunks, cfg.b, cfg.tp)
            bounds[key] = max(cfg.bound, s._memory_bound(cfg))
    checked = 0
    for dp, pp in ((1, 4), (2, 2), (4, 1)):
        for schedule, mb, zero, rc in itertools.product(("gpipe", "1f1b", "zb_h1"), (1, 2, 4), (0, 1), (False, True)):
            if (8 // dp) % mb:
                continue
            for split in _compositions(layers, pp) if pp > 1 else [None]:
                e = price_strategy(cm, Strategy(dp=dp, pp=pp, schedule=schedule if pp > 1 else "1f1b",
                                                microbatch_size=mb, zero=zero if dp > 1 else 0, recompute=rc,
                                                layer_split=split))
                key = (dp, pp, schedule if pp > 1 else "1f1b", 1, mb, 1)
                if not e.fits or key not in bounds:
                    continue
                assert bounds[key] <= e.plan.predicted["step_time_s"] * (1 + 1e-9), (key, split, zero, rc)
                checked += 1
    assert checked >= 20  # the memory budget leaves many layouts that fit, and many that do not


@given(st.integers(0, 20), st.integers(-1, 25), st.integers(-3, 50), st.integers(-5, 60))
def test_largest_true_finds_the_last_true_of_a_monotone_predicate(lo: int, span: int, last: int, guess: int) -> None:
    hi = lo + span
    asked: list[int] = []

    def ok(e: int) -> bool:
        asked.append(e)
        return e <= last

    expected = max((e for e in range(lo, hi + 1) if e <= last), default=None)  # a linear scan
    assert largest_true(ok, lo, hi, guess) == expected
    assert all(lo <= e <= hi for e in asked)


def test_a_stopped_search_states_how_much_faster_a_plan_could_be() -> None:
    """At the time limit the warning bounds what the unsolved configurations could still win; the complete
    search's optimum respects that bound."""
    cm = cm_for("1x2xA100-80GB+1x2xT4", layers=4, batch=8)
    stopped = Search(cm, 0.0)  # stops after the first configuration that gives a plan
    with pytest.warns(UserWarning, match=r"lower bounds allow one at most [0-9.]+% faster"):
        early = stopped.run()
    full = Search(cm, 600)
    best = full.run()
    assert full.gap == 0.0 and stopped.gap > 0.0
    assert best.predicted["step_time_s"] >= early.predicted["step_time_s"] / (1 + stopped.gap) * (1 - 1e-9)
    assert best.predicted["step_time_s"] <= early.predicted["step_time_s"]
