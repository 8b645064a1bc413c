"""Models people bring (issue 22): ten transformers architectures beyond GPT-2, Llama, Mixtral and BERT, built
from tiny configs (autopar/hf_models.py), each planned by `autopar.plan` for a mixed cluster and trained on 4
gloo processes with that plan.

Architectures: grouped-query attention (Qwen2), sliding-window attention (Mistral), ALiBi (Bloom), parallel
attention (GPT-NeoX, GPT-J, Falcon's new decoder), routed plus shared experts (Qwen2-MoE), an encoder-decoder
(T5, `forward(ids)` with `decoder_input_ids=ids`), a vision transformer (ViT) and a convnet (ConvNeXt).

The cluster: two large, fast CPU-like devices and two small ones at half the speed, none able to hold a whole
replica's training state (sized from the plan of one device that holds everything), so autopar must split
the work. Plans are made here with `autopar.plan` (nothing hand-written); one spawn of 4 ranks then, for each
architecture in turn, runs `autopar.compile(plan=...)` and 3 steps under `track_memory`. Checks per
architecture: every step's loss and every final parameter equal single-process training (rtol 1e-4, atol
1e-5); the plan splits the work (several stages or replicas, the ranks' shares differ); each rank's measured
peak of live tensor bytes over compile + steps is within 15% of `plan.predicted["peak_memory_bytes"][rank]`
(an architecture that misses it is a strict xfail with its reason in MEMORY_XFAIL: ConvNeXt on AVX2 hosts; a
plan of this host's on which it misses, in PLAN_XFAIL, keyed by the plan's layout).
"""

from __future__ import annotations

import gc
from typing import Any

import pytest

import autopar
from autopar import models
from autopar.cluster import device_spec
from autopar.cost_models.conv_workspace import local_isa
from autopar.ir.plan import Plan
from autopar.runtime.launch import spawn_local
from autopar.runtime.memtrace import track_memory
from autopar.runtime.program import Program

from .runtime_cases import STEPS, assert_matches_reference, optimizer, work_of

# name -> model kwargs (tiny: hidden 16-64, 2 layers, vocab 128, seq 16)
ARCHS: dict[str, dict[str, Any]] = {
    "hf_qwen2": dict(batch=4),
    "hf_mistral": dict(batch=4),
    "hf_bloom": dict(batch=4),
    "hf_gpt_neox": dict(batch=4),
    "hf_gptj": dict(batch=4),
    "hf_falcon": dict(batch=4),
    "hf_qwen2_moe": dict(batch=4),
    "hf_t5": dict(batch=4),
    "hf_vit": dict(batch=4),
    # batch 8: a CPU rank's backward of a 7 x 7 depthwise convolution on a channels-last input holds the weight
    # gradient in oneDNN's padded layout, 256 x C x 49 x 4 bytes whatever the batch (1.6 MB at C = 32 with
    # PyTorch's copies; cost_models/conv_workspace.py). At batch 4 that is 58% of one device's whole-model
    # peak (2.8 MB), and autopar.plan finds no split that fits the cluster sized from it (the plan made before
    # the buffer was priced put 2.0 MB on a 0.5 MB device); at batch 8 the activations, which the cluster's
    # memory scales with, make room for it
    "hf_convnext": dict(batch=8),
}
# device memory as a fraction of one device's predicted peak holding the whole model's training
BIG, SMALL = 0.7, 0.45
TOL = 0.15  # measured peak / predicted peak, every rank
# architectures whose measured peak misses TOL on some rank: name -> reason (with the measured ratios)
MEMORY_XFAIL: dict[str, str] = {}
if local_isa() != "avx512_core":
    # measured on an AMD EPYC AVX2 host (2026-12-03), the same on a5f695a and after: ranks at 0.70, 0.70, 0.82
    # and 0.82 of their prediction (over-priced, so it fits; within 15 % on the AVX-512 hosts it was fitted on)
    MEMORY_XFAIL["hf_convnext"] = ("ConvNeXt is over-priced by 1.2-1.4x on AVX2 hosts (measured 0.70-0.82 of "
                                   "the plan): cause not found yet")

