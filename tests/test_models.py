import importlib.util
import math

import pytest
import torch
from torch import nn

from autopar.models import CASES, GPT, ModelCase, gpt, gpt_config, llama, loss_of, moe_gpt

OWN = ["mlp", "cnn", "gpt", "llama", "moe_gpt", "gnn"]
HF_NAMES = ["hf_gpt2", "hf_llama", "hf_mixtral", "hf_bert"]
_no_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers missing")
HF = [pytest.param(n, marks=_no_hf) for n in HF_NAMES]


class LossWrapper(nn.Module):
    """forward(*inputs, target) -> scalar loss, the shape of module autopar captures."""

    def __init__(self, case: ModelCase):
        super().__init__()
        self.model, self.loss_fn = case.model, case.loss_fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        *inputs, target = args
        return self.loss_fn(self.model(*inputs), target)


# trained on 4 ranks by tests/test_hf_architectures.py
HF_ARCHITECTURES = ["hf_qwen2", "hf_mistral", "hf_bloom", "hf_gpt_neox", "hf_gptj", "hf_falcon", "hf_qwen2_moe",
                    "hf_t5", "hf_vit", "hf_convnext"]


def test_case_registry():
    assert sorted(CASES) == sorted(OWN + HF_NAMES + HF_ARCHITECTURES)


@pytest.mark.parametrize("name", OWN + HF)
def test_cpu_forward_backward_reaches_every_param(name):
    case = CASES[name]()
    assert case.name == name
    loss = loss_of(case)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    no_grad = [n for n, p in case.model.named_parameters()
               if n not in case.unused_params and (p.grad is None or not p.grad.abs().sum() > 0)]
    assert not no_grad
    for p in case.model.parameters():
        assert p.grad is None or torch.isfinite(p.grad).all()


@pytest.mark.parametrize("name", OWN + HF)
def test_builds_on_meta(name):
    case = CASES[name](device="meta")
    tensors = [*case.model.parameters(), *case.model.buffers(), *case.example_inputs, case.example_target]
    assert all(t.is_meta for t in tensors)
    if name in OWN:  # HF causal masks call .item() on eager meta tensors; export (below) still works
        assert loss_of(case).shape == ()


@pytest.mark.parametrize("name", OWN + HF)
def test_repeated_blocks_live_in_module_list(name):
    model = CASES[name](device="meta").model
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) >= 2]
    assert any(len({type(b) for b in m}) == 1 for m in lists)


@pytest.mark.parametrize("name", OWN + HF)
def test_seed_determinism(name):
    a, b, c = CASES[name](seed=3), CASES[name](seed=3), CASES[name](seed=4)
    pa, pb, pc = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert all(torch.equal(x, y) for x, y in zip(a.example_inputs, b.example_inputs, strict=True))
    assert not all(torch.equal(pa[k], pc[k]) for k in pa)


def test_factories_leave_global_rng_alone():
    state = torch.random.get_rng_state()
    gpt(seed=123)
    assert torch.equal(state, torch.random.get_rng_state())


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("name", OWN + HF)
def test_export_non_strict(name, device):
    case = CASES[name](device=device)
    ep = torch.export.export(LossWrapper(case), (*case.example_inputs, case.example_target), strict=False)
    assert len(ep.graph_signature.user_outputs) == 1


def test_loss_of_defaults_match_explicit_inputs():
    case = gpt()
    assert torch.equal(loss_of(case), loss_of(case, *case.example_inputs, target=case.example_target))


def test_gpt3_175b_on_meta_is_right_sized():  # its build time: bench/fast_paths.py
    cfg = gpt_config("gpt3-175b")
    case = gpt(**cfg, batch=1, device="meta")
    n_params = sum(p.numel() for p in case.model.parameters())
    # Per layer: attention 4h^2 (qkv + out), MLP 8h^2 (h -> 4h -> h); biases and norms are O(h).
    # Embeddings: tokens V*h (shared with the tied LM head) + positions S*h.
    L, h, V, S = cfg["layers"], cfg["hidden"], cfg["vocab"], cfg["seq"]
    closed_form = 12 * L * h**2 + (V + S) * h
    assert abs(n_params - closed_form) / closed_form < 0.02
    assert 170e9 < n_params < 180e9


@pytest.mark.parametrize("preset, factory, expected", [
    ("gpt2-small", gpt, 124.4e6), ("gpt2-medium", gpt, 354.8e6), ("gpt-1.3b", gpt, 1.316e9),
    ("llama-7b", llama, 6.74e9),
])
def test_presets_match_published_sizes(preset, factory, expected):
    model = factory(**gpt_config(preset), batch=1, device="meta").model
    n_params = sum(p.numel() for p in model.parameters())
    assert math.isclose(n_params, expected, rel_tol=0.01)


def test_moe_routing_is_exact_top_k():
    case = moe_gpt(experts=4, top_k=2)
    assert isinstance(case.model, GPT)
    moe = case.model.blocks[0].mlp
    gates = moe.gates(torch.randn(3, 5, case.model.config.hidden))
    assert ((gates > 0).sum(-1) == 2).all()
    torch.testing.assert_close(gates.sum(-1), torch.ones(3, 5))


def test_gpt_tied_embeddings_share_storage():
    model = gpt(tie_embeddings=True).model
    assert model.lm_head.weight is model.wte.weight
