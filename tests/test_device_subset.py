"""Device subsets: a plan may leave devices of its cluster out; their ranks idle and hold nothing.

On 3 gloo ranks, plans that use ranks 0 and 1 only (two data-parallel replicas with uneven shares, and a
2-stage pipeline) train exactly like one process, and rank 2 gets no batch, no layer, no parameter. On
the pricing side such a plan is priced as the same plan on the cluster of just those devices, and
`predicted["idle_devices"]` / `explain()` name the devices left out and why.
"""

from __future__ import annotations

import pytest

from autopar.cluster import Cluster
from autopar.ir.plan import Pipeline, Plan, Stage
from autopar.runtime.launch import spawn_local
from autopar.solver.pricing.pricing import CostModel, model_summary, price

from .runtime_cases import assert_ranks_match_reference, run_cases
from .test_planner import cm_for

GPT = ("gpt", {"layers": 4, "batch": 8})
CASES = [
    (*GPT, {"pipelines": [{"batch": 5, "m": 1, "stages": [(4, (0,))]}, {"batch": 3, "m": 1, "stages": [(4, (1,))]}]}),
    (*GPT, {"pipelines": [{"batch": 8, "m": 2, "stages": [(2, (0,)), (2, (1,))]}]}),
]

BATCHES = [[(0, 5), (5, 3)], [(0, 8), (0, 8)]]  # (offset, size) of ranks 0 and 1


@pytest.fixture(scope="module")
def results() -> list:
    return spawn_local(run_cases, 3, CASES, timeout_s=300)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_two_of_three_ranks_train_like_one_process(results: list, index: int) -> None:
    name, kwargs, _ = CASES[index]
    # all three ranks, the idle one too: its state_dict is the full trained model
    assert_ranks_match_reference(results, index, name, kwargs, f"case {index} ")
    assert results[2][index][2] == {"batch": (0, 0), "layers": [], "params": {}}
    used = [results[r][index][2] for r in (0, 1)]
    assert [w["batch"] for w in used] == BATCHES[index]
    assert all(w["params"] for w in used)


def _plan(cm: CostModel, devices: tuple[int, int]) -> Plan:
    L = cm.L
    pipes = [Pipeline(6, 3, 2, [Stage([0, L], [devices[0]])]), Pipeline(2, 1, 2, [Stage([0, L], [devices[1]])])]
    return Plan(cm.B, cm.precision, cm.optimizer, "1f1b", 1, cm.cluster.to_dict(), model_summary(cm.graph), pipes,
                {}, cm.reserve)


def test_a_plan_leaving_devices_out_is_priced_as_on_the_subset() -> None:
    whole = cm_for("1x2xA100-80GB+1x2xT4", layers=4, batch=8)
    sub = cm_for(Cluster.load("1x2xA100-80GB+1x2xT4").subset([0, 2]).to_dict(), layers=4, batch=8)
    a = price(whole, _plan(whole, (0, 2)))
    b = price(sub, _plan(sub, (0, 1)))
    assert a.fits and b.fits
    pa, pb = a.plan.predicted, b.plan.predicted
    assert pa["step_time_s"] == pytest.approx(pb["step_time_s"], rel=1e-12)
    assert list(pa["peak_memory_bytes"].values()) == list(pb["peak_memory_bytes"].values())
    assert sorted(pa["peak_memory_bytes"]) == [0, 2]
    assert sorted(pa["idle_devices"]) == [1, 3] and pb["idle_devices"] == {}
    text = a.plan.explain()
    assert "2 devices of its 4 used" in text
    assert "device 1 (A100-80GB) left out: the plan gives it no stage" in text
    assert "device 3 (T4) left out" in text
    # a reason the caller (the search) gives is kept, also through JSON and a second pricing
    why = {1: "a third replica would wait for the T4s: predicted 0.9x samples/s"}
    c = price(whole, _plan(whole, (0, 2)), idle_reasons=why)
    again = price(whole, Plan.from_json(c.plan.to_json()))
    assert again.plan.predicted["idle_devices"][1] == why[1]
    assert why[1] in again.plan.explain()
