"""GNN workloads: partitioned full-graph and sampled data-parallel training through autopar.plan/compile on
gloo processes equal single-process training (fp32, 3 AdamW steps); TGN data parallel likewise; the graph cost
model's prices; plan round trip. One process spawn per world size serves every case. (The issue-13 default
mode, zero shares and the sampled option: tests/test_graph_modes.py.)"""

from __future__ import annotations

import math

import pytest
import torch

import autopar
from autopar.errors import InfeasibleError, PlanError
from autopar.graphs.cost import GraphCostModel
from autopar.graphs.halo import partition_graph, proportional_shares
from autopar.graphs.models import GRAPH_CASES
from autopar.graphs.planner import graph_stats, plan_graph
from autopar.graphs.program import GraphProgram
from autopar.graphs.sampling import labelled_nodes, sampled_graph, seeds_for_step
from autopar.graphs.tgn import event_batch, tgn_case, train_tgn_reference
from autopar.ir.plan import Plan
from autopar.models import train_reference
from autopar.runtime.launch import spawn_local

from .runtime_cases import assert_matches_reference

pytest.importorskip("torch_geometric")

RTOL, ATOL, STEPS = 1e-4, 1e-5, 3
GRAPH = {"nodes": 1000, "avg_degree": 4.0, "labelled": 0.8}  # unlabelled nodes exercise the global-count weights
SAMPLED = {"mode": "sampled_dp", "batch_size": 48, "fanout": 3, "seed": 5}
# two device types: on graphs this small the cost model gives every node (and every seed) to the fastest device
# (host time and kernel launches bound the step), so the cases train on given uneven node / seed shares
PART_SHARES = {2: [620, 380], 3: [450, 330, 220]}
SEED_SHARES = {2: [30, 18], 3: [22, 16, 10]}
MIXED_2 = {"nodes": [{"device": "A100-80GB"}, {"device": "T4"}]}
MIXED_3 = {"nodes": [{"device": "A100-80GB"}, {"device": "V100-32GB"}, {"device": "T4"}]}
CASES_2 = [(name, mode, {}) for name in ("gcn", "sage", "gat", "graphconv") for mode in ("partition", "sampled_dp")]
CASES_2.append(("tgn", "temporal_dp", {}))
# power-law graphs: hubs with large in-degree, uneven halos
CASES_3 = [("sage", "partition", {"power_law": True}), ("graphconv", "partition", {}),
           ("gcn", "sampled_dp", {"power_law": True}), ("tgn", "temporal_dp", {})]
TGN_BATCH = 40
TGN_SHARES = {2: [25, 15], 3: [20, 12, 8]}


def optimizer(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def options(mode: str) -> dict:
    return SAMPLED if mode == "sampled_dp" else {"mode": mode}


def run_graph_cases(rank: int, world: int, cases: list[tuple[str, str, dict]]) -> list[tuple]:
    """Worker: every case through autopar.compile (rank 0 plans, broadcasts); losses, final state, plan.graph."""
    cluster = MIXED_2 if world == 2 else MIXED_3
    out = []
    for name, mode, extra in cases:
        if name == "tgn":
            case, events = tgn_case(batch_size=TGN_BATCH)
            # the planner gives this tiny TGN's events all to the fastest device (the replicated memory update
            # dominates); a given plan with uneven shares exercises the split
            plan = autopar.plan(case.model, cluster, case.example_inputs, precision="fp32")
            plan.graph["shares"] = TGN_SHARES[world]
            prog = autopar.compile(case.model, cluster, case.example_inputs, optimizer=optimizer, plan=plan.to_json(),
                                   timeout_s=60)
            losses = [prog.step(*event_batch(events, TGN_BATCH, k)) for k in range(STEPS)]
        else:
            case = GRAPH_CASES[name](seed=0, **GRAPH, **extra)
            plan = None
            plan = autopar.plan(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn,
                                precision="fp32", graph_options=options(mode))
            plan.graph["shares"] = (PART_SHARES if mode == "partition" else SEED_SHARES)[world]
            plan = plan.to_json()
            prog = autopar.compile(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn,
                                   optimizer=optimizer, plan=plan, timeout_s=60, graph_options=options(mode),
                                   precision="fp32")
            losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(STEPS)]
        out.append((losses, prog.state_dict()["model"], prog.plan.graph))
    return out


