"""ZB-H1 together with every option the planner can choose beside it: tensor parallelism, bf16 / fp16 mixed
precision (fp16 with dynamic loss scaling), CPU offload (optimizer state, activations, parameters), compressed
stage sends, per-block recompute (k of a stage's blocks), expert parallelism and ZeRO-1/3 (whole-step under a
split backward; ZeRO-2 and plain pp / dp x pp are in tests/test_zero_bubble.py).

Expectations. fp32 runs: every rank's per-step losses and final parameters (3 AdamW steps, eps 1e-6) equal
single-process training of the original model to fp32 reduction-order noise (rtol 1e-4, atol 1e-5,
runtime_cases.assert_matches_reference; measured differences are below 2e-6). bf16 / fp16 autocast and
bf16-compressed sends round on purpose, so those runs are compared with the same plan under 1F1B, which must
be bitwise equal (torch.equal on every loss, parameter and loss-scale value): B and W compute each gradient
as the same sum of the same products as one backward (split_backward.py), the wire and autocast rounding
are the same, and the micro-batch gradients are accumulated in the same order. That those runs really
rounded is checked too (they leave fp32 training by more than its noise), and the compressed run stays
within the wire format's unit roundoff of fp32 training (tests/test_runtime_compress.py's bound).
That the split really ran: on every stage after the first, every micro-batch's backward was split (B
input gradients, W weight gradients later); the first stage has nothing to send upstream and runs its
whole backward in W (split_backward.py).
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from autopar.runtime.launch import spawn_local
from autopar.runtime.split_backward import backward_input, backward_weight

from .runtime_cases import (
    STEPS,
    assert_ranks_match_reference,
    assert_work_split,
    compile_case,
    reference,
    work_of,
)

# multi-process and minutes long: CI's second step (.ci/run, `-m slow`) runs it
pytestmark = pytest.mark.slow

UNIT_ROUNDOFF_BF16 = 2.0**-8  # bf16: 8 significand bits
# a loss scale at which the first fp16 step overflows and the next ones do not: one process training this
# GPT on the same micro-batches under torch.amp.GradScaler skips exactly its first step from 2^20 (none from
# 2^19, the first two from 2^21)
FP16_FORCED_SCALE = 2.0**20

# ---- the split itself, on one process ------------------------------------------------------------------


def _plain_grads(fn: Any, params: list[torch.Tensor], x: torch.Tensor, grads: list[torch.Tensor]) -> list:
    """The expectation: one ordinary backward of `fn(x)`, parameter and input gradients."""
    x = x.detach().clone().requires_grad_(True)
    torch.autograd.backward(fn(x), grads)
    out = [p.grad.clone() for p in params] + [x.grad.clone()]
    for p in params:
        p.grad = None
    return out


def test_a_parameter_that_also_feeds_an_output_directly_gets_its_whole_gradient() -> None:
    """A stage output that depends on a weight but not on the stage input: W (which starts where the weight
    joins the input-gradient graph) would miss that part, so B runs the whole backward."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 4))
    grads = [torch.randn(3, 4), torch.randn(4)]
    fn = lambda x: [x @ w, (w * 2).sum(0)]  # noqa: E731
    data = torch.randn(3, 4)
    expect = _plain_grads(fn, [w], data, grads)
    x = data.clone().requires_grad_(True)
    pending = backward_input(fn(x), grads, [x], [w])
    assert pending.mode == "whole"
    backward_weight(pending)
    assert torch.equal(w.grad, expect[0]) and torch.equal(x.grad, expect[1])


class _Counted(torch.nn.Module):
    """Two linears (the first applied on `uses` parallel branches, summed), counting its forward runs."""

    def __init__(self, uses: int) -> None:
        super().__init__()
        self.a, self.b, self.uses, self.calls = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), uses, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = sum(torch.relu(self.a(x * (i + 1))) for i in range(self.uses))
        return self.b(x)


