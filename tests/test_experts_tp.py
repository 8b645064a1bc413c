"""Expert parallelism combined with tensor parallelism and ZeRO: EP x TP / EP x ZeRO programs on 4 gloo
processes train exactly like one process, and the planner prices and searches ep x tp and ep x ZeRO
configurations (expert state partitioned over the dp / ep replicas holding it)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import autopar
from autopar import models
from autopar.ir.plan import Plan, Strategy
from autopar.runtime.launch import spawn_local
from autopar.solver.pricing import experts
from autopar.solver.pricing.pricing import Option, price_strategy
from autopar.solver.search.search import Search

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
# a plan the planner prices with ZeRO and ep: its zero level must reach the runtime's layout
PLAN_CASE_ZERO = ("moe_gpt", {"layers": 2, "batch": 8}, {"dp": 4, "ep": 2, "zero": 2})
PLAN_CLUSTER = "1x4xA100-80GB"


@pytest.fixture(scope="module")
def results_tp() -> list:
    cases = list(CASES_TP)
    for name, kwargs, spec in (PLAN_CASE, PLAN_CASE_ZERO):
        plan = estimated_plan(name, kwargs, PLAN_CLUSTER, Strategy(**spec))
        cases.append((name, kwargs, {"ep": spec["ep"], "plan": plan, "cluster": PLAN_CLUSTER}))
    return spawn_local(run_ep_cases, 4, cases, timeout_s=400)


# the 4-rank expert x tensor-parallel runs (one spawn, ~25-60 s) run in CI's slow step: the main suite is at
# its 15-minute budget
@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES_TP)), ids=[f"{c[0]}-{c[2]}" for c in CASES_TP])
def test_expert_and_tensor_parallel_match_single_process(results_tp: list, index: int) -> None:
    _check(results_tp, CASES_TP, index)


@pytest.mark.slow
def test_compiled_expert_and_tensor_parallel_plan_matches_single_process(results_tp: list) -> None:
    """autopar.estimate(dp=2, tp=2, ep=2) -> Plan (JSON) -> autopar.compile trains exactly."""
    _check(results_tp, CASES_TP + [PLAN_CASE], len(CASES_TP))


@pytest.mark.slow
def test_compiled_expert_parallel_zero_plan_matches_single_process(results_tp: list) -> None:
    """autopar.estimate(dp=4, ep=2, zero=2) -> Plan (JSON) -> autopar.compile trains exactly, and its ranks
    run ZeRO-2 on the experts (partitioned among the 2 replicas holding each) and on the rest."""
    _check(results_tp, CASES_TP + [PLAN_CASE, PLAN_CASE_ZERO], len(CASES_TP) + 1)


def test_tensor_parallel_groups_must_order_their_ranks_alike() -> None:
    from autopar.errors import PlanError
    from autopar.runtime.expert_parallel import expert_groups

    from .runtime_cases import chain, layout_for

    # replica 0 is (0, 3), replica 1 (1, 2): tp index 0 puts replica 0 first, tp index 1 replica 1 first
    lay = layout_for(chain(4, 2), 4, {"ep": 2, "pipelines": [{"batch": 2, "stages": [(2, [0, 3])]},
                                                             {"batch": 2, "stages": [(2, [1, 2])]}]})
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


def test_planner_prices_offload_with_expert_parallelism(cm_2x2: object) -> None:
    """Offload with ep > 1 is priced: it moves whole experts' state to the host."""
    plain = price_strategy(cm_2x2, Strategy(dp=2, tp=2, ep=2))
    off = price_strategy(cm_2x2, Strategy(dp=2, tp=2, ep=2, offload=("optimizer",)))
    assert off.plan.experts == plain.plan.experts
    peak = {k: max(e.predicted["peak_memory_bytes"].values()) for k, e in (("plain", plain), ("off", off))}
    assert peak["off"] < peak["plain"]


# ---- ZeRO with expert parallelism (single process) -----------------------------------------------------


def _counts(model: object, ep: int) -> dict:
    """Parameter elements per rank of a one-stage ep plan, from the model: the rest (held by every replica),
    the experts a rank holds (E / ep of each layer), and its largest layer (a block, experts / ep)."""
    named = dict(model.named_parameters())
    total = sum(p.numel() for p in named.values())
    expert = sum(p.numel() for n, p in named.items() if ".experts." in n)
    blocks = {n.split(".")[1] for n in named if n.startswith("blocks.")}
    block = {b: sum(p.numel() / (ep if ".experts." in n else 1) for n, p in named.items()
                    if n.startswith(f"blocks.{b}.")) for b in blocks}
    outside = total - sum(p.numel() for n, p in named.items() if n.startswith("blocks."))
    largest = max(block.values()) if block else 0
    assert largest > outside  # so the largest coarse layer is a block, whatever the split of the rest
    return {"rest": total - expert, "held": expert / ep, "largest": largest}


