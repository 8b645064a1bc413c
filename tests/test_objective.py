"""Prices and the cost objective: `price_per_hour` in the cluster file, the predicted cost of a plan,
`objective.score`, and `autopar.plan(objective=..., budget_per_hour=...)`'s checks."""

from __future__ import annotations

import math

import pytest

import autopar
from autopar import models
from autopar.cluster import Cluster
from autopar.errors import ClusterError, InfeasibleError, PlanError
from autopar.ir.plan import Strategy
from autopar.solver.pricing.pricing import price_strategy
from autopar.solver.search.objective import check_objective, score, used_devices

from .test_planner import cm_for

PRICED = {"name": "priced", "nodes": [
    {"device": "A100-80GB", "devices_per_node": 2, "price_per_hour": 4.1},
    {"device": "T4", "devices_per_node": 2, "price_per_hour": 0.53}]}


def test_cluster_file_prices_round_trip() -> None:
    c = Cluster.load(PRICED)
    assert [c.price_per_hour(d) for d in range(4)] == [4.1, 4.1, 0.53, 0.53]
    again = Cluster.load(c.to_dict())
    assert again == c and [again.price_per_hour(d) for d in range(4)] == [4.1, 4.1, 0.53, 0.53]
    assert [c.subset([3, 0]).price_per_hour(d) for d in range(2)] == [0.53, 4.1]
    assert Cluster.load("1x2xA100-80GB").price_per_hour(0) is None
    with pytest.raises(ClusterError, match="price_per_hour"):
        Cluster.load({"nodes": [{"device": "T4", "price_per_hour": -1}]})
    with pytest.raises(ClusterError, match="did you mean 'price_per_hour'"):
        Cluster.load({"nodes": [{"device": "T4", "price_per_hours": 1}]})


def test_priced_plan_predicts_its_cost() -> None:
    cm = cm_for(PRICED, layers=4, batch=8)
    est = price_strategy(cm, Strategy(dp=2, tp=2))
    pr = est.predicted
    assert used_devices(est.plan) == [0, 1, 2, 3]
    per_hour = 2 * 4.1 + 2 * 0.53
    assert pr["cost_per_hour"] == pytest.approx(per_hour, rel=1e-12)
    # per sample: what the devices cost during one step, over the samples of the step
    assert pr["cost_per_sample"] == pytest.approx(per_hour / 3600 * pr["step_time_s"] / 8, rel=1e-9)
    assert "cost (predicted): 9.26 per hour" in est.explain()
    assert score(pr, cm.cluster, "time") == pr["step_time_s"]
    assert score(pr, cm.cluster, "cost") == pr["cost_per_sample"]
    assert score(pr, cm.cluster, "time", budget=per_hour) == pr["step_time_s"]
    assert score(pr, cm.cluster, "cost", budget=per_hour - 0.01) == math.inf
    assert score({**pr, "fits": False}, cm.cluster, "time") == math.inf
    # figures missing from the predictions are computed from the used devices (peak_memory_bytes' keys)
    bare = {k: v for k, v in pr.items() if k not in ("cost_per_hour", "cost_per_sample")}
    assert score(bare, cm.cluster, "cost") == pytest.approx(pr["cost_per_sample"], rel=1e-12)


def test_unpriced_cluster_has_no_cost_and_refuses_the_cost_objective() -> None:
    cm = cm_for("1x2xA100-80GB", layers=4, batch=8)
    pr = price_strategy(cm, Strategy(dp=2)).predicted
    assert "cost_per_hour" not in pr and "cost" not in price_strategy(cm, Strategy(dp=2)).explain()
    assert score(pr, cm.cluster, "time") == pr["step_time_s"]
    with pytest.raises(PlanError, match="price_per_hour"):
        check_objective("cost", None, cm.cluster)
    with pytest.raises(PlanError, match="price_per_hour"):
        check_objective("time", 10.0, cm.cluster)
    with pytest.raises(PlanError, match="objective='fast'"):
        check_objective("fast", None, cm.cluster)
    with pytest.raises(PlanError, match="budget_per_hour"):
        check_objective("time", -1.0, Cluster.load(PRICED))
    check_objective("cost", 3.0, Cluster.load(PRICED))


def test_plan_checks_the_objective_and_the_budget() -> None:
    case = models.gpt(layers=2, batch=4)
    args = (case.model, "1x2xA100-80GB", case.example_inputs, case.example_target, case.loss_fn)
    with pytest.raises(PlanError, match="price_per_hour"):
        autopar.plan(*args, objective="cost")
    with pytest.raises(PlanError, match="objective="):
        autopar.plan(*args, objective="speed")
    cheap = {"nodes": [{"device": "A100-80GB", "devices_per_node": 2, "price_per_hour": 1.0}]}
    with pytest.raises(InfeasibleError):  # every plan uses a device, and one costs more than the budget
        autopar.plan(case.model, cheap, case.example_inputs, case.example_target, case.loss_fn,
                     time_limit_s=30, budget_per_hour=0.5)


def test_a_search_that_stops_without_a_fitting_plan_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the search's best when it stopped does not fit (Sailor's 48 GPUs at 120 s, bench/peers.py), the
    error names the time limit, not a budget nobody set."""
    import autopar.api as api

    case = models.gpt(layers=2, batch=4)
    real = api.search

    def stopped(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        plan = real(*a, **kw)
        plan.predicted["fits"] = False
        return plan

    monkeypatch.setattr(api, "search", stopped)
    with pytest.raises(InfeasibleError, match=r"planning stopped \(time_limit_s=30\) with no plan that fits") as e:
        autopar.plan(case.model, "1x2xA100-80GB", case.example_inputs, case.example_target, case.loss_fn,
                     time_limit_s=30)
    assert "budget" not in str(e.value)


def test_cost_objective_searches_device_subsets_and_may_leave_a_type_out() -> None:
    """objective="cost" returns the plan of lowest cost per sample over every union of device types, written
    on the whole cluster with the unused devices idle; checked against planning each sub-cluster on its own
    and costing it from the file's prices by hand."""
    case = models.gpt(layers=4, batch=8, seq=32, hidden=64, heads=4, vocab=128)
    args = (case.example_inputs, case.example_target, case.loss_fn)
    got = autopar.plan(case.model, PRICED, *args, objective="cost", time_limit_s=30)
    by_hand = {}
    for name, devices, price_each in (("all", 4, None), ("A100", 2, 4.1), ("T4", 2, 0.53)):
        nodes = PRICED["nodes"] if name == "all" else [g for g in PRICED["nodes"] if g["device"].startswith(name)]
        alone = autopar.plan(case.model, {"nodes": nodes}, *args, time_limit_s=30)
        per_hour = 2 * 4.1 + 2 * 0.53 if name == "all" else devices * price_each
        by_hand[name] = per_hour / 3600 / alone.predicted["samples_per_s"]
    assert got.predicted["cost_per_sample"] == pytest.approx(min(by_hand.values()), rel=1e-6)
    used = set(used_devices(got))
    idle = {int(d) for d in got.predicted.get("idle_devices", {})}
    assert used | idle == {0, 1, 2, 3} and not used & idle
    if min(by_hand, key=by_hand.get) != "all":
        assert idle and "leaves the" in got.explain()
    # a budget below the whole cluster's price: the fastest plan within it uses fewer devices
    cheap = autopar.plan(case.model, PRICED, *args, budget_per_hour=5.0, time_limit_s=30)
    assert cheap.predicted["cost_per_hour"] <= 5.0 and len(used_devices(cheap)) < 4
