"""Compute-time model: op classification, roofline limits, profiles, calibration on this host."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest

from autopar.cluster import device_spec
from autopar.cost_models.compute import (
    OP_KINDS,
    ComputeModel,
    Profile,
    classify,
    default_curves,
    load_profile,
    pointwise_flops,
    profile_dir,
)


@pytest.fixture(autouse=True)
def _no_saved_profiles(tmp_path, monkeypatch):
    """Keep the user's ~/.cache profiles out of the tests; reset the cached CPU spec after."""
    from autopar.cost_models import host

    monkeypatch.setenv("AUTOPAR_PROFILE_DIR", str(tmp_path / "profiles"))
    host.cpu_spec.cache_clear()
    yield
    host.cpu_spec.cache_clear()


@pytest.mark.parametrize("target, kind", [
    ("aten.mm.default", "matmul"), ("aten.addmm.default", "matmul"), ("aten.linear.default", "matmul"),
    ("aten.bmm.default", "matmul"), ("aten.matmul.default", "matmul"), ("aten::addmm", "matmul"),
    ("aten.scaled_dot_product_attention.default", "attention"),
    ("aten._scaled_dot_product_flash_attention.default", "attention"),
    ("aten._scaled_dot_product_flash_attention_for_cpu_backward.default", "attention"),
    ("aten._scaled_dot_product_efficient_attention_backward.default", "attention"),
    ("aten.convolution.default", "conv"), ("aten.convolution_backward.default", "conv"),
    ("aten.conv2d.default", "conv"), ("aten.layer_norm.default", "norm"),
    ("aten.native_layer_norm_backward.default", "norm"), ("aten._native_batch_norm_legit.default", "norm"),
    ("aten.group_norm.default", "norm"), ("aten.rms_norm.default", "norm"),
    ("aten._softmax.default", "softmax"), ("aten._log_softmax_backward_data.default", "softmax"),
    ("aten.cross_entropy_loss.default", "softmax"), ("aten.sum.dim_IntList", "reduction"),
    ("aten.mean.dim", "reduction"), ("aten.nll_loss_forward.default", "reduction"),
    ("aten.max_pool2d_with_indices_backward.default", "reduction"),
    ("aten.embedding.default", "embedding"), ("aten.embedding_dense_backward.default", "embedding"),
    ("aten.index_select.default", "gather"), ("aten.index_add.default", "gather"),
    ("aten.relu.default", "elementwise"), ("aten.relu_.default", "elementwise"),
    ("aten.add.Tensor", "elementwise"),
    ("aten.add_.Tensor", "elementwise"), ("aten.gelu.default", "elementwise"),
    ("aten.gelu_backward.default", "elementwise"), ("aten.threshold_backward.default", "elementwise"),
    ("aten.native_dropout.default", "elementwise"), ("aten.clone.default", "elementwise"),
    ("aten._to_copy.default", "elementwise"), ("aten.cat.default", "elementwise"),
    ("aten.where.self", "elementwise"), ("aten.view.default", "view"), ("aten._unsafe_view.default", "view"),
    ("aten.reshape.default", "view"), ("aten.permute.default", "view"), ("aten.expand.default", "view"),
    ("aten.slice.Tensor", "view"), ("aten.select.int", "view"), ("aten.t.default", "view"),
    ("aten.transpose.int", "view"), ("aten.unsqueeze.default", "view"), ("aten.detach.default", "view"),
    ("aten.alias.default", "view"), ("aten.split.Tensor", "view"), ("aten.empty.memory_format", "view"),
    ("aten.sym_size.int", "view"), ("torch.ops.aten.mm.default", "matmul"),
    ("aten.some_new_op.default", "other"), ("aten._foreach_mul_.Scalar", "elementwise"),
    ("torch.nn.functional.gelu", "elementwise"), ("<built-in function add>", "elementwise"),
    ("<built-in function getitem>", "view"), ("torch.matmul", "matmul"), ("aten::_softmax", "softmax"),
])
def test_classify(target, kind):
    assert classify(target) == kind
    assert kind in OP_KINDS


