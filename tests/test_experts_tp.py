"""Expert parallelism combined with tensor parallelism: EP x TP programs on 4 gloo processes train
exactly like one process, and the planner prices and searches ep x tp configurations."""

from __future__ import annotations

from dataclasses import replace

import pytest

import autopar
from autopar import models
from autopar.plan import Strategy
from autopar.runtime.launch import spawn_local
from autopar.solver import experts
from autopar.solver.pricing import price_strategy
from autopar.solver.search import Search

from .test_experts import _check, estimated_plan, run_ep_cases

# dp=2 replicas of tp=2 groups; the replicas share experts (ep=2): ranks at the same tp index exchange tokens
CASES_TP = [
    ("moe_gpt", {"layers": 2, "batch": 4}, {"dp": 2, "tp": 2, "ep": 2}),
    ("hf_mixtral", {"layers": 2, "batch": 4}, {"dp": 2, "tp": 2, "ep": 2}),
    # a stage sharding (as the intra-op ILP records) that shards experts: they stay whole under ep all the same
    ("moe_gpt", {"layers": 2, "batch": 4},
     {"dp": 2, "tp": 2, "ep": 2,
      "sharding": {"blocks.0.attn.proj.weight": "shard(1)", "blocks.0.mlp.router.weight": "shard(0)",
                   **{f"blocks.0.mlp.experts.{e}.fc.weight": "shard(0)" for e in range(4)}}}),
    # ZeRO and offload with ep: experts partitioned among the replicas holding them (dp / ep of them)
    ("moe_gpt", {"layers": 2, "batch": 8}, {"dp": 4, "ep": 2, "zero": 1}),
    ("moe_gpt", {"layers": 2, "batch": 8}, {"dp": 4, "ep": 2, "zero": 3, "m": 2}),
    ("moe_gpt", {"layers": 2, "batch": 4}, {"dp": 2, "tp": 2, "ep": 2, "zero": 2}),
    ("hf_mixtral", {"layers": 2, "batch": 4}, {"dp": 4, "ep": 2, "zero": 2}),
    ("moe_gpt", {"layers": 2, "batch": 4}, {"dp": 4, "ep": 2, "offload": ("optimizer", "params")}),
]


PLAN_CASE = ("moe_gpt", {"layers": 2, "batch": 4}, {"dp": 2, "tp": 2, "ep": 2})
PLAN_CLUSTER = "1x4xA100-80GB"


@pytest.fixture(scope="module")
def results_tp() -> list:
    name, kwargs, _ = PLAN_CASE
    plan = estimated_plan(name, kwargs, PLAN_CLUSTER, Strategy(dp=2, tp=2, ep=2))
    cases = CASES_TP + [(name, kwargs, {"ep": 2, "plan": plan, "cluster": PLAN_CLUSTER})]
    return spawn_local(run_ep_cases, 4, cases, timeout_s=400)


@pytest.mark.parametrize("index", range(len(CASES_TP)), ids=[f"{c[0]}-{c[2]}" for c in CASES_TP])
def test_expert_and_tensor_parallel_match_single_process(results_tp: list, index: int) -> None:
    _check(results_tp, CASES_TP, index)


def test_compiled_expert_and_tensor_parallel_plan_matches_single_process(results_tp: list) -> None:
    """autopar.estimate(dp=2, tp=2, ep=2) -> Plan (JSON) -> autopar.compile trains exactly."""
    _check(results_tp, CASES_TP + [PLAN_CASE], len(CASES_TP))


def test_tensor_parallel_groups_must_order_their_ranks_alike() -> None:
    from autopar.errors import PlanError
    from autopar.runtime.expert_parallel import expert_groups

    from .runtime_cases import custom_layout

    # replica 0 is (0, 3), replica 1 (1, 2): tp index 0 puts replica 0 first, tp index 1 replica 1 first
    lay = replace(custom_layout([{"batch": 2, "stages": [(2, [0, 3])]}, {"batch": 2, "stages": [(2, [1, 2])]}],
                                4, 4, 4), ep=2)
    with pytest.raises(PlanError, match="do not order their ranks alike"):
        expert_groups(lay)


