"""A zoo of small, deterministic models for tests, demos and benchmarks.

Every factory returns a :class:`ModelCase`. Factories take ``device`` (``"meta"`` builds parameters and
inputs without allocating or initialising data, so even GPT-3 175B shapes build instantly) and ``seed``.
Repeated blocks always live in an ``nn.ModuleList`` so later passes can detect them.

The Hugging Face clients live in :mod:`autopar.hf_models`, the case type and the helpers both use in
:mod:`autopar.model_case`; both are re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .hf_models import (
    hf_bert,
    hf_bloom,
    hf_convnext,
    hf_falcon,
    hf_gpt2,
    hf_gpt_neox,
    hf_gptj,
    hf_llama,
    hf_mistral,
    hf_mixtral,
    hf_qwen2,
    hf_qwen2_moe,
    hf_t5,
    hf_vit,
)
from .model_case import ModelCase, building, lm_loss, loss_of, token_batch, train_reference

__all__ = ["ModelCase", "CASES", "loss_of", "train_reference", "building", "lm_loss", "token_batch", "GPTConfig",
           "GPT", "Llama", "gpt_config", "mlp", "cnn", "gpt", "llama", "moe_gpt", "gnn", "hf_gpt2", "hf_llama",
           "hf_mixtral", "hf_bert", "hf_qwen2", "hf_mistral", "hf_bloom", "hf_gpt_neox", "hf_gptj", "hf_falcon",
           "hf_qwen2_moe", "hf_t5", "hf_vit", "hf_convnext"]


# ---------------------------------------------------------------------------------------------- MLP


class MLPBlock(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class MLP(nn.Module):
    def __init__(self, d_in: int, hidden: int, layers: int, d_out: int):
        super().__init__()
        self.stem = MLPBlock(d_in, hidden)
        self.blocks = nn.ModuleList(MLPBlock(hidden, hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def mlp(batch: int = 16, d_in: int = 64, hidden: int = 128, layers: int = 3, d_out: int = 10, *,
        device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    with building(device, seed):
        model = MLP(d_in, hidden, layers, d_out)
        x, y = torch.randn(batch, d_in), torch.randint(0, d_out, (batch,))
    return ModelCase(model, (x,), F.cross_entropy, y, "mlp")


# ---------------------------------------------------------------------------------------------- CNN


def _group_norm(channels: int) -> nn.GroupNorm:
    # GroupNorm instead of BatchNorm: no running stats, so the step is a pure function of params and batch.
    return nn.GroupNorm(math.gcd(8, channels), channels)


class ResBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1 = _group_norm(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = _group_norm(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm1(self.conv1(x)))
        return F.relu(x + self.norm2(self.conv2(h)))


class CNN(nn.Module):
    def __init__(self, channels: int, blocks: int, classes: int, in_channels: int = 3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, channels, 3, padding=1, bias=False),
                                  _group_norm(channels), nn.ReLU())
        self.blocks = nn.ModuleList(ResBlock(channels) for _ in range(blocks))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def cnn(batch: int = 8, channels: int = 16, image: int = 32, blocks: int = 2, classes: int = 10, *,
        device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    with building(device, seed):
        model = CNN(channels, blocks, classes)
        x, y = torch.randn(batch, 3, image, image), torch.randint(0, classes, (batch,))
    return ModelCase(model, (x,), F.cross_entropy, y, "cnn")


# ------------------------------------------------------------------------------------ GPT / MoE-GPT


@dataclass
class GPTConfig:
    vocab: int = 128
    seq: int = 32
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    ffn: int | None = None  # default 4 * hidden
    dropout: float = 0.0
    tie_embeddings: bool = False
    experts: int = 0  # > 0 turns every MLP into a routed mixture of experts
    top_k: int = 2

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.ffn is None:
            self.ffn = 4 * self.hidden
        if self.experts and not 0 < self.top_k <= self.experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, experts={self.experts}]")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads, self.dropout = cfg.heads, cfg.dropout
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, h))


class MatmulAttention(nn.Module):
    """Megatron-LM's unfused causal attention on a fused QKV projection: matmul, mask, softmax, matmul (what
    OPT and AMP's GPT-2 run), for tests that compare it with SDPA's `CausalSelfAttention`."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(h // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        return self.proj(torch.matmul(probs, v).transpose(1, 2).reshape(b, t, h))


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc = nn.Linear(hidden, ffn)
        self.proj = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class MoE(nn.Module):
    """Top-k routed experts, computed densely: every expert sees every token and the unselected ones get
    gate weight 0. Routing is exact (no capacity, no token dropping) and shapes are static, so the module
    exports without data-dependent shapes and sharded versions can match it bit-for-bit."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(hidden, ffn) for _ in range(experts))

    def gates(self, x: torch.Tensor) -> torch.Tensor:
        """(..., experts) combine weights: renormalised softmax probabilities of the top-k, else 0."""
        probs = self.router(x).softmax(dim=-1)
        weight, index = probs.topk(self.top_k, dim=-1)
        return torch.zeros_like(probs).scatter(-1, index, weight / weight.sum(dim=-1, keepdim=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.gates(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + gates[..., e : e + 1] * expert(x)
        return out


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.ffn is not None
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = (MoE(cfg.hidden, cfg.ffn, cfg.experts, cfg.top_k) if cfg.experts
                    else FeedForward(cfg.hidden, cfg.ffn))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Pre-LN GPT-2/3 style decoder returning logits ``(batch, seq, vocab)``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        if self.wte.weight.is_meta:
            return  # meta has no data; skip init, which is ~0.3 s of dispatch for GPT-3 175B
        self.apply(_gpt_init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                # GPT-2: scale residual-branch outputs by 1/sqrt(2 * layers) to keep activations bounded.
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _gpt_init(m: nn.Module) -> None:
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


_PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-small": dict(layers=12, hidden=768, heads=12, seq=1024, vocab=50257, tie_embeddings=True),
    "gpt2-medium": dict(layers=24, hidden=1024, heads=16, seq=1024, vocab=50257, tie_embeddings=True),
    # GPT-3 XL; the paper's "24 heads" does not divide d_model=2048, so use 16 heads of 128.
    "gpt-1.3b": dict(layers=24, hidden=2048, heads=16, seq=2048, vocab=50257, tie_embeddings=True),
    "gpt3-175b": dict(layers=96, hidden=12288, heads=96, seq=2048, vocab=50257, tie_embeddings=True),
    "llama-7b": dict(layers=32, hidden=4096, heads=32, ffn=11008, seq=2048, vocab=32000),
    # For hf_bert (BertForMaskedLM ties its decoder itself).
    "bert-base": dict(layers=12, hidden=768, heads=12, seq=512, vocab=30522),
}


def gpt_config(name: str) -> dict[str, Any]:
    """Size keyword arguments of a well-known shape, for ``gpt``/``moe_gpt``/``llama`` (``llama-7b``)
    or ``hf_bert`` (``bert-base``). Build large ones with ``device="meta"``."""
    try:
        return dict(_PRESETS[name])
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known: {sorted(_PRESETS)}") from None


def _gpt_case(cfg: GPTConfig, batch: int, device: str | torch.device, seed: int, name: str) -> ModelCase:
    with building(device, seed):
        model = GPT(cfg)
        idx, target = token_batch(batch, cfg.seq, cfg.vocab)
    return ModelCase(model, (idx,), lm_loss, target, name)


def gpt(batch: int = 4, seq: int = 32, vocab: int = 128, hidden: int = 64, layers: int = 2, heads: int = 4,
        dropout: float = 0.0, tie_embeddings: bool = False, ffn: int | None = None, *,
        device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    cfg = GPTConfig(vocab=vocab, seq=seq, hidden=hidden, layers=layers, heads=heads, ffn=ffn,
                    dropout=dropout, tie_embeddings=tie_embeddings)
    return _gpt_case(cfg, batch, device, seed, "gpt")


def moe_gpt(batch: int = 4, seq: int = 32, vocab: int = 128, hidden: int = 64, layers: int = 2,
            heads: int = 4, experts: int = 4, top_k: int = 2, ffn: int | None = None,
            tie_embeddings: bool = False, *, device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    cfg = GPTConfig(vocab=vocab, seq=seq, hidden=hidden, layers=layers, heads=heads, ffn=ffn,
                    tie_embeddings=tie_embeddings, experts=experts, top_k=top_k)
    return _gpt_case(cfg, batch, device, seed, "moe_gpt")


# -------------------------------------------------------------------------------------------- Llama


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``(batch, heads, seq, head_dim)``; cos/sin are ``(seq, head_dim / 2)``."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = (p(x).view(b, t, self.heads, h // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(rotary(q, cos, sin), rotary(k, cos, sin), v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, h))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.attn = LlamaAttention(hidden, heads)
        self.mlp_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.mlp = SwiGLU(hidden, ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Llama-style decoder (RMSNorm, SwiGLU, RoPE, no biases) returning logits."""

    def __init__(self, cfg: GPTConfig, rope_theta: float = 10000.0):
        super().__init__()
        assert cfg.ffn is not None
        self.config, self.rope_theta = cfg, rope_theta
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(LlamaBlock(cfg.hidden, cfg.heads, cfg.ffn) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=1e-5)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        if not self.embed.weight.is_meta:
            self.apply(_gpt_init)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # RoPE tables are computed here rather than stored as buffers so a meta-built model needs no
        # buffer re-materialisation.
        d = self.config.hidden // self.config.heads
        inv_freq = self.rope_theta ** (-torch.arange(0, d, 2, device=idx.device, dtype=torch.float32) / d)
        angles = torch.outer(torch.arange(idx.shape[1], device=idx.device, dtype=torch.float32), inv_freq)
        cos, sin = angles.cos(), angles.sin()
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