def test_pointwise_flops_scale():
    assert pointwise_flops("aten.add.Tensor", 1000) == 1000
    assert pointwise_flops("aten.gelu.default", 1000) > 10 * 1000
    softmax_bwd = pointwise_flops("aten._softmax_backward_data.default", 10)
    assert pointwise_flops("aten._softmax.default", 10) > softmax_bwd


def _gpu_model(name="A100-80GB", dtype="bf16"):
    return ComputeModel(device_spec(name), dtype=dtype)


def test_defaults_without_profile():
    m = _gpu_model()
    assert not m.calibrated
    assert m.peak == pytest.approx(312e12)
    curves, overhead = default_curves("gpu")
    assert overhead == pytest.approx(6e-6)
    assert curves["matmul"]["flop"]["eff_max"] == pytest.approx(0.75)
    assert curves["elementwise"]["bw"]["eff_max"] == pytest.approx(0.8)
    assert "view" not in curves


def test_huge_matmul_approaches_eff_max_peak():
    m = _gpu_model()
    flops = 1e16
    t = m.op_time("matmul", flops, 1e9)
    # A100 SXM bf16 torch.mm: 267.9 TFLOP/s at best (ml-engineering's MAMF table), 85.9% of 312
    assert flops / t == pytest.approx(267.9e12, rel=0.01)
    eff_f, _ = m.efficiency("matmul", flops, 1e9)
    assert eff_f == pytest.approx(0.86, rel=1e-3)
    # a device without a catalog profile keeps the generic 75%
    generic = ComputeModel(replace(device_spec("A100-80GB"), name="my-gpu"), dtype="bf16")
    assert generic.efficiency("matmul", flops, 1e9)[0] == pytest.approx(0.75, rel=1e-3)


def test_efficiency_rises_with_size():
    m = _gpu_model()
    effs = [m.efficiency("matmul", f, f / 100)[0] for f in (1e6, 1e8, 1e10, 1e12)]
    assert effs == sorted(effs) and effs[0] < 0.5 * effs[-1]
    bw = [m.efficiency("elementwise", 0, b)[1] for b in (1e3, 1e5, 1e7, 1e9)]
    assert bw == sorted(bw)


def test_tiny_op_costs_the_overhead():
    m = _gpu_model()
    for kind in ("matmul", "elementwise", "norm", "softmax", "embedding", "gather", "other"):
        # The launch overhead plus the kernel's minimum latency (half / (peak * eff_max)).
        assert m.overhead < m.op_time(kind, 100, 400) < 2 * m.overhead
    assert m.op_time("view", 1e9, 1e9) == 0.0
    assert m.op_time("matmul", 100, 400, launches=2) == pytest.approx(2 * m.op_time("matmul", 50, 200))


def test_bandwidth_bound_time_proportional_to_bytes():
    m = _gpu_model()
    t1 = m.op_time("elementwise", 1e8, 4e9) - m.overhead
    t2 = m.op_time("elementwise", 2e8, 8e9) - m.overhead
    assert t2 / t1 == pytest.approx(2.0, rel=1e-3)
    assert t1 == pytest.approx(4e9 / (0.9 * 2039e9), rel=1e-3)  # HBM2e copies: ~90% (gpu_profiles.py)
    # Embedding is a gather: bandwidth-bound, its FLOPs ignored.
    assert m.op_time("embedding", 1e15, 1e6) == m.op_time("embedding", 0, 1e6)


def test_low_intensity_matmul_is_memory_bound():
    m = _gpu_model()
    flops, nbytes = 2 * 16 * 8192 * 8192, 2 * 8192 * 8192  # a skinny GEMM: weights dominate
    t = m.op_time("matmul", flops, nbytes)
    assert t > nbytes / m.bandwidth