@pytest.fixture(scope="module")
def meta_1x4() -> tuple:
    c = models.moe_gpt(layers=2, batch=8, device="meta")
    return c.model, autopar.api.cost_model(c.model, "1x4xA100-80GB", c.example_inputs, c.example_target,
                                           c.loss_fn)


def test_zero_with_expert_parallelism_partitions_experts_over_their_holders(meta_1x4: tuple) -> None:
    """dp=4, ep=2: a rank's experts are held by 2 replicas, the rest by 4. Per-device static memory is
    weights + grads + optimizer state with ZeRO's partitions: rest / 4 + experts / 2 (not / 4); everything
    else in the peak is the same at every zero level. Expert-parallel stages run ZeRO for the whole step
    (runtime/zero_layers.py: their programs are not layered), so ZeRO-2/3 there have ZeRO-1's peak: all
    weights are gathered and all gradients kept until after the schedule."""
    model, cm = meta_1x4
    D, ep, s = 4, 2, cm.state
    k = _counts(model, ep)

    def static(z: int) -> float:
        part, whole = k["rest"] / D + k["held"] / (D // ep), k["rest"] + k["held"]
        return s.weights * whole + s.grads * whole + s.optimizer * (part if z >= 1 else whole)

    est = {z: price_strategy(cm, Strategy(dp=D, ep=ep, zero=z)) for z in range(4)}
    c2 = experts.with_degree(cm, ep)
    dtype = cm.cluster.devices[0].spec.name
    base = c2.base(0, cm.L, dtype, cm.B // D, (0,))
    for z in range(4):
        assert [st.zero for p in est[z].plan.pipelines for st in p.stages] == [z] * D
        assert c2.stage_memory(base, Option(z), 1, D).static == pytest.approx(static(z), rel=1e-9)
        for d, peak in est[z].predicted["peak_memory_bytes"].items():
            # the static difference, plus at most the change of the after-schedule sync bucket (<= N g), which
            # is smaller when only an owner's share is reduced there
            diff = peak - est[0].predicted["peak_memory_bytes"][d]
            assert static(z) - static(0) - s.grads * (k["rest"] + k["held"]) <= diff <= static(z) - static(0) + 2
    # ZeRO with ep lowers the peak (ZeRO-1's partitioned optimizer state; 2 and 3 only shrink the sync bucket)
    peak = {z: max(e.predicted["peak_memory_bytes"].values()) for z, e in est.items()}
    assert peak[3] <= peak[2] <= peak[1] < peak[0]
    assert peak[1] - peak[3] <= s.grads * (k["rest"] + k["held"])


def test_zero_with_expert_parallelism_syncs_experts_among_their_holders(meta_1x4: tuple) -> None:
    """The step's sync and ZeRO's gathers / reduce-scatters: the rest over the 4 replicas, the experts
    over the 2 ranks holding the same ones (the plan's expert groups' ranks at one position), and the
    optimizer step on the partitioned state."""
    model, cm = meta_1x4
    D, ep, s = 4, 2, cm.state
    k = _counts(model, ep)
    est = {z: price_strategy(cm, Strategy(dp=D, ep=ep, zero=z)) for z in range(4)}
    groups = est[0].plan.experts["groups"]
    dp = tuple(p.stages[0].devices[0] for p in est[0].plan.pipelines)
    rank = dp[0]
    pos = next(g.index(rank) for g in groups if rank in g)
    hold = tuple(g[pos] for g in groups)
    assert len(hold) == D // ep
    col = cm.collective
    ag = col("all_gather", k["rest"] * s.weights, dp) + col("all_gather", k["held"] * s.weights, hold)
    rs = col("reduce_scatter", k["rest"] * s.grads, dp) + col("reduce_scatter", k["held"] * s.grads, hold)
    ar = col("all_reduce", k["rest"] * s.grads, dp) + col("all_reduce", k["held"] * s.grads, hold)
    bw = cm.models[cm.cluster.devices[rank].spec.name].bandwidth
    step = {z: 2 * s.total * (k["rest"] / D + k["held"] / (D // ep) if z else k["rest"] + k["held"]) / bw
            for z in range(4)}
    pred = {z: e.plan.pipelines[0].stages[0].predicted for z, e in est.items()}
    # plus the host's per-step optimizer overhead (cost_models/overhead.py), the same for every level
    host = cm.base(0, cm.L, cm.cluster.devices[rank].spec.name, est[0].plan.pipelines[0].microbatch_size,
                   (rank,)).host_step
    for z, comm in enumerate((ar, rs + ag, ag, 0.0)):
        assert pred[z]["sync_s"] == pytest.approx(comm + step[z] + host, rel=1e-9)
    assert pred[3]["fwd_s"] - pred[0]["fwd_s"] == pytest.approx(ag, rel=1e-6)
    assert pred[3]["bwd_s"] - pred[0]["bwd_s"] == pytest.approx(ag + rs, rel=1e-6)
    assert pred[2]["bwd_s"] - pred[0]["bwd_s"] == pytest.approx(rs, rel=1e-6)
    assert pred[1]["fwd_s"] == pred[0]["fwd_s"] and pred[1]["bwd_s"] == pred[0]["bwd_s"]


def test_zero_leaves_stacked_mixtral_experts_whole() -> None:
    """Mixtral's stacked expert tensors stay out of ZeRO in the runtime (`zero_levels`): the planner
    partitions only the rest of the stage."""
    pytest.importorskip("transformers")
    c = models.hf_mixtral(layers=2, batch=4, device="meta")
    cm = autopar.api.cost_model(c.model, "1x4xA100-80GB", c.example_inputs, c.example_target, c.loss_fn)
    named = dict(c.model.named_parameters())
    held = sum(p.numel() for n, p in named.items() if ".experts." in n) / 2  # a rank's half of every stack
    rest = sum(p.numel() for p in named.values()) - 2 * held
    assert held and all(m.stacked for m in experts.find_moe(cm.graph))
    s = cm.state
    peak = {z: price_strategy(cm, Strategy(dp=4, ep=2, zero=z)).predicted["peak_memory_bytes"][0] for z in (0, 1, 2)}
    assert peak[1] - peak[0] == pytest.approx(-s.optimizer * rest * 3 / 4, abs=2)
    assert peak[2] == peak[1]  # expert-parallel stages run ZeRO-2 for the whole step: ZeRO-1's peak


def test_search_chooses_zero_with_expert_parallelism_when_memory_requires_it() -> None:
    """With each device's usable memory between the dp=4 plans' peaks without and with ZeRO-1 at the
    largest expert degree, no expert-parallel data-parallel plan fits without ZeRO: the ep > 1 plan that
    fits needs its ZeRO (at zero 0 it does not fit), its JSON lowers to a runtime layout with the same zero
    levels and expert degree, and the search's plan is at least as fast (and, if expert-parallel, the same)."""
    from autopar.lowering import layout_of
    from autopar.runtime.expert_parallel import expert_groups
    from autopar.solver.pricing.pricing import CostModel, price
    from autopar.solver.search.search import search

    c = models.moe_gpt(layers=2, batch=8, seq=128, hidden=1024, heads=16, vocab=1024, ffn=8192, experts=8,
                       top_k=1, device="meta")
    cm = autopar.api.cost_model(c.model, "1x4xA100-80GB", c.example_inputs, c.example_target, c.loss_fn)
    top = max(experts.candidates(cm))
    assert top > 1
    peak = {(ep, z): max(price_strategy(cm, Strategy(dp=4, ep=ep, zero=z)).predicted["peak_memory_bytes"].values())
            for ep in experts.candidates(cm) if ep > 1 for z in (0, 1)}
    usable = (peak[top, 0] + peak[top, 1]) / 2
    assert all(peak[ep, 0] > usable for ep, _ in peak) and peak[top, 1] < usable
    capacity = cm.cluster.devices[0].spec.memory
    # the reserve that leaves `usable` bytes for tensors once the runtime's own (CUDA context, NCCL) is taken
    tight = CostModel(cm.graph, cm.cluster, cm.precision, cm.optimizer,
                      memory_reserve=1 - (usable + cm.runtime_reserve(0)) / capacity)
    found = search(tight, time_limit_s=30)
    # the search may find something faster than data parallelism (since zero-bubble schedules and tp pipelines
    # it finds a tp2 x pp2 plan here), never something slower than the one expert-parallel DP plan that fits
    ep_plan = price_strategy(tight, Strategy(dp=4, ep=top, zero=1)).plan
    assert price(tight, replace(found, predicted={})).fits
    assert found.predicted["step_time_s"] <= ep_plan.predicted["step_time_s"] * (1 + 1e-9)
    for plan in [ep_plan] + ([found] if found.experts and found.experts["degree"] > 1 else []):
        zeros = [st.zero for p in plan.pipelines for st in p.stages]
        assert any(zeros)
        assert price(tight, replace(plan, predicted={})).fits
        plain = replace(plan, predicted={}, pipelines=[replace(p, stages=[replace(st, zero=0) for st in p.stages])
                                                       for p in plan.pipelines])
        assert not price(tight, plain).fits
        again = Plan.from_json(plan.to_json())
        lay = layout_of(again, cm.L)
        assert lay.ep == plan.experts["degree"]
        assert [st.zero for p in lay.pipelines for st in p.stages] == zeros
        assert sorted(map(list, expert_groups(lay))) == sorted(plan.experts["groups"])


# all three together needs 8 ranks: dp=2 replicas of a 2-stage pipeline of tp=2 groups, experts shared (ep=2)
CASES_TP_PP = [("moe_gpt", {"layers": 2, "batch": 4}, {"dp": 2, "tp": 2, "pp": 2, "ep": 2, "m": 2})]


@pytest.mark.slow
def test_expert_tensor_and_pipeline_parallel_match_single_process() -> None:
    results = spawn_local(run_ep_cases, 8, CASES_TP_PP, timeout_s=600)
    _check(results, CASES_TP_PP, 0)
