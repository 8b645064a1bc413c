"""Expert parallelism: EP programs on gloo processes train exactly like one process, and its pricing."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar import models
from autopar.errors import PlanError
from autopar.ir.plan import Plan, Strategy
from autopar.runtime.launch import spawn_local
from autopar.runtime.program import Program
from autopar.solver.pricing import experts
from autopar.solver.pricing.pricing import Option, price_strategy
from autopar.solver.search.search import Search, search

from .runtime_cases import (
    STEPS,
    assert_matches_reference,
    assert_work_split,
    build,
    layout_for,
    optimizer,
    plan_for,
    reference,
    work_of,
)

RTOL, ATOL = 1e-4, 1e-5
COMPILE_CLUSTER = "1x2xA100-80GB"

# (model, model kwargs, strategy with the expert-parallel degree "ep")
CASES_2 = [
    ("moe_gpt", {"layers": 2, "batch": 4}, {"dp": 2, "ep": 2}),
    ("moe_gpt", {"layers": 2, "batch": 4, "experts": 4, "top_k": 1}, {"dp": 2, "ep": 2, "m": 2}),
    ("hf_mixtral", {"layers": 2, "batch": 4}, {"dp": 2, "ep": 2}),
]
CASES_4 = [
    ("moe_gpt", {"layers": 2, "batch": 8}, {"dp": 2, "pp": 2, "m": 2, "ep": 2}),
    ("moe_gpt", {"layers": 2, "batch": 8, "experts": 8}, {"dp": 4, "ep": 4, "batch_split": [3, 2, 2, 1]}),
    ("moe_gpt", {"layers": 2, "batch": 8}, {"dp": 4, "ep": 2, "m": 2, "recompute": True}),
    # replica 0 on the higher ranks: group positions follow process-group rank order, not replica order
    ("moe_gpt", {"layers": 2, "batch": 8},
     {"ep": 2, "pipelines": [{"batch": 5, "m": 2, "stages": [(1, [1]), (1, [3])]},
                             {"batch": 3, "m": 2, "stages": [(1, [0]), (1, [2])]}]}),
]


def run_ep_cases(rank: int, world: int, cases: list[tuple[str, dict, dict]]) -> list[tuple]:
    """Worker body: per case, the losses, the full final state and how many expert parameters this rank
    holds (elements), against the model's total expert elements."""
    from autopar.runtime.expert_parallel import supported_moe

    out = []
    for name, kwargs, spec in cases:
        case = build(name, **kwargs)
        if "plan" in spec:  # the public path: a Plan (JSON) through autopar.compile
            prog = autopar.compile(case.model, spec["cluster"], case.example_inputs, case.example_target,
                                   case.loss_fn, optimizer, plan=spec["plan"], timeout_s=60)
        else:
            g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
            # "sharding": an ILP-style Stage.sharding on every stage
            prog = Program(case.model, plan_for(g, world, spec), case.example_inputs, case.example_target,
                           case.loss_fn, optimizer, rank, world, timeout_s=60, graph=g)
        losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(STEPS)]
        names = {f"{path}.{rel}" for path, m, a in supported_moe(case.model) for rel, _ in a.params(m)}
        # local elements: under tensor parallelism experts stay whole (replicated in the tp group)
        held = sum(getattr(p, "_local_tensor", p).numel() for n, p in prog.params.items() if n in names)
        tp_sharded = sorted(n for n, p in prog.params.items() if getattr(p, "_local_tensor", p).shape != p.shape)
        zero_levels = {n: prog.zero.state[n].level for n in prog.params}
        stage_total = sum(dict(case.model.named_parameters())[n].numel() for n in names
                          if any(n in st.params for st in prog._stages.values()))
        sd = prog.state_dict()
        # back into this layout: each rank takes its experts (shards) again
        prog.load_state_dict(sd)
        again = prog.state_dict()
        same = all(torch.equal(again["model"][k], v) for k, v in sd["model"].items()) and all(
            torch.equal(again["optimizer"][n][k], v) for n, st in sd["optimizer"].items() for k, v in st.items())
        out.append((losses, sd["model"], held, stage_total, same, tp_sharded, zero_levels, work_of(prog)))
    return out