def _llama_ffn(hidden: int) -> int:
    # Llama rule: 2/3 of 4*hidden, rounded up to a multiple of 32.
    return -(-(8 * hidden // 3) // 32) * 32


def llama(batch: int = 4, seq: int = 32, vocab: int = 128, hidden: int = 64, layers: int = 2, heads: int = 4,
          ffn: int | None = None, tie_embeddings: bool = False, *, device: str | torch.device = "cpu",
          seed: int = 0) -> ModelCase:
    cfg = GPTConfig(vocab=vocab, seq=seq, hidden=hidden, layers=layers, heads=heads,
                    ffn=ffn or _llama_ffn(hidden), tie_embeddings=tie_embeddings)
    with building(device, seed):
        model = Llama(cfg)
        idx, target = token_batch(batch, seq, vocab)
    return ModelCase(model, (idx,), lm_loss, target, "llama")


# ---------------------------------------------------------------------------------------------- GNN


class GraphConv(nn.Module):
    """h_i' = W_self h_i + W_neigh mean_{j -> i} h_j."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.self_lin = nn.Linear(d_in, d_out)
        self.neigh_lin = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                inv_degree: torch.Tensor) -> torch.Tensor:
        agg = torch.zeros_like(x).index_add(0, dst, x.index_select(0, src)) * inv_degree
        return self.self_lin(x) + self.neigh_lin(agg)


class GNN(nn.Module):
    def __init__(self, features: int, hidden: int, layers: int, classes: int):
        super().__init__()
        self.encoder = nn.Linear(features, hidden)
        self.layers = nn.ModuleList(GraphConv(hidden, hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index[0], edge_index[1]
        degree = torch.zeros(x.shape[0], 1, dtype=x.dtype, device=x.device).index_add(
            0, dst, torch.ones(dst.shape[0], 1, dtype=x.dtype, device=x.device))
        inv_degree = 1.0 / degree.clamp(min=1.0)
        h = F.relu(self.encoder(x))
        for layer in self.layers:
            h = F.relu(layer(h, src, dst, inv_degree))
        return self.head(h)


def gnn(nodes: int = 64, edges: int = 256, features: int = 16, hidden: int = 32, layers: int = 2,
        classes: int = 4, *, device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    with building(device, seed):
        model = GNN(features, hidden, layers, classes)
        x = torch.randn(nodes, features)
        edge_index = torch.randint(0, nodes, (2, edges))
        y = torch.randint(0, classes, (nodes,))
    return ModelCase(model, (x, edge_index), F.cross_entropy, y, "gnn")


CASES: dict[str, Callable[..., ModelCase]] = {
    "mlp": mlp, "cnn": cnn, "gpt": gpt, "llama": llama, "moe_gpt": moe_gpt, "gnn": gnn,
    "hf_gpt2": hf_gpt2, "hf_llama": hf_llama, "hf_mixtral": hf_mixtral, "hf_bert": hf_bert,
    # issue 22: architectures people bring (tests/test_hf_architectures.py)
    "hf_qwen2": hf_qwen2, "hf_mistral": hf_mistral, "hf_bloom": hf_bloom, "hf_gpt_neox": hf_gpt_neox,
    "hf_gptj": hf_gptj, "hf_falcon": hf_falcon, "hf_qwen2_moe": hf_qwen2_moe, "hf_t5": hf_t5, "hf_vit": hf_vit,
    "hf_convnext": hf_convnext,
}
