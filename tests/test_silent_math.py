"""Nothing changes the math unasked (issue 24): the precision autopar chooses is announced when it differs from
the model's dtype, and ops the cost model cannot measure are named, not priced at zero in silence."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import autopar
from autopar import models
from autopar.compiler import warn_precision_change
from autopar.ir.precision import precision_change
from autopar.passes.annotate import annotate

MIXED = autopar.Cluster.load("1x2xA100-80GB+1x2xV100-16GB")


def test_the_default_gpu_precision_is_announced_per_device_type() -> None:
    with pytest.warns(autopar.PrecisionChangeWarning) as caught:
        warn_precision_change(nn.Linear(4, 4), MIXED, autopar.default_precision(MIXED))
    text = str(caught[0].message)
    assert "precision='fp16'" in text and "A100-80GB: fp16 autocast" in text and "V100-16GB: fp16" in text
    assert "dynamic loss scaling" in text and "precision='fp32'" in text


def test_tf32_is_a_change_only_where_tensor_cores_take_it() -> None:
    a100, v100 = autopar.Cluster.load("1x2xA100-80GB"), autopar.Cluster.load("1x2xV100-16GB")
    assert "TF32 matmuls" in precision_change(torch.float32, a100, "tf32")
    assert precision_change(torch.float32, v100, "tf32") is None  # a V100 has no TF32: fp32 math
    assert precision_change(torch.float32, autopar.Cluster.load("1x2xcpu"), "fp32") is None
    assert precision_change(torch.bfloat16, a100, "bf16") is None  # the model is already bf16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_precision_change(nn.Linear(4, 4), a100, "fp32")


def test_factory_and_cast_ops_are_measured_not_guessed() -> None:
    """arange / ones / to(dtype) / _assert_tensor_metadata used to fail measurement (their dtype and device
    arguments were passed as strings) and were priced by bytes in silence; every model here is measured whole."""
    for name, kw in (("gpt", {"layers": 2}), ("llama", {"layers": 2}), ("gnn", {}), ("hf_llama", {"layers": 2})):
        if name.startswith("hf_"):
            pytest.importorskip("transformers")
        case = models.CASES[name](seed=0, **kw)
        g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
        with warnings.catch_warnings():
            warnings.simplefilter("error", autopar.UnpricedOpWarning)
            annotate(g, autopar.Cluster.load("1x2xcpu"), "fp32")


def test_an_in_place_op_on_an_activation_is_measured() -> None:
    """hf_falcon adds into an activation in place (`add_`); measured on meta leaves that require grad it was
    refused ("a leaf Variable that requires grad is being used in an in-place operation") and priced by bytes."""
    pytest.importorskip("transformers")
    case = models.CASES["hf_falcon"](seed=0, batch=2)
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    assert any(str(n.target) == "aten.add_.Tensor" for n in g.nodes.values())
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.UnpricedOpWarning)
        annotate(g, autopar.Cluster.load("1x2xcpu"), "fp32")


def test_attention_with_a_learned_bias_is_measured() -> None:
    """hf_t5's attention adds a position bias that needs a gradient; the flash form sdpa is priced as refuses
    such a mask, so it was priced by bytes in silence-but-for-a-warning; torch runs the math formulation there,
    and that is what is measured now (its FLOPs and the softmax it saves)."""
    pytest.importorskip("transformers")
    case = models.CASES["hf_t5"](seed=0, batch=2)
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    sdpa = [n for n in g.nodes.values() if str(n.target) == "aten.scaled_dot_product_attention.default"]
    assert sdpa
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.UnpricedOpWarning)
        priced = annotate(g, autopar.Cluster.load("1x2xcpu"), "fp32")
    assert all(sum(k.flops for k in priced.nodes[n.name].kernels_fwd) > 0 for n in sdpa)


def test_an_unmeasurable_op_is_named_with_the_price_used(monkeypatch: pytest.MonkeyPatch) -> None:
    import autopar.passes.annotate as ann

    case = models.mlp(seed=0)
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    real = ann._measure

    def measure(target, arg_specs, kwarg_specs):  # noqa: ANN001
        if "linear" in str(target):
            raise RuntimeError("no meta kernel (test)")
        return real(target, arg_specs, kwarg_specs)

    monkeypatch.setattr(ann, "_measure", measure)
    with pytest.warns(autopar.UnpricedOpWarning, match=r"aten\.linear\.default \(\d+ node\(s\)") as caught:
        out = annotate(g, autopar.Cluster.load("1x2xcpu"), "fp32")
    assert "0 FLOPs" in str(caught[0].message)
    addmm = [n for n in out.nodes.values() if "linear" in str(n.target)]
    assert addmm and all(n.flops_fwd == 0 for n in addmm)


def test_explain_says_fp32_where_a_device_has_no_tf32() -> None:
    case = models.gpt(layers=2, device="meta")
    args = (case.example_inputs, case.example_target, case.loss_fn)
    for cluster, want in (("1x2xV100-16GB", "V100-16GB: fp32 (no TF32 tensor cores"),
                          ("1x2xA100-80GB", "A100-80GB: fp32 storage, TF32 matmuls")):
        est = autopar.estimate(case.model, cluster, autopar.Strategy(dp=2), *args, precision="tf32")
        assert want in est.plan.explain(), est.plan.explain()


def test_batch_statistics_warning_names_the_layers_by_kind() -> None:
    from autopar.passes.batch_stats import warn_if_batch_split

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4))
    with pytest.warns(autopar.BatchStatisticsWarning, match=r"1 \(BatchNorm2d\), 4 \(BatchNorm2d\)"):
        warn_if_batch_split(model, 2, 8, "the plan")


def test_the_search_module_is_not_hidden_by_its_function() -> None:
    import types

    import autopar.solver

    assert isinstance(autopar.solver.search.search, types.ModuleType)
    assert callable(autopar.solver.search.search.search)


def test_generated_kernels_say_how_they_round() -> None:
    """kernels="triton" (as "auto" on CUDA) swaps fused regions for generated kernels: compile says what that
    changes; "auto" on a CPU runs torch's ops and says nothing."""
    pytest.importorskip("triton")
    case = models.gpt(hidden=32, layers=1, batch=2, seq=8, dropout=0.1)
    args = (case.model, "1x1xcpu", case.example_inputs, case.example_target, case.loss_fn)
    with pytest.warns(autopar.FusedKernelWarning) as caught:
        autopar.compile(*args, kernels="triton")
    text = " ".join(str(w.message) for w in caught if issubclass(w.category, autopar.FusedKernelWarning))
    assert "evaluation order" in text and "kernels='torch'" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.FusedKernelWarning)
        autopar.compile(*args, kernels="auto")