def test_edge_devices_are_less_efficient():
    orin = _gpu_model("Jetson-AGX-Orin")
    a100 = _gpu_model()
    assert orin.overhead > a100.overhead
    assert orin.efficiency("matmul", 1e13, 1e9)[0] < a100.efficiency("matmul", 1e13, 1e9)[0]


def test_unknown_kind_falls_back_to_other():
    m = _gpu_model()
    assert m.op_time("no-such-kind", 0, 1e8) == m.op_time("other", 0, 1e8)


def test_profile_json_round_trip(tmp_path):
    curves, overhead = default_curves("gpu")
    curves["elementwise"]["bw"] = {"table": [[3.0, 0.1], [6.0, 0.9], [9.0, 0.5]]}
    p = Profile(device="A100-80GB", curves=curves, overhead_s=overhead, peak_flops=None,
                memory_bandwidth=1.9e12, meta={"dtype": "bf16", "note": "hand-written"})
    q = Profile.from_json(p.to_json())
    assert q == p
    path = p.save(tmp_path / "sub" / "x.json")
    assert Profile.load(path) == p


def test_load_profile_finds_saved_profile():
    assert load_profile("A100-80GB") is None
    curves, _ = default_curves("gpu")
    curves["matmul"]["flop"] = {"eff_max": 0.5, "half": 0.0}
    Profile(device="A100-80GB", curves=curves, overhead_s=1e-5, meta={"dtype": "bf16"}).save(
        profile_dir() / "A100-80GB.json")
    m = _gpu_model()
    assert m.calibrated and m.overhead == pytest.approx(1e-5)
    assert m.efficiency("matmul", 1e15, 1e9)[0] == pytest.approx(0.5)


def test_corrupt_profile_is_ignored_with_a_warning():
    profile_dir().mkdir(parents=True, exist_ok=True)
    (profile_dir() / "T4.json").write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable compute profile"):
        assert load_profile("T4") is None


def test_table_curve_interpolates_in_log_size():
    curves, _ = default_curves("gpu")
    curves["elementwise"] = {"flop": None, "bw": {"table": [[4.0, 0.2], [6.0, 0.6]]}}
    m = ComputeModel(device_spec("T4"), Profile("T4", curves, 0.0, meta={"dtype": "fp32"}))
    assert m.efficiency("elementwise", 0, 1e5)[1] == pytest.approx(0.4)
    assert m.efficiency("elementwise", 0, 1e2)[1] == pytest.approx(0.2)  # clamped at the ends
    assert m.efficiency("elementwise", 0, 1e9)[1] == pytest.approx(0.6)


def test_calibrate_quick_saves_the_profile_the_model_uses():
    """The quick calibration saves a profile that load_profile and cpu_spec pick up. How well it predicts
    single ops is timed in bench/cost_model.py (timing has no place in a test on a shared host)."""
    import torch

    from autopar.cost_models.calibrate import calibrate
    from autopar.cost_models.host import cpu_spec

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "other processes kept N CPUs busy" on a shared host
        prof = calibrate(device="cpu", quick=True, save=True)
    assert (profile_dir() / "cpu.json").is_file()
    loaded = load_profile("cpu")
    assert loaded == prof
    assert loaded.meta["threads"] == torch.get_num_threads()
    assert set(loaded.curves) >= {"matmul", "elementwise", "norm", "softmax", "attention", "embedding",
                                  "gather", "conv"}
    spec = cpu_spec()
    assert spec.flops("fp32") == pytest.approx(loaded.peak_flops)
    assert spec.memory_bandwidth == pytest.approx(loaded.memory_bandwidth)
    model = ComputeModel(spec)
    assert model.calibrated
    small, large = (model.op_time("matmul", 2 * n**3, 3 * n * n * 4) for n in (256, 512))
    assert 0 < small < large

