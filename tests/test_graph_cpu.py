"""Issue #26 part 3: cpu devices beside accelerators work too.

* full graph: on a T4 + cpu cluster the planner gives the cpu rank a part sized to its speed (smaller than
  the T4's, the two ranks' priced compute balanced, the step faster than with the cpu idle), and 2 gloo ranks
  trained with that plan equal one process on the whole graph (fp32, 3 AdamW steps, every loss and
  parameter); beside an A100 the same cpu is left idle with its reason;
* sampled_pipeline: on 2 'A100' ranks + 1 or 2 cpu ranks the cpu ranks sample and gather every mini-batch (counted
  by patching the sampler in every rank) and the A100 ranks, which sample nothing, train: their losses and
  parameters equal one process training model(x, sampled_graph(...)) on the same seeds; the sampler's model
  is never updated, until eval_step / save hand it the trainers' (the checkpoint, written by a trainer, loads
  into the plain model as the reference's state); priced as the slowest pipeline stage; a cluster without both
  kinds is a clear error.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import autopar
from autopar.cluster import Cluster
from autopar.errors import PlanError
from autopar.graphs.cost import GraphCostModel
from autopar.graphs.data import clustered_graph
from autopar.graphs.models import GRAPH_CASES, PyGNet
from autopar.graphs.planner import graph_stats, plan_graph
from autopar.model_case import ModelCase, train_reference
from autopar.runtime.checkpoint import load_into_model
from autopar.runtime.launch import spawn_local

from .runtime_cases import assert_matches_reference
from .test_graphs import optimizer, train_sampled_reference

pytest.importorskip("torch_geometric")

STEPS = 3
# wide enough that compute, not kernel launches, sets the step: the cpu's part pays for itself beside a T4
NODES, FEATURES, HIDDEN = 2000, 256, 64
T4_CPU = {"nodes": [{"device": "T4"}, {"device": "cpu"}]}
A100_CPU = {"nodes": [{"device": "A100-80GB"}, {"device": "cpu"}]}
PIPE_CLUSTER = "1x2xA100-80GB+1x1xcpu"  # ranks 0, 1: A100 (trainers); rank 2: cpu (sampler)
PIPE = {"mode": "sampled_pipeline", "batch_size": 48, "fanout": 3, "seed": 5}
PIPE_STEPS = 4


def full_case() -> ModelCase:
    g = clustered_graph(NODES, 8, 4.0, FEATURES, 4, seed=0, labelled=0.8)
    torch.manual_seed(0)
    return ModelCase(PyGNet("sage", FEATURES, HIDDEN, 2, 4), (g.x, g.edge_index), F.cross_entropy, g.y, "sage")


def pipe_case() -> ModelCase:
    return GRAPH_CASES["sage"](seed=0, nodes=1000, avg_degree=4.0, labelled=0.8)


def test_cpu_owns_a_part_sized_to_its_speed() -> None:
    case = full_case()
    plan = plan_graph(case.model, T4_CPU, case.example_inputs, case.example_target, precision="fp32")
    g = plan.graph
    t4, cpu = g["shares"]
    assert g["mode"] == "partition" and g["idle"] == [] and 0 < cpu < t4, g["shares"]
    compute = g["candidates"]["partition"]["compute_s"]
    assert max(compute) / min(compute) < 1.3, f"the two ranks' priced compute should balance: {compute}"
    # a part for the cpu shortens the predicted step against the same cluster with the cpu idle
    x, edge_index = case.example_inputs
    cost = GraphCostModel(case.model, graph_stats(x, edge_index, case.example_target), Cluster.load(T4_CPU), "fp32")
    alone = cost._price_partition([NODES, 0], None)
    alone_step = max(alone[2]) + cost._halo_comm(alone[1]) + cost.sync_s
    assert plan.predicted["step_time_s"] < alone_step


def test_a_share_the_idle_check_prices_faster_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both balancers made to leave the cpu out: the idle check's faster priced share for it is adopted, so no
    device stays idle with reason 'balance' (a faster plan the planner knew of)."""
    import autopar.graphs.cost as cost_module

    def without_cpu(fn):  # noqa: ANN001, ANN202 (a wrapper for either balancer)
        def wrapped(total, *args):  # noqa: ANN001, ANN202
            *rest, caps = args
            return fn(total, *rest, [c if d == 0 else 0.0 for d, c in enumerate(caps)])
        return wrapped

    monkeypatch.setattr(cost_module, "balanced_shares", without_cpu(cost_module.balanced_shares))
    original = GraphCostModel._level_shares
    monkeypatch.setattr(GraphCostModel, "_level_shares",
                        lambda self, total, caps, scale: without_cpu(lambda t, c: original(self, t, c, scale))(
                            total, caps))
    case = full_case()
    plan = plan_graph(case.model, T4_CPU, case.example_inputs, case.example_target, precision="fp32")
    assert plan.graph["shares"][1] > 0 and plan.graph["idle"] == [], (plan.graph["shares"], plan.graph["idle"])


