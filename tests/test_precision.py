"""Mixed precision: the catalog's fp16/bf16 split, the default precision, and bf16/fp16 plans at run time.

Run-time expectations. A bf16/fp16 plan runs each stage forward under torch.autocast with fp32 parameters,
AdamW state and gradient reduction (runtime/precision.py). The reference is one process under the same
policy: torch.autocast around model + loss, fp32 AdamW (eps 1e-6), torch.amp.GradScaler for fp16, with the
gradients accumulated over the plan's micro-batches (each loss weighted by size / batch, as the runtime
does) and, for a pipeline, the stage boundary's activation and its gradient rounded to the plan's dtype
(the wire the planner prices). Under autocast a micro-batch's weight gradient is rounded to bf16/fp16 once
per micro-batch, so a run with other micro-batches differs from the whole-batch run by about the unit
roundoff (2^-8 for bf16) per gradient element; with the same micro-batches and wire rounding only fp32
summation order is left, and we measured losses within 1e-7 and parameters within 2e-7 (pipelines:
bitwise equal). We therefore hold the runs to the fp32 tolerances of the other runtime tests (rtol 1e-4,
atol 1e-5; assert_matches_reference). The loss-scale history must equal GradScaler's exactly, including a
run whose first step overflows and is skipped on every rank. That the policy really ran: the bf16 run is
far closer to the bf16 reference than to the fp32 one.
fp32 plans stay exact: Program without a plan runs fp32, covered by tests/test_runtime.py at rtol 1e-4.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import autopar
from autopar import Cluster, Strategy, models
from autopar.catalog import CATALOG
from autopar.cluster import device_spec
from autopar.cost_models.memory import state_bytes_per_param
from autopar.errors import PlanError
from autopar.ir.plan import plan_from_strategy
from autopar.ir.precision import default_precision
from autopar.runtime.launch import spawn_local
from autopar.runtime.precision import PrecisionPolicy

from .runtime_cases import assert_matches_reference, build, optimizer

TF = 1e12
NO_BF16 = ("V100-16GB", "V100-32GB", "T4", "RTX-2080Ti", "TITAN-RTX", "Jetson-Xavier-NX-8GB")
MIXED = "1x2xA100-80GB+1x2xT4"
STEPS = 3
# torch ops, not fused regions: the generated kernels (codegen/kernels.py) compute a region in fp32 and cast
# its outputs back, so under autocast they round differently from eager autocast (the reference)
KERNELS = "torch"
FP16_FORCED_SCALE = 2.0**19  # the first step's fp16 gradients overflow at this scale, the next ones do not


# ---- catalog and default precision -------------------------------------------------------------------


@pytest.mark.parametrize("name, fp16", [("V100-16GB", 125), ("V100-32GB", 125), ("T4", 65), ("RTX-2080Ti", 53.8),
                                        ("TITAN-RTX", 130), ("Jetson-Xavier-NX-8GB", 6.76)])
def test_devices_without_bf16_list_fp16_only(name: str, fp16: float) -> None:
    s = device_spec(name)
    assert CATALOG[name]["tflops_bf16"] is None and "bf16" not in s.peak_flops
    assert s.flops("fp16") == pytest.approx(fp16 * TF)
    with pytest.raises(PlanError, match=f"{name} cannot compute in bf16.*fp16"):
        s.flops("bf16")
    assert Cluster.load(Cluster.load(f"1x1x{name}").to_dict()).devices[0].spec == s  # round-trips


@pytest.mark.parametrize("name", [n for n in CATALOG if n not in NO_BF16])
def test_bf16_devices_list_equal_fp16_and_bf16_peaks(name: str) -> None:
    s = device_spec(name)
    assert s.flops("bf16") == s.flops("fp16") == CATALOG[name]["tflops_fp16"] * TF


def test_custom_devices_fp16() -> None:
    old = device_spec({"name": "Old", "tflops_fp32": 10, "tflops_bf16": 40, "memory_GiB": 8,
                       "memory_bandwidth_GBps": 100})
    assert old.flops("fp16") == old.flops("bf16") == 40 * TF  # an old file: fp16 = bf16
    new = device_spec({"name": "New", "tflops_fp32": 10, "tflops_fp16": 80, "tflops_bf16": None, "memory_GiB": 8,
                       "memory_bandwidth_GBps": 100})
    assert new.flops("fp16") == 80 * TF and "bf16" not in new.peak_flops
    t4_like = device_spec({"based_on": "T4", "name": "T4-slow", "tflops_fp16": 50})
    assert t4_like.flops("fp16") == 50 * TF and "bf16" not in t4_like.peak_flops


def test_devices_table_shows_both_peaks() -> None:
    from autopar.cluster import catalog_table

    lines = catalog_table().splitlines()
    head = lines[0].split()
    assert "fp16" in head and "bf16" in head
    t4 = next(line for line in lines if line.startswith("T4 ")).split()
    assert t4[3:5] == ["65", "-"]  # fp16 65 TFLOP/s, no bf16
    a100 = next(line for line in lines if line.startswith("A100-80GB")).split()
    assert a100[3:5] == ["312", "312"]


@pytest.mark.parametrize("cluster, expected", [(MIXED, "fp16"), ("1x2xA100-80GB", "bf16"), ("2x8xH100-SXM", "bf16"),
                                               ("1x4xV100-16GB", "fp16"), ("1x1xcpu", "fp32")])
def test_default_precision_is_one_every_device_runs(cluster: str, expected: str) -> None:
    assert default_precision(Cluster.load(cluster)) == expected


def _gpt(layers: int = 2, batch: int = 4) -> models.ModelCase:
    return build("gpt", layers=layers, batch=batch)


def test_plan_defaults_to_fp16_on_a_cluster_with_t4() -> None:
    c = _gpt()
    plan = autopar.plan(c.model, MIXED, c.example_inputs, c.example_target, c.loss_fn, time_limit_s=20)
    assert plan.precision == "fp16"
    text = plan.explain()
    assert "A100-80GB: fp16 autocast, fp32 master weights / optimizer state / gradient reduction" in text
    assert "T4: fp16 autocast" in text and "loss scaling" in text


def test_bf16_plan_on_t4_is_refused() -> None:
    c = _gpt()
    with pytest.raises(PlanError, match=r"precision='bf16'.*T4 \(device\(s\) \[2, 3\].*precision='fp16'"):
        autopar.plan(c.model, MIXED, c.example_inputs, c.example_target, c.loss_fn, precision="bf16")


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(PlanError, match="unknown precision 'fp8'"):
        PrecisionPolicy("fp8")


def test_mixed_precision_state_bytes_are_what_the_runtime_keeps() -> None:
    # fp32 parameters (they are the master weights), fp32 gradients, AdamW's two fp32 moments
    sb = state_bytes_per_param("adamw", "bf16")
    assert (sb.weights, sb.grads, sb.optimizer) == (4, 4, 8)
    assert sb.cast_copy == 2  # autocast's bf16 copy a matmul keeps per micro-batch in flight
    assert state_bytes_per_param("adamw", "fp32").cast_copy == 0


# ---- at run time ---------------------------------------------------------------------------------------

# (model kwargs, strategy, cluster, precision): one 2-rank process group for the whole list
CASES = [
    ({"layers": 2, "batch": 4}, {"dp": 2}, "1x2xA100-80GB", "bf16"),
    ({"layers": 2, "batch": 4}, {"pp": 2, "microbatch_size": 1}, "1x2xA100-80GB", "bf16"),
    ({"layers": 2, "batch": 4}, {"dp": 2}, "1x2xT4", "fp16"),
    ({"layers": 2, "batch": 4}, {"dp": 2}, "1x2xT4", "fp16-forced"),  # starts at FP16_FORCED_SCALE
    ({"layers": 2, "batch": 4}, {"pp": 2, "microbatch_size": 2}, "1x2xT4", "fp16"),
    # layer-wise ZeRO-3, and parameters streamed from the host with their loss-scaled gradients there too
    # (one micro-batch per replica: with several, the fp32 sum of bf16-rounded micro-batch gradients runs in
    # another order than one process's, and Adam turns that last-bit noise into ~1e-5 parameter differences)
    ({"layers": 2, "batch": 4}, {"dp": 2, "zero": 3}, "1x2xA100-80GB", "bf16"),
    ({"layers": 2, "batch": 4}, {"dp": 2, "offload": ("optimizer", "activations", "params")}, "1x2xT4",
     "fp16-forced"),
]


def make_plan(kwargs: dict, strategy: dict, cluster: str, precision: str) -> autopar.Plan:
    case = _gpt(**kwargs)
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    blocks = [i for i, layer in enumerate(g.layers) if layer.kind == "block"]
    c = Cluster.load(cluster)
    return plan_from_strategy(Strategy(**strategy), world_size=c.world_size, global_batch=kwargs["batch"],
                              num_layers=len(g.layers), first_block=blocks[0], num_blocks=len(blocks),
                              precision=precision, optimizer="adamw", cluster=c.to_dict(),
                              model={"num_layers": len(g.layers)})


def run_precision_cases(rank: int, world: int, cases: list) -> list:
    """Worker: compile each case's plan, train; losses, final state, per-rank work split, scale history."""
    out = []
    for kwargs, strategy, cluster, precision in cases:
        case = _gpt(**kwargs)
        plan = make_plan(kwargs, strategy, cluster, precision.split("-")[0])
        prog = autopar.compile(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn,
                               optimizer, plan=plan, precision=plan.precision, timeout_s=60, kernels=KERNELS)
        if precision.endswith("forced"):
            prog.amp.scaler.scale = FP16_FORCED_SCALE
        losses, scales = [], []
        for _ in range(STEPS):
            losses.append(prog.step(*case.example_inputs, target=case.example_target))
            scales.append(prog.amp.scaler.scale if prog.amp.scaler else None)
        pipe = prog.pipeline
        split = (pipe.batch_offset, pipe.batch_size, tuple(pipe.stages[prog.position.stages[0]].layers))
        out.append((losses, prog.state_dict()["model"], split, scales, prog.amp.describe()))
    return out