def reference(name: str, mode: str, extra: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training: the plain model on the full graph, on the sampled graphs, or the TGN."""
    if name == "tgn":
        case, events = tgn_case(batch_size=TGN_BATCH)
        return train_tgn_reference(case.model, events, TGN_BATCH, STEPS, optimizer)
    case = GRAPH_CASES[name](seed=0, **GRAPH, **extra)
    if mode == "partition":
        return train_reference(case, optimizer, STEPS)
    return train_sampled_reference(case, SAMPLED, STEPS)


def train_sampled_reference(case: object, opts: dict, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process training the plain model on each step's whole sampled graph, loss on that step's seeds."""
    x, edge_index = case.example_inputs
    y, opt, losses = case.example_target, optimizer(list(case.model.parameters())), []
    for step in range(steps):
        seeds = seeds_for_step(labelled_nodes(y), opts["batch_size"], step, opts["seed"])
        graph = sampled_graph(edge_index, x.shape[0], opts["fanout"], step, opts["seed"])
        loss = case.loss_fn(case.model(x, graph)[seeds], y[seeds])
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in case.model.state_dict().items()}


@pytest.fixture(scope="module")
def results_2() -> list:
    return spawn_local(run_graph_cases, 2, CASES_2, timeout_s=180)


@pytest.fixture(scope="module")
def results_3() -> list:
    return spawn_local(run_graph_cases, 3, CASES_3, timeout_s=180)


def check(results: list, cases: list, index: int) -> None:
    name, mode, extra = cases[index]
    ref_losses, ref_state = reference(name, mode, extra)
    graphs = [per_rank[index][2] for per_rank in results]
    assert all(g == graphs[0] for g in graphs) and graphs[0]["mode"] == mode
    shares = graphs[0]["shares"]
    assert len(set(shares)) > 1 and min(shares) > 0, f"expected uneven shares on mixed devices, got {shares}"
    for rank, per_rank in enumerate(results):
        losses, state, _ = per_rank[index]
        assert_matches_reference(losses, state, ref_losses, ref_state, f"rank {rank}")
    assert ref_losses[-1] != ref_losses[0]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("index", range(len(CASES_2)), ids=[f"{n}-{m}" for n, m, _ in CASES_2])
def test_two_ranks_match_single_process(results_2: list, index: int) -> None:
    check(results_2, CASES_2, index)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("index", range(len(CASES_3)),
                         ids=[f"{n}-{m}" + ("-powerlaw" if e else "") for n, m, e in CASES_3])
def test_three_ranks_match_single_process(results_3: list, index: int) -> None:
    check(results_3, CASES_3, index)


# ---- fast, single-process --------------------------------------------------------------------------------


def test_partition_is_consistent_across_ranks() -> None:
    case = GRAPH_CASES["sage"](seed=1, nodes=120, avg_degree=5.0)
    x, edge_index = case.example_inputs
    shares = [50, 40, 30]
    parts = [partition_graph(edge_index, 120, shares, r) for r in range(3)]
    owned = torch.cat([p.owned for p in parts])
    assert sorted(owned.tolist()) == list(range(120))
    for r, p in enumerate(parts):
        rows = torch.cat([p.owned, p.halo])
        local = {(int(rows[s]), int(rows[d])) for s, d in p.edges.t().tolist()}
        mine = set(p.owned.tolist())
        expected = {(s, d) for s, d in edge_index.t().tolist() if d in mine}
        assert local == expected  # every in-edge of an owned node, nothing else
        assert set(p.halo.tolist()) == {s for s, _ in expected} - mine
        for q, other in enumerate(parts):  # what r sends q is exactly q's halo rows owned by r, in q's order
            sent = p.owned[p.send_index[sum(p.send_counts[:q]):sum(p.send_counts[:q + 1])]].tolist()
            got = other.halo[sum(other.recv_counts[:r]):sum(other.recv_counts[:r + 1])].tolist()
            assert sent == got


def test_shares_follow_speed_and_memory_caps() -> None:
    assert proportional_shares(100, [3.0, 1.0]) == [75, 25]
    capped = proportional_shares(100, [3.0, 1.0, 1.0], caps=[40, 100, 100])
    assert capped[0] == 40 and capped[1] == capped[2] == 30


def _priced(case: object, cluster: object, batch: int, fanout: int, precision: str | None = None) -> tuple:
    x, edge_index = case.example_inputs
    cluster = autopar.Cluster.load(cluster)
    cm = GraphCostModel(case.model, graph_stats(x, edge_index, case.example_target), cluster,
                        precision or autopar.default_precision(cluster))
    return cm.partition(), cm.sampled_dp(batch, fanout)


