"""Hugging Face model cases, built from small configs (never downloaded).

``transformers`` is imported lazily so autopar works without it. Models return their ``ModelOutput``;
the loss takes ``.logits``. Dropout is off unless a builder's `dropout=` asks for it (autopar keys its masks
so that every plan draws the same ones: passes/randomness.py), and
the implementations are chosen so ``torch.export.export(..., strict=False)`` traces them on cpu and meta:
SDPA attention, and for Mixtral the ``batched_mm`` experts kernel (the default "eager" one loops over
``nonzero()`` of the routing mask, a data-dependent shape that cannot be traced on meta tensors).
"""

from __future__ import annotations

from typing import Any

import torch

from .model_case import ModelCase, building, lm_loss, token_batch

ATTN_IMPLEMENTATION = "sdpa"


def _case(model_cls: Any, config: Any, batch: int, seq: int, vocab: int, device: str | torch.device,
          seed: int, name: str) -> ModelCase:
    with building(device, seed):
        model = model_cls(config)
        ids, target = token_batch(batch, seq, vocab)
    model.train()
    return ModelCase(model, (ids,), lm_loss, target, name)


def hf_gpt2(batch: int = 2, seq: int = 16, vocab: int = 128, hidden: int = 64, layers: int = 2,
            heads: int = 4, *, device: str | torch.device = "cpu", seed: int = 0,
            dropout: float = 0.0) -> ModelCase:
    """GPT2LMHeadModel; `dropout` is its residual, embedding and attention dropout (autopar keys the masks:
    passes/randomness.py)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=heads,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False,
                        bos_token_id=vocab - 1, eos_token_id=vocab - 1,
                        attn_implementation=ATTN_IMPLEMENTATION)
    return _case(GPT2LMHeadModel, config, batch, seq, vocab, device, seed, "hf_gpt2")


def hf_llama(batch: int = 2, seq: int = 16, vocab: int = 128, hidden: int = 64, layers: int = 2,
             heads: int = 4, ffn: int | None = None, kv_heads: int | None = None, *,
             device: str | torch.device = "cpu", seed: int = 0, dropout: float = 0.0) -> ModelCase:
    """transformers' LlamaForCausalLM; `kv_heads` < `heads` is grouped-query attention; `dropout` its
    attention dropout (Llama has no other)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn or 4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads or heads,
                         max_position_embeddings=seq, use_cache=False, bos_token_id=1, eos_token_id=2,
                         attention_dropout=dropout, attn_implementation=ATTN_IMPLEMENTATION)
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


# ------------------------------------------------------------------------- more architectures (issue 22)
# Each is the smallest configuration that still has the architecture's distinguishing feature; all build on
# cpu and meta. Decoder-only ones return their CausalLMOutput (loss: `lm_loss`).


def hf_qwen2(batch: int = 2, seq: int = 16, vocab: int = 128, hidden: int = 64, layers: int = 2,
             heads: int = 4, kv_heads: int = 2, ffn: int | None = None, *, device: str | torch.device = "cpu",
             seed: int = 0) -> ModelCase:
    """Qwen2ForCausalLM: grouped-query attention (`kv_heads` < `heads`) with q/k/v biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn or 2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=seq, use_cache=False, attention_dropout=0.0,
                         bos_token_id=1, eos_token_id=2, attn_implementation=ATTN_IMPLEMENTATION)
    return _case(Qwen2ForCausalLM, config, batch, seq, vocab, device, seed, "hf_qwen2")


def hf_mistral(batch: int = 2, seq: int = 16, vocab: int = 128, hidden: int = 64, layers: int = 2,
               heads: int = 4, kv_heads: int = 2, window: int = 8, ffn: int | None = None, *,
               device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    """MistralForCausalLM: sliding-window attention (`window` < `seq`, so the window masks), GQA."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn or 2 * hidden,
                           num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           max_position_embeddings=seq, sliding_window=window, use_cache=False,
                           attention_dropout=0.0, bos_token_id=1, eos_token_id=2,
                           attn_implementation=ATTN_IMPLEMENTATION)
    return _case(MistralForCausalLM, config, batch, seq, vocab, device, seed, "hf_mistral")


