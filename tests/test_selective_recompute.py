"""Selective recompute: a stage recomputes its first k repeated blocks (`Stage.recompute = k`).

One spawn of 2 gloo processes trains every case against one process: a 2-stage pipeline and a
tensor-parallel stage recomputing some of their blocks, and a GPipe data-parallel GPT at k = 0..4 of its 4
blocks whose per-rank peak of live tensor bytes over two training steps is measured at the allocator
(runtime/memtrace.py): it must fall with every block recomputed. Then the pricing side: predicted memory
falls and predicted time rises with k, k = all prices exactly as recompute=True, and bad k are refused.
"""

from __future__ import annotations

import gc
import json
from typing import Any

import pytest

import autopar
from autopar import models
from autopar.errors import PlanError
from autopar.ir.plan import Plan, Strategy
from autopar.lowering import lower
from autopar.runtime.launch import spawn_local
from autopar.runtime.layered import layer_calls
from autopar.runtime.memtrace import track_memory
from autopar.solver.pricing.pricing import price, price_strategy

from .runtime_cases import STEPS, assert_matches_reference, compile_case, plan_for, reference
from .test_planner import cm_for

GPT = ("gpt", {"layers": 4, "batch": 8})
CASES: dict[str, tuple[str, dict, dict]] = {
    "pp2-first1": (*GPT, {"pp": 2, "m": 2, "recompute": 1}),  # 2 blocks per stage, the first recomputed
    "tp2-first3": (*GPT, {"tp": 2, "recompute": 3}),  # per block through the DTensor interpreter
}
# activations dominate: 16 samples of 64 tokens, GPipe holds both micro-batches of a rank at once
MEM = ("gpt", {"layers": 4, "batch": 16, "seq": 64})
KS = (0, 1, 2, 3, 4)