def estimated_plan(name: str, kwargs: dict, cluster: str, strategy: Strategy) -> str:
    """The Plan autopar.estimate makes of a hand-written strategy, as JSON."""
    case = build(name, **kwargs)
    # fp32: the reference is fp32 training (the A100 default, bf16, would run under autocast)
    est = autopar.estimate(case.model, cluster, strategy, case.example_inputs, case.example_target, case.loss_fn,
                           precision="fp32")
    return est.plan.to_json()


@pytest.fixture(scope="module")
def results_2() -> list:
    pytest.importorskip("transformers")
    name, kwargs = "moe_gpt", {"layers": 2, "batch": 4}
    plan = estimated_plan(name, kwargs, COMPILE_CLUSTER, Strategy(dp=2, ep=2))
    cases = CASES_2 + [(name, kwargs, {"ep": 2, "dp": 2, "plan": plan, "cluster": COMPILE_CLUSTER})]
    return spawn_local(run_ep_cases, 2, cases, timeout_s=240)


@pytest.fixture(scope="module")
def results_4() -> list:
    return spawn_local(run_ep_cases, 4, CASES_4, timeout_s=240)


def _check(results: list, cases: list, index: int) -> None:
    name, kwargs, spec = cases[index]
    ref_losses, ref_params = reference(name, kwargs)
    for rank, per_rank in enumerate(results):
        losses, params, held, stage_total, round_trip, tp_sharded, levels, _ = per_rank[index]
        assert round_trip, f"rank {rank}: state_dict -> load_state_dict -> state_dict changed the state"
        assert_matches_reference(losses, params, ref_losses, ref_params, f"rank {rank}")
        assert held * spec["ep"] == stage_total  # each rank holds 1/ep of its stage's experts
        assert bool(tp_sharded) == (spec.get("tp", 1) > 1)  # tensor parallelism shards the rest of the stage
        # ZeRO partitions what more than one replica holds: experts when dp / ep > 1 (stacked ones stay whole)
        replicas = spec.get("dp", 1) // spec["ep"]
        expected = {n: spec.get("zero", 0) if replicas > 1 and "experts.gate_up" not in n
                    and "experts.down" not in n else 0 for n in levels if ".experts." in n}
        assert {n: v for n, v in levels.items() if ".experts." in n} == expected
        if spec.get("zero", 0):
            assert any(v == spec["zero"] for n, v in levels.items() if ".experts." not in n)
    assert ref_losses[-1] < ref_losses[0]
    # and the ranks' batch slices, layers and tensor-parallel shards follow the strategy
    assert_work_split([per_rank[index][-1] for per_rank in results], spec, kwargs["batch"], ref_params)


@pytest.mark.parametrize("index", range(len(CASES_2)), ids=[f"{c[0]}-{c[2]}" for c in CASES_2])
def test_expert_parallel_2_ranks_matches_single_process(results_2: list, index: int) -> None:
    _check(results_2, CASES_2, index)


def test_compiled_expert_parallel_plan_matches_single_process(results_2: list) -> None:
    """autopar.estimate -> Plan (JSON, with its `experts` entry) -> autopar.compile trains exactly."""
    _check(results_2, CASES_2 + [("moe_gpt", {"layers": 2, "batch": 4}, {"ep": 2, "dp": 2})], len(CASES_2))


@pytest.mark.parametrize("index", range(len(CASES_4)), ids=[f"{c[0]}-{c[2]}" for c in CASES_4])
def test_expert_parallel_4_ranks_matches_single_process(results_4: list, index: int) -> None:
    _check(results_4, CASES_4, index)


# ---- pricing (single process) -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_cm() -> dict:
    c = models.moe_gpt(layers=2, batch=8)
    return {cl: autopar.api.cost_model(c.model, cl, c.example_inputs, c.example_target, c.loss_fn)
            for cl in ("1x2xA100-80GB", "2x1xA100-80GB")}


