"""Plan data: JSON round trip, explain(), timeline(), re-simulation; Strategy -> Plan (estimate)."""

from __future__ import annotations

import functools
import json

import pytest

import autopar
from autopar import Plan, PlanError, Strategy
from autopar.api import cost_model
from autopar.ir.plan import Pipeline, Stage, plan_from_strategy, simulate_stages
from autopar.models import gpt
from autopar.solver.search.search import Search

A100 = "1x2xA100-80GB"


@functools.cache
def _small_gpt(batch: int = 8, layers: int = 4, hidden: int = 64, seq: int = 32):
    return gpt(batch=batch, layers=layers, hidden=hidden, seq=seq, device="meta")


def _plan(cluster: str = A100, **kw) -> Plan:
    c = _small_gpt(**kw)
    return autopar.plan(c.model, cluster, c.example_inputs, c.example_target, c.loss_fn)


def _estimate(strategy: Strategy, cluster: str | dict = "2x4xA100-80GB", **kw) -> autopar.Estimate:
    c = _small_gpt(**kw)
    return autopar.estimate(c.model, cluster, strategy, c.example_inputs, c.example_target, c.loss_fn)


@pytest.fixture(scope="module")
def planned() -> Plan:
    """The fastest plan on every device of a mixed cluster (`autopar.plan` leaves the T4s idle for this small
    GPT, too slow to pay for themselves: tests/test_idle_fallback.py), to check the data of a mixed plan."""
    c = _small_gpt()
    return Search(cost_model(c.model, "1x2xA100-80GB+1x2xT4", c.example_inputs, c.example_target, c.loss_fn)).run()


def test_json_round_trip(planned: Plan) -> None:
    text = planned.to_json()
    back = Plan.from_json(text)
    assert back == planned
    assert back.to_json() == text
    assert all(isinstance(k, int) for k in back.predicted["peak_memory_bytes"])
    est = _estimate(Strategy(dp=2, tp=2, pp=2, microbatch_size=2))
    assert Plan.from_json(est.plan.to_json()) == est.plan


def test_from_json_rejects_garbage() -> None:
    with pytest.raises(PlanError, match="not a valid autopar plan"):
        Plan.from_json(json.dumps({"global_batch": 4}))


def test_plan_structure(planned: Plan) -> None:
    assert sum(p.batch_share for p in planned.pipelines) == planned.global_batch
    devices = sorted(d for p in planned.pipelines for g in p.device_groups() for d in g)
    assert devices == list(range(4))
    for p in planned.pipelines:
        assert p.stages[0].layers[0] == 0 and p.stages[-1].layers[1] == planned.model["num_layers"]
        assert all(a.layers[1] == b.layers[0] for a, b in zip(p.stages, p.stages[1:], strict=False))
        assert sum(p.microbatch_sizes()) == p.batch_share
        assert max(p.microbatch_sizes()) == p.microbatch_size


def test_explain_mentions_every_stage_and_device(planned: Plan) -> None:
    text = planned.explain()
    assert "peak mem / capacity" in text and "micro-batches" in text and "ZeRO" in text
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("pipeline"))
    start, end = header.index("devices"), header.index("type")
    rows = [line for line in lines if line[:1].isdigit()]
    assert len(rows) == sum(len(p.stages) for p in planned.pipelines)
    mentioned = set()
    for row in rows:
        for part in row[start:end].split(","):
            lo, _, hi = part.strip().partition("-")
            mentioned |= set(range(int(lo), int(hi or lo) + 1))
    assert mentioned == set(range(4))
    assert "A100-80GB" in text and "T4" in text


def test_explain_collapses_many_identical_replicas() -> None:
    est = _estimate(Strategy(dp=16, tp=1, pp=1), cluster="2x8xA100-80GB", batch=16)
    text = est.explain()
    rows = [line for line in text.splitlines() if line[:1].isdigit()]
    assert len(rows) == 1 and rows[0].startswith("0-15") and " 0-15 " in rows[0]


def test_simulate_reproduces_prediction(planned: Plan) -> None:
    sims = Plan.from_json(planned.to_json()).simulate()
    assert max(s.step_time for s in sims) == planned.predicted["step_time_s"]


