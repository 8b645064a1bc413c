"""The joint stage model (solver/split/stage_model_shares.py: batch shares, splits and options of several pipeline
classes in one CP-SAT model) against a brute force written here: every batch split of B into the config's
pipelines (each at least one sample), each pipeline at its share running m = ceil(s / min(b, s)) micro-batches
(interleaved: rounded up to a multiple of the ranks), and for each pipeline the least surrogate over every layer
split and option combination that fits (tests/test_stage_model.py's brute force); the step is the slowest
pipeline's, the optimum the least step. Devices are small, so memory decides options and shares."""

from __future__ import annotations

import itertools
import math

import pytest

from autopar.api import cost_model
from autopar.models import gpt
from autopar.solver.search.search import Search
from autopar.solver.split.stage_model import GAP
from autopar.solver.split.stage_model_shares import JointModel, ShareClass
from tests.test_stage_model import NS_TOL, _brute


def _microbatches(share: int, b: int, ranks: int, schedule: str) -> int | None:
    m = -(-share // min(b, share))
    if schedule == "interleaved_1f1b":
        m = -(-m // ranks) * ranks
    return m if m <= share else None


def _setup(schedule: str, chunks: int, b: int, batch: int = 7):
    """Two nodes of two small A100s (two pipelines of two stages) and one of two small V100s (one pipeline)."""
    mc = gpt(batch=batch, seq=64, vocab=512, hidden=256, layers=4, heads=4)
    cluster = {"nodes": [
        {"device": {"name": "small-A", "based_on": "A100-80GB", "memory_GiB": 0.03}, "devices_per_node": 2,
         "count": 2},
        {"device": {"name": "small-V", "based_on": "V100-16GB", "memory_GiB": 0.03}, "devices_per_node": 2,
         "count": 1}]}
    cm = cost_model(mc.model, cluster, mc.example_inputs, mc.example_target, mc.loss_fn)
    search = Search(cm)
    cfg = next(c for c in search._configs() if c.grouping == "by-type" and c.tp == 1 and c.schedule == schedule
               and c.chunks == chunks and c.b == b)
    assert len(cfg.pipelines) == 3
    classes = [ShareClass([0, 1], lambda m: search._slots(cfg, cfg.pipelines[0], m, False)),
               ShareClass([2], lambda m: search._slots(cfg, cfg.pipelines[2], m, False))]
    return cm, search, cfg, classes


def _brute_joint(cm, search: Search, cfg, classes) -> tuple[float, dict]:
    """The least step over every batch split (and the least surrogate of every pipeline at every share)."""
    p = len(cfg.pipelines[0])
    per_share: dict[tuple[int, int], float] = {}

    def pipeline(c: int, share: int) -> float:
        if (c, share) not in per_share:
            m = _microbatches(share, cfg.b, p, cfg.schedule)
            per_share[(c, share)] = math.inf if m is None else \
                _brute(cm, classes[c].slots(m), m, -(-share // m), cfg.chunks, prune=cfg.chunks > 1)[0]
        return per_share[(c, share)]

    best = math.inf
    for cuts in itertools.combinations(range(1, cm.B), 2):
        shares = [cuts[0], cuts[1] - cuts[0], cm.B - cuts[1]]
        best = min(best, max(pipeline(0, shares[0]), pipeline(0, shares[1]), pipeline(1, shares[2])))
    return best, per_share


@pytest.mark.parametrize("schedule,chunks,b", [("1f1b", 1, 2), ("interleaved_1f1b", 2, 2)])
def test_joint_model_matches_brute_force(schedule: str, chunks: int, b: int) -> None:
    cm, search, cfg, classes = _setup(schedule, chunks, b)
    best, per_share = _brute_joint(cm, search, cfg, classes)
    assert best < math.inf
    tol = 4 * len(classes[0].slots(2)) * NS_TOL
    # a poor incumbent (the A100 pipelines the fewest samples they can run), so the model has better shares to find
    least = 1 if chunks == 1 else 2
    for gap in (0.0, GAP):
        model = JointModel(cm, search.splitter, classes, cfg.b, cfg.schedule, cfg.chunks,
                           [least, least, cm.B - 2 * least], gap=gap)
        got = model.solve(30.0)
        assert got is not None and model.U > best * (1 + GAP)
        assert got.status == "optimal" and sum(got.shares) == cm.B and min(got.shares) >= 1
        assert got.shares[0] - got.shares[1] in (0, 1)  # one class: shares differ by one sample at most
        # its value is a real step (no pipeline of the brute force is faster at these shares), within the gap
        at_shares = max(per_share[(0, got.shares[0])], per_share[(0, got.shares[1])], per_share[(1, got.shares[2])])
        assert at_shares <= got.value + tol
        assert got.value >= best - tol
        assert (1 - got.gap) * got.value <= best + tol
        assert got.gap <= gap + 1e-5
        if gap == 0.0:
            assert got.value == pytest.approx(best, abs=tol)


def test_joint_model_keeps_optimal_shares() -> None:
    """Given the optimal shares, the model proves them within GAP and keeps them."""
    cm, search, cfg, classes = _setup("1f1b", 1, 2)
    best, per_share = _brute_joint(cm, search, cfg, classes)
    shares = min(([a, c - a, cm.B - c] for a, c in itertools.combinations(range(1, cm.B), 2)),
                 key=lambda s: max(per_share.get((0, s[0]), math.inf), per_share.get((0, s[1]), math.inf),
                                   per_share.get((1, s[2]), math.inf)))
    shares[:2] = sorted(shares[:2], reverse=True)  # the larger share first, as the model writes them
    model = JointModel(cm, search.splitter, classes, cfg.b, cfg.schedule, cfg.chunks, shares)
    assert model.U <= best / (1 - GAP)  # the best known splits at these shares are within GAP here
    got = model.solve(30.0)
    assert got is not None and got.status in ("pruned", "infeasible") and got.shares == shares
    assert got.gap <= GAP + 1e-9
