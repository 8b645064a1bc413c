"""The CP-SAT stage model (solver/split/stage_model.py) against a brute force written here: on chains with tight
device memory, its split's surrogate lies within its proven gap of the minimum over every layer split and
every per-stage option combination whose devices fit, and its stated lower bound holds. The brute force
enumerates splits and options itself, checks memory with the cost model's per-device formulas
(`pricing.rank_peak`, `rank_host`) and evaluates the surrogate from its definition (split.py's docstring),
re-implemented below; on long chains it drops, per stage and range, the options another one beats in every
time (and, interleaved, every memory term), which cannot change the minimum (the surrogate grows with each
time, a device's peak with each memory term)."""

from __future__ import annotations

import itertools
import math

import pytest

from autopar.api import cost_model
from autopar.models import gpt, llama
from autopar.solver.pricing.pricing import CostModel, Option, rank_host, rank_peak
from autopar.solver.search.search import Search, microbatch_count
from autopar.solver.split.split import OFFLOAD_LADDER, Choice, Slot, Split
from autopar.solver.split.stage_model import GAP, POOL, POOL_RTOL, StageModel

from .runtime_cases import captured_case

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


def _options(cm: CostModel, slot: Slot, a: int, e: int, n: int, chunks: int, prune: bool) -> list[tuple]:
    """(option, (fwd, bwd, sync), memory, out bytes) of layers [a, e) on `slot`; with `prune`, those that fit
    the device alone and that no other such option beats in every time (and memory term, chunks > 1)."""
    base = cm.base(a, e, slot.dtype, n, slot.tp_group)
    opts = []
    for off in OFFLOAD_LADDER:
        # ZeRO-2/3 only where the runtime runs them per layer (`Slot.layerwise`)
        for z in range((4 if slot.layerwise else 2) if len(slot.dp_group) > 1 else 1):
            for rc in (False, True) if base.has_blocks else (False,):
                if z == 3 and "params" in off:
                    continue
                opt = Option(z, rc, off)
                tm = cm.stage_times(base, opt, slot.dtype, slot.tp_group, slot.dp_group, layerwise=slot.layerwise,
                                    mixed_tp=slot.mixed_tp)
                mem = cm.stage_memory(base, opt, len(slot.tp_group), len(slot.dp_group), slot.layerwise)
                opts.append((opt, (tm.fwd, tm.bwd, tm.sync), mem, base.out_bytes, tm))
    if not prune:
        return opts

    def vec(o: tuple) -> tuple:
        mem, k = o[2], slot.inflight
        act = (min(k, 1) if mem.offload_act else k) * mem.act
        return o[1] + ((mem.static, act, mem.work, mem.sync, mem.host, k * mem.host_act) if chunks > 1 else ())

    fit = [o for o in opts if rank_peak([o[2]], slot.inflight, slot.microbatches) <= slot.budget
           and rank_host([o[2]], slot.inflight) <= slot.host_budget]
    return [o for o in fit if not any(vec(k) != vec(o) and all(x <= y for x, y in zip(vec(k), vec(o), strict=True))
                                      for k in fit)]


def _brute(cm: CostModel, slots: list[Slot], m: int, n: int, chunks: int, prune: bool = False,
           every: list[float] | None = None) -> tuple[float, list]:
    """The minimum surrogate over every split and option combination that fits, and its argmin (the first such
    combination in listing order); `every` collects the surrogate of each such combination.

    Without `every`, a combination is skipped when some rank's work, m (fwd + bwd) summed over its stages as
    `_surrogate` sums it for the rank's last stage, is at least the best so far: the surrogate adds
    non-negative times to that sum, so it is no smaller, and only a strictly smaller one replaces the best.
    A rank's fit depends on its own stages' options alone, so it is checked once per such tuple."""
    S, p, L = len(slots), len(slots) // chunks, cm.L
    best, arg = math.inf, None
    table: dict[tuple[int, int, int], list[tuple]] = {}
    for cuts in itertools.combinations(range(1, L), S - 1):
        edges = (0, *cuts, L)
        per_stage = []
        for j, slot in enumerate(slots):
            key = (j, edges[j], edges[j + 1])
            if key not in table:
                table[key] = _options(cm, slot, edges[j], edges[j + 1], n, chunks, prune)
            per_stage.append(table[key])
        if not all(per_stage):
            continue
        work = [[m * (o[1][0] + o[1][1]) for o in opts] for opts in per_stage]
        fits: dict[tuple, bool] = {}

        def fit(q: int, ix: tuple[int, ...], per_stage: list = per_stage, fits: dict = fits) -> bool:
            if (q, ix) not in fits:
                mems = [per_stage[j][i][2] for j, i in zip(range(q, S, p), ix, strict=True)]
                fits[(q, ix)] = (rank_peak(mems, slots[q].inflight, slots[q].microbatches) <= slots[q].budget
                                 and rank_host(mems, slots[q].inflight) <= slots[q].host_budget)
            return fits[(q, ix)]

        # the sends depend on the stages' ranges and devices alone (every option of a range has its out bytes)
        sends = [0.0 if j + 1 == S else cm.boundary_send(per_stage[j][0][3], slots[j].tp_group[0],
                                                         slots[j + 1].tp_group[0]) for j in range(S)]
        for ix in itertools.product(*(range(len(opts)) for opts in per_stage)):
            if every is None and any(sum(work[k][ix[k]] for k in range(q, S, p)) >= best for q in range(p)):
                continue
            if not all(fit(q, ix[q::p]) for q in range(p)):
                continue
            combo = [per_stage[j][i] for j, i in enumerate(ix)]
            value = _surrogate([c[1] for c in combo], sends, p, m)
            if every is not None:
                every.append(value)
            if value < best:
                best, arg = value, [(edges[j], edges[j + 1], c) for j, c in enumerate(combo)]
    return best, arg