class _Wire(torch.autograd.Function):
    """A stage boundary's transfer: the value, and its gradient on the way back, rounded to the wire dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.dtype = dtype
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return g.to(ctx.dtype).to(g.dtype), None


def reference_amp(kwargs: dict, precision: str, strategy: dict | None = None, cluster: str = "1x2xA100-80GB"
                  ) -> tuple[list[float], dict, list[float | None]]:
    """One process under the same policy: autocast around model + loss, fp32 AdamW, torch.amp.GradScaler for
    fp16; with `strategy`, gradients accumulated over the plan's micro-batches (each weighted by size / batch,
    as the runtime weights them) and a pipeline's stage boundary rounded to the wire dtype both ways."""
    case = _gpt(**kwargs)
    opt = optimizer(list(case.model.parameters()))
    name = precision.split("-")[0]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[name]
    scaler = None
    if dtype is torch.float16:
        init = FP16_FORCED_SCALE if precision.endswith("forced") else 2.0**16
        scaler = torch.amp.GradScaler("cpu", init_scale=init)
    batch = kwargs["batch"]
    slices = [(0, batch)]
    if strategy is not None:
        plan = make_plan(kwargs, strategy, cluster, name)
        slices, offset = [], 0
        for p in plan.pipelines:
            for size in p.microbatch_sizes():
                slices.append((offset, size))
                offset += size
        if len(plan.pipelines[0].stages) > 1 and dtype is not None:  # layers [0, e) = pre + blocks[: e - 1]
            block = case.model.blocks[plan.pipelines[0].stages[0].layers[1] - 2]
            block.register_forward_hook(lambda _m, _i, out: _Wire.apply(out, dtype))
    (x,), y = case.example_inputs, case.example_target
    losses, scales = [], []
    for _ in range(STEPS):
        total = 0.0
        for start, size in slices:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = models.loss_of(case, x[start:start + size], target=y[start:start + size]) * (size / batch)
            total += loss.item()
            (scaler.scale(loss) if scaler else loss).backward()
        losses.append(total)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale() if scaler else None)
    return losses, {k: v.detach().clone() for k, v in case.model.state_dict().items()}, scales