def test_cost_model_prices_both_modes_and_plans_full_graph() -> None:
    # big features and a fast link: full-graph partitioning over both devices trains more labelled nodes per
    # second than mini-batches whose fanout^2 neighbourhoods repeat work. On a slow network the halo exchange
    # of a split would cost far more than the second device saves: the graph stays on one device (still full
    # graph training) and explain() says why the other gets no nodes. sampled_dp is priced either way but
    # only planned when asked for.
    meta = {"x": torch.empty(200_000, 512, device="meta"),
            "e": torch.empty(2, 4_000_000, dtype=torch.long, device="meta")}
    case = GRAPH_CASES["sage"](seed=0, nodes=50, hidden=128)
    case.example_inputs, case.example_target = (meta["x"], meta["e"]), None
    fast = {"nodes": [{"device": "A100-80GB", "devices_per_node": 2}]}
    slow = {"nodes": [{"device": "A100-80GB"}, {"device": "A100-80GB"}],
            "network": {"bandwidth_GBps": 0.125, "latency_us": 100}}
    opts = {"batch_size": 2048, "fanout": 10}
    priced = {}
    for label, cluster in (("fast", fast), ("slow", slow)):
        part, samp = _priced(case, cluster, 2048, 10, "bf16")
        plan = plan_graph(case.model, cluster, case.example_inputs, None, precision="bf16", options=opts)
        assert plan.graph["mode"] == "partition"  # the default, whatever sampled_dp would price
        assert plan.predicted["samples_per_s"] == pytest.approx(part.samples_per_s)
        assert plan.graph["candidates"]["sampled_dp"]["samples_per_s"] == pytest.approx(samp.samples_per_s)
        asked = plan_graph(case.model, cluster, case.example_inputs, None, precision="bf16",
                           options={**opts, "mode": "sampled_dp"})
        assert asked.graph["mode"] == "sampled_dp" and asked.graph["shares"] == samp.shares
        priced[label] = (part, samp, plan)
    fast_part, fast_samp, _ = priced["fast"]
    assert min(fast_part.shares) > 0 and fast_part.samples_per_s > 5 * fast_samp.samples_per_s
    slow_part, _, slow_plan = priced["slow"]
    assert slow_part.shares == [200_000, 0]
    (idle,) = slow_part.extra["idle"]
    # one node on device 1 makes its halo exchange (over 0.125 GB/s) cost more than the node saves
    assert idle["device"] == 1 and idle["why"] == "slower" and idle["step_s"] > idle["chosen_step_s"]
    assert idle["comm_s"] - idle["chosen_comm_s"] > idle["chosen_compute_s"] - idle["compute_s"]
    text = slow_plan.explain()
    assert "A100-80GB device 1 gets no nodes: adding it makes the step slower" in text
    assert "the halo exchange grows" in text
    assert "sampled_dp (not considered: a different algorithm" in text


def test_partition_infeasible_when_the_graph_does_not_fit() -> None:
    case = GRAPH_CASES["graphconv"](seed=0, nodes=50, hidden=64)
    x = torch.empty(400_000_000, 64, device="meta")  # ~100 GiB of fp32 features per copy
    e = torch.empty(2, 800_000_000, dtype=torch.long, device="meta")
    # T4s compute in fp16 (no bf16): the cluster's default precision
    part, samp = _priced(type(case)(case.model, (x, e), case.loss_fn, None, "big"), "1x2xT4", 1024, 5)
    assert not part.fits and samp.fits and samp.extra["features_on"] == ["host", "host"]
    opts = {"batch_size": 1024, "fanout": 5}
    with pytest.raises(InfeasibleError, match="partition does not fit memory.*sampled_dp would fit"):
        plan_graph(case.model, "1x2xT4", (x, e), None, options=opts)  # never swapped for sampled silently
    plan = plan_graph(case.model, "1x2xT4", (x, e), None, options={**opts, "mode": "sampled_dp"})
    assert plan.graph["mode"] == "sampled_dp" and plan.precision == "fp16"
    with pytest.raises(PlanError, match="bf16"):
        plan_graph(case.model, "1x2xT4", (x, e), None, precision="bf16", options=opts)


def test_plan_json_round_trip_and_explain() -> None:
    case = GRAPH_CASES["gcn"](seed=0, **GRAPH)
    plan = autopar.plan(case.model, MIXED_2, case.example_inputs, case.example_target, case.loss_fn,
                        graph_options={"mode": "partition"})
    back = Plan.from_json(plan.to_json())
    assert back.to_dict() == plan.to_dict() and back.graph["mode"] == "partition"
    assert sum(back.graph["shares"]) == GRAPH["nodes"] and math.isfinite(back.predicted["samples_per_s"])
    text = back.explain()
    assert "mode partition" in text and "sampled_dp" in text


def test_bad_graph_input_is_a_clear_error() -> None:
    case = GRAPH_CASES["sage"](seed=0, nodes=30)
    x, edge_index = case.example_inputs
    plan = plan_graph(case.model, "1x1xA100-80GB", case.example_inputs, case.example_target,
                      options={"mode": "partition"})
    prog = GraphProgram(case.model, plan, case.loss_fn, optimizer, 0, 1)
    with pytest.raises(PlanError, match="outside"):
        prog.step(x, edge_index + 1000, target=case.example_target)
    with pytest.raises(PlanError, match="options"):
        plan_graph(case.model, "1x1xA100-80GB", case.example_inputs, options={"mode": "magic"})
