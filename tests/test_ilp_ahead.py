"""The configurations' work bounds with their intra-op ILPs shared with a forked helper (solver/search/ilp_ahead.py)
equal the one-process bounds, and the helper's CP-SAT solves leave the search's process (counted by process id at
CP-SAT's own entry point, in a file every process appends to). A helper that dies or warns hands back nothing:
the bounds are the same and every ILP is solved in the search's process.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
from ortools.sat.python import cp_model

from autopar.api import cost_model
from autopar.models import gpt
from autopar.solver.intra_op import ilp
from autopar.solver.search import ilp_ahead
from autopar.solver.search.search import Search

pytestmark = pytest.mark.timeout(300)


def _cm():
    # wide enough that tensor parallelism pays on some blocks: their ILP answers are not all "replicate"
    mc = gpt(batch=16, seq=128, vocab=256, hidden=512, layers=8, heads=8, device="meta")
    return cost_model(mc.model, "1x4xA100-80GB+1x4xV100-16GB", mc.example_inputs, mc.example_target, mc.loss_fn)


def _configs(monkeypatch, tmp_path: Path, workers: int) -> tuple[list, int, int]:
    """The search's configurations (with their bounds) on a new cost model from a cold ILP cache, and the CP-SAT
    solves run in this process and in others meanwhile."""
    cm = _cm()
    log = tmp_path / f"solves-{workers}.txt"
    log.write_text("")
    solve = cp_model.CpSolver.solve

    def counted(self, *a, **k):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return solve(self, *a, **k)

    ilp.clear_cache()
    with monkeypatch.context() as mp:
        mp.setattr(cp_model.CpSolver, "solve", counted)
        configs = Search(cm, 600, workers=workers)._configs()
    pids = log.read_text().split()
    here = sum(p == str(os.getpid()) for p in pids)
    return configs, here, len(pids) - here


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        return _configs(mp, tmp_path_factory.mktemp("one"), 0)


def test_bounds_equal_the_one_process_bounds_and_the_helper_solves_some_ilps(monkeypatch, tmp_path, one_process):
    configs, here, elsewhere = _configs(monkeypatch, tmp_path, 2)
    alone, alone_here, alone_elsewhere = one_process
    assert alone_here > 4 and alone_elsewhere == 0
    assert configs == alone  # every configuration, in the same order, with the same bound
    assert elsewhere > 0, "the helper solved no ILP"
    assert here < alone_here, "the search's process solved every ILP itself"


@pytest.mark.parametrize("fault", ["dies", "warns"])
def test_a_helper_that_dies_or_warns_hands_back_nothing(monkeypatch, tmp_path, one_process, fault):
    solve = ilp_ahead._solve

    def faulty(conn, price, items, keys):
        if fault == "dies":
            os._exit(1)

        def warned(u, b):
            warnings.warn("the wall-clock guard cut a solve", stacklevel=1)
            return price(u, b)

        return solve(conn, warned, items, keys)

    monkeypatch.setattr(ilp_ahead, "_solve", faulty)
    configs, here, elsewhere = _configs(monkeypatch, tmp_path, 2)
    alone, alone_here, _ = one_process
    assert configs == alone
    assert here == alone_here  # nothing was taken from the helper: every ILP solved here
    if fault == "dies":
        assert elsewhere == 0
