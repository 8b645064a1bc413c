"""The memory model checked on runs that crashed (issue 12, item 5).

AMP (NeurIPS'22) trained GPT-2 medium (24 x 1024, 16 heads, seq 1024, Megatron vocab 50304, tied embeddings,
fp16 + Adam, global batch 32, DeepSpeed 1F1B) on 3 nodes of 4x V100-16GB and 1 node of 4x T4
(../shared/reference/measured/amp_het_runs.csv). Expectations come from the data (which trials crashed and
which completed) and from the accounting PyTorch's ops imply, computed by hand here:

* cross_entropy = log_softmax + nll_loss keeps the log-probabilities (b x s x vocab) for backward, in fp32
  under autocast (PyTorch AMP docs: cross_entropy / log_softmax autocast to float32), and its backward holds
  two more fp32 buffers of that size (d/d log-probs, d/d logits): 4 + 8 = 12 bytes per logit;
* mixed-precision Adam state: 16 bytes per parameter (fp32 weights, fp32 gradients, two fp32 moments).
"""

from __future__ import annotations

import pytest

import autopar
from autopar import Strategy, models
from autopar.cluster import Cluster
from autopar.cost_models.memory import (
    CUBLAS_WORKSPACE_BYTES,
    CUDA_CONTEXT_BYTES,
    NCCL_COMMUNICATOR_BYTES,
    runtime_reserve_bytes,
)
from autopar.passes.annotate import annotate
from autopar.solver.pricing.pricing import CostModel, price_strategy

GiB = 2**30
SEQ, VOCAB, BATCH = 1024, 50304, 32  # Megatron pads GPT-2's 50257 tokens to a multiple of 128 (mp = 1)


def amp_het_cluster() -> dict:
    """3 x p3.8xlarge (4x V100-16GB) then 1 x g4dn.12xlarge (4x T4): the T4 node last, as AMP's model assumes."""
    def node(device: str, count: int) -> dict:
        return {"device": device, "devices_per_node": 4, "count": count,
                "intra_node": {"bandwidth_GBps": 6.25, "kind": "PCIe"}}

    return {"name": "amp-het", "nodes": [node("V100-16GB", 3), node("T4", 1)],
            "network": {"bandwidth_GBps": 1.25 / 4, "latency_us": 5.0}}


@pytest.fixture(scope="module")
def gpt2_medium() -> CostModel:
    """The cost model of AMP's GPT-2 on its cluster, tensor parallelism priced as Megatron shards it (what the
    runs used; the ILP's sharding, priced within a solver time limit, would be autopar's own choice), with
    torch's kernels as those runs had: autopar's own CUDA program fuses the vocabulary-wide cross-entropy since
    rows of any length loop over column blocks (codegen/triton_gen.py), and a fused region keeps only its
    input for backward."""
    case = models.gpt(vocab=VOCAB, hidden=1024, layers=24, heads=16, seq=SEQ, batch=BATCH, tie_embeddings=True,
                      device="meta")
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    c = Cluster.load(amp_het_cluster())
    return CostModel(annotate(g, c, precision="fp16", kernels="torch"), c, "fp16", "adam", 0.1, intra_op=False)


def amp_estimate(cm: CostModel, tp: int, dp: int, pp: int, mbs: int, split: list[int]) -> autopar.Estimate:
    strategy = Strategy(dp=dp, tp=tp, pp=pp, microbatch_size=mbs, schedule="1f1b", layer_split=split)
    return price_strategy(cm, strategy)


def test_amp_trial_that_crashed_is_flagged_on_the_t4_holding_the_loss(gpt2_medium: CostModel) -> None:
    # amp_het trial 50 (r_cost inf): tp1 dp1 pp16 mbs32; the last stage (1 block + the loss) is on the T4 node
    est = amp_estimate(gpt2_medium, 1, 1, 16, 32, [2] * 8 + [1] * 8)
    assert not est.fits
    problems = est.predicted["memory_problems"]
    assert len(problems) == 1 and problems[0].startswith("device 15 (T4, pipeline 0 stage 15) needs")
    assert "CUDA runtime" in problems[0]  # the usable figure names what the runtime holds besides tensors
    logits = BATCH * SEQ * VOCAB  # one micro-batch of 32 sequences goes through the loss at once
    assert est.predicted["peak_memory_bytes"][15] >= 12 * logits  # > 18 GiB on a 16 GB T4


