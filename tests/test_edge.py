"""Edge clusters (issue 6, planner side): Jetson boards on slow links, compressed stage sends."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import autopar
from autopar import models
from autopar.api import cost_model
from autopar.errors import PlanError
from autopar.ir.plan import Strategy
from autopar.solver.pricing.pricing import ACT_BYTES, SLOW_LINK_BYTES_PER_S, WIRE_BYTES, price
from autopar.solver.search.search import search

from .runtime_cases import captured_case

CLUSTERS = Path(__file__).resolve().parent.parent / "examples" / "clusters"
WIFI = str(CLUSTERS / "edge_orin_wifi.yaml")
ETHERNET = str(CLUSTERS / "edge_orin_ethernet.yaml")
FAST = {"name": "orin-fast", "nodes": [{"device": "Jetson-AGX-Orin", "devices_per_node": 1, "count": 4}],
        "network": {"bandwidth_GBps": 25.0, "latency_us": 5.0}}
BERT_BASE = dict(layers=12, hidden=768, heads=12, seq=128, vocab=30522)


@pytest.fixture(scope="module")
def bert_base():
    """The model and its capture (each cost model annotates its own copy of it)."""
    return captured_case(models.hf_bert, **BERT_BASE, batch=32, device="meta")


def _cm(bert, cluster, precision="fp32", compress="bf16"):
    mc, graph = bert
    return cost_model(mc.model, cluster, mc.example_inputs, mc.example_target, mc.loss_fn, precision=precision,
                      compress=compress, captured=graph)


def _without_compression(plan):
    return dataclasses.replace(plan, pipelines=[
        dataclasses.replace(p, stages=[dataclasses.replace(s, compress=None) for s in p.stages])
        for p in plan.pipelines])


def test_example_edge_clusters_load():
    for path, gbps in ((ETHERNET, 1.0), (WIFI, 0.1)):
        c = autopar.Cluster.load(path)
        assert c.world_size == 4 and all(d.spec.kind == "edge" for d in c.devices)
        assert c.link(0, 1).bandwidth == pytest.approx(gbps * 1e9 / 8)
    for name in ("Jetson-Orin-NX-16GB", "Jetson-Xavier-NX-8GB"):
        spec = autopar.Cluster.load(f"2x1x{name}").devices[0].spec
        assert spec.kind == "edge" and spec.memory <= 16 * 2**30


@pytest.mark.parametrize("cluster", [WIFI, ETHERNET])
def test_slow_link_plan_fits_and_compresses(bert_base, cluster):
    cm = _cm(bert_base, cluster)
    plan = search(cm, time_limit_s=60)
    priced = price(cm, plan)
    assert priced.fits, priced.problems
    for d, peak in plan.predicted["peak_memory_bytes"].items():
        assert peak <= cm.usable(d)
    pipes = [p for p in plan.pipelines if len(p.stages) > 1]
    assert pipes, "on a slow network the planner should pipeline rather than all-reduce every gradient"
    compressed = [(p, j) for p in pipes for j, s in enumerate(p.stages) if s.compress]
    assert compressed
    for p, j in compressed:  # only where the rule allows: a slow link between two different boards
        src, dst = p.stages[j].devices[0], p.stages[j + 1].devices[0]
        assert src != dst and cm.cluster.link(src, dst).bandwidth <= SLOW_LINK_BYTES_PER_S
        assert p.stages[j].compress in WIRE_BYTES
    # taken only because it shortens the predicted step
    plain = price(cm, _without_compression(plan)).plan
    assert plan.predicted["step_time_s"] < plain.predicted["step_time_s"]
    assert "send as" in plan.explain() and "bf16" in plan.explain()


def test_fast_link_and_mixed_precision_do_not_compress(bert_base):
    for cluster, precision in ((FAST, "fp32"), (WIFI, "bf16")):
        plan = search(_cm(bert_base, cluster, precision), time_limit_s=60)
        assert not any(s.compress for p in plan.pipelines for s in p.stages), (cluster, precision)


def test_slow_links_stay_uncompressed_unless_the_user_allows_it(bert_base):
    """Compression rounds what the stages exchange: the default plan never chooses it, however slow the link."""
    plan = search(_cm(bert_base, WIFI, compress=None), time_limit_s=60)
    assert any(len(p.stages) > 1 for p in plan.pipelines)  # pipelined over the slow links, as with compression
    assert not any(s.compress for p in plan.pipelines for s in p.stages)


def test_plan_and_compile_take_compress_and_refuse_a_bad_dtype():
    import inspect

    for entry in (autopar.plan, autopar.compile):
        assert inspect.signature(entry).parameters["compress"].default is None
    mc = models.hf_bert(batch=8, seq=64, hidden=64, layers=4, device="meta")
    with pytest.raises(PlanError, match="compress='int8'"):
        autopar.plan(mc.model, WIFI, mc.example_inputs, mc.example_target, mc.loss_fn, compress="int8")
    with pytest.raises(PlanError, match="compress='int8'"):
        autopar.compile(mc.model, "1xcpu", mc.example_inputs, mc.example_target, mc.loss_fn, compress="int8")


def test_estimate_compressed_sends_shrink_by_the_byte_ratio():
    mc = models.hf_bert(batch=8, seq=64, hidden=64, layers=4, device="meta")
    args = (mc.example_inputs, mc.example_target, mc.loss_fn)
    plain = autopar.estimate(mc.model, WIFI, Strategy(pp=4, microbatch_size=2), *args, precision="fp32")
    comp = autopar.estimate(mc.model, WIFI, Strategy(pp=4, microbatch_size=2, compress="bf16"), *args,
                            precision="fp32")
    cluster = autopar.Cluster.load(WIFI)
    link, bw = cluster.link(0, 1), cluster.devices[0].spec.memory_bandwidth
    ratio = WIRE_BYTES["bf16"] / ACT_BYTES["fp32"]
    stages_p, stages_c = plain.plan.pipelines[0].stages, comp.plan.pipelines[0].stages
    assert [s.compress for s in stages_c] == ["bf16"] * 3 + [None]
    for sp, sc in zip(stages_p[:-1], stages_c[:-1], strict=True):
        wire_p = sp.predicted["send_s"] - link.latency
        nbytes = wire_p * link.bandwidth
        cast = 2 * (nbytes / ACT_BYTES["fp32"]) * (ACT_BYTES["fp32"] + WIRE_BYTES["bf16"]) / bw
        assert sc.predicted["send_s"] - link.latency - cast == pytest.approx(ratio * wire_p, rel=1e-9)
    assert comp.predicted["step_time_s"] < plain.predicted["step_time_s"]
    assert "send as" in comp.explain()
    assert autopar.Plan.from_json(comp.plan.to_json()) == comp.plan  # plain data: the choice round-trips


def test_bad_compress_dtype_is_a_clear_error():
    mc = models.hf_bert(batch=4, seq=16, hidden=32, layers=4, device="meta")
    with pytest.raises(PlanError, match="compress='int8'"):
        autopar.estimate(mc.model, WIFI, Strategy(pp=4, microbatch_size=1, compress="int8"), mc.example_inputs,
                         mc.example_target, mc.loss_fn, precision="fp32")
