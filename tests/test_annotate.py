"""Annotation: FLOPs, training-state bytes and saved activations against torch's own accounting."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import autopar
from autopar import models
from autopar.codegen.fusion import find_regions, fused_bytes
from autopar.cost_models.compute import ComputeModel, pointwise_flops
from autopar.cost_models.memory import training_state_bytes
from autopar.ir.graph import TrainingGraph
from autopar.passes.annotate import annotate

CLUSTER = autopar.Cluster.load("1x2xA100-80GB+1x2xT4")


def _annotated(case: models.ModelCase, precision: str = "fp32", kernels: str = "torch") -> TrainingGraph:
    """Priced as eager torch runs it (kernels="torch"), which is what these tests compare against."""
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    return annotate(g, CLUSTER, precision=precision, kernels=kernels)


def _reference_flops(case: models.ModelCase) -> tuple[int, int]:
    with FlopCounterMode(display=False) as fwd:
        loss = models.loss_of(case)
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


@pytest.mark.parametrize("name,kwargs", [("mlp", {}), ("cnn", {}), ("gnn", {})])
def test_flops_match_flop_counter_mode(name: str, kwargs: dict) -> None:
    case = models.CASES[name](**kwargs)
    g = _annotated(case)
    fwd, bwd = _reference_flops(case)
    assert fwd > 0
    assert g.total("flops_fwd") == fwd
    assert g.total("flops_bwd") == bwd


def test_gpt_flops_match_closed_form() -> None:
    b, s, h, v, n_layers, heads = 4, 32, 64, 128, 3, 4
    case = models.gpt(batch=b, seq=s, hidden=h, vocab=v, layers=n_layers, heads=heads)
    g = _annotated(case)
    attention = 4 * b * s * s * h  # QK^T and PV
    dense = 24 * b * s * h * h  # qkv (3h^2) + out proj (h^2) + MLP (8h^2), 2 FLOPs per MAC
    head = 2 * b * s * h * v
    assert g.total("flops_fwd") == n_layers * (dense + attention) + head
    # backward: twice the forward for every matmul (all inputs need grad), 2.5x for attention
    assert g.total("flops_bwd") == n_layers * (2 * dense + 2.5 * attention) + 2 * head
    for layer in g.layers:
        if layer.kind == "block":
            assert layer.flops_fwd == dense + attention


@pytest.mark.parametrize("optimizer,cls", [("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam),
                                            ("sgd_momentum", None)])
def test_training_state_bytes_exact(optimizer: str, cls) -> None:
    case = models.gpt(layers=2, tie_embeddings=True)
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    params = list(case.model.parameters())
    opt = cls(params, lr=1e-3) if cls else torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    models.loss_of(case).backward()
    opt.step()
    state = training_state_bytes(g, optimizer)
    assert state["weights"] == sum(p.numel() * p.element_size() for p in params)
    assert state["grads"] == sum(p.grad.numel() * p.grad.element_size() for p in params)
    real_opt = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                   if isinstance(t, torch.Tensor))
    assert state["optimizer"] == real_opt


def test_mixed_precision_state_is_16_bytes_per_param() -> None:
    case = models.mlp()
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    state = training_state_bytes(g, "adamw", precision="bf16")
    n = g.num_params()
    assert state["weights"] + state["grads"] + state["optimizer"] == 16 * n + 4 * len(g.params)


def real_saved_bytes(case: models.ModelCase) -> int:
    """Bytes of the unique storages autograd saves for one forward of `case`, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in case.model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = models.loss_of(case)
    del loss
    return sum(seen.values())


@pytest.mark.parametrize("name,kwargs", [
    ("mlp", {}), ("cnn", {}), ("gpt", {"layers": 2, "seq": 64}), ("llama", {"layers": 2}), ("gnn", {}),
    ("moe_gpt", {"layers": 2}), ("hf_gpt2", {"layers": 2}), ("hf_bert", {"layers": 2}),
])
def test_saved_activation_bytes_within_10_percent_of_a_real_run(name: str, kwargs: dict) -> None:
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    case = models.CASES[name](**kwargs)
    g = _annotated(case)
    real = real_saved_bytes(case)
    assert real > 0
    assert g.saved_activation_bytes() == pytest.approx(real, rel=0.10)


def test_meta_and_cpu_captures_annotate_identically() -> None:
    a = _annotated(models.gpt(layers=2, device="meta"))
    b = _annotated(models.gpt(layers=2, device="cpu"))
    assert a.total("flops_fwd") == b.total("flops_fwd")
    assert a.saved_activation_bytes() == b.saved_activation_bytes()


def test_times_per_device_type_and_precision() -> None:
    case = models.gpt(layers=2, hidden=256, seq=128, heads=4, device="meta")
    fp32 = _annotated(case)
    bf16 = _annotated(case, precision="fp16")  # mixed precision: the T4 has no bf16, so fp16
    for layer in fp32.layers:
        assert set(layer.time_fwd) == {"A100-80GB", "T4"}
    block = next(x for x in fp32.layers if x.kind == "block")
    assert block.time_fwd["T4"] > block.time_fwd["A100-80GB"] > 0
    assert block.time_bwd["A100-80GB"] > block.time_fwd["A100-80GB"]
    block16 = next(x for x in bf16.layers if x.kind == "block")
    assert block16.saved_bytes == pytest.approx(block.saved_bytes / 2, rel=0.02)
    assert block16.time_fwd["A100-80GB"] < block.time_fwd["A100-80GB"]