# ---- pricing (single process) -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cm_2x2() -> object:
    c = models.moe_gpt(layers=2, batch=8)
    return autopar.api.cost_model(c.model, "2x2xA100-80GB", c.example_inputs, c.example_target, c.loss_fn)


def test_expert_and_tensor_parallel_plan_is_priced(cm_2x2: object) -> None:
    """dp=2 x tp=2 x ep=2 on 2 nodes of 2: tp groups inside a node, the all-to-all among the ranks at one tp
    index of the two replicas (across the nodes), experts held whole (E / ep per rank, not divided by tp)."""
    cm = cm_2x2
    est = price_strategy(cm, Strategy(dp=2, tp=2, ep=2))
    pipes = est.plan.pipelines
    assert est.fits and all(len(st.devices) == 2 for p in pipes for st in p.stages)
    assert est.plan.experts["groups"] == [[p.stages[0].devices[t] for p in pipes] for t in range(2)]
    tp_group = tuple(pipes[0].stages[0].devices)
    dp_group = tuple(p.stages[0].devices[0] for p in pipes)
    node = {d.index: d.node for d in cm.cluster.devices}
    assert len({node[r] for r in tp_group}) == 1 and len({node[r] for r in dp_group}) == 2
    c2 = experts.with_degree(cm, 2)
    dtype = cm.cluster.devices[0].spec.name
    base = c2.base(0, cm.L, dtype, 4, tp_group)
    fwd, bwd, _ = experts.a2a_times(c2, base, tp_group, dp_group)
    one = cm.collective("all_to_all", base.moe_bytes, dp_group)
    assert fwd == pytest.approx(base.moe_layers * 2 * one) and fwd > 0
    assert bwd == pytest.approx(base.moe_layers * (cm.collective("all_to_all", 2 * base.moe_bytes, dp_group) + one))
    # per-rank parameters: the rest / tp + the experts / ep, so going from ep=2 to ep=4 saves a quarter of them
    expert_params = sum(m.params for m in experts.find_moe(cm.graph))
    per_rank = {}
    for ep in (2, 4):
        b = experts.with_degree(cm, ep).base(0, cm.L, dtype, 4, tp_group)
        assert b.expert_params == expert_params / ep
        per_rank[ep] = b.params / len(tp_group) + b.tp_extra
    assert per_rank[2] - per_rank[4] == pytest.approx(expert_params / 4)


def test_search_considers_tensor_parallelism_with_expert_parallelism(cm_2x2: object) -> None:
    """The searcher's configs at ep=2 include tp=2 ones, and its plan is at least as fast as the hand-written
    dp=2 x tp=2 x ep=2 strategy (which is among them)."""
    cm = cm_2x2
    s = Search(experts.with_degree(cm, 2), 20)
    assert {c.tp for c in s._configs()} == {1, 2}
    plan = s.run()
    hand = price_strategy(cm, Strategy(dp=2, tp=2, ep=2))
    assert plan.predicted["step_time_s"] <= hand.predicted["step_time_s"] * (1 + 1e-9)


def test_planner_keeps_zero_out_of_expert_parallel_plans_but_prices_offload(cm_2x2: object) -> None:
    """ZeRO with ep > 1 runs (tests above) but is not priced: a plan asking for it is a clear error;
    offload with ep > 1 is priced (it moves whole experts' state to the host)."""
    from autopar.errors import PlanError

    with pytest.raises(PlanError, match="does not price ZeRO with expert parallelism"):
        price_strategy(cm_2x2, Strategy(dp=2, tp=2, ep=2, zero=1))
    plain = price_strategy(cm_2x2, Strategy(dp=2, tp=2, ep=2))
    off = price_strategy(cm_2x2, Strategy(dp=2, tp=2, ep=2, offload=("optimizer",)))
    assert off.plan.experts == plain.plan.experts
    peak = {k: max(e.predicted["peak_memory_bytes"].values()) for k, e in (("plain", plain), ("off", off))}
    assert peak["off"] < peak["plain"]