@pytest.mark.parametrize("trial, tp, dp, pp, mbs, split", [
    (1, 1, 2, 8, 1, [3, 4, 3, 3, 3, 3, 3, 2]),  # the measured best, 1.28 s
    (21, 1, 16, 1, 1, [24]),  # every device holds the whole model: 16 bytes x 355M parameters = 5.3 GiB
    (51, 4, 1, 4, 32, [6, 6, 6, 6]),  # tp4 shards the loss of 32 sequences four ways
])
def test_amp_trials_that_completed_fit(gpt2_medium: CostModel, trial: int, tp: int, dp: int, pp: int,
                                       mbs: int, split: list[int]) -> None:
    est = amp_estimate(gpt2_medium, tp, dp, pp, mbs, split)
    assert est.fits, (trial, est.predicted["memory_problems"])
    if trial == 21:
        params = 24 * 12_596_224 + VOCAB * 1024 + SEQ * 1024 + 2 * 1024  # blocks, tied embedding, positions, ln_f
        assert min(est.predicted["peak_memory_bytes"].values()) > 16 * params


def test_runtime_reserve_is_charged_on_gpus_only() -> None:
    assert runtime_reserve_bytes("cpu", 3) == 0 and runtime_reserve_bytes("edge", 3) == 0
    assert runtime_reserve_bytes("gpu", 0) == CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES
    # NCCL buffers per communicator the process creates (its groups and pipeline peers)
    assert runtime_reserve_bytes("gpu", 3) == CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + 3 * NCCL_COMMUNICATOR_BYTES
    assert runtime_reserve_bytes("gpu", 1, "T4") == runtime_reserve_bytes("gpu", 1)
    assert runtime_reserve_bytes("gpu", 1, "tiny") == 0  # a custom device states what its tensors may use
    # sourced figures (cost_models/memory.py): ~0.4 GiB context with lazy loading, PyTorch's 8519680-byte workspace
    assert CUDA_CONTEXT_BYTES == 400 * 2**20 and CUBLAS_WORKSPACE_BYTES == 4096 * 1024 * 2 + 16 * 1024 * 8


def tiny_cost_model(cluster: str, precision: str, kernels: str = "torch") -> CostModel:
    case = models.gpt(batch=2, seq=8, vocab=50, hidden=16, layers=1, heads=2)
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    c = Cluster.load(cluster)
    return CostModel(annotate(g, c, precision=precision, kernels=kernels), c, precision, "adam", 0.1,
                     intra_op=False)


def test_cpu_usable_memory_is_the_reserve_fraction_only() -> None:
    cm = tiny_cost_model("1x2xcpu", "fp32")
    assert cm.usable(0) == pytest.approx(0.9 * cm.cluster.devices[0].spec.memory, rel=0, abs=0)


def test_gpu_usable_memory_excludes_context_workspace_and_nccl() -> None:
    cm = tiny_cost_model("1x2xT4", "fp16")
    held = 400 * 2**20 + 8_519_680 + 192 * 2**20  # without a plan: the world's communicator only
    # a T4's 15 GiB: 16 GB less ECC's 6.25% (catalog.py; was 16, the datasheet figure a T4 does not expose)
    assert cm.usable(1) == pytest.approx(0.9 * 15 * GiB - held, rel=0, abs=1)
    assert cm.usable(1, 3) == pytest.approx(0.9 * 15 * GiB - held - 2 * 192 * 2**20, rel=0, abs=1)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_loss_keeps_fp32_log_probs_and_a_backward_transient(precision: str) -> None:
    cm = tiny_cost_model("1x2xT4", precision)  # eager torch kernels: aten's cross_entropy
    logits = 2 * 8 * 50  # batch x seq x vocab
    post = cm.graph.layers[-1]
    assert cm.bwd_transient[-1] == 8 * logits  # d/d log-probs and d/d logits, fp32 in any precision
    assert cm.saved[-1] >= 4 * logits  # the log-probabilities, 4 bytes each also under fp16 autocast
    if precision == "fp32":
        assert cm.saved[-1] == post.saved_bytes  # nothing to correct
    else:  # annotate priced them at 2 bytes: the correction adds the other 2
        assert cm.saved[-1] - post.saved_bytes == pytest.approx(2 * logits, abs=8)  # (+ a scalar it keeps)


def test_fused_loss_keeps_the_logits_and_returns_one_fp32_gradient() -> None:
    # kernels="auto" fuses on CUDA types: the fused cross-entropy keeps its input (the logits, which autocast's
    # linear produced in fp16) and recomputes the softmax in backward, returning d/d logits
    cm = tiny_cost_model("1x2xT4", "fp16", kernels="auto")
    assert cm.graph.fused_types == ["T4"]
    logits = 2 * 8 * 50
    assert cm.saved[-1] == 2 * logits
    assert cm.bwd_transient[-1] == 4 * logits
