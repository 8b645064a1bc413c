"""Priced activations against what torch's autograd actually saves (issue 22, "every allocation priced").

The figure to match is torch's own: `torch.autograd.graph.saved_tensors_hooks` sees every tensor autograd
keeps for the backward; unique storages' bytes, parameters left out (they are the state, priced apart), is
what one block holds per micro-batch. The priced figure is the growth of `estimate()`'s peak per block
(from 2 to 3 blocks) less the block's state (fp32 AdamW: 16 bytes per parameter), on an A100 (CUDA: the
fused-kernel pricing).

Unfused attention (matmul, masked_fill, softmax, matmul: `models.MatmulAttention`) was priced at ~1.7x
torch's figure at seq 2048: the fused softmax region saved its input, the seq x seq scores, beside the
probabilities the second matmul saves (codegen/fusion.py now leaves such a softmax to torch).
"""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar import models
from autopar.codegen.fusion import find_regions

from .test_annotate import real_saved_bytes
from .test_kernels import capture

SEQ, HIDDEN, HEADS = 256, 128, 16  # the GPT at seq 2048, hidden 1024, 16 heads, scaled by 1/8


def _case(layers: int, device: str) -> models.ModelCase:
    case = models.gpt(batch=1, seq=SEQ, vocab=128, hidden=HIDDEN, heads=HEADS, layers=layers, device=device)
    with torch.device(device):
        for block in case.model.blocks:
            block.attn = models.MatmulAttention(HIDDEN, HEADS)
    return case


def _torch_saved_bytes(layers: int) -> int:
    """Bytes of the unique storages autograd saves for the backward, parameters excluded."""
    return real_saved_bytes(_case(layers, "cpu"))


def _priced_peak(layers: int) -> tuple[float, int]:
    case = _case(layers, "meta")
    est = autopar.estimate(case.model, "1x1xA100-80GB", autopar.Strategy(dp=1, pp=1, microbatch_size=1),
                           case.example_inputs, case.example_target, case.loss_fn, precision="tf32")
    n_params = sum(p.numel() for p in case.model.parameters())
    return est.predicted["peak_memory_bytes"][0], n_params


def test_priced_activations_per_block_are_what_torch_saves() -> None:
    # 2 -> 3 blocks: a block between blocks (the first block's regions border the embeddings')
    (p2, n2), (p3, n3) = _priced_peak(2), _priced_peak(3)
    priced = (p3 - p2) - 16 * (n3 - n2)  # fp32 weights, gradients, two Adam moments
    held = _torch_saved_bytes(3) - _torch_saved_bytes(2)
    print(f"per block: priced {priced / 2**20:.3f} MiB, torch saves {held / 2**20:.3f} MiB")
    assert priced == pytest.approx(held, rel=0.15)


def test_softmax_read_by_a_matmul_is_left_to_torch() -> None:
    """The attention probabilities feed `probs @ v`, which saves them: a fused softmax would keep its input
    as well. A softmax whose output no matmul reads still fuses."""
    s, v = torch.randn(2, 16, 16), torch.randn(2, 16, 8)
    kept = [r for r in find_regions(capture(lambda s, v: torch.matmul((s * 0.5).softmax(-1), v), s, v))
            if r.kind == "softmax"]
    assert len(kept) == 1 and not kept[0].fused and "feeds a matmul" in kept[0].reason
    fused = [r for r in find_regions(capture(lambda s: (s * 0.5).softmax(-1) * 2.0, s)) if r.kind == "softmax"]
    assert len(fused) == 1 and fused[0].fused