@pytest.mark.parametrize("uses", [1, 2])
def test_w_of_a_recomputed_block_recomputes_it_once_and_gets_a_plain_backwards_gradients(uses: int) -> None:
    """A checkpointed block: forward once in F, recomputed once in B and once in W (not once per parameter
    group: it has 2); with a weight used on two parallel branches (one group joining the input-gradient graph
    at two nodes, neither below the other) W falls back to one recompute per group, and the gradients are
    still a plain backward's, bit for bit."""
    torch.manual_seed(0)
    block = _Counted(uses)
    twin = copy.deepcopy(block)
    x, g = torch.randn(3, 4), torch.randn(3, 4)
    expect = _plain_grads(lambda v: [twin(v)], list(twin.parameters()), x, [g])
    x2 = x.clone().requires_grad_(True)
    out = checkpoint(block, x2, use_reentrant=False)
    pending = backward_input([out], [g], [x2], list(block.parameters()))
    assert pending.mode == "split" and block.calls == 2  # F, and B's recompute
    assert all(p.grad is None for p in block.parameters())
    backward_weight(pending)
    assert block.calls == (3 if uses == 1 else 4)  # W: once (shared), or once per group (2 groups)
    for got, want in zip([*(p.grad for p in block.parameters()), x2.grad], expect, strict=True):
        assert torch.equal(got, want)


# ---- on gloo ranks -------------------------------------------------------------------------------------

GPT = ("gpt", {"layers": 4, "batch": 8})
MOE = ("moe_gpt", {"layers": 2, "batch": 8})
DP_PP = {"dp": 2, "pp": 2, "m": 2, "schedule": "zb_h1"}
# autocast runs: torch ops, as tests/test_precision.py (generated kernels compute their regions in fp32)
BF16 = {**DP_PP, "precision": "bf16", "kernels": "torch"}
FP16 = {**DP_PP, "precision": "fp16", "kernels": "torch", "scale": FP16_FORCED_SCALE}
# (model, kwargs, spec) on 4 ranks; "twin": compared bitwise with the next case (the same plan under 1F1B),
# the others with single-process fp32 training
CASES: dict[str, tuple[str, dict, dict]] = {
    "tp2-pp2-recompute1": (*GPT, {"tp": 2, "pp": 2, "m": 4, "recompute": 1, "schedule": "zb_h1"}),
    "dp2-pp2-recompute1": (*GPT, {**DP_PP, "recompute": 1}),
    "bf16": (*GPT, BF16),
    "bf16-1f1b": (*GPT, {**BF16, "schedule": "1f1b"}),
    "fp16-scaled": (*GPT, FP16),
    "fp16-scaled-1f1b": (*GPT, {**FP16, "schedule": "1f1b"}),
    "offload-optimizer-activations": (*GPT, {**DP_PP, "offload": ("optimizer", "activations")}),
    "zero1": (*GPT, {**DP_PP, "zero": 1}),
    "zero3-offload-all": (*GPT, {**DP_PP, "zero": 3, "offload": ("optimizer", "activations", "params")}),
    "compress-bf16": (*GPT, {**DP_PP, "compress": "bf16"}),
    "compress-bf16-1f1b": (*GPT, {**DP_PP, "compress": "bf16", "schedule": "1f1b"}),
    "ep2-recompute": (*MOE, {**DP_PP, "ep": 2, "recompute": True}),  # MoE stages: one checkpoint per stage
}
TWINS = {"bf16": "bf16-1f1b", "fp16-scaled": "fp16-scaled-1f1b", "compress-bf16": "compress-bf16-1f1b"}


def run_combo_cases(rank: int, world: int, cases: dict[str, tuple[str, dict, dict]]) -> dict[str, dict]:
    """Worker body: per case, the losses, the full final state, the work split, the loss scale after each
    step, this rank's stages and how its B's split their backward (PendingWeights.mode)."""
    from autopar.runtime import program

    modes: Counter = Counter()
    original = program.backward_input

    def recording(*args: Any) -> Any:
        pending = original(*args)
        modes[pending.mode] += 1
        return pending

    program.backward_input = recording
    out = {}
    try:
        for cid, (name, kwargs, spec) in cases.items():
            modes.clear()
            case, prog = compile_case(name, kwargs, spec, rank, world)
            if "scale" in spec:
                prog.amp.scaler.scale = spec["scale"]
            losses, scales = [], []
            for _ in range(STEPS):
                losses.append(prog.step(*case.example_inputs, target=case.example_target))
                scales.append(prog.amp.scaler.scale if prog.amp.scaler is not None else None)
            out[cid] = {"losses": losses, "params": prog.state_dict()["model"], "work": work_of(prog),
                        "scales": scales, "stages": list(prog.position.stages), "modes": dict(modes),
                        "levels": {n: prog.zero.state[n].level for n in prog.params}}
    finally:
        program.backward_input = original
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict]]:
    return spawn_local(run_combo_cases, 4, CASES, timeout_s=300)


