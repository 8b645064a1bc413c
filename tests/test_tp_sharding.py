"""The runtime runs the tensor-parallel sharding the planner's intra-op ILP chose (`Stage.sharding`).

Single process: the sharding a plan records for its blocks is the ILP's own solution (its parameter
layouts; DTensor's propagation, as `runtime_choice` models it, reaches the ILP's strategies from them, so
the price is the ILP's optimum), it round-trips through JSON and reaches the runtime's layout. Two gloo
ranks: plans with ILP shardings that differ from Megatron's train like one process (fp32, 3 AdamW steps).
"""

from __future__ import annotations

from typing import Any

import pytest

import autopar
from autopar.cluster import Cluster
from autopar.ir.plan import Plan
from autopar.lowering import layout_of
from autopar.runtime.launch import spawn_local
from autopar.runtime.program import Program
from autopar.solver.intra_op import pricing as iop
from autopar.solver.intra_op.ilp import solve_problems
from autopar.solver.intra_op.intra_op import _build

from .runtime_cases import assert_matches_reference, build, optimizer, plan_for, reference, train_observing

RTOL, ATOL = 1e-4, 1e-5
FAST = Cluster.load("1x4xA100-80GB")
# Slow devices on a fast link: sharding pays even for tiny blocks, and the ILP makes every linear of a GPT
# block column-parallel (Megatron makes the projections row-parallel).
SLOW_DEVICE = "Jetson-Xavier-NX-8GB"
SLOW = Cluster.load({"nodes": [{"device": SLOW_DEVICE, "devices_per_node": 4,
                                "intra_node": {"bandwidth_GBps": 1000, "latency_us": 0.01}}]})