@pytest.fixture(scope="module")
def results() -> list:
    return spawn_local(run_precision_cases, 2, CASES, timeout_s=240)


def _max_diff(params: dict, ref: dict) -> float:
    return max(float((params[k] - v).abs().max()) for k, v in ref.items())


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c[1]}-{c[3]}" for c in CASES])
def test_mixed_precision_matches_single_process_under_the_same_policy(results: list, index: int) -> None:
    kwargs, strategy, cluster, precision = CASES[index]
    ref_losses, ref_params, ref_scales = reference_amp(kwargs, precision, strategy, cluster)
    splits = set()
    for rank, per_rank in enumerate(results):
        losses, params, split, scales, described = per_rank[index]
        splits.add(split)
        assert described.startswith(f"{precision.split('-')[0]} autocast, fp32 master weights")
        assert_matches_reference(losses, params, ref_losses, ref_params, f"rank {rank}")
        if precision.startswith("fp16"):
            assert scales == ref_scales, f"rank {rank}: loss scale history {scales} vs GradScaler {ref_scales}"
    assert len(splits) == 2, f"the work was not split: {splits}"  # two batch halves or two layer ranges
    if precision.endswith("forced"):  # the first step overflowed and was skipped on both ranks, then it trains
        assert ref_scales[0] == FP16_FORCED_SCALE / 2 and ref_losses[0] == ref_losses[1] > ref_losses[2]


