"""Annotation: FLOPs, training-state bytes and saved activations against torch's own accounting."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import autopar
from autopar import models
from autopar.cost_models.memory import training_state_bytes
from autopar.graph import TrainingGraph
from autopar.passes.annotate import annotate

CLUSTER = autopar.Cluster.load("1x2xA100-80GB+1x2xT4")


def _annotated(case: models.ModelCase, precision: str = "fp32") -> TrainingGraph:
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    return annotate(g, CLUSTER, precision=precision)


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


def _real_saved_bytes(case: models.ModelCase) -> int:
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
    real = _real_saved_bytes(case)
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
    bf16 = _annotated(case, precision="bf16")
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