def _plan(name: str, kwargs: dict, cluster: Cluster, tp: int) -> Plan:
    case = build(name, **kwargs)
    est = autopar.estimate(case.model, cluster, autopar.Strategy(tp=tp, dp=4 // tp), case.example_inputs,
                           case.example_target, case.loss_fn, precision="fp32")
    return est.plan


def _ilp_sharding(cm: Any, block: int, tp: int, n: int) -> tuple[dict[str, str], tuple, tuple, float]:
    """The ILP's own optimum for one block in runtime mode: its parameter placements (as Stage.sharding
    entries), its strategy per group, the strategies DTensor's propagation reaches from those placements,
    and the ILP cost model's seconds of the latter."""
    dtype = cm.cluster.devices[0].spec.name
    pricer = iop.LayerPricer(cm.graph, tp, dtype, cm.cluster, list(range(tp)))
    ctx, layer = pricer._at(n), cm.graph.layers[block]
    (choice,) = solve_problems([(pricer.problem(ctx, layer), 1)], None, 10.0)
    groups = iop._merge_followers(ctx, [x for x in layer.nodes if cm.graph.nodes[x].outputs])
    layouts = iop.param_layouts(ctx, groups, choice)
    reached = iop.runtime_choice(ctx, layer, groups, layouts)
    ctx.forbid = False
    seconds = _build(ctx, layer, -1).breakdown(reached).seconds
    return iop.sharding_of(ctx, layer, layouts), choice, reached, seconds


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("cluster", [SLOW, FAST], ids=["slow-device", "fast-device"])
def test_recorded_sharding_is_the_ilp_solution(tp: int, cluster: Cluster) -> None:
    from autopar.api import cost_model
    from autopar.solver.pricing.pricing import tp_layer_cost

    case = build("gpt", layers=2, batch=4)
    cm = cost_model(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn,
                    precision="fp32")
    plan = _plan("gpt", {"layers": 2, "batch": 4}, cluster, tp)
    blocks = [layer.index for layer in cm.graph.layers if layer.kind == "block"]
    for pipe in plan.pipelines:
        for st in pipe.stages:
            assert st.predicted["tp_source"] == "ilp"
            expected: dict[str, str] = {}
            for b in blocks:
                if st.layers[0] <= b < st.layers[1]:
                    sharding, choice, reached, seconds = _ilp_sharding(cm, b, tp, pipe.microbatch_size)
                    assert reached == choice  # propagation runs exactly the ILP's strategies
                    expected.update(sharding)
                    c = tp_layer_cost(cm, b, cm.cluster.devices[0].spec.name, pipe.microbatch_size,
                                      tuple(st.devices))
                    assert c.fwd + c.bwd + c.fwd_comm + c.bwd_comm == pytest.approx(seconds, rel=1e-9)
            assert st.sharding == expected
    pricer = iop.LayerPricer(cm.graph, tp, cm.cluster.devices[0].spec.name, cm.cluster, list(range(tp)))
    layer = cm.graph.layers[blocks[0]]
    megatron = iop.sharding_of(pricer.ctx, layer, iop.megatron_layouts(pricer.ctx, layer))
    mine = {k: v for k, v in plan.pipelines[0].stages[0].sharding.items() if k in megatron}
    assert mine != megatron  # on both clusters the ILP's choice is not Megatron's
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.pipelines[0].stages[0].sharding == plan.pipelines[0].stages[0].sharding
    lay = layout_of(again, len(cm.graph.layers))
    assert dict(lay.pipelines[0].stages[0].sharding) == plan.pipelines[0].stages[0].sharding


def test_sharding_none_without_ilp() -> None:
    """Closed-form pricing (the ILP switched off) records no sharding: the runtime runs Megatron's."""
    from autopar.api import cost_model
    from autopar.ir.plan import plan_from_strategy
    from autopar.solver.pricing.pricing import model_summary, price

    case = build("gpt", layers=2, batch=4)
    cm = cost_model(case.model, FAST, case.example_inputs, case.example_target, case.loss_fn, precision="fp32")
    cm.intra_op = False
    skeleton = plan_from_strategy(autopar.Strategy(tp=2, dp=2), world_size=4, global_batch=cm.B, num_layers=cm.L,
                                  first_block=cm.first_block, num_blocks=cm.num_blocks, precision=cm.precision,
                                  optimizer=cm.optimizer, cluster=cm.cluster.to_dict(),
                                  model=model_summary(cm.graph), memory_reserve=cm.reserve)
    plan = price(cm, skeleton).plan
    assert {st.predicted["tp_source"] for p in plan.pipelines for st in p.stages} == {"closed_form"}
    assert all(st.sharding is None for p in plan.pipelines for st in p.stages)


def test_bad_sharding_is_a_clear_error() -> None:
    from autopar.errors import PlanError
    from autopar.runtime.tensor_parallel import parse_placement, sharding_spec

    g = autopar.capture(*(lambda c: (c.model, c.example_inputs, c.loss_fn, c.example_target))(build("gpt")))
    with pytest.raises(PlanError, match="shard"):
        parse_placement("column")
    with pytest.raises(PlanError, match="does not have"):
        sharding_spec(g, (0, len(g.layers)), {"no.such.weight": "replicate"})


# ---- two gloo ranks -----------------------------------------------------------------------------------


def _layout_name(x: Any) -> str:
    from torch.distributed.tensor import Replicate, Shard

    return "R" if isinstance(x, Replicate) else f"S({x.dim})" if isinstance(x, Shard) else "P"


def _train(rank: int, world: int, cases: list[tuple[str, dict, dict[str, str]]]) -> list[tuple]:
    """Worker: train each case at tp=world with its stage sharding; losses, final state, local shapes, and
    the layout of every DTensor value the first forward computed (after the runtime's re-layouts)."""
    from torch.distributed.tensor import DTensor

    from autopar.runtime import tensor_parallel

    original = tensor_parallel._TPInterpreter.run_node
    out = []
    for name, kwargs, sharding in cases:
        placed: dict[str, str] = {}

        def run_node(self: Any, n: Any, placed: dict = placed) -> Any:
            value = original(self, n)
            if isinstance(value, DTensor):
                placed.setdefault(n.name, _layout_name(value.placements[0]))
            return value

        case = build(name, **kwargs)
        g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
        prog = Program(case.model, plan_for(g, world, {"tp": world, "sharding": sharding}), case.example_inputs,
                       case.example_target, case.loss_fn, optimizer, rank, world, timeout_s=60, graph=g)
        shapes = {k: tuple(getattr(v, "_local_tensor", v).shape) for k, v in prog.params.items()}
        losses = train_observing(prog, case, run_node)
        relayout = {k: _layout_name(v) for k, v in prog.tp.spec.relayout.items()}
        out.append((losses, prog.state_dict()["model"], shapes, placed, relayout))
    return out


CASES = [("gpt", {"layers": 2, "batch": 4}), ("gpt", {"layers": 2, "batch": 4}),
         ("hf_llama", {"layers": 2, "batch": 4}), ("hf_gpt2", {"layers": 2, "batch": 4})]
CLUSTERS = [SLOW, FAST, SLOW, SLOW]


def _cases() -> list[tuple[str, dict, dict[str, str]]]:
    cases = []
    for (name, kwargs), cluster in zip(CASES, CLUSTERS, strict=True):
        (st,) = _plan(name, kwargs, cluster, 2).pipelines[0].stages
        assert st.sharding, f"{name}: the planner recorded no sharding"
        cases.append((name, kwargs, st.sharding))
    return cases


def _priced_layouts(name: str, kwargs: dict, cluster: Cluster, sharding: dict[str, str]) -> dict[str, str]:
    """Node -> the output layout of the strategy the plan priced for it (`runtime_choice`), block layers."""
    from autopar.api import cost_model

    case = build(name, **kwargs)
    cm = cost_model(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn,
                    precision="fp32")
    pricer = iop.LayerPricer(cm.graph, 2, cluster.devices[0].spec.name, cluster, [0, 1])
    ctx = pricer._at(cm.B)
    layouts = {p: -1 if sharding[cm.graph.canonical(p)] == "replicate" else int(sharding[cm.graph.canonical(p)][6:-1])
               for p in cm.graph.params if cm.graph.canonical(p) in sharding}
    out = {}
    for layer in cm.graph.layers:
        if layer.kind != "block":
            continue
        groups = iop._merge_followers(ctx, [x for x in layer.nodes if cm.graph.nodes[x].outputs])
        for grp, i in zip(groups, iop.runtime_choice(ctx, layer, groups, layouts), strict=True):
            out.update((m, _layout_name_int(s.base.out)) for m, s in grp.choices[i].items())
    return out


def _layout_name_int(layout: int) -> str:
    return "R" if layout == -1 else "P" if layout == -2 else f"S({layout})"


@pytest.fixture(scope="module")
def trained() -> tuple[list, list]:
    pytest.importorskip("transformers")
    cases = _cases()
    return cases, spawn_local(_train, 2, cases, timeout_s=240)


@pytest.mark.parametrize("index", range(4), ids=["gpt-slow-device", "gpt-replicated", "llama", "hf_gpt2-conv1d"])
def test_ilp_sharding_trains_like_one_process(trained: tuple[list, list], index: int) -> None:
    cases, results = trained
    name, kwargs, sharding = cases[index]
    ref_losses, ref_params = reference(name, kwargs)
    full = dict(build(name, **kwargs).model.named_parameters())
    priced = _priced_layouts(name, kwargs, CLUSTERS[index], sharding)
    for rank, (losses, params, shapes, placed, relayout) in enumerate(r[index] for r in results):
        # every block value DTensor computed has the layout the plan priced (or the runtime re-laid it out)
        ran = {k: v for k, v in placed.items() if k in priced}
        assert len(ran) > len(priced) // 2, sorted(placed)
        assert {k: relayout.get(k, priced[k]) for k in ran} == ran
        assert_matches_reference(losses, params, ref_losses, ref_params, f"rank {rank}")
        for k, placement in sharding.items():  # each rank holds the shard the plan says
            want = list(full[k].shape)
            if placement != "replicate":
                want[int(placement[6:-1])] //= 2
            assert list(shapes[k]) == want, (k, placement)
    assert ref_losses[-1] < ref_losses[0]


def _column_parallel(rank: int, world: int) -> list[dict]:
    """A column-parallel addmm (Conv1D weight (in, out) sharded on out) reading a feature-sharded activation,
    as the interpreter runs it, plain and inside a recomputed block's checkpoint; 2 micro-batches."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.utils.checkpoint import checkpoint

    from autopar.runtime.tensor_parallel import _column_parallel_input

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(6, 8, generator=g) for _ in range(2)]
    w0, b0 = torch.randn(8, 4, generator=g), torch.randn(4, generator=g)
    out = []
    for recompute in (False, True):
        w = torch.nn.Parameter(DTensor.from_local(w0.clone(), mesh, [Replicate()]).redistribute(mesh, [Shard(1)]))
        b = torch.nn.Parameter(DTensor.from_local(b0.clone(), mesh, [Replicate()]).redistribute(mesh, [Shard(0)]))
        saved: list[tuple[int, ...]] = []

        def run(x: DTensor, w: DTensor = w, b: DTensor = b) -> DTensor:
            args, saving = _column_parallel_input(torch.ops.aten.addmm.default, (b, x, w))
            with saving:
                return torch.ops.aten.addmm.default(*args).tanh()

        grad_placements = []
        w.register_hook(lambda grad, seen=grad_placements: seen.append(str(grad.placements[0])) or grad)
        for x in xs:
            xd = DTensor.from_local(x.clone(), mesh, [Replicate()]).redistribute(mesh, [Shard(1)]).requires_grad_()
            with torch.autograd.graph.saved_tensors_hooks(
                    lambda t, saved=saved: saved.append(tuple(getattr(t, "_local_tensor", t).shape)) or t,
                    lambda t: t):
                y = checkpoint(run, xd, use_reentrant=False) if recompute else run(xd)
            y.full_tensor().pow(2).sum().backward()
        out.append({"w": w.grad.full_tensor(), "b": b.grad.full_tensor(), "saved": saved,
                    "grad_placements": grad_placements, "w_grad_placement": str(w.grad.placements[0])})
    return out


def test_a_column_parallel_linear_saves_its_input_shard_and_keeps_its_weights_gradient_layout() -> None:
    """The op saves the activation's shard (what the ILP prices) and gathers it again in the backward; its
    weight gradient comes out Shard(1), as the weight (DTensor alone made it Shard(0), redistributed every
    micro-batch). Same gradients as one process, with and without a recomputed block around it."""
    import torch

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(6, 8, generator=g) for _ in range(2)]
    w = torch.randn(8, 4, generator=g).requires_grad_()
    b = torch.randn(4, generator=g).requires_grad_()
    for x in xs:
        torch.addmm(b, x, w).tanh().pow(2).sum().backward()
    for rank_results in spawn_local(_column_parallel, 2, timeout_s=120):
        for r in rank_results:
            torch.testing.assert_close(r["w"], w.grad, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(r["b"], b.grad, rtol=1e-5, atol=1e-6)
            assert r["grad_placements"] == ["S(1)", "S(1)"], r["grad_placements"]
            assert (6, 8) not in r["saved"] and (6, 4) in r["saved"], r["saved"]  # the shard, never the gather