def test_moe_layers_found_in_the_graph(small_cm: dict) -> None:
    cm = small_cm["1x2xA100-80GB"]
    layers = experts.find_moe(cm.graph)
    assert [m.module for m in layers] == ["blocks.0.mlp", "blocks.1.mlp"]
    m = layers[0]
    assert (m.experts, m.top_k, m.hidden, m.tokens, m.dense, m.supported) == (4, 2, 64, 8 * 32, True, True)
    own = dict(cm.graph.params.items())
    assert m.params == sum(i.meta.numel for i in own.values() if i.name.startswith("blocks.0.mlp.experts."))
    assert experts.candidates(cm) == [1, 2]


def test_all_to_all_across_nodes_costs_more_than_inside(small_cm: dict) -> None:
    times = {}
    for cl, cm in small_cm.items():
        c2 = experts.with_degree(cm, 2)
        base = c2.base(0, cm.L, cm.cluster.devices[0].spec.name, 4, (0,))
        assert base.moe_layers == 2 and base.moe_bytes == 4 * 32 * 2 * 64 * 4  # tokens x top_k x hidden x fp32
        times[cl] = experts.a2a_times(c2, base, (0,), (0, 1))
        assert times[cl][0] == pytest.approx(2 * 2 * cm.collective("all_to_all", base.moe_bytes, (0, 1)))
    assert times["2x1xA100-80GB"][0] > times["1x2xA100-80GB"][0] > 0
    assert times["2x1xA100-80GB"][1] > times["1x2xA100-80GB"][1] > 0


def test_expert_memory_per_device_drops_with_ep(small_cm: dict) -> None:
    cm = small_cm["1x2xA100-80GB"]
    expert_params = sum(m.params for m in experts.find_moe(cm.graph))
    dtype = cm.cluster.devices[0].spec.name
    static = {}
    for ep in (1, 2):
        c = experts.with_degree(cm, ep)
        base = c.base(0, cm.L, dtype, 4, (0,))
        static[ep] = c.stage_memory(base, Option(), 1, 2).static
    assert static[1] - static[2] == pytest.approx(expert_params / 2 * cm.state.total, rel=1e-6)
    peak = {ep: max(price_strategy(cm, Strategy(dp=2, ep=ep)).predicted["peak_memory_bytes"].values())
            for ep in (1, 2)}
    assert peak[2] < peak[1]


def test_planner_derives_the_expert_degree() -> None:
    """On 4 single-GPU nodes, expert gradients cost a network all-reduce under data parallelism: the
    planner's degree is the one whose own search predicts the shortest step, and here it is > 1."""
    c = models.moe_gpt(layers=2, batch=8, seq=128, hidden=1024, heads=16, vocab=1024, ffn=8192, experts=8,
                       top_k=1, device="meta")
    cm = autopar.api.cost_model(c.model, "4x1xA100-80GB", c.example_inputs, c.example_target, c.loss_fn)
    plan = search(cm, time_limit_s=30)
    per_ep = {ep: Search(experts.with_degree(cm, ep), 30).run().predicted["step_time_s"]
              for ep in experts.candidates(cm)}
    best = min(per_ep, key=per_ep.get)
    assert plan.experts["degree"] == best > 1
    assert plan.predicted["step_time_s"] == pytest.approx(per_ep[best])
    assert plan.experts["experts_per_rank"] == 8 // best and len(plan.experts["groups"][0]) == best
    assert Plan.from_json(plan.to_json()).experts == plan.experts  # plain JSON


def test_bad_expert_degree_is_a_clear_error(small_cm: dict) -> None:
    cm = small_cm["1x2xA100-80GB"]
    with pytest.raises(PlanError, match="does not divide the expert count"):
        price_strategy(cm, Strategy(dp=2, ep=3))
    with pytest.raises(PlanError, match="must divide the number of data-parallel replicas"):
        price_strategy(cm, Strategy(tp=2, ep=2))


