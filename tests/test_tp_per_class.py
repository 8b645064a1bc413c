"""A tensor-parallel degree per pipeline class: fast devices at tp 2 beside slow ones at tp 1.

On 4 gloo ranks: pipeline 0 runs on ranks (0, 1) at tp 2, pipelines 1 and 2 on ranks 2 and 3 at tp 1
(and, in a second case, one 2-stage pipeline on ranks 2 and 3), with uneven batch shares; training equals
one process and the tp 2 ranks hold shards. Pricing: such a plan on 2 A100 + 2 T4 prices, and its
gradient sync is what the runtime runs when peers differ in tp (runtime/zero.py): whole gradients
all-reduced among the groups' first ranks, after the tp 2 group gathers them and before it broadcasts.
"""

from __future__ import annotations

import pytest

from autopar.cost_models.comm import collective_time
from autopar.ir.plan import Pipeline, Plan, Stage
from autopar.runtime.launch import spawn_local
from autopar.solver.pricing.model import Option
from autopar.solver.pricing.pricing import model_summary, price

from .runtime_cases import (
    assert_ranks_match_reference,
    assert_work_split,
    build,
    run_cases,
)
from .test_planner import cm_for

GPT = ("gpt", {"layers": 4, "batch": 8})
CASES = [
    (*GPT, {"pipelines": [{"batch": 4, "m": 2, "stages": [(4, (0, 1))]},
                          {"batch": 3, "m": 1, "stages": [(4, (2,))]},
                          {"batch": 1, "m": 1, "stages": [(4, (3,))]}]}),
    (*GPT, {"pipelines": [{"batch": 5, "m": 1, "stages": [(4, (0, 1))]},
                          {"batch": 3, "m": 3, "stages": [(2, (2,)), (2, (3,))]}]}),
    # one pipeline whose stages differ in tp (the search's "mixed" groupings with a tp per device type)
    (*GPT, {"pipelines": [{"batch": 8, "m": 4, "stages": [(2, (0, 1)), (1, (2,)), (1, (3,))]}]}),
]


@pytest.fixture(scope="module")
def results() -> list:
    return spawn_local(run_cases, 4, CASES, timeout_s=300)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_mixed_tp_trains_like_one_process(results: list, index: int) -> None:
    name, kwargs, spec = CASES[index]
    assert_ranks_match_reference(results, index, name, kwargs, f"case {index} ")
    full = build(name, **kwargs).model.state_dict()
    works = [r[index][2] for r in results]
    assert_work_split(works, spec, kwargs["batch"], full)
    # the tp 2 ranks hold shards of the block matrices, the tp 1 ranks whole ones
    for rank in (0, 1):
        assert any(shape != tuple(full[k].shape) for k, shape in works[rank]["params"].items())
    for rank in (2, 3):
        assert all(shape == tuple(full[k].shape) for k, shape in works[rank]["params"].items())


def _mixed_plan(cm):  # noqa: ANN001, ANN202
    L = cm.L
    pipes = [Pipeline(4, 2, 2, [Stage([0, L], [0, 1])]), Pipeline(2, 1, 2, [Stage([0, L], [2])]),
             Pipeline(2, 1, 2, [Stage([0, L], [3])])]
    return Plan(cm.B, cm.precision, cm.optimizer, "1f1b", 1, cm.cluster.to_dict(), model_summary(cm.graph), pipes,
                {}, cm.reserve)


def test_mixed_tp_plan_is_priced_with_the_runtime_sync() -> None:
    cm = cm_for("1x2xA100-80GB+1x2xT4", layers=4, batch=8)
    priced = price(cm, _mixed_plan(cm))
    assert priced.fits
    pr = priced.plan.predicted
    assert sorted(pr["peak_memory_bytes"]) == [0, 1, 2, 3] and pr["idle_devices"] == {}
    fast, slow = priced.plan.pipelines[0].stages[0], priced.plan.pipelines[1].stages[0]
    assert fast.tp == 2 and slow.tp == 1
    # independently of the pricing: whole fp32 gradients (4 bytes per parameter) all-reduced over the first
    # ranks (0, 2, 3), and the tp 2 group's gather and broadcast of them (an all-gather's bytes each)
    grads = 4.0 * cm.graph.num_params()
    reps = collective_time("all_reduce", grads, (0, 2, 3), cm.cluster)
    inner = collective_time("all_gather", grads, (0, 1), cm.cluster)
    assert fast.predicted["sync_s"] >= reps + 2 * inner
    assert slow.predicted["sync_s"] >= reps
    assert pr["step_time_s"] >= max(s.predicted["compute_s"] for p in priced.plan.pipelines for s in p.stages)