# plans on which the memory model misses TOL, keyed by the plan's layout (`layout`): the plans autopar makes
# here follow the host's probed CPU speed, and on a 2-core AMD EPYC AVX2 host (2026-12-04; the same at a2e547e,
# where the suite passed on another host's plans) these three came out. Strict: an entry whose plan meets TOL
# fails, asking to be removed; any other plan of the architecture must meet TOL.
PLAN_XFAIL: dict[tuple[str, str], str] = {
    ("hf_qwen2_moe", "2x1: L0-2@0z1 L2-4@2z1; 2x1: L0-2@1z1 L2-4@3z1"):
        "under-priced 1.16x (ranks 0-1) and 1.40x (ranks 2-3) on dp2 x pp2 at ZeRO-1: at the peak 2.2 MB allocated "
        "in the backward sit beside 2.1 MB of aten::index output (the experts' gathered weights, batched_mm); "
        "likely that output's gradient, a transient StageBase.bwd_transient (the loss's logits buffers) does not "
        "cover; not confirmed",
    ("hf_qwen2_moe", "1x1: L0-4@0z1; 1x1: L0-4@1z1; 1x1: L0-4@2z1; 1x1: L0-4@3z1"):
        "over-priced (measured 0.81 of the plan on every rank, dp 4 at ZeRO-1): the last block's backward transient, "
        "the gradient of its gathered expert weights (aten::index output, 1.05 MB a rank; 1.18 MB of backward buffers "
        "measured at the peak), is priced on top of every activation saved, but by then the block's backward has "
        "freed part of its own saved gathered weights (2.62 MB of aten::index live at the peak, 3.15 MB priced)",
    ("hf_convnext", "4x1: L0-2@2z1 L2-4@0z1; 4x1: L0-2@3z1 L2-4@1z1"):
        "over-priced on its first stages (measured 0.85 of the plan on ranks 2-3, 1.03 on 0-1; 0.86 before the "
        "executor stopped keeping a batch's receive buffer, 2026-12-06): at the peak 0.85 MB of backward buffers "
        "against ~1.06 MB of activations and backward transient priced; cause not found",
    ("hf_falcon", "2x1: L0-2@2z2 L2-4@0z1; 2x1: L0-2@3z2 L2-4@1z1"):
        "over-priced on its ZeRO-2 first stages (measured 0.84-0.88 of the plan there, 0.95-0.99 elsewhere)",
}


def layout(plan: Plan) -> str:
    """A plan's layout as PLAN_XFAIL keys it: per pipeline, share x micro-batches and each stage's layers,
    devices and ZeRO level."""
    return "; ".join(f"{p.batch_share}x{p.num_microbatches}: " + " ".join(
        f"L{s.layers[0]}-{s.layers[1]}@{','.join(map(str, s.devices))}z{s.zero}" for s in p.stages)
        for p in plan.pipelines)


def build(name: str, device: str = "cpu") -> models.ModelCase:
    return models.CASES[name](seed=0, device=device, **ARCHS[name])


def mixed_cluster(whole_bytes: int) -> dict:
    """Two CPU-like devices of BIG x `whole_bytes` and two of SMALL x at half the compute rate."""
    gib = 2**30
    base = device_spec("cpu").to_dict()
    big = {"name": "cpu-big", "based_on": "cpu", "memory_GiB": BIG * whole_bytes / gib}
    small = {"name": "cpu-small", "based_on": "cpu", "memory_GiB": SMALL * whole_bytes / gib,
             "tflops_fp32": base["tflops_fp32"] / 2}
    return {"nodes": [{"device": big, "devices_per_node": 2}, {"device": small, "devices_per_node": 2}]}