def test_expert_groups_follow_the_layout_and_reject_what_the_runtime_cannot_run() -> None:
    from autopar.runtime.expert_parallel import expert_groups

    from .runtime_cases import chain

    # Megatron order: stage s, replica d = 4 s + d
    lay = layout_for(chain(8, 2), 8, {"dp": 4, "pp": 2, "m": 2, "ep": 2})
    assert expert_groups(lay) == [(0, 1), (4, 5), (2, 3), (6, 7)]
    with pytest.raises(PlanError, match="must divide the 3 data-parallel replicas"):
        expert_groups(layout_for(chain(6, 2), 3, {"dp": 3, "ep": 2}))
    tp = layout_for(chain(4, 2), 4, {"dp": 2, "tp": 2, "ep": 2})  # with tp: one group per tensor-parallel index
    ranks = [p.stages[0].ranks for p in tp.pipelines]
    assert expert_groups(tp) == [(ranks[0][t], ranks[1][t]) for t in range(2)]
    uneven = layout_for(chain(4, 2), 3, {"ep": 2, "pipelines": [{"batch": 2, "stages": [(2, [0, 1])]},
                                                                {"batch": 2, "stages": [(2, [2])]}]})
    with pytest.raises(PlanError, match="same tp per stage"):
        expert_groups(uneven)
    with pytest.raises(PlanError, match="identical pipelines"):
        expert_groups(layout_for(chain(4, 2), 2, {"dp": 2, "m": 2, "batch_split": [3, 1], "ep": 2}))


class _OtherMoE(torch.nn.Module):
    """A top-k MoE the runtime has no adapter for (its experts are nn.Sequential)."""

    def __init__(self, hidden: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU())
                                           for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, i = self.gate(x).softmax(-1).topk(2, dim=-1)
        gates = torch.zeros(*x.shape[:-1], len(self.experts)).scatter(-1, i, w)
        return sum(gates[..., e:e + 1] * ex(x) for e, ex in enumerate(self.experts))


def test_unsupported_moe_stays_replicated_and_the_plan_says_so() -> None:
    from autopar.runtime.expert_parallel import supported_moe, unsupported_moe

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), _OtherMoE(), _OtherMoE(), torch.nn.Linear(16, 4))
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    assert supported_moe(model) == [] and unsupported_moe(model) == ["1", "2"]
    cm = autopar.api.cost_model(model, "1x2xA100-80GB", (x,), y, torch.nn.functional.mse_loss)
    layers = experts.find_moe(cm.graph)
    assert layers and not any(m.supported for m in layers)
    assert experts.candidates(cm) == [1]
    est = price_strategy(cm, Strategy(dp=2))
    assert est.plan.experts["degree"] == 1 and est.plan.experts["replicated"] == [m.module for m in layers]
    with pytest.raises(PlanError, match="none of the model's MoE layers"):
        price_strategy(cm, Strategy(dp=2, ep=2))


def test_explain_names_the_expert_placement(small_cm: dict) -> None:
    est = price_strategy(small_cm["1x2xA100-80GB"], Strategy(dp=2, ep=2))
    assert "experts: ep=2, 2 of 4 experts (top-2) per device in groups [[0, 1]]" in est.plan.explain()


def test_mixtral_experts_are_found_routed_and_supported() -> None:
    pytest.importorskip("transformers")
    c = models.hf_mixtral(layers=2, batch=2, experts=4, top_k=2)
    cm = autopar.api.cost_model(c.model, "1x2xA100-80GB", c.example_inputs, c.example_target, c.loss_fn)
    layers = experts.find_moe(cm.graph)
    assert [m.module for m in layers] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    m = layers[0]
    assert (m.experts, m.top_k, m.hidden, m.tokens, m.dense, m.supported) == (4, 2, 64, 2 * 16, False, True)
    base = {ep: experts.with_degree(cm, ep).base(0, cm.L, "A100-80GB", 2, (0,)) for ep in (1, 2)}
    assert base[1].params - base[2].params == sum(m.params for m in layers) // 2