def test_bf16_runs_really_compute_in_bf16(results: list) -> None:
    """The dp=2 bf16 run is much closer to the bf16 reference than to the fp32 one (autocast ran)."""
    kwargs, strategy, cluster, _ = CASES[0]
    _, bf16_params, _ = reference_amp(kwargs, "bf16", strategy, cluster)
    _, fp32_params, _ = reference_amp(kwargs, "fp32", strategy, cluster)
    params = results[0][0][1]
    assert _max_diff(params, fp32_params) > 100 * max(_max_diff(params, bf16_params), 1e-7)


def test_compile_precision_contradicting_the_plan_is_refused() -> None:
    plan = make_plan({"layers": 2, "batch": 4}, {"dp": 1}, "1x1xA100-80GB", "bf16")
    c = _gpt()
    with pytest.raises(PlanError, match="precision='fp16'.*plan computes in 'bf16'"):
        autopar.compile(c.model, "1x1xA100-80GB", c.example_inputs, c.example_target, c.loss_fn, plan=plan,
                        precision="fp16")


# ---- autocast's weight copies ----------------------------------------------------------------------------


def _autocast_copied(model: torch.nn.Module, *inputs: torch.Tensor) -> dict[str, int]:
    """Parameters torch.autocast copies to bf16 in one forward (its casts are aten._to_copy of the parameter),
    by name -> elements, from the dispatcher: what runtime/precision.py's autocast makes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    names = {p.untyped_storage().data_ptr(): n for n, p in model.named_parameters()}
    copied: dict[str, int] = {}

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
                name = names.get(args[0].untyped_storage().data_ptr())
                if name is not None and out.dtype == torch.bfloat16:
                    copied[name] = args[0].numel()
            return out

    with torch.autocast("cpu", dtype=torch.bfloat16), Casts():
        model(*inputs)
    return copied


@pytest.mark.parametrize("tied", [False, True])
def test_autocast_copies_priced_are_the_weights_autocast_casts(tied: bool) -> None:
    """The planner charges autocast's 2-byte copy only for the weights torch.autocast really casts (those read
    by linear / matmul / conv): not the embedding tables (an embedding lookup is on neither autocast list) nor
    the layer norms' weights. With tied embeddings the table is cast where the logits' linear reads it."""
    from autopar.api import cost_model
    from autopar.solver.pricing.model import Option
    from autopar.solver.pricing.stage_memory import stage_memory

    c = models.gpt(vocab=512, hidden=64, layers=2, seq=32, tie_embeddings=tied)
    copied = _autocast_copied(c.model, *c.example_inputs)
    assert "wpe.weight" not in copied and not any("ln" in n for n in copied)
    assert ("wte.weight" in copied) == tied  # the tied table only through lm_head's linear
    cm = cost_model(c.model, "1x1xA100-80GB", c.example_inputs, c.example_target, c.loss_fn, precision="bf16")
    base = cm.base(0, cm.L, "A100-80GB", cm.B, (0,))
    assert base.cast_params == sum(copied.values())
    assert base.params - base.cast_params >= c.model.wpe.weight.numel() + (0 if tied else c.model.wte.weight.numel())
    # per micro-batch in flight the stage holds 2 bytes for each of them, on top of the saved activations
    mem = stage_memory(cm, base, Option(0, False, ()), 1, 1)
    assert mem.act - base.act == pytest.approx(2 * sum(copied.values()))