def test_cpu_beside_a_faster_accelerator_is_idle_with_its_reason() -> None:
    case = full_case()
    plan = plan_graph(case.model, A100_CPU, case.example_inputs, case.example_target, precision="fp32")
    assert plan.graph["shares"][1] == 0
    (idle,) = plan.graph["idle"]
    assert idle["device"] == 1 and idle["type"] == "cpu" and idle["why"] in ("no_gain", "slower")
    assert "cpu device 1 gets no nodes" in plan.explain()


def train_full_graph(rank: int, world: int) -> tuple:
    case = full_case()
    prog = autopar.compile(case.model, T4_CPU, case.example_inputs, case.example_target, case.loss_fn,
                           optimizer=optimizer, timeout_s=120, precision="fp32")
    losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(STEPS)]
    return losses, prog.state_dict()["model"], prog.plan.graph["shares"]


@pytest.mark.timeout(600)
def test_cpu_and_accelerator_partitions_train_like_one_process() -> None:
    results = spawn_local(train_full_graph, 2, timeout_s=300)
    ref_losses, ref_state = train_reference(full_case(), optimizer, STEPS)
    shares = results[0][2]
    assert 0 < shares[1] < shares[0], f"the cpu rank should own a smaller part: {shares}"
    for rank, (losses, state, _) in enumerate(results):
        assert_matches_reference(losses, state, ref_losses, ref_state, f"rank {rank}")
    assert ref_losses[-1] != ref_losses[0]


def train_pipeline(rank: int, world: int, cluster: str, ckpt: str) -> tuple:
    from autopar.graphs import sampling

    calls = {"sample": 0}
    original = sampling.InEdges.sample

    def counted(self: sampling.InEdges, *args: object, **kwargs: object) -> tuple:
        calls["sample"] += 1
        return original(self, *args, **kwargs)

    sampling.InEdges.sample = counted  # every caller of the sampler in this process
    case = pipe_case()
    prog = autopar.compile(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn,
                           optimizer=optimizer, timeout_s=120, precision="fp32", graph_options=PIPE)
    losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(PIPE_STEPS)]
    trained = prog.state_dict()["model"]  # before eval_step / save hand the trainers' model to the sampler
    out = prog.eval_step(*case.example_inputs)
    prog.save(ckpt)
    return losses, trained, calls["sample"], prog.plan.graph, prog.what_runs(), out, prog.state_dict()["model"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cpus", [1, 2])
def test_cpu_ranks_sample_for_accelerator_ranks_like_one_process(tmp_path: Path, cpus: int) -> None:
    cluster = f"1x2xA100-80GB+1x{cpus}xcpu"  # ranks 0, 1: A100 (trainers); ranks 2..: cpu (samplers)
    results = spawn_local(train_pipeline, 2 + cpus, cluster, str(tmp_path / "ckpt"), timeout_s=300)
    graph = results[0][3]
    samplers = list(range(2, 2 + cpus))
    assert graph["mode"] == "sampled_pipeline" and graph["samplers"] == samplers and graph["trainers"] == [0, 1]
    ref_losses, ref_state = train_sampled_reference(pipe_case(), PIPE, PIPE_STEPS)
    for rank in graph["trainers"]:
        losses, state, calls = results[rank][:3]
        assert calls == 0, f"trainer rank {rank} sampled {calls} times"
        assert_matches_reference(losses, state, ref_losses, ref_state, f"rank {rank}")
    untrained = pipe_case().model.state_dict()
    for rank in samplers:
        losses, state, calls, _, what, out, shared = results[rank]
        # every layer of its trainers' batches of every step, and the next step's sampled ahead
        fed = 2 // cpus
        assert calls == 2 * fed * (PIPE_STEPS + 1), f"sampler rank {rank} sampled {calls} times"
        assert all(math.isnan(v) for v in losses) and "samples and gathers" in what
        assert all(torch.equal(state[k], v) for k, v in untrained.items()), "a sampler's model should not train"
        # eval_step and save hand the trainers' model to the sampler; the checkpoint holds the trained model
        for k, v in results[0][1].items():
            assert torch.equal(shared[k], v), f"sampler rank {rank} param {k} after eval_step"
        assert torch.equal(out, results[0][5]) and torch.equal(out, results[1][5])
    model = pipe_case().model
    opt = optimizer(list(model.parameters()))
    assert load_into_model(model, tmp_path / "ckpt", opt) == PIPE_STEPS
    assert len(opt.state) == len(list(model.parameters())), "the checkpoint should hold a trainer's AdamW state"
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, ref_state[k], rtol=1e-4, atol=1e-5, msg=f"checkpoint param {k}")
    assert ref_losses[-1] != ref_losses[0]