def _setup(gib: float, schedule: str, chunks: int, ranks: int, layers: int = 4, family=gpt, batch: int = 4):
    mc, graph = captured_case(family, batch=batch, seq=64, vocab=512, hidden=256, layers=layers, heads=4)
    cluster = {"nodes": [{"device": {"name": "small-A100", "based_on": "A100-80GB", "memory_GiB": gib},
                          "devices_per_node": 1, "count": ranks}]}
    cm = cost_model(mc.model, cluster, mc.example_inputs, mc.example_target, mc.loss_fn, captured=graph)
    search = Search(cm)
    cfg = next(c for c in search._configs() if len(c.pipelines) == 1 and c.schedule == schedule
               and c.chunks == chunks and c.b == 2)
    m = microbatch_count(cm.B, cfg.b, ranks, schedule)
    n = -(-cm.B // m)
    slots = search._slots(cfg, cfg.pipelines[0], m)
    return cm, search.splitter, slots, m, n


def _check_split(cm: CostModel, slots: list[Slot], got: Split, m: int, chunks: int) -> None:
    """A real split whose devices fit, its surrogate the one re-implemented here."""
    assert [a for a, _, _ in got.stages] == [0] + [e for _, e, _ in got.stages[:-1]]
    assert got.stages[-1][1] == cm.L
    p, S = len(slots) // chunks, len(slots)
    for q in range(p):
        mems = [c.memory for _, _, c in got.stages[q::p]]
        assert rank_peak(mems, slots[q].inflight, slots[q].microbatches) <= slots[q].budget
        assert rank_host(mems, slots[q].inflight) <= slots[q].host_budget
    sends = [0.0 if j + 1 == S else cm.boundary_send(c.out_bytes, slots[j].tp_group[0], slots[j + 1].tp_group[0])
             for j, (_, _, c) in enumerate(got.stages)]
    times = [(c.times.fwd, c.times.bwd, c.times.sync) for _, _, c in got.stages]
    assert got.surrogate == pytest.approx(_surrogate(times, sends, p, m), rel=1e-12)


def _check_within_gap(got: Split | None, best: float, slots: list[Slot]) -> None:
    """Not below the optimum, within GAP of it, and its stated lower bound below the optimum."""
    tol = len(slots) * 4 * NS_TOL
    assert got is not None and got.gap is not None
    assert got.gap <= GAP + 1e-9
    assert got.surrogate >= best - tol
    assert (1 - got.gap) * got.surrogate <= best + tol
    assert got.surrogate <= best / (1 - GAP) + tol


SMALL = [
    (0.02, "1f1b", 1, 3),  # three stages, each device too small for the plain options of long ranges
    (0.03, "gpipe", 1, 2),
    (0.02, "interleaved_1f1b", 2, 2),  # two chunks per device: their memory is checked together
]


@pytest.mark.parametrize("gib,schedule,chunks,ranks", SMALL)
def test_stage_model_matches_brute_force(gib: float, schedule: str, chunks: int, ranks: int) -> None:
    """At gap 0 the model's optimum is the brute force's; at its default GAP it stays within it."""
    cm, splitter, slots, m, n = _setup(gib, schedule, chunks, ranks)
    best, arg = _brute(cm, slots, m, n, chunks)
    assert arg is not None
    assert any(c[0] != Option() for _, _, c in arg), "memory should force some option in this case"
    incumbent = splitter.greedy(slots, math.inf, m, n, chunks)
    assert incumbent is not None
    exact = StageModel(cm, splitter, slots, m, n, chunks, incumbent, gap=0.0).solve(30.0)
    assert exact is not None
    assert exact.surrogate == pytest.approx(best, abs=len(slots) * 4 * NS_TOL)
    assert exact.gap == pytest.approx(0.0, abs=1e-5)  # the rounding slack: a few ns of milliseconds
    _check_split(cm, slots, exact, m, chunks)
    got = StageModel(cm, splitter, slots, m, n, chunks, incumbent).solve(30.0)
    _check_within_gap(got, best, slots)
    _check_split(cm, slots, got, m, chunks)


@pytest.mark.parametrize("gib,schedule,chunks,ranks", SMALL)
def test_near_optimal_pool_is_distinct_and_within_its_tolerance(gib: float, schedule: str, chunks: int,
                                                                ranks: int) -> None:
    """Besides the optimum, the model hands the simulator up to POOL other splits (stage_model.py
    `_near_optimal`): each fits, differs from the optimum and from the others, and lies within POOL_RTOL of the
    brute force's minimum; it finds as many as the brute force says there are (up to POOL)."""
    cm, splitter, slots, m, n = _setup(gib, schedule, chunks, ranks)
    every: list[float] = []
    # options another beats in every time (and memory term) are not in the model's table: not counted either
    best, _ = _brute(cm, slots, m, n, chunks, prune=True, every=every)
    incumbent = splitter.greedy(slots, math.inf, m, n, chunks)
    assert incumbent is not None
    model = StageModel(cm, splitter, slots, m, n, chunks, incumbent, gap=0.0)
    got = model.solve(30.0)
    assert got is not None and model.status == "optimal"
    tol = len(slots) * 4 * NS_TOL + 2 * (2 * len(slots) + chunks + 2) / 1e9  # plus the model's rounding slack
    # the table holds what could beat the incumbent (its cap): the pool lies under both
    top = min(best * (1 + POOL_RTOL), incumbent.surrogate)
    near = sum(1 for v in every if v <= top - tol) - 1  # the optimum itself not counted
    keys = [tuple((a, e, c.option) for a, e, c in sp.stages) for sp in [got, *model.pool]]
    assert len(set(keys)) == len(keys)
    assert min(POOL, near) <= len(model.pool) <= POOL
    for sp in model.pool:
        _check_split(cm, slots, sp, m, chunks)
        assert best - tol <= sp.surrogate <= best * (1 + POOL_RTOL) + tol


@pytest.mark.parametrize("gib,schedule,chunks,ranks", SMALL)
def test_stage_model_keeps_an_optimal_incumbent(gib: float, schedule: str, chunks: int, ranks: int) -> None:
    """Given the brute force's optimum as its incumbent, the model proves it within GAP and returns it."""
    cm, splitter, slots, m, n = _setup(gib, schedule, chunks, ranks)
    best, arg = _brute(cm, slots, m, n, chunks)
    incumbent = Split([(a, e, Choice(o[0], o[4], o[2], o[3])) for a, e, o in arg], best)
    model = StageModel(cm, splitter, slots, m, n, chunks, incumbent)
    got = model.solve(30.0)
    assert model.status in ("pruned", "infeasible")
    assert got is not None and [(a, e, c.option) for a, e, c in got.stages] == [(a, e, o[0]) for a, e, o in arg]
    _check_within_gap(got, best, slots)


@pytest.mark.parametrize("family,layers,gib,schedule,chunks,ranks", [
    (gpt, 32, 0.05, "1f1b", 1, 3),  # 34 layers: a uniform chain (the compact, count-based form)
    (llama, 32, 0.05, "1f1b", 1, 3),  # 34 layers, not uniform: the interval form
    (gpt, 10, 0.03, "interleaved_1f1b", 2, 2),  # 12 layers, four stages on two devices
])
def test_stage_model_on_long_chains(family, layers: int, gib: float, schedule: str, chunks: int,
                                    ranks: int) -> None:
    cm, splitter, slots, m, n = _setup(gib, schedule, chunks, ranks, layers, family)
    assert cm.L == layers + 2 and cm.uniform == (family is gpt)
    best, arg = _brute(cm, slots, m, n, chunks, prune=True)
    assert arg is not None
    assert any(c[0] != Option() for _, _, c in arg), "memory should force some option in this case"
    incumbent = splitter.greedy(slots, math.inf, m, n, chunks)
    assert incumbent is not None
    got = StageModel(cm, splitter, slots, m, n, chunks, incumbent).solve(30.0)
    _check_within_gap(got, best, slots)
    _check_split(cm, slots, got, m, chunks)


def test_stage_model_is_deterministic() -> None:
    cm, splitter, slots, m, n = _setup(0.02, "interleaved_1f1b", 2, 2)
    incumbent = splitter.greedy(slots, math.inf, m, n, 2)
    runs = [StageModel(cm, splitter, slots, m, n, 2, incumbent).solve(30.0) for _ in range(3)]
    assert all(r is not None for r in runs)
    assert len({tuple((a, e, c.option) for a, e, c in r.stages) for r in runs}) == 1


def test_split_with_the_model_on_a_long_chain() -> None:
    """`Splitter.split(model=True)` runs the model on a 34-layer chain (past the old 32-layer limit): the split it
    returns carries the model's proven gap, and simulates no slower than the split without the model (the
    simulator judges among the candidates)."""
    from autopar.ir.plan import simulated_step_time

    cm, splitter, slots, m, n = _setup(0.08, "1f1b", 1, 3, 32, batch=16)
    share = cm.B
    plain = splitter.split(slots, share, m, "1f1b", 1)
    refined = splitter.split(slots, share, m, "1f1b", 1, model=True)
    assert plain is not None and refined is not None
    assert refined.gap is not None and refined.gap <= GAP + 1e-9
    _check_split(cm, slots, refined, m, 1)

    def step(split: Split) -> float:
        return simulated_step_time("1f1b", 1, share, m, splitter.values(slots, split, 0))

    assert step(refined) <= step(plain) * (1 + 1e-12)
