"""Capture: own models and transformers models become graphs with shapes and a coarse layer chain."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

import autopar
from autopar import models
from autopar.errors import CaptureError
from autopar.ir.graph import TrainingGraph

OWN = {"mlp": {"layers": 3}, "cnn": {"blocks": 2}, "gpt": {"layers": 3}, "llama": {"layers": 2},
       "moe_gpt": {"layers": 2}, "gnn": {"layers": 3}}
HF = ["hf_gpt2", "hf_llama", "hf_mixtral", "hf_bert"]


def _capture(case: models.ModelCase) -> TrainingGraph:
    return autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("name", list(OWN))
def test_own_models_capture_with_shapes_and_blocks(name: str, device: str) -> None:
    kwargs = OWN[name]
    case = models.CASES[name](device=device, **kwargs)
    g = _capture(case)
    n_blocks = next(iter(kwargs.values()))
    assert all(n.outputs for n in g.nodes.values() if not n.target.startswith("aten._assert")), \
        "every op node carries its output shape/dtype"
    blocks = [layer for layer in g.layers if layer.kind == "block"]
    assert len(blocks) == n_blocks
    shapes = [[g.params[p].meta.shape for p in b.params] for b in blocks]
    if name == "gnn":  # first/last message-passing layers change the feature width
        for a, b in zip(blocks, blocks[1:], strict=False):
            assert (a.signature == b.signature) == (shapes[a.index - 1] == shapes[b.index - 1])
    else:
        assert g.repeated_groups() == [[b.index for b in blocks]]
    # every node belongs to exactly one layer, in chain order
    assert sorted(x for layer in g.layers for x in layer.nodes) == sorted(g.nodes)
    assert [n.layer for n in g.nodes.values()] == sorted(n.layer for n in g.nodes.values())
    real = {id(p): p for p in case.model.parameters()}
    assert g.num_params() == sum(p.numel() for p in real.values())
    assert g.loss_node in g.nodes and g.nodes[g.loss_node].outputs[0].shape == ()
    assert g.batch_size == case.example_inputs[0].shape[0]


@pytest.mark.parametrize("name", HF)
def test_transformers_models_capture(name: str) -> None:
    pytest.importorskip("transformers")
    case = models.CASES[name](device="meta", layers=2)
    g = _capture(case)
    blocks = [layer for layer in g.layers if layer.kind == "block"]
    assert len(blocks) == 2 and g.repeated_groups() == [[b.index for b in blocks]]
    assert g.layers[0].kind == "pre" and g.layers[-1].kind == "post"
    assert g.num_params() == sum(p.numel() for p in case.model.parameters())  # parameters() dedups ties


def test_tied_embeddings_counted_once() -> None:
    case = models.gpt(tie_embeddings=True)
    g = _capture(case)
    tied = [p for p in g.params.values() if p.tied_to]
    assert len(tied) == 1 and g.params[tied[0].tied_to].meta.shape == tied[0].meta.shape
    assert g.num_params() == sum(p.numel() for p in case.model.parameters())


def test_gpt3_175b_shape_on_meta() -> None:
    cfg = models.gpt_config("gpt3-175b")
    case = models.gpt(**cfg, batch=2, device="meta")
    g = _capture(case)
    blocks = [layer for layer in g.layers if layer.kind == "block"]
    assert len(blocks) == 96 and len(g.repeated_groups()) == 1
    h, v, s = cfg["hidden"], cfg["vocab"], cfg["seq"]
    closed_form = 96 * (12 * h * h + 13 * h) + v * h + s * h + 2 * h
    assert g.num_params() == pytest.approx(closed_form, rel=1e-3)


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent control flow
            return y.sum()
        return -y.sum()


def test_data_dependent_control_flow_names_the_line() -> None:
    with pytest.raises(CaptureError) as e:
        autopar.capture(_Branchy(), (torch.randn(2, 4),))
    msg = str(e.value)
    assert "test_capture.py" in msg and "if y.sum() > 0" in msg
    assert "torch.where" in msg or "torch.cond" in msg


def test_non_scalar_output_without_loss_fn_says_what_to_pass() -> None:
    with pytest.raises(CaptureError, match="loss_fn"):
        autopar.capture(nn.Linear(4, 4), (torch.randn(2, 4),))


def test_loss_fn_without_target_is_rejected() -> None:
    with pytest.raises(CaptureError, match="example_target"):
        autopar.capture(nn.Linear(4, 4), (torch.randn(2, 4),), loss_fn=nn.functional.mse_loss)


def test_graph_json_round_trip_and_dump(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AUTOPAR_DUMP", str(tmp_path))
    case = models.gpt(layers=2)
    g = autopar.analyze(case.model, "1x2xA100-80GB+1x2xT4", example_inputs=case.example_inputs,
                        example_target=case.example_target, loss_fn=case.loss_fn)
    assert {"graph.txt", "graph.json", "graph.dot"} <= {p.name for p in tmp_path.iterdir()}
    back = TrainingGraph.from_dict(json.loads((tmp_path / "graph.json").read_text()))
    assert back.to_dict() == g.to_dict()
    text = (tmp_path / "graph.txt").read_text()
    assert "TOTAL" in text and "fwd A100-80GB" in text and "fwd T4" in text
    assert (tmp_path / "graph.dot").read_text().startswith("digraph")


def test_a_plans_dumped_graph_names_each_nodes_source(tmp_path, monkeypatch) -> None:
    """`plan` captures without per-node source lines unless it dumps (the dump's graph.json shows them)."""
    case = models.gpt(layers=2)
    args = dict(example_inputs=case.example_inputs, example_target=case.example_target, loss_fn=case.loss_fn)
    monkeypatch.setenv("AUTOPAR_DUMP", str(tmp_path))
    autopar.plan(case.model, "1x2xA100-80GB", **args)
    nodes = json.loads((tmp_path / "graph.json").read_text())["nodes"]
    assert any("models.py:" in n["source"] for n in nodes)


class _Offsets(nn.Module):
    """A forward that makes tensors from Python data on its input's device (as transformers' Falcon does):
    export lifts them out of the graph as constants."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shift = torch.tensor([-2, -1], device=x.device)
        return self.proj(x).roll(1, -1) * shift.sum() + torch.tensor([3.0], device=x.device)


def test_meta_capture_keeps_the_values_of_lifted_constants() -> None:
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    mse = nn.functional.mse_loss
    cpu = autopar.capture(_Offsets(), (x,), mse, y)
    with torch.device("meta"):
        meta_model = _Offsets()
    meta = autopar.capture(meta_model, (x,), mse, y)  # real inputs beside a meta model: converted
    want = {k: v for k, v in cpu.gm.constants.items()}
    got = {k: v for k, v in meta.gm.constants.items()}
    assert len(want) == 2 and got.keys() == want.keys()
    for k, v in want.items():
        assert not got[k].is_meta, k
        torch.testing.assert_close(got[k], v, rtol=0, atol=0)
    assert all(p.is_meta for p in meta_model.parameters())  # the capture put the model back as it was


def test_lifted_constants_train_from_a_meta_model() -> None:
    """The program makes a lifted constant itself (it is in no weights file and not in the state_dict)."""
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with torch.device("meta"):
        meta_model = _Offsets()
    prog = autopar.compile(meta_model, "1x1xcpu", (x,), y, nn.functional.mse_loss, "adamw", precision="fp32")
    ref = autopar.materialize(_Offsets().to("meta"), seed=0)
    losses = [prog.step(x, target=y) for _ in range(2)]
    ref_opt = torch.optim.AdamW(ref.parameters())
    for want_loss in losses:
        loss = nn.functional.mse_loss(ref(x), y)
        torch.testing.assert_close(loss.item(), want_loss, rtol=1e-5, atol=1e-6)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()


def test_plan_takes_a_meta_model_with_real_inputs() -> None:
    from autopar.hf_models import hf_gpt2

    meta, real = hf_gpt2(device="meta"), hf_gpt2()
    plan = autopar.plan(meta.model, "1x2xA100-80GB", real.example_inputs, real.example_target, meta.loss_fn)
    assert plan.world_size == 2


def test_a_capture_without_sources_is_the_same_graph() -> None:
    """`sources=False` (a rank's capture at its micro-batch size) records no stack traces: the same nodes,
    ops, shapes, layers and program, only `OpNode.source` empty; torch's flag is restored after it."""
    import torch.fx.config as fx_config

    case = models.gpt(layers=2, seed=0)
    full = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    bare = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target, sources=False)
    assert fx_config.do_not_emit_stack_traces is False
    assert any(n.source for n in full.nodes.values()) and not any(n.source for n in bare.nodes.values())
    strip = {name: dataclasses.replace(n, source="") for name, n in full.nodes.items()}
    assert strip == bare.nodes
    assert full.layers == bare.layers
    assert full.gm.graph_module.code == bare.gm.graph_module.code