def test_pipeline_is_priced_as_its_slowest_stage() -> None:
    case = pipe_case()
    plan = autopar.plan(case.model, PIPE_CLUSTER, case.example_inputs, case.example_target, case.loss_fn,
                        precision="fp32", graph_options=PIPE)
    g = plan.graph
    assert g["shares"] == [24, 24, 0] and g["sampler_of"] == {"0": 2, "1": 2}
    stages = g["stages"]
    assert set(stages) == {"sample_s", "transfer_s", "train_s"} and min(stages.values()) > 0
    assert plan.predicted["step_time_s"] == pytest.approx(max(stages.values()))
    assert "cpu ranks [2] sample and gather" in plan.explain()
    # two cpu ranks feed two trainers one each
    two = plan_graph(case.model, "1x2xA100-80GB+1x2xcpu", case.example_inputs, case.example_target,
                     precision="fp32", options=PIPE)
    assert two.graph["sampler_of"] == {"0": 2, "1": 3} and two.graph["shares"][2:] == [0, 0]


@pytest.mark.parametrize("cluster, has", [("1x2xA100-80GB", "no cpu devices"), ("1x2xcpu", "only cpu devices")])
def test_pipeline_without_both_kinds_is_a_clear_error(cluster: str, has: str) -> None:
    case = pipe_case()
    with pytest.raises(PlanError, match=f"needs cpu devices beside accelerators.*{has}.*sampled_dp"):
        autopar.plan(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn,
                     precision="fp32", graph_options=PIPE)


def test_sampled_dp_on_a_mixed_cluster_prices_the_pipeline_beside_it() -> None:
    case = pipe_case()
    args = (case.model, PIPE_CLUSTER, case.example_inputs, case.example_target, case.loss_fn)
    dp = autopar.plan(*args, precision="fp32", graph_options={**PIPE, "mode": "sampled_dp"})
    pipe = autopar.plan(*args, precision="fp32", graph_options=PIPE)
    assert dp.graph["mode"] == "sampled_dp" and set(dp.graph["candidates"]) == {"partition", "sampled_dp",
                                                                                 "sampled_pipeline"}
    # the same mini-batch priced the same way whichever of the two was asked for
    for m in ("sampled_dp", "sampled_pipeline"):
        assert dp.graph["candidates"][m]["step_time_s"] == pytest.approx(pipe.graph["candidates"][m]["step_time_s"])
    faster = pipe.predicted["step_time_s"] < dp.predicted["step_time_s"]
    assert (f"sampled_pipeline (the same sampled algorithm, {'faster' if faster else 'not faster'} on this "
            f"cluster: cpu ranks sample for the accelerator ranks") in dp.explain()
    assert "sampled_pipeline" not in autopar.plan(case.model, "1x2xA100-80GB", case.example_inputs,
                                                  case.example_target, case.loss_fn, precision="fp32",
                                                  graph_options={**PIPE, "mode": "sampled_dp"}).graph["candidates"]