def _check_split_ran(results: list[dict], cid: str) -> None:
    _, _, spec = CASES[cid]
    m = spec["m"] * STEPS
    for rank, per_rank in enumerate(results):
        r = per_rank[cid]
        if spec.get("schedule") != "zb_h1":
            assert r["modes"] == {}, f"rank {rank}: 1F1B ran a split backward"
        elif r["stages"] == [0]:
            assert r["modes"] == {"deferred": m}, f"rank {rank} (first stage) {r['modes']}"
        else:
            assert r["modes"] == {"split": m}, f"rank {rank} (stage {r['stages']}) {r['modes']}"


FP32 = [cid for cid, (_, _, spec) in CASES.items() if "precision" not in spec and "compress" not in spec]


@pytest.mark.parametrize("cid", FP32)
def test_zb_h1_with_the_option_trains_like_one_process(results: list[dict], cid: str) -> None:
    name, kwargs, spec = CASES[cid]
    per_case = [[(r[cid]["losses"], r[cid]["params"], r[cid]["work"])] for r in results]
    ref_losses, ref_params = assert_ranks_match_reference(per_case, 0, name, kwargs, f"{cid} ")
    assert ref_losses[-1] < ref_losses[0]
    assert_work_split([r[cid]["work"] for r in results], spec, kwargs["batch"], ref_params)
    _check_split_ran(results, cid)


@pytest.mark.parametrize("cid", list(TWINS))
def test_zb_h1_with_rounding_options_equals_1f1b_bitwise(results: list[dict], cid: str) -> None:
    name, kwargs, spec = CASES[cid]
    twin = TWINS[cid]
    ref_losses, ref_params = reference(name, kwargs)  # fp32 single-process training
    for rank, per_rank in enumerate(results):
        zb, one = per_rank[cid], per_rank[twin]
        assert zb["losses"] == one["losses"], f"rank {rank} losses"
        assert zb["scales"] == one["scales"], f"rank {rank} loss scales"
        assert zb["params"].keys() == one["params"].keys()
        for k, v in one["params"].items():
            assert torch.equal(zb["params"][k], v), f"rank {rank} {k} differs from 1F1B"
        # the rounding really happened: further from fp32 training than fp32's reduction-order noise
        assert max(abs(a - b) for a, b in zip(zb["losses"], ref_losses, strict=True)) > 1e-5
        if "compress" in spec:  # bf16 wire: losses within its unit roundoff of fp32 training
            assert zb["losses"] == pytest.approx(ref_losses, rel=UNIT_ROUNDOFF_BF16)
        assert zb["losses"][-1] < zb["losses"][0]
    assert_work_split([r[cid]["work"] for r in results], spec, kwargs["batch"], ref_params)
    _check_split_ran(results, cid)
    _check_split_ran(results, twin)


def test_fp16_loss_scaling_skips_the_overflowing_step_under_zb_h1(results: list[dict]) -> None:
    """Started at 2^20, the first step's fp16 gradients overflow: every rank skips it and halves the scale
    (GradScaler's rule); the next steps train."""
    for rank, per_rank in enumerate(results):
        r = per_rank["fp16-scaled"]
        assert r["scales"] == [FP16_FORCED_SCALE / 2] * STEPS, f"rank {rank} {r['scales']}"


def test_zero_under_zb_h1_partitions_every_replicated_parameter(results: list[dict]) -> None:
    """The ZeRO levels were applied (whole-step under a split backward), not dropped: every parameter of a
    dp 2 x pp 2 plan has two holders, so every one runs at the plan's level."""
    for cid in ("zero1", "zero3-offload-all"):
        level = CASES[cid][2]["zero"]
        for rank, per_rank in enumerate(results):
            levels = per_rank[cid]["levels"]
            assert levels and set(levels.values()) == {level}, f"{cid} rank {rank} {levels}"
