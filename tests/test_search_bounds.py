"""The work bound of configs whose pipelines differ in speed (solver/search/bounds.py `ConfigBounds._classes`,
issue 14) and the search's pruning with it: the bound never exceeds a fitting plan's priced step, it is no
more than the exact min-max over every integer batch split (enumerated here), and the search that prunes
with it returns the plan the exhaustive share enumeration of small cases allows."""

from __future__ import annotations

import itertools
import math

from autopar.solver.pricing.pricing import price
from autopar.solver.search.configs import microbatch_count
from autopar.solver.search.search import Search

from .test_planner import cm_for

MIXED = "1x2xA100-80GB+1x2xT4"


def _multi_class(s: Search) -> list:
    out = []
    for cfg in s._configs():
        per = {s.bounds.per_sample(pipe, cfg.b) for pipe in cfg.pipelines}
        if len(per) > 1:
            out.append(cfg)
    return out


def test_class_bound_never_exceeds_a_priced_plan() -> None:
    """Every config whose pipelines differ in speed: the plan its inner solve gives, priced in full by
    `pricing.price`, steps no faster than the config's bound."""
    cm = cm_for(MIXED, layers=4, batch=8)
    s = Search(cm, 600)
    checked = 0
    for cfg in _multi_class(s):
        solved = s._solve(cfg)
        if solved is None:
            continue
        priced = price(cm, solved.build())
        if not priced.fits:
            continue
        assert cfg.bound <= priced.plan.predicted["step_time_s"] * (1 + 1e-9), cfg
        checked += 1
    assert checked >= 10


def test_class_bound_is_at_most_the_min_max_over_every_batch_split() -> None:
    """Against every composition of the batch into the config's pipelines (each share at least 1): the bound is
    no more than min over them of the slowest pipeline's work bound at its share, and no less than the
    throughput bound B / sum_d (p / w_d) it replaces."""
    cm = cm_for(MIXED, layers=4, batch=8)
    s = Search(cm, 600)
    cfgs = _multi_class(s)
    assert cfgs
    for cfg in cfgs:
        D, p = len(cfg.pipelines), len(cfg.pipelines[0])
        per = [s.bounds.per_sample(pipe, cfg.b) for pipe in cfg.pipelines]

        def f(share: int, w: float, cfg=cfg, p=p) -> float:  # noqa: ANN001 (the one-pipeline work bound, written out)
            m = microbatch_count(share, min(cfg.b, share), p, cfg.schedule)
            if m is None:
                return math.inf
            X = share * w
            if cfg.schedule == "interleaved_1f1b":
                return max(X / p, X / m)
            return X / m / (1 - (1 - 1 / m) ** p)

        exact = min((max(f(sh, w) for sh, w in zip(shares, per, strict=True))
                     for cut in itertools.combinations(range(1, cm.B), D - 1)
                     for shares in [[b - a for a, b in zip((0, *cut), (*cut, cm.B), strict=True)]]),
                    default=math.inf)
        assert cfg.bound <= exact * (1 + 1e-12), cfg
        assert cfg.bound >= cm.B / sum(p / w for w in per) * (1 - 1e-12), cfg


def test_pruned_search_matches_the_unpruned_one(monkeypatch) -> None:  # noqa: ANN001
    """The class bound, the mixed-pipeline capacity bound and the share tables' pruning (shares whose work bound
    reaches the incumbent) change no plan: the same step as a search with the throughput bound and every share in
    the tables."""
    cm = cm_for("1x2xA100-80GB+1x2xV100-16GB", layers=8, batch=8, hidden=1024, seq=256)
    pruned = Search(cm, 600).run().predicted["step_time_s"]
    import autopar.solver.search.bounds as bounds

    monkeypatch.setattr(bounds.ConfigBounds, "shares",
                        lambda self, cfg, w, top, capacity=None: [math.inf] + [0.0] * top)  # prunes no share
    monkeypatch.setattr(bounds.ConfigBounds, "capacity", lambda self, pipe, b: math.inf)  # no mixed-pipeline bound
    unpruned = Search(cm, 600).run().predicted["step_time_s"]
    assert pruned == unpruned