def test_layer_boundaries_carry_the_hidden_state() -> None:
    b, s, h = 4, 32, 64
    g = _annotated(models.gpt(batch=b, seq=s, hidden=h, layers=3))
    blocks = [x for x in g.layers if x.kind == "block"]
    for layer in blocks[:-1]:
        assert layer.boundary_bytes == b * s * h * 4  # the residual stream, fp32


def test_fused_regions_are_priced_as_one_kernel_where_the_kernels_mode_fuses() -> None:
    b, s, h = 4, 32, 64
    case = models.gpt(batch=b, seq=s, hidden=h, layers=2)
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    mixed = autopar.Cluster.load("1x1xA100-80GB+1x1xcpu")
    auto, eager = annotate(g, mixed, kernels="auto"), annotate(g, mixed, kernels="torch")
    assert (auto.kernels, auto.fused_types, eager.fused_types) == ("auto", ["A100-80GB"], [])
    assert TrainingGraph.from_dict(auto.to_dict()).fused_types == ["A100-80GB"]
    gpu = ComputeModel(mixed.spec("A100-80GB"))
    for fused, plain in zip(auto.layers, eager.layers, strict=True):
        assert fused.time_fwd["cpu"] == plain.time_fwd["cpu"]  # auto: the cpu type runs torch ops
        assert fused.time_bwd["cpu"] == plain.time_bwd["cpu"]
        faster = (lambda a, b: a < b) if fused.kind == "block" else (lambda a, b: a <= b)
        assert faster(fused.time_fwd["A100-80GB"], plain.time_fwd["A100-80GB"])
        assert faster(fused.time_bwd["A100-80GB"], plain.time_bwd["A100-80GB"])
    # the MLP's bias + GELU, by hand: the kernel reads the matmul output and the bias, writes GELU's output
    region = next(r for r in find_regions(g.gm.graph_module) if r.kind == "bias_act")
    (gelu,) = [n for n in region.nodes if "gelu" in str(n.target)]
    (head,) = region.heads
    after = 4 * (2 * b * s * 4 * h + 4 * h)
    assert fused_bytes(region)[1] == after < fused_bytes(region)[0]
    unfused_gelu = eager.nodes[gelu.name].time_fwd["A100-80GB"]
    by_hand = gpu.op_time("elementwise", pointwise_flops("aten.gelu.default", b * s * 4 * h), after)
    assert auto.nodes[gelu.name].time_fwd["A100-80GB"] == pytest.approx(by_hand, rel=1e-12)
    assert auto.nodes[head.name].time_fwd == eager.nodes[head.name].time_fwd  # the matmul stays in torch
    assert by_hand < unfused_gelu + eager.nodes[head.name].time_fwd["A100-80GB"]
    # every type fuses ("triton", or auto on GPUs only): kernels and saved tensors are the fused program's
    triton = annotate(g, mixed, kernels="triton")
    assert [k.op for k in triton.nodes[gelu.name].kernels_fwd] == ["fused.bias_act"]
    assert triton.nodes[gelu.name].saved == sorted([head.name, region.inputs[1].name])  # the inputs it saves
    assert triton.layers[1].time_fwd["cpu"] < eager.layers[1].time_fwd["cpu"]
    assert auto.layers[1].saved_bytes == eager.layers[1].saved_bytes  # mixed: memory as eager runs it
    with pytest.raises(autopar.errors.PlanError, match="kernels mode 'fast'"):
        annotate(g, mixed, kernels="fast")
    # plans price what will run, and say which mode they were priced for
    ests = {k: autopar.estimate(case.model, "1x1xA100-80GB", autopar.Strategy(), case.example_inputs,
                                case.example_target, case.loss_fn, kernels=k) for k in ("auto", "torch")}
    assert ests["auto"].plan.model["kernels"] == "auto"
    assert ests["auto"].plan.model["fused_device_types"] == ["A100-80GB"]
    assert ests["torch"].plan.model["fused_device_types"] == []
    assert ests["auto"].predicted["step_time_s"] < ests["torch"].predicted["step_time_s"]


def test_saved_bytes_with_fusion_match_what_the_fused_program_saves() -> None:
    pytest.importorskip("triton")
    from autopar.codegen.kernels import apply_kernels
    from autopar.codegen.split import split_stages

    case = models.gpt(hidden=64, layers=2, seq=64)
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    (st,) = split_stages(g, [(0, len(g.layers))])
    named = {**dict(case.model.named_parameters()), **dict(case.model.named_buffers())}
    user = [*case.example_inputs, case.example_target]
    params = [named[p].detach().clone().requires_grad_(True) for p in st.params]
    args = params + [named[b] for b in st.buffers] + [user[i] for i in st.inputs]
    fused, report = apply_kernels(st.gm, "triton", example_inputs=args)
    assert report.fused
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fused(*args)
    cluster = autopar.Cluster.load("1x1xA100-80GB")
    priced = annotate(g, cluster, kernels="triton").saved_activation_bytes()
    assert priced != annotate(g, cluster, kernels="torch").saved_activation_bytes()
    # regions are priced per layer; the program also fuses across layer boundaries
    assert priced == pytest.approx(sum(seen.values()), rel=0.05)