def test_one_tp_degree_is_priced_with_the_runtime_sync_too() -> None:
    """dp 2 x tp 2 (one degree everywhere): runtime/zero.py syncs those gradients the same way, whole tensors
    among the groups' first ranks (not one all-reduce of shards per tp rank), and the price says so."""
    cm = cm_for("1x4xA100-80GB", layers=4, batch=8)
    L = cm.L
    pipes = [Pipeline(4, 2, 2, [Stage([0, L], [0, 1])]), Pipeline(4, 2, 2, [Stage([0, L], [2, 3])])]
    plan = Plan(cm.B, cm.precision, cm.optimizer, "1f1b", 1, cm.cluster.to_dict(), model_summary(cm.graph), pipes,
                {}, cm.reserve)
    stage = price(cm, plan).plan.pipelines[0].stages[0]
    base = cm.base(0, L, "A100-80GB", 2, (0, 1))
    whole = cm.stage_times(base, Option(), "A100-80GB", (0, 1), (0, 2), mixed_tp=True).sync
    shards = cm.options_times(base, [Option()], "A100-80GB", (0, 1), (0, 2))[0].sync
    assert stage.tp == 2 and stage.predicted["sync_s"] == pytest.approx(whole)
    assert shards == pytest.approx(whole)  # one degree or several: the same runtime path, the same price


def test_megatron_shard_sync_is_priced_only_when_asked() -> None:
    """bench/measured.py prices Megatron-LM runs, whose tp ranks each all-reduce their own shard with the same
    shard of every replica: `tp_dp_sync="shards"` prices that (less than the whole-tensor sync autopar runs);
    autopar's own plans keep "whole"."""
    from autopar.errors import PlanError
    from autopar.solver.pricing.pricing import CostModel

    cm = cm_for("1x4xA100-80GB", layers=4, batch=8)
    megatron = CostModel(cm.graph, cm.cluster, cm.precision, cm.optimizer, cm.reserve, tp_dp_sync="shards")
    sync = {}
    for name, c in (("whole", cm), ("shards", megatron)):
        base = c.base(0, c.L, "A100-80GB", 2, (0, 1))
        sync[name] = c.options_times(base, [Option()], "A100-80GB", (0, 1), (0, 2))[0].sync
    assert cm.tp_dp_sync == "whole" and 0 < sync["shards"] < sync["whole"]
    with pytest.raises(PlanError, match="tp_dp_sync='halves'"):
        CostModel(cm.graph, cm.cluster, cm.precision, cm.optimizer, cm.reserve, tp_dp_sync="halves")


def test_megatron_runs_are_priced_with_megatron_lm_s_own_sharding() -> None:
    """Pricing Megatron-LM's runs (`tp_dp_sync="shards"`, bench/measured.py), a tp rank holds 1/tp of every
    layer's parameters, as Megatron-LM shards them (a fused QKV by heads, vocabulary-parallel tables); autopar's
    own closed form holds them as its runtime places them (`megatron_param_frac`: a GPT block's fused QKV whole).
    With the runtime's share the Sailor runs' data-parallel sync was priced 2.5x (N6_D6: 54 s against 21 s)."""
    from autopar.solver.intra_op.pricing import closed_form, megatron_param_frac
    from autopar.solver.pricing.pricing import CostModel

    cm = cm_for("1x4xA100-80GB", layers=2, batch=8)
    cm = CostModel(cm.graph, cm.cluster, cm.precision, cm.optimizer, cm.reserve, intra_op=False)
    megatron = CostModel(cm.graph, cm.cluster, cm.precision, cm.optimizer, cm.reserve, intra_op=False,
                         tp_dp_sync="shards")
    block = next(i for i, layer in enumerate(cm.graph.layers) if layer.kind == "block")
    own = megatron_param_frac(cm.graph, block, 4)
    assert own > 1 / 4  # the runtime keeps part of the block whole
    assert closed_form(cm, block, "A100-80GB", 2, (0, 1, 2, 3)).param_frac == pytest.approx(own)
    assert closed_form(megatron, block, "A100-80GB", 2, (0, 1, 2, 3)).param_frac == pytest.approx(1 / 4)


def test_the_closed_form_holds_every_layer_as_the_runtime_places_it() -> None:
    """Every layer's share under the closed form (the LM head and the embedding vocabulary-parallel, found from
    the loss heads the cost model reads once) is the share of the runtime's own placements, found from the graph
    alone (`megatron_placements` without `heads`), the embedding and head included."""
    from autopar.passes.tp_patterns import megatron_placements
    from autopar.solver.intra_op.pricing import closed_form, layer_params
    from autopar.solver.pricing.pricing import CostModel

    cm = cm_for("1x4xA100-80GB", layers=2, batch=8)
    cm = CostModel(cm.graph, cm.cluster, cm.precision, cm.optimizer, cm.reserve, intra_op=False)
    g = cm.graph
    vocab_parallel = 0
    for i, layer in enumerate(g.layers):
        sharded = megatron_placements(g, (i, i + 1)).params
        sizes = [(g.params[p].meta.nbytes, name in sharded) for p, name in layer_params(g, layer)]
        total = sum(b for b, _ in sizes)
        expected = sum(b / 4 if s else b for b, s in sizes) / total if total else 1 / 4
        assert closed_form(cm, i, "A100-80GB", 2, (0, 1, 2, 3)).param_frac == pytest.approx(expected), i
        vocab_parallel += layer.kind != "block" and any(s for _, s in sizes)
    assert vocab_parallel  # the embedding or the head is sharded: the loss heads were read
