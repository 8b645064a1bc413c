"""Intra-op (Alpa-style) sharding ILP: Megatron's pattern where it pays, less communication on slow links,
parameter sharding under a memory budget, exactness against brute force, determinism and block reuse."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

import autopar
from autopar import models
from autopar.cluster import Cluster
from autopar.cost_models.memory import state_bytes_per_param
from autopar.errors import InfeasibleError, PlanError
from autopar.solver.intra_op import intra_op
from autopar.solver.intra_op.intra_op import build_layer_problem, solve_intra_op, solve_problems
from autopar.solver.intra_op.strategies import R, reshape_map

DEV = "A100-80GB"
FAST = Cluster.load("1x4xA100-80GB")
# Same devices, a link a thousand times slower than PCIe with a millisecond latency.
SLOW = Cluster.load({"nodes": [{"device": DEV, "devices_per_node": 4,
                                "intra_node": {"bandwidth_GBps": 0.01, "latency_us": 1000}}]})


def _analyze(case: models.ModelCase, precision: str = "fp32") -> autopar.TrainingGraph:
    return autopar.analyze(case.model, FAST, example_inputs=case.example_inputs,
                           example_target=case.example_target, loss_fn=case.loss_fn, precision=precision)


@pytest.fixture(scope="module")
def big_gpt() -> autopar.TrainingGraph:
    # hidden 4096: matmuls dominate, and tokens (1024) < 3 x hidden, so Megatron's activation all-reduces
    # move less than batch sharding's weight-gradient all-reduces.
    return _analyze(models.gpt(batch=2, seq=512, vocab=1024, hidden=4096, heads=32, layers=2, device="meta"),
                    precision="bf16")


@pytest.fixture(scope="module")
def small_gpt() -> autopar.TrainingGraph:
    return _analyze(models.gpt(batch=4, seq=128, vocab=512, hidden=512, heads=8, layers=4, device="meta"))


def _by_module(graph: autopar.TrainingGraph, result: intra_op.IntraOpResult, module: str) -> str:
    (name,) = [n.name for n in graph.nodes.values()
               if n.module == module and n.target == "aten.linear.default"]
    return result.strategies[name]


def _all_layers(graph: autopar.TrainingGraph) -> list[int]:
    return list(range(len(graph.layers)))


@pytest.mark.parametrize("tp", [2, 4])
def test_megatron_mlp_when_comm_is_cheap(big_gpt: autopar.TrainingGraph, tp: int) -> None:
    result = solve_intra_op(big_gpt, _all_layers(big_gpt), tp, DEV, FAST, list(range(tp)))
    plain = solve_intra_op(big_gpt, _all_layers(big_gpt), 1, DEV, FAST, [0])
    for block in (0, 1):
        assert _by_module(big_gpt, result, f"blocks.{block}.mlp.fc") == "col"
        assert _by_module(big_gpt, result, f"blocks.{block}.mlp.proj") == "row"
        assert _by_module(big_gpt, result, f"blocks.{block}.attn.qkv") == "col"
        assert _by_module(big_gpt, result, f"blocks.{block}.attn.proj") == "row"
    assert result.comm_time > 0
    assert result.time_fwd + result.time_bwd < 0.75 * (plain.time_fwd + plain.time_bwd)
    assert result.param_bytes_per_device < 1.05 / tp * plain.param_bytes_per_device


def test_slow_link_avoids_communication(big_gpt: autopar.TrainingGraph) -> None:
    fast = solve_intra_op(big_gpt, _all_layers(big_gpt), 4, DEV, FAST, [0, 1, 2, 3])
    slow = solve_intra_op(big_gpt, _all_layers(big_gpt), 4, DEV, SLOW, [0, 1, 2, 3])
    assert slow.comm_time < fast.comm_time
    for block in (0, 1):
        assert _by_module(big_gpt, slow, f"blocks.{block}.mlp.fc") in ("R", "S(0)", "S(1)")
        assert _by_module(big_gpt, slow, f"blocks.{block}.mlp.proj") in ("R", "S(0)", "S(1)")
    assert slow.comm_time == 0  # replicated everywhere: nothing is worth a millisecond per message


def test_memory_budget_forces_parameter_sharding(small_gpt: autopar.TrainingGraph) -> None:
    layers = [1, 2, 3, 4]
    free = solve_intra_op(small_gpt, layers, 4, DEV, SLOW, [0, 1, 2, 3])
    assert set(free.strategies.values()) <= {"R"}
    per_param = state_bytes_per_param("adamw", small_gpt.dtype)
    state = free.param_bytes_per_device / 4 * per_param.total  # fp32: 4 bytes per weight
    budget = 0.6 * state + free.activation_bytes_per_device
    tight = solve_intra_op(small_gpt, layers, 4, DEV, SLOW, [0, 1, 2, 3], memory_budget=budget)
    assert tight.param_bytes_per_device < 0.6 * free.param_bytes_per_device
    assert tight.param_bytes_per_device / 4 * per_param.total + tight.activation_bytes_per_device <= budget
    assert {"col", "row"} & set(tight.strategies.values())
    assert tight.time_fwd + tight.time_bwd > free.time_fwd + free.time_bwd  # it paid for the memory
    with pytest.raises(InfeasibleError, match="GiB per device"):
        solve_intra_op(small_gpt, layers, 4, DEV, SLOW, [0, 1, 2, 3], memory_budget=1e5)


class _MLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.nn.functional.gelu(self.fc(x)))


class _MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_MLPBlock(d), _MLPBlock(d)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


@pytest.fixture(scope="module")
def mlp_graph() -> autopar.TrainingGraph:
    with torch.device("meta"):
        model, x, y = _MLP(1024), torch.randn(8, 128, 1024), torch.randn(8, 128, 1024)
    return autopar.analyze(model, FAST, example_inputs=(x,), example_target=y,
                           loss_fn=torch.nn.functional.mse_loss)


@pytest.mark.parametrize(("cluster", "boundary", "budget_frac"),
                         [(FAST, R, None), (FAST, 1, None), (SLOW, R, None), (SLOW, R, 0.5)])
def test_ilp_matches_brute_force(mlp_graph: autopar.TrainingGraph, cluster: Cluster, boundary: int,
                                 budget_frac: float | None) -> None:
    block = next(layer.index for layer in mlp_graph.layers if layer.kind == "block")
    prob = build_layer_problem(mlp_graph, block, 2, DEV, cluster, [0, 1], boundary=boundary)
    combos = list(itertools.product(*(range(len(c)) for c in prob.cost)))
    assert len(combos) > 50  # fc, gelu and proj each have several strategies: a real search
    budget = None
    if budget_frac is not None:
        low, high = min(map(prob.memory_of, combos)), max(map(prob.memory_of, combos))
        budget = low + budget_frac * (high - low)
        combos = [c for c in combos if prob.memory_of(c) <= budget]
    brute = min((prob.objective(c), sum(c)) for c in combos)
    (choice,) = solve_problems([(prob, 1)], memory_budget=budget)
    assert (prob.objective(choice), sum(choice)) == brute
    if budget is not None:
        assert prob.memory_of(choice) <= budget


def test_deterministic(big_gpt: autopar.TrainingGraph) -> None:
    results = []
    for _ in range(3):
        intra_op.clear_cache()
        results.append(solve_intra_op(big_gpt, _all_layers(big_gpt), 4, DEV, FAST, [0, 1, 2, 3]))
    assert results[0] == results[1] == results[2]


def test_repeated_blocks_solved_once(small_gpt: autopar.TrainingGraph) -> None:
    intra_op.clear_cache()
    one = solve_intra_op(small_gpt, [1], 2, DEV, FAST, [0, 1])
    solves_one_block = intra_op.cache_info()["ilp_solves"]
    intra_op.clear_cache()
    four = solve_intra_op(small_gpt, [1, 2, 3, 4], 2, DEV, FAST, [0, 1])
    assert intra_op.cache_info()["ilp_solves"] == solves_one_block
    assert four.time_fwd == pytest.approx(4 * one.time_fwd)
    assert four.activation_bytes_per_device == pytest.approx(4 * one.activation_bytes_per_device)
    # identical blocks get identical strategies, node for node
    first, second = (small_gpt.layers[i].nodes for i in (1, 2))
    assert [four.strategies[a] for a in first] == [four.strategies[b] for b in second]
    again = solve_intra_op(small_gpt, [2, 3], 2, DEV, FAST, [0, 1])  # other blocks, same signature: cached
    assert intra_op.cache_info()["ilp_solves"] == solves_one_block
    assert intra_op.cache_info()["hits"] > 0
    assert again.time_bwd == pytest.approx(2 * one.time_bwd)


def test_tp1_is_the_plain_layer_cost(small_gpt: autopar.TrainingGraph) -> None:
    layers = _all_layers(small_gpt)
    r = solve_intra_op(small_gpt, layers, 1, DEV, FAST, [0])
    assert r.comm_time == 0
    assert r.time_fwd == pytest.approx(sum(small_gpt.layers[i].time_fwd[DEV] for i in layers))
    assert r.activation_bytes_per_device == sum(small_gpt.layers[i].saved_bytes for i in layers)
    assert r.param_bytes_per_device == small_gpt.param_bytes()
    # all-replicated strategies in the ILP's own accounting give the same numbers
    for i in layers:
        prob = build_layer_problem(small_gpt, i, 2, DEV, FAST, [0, 1])
        cost = prob.breakdown([0] * len(prob.cost))
        assert cost.comm_fwd == cost.comm_bwd == 0
        assert cost.compute_fwd == pytest.approx(small_gpt.layers[i].time_fwd[DEV])
        assert cost.act_bytes == small_gpt.layers[i].saved_bytes
        assert cost.param_bytes == small_gpt.layers[i].param_bytes


def test_bad_input_names_the_fix(small_gpt: autopar.TrainingGraph) -> None:
    with pytest.raises(PlanError, match="must list tp=2"):
        solve_intra_op(small_gpt, [1], 2, DEV, FAST, [0])
    with pytest.raises(PlanError, match="no times for device type"):
        solve_intra_op(small_gpt, [1], 2, "H100-SXM", FAST, [0, 1])
    with pytest.raises(PlanError, match="layer indices"):
        solve_intra_op(small_gpt, [99], 2, DEV, FAST, [0, 1])


def test_reshape_carries_shards() -> None:
    # fused QKV (B, T, 3*H*D) -> (B, T, 3, H, D): a column shard lands on the heads (3 does not divide by 2)
    assert reshape_map((4, 32, 192), (4, 32, 3, 4, 16), 2, 2) == 3
    assert reshape_map((4, 32, 192), (4, 32, 3, 4, 16), 1, 2) == 1
    # heads merged back: (B, T, H, D) -> (B, T, H*D) keeps a head shard, a head-dim shard cannot follow
    assert reshape_map((4, 32, 4, 16), (4, 32, 64), 2, 2) == 2
    assert reshape_map((4, 32, 4, 16), (4, 32, 64), 3, 2) is None
    # flatten (B, T, V) -> (B*T, V): batch and vocab shards survive, a sequence shard does not
    assert reshape_map((4, 32, 128), (128, 128), 0, 2) == 0
    assert reshape_map((4, 32, 128), (128, 128), 2, 2) == 1
    assert reshape_map((4, 32, 128), (128, 128), 1, 2) is None
    # DTensor's view propagation keeps a split shard only on the first factor (the runtime's ILP mode)
    assert reshape_map((4, 32, 192), (4, 32, 3, 4, 16), 2, 2, first_only=True) is None
    assert reshape_map((4, 32, 64), (4, 32, 4, 16), 2, 2, first_only=True) == 2


MEGATRON = {"attn.qkv": "col", "attn.proj": "row", "mlp.fc": "col", "mlp.proj": "row"}


def _megatron_choice(graph: autopar.TrainingGraph, prob: intra_op.Problem) -> tuple[int, ...]:
    """Megatron's sharding in the ILP's space: column-parallel QKV and fc, row-parallel projections, every
    other op given the cheapest strategy that completes those layouts (the ILP with the linears pinned)."""
    pinned = copy.deepcopy(prob)
    big = 1 + sum(max(c) for c in prob.cost) + sum(max(map(max, m)) for m in prob.edges.values())
    found = 0
    for g, costs in zip(pinned.groups, pinned.cost, strict=True):
        node = graph.nodes[g.members[0]]
        want = next((v for k, v in MEGATRON.items() if node.module.endswith(k)), None)
        if want is None or node.target != "aten.linear.default":
            continue
        found += 1
        for i, choice in enumerate(g.choices):
            if choice[g.members[0]].base.name != want:
                costs[i] = big
    assert found == 4
    (choice,) = solve_problems([(pinned, 1)])
    return choice


@pytest.mark.parametrize("tp", [2, 4])
def test_planner_ilp_never_worse_than_megatron_on_a_gpt_block(tp: int) -> None:
    """The planner's tensor-parallel price of a GPT block (pricing.tp_layer_cost, from the ILP in runtime
    mode) is at most the ILP model's price of the runtime's Megatron placements (`megatron_spec`, laid out
    by DTensor's propagation as `runtime_choice` models it), at several micro-batch sizes, including uneven
    ones. The unrestricted ILP (`solve_intra_op`) is at most its own Megatron sharding, whose column-parallel
    fused QKV the runtime cannot run (it would need the weight's features permuted)."""
    from autopar.api import cost_model
    from autopar.solver.intra_op import pricing as iop
    from autopar.solver.pricing.pricing import tp_layer_cost

    case = models.gpt(batch=6, seq=256, vocab=1024, hidden=1024, heads=16, layers=2, device="meta")
    cm = cost_model(case.model, FAST, case.example_inputs, case.example_target, case.loss_fn)
    block = next(layer.index for layer in cm.graph.layers if layer.kind == "block")
    layer = cm.graph.layers[block]
    group = tuple(range(tp))
    pricer = iop.LayerPricer(cm.graph, tp, DEV, FAST, group)
    for n in (1, 2, 4, 3, 6):
        priced = tp_layer_cost(cm, block, DEV, n, group)
        assert priced.ilp
        total = priced.fwd + priced.bwd + priced.fwd_comm + priced.bwd_comm
        ctx = pricer._at(n)
        ctx.forbid = False
        prob = intra_op._build(ctx, layer, R)
        runtime_megatron = prob.breakdown(iop.runtime_choice(ctx, layer, prob.groups,
                                                             iop.megatron_layouts(ctx, layer)))
        assert total <= runtime_megatron.seconds * (1 + 1e-9)
        assert runtime_megatron.comm_fwd > 0 and runtime_megatron.comm_bwd > 0  # Megatron's all-reduces
        free = solve_intra_op(cm.graph, [block], tp, DEV, FAST, list(group), batch=n)
        prob = build_layer_problem(cm.graph, block, tp, DEV, FAST, group, boundary=R, batch=n)
        assert free.time_fwd + free.time_bwd <= prob.breakdown(_megatron_choice(cm.graph, prob)).seconds * (1 + 1e-9)
    est = autopar.estimate(case.model, FAST, autopar.Strategy(tp=tp, dp=4 // tp), case.example_inputs,
                           case.example_target, case.loss_fn)
    assert {s.predicted["tp_source"] for p in est.plan.pipelines for s in p.stages} == {"ilp"}