def make_plan(name: str) -> tuple[dict, str]:
    case = build(name)
    args = (case.example_inputs, case.example_target, case.loss_fn)
    graph = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    whole = autopar.estimate(case.model, "1x1xcpu", autopar.Strategy(), *args, optimizer="adamw",
                             precision="fp32", captured=graph).plan.predicted["peak_memory_bytes"][0]
    cluster = mixed_cluster(whole)
    plan = autopar.plan(case.model, cluster, *args, optimizer="adamw", precision="fp32", time_limit_s=30,
                        captured=graph)
    return cluster, plan.to_json()


def worker(rank: int, world: int, items: list[tuple[str, dict, str]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, cluster, plan_json in items:
        case = build(name)
        gc.collect()
        try:
            with track_memory() as trace:
                prog = autopar.compile(case.model, cluster, case.example_inputs, case.example_target,
                                       case.loss_fn, optimizer, plan=plan_json, precision="fp32", timeout_s=120,
                                       fallback=False)
                losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(STEPS)]
        except Exception as e:
            raise RuntimeError(f"{name} on rank {rank}: {type(e).__name__}: {e}") from e
        assert isinstance(prog, Program), type(prog)
        out[name] = {"losses": losses, "final": prog.state_dict()["model"], "work": work_of(prog),
                     "trace": trace.summary(top=12)}
        del prog, trace
    return out


@pytest.fixture(scope="module")
def runs() -> tuple[dict[str, tuple[dict, str]], list[dict]]:
    plans = {name: make_plan(name) for name in ARCHS}
    items = [(name, cluster, plan_json) for name, (cluster, plan_json) in plans.items()]
    return plans, spawn_local(worker, 4, items, timeout_s=600)


@pytest.mark.parametrize("name", list(ARCHS))
def test_trains_like_one_process(runs: tuple, name: str) -> None:
    _, results = runs
    ref_losses, ref_final = models.train_reference(build(name), optimizer, STEPS)
    for rank, res in enumerate(results):
        assert_matches_reference(res[name]["losses"], res[name]["final"], ref_losses, ref_final,
                                 f"{name} rank {rank}")


@pytest.mark.parametrize("name", list(ARCHS))
def test_plan_splits_the_work(runs: tuple, name: str) -> None:
    plans, results = runs
    plan = Plan.from_json(plans[name][1])
    assert plan.world_size == 4
    assert len(plan.pipelines) > 1 or len(plan.pipelines[0].stages) > 1, plan.explain()
    works = [res[name]["work"] for res in results]
    # no rank trains the whole batch through every parameter the ranks hold together
    union = set().union(*(w["params"] for w in works))
    for rank, w in enumerate(works):
        whole_batch = w["batch"] == (0, plan.global_batch)
        assert not (whole_batch and set(w["params"]) == union), (
            f"{name} rank {rank} does everything: batch {w['batch']}, layers {w['layers']}")


def _memory_cases() -> list[Any]:
    def marks(name: str) -> list[Any]:
        if name in MEMORY_XFAIL:
            return [pytest.mark.xfail(strict=True, reason=MEMORY_XFAIL[name])]
        return []
    return [pytest.param(name, marks=marks(name)) for name in ARCHS]


@pytest.mark.parametrize("name", _memory_cases())
def test_measured_peak_memory_matches_plan(runs: tuple, name: str) -> None:
    plans, results = runs
    plan = Plan.from_json(plans[name][1])
    predicted = plan.predicted["peak_memory_bytes"]
    ratios = {rank: res[name]["trace"]["peak_bytes"] / predicted[rank] for rank, res in enumerate(results)}
    missed = {rank: r for rank, r in ratios.items() if abs(r - 1) > TOL}
    known = PLAN_XFAIL.get((name, layout(plan)))
    if known is not None:
        assert missed, f"{name} now meets {TOL:.0%} on plan {layout(plan)!r} ({ratios}): remove its PLAN_XFAIL entry"
        pytest.xfail(f"{known}; measured/predicted {ratios}")
    assert not missed, (f"{name}: measured/predicted peak {ratios}; at the peak: "
                        + "; ".join(f"rank {rank}: {results[rank][name]['trace']['at_peak']}, unseen frees "
                                    f"{results[rank][name]['trace']['unseen_free_bytes']}" for rank in missed))
