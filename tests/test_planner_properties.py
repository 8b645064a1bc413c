"""Property-based planner tests: random small models on random (heterogeneous, small-memory) clusters
always give a valid plan or a clear InfeasibleError; the search's bounds and closed forms hold."""

from __future__ import annotations

import functools
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar import InfeasibleError
from autopar.api import cost_model
from autopar.ir.plan import simulate_stages
from autopar.ir.schedule import SPLIT_SCHEDULES, make_schedule, peak_inflight
from autopar.models import gpt, mlp
from autopar.solver.pricing.pricing import CostModel, inflight_closed_form, lower_bound
from autopar.solver.search.search import Search
from autopar.solver.split.split import surrogate

from .test_planner import check_plan  # the shared plan checker

TYPES = ["A100-80GB", "A100-40GB", "V100-16GB", "T4", "H100", "L4", "RTX-3090"]
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def models(draw) -> tuple:
    batch = draw(st.integers(1, 6))
    layers = draw(st.integers(1, 3))
    if draw(st.booleans()):
        hidden, seq = draw(st.sampled_from([32, 64, 128])), draw(st.sampled_from([8, 16, 32]))
        return ("gpt", batch, layers, hidden, seq)
    return ("mlp", batch, layers, draw(st.sampled_from([16, 64, 256, 1024])), 0)


@st.composite
def clusters(draw) -> str:
    groups = []
    for _ in range(draw(st.integers(1, 2))):
        name = draw(st.sampled_from(TYPES))
        if draw(st.booleans()):  # a custom device with little memory
            gib = draw(st.sampled_from([0.0005, 0.002, 0.01, 0.05]))
            device: str | dict = {"name": f"small-{name}", "based_on": name, "memory_GiB": gib}
        else:
            device = name
        groups.append({"device": device, "devices_per_node": draw(st.sampled_from([1, 2, 4])),
                       "count": draw(st.integers(1, 2))})
    return json.dumps({"nodes": groups}, sort_keys=True)


@functools.cache
def _cm(model: tuple, cluster: str) -> CostModel:
    kind, batch, layers, hidden, seq = model
    case = (gpt(device="meta", batch=batch, layers=layers, hidden=hidden, seq=seq) if kind == "gpt"
            else mlp(device="meta", batch=batch, layers=layers, hidden=hidden))
    return cost_model(case.model, json.loads(cluster), case.example_inputs, case.example_target, case.loss_fn)


@SETTINGS
@given(models(), clusters())
def test_planner_gives_a_valid_plan_or_a_clear_error(model: tuple, cluster: str) -> None:
    cm = _cm(model, cluster)
    try:
        plan = Search(cm).run()
    except InfeasibleError as e:
        msg = str(e)
        assert "no plan fits in memory" in msg and "To fit" in msg and "usable" in msg
        return
    check_plan(plan, cm)
    assert plan.predicted["step_time_s"] == max(s.step_time for s in plan.simulate())


@SETTINGS
@given(models(), clusters())
def test_bounds_never_exceed_the_simulated_step(model: tuple, cluster: str) -> None:
    cm = _cm(model, cluster)
    search = Search(cm)
    for cfg in search._configs()[:40]:
        solved = search._solve(cfg)
        if solved is None:
            continue
        step = max(simulate_stages(cfg.schedule, cfg.chunks, share, m, vals).step_time
                   for share, m, vals in solved.pipelines)
        assert cfg.bound <= solved.bound * (1 + 1e-9) and solved.bound <= step * (1 + 1e-9)
        for share, m, vals in solved.pipelines:
            q, r = divmod(share, m)
            sizes = [q + 1] * r + [q] * (m - r)
            split = cfg.schedule in SPLIT_SCHEDULES  # zero-bubble: a W may end a device's compute
            assert lower_bound(vals, sizes, len(vals) // cfg.chunks, split) <= simulate_stages(
                cfg.schedule, cfg.chunks, share, m, vals).step_time * (1 + 1e-9)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b"]), st.integers(1, 6), st.integers(1, 12),
       st.integers(1, 3))
def test_inflight_closed_form_matches_the_schedule(schedule: str, ranks: int, m: int, chunks: int) -> None:
    if schedule != "interleaved_1f1b":
        chunks = 1
    elif m % ranks:
        m = ranks * math.ceil(m / ranks)
    expected = peak_inflight(make_schedule(schedule, ranks, m, chunks))
    assert inflight_closed_form(schedule, ranks, m, chunks) == [expected[r] for r in range(ranks)]


@pytest.mark.parametrize("chunks", [1, 2])
def test_greedy_split_reports_its_surrogate(chunks: int) -> None:
    cm = _cm(("gpt", 8, 6, 64, 16), json.dumps({"nodes": [{"device": "A100-80GB", "devices_per_node": 2},
                                                          {"device": "T4", "devices_per_node": 2}]}))
    search = Search(cm)
    cfg = next(c for c in search._configs() if c.grouping == "mixed" and c.chunks == chunks and c.tp == 1
               and len(c.pipelines) == 1)
    pipe, m = cfg.pipelines[0], 4
    slots = search._slots(cfg, pipe, m)
    split = search.splitter.greedy(slots, math.inf, m, 2, chunks)
    assert split is not None
    sends = [cm.send_time(c.out_bytes, slots[j].tp_group[0], slots[(j + 1) % len(slots)].tp_group[0])
             if j + 1 < len(slots) else 0.0 for j, (_, _, c) in enumerate(split.stages)]
    assert split.surrogate == pytest.approx(
        surrogate([c.times for _, _, c in split.stages], sends, len(pipe), m), rel=1e-12)
