"""The CP-SAT stage model (solver/stage_model.py) against a brute force written here: on small chains with
tight device memory, its optimum equals the minimum of the surrogate step over every layer split and
every per-stage option combination whose devices fit. The brute force enumerates splits and options
itself, checks memory with the cost model's per-device formulas (`pricing.rank_peak`, `rank_host`) and
evaluates the surrogate from its definition (split.py's docstring), re-implemented below."""

from __future__ import annotations

import itertools
import math

import pytest

from autopar.api import cost_model
from autopar.models import gpt
from autopar.solver.pricing import CostModel, Option, rank_host, rank_peak
from autopar.solver.search import Search, microbatch_count
from autopar.solver.split import OFFLOAD_LADDER, Slot
from autopar.solver.stage_model import StageModel

NS_TOL = 1e-9  # seconds: the model's integer nanoseconds round each coefficient by at most 0.5 ns


def _surrogate(times: list[tuple[float, float, float]], sends: list[float], ranks: int, m: int) -> float:
    """max over stages j on rank r of F_r + max(W_rj, v w_j) + max(Q_r + sync_0, send_{j-1} + sync_j),
    w_j = m (fwd_j + bwd_j), W_rj the work of rank r's chunks up to j, F_r / Q_r the forward / backward
    prefix (sends included) of the first-chunk stages before rank r."""
    v = len(times) // ranks
    F = [sum(times[i][0] + sends[i] for i in range(r)) for r in range(ranks)]
    Q = [sum(times[i][1] + sends[i] for i in range(r)) for r in range(ranks)]
    worst = 0.0
    for j, (f, b, s) in enumerate(times):
        r = j % ranks
        w = m * (f + b)
        W = sum(m * (times[k][0] + times[k][1]) for k in range(r, j + 1, ranks))
        tail = max(Q[r] + times[0][2], (sends[j - 1] if j else 0.0) + s)
        worst = max(worst, F[r] + max(W, v * w) + tail)
    return worst


def _brute(cm: CostModel, slots: list[Slot], m: int, n: int, chunks: int) -> tuple[float, list]:
    S, p, L = len(slots), len(slots) // chunks, cm.L
    best, arg = math.inf, None
    for cuts in itertools.combinations(range(1, L), S - 1):
        edges = (0, *cuts, L)
        per_stage = []
        for j, slot in enumerate(slots):
            base = cm.base(edges[j], edges[j + 1], slot.dtype, n, slot.tp_group)
            opts = []
            for off in OFFLOAD_LADDER:
                for z in range(4 if len(slot.dp_group) > 1 else 1):
                    for rc in (False, True) if base.has_blocks else (False,):
                        if z == 3 and "params" in off:
                            continue
                        opt = Option(z, rc, off)
                        tm = cm.stage_times(base, opt, slot.dtype, slot.tp_group, slot.dp_group)
                        mem = cm.stage_memory(base, opt, len(slot.tp_group), len(slot.dp_group))
                        opts.append((opt, (tm.fwd, tm.bwd, tm.sync), mem, base.out_bytes))
            per_stage.append(opts)
        for combo in itertools.product(*per_stage):
            ok = all(rank_peak([c[2] for c in combo[q::p]], slots[q].inflight) <= slots[q].budget
                     and rank_host([c[2] for c in combo[q::p]], slots[q].inflight) <= slots[q].host_budget
                     for q in range(p))
            if not ok:
                continue
            sends = [0.0 if j + 1 == S else
                     cm.boundary_send(combo[j][3], slots[j].tp_group[0], slots[j + 1].tp_group[0])
                     for j in range(S)]
            value = _surrogate([c[1] for c in combo], sends, p, m)
            if value < best:
                best, arg = value, [(edges[j], edges[j + 1], c[0]) for j, c in enumerate(combo)]
    return best, arg


def _setup(gib: float, schedule: str, chunks: int, ranks: int):
    mc = gpt(batch=4, seq=64, vocab=512, hidden=256, layers=4, heads=4)
    cluster = {"nodes": [{"device": {"name": "small-A100", "based_on": "A100-80GB", "memory_GiB": gib},
                          "devices_per_node": 1, "count": ranks}]}
    cm = cost_model(mc.model, cluster, mc.example_inputs, mc.example_target, mc.loss_fn)
    search = Search(cm)
    cfg = next(c for c in search._configs() if len(c.pipelines) == 1 and c.schedule == schedule
               and c.chunks == chunks and c.b == 2)
    m = microbatch_count(cm.B, cfg.b, ranks, schedule)
    n = -(-cm.B // m)
    slots = search._slots(cfg, cfg.pipelines[0], m)
    return cm, search.splitter, slots, m, n


@pytest.mark.parametrize("gib,schedule,chunks,ranks", [
    (0.02, "1f1b", 1, 3),  # three stages, each device too small for the plain options of long ranges
    (0.03, "gpipe", 1, 2),
    (0.02, "interleaved_1f1b", 2, 2),  # two chunks per device: their memory is checked together
])
def test_stage_model_matches_brute_force(gib: float, schedule: str, chunks: int, ranks: int) -> None:
    cm, splitter, slots, m, n = _setup(gib, schedule, chunks, ranks)
    best, arg = _brute(cm, slots, m, n, chunks)
    assert arg is not None
    assert any(opt != Option() for _, _, opt in arg), "memory should force some option in this case"
    incumbent = splitter.greedy(slots, math.inf, m, n, chunks)
    assert incumbent is not None
    got = StageModel(cm, splitter, slots, m, n, chunks, incumbent).solve(30.0)
    assert got is not None
    assert got.surrogate == pytest.approx(best, abs=len(slots) * 4 * NS_TOL)
    # what the model returns is a real split whose devices fit
    assert [a for a, _, _ in got.stages] == [0] + [e for _, e, _ in got.stages[:-1]]
    assert got.stages[-1][1] == cm.L
    p = len(slots) // chunks
    for q in range(p):
        mems = [c.memory for _, _, c in got.stages[q::p]]
        assert rank_peak(mems, slots[q].inflight) <= slots[q].budget


def test_stage_model_is_deterministic() -> None:
    cm, splitter, slots, m, n = _setup(0.02, "interleaved_1f1b", 2, 2)
    incumbent = splitter.greedy(slots, math.inf, m, n, 2)
    runs = [StageModel(cm, splitter, slots, m, n, 2, incumbent).solve(30.0) for _ in range(3)]
    assert all(r is not None for r in runs)
    assert len({tuple((a, e, c.option) for a, e, c in r.stages) for r in runs}) == 1
