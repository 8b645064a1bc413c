"""Hugging Face model cases, built from small configs (never downloaded).

``transformers`` is imported lazily so autopar works without it. Models return their ``ModelOutput``;
the loss takes ``.logits``. All dropout is off so that sharded runs can match a single-device run, and
the implementations are chosen so ``torch.export.export(..., strict=False)`` traces them on cpu and meta:
SDPA attention, and for Mixtral the ``batched_mm`` experts kernel (the default "eager" one loops over
``nonzero()`` of the routing mask, a data-dependent shape that cannot be traced on meta tensors).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .models import ModelCase

ATTN_IMPLEMENTATION = "sdpa"


def _case(model_cls: Any, config: Any, batch: int, seq: int, vocab: int, device: str | torch.device,
          seed: int, name: str) -> ModelCase:
    from .models import ModelCase, building, lm_loss, token_batch

    with building(device, seed):
        model = model_cls(config)
        ids, target = token_batch(batch, seq, vocab)
    model.train()
    return ModelCase(model, (ids,), lm_loss, target, name)


def hf_gpt2(batch: int = 2, seq: int = 16, vocab: int = 128, hidden: int = 64, layers: int = 2,
            heads: int = 4, *, device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=heads,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=vocab - 1, eos_token_id=vocab - 1,
                        attn_implementation=ATTN_IMPLEMENTATION)
    return _case(GPT2LMHeadModel, config, batch, seq, vocab, device, seed, "hf_gpt2")


def hf_llama(batch: int = 2, seq: int = 16, vocab: int = 128, hidden: int = 64, layers: int = 2,
             heads: int = 4, ffn: int | None = None, kv_heads: int | None = None, *,
             device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    """transformers' LlamaForCausalLM; `kv_heads` < `heads` is grouped-query attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn or 4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads or heads,
                         max_position_embeddings=seq, use_cache=False, bos_token_id=1, eos_token_id=2,
                         attn_implementation=ATTN_IMPLEMENTATION)
    return _case(LlamaForCausalLM, config, batch, seq, vocab, device, seed, "hf_llama")


def hf_mixtral(batch: int = 2, seq: int = 16, vocab: int = 128, hidden: int = 64, layers: int = 2,
               heads: int = 4, ffn: int | None = None, experts: int = 4, top_k: int = 2, *,
               device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn or 2 * hidden,
                           num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                           num_local_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=seq,
                           use_cache=False, bos_token_id=1, eos_token_id=2, router_jitter_noise=0.0,
                           attn_implementation=ATTN_IMPLEMENTATION, experts_implementation="batched_mm")
    return _case(MixtralForCausalLM, config, batch, seq, vocab, device, seed, "hf_mixtral")


def hf_bert(batch: int = 2, seq: int = 16, vocab: int = 128, hidden: int = 64, layers: int = 2,
            heads: int = 4, ffn: int | None = None, *, device: str | torch.device = "cpu",
            seed: int = 0) -> ModelCase:
    """BertForMaskedLM; the loss is token cross-entropy against random ids at every position."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=ffn or 4 * hidden,
                        max_position_embeddings=seq, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, pad_token_id=0,
                        attn_implementation=ATTN_IMPLEMENTATION)
    return _case(BertForMaskedLM, config, batch, seq, vocab, device, seed, "hf_bert")