def hf_bloom(batch: int = 2, seq: int = 16, vocab: int = 128, hidden: int = 64, layers: int = 2,
             heads: int = 4, *, device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    """BloomForCausalLM: ALiBi position biases (no position embeddings), embedding LayerNorm, tied head."""
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(vocab_size=vocab, hidden_size=hidden, n_layer=layers, n_head=heads, use_cache=False,
                         hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    return _case(BloomForCausalLM, config, batch, seq, vocab, device, seed, "hf_bloom")


def hf_gpt_neox(batch: int = 2, seq: int = 16, vocab: int = 128, hidden: int = 64, layers: int = 2,
                heads: int = 4, *, device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    """GPTNeoXForCausalLM: parallel attention and MLP (`use_parallel_residual`), partial rotary, fused qkv."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                           num_attention_heads=heads, intermediate_size=4 * hidden, max_position_embeddings=seq,
                           use_parallel_residual=True, attention_dropout=0.0, hidden_dropout=0.0,
                           use_cache=False, bos_token_id=1, eos_token_id=2,
                           attn_implementation=ATTN_IMPLEMENTATION)
    return _case(GPTNeoXForCausalLM, config, batch, seq, vocab, device, seed, "hf_gpt_neox")


def hf_gptj(batch: int = 2, seq: int = 16, vocab: int = 128, hidden: int = 64, layers: int = 2,
            heads: int = 4, *, device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    """GPTJForCausalLM: attention and MLP in parallel off one LayerNorm, interleaved rotary on part of
    each head (`rotary_dim`)."""
    from transformers import GPTJConfig, GPTJForCausalLM

    config = GPTJConfig(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=heads,
                        rotary_dim=hidden // heads // 2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        use_cache=False, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return _case(GPTJForCausalLM, config, batch, seq, vocab, device, seed, "hf_gptj")


def hf_falcon(batch: int = 2, seq: int = 16, vocab: int = 128, hidden: int = 64, layers: int = 2,
              heads: int = 4, kv_heads: int = 2, *, device: str | torch.device = "cpu",
              seed: int = 0) -> ModelCase:
    """FalconForCausalLM with the new decoder architecture: parallel attention (two LayerNorms), grouped
    kv heads, rotary."""
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                          num_attention_heads=heads, num_kv_heads=kv_heads, new_decoder_architecture=True,
                          parallel_attn=True, bias=False, alibi=False, max_position_embeddings=seq,
                          hidden_dropout=0.0, attention_dropout=0.0, use_cache=False, bos_token_id=1,
                          eos_token_id=2, attn_implementation=ATTN_IMPLEMENTATION)
    return _case(FalconForCausalLM, config, batch, seq, vocab, device, seed, "hf_falcon")


def hf_qwen2_moe(batch: int = 2, seq: int = 16, vocab: int = 128, hidden: int = 64, layers: int = 2,
                 heads: int = 4, kv_heads: int = 2, experts: int = 4, top_k: int = 2, *,
                 device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    """Qwen2MoeForCausalLM: routed experts plus a gated shared expert in every layer."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                            moe_intermediate_size=hidden, shared_expert_intermediate_size=2 * hidden,
                            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                            num_experts=experts, num_experts_per_tok=top_k, decoder_sparse_step=1,
                            max_position_embeddings=seq, use_cache=False, attention_dropout=0.0,
                            bos_token_id=1, eos_token_id=2, attn_implementation=ATTN_IMPLEMENTATION,
                            experts_implementation="batched_mm")
    return _case(Qwen2MoeForCausalLM, config, batch, seq, vocab, device, seed, "hf_qwen2_moe")


class Seq2SeqLogits(torch.nn.Module):
    """An encoder-decoder language model as `forward(ids) -> logits`: the decoder reads the same ids
    (`decoder_input_ids=ids`), so the loss is next-token prediction through encoder and decoder."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, decoder_input_ids=ids).logits


def hf_t5(batch: int = 2, seq: int = 16, vocab: int = 128, hidden: int = 64, layers: int = 2,
          heads: int = 4, ffn: int | None = None, *, device: str | torch.device = "cpu",
          seed: int = 0) -> ModelCase:
    """T5ForConditionalGeneration (relative position buckets, RMS-style LayerNorm, tied head) wrapped by
    `Seq2SeqLogits`."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=vocab, d_model=hidden, d_kv=hidden // heads, d_ff=ffn or 2 * hidden,
                      num_layers=layers, num_decoder_layers=layers, num_heads=heads, dropout_rate=0.0,
                      use_cache=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                      attn_implementation=ATTN_IMPLEMENTATION)
    with building(device, seed):
        model = Seq2SeqLogits(T5ForConditionalGeneration(config))
        ids, target = token_batch(batch, seq, vocab)
    model.train()
    return ModelCase(model, (ids,), lm_loss, target, "hf_t5")


def _image_case(model_cls: Any, config: Any, batch: int, image: int, classes: int, device: str | torch.device,
                seed: int, name: str) -> ModelCase:
    with building(device, seed):
        model = model_cls(config)
        pixels = torch.randn(batch, config.num_channels, image, image)
        labels = torch.randint(0, classes, (batch,))
    model.train()
    return ModelCase(model, (pixels,), lm_loss, labels, name)  # lm_loss: cross-entropy of .logits vs labels


def hf_vit(batch: int = 4, image: int = 16, patch: int = 4, hidden: int = 64, layers: int = 2, heads: int = 4,
           classes: int = 10, *, device: str | torch.device = "cpu", seed: int = 0) -> ModelCase:
    """ViTForImageClassification on `image` x `image` RGB images (patch embedding, CLS token)."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       intermediate_size=4 * hidden, image_size=image, patch_size=patch, num_channels=3,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=classes,
                       attn_implementation=ATTN_IMPLEMENTATION)
    return _image_case(ViTForImageClassification, config, batch, image, classes, device, seed, "hf_vit")


def hf_convnext(batch: int = 4, image: int = 32, hidden_sizes: tuple[int, ...] = (16, 32),
                depths: tuple[int, ...] = (2, 2), classes: int = 10, *, device: str | torch.device = "cpu",
                seed: int = 0) -> ModelCase:
    """ConvNextForImageClassification: depthwise 7x7 convolutions, LayerNorm (no batch statistics, so a
    split batch trains exactly like one process), layer scale."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(num_channels=3, patch_size=4, num_stages=len(hidden_sizes),
                            hidden_sizes=list(hidden_sizes), depths=list(depths), drop_path_rate=0.0,
                            image_size=image, num_labels=classes)
    return _image_case(ConvNextForImageClassification, config, batch, image, classes, device, seed,
                       "hf_convnext")