def run(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cases = {**CASES, **{f"mem-k{k}": (*MEM, {"dp": 2, "m": 2, "schedule": "gpipe", "recompute": k}) for k in KS}}
    for cid, (name, kwargs, spec) in cases.items():
        case, prog = compile_case(name, kwargs, spec, rank, world)
        losses = [prog.step(*case.example_inputs, target=case.example_target)]  # optimizer state exists now
        gc.collect()
        with track_memory() as trace:
            losses += [prog.step(*case.example_inputs, target=case.example_target) for _ in range(STEPS - 1)]
        calls = [[(c.layer, c.checkpointed) for c in layer_calls(st.gm)] for st in prog._stages.values()]
        out[cid] = {"losses": losses, "model": prog.state_dict()["model"], "calls": calls,
                    "peak": trace.peak_bytes, "kinds": [layer.kind for layer in prog.graph.layers],
                    "recompute": {s: sorted(b) for s, b in prog.lowered.recompute.items()}}
        del prog  # collected before the next one is measured
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn_local(run, 2, timeout_s=400)


@pytest.mark.parametrize("cid", [*CASES, *(f"mem-k{k}" for k in KS)])
def test_training_matches_single_process(results: list[dict], cid: str) -> None:
    name, kwargs = (CASES[cid][:2] if cid in CASES else MEM)
    ref = reference(name, kwargs)
    for rank, r in enumerate(results):
        assert_matches_reference(r[cid]["losses"], r[cid]["model"], *ref, f"{cid} rank {rank}")


@pytest.mark.parametrize("cid, k", [("pp2-first1", 1), ("tp2-first3", 3), ("mem-k2", 2)])
def test_the_first_k_blocks_of_each_stage_are_checkpointed(results: list[dict], cid: str, k: int) -> None:
    for r in results:
        kinds = r[cid]["kinds"]
        for calls in r[cid]["calls"]:
            blocks = [layer for layer, _ in calls if kinds[layer] == "block"]
            assert blocks, "a recomputing stage runs layer by layer"
            assert [layer for layer, flag in calls if flag] == blocks[:k], calls


def test_measured_peak_falls_with_every_recomputed_block(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        peaks = [r[f"mem-k{k}"]["peak"] for k in KS]
        assert all(a > b for a, b in zip(peaks, peaks[1:], strict=False)), (rank, peaks)
        assert peaks[-1] < 0.8 * peaks[0], (rank, peaks)  # recomputing all 4 blocks saves a fifth at least


# ---- pricing ---------------------------------------------------------------------------------------------

def _cm():  # noqa: ANN202
    return cm_for("1x2xA100-80GB", layers=4, batch=16, seq=256)


def test_predicted_memory_falls_and_time_rises_with_k() -> None:
    cm = _cm()
    peaks, steps = [], []
    for k in KS:  # GPipe, 4 micro-batches per replica in flight: every block recomputed saves memory
        est = price_strategy(cm, Strategy(dp=2, microbatch_size=2, schedule="gpipe", recompute=k))
        assert [s.recompute for p in est.plan.pipelines for s in p.stages] == [k, k]
        peaks.append(est.predicted["peak_memory_bytes"][0])
        steps.append(est.predicted["step_time_s"])
    assert all(a > b for a, b in zip(peaks, peaks[1:], strict=False)), peaks
    assert all(a < b for a, b in zip(steps, steps[1:], strict=False)), steps
    # k = all is recompute=True, to the byte and the second; k = 0 is recompute=False
    for k, flag in ((4, True), (0, False)):
        est = price_strategy(cm, Strategy(dp=2, microbatch_size=2, schedule="gpipe", recompute=flag))
        assert est.predicted["peak_memory_bytes"][0] == peaks[KS.index(k)]
        assert est.predicted["step_time_s"] == steps[KS.index(k)]


def test_strategy_k_is_per_stage_and_clamped_to_its_blocks() -> None:
    cm = _cm()
    est = price_strategy(cm, Strategy(pp=2, layer_split=[3, 1], microbatch_size=4, recompute=2))
    assert [s.recompute for s in est.plan.pipelines[0].stages] == [2, 1]
    with pytest.raises(PlanError, match="Strategy.recompute"):
        price_strategy(cm, Strategy(pp=2, recompute=-1))


def test_k_round_trips_through_json_and_bad_k_is_refused() -> None:
    cm = _cm()
    plan = price_strategy(cm, Strategy(pp=2, microbatch_size=4, recompute=1)).plan
    back = Plan.from_json(plan.to_json())
    assert [s.recompute for s in back.pipelines[0].stages] == [1, 1]
    assert type(back.pipelines[0].stages[0].recompute) is int
    assert "first 1" in back.explain()
    flagged = Plan.from_json(plan.to_json().replace('"recompute": 1', '"recompute": true'))
    assert [s.recompute for s in flagged.pipelines[0].stages] == [True, True]
    bad = Plan.from_dict(json.loads(plan.to_json()))
    bad.pipelines[0].stages[0].recompute = 3  # the first stage holds 2 blocks
    with pytest.raises(PlanError, match=r"recompute = 3.*\[0, 2\]"):
        price(cm, bad)
    with pytest.raises(PlanError, match=r"recompute = 3.*\[0, 2\]"):
        lower(bad, cm.graph, 0)
    bad.pipelines[0].stages[0].recompute = "yes"
    with pytest.raises(PlanError, match="recompute"):
        lower(bad, cm.graph, 0)


def test_lowering_recomputes_the_first_k_blocks() -> None:
    c = models.gpt(layers=4, batch=4)
    g = autopar.capture(c.model, c.example_inputs, c.loss_fn, c.example_target)
    blocks = [i for i, layer in enumerate(g.layers) if layer.kind == "block"]
    assert lower(plan_for(g, 1, {"recompute": 3}), g, 0).recompute == {0: frozenset(blocks[:3])}
    assert lower(plan_for(g, 1, {"recompute": True}), g, 0).recompute == {0: frozenset(blocks)}
    assert lower(plan_for(g, 1, {"recompute": 0}), g, 0).recompute == {0: frozenset()}