def test_timeline_writes_chrome_trace(planned: Plan, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AUTOPAR_DUMP", str(tmp_path / "dump"))
    trace = planned.timeline(tmp_path / "t.json")
    on_disk = json.loads((tmp_path / "t.json").read_text())
    assert on_disk == trace == json.loads((tmp_path / "dump" / "timeline.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    firsts = {g[0] for p in planned.pipelines for g in p.device_groups()}
    assert {e["pid"] for e in events} == firsts
    names = [e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"]
    assert any("T4" in n for n in names) and any("A100" in n for n in names)
    end = max(e["ts"] + e["dur"] for e in events)
    assert end == pytest.approx(planned.predicted["step_time_s"] * 1e6)


def test_uneven_microbatches_are_simulated_by_size() -> None:
    times = [(2.0, 1.0, 4.0, 2.0, 0.0, 0.0)]  # one stage: full micro-batch 2+4 s, the smaller one 1+2 s
    assert simulate_stages("1f1b", 1, 5, 2, times).step_time == 6.0 + 3.0  # sizes 3 and 2
    assert simulate_stages("1f1b", 1, 6, 2, times).step_time == 12.0  # sizes 3 and 3


def test_gpipe_bubble_closed_form_on_equal_stages() -> None:
    p, m, f, b = 4, 6, 1.0, 2.0
    stages = [Stage([s, s + 1], [s], predicted={"fwd_s": f, "bwd_s": b}) for s in range(p)]
    plan = Plan(m, "bf16", "adamw", "gpipe", 1, {"nodes": []}, {}, [Pipeline(m, 1, m, stages)])
    sim = plan.simulate()[0]
    assert sim.step_time == (m + p - 1) * (f + b)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


# ---- Strategy -> Plan ----------------------------------------------------------------------------------


def test_megatron_rank_mapping_and_uniform_split() -> None:
    est = _estimate(Strategy(dp=2, tp=2, pp=2, microbatch_size=2))
    plan = est.plan
    assert [[s.devices for s in p.stages] for p in plan.pipelines] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    # 4 blocks over 2 stages; the embedding layer before them on the first, the head after them on the last
    assert [s.layers for s in plan.pipelines[0].stages] == [[0, 3], [3, 6]]
    assert [(p.batch_share, p.microbatch_size, p.num_microbatches) for p in plan.pipelines] == [(4, 2, 2)] * 2
    assert est.fits and not est.memory_problems
    keys = {"step_time_s", "samples_per_s", "tflops_per_device", "mfu", "peak_memory_bytes"}
    assert set(est.predicted) >= keys
    assert sorted(est.predicted["peak_memory_bytes"]) == list(range(8))


def test_interleaved_strategy_places_chunks_round_robin() -> None:
    est = _estimate(Strategy(pp=2, tp=4, schedule="interleaved_1f1b", microbatch_size=2))
    stages = est.plan.pipelines[0].stages
    assert est.plan.chunks == 2 and len(stages) == 4
    assert [s.devices for s in stages] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
    assert [s.layers for s in stages] == [[0, 2], [2, 3], [3, 4], [4, 6]]


def test_strategy_layer_and_batch_split() -> None:
    est = _estimate(Strategy(dp=2, pp=2, tp=2, layer_split=[3, 1], batch_split=[5, 3], microbatch_size=1))
    p0, p1 = est.plan.pipelines
    assert [s.layers for s in p0.stages] == [[0, 4], [4, 6]]
    assert (p0.batch_share, p0.num_microbatches, p1.batch_share, p1.num_microbatches) == (5, 5, 3, 3)


def test_estimate_reports_memory_problems() -> None:
    tiny = {"nodes": [{"device": {"name": "tiny", "based_on": "A100-80GB", "memory_GiB": 0.001},
                       "devices_per_node": 2}]}
    est = _estimate(Strategy(dp=2), cluster=tiny)
    assert not est.fits
    assert len(est.memory_problems) == 2
    msg = est.memory_problems[0]
    assert "device 0 (tiny" in msg and "needs" in msg and "optimizer state" in msg
    assert "usable of 1.02MiB (10% reserve)" in msg
    assert "DOES NOT FIT" in est.explain()


@pytest.mark.parametrize("strategy, match", [
    (Strategy(dp=3), r"dp \* tp \* cp \* pp = 3 \* 1 \* 1 \* 1 = 3, but the cluster has 8 devices"),
    (Strategy(dp=4, pp=2, layer_split=[3, 2]), r"layer_split \[3, 2\] must have 2 non-negative block counts"),
    (Strategy(dp=1, pp=8), r"4 repeated blocks do not divide into 8 stages"),
    (Strategy(dp=2, tp=4, microbatch_size=3), r"batch share 4 is not divisible by microbatch_size=3"),
    (Strategy(dp=2, pp=2, tp=2, schedule="interleaved_1f1b", microbatch_size=4), r"multiple of pp=2"),
    (Strategy(dp=4, tp=2, batch_split=[3, 3, 1, 0]), r"positive entries"),
    (Strategy(dp=8, schedule="zigzag"), r"unknown schedule 'zigzag'"),
    (Strategy(dp=8, zero=5), r"zero must be 0-3"),
])
def test_bad_strategies(strategy: Strategy, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        _estimate(strategy)


def test_global_batch_must_divide_without_batch_split() -> None:
    with pytest.raises(PlanError, match=r"global batch \(6\) is not divisible by dp=4; pass batch_split="):
        _estimate(Strategy(dp=4, tp=2), batch=6)


def test_layer_split_must_leave_a_layer_per_stage() -> None:
    kw = dict(world_size=3, global_batch=3, num_layers=5, first_block=1, num_blocks=3, precision="bf16",
              optimizer="adamw", cluster={}, model={})
    with pytest.raises(PlanError, match=r"leaves stage\(s\) \[1\] without layers.*give every middle stage a block"):
        plan_from_strategy(Strategy(pp=3, layer_split=[1, 0, 2]), **kw)
    assert len(plan_from_strategy(Strategy(pp=3, layer_split=[0, 3, 0]), **kw).pipelines[0].stages) == 3
