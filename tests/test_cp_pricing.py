"""Context parallelism (cp) in the planner: the exchange bytes (cost_models/context.py), the prices of a cp plan
(solver/pricing/context.py: compute on T/cp tokens, the ring exchange overlapped with the block computation,
memory, sends, the sync over dp x cp holders), JSON round trips, and the search's choice (solver/search/context.py).
Pure pricing: no process is spawned."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar import Plan, PlanError, Strategy
from autopar.api import cost_model
from autopar.cost_models.context import cp_exchange_bytes, exchange_steps, kv_block_bytes
from autopar.models import gpt, lm_loss, mlp
from autopar.solver.pricing.context import candidates
from autopar.solver.pricing.pricing import Option
from autopar.solver.search.context import CP_MIN_TOKENS

from .runtime_cases import captured_case

A100 = "A100-80GB"
# two nodes of two A100s whose intra-node link is very slow (50 MB/s) and whose network is fast: a cp ring inside
# a node cannot hide its transfers behind the block computations
SLOW = {"nodes": [{"device": A100, "devices_per_node": 2, "count": 2,
                   "intra_node": {"bandwidth_GBps": 0.05, "latency_us": 2}}],
        "network": {"bandwidth_GBps": 25, "latency_us": 5}}


@functools.cache
def _gpt(batch: int = 2, seq: int = 4096, hidden: int = 256, layers: int = 2, heads: int = 4, vocab: int = 256,
         dropout: float = 0.0):
    return gpt(batch=batch, seq=seq, hidden=hidden, layers=layers, heads=heads, vocab=vocab, dropout=dropout,
               device="meta")


def _estimate(strategy: Strategy | Plan, cluster: str | dict, **kw) -> autopar.Estimate:
    c, graph = captured_case(_gpt, **kw)
    return autopar.estimate(c.model, cluster, strategy, c.example_inputs, c.example_target, c.loss_fn,
                            captured=graph)


def _plan(cluster: str | dict, **kw) -> Plan:
    c, graph = captured_case(_gpt, **kw)
    return autopar.plan(c.model, cluster, c.example_inputs, c.example_target, c.loss_fn, captured=graph)


# ---- the bytes -------------------------------------------------------------------------------------------------


def test_exchange_bytes_ring_and_ulysses() -> None:
    blk = kv_block_bytes(2, 4, 1024, 64, 2)
    assert blk == 2 * 4 * 1024 * 64 * 2
    ring = cp_exchange_bytes(2, 4, 1024, 64, 4, 2, "ring")
    # forward: cp-1 steps of K and V; backward: cp-1 steps of K, V, dK, dV and the dK/dV sent home, the
    # dK/dV accumulators in fp32 (2 blk at bf16)
    acc = 2 * blk
    assert ring == {"forward": 3 * 2 * blk, "backward": 3 * (2 * blk + 2 * acc) + 2 * acc}
    assert ring["backward"] == (4 - 1) * 2 * blk + 4 * 2 * acc
    assert cp_exchange_bytes(2, 4, 1024, 64, 4, 4, "ring")["backward"] == 3 * 4 * 2 * blk + 2 * 2 * blk  # fp32
    steps = exchange_steps(2, 4, 1024, 64, 4, 2, "ring")
    assert steps.forward == (2 * blk,) * 3 and steps.backward == (2 * blk + 2 * acc,) * 3 + (2 * acc,)
    assert (steps.overlapped_forward, steps.overlapped_backward) == (3, 3)
    # Ulysses: the all-to-all buffers of q, k, v and the output each way (q and out with the query heads), of
    # which (cp-1)/cp leaves the rank
    q = kv_block_bytes(1, 8, 512, 64, 2)
    uly = cp_exchange_bytes(1, 2, 512, 64, 4, 2, "ulysses", heads_q=8)
    kv = 2 * kv_block_bytes(1, 4, 512, 64, 2)  # k, v repeated to lcm(2, 4) = 4 heads
    assert uly == {"forward": 2 * q + kv, "backward": 2 * q + kv}
    sent = exchange_steps(1, 2, 512, 64, 4, 2, "ulysses", heads_q=8)
    assert sum(sent.forward) == sum(sent.backward) == 3 * (2 * q + kv) // 4
    assert cp_exchange_bytes(2, 4, 1024, 64, 1, 2, "ring") == {"forward": 0, "backward": 0}
    with pytest.raises(PlanError, match="whole heads"):
        cp_exchange_bytes(1, 2, 512, 64, 4, 2, "ulysses", heads_q=6)


def test_candidates_need_the_sequence_to_split_into_2cp_chunks() -> None:
    c = _gpt(seq=24)
    cm = cost_model(c.model, "1x8xA100-80GB", c.example_inputs, c.example_target, c.loss_fn)
    assert candidates(cm) == [2, 4]  # 24 tokens: 2 cp = 4 and 8 divide them, 16 does not
    with pytest.raises(PlanError, match="chunks"):
        _estimate(Strategy(dp=1, cp=8), "1x8xA100-80GB", seq=24)


# ---- the prices of a cp plan -----------------------------------------------------------------------------------


def test_cp_halves_the_activations_per_rank() -> None:
    # CPU devices: ring blocks run torch's fused attention (no [c, c] scores)
    one = _estimate(Strategy(microbatch_size=1), "1x1xcpu").plan.predicted["peak_memory_parts_bytes"][0]
    two = _estimate(Strategy(cp=2, microbatch_size=1), "1x2xcpu").plan.predicted["peak_memory_parts_bytes"]
    assert two[0] == two[1]
    # half the tokens; a little more for ring attention's in-flight K/V blocks and fp32 dK/dV accumulators, its
    # block's fp32 rows and its fp32 log-sum-exp
    assert 0.5 < two[0]["activations"] / one["activations"] < 0.66
    # on a GPU the blocks run unfused: one chunk pair's fp32 scores (5 of them in backward) are priced too
    gpu = _estimate(Strategy(cp=2, microbatch_size=1), "1x2xA100-80GB").plan.predicted["peak_memory_parts_bytes"]
    c = 4096 // 4
    assert gpu[0]["activations"] - gpu_base_activations() >= 5 * (1 * 4 * c * c * 4)
    # what a micro-batch's layers keep for the backward is half, plus the 2 bytes per row and head the fp32
    # log-sum-exp of ring attention takes beyond the one the captured attention keeps (bf16 here)
    c = _gpt()
    cm = cost_model(c.model, "1x2xA100-80GB", c.example_inputs, c.example_target, c.loss_fn)
    cm2 = cm.with_context(2)
    base1, base2 = cm.base(0, cm.L, A100, 1, (0,)), cm2.base(0, cm.L, A100, 1, (0, 1))
    lse = 2 * (1 * 4 * 2048) * (4 - 2)  # 2 calls, 1 sample x 4 heads x T/2 rows, 2 more bytes each
    assert base2.act == pytest.approx(base1.act / 2 + lse, rel=1e-9)
    # autocast's bf16 weight copies are per micro-batch, not per token: the same at cp 2
    assert cm2.stage_memory(base2, Option(), 2, 2).act - base2.act == pytest.approx(
        cm.stage_memory(base1, Option(), 1, 1).act - base1.act, rel=1e-9)
    # the K/V blocks in flight: the computed and the arriving one, with the dK/dV accumulators in backward, and
    # one chunk pair's block: unfused on the A100 (5 fp32 [c, c] scores per head in backward)
    blk = kv_block_bytes(1, 4, 2048, 64, 2)
    assert base2.cp_work == 4 * blk + 4 * (2 * blk) + 5 * (1 * 4 * 1024 * 1024 * 4)


def gpu_base_activations() -> float:
    """The cp 2 stage's activations on an A100 without ring attention's transient (its saved bytes only)."""
    c = _gpt()
    cm = cost_model(c.model, "1x2xA100-80GB", c.example_inputs, c.example_target, c.loss_fn).with_context(2)
    return cm.base(0, cm.L, A100, 1, (0, 1)).act


def test_ring_block_memory_is_what_the_allocator_sees() -> None:
    """One ring block's forward and backward peaks, measured at the allocator, against cost_models/context.py's
    FUSED_BLOCK (CPU: fp32 rows of a chunk) and UNFUSED_BLOCK (elsewhere: fp32 scores of a chunk pair)."""
    import torch

    from autopar.cost_models.context import FUSED_BLOCK, UNFUSED_BLOCK
    from autopar.runtime import ring_attention as ra
    from autopar.runtime.memtrace import track_memory

    b, h, c, d = 2, 8, 256, 64
    rows, scores = b * h * c * d * 4, b * h * c * c * 4
    q, k, v, dout, out = (torch.randn(b, h, c, d) for _ in range(5))
    lse = torch.randn(b, h, c)
    for fused, unit, (fwd, bwd) in ((True, rows, FUSED_BLOCK), (False, scores, UNFUSED_BLOCK)):
        saved = ra._fused
        ra._fused = lambda t, fused=fused: fused  # noqa: E731
        try:
            with track_memory() as f:
                o, s = ra._attend(q, k, v, 0.125, True)
                merged = ra._merge((o.clone(), s.clone()), o, s)
                del o, s, merged
            with track_memory() as g:
                grads = ra._attend_backward(q, k, v, dout, out, lse, 0.125, True)
                del grads
        finally:
            ra._fused = saved
        # measured within 15 % of the priced count (the rest: the block's small outputs and statistics)
        assert f.peak_bytes == pytest.approx(fwd * unit, rel=0.15), (fused, f.peak_bytes / unit)
        assert g.peak_bytes == pytest.approx(bwd * unit, rel=0.15), (fused, g.peak_bytes / unit)


def test_prediction_carries_the_exchange_bytes() -> None:
    est = _estimate(Strategy(cp=2, tp=2, microbatch_size=1), "1x4xA100-80GB")
    per_call = cp_exchange_bytes(1, 4 // 2, 4096 // 2, 64, 2, 2, "ring")  # 4 heads over tp 2, bf16
    st = est.plan.pipelines[0].stages[0]
    assert (st.cp, st.tp, st.cp_attention) == (2, 2, "ring")
    assert st.predicted["cp_calls"] == 2  # one attention per block
    assert st.predicted["cp_exchange_bytes"] == {k: 2 * v for k, v in per_call.items()}
    ex = est.plan.predicted["cp"]["exchange"]
    assert ex["bytes_per_call"] == per_call and ex["tokens_per_rank"] == 2048
    assert ex["bytes_per_step"] == 2 * 2 * (per_call["forward"] + per_call["backward"])  # 2 samples, 2 calls
    assert est.plan.predicted["cp"]["chosen"] == 2
    text = est.plan.explain()
    assert "context parallelism: cp=2, ring attention" in text and "per ring step" in text
    assert "with context parallelism (cp=2) the blocks run Megatron's placements" in text
    assert st.sharding is None  # Megatron's placements at cp > 1


def test_exposed_exchange_is_what_the_blocks_do_not_hide() -> None:
    fast = _estimate(Strategy(dp=2, cp=2, microbatch_size=1), "1x4xA100-80GB", batch=2).plan
    slow = _estimate(Strategy(dp=2, cp=2, microbatch_size=1), SLOW, batch=2).plan
    for plan in (fast, slow):
        st, ring = plan.pipelines[0].stages[0], plan.predicted["cp"]["exchange"]["ring_step"]
        f, b = ring["forward"], ring["backward"]
        # cp = 2: one overlapped step each way, then the dK/dV sent home (fp32 accumulators: twice a bf16 step)
        assert ring["home"]["bytes"] == 2 * f["bytes"]
        per_call = max(0.0, f["transfer_s"] - f["block_compute_s"]) + max(0.0, b["transfer_s"] - b["block_compute_s"]) \
            + ring["home"]["transfer_s"]
        assert st.predicted["cp_exchange_s"] == pytest.approx(2 * per_call, rel=1e-9)
    assert slow.pipelines[0].stages[0].predicted["cp_exchange_s"] > 100 * fast.pipelines[0].stages[0].predicted[
        "cp_exchange_s"]
    # the exposed exchange is in the stage's times: the same compute, slower by it
    gap = sum(slow.pipelines[0].stages[0].predicted[k] - fast.pipelines[0].stages[0].predicted[k]
              for k in ("fwd_s", "bwd_s"))
    exposed = (slow.pipelines[0].stages[0].predicted["cp_exchange_s"]
               - fast.pipelines[0].stages[0].predicted["cp_exchange_s"])
    assert gap == pytest.approx(exposed, rel=0.05)


def test_sync_and_zero_over_the_dp_x_cp_holders() -> None:
    alone = _estimate(Strategy(microbatch_size=1), "1x1xA100-80GB").plan
    cp2 = _estimate(Strategy(cp=2, microbatch_size=1), "1x2xA100-80GB").plan
    # two holders of every parameter: their gradients are all-reduced
    assert cp2.pipelines[0].stages[0].predicted["sync_s"] > alone.pipelines[0].stages[0].predicted["sync_s"]
    zero = _estimate(Strategy(cp=2, zero=1, microbatch_size=1), "1x2xA100-80GB").plan
    full, part = (p.predicted["peak_memory_parts_bytes"][0]["optimizer state"] for p in (cp2, zero))
    assert part == pytest.approx(full / 2, rel=1e-6)  # ZeRO partitions over the cp siblings too


def test_stage_boundary_sends_the_local_tokens() -> None:
    c = _gpt()
    cm = cost_model(c.model, "1x4xA100-80GB", c.example_inputs, c.example_target, c.loss_fn)
    cm2 = cm.with_context(2)
    assert cm2.base(0, 2, A100, 1, (0, 1)).out_bytes == cm.base(0, 2, A100, 1, (0,)).out_bytes / 2
    plain = _estimate(Strategy(pp=2, dp=2, microbatch_size=1), "1x4xA100-80GB").plan
    cp = _estimate(Strategy(pp=2, cp=2, microbatch_size=1), "1x4xA100-80GB").plan
    assert cp.pipelines[0].stages[0].predicted["send_s"] < plain.pipelines[0].stages[0].predicted["send_s"]


def test_cp_plan_round_trips_through_json() -> None:
    est = _estimate(Strategy(cp=2, pp=2, microbatch_size=1), "1x4xA100-80GB")
    back = Plan.from_json(est.plan.to_json())
    assert back == est.plan
    assert [(st.cp, st.cp_attention, st.devices) for st in back.pipelines[0].stages] == [
        (2, "ring", [0, 1]), (2, "ring", [2, 3])]
    again = _estimate(back, "1x4xA100-80GB")
    assert again.plan.predicted == est.plan.predicted
    assert json.loads(again.plan.to_json())["predicted"]["cp"]["exchange"]["bytes_per_call"] == \
        est.plan.predicted["cp"]["exchange"]["bytes_per_call"]


def test_ulysses_prices_all_to_alls() -> None:
    ring = _estimate(Strategy(cp=2, microbatch_size=1), "1x2xA100-80GB").plan
    uly = _estimate(Strategy(cp=2, cp_attention="ulysses", microbatch_size=1), "1x2xA100-80GB").plan
    st = uly.pipelines[0].stages[0]
    assert st.cp_attention == "ulysses" and uly.predicted["cp"]["attention"] == "ulysses"
    per_call = cp_exchange_bytes(1, 4, 2048, 64, 2, 2, "ulysses")
    assert st.predicted["cp_exchange_bytes"] == {k: 2 * v for k, v in per_call.items()}
    assert st.predicted["cp_exchange_s"] > 0 and "ring_step" not in uly.predicted["cp"]["exchange"]
    assert ring.predicted["step_time_s"] != uly.predicted["step_time_s"]


@pytest.mark.parametrize(("kw", "strategy", "match"), [
    (dict(dropout=0.1), Strategy(cp=2), "dropout"),
    (dict(seq=4094), Strategy(cp=2), "chunks"),
    (dict(heads=2, hidden=128), Strategy(cp=4, cp_attention="ulysses"), "whole heads"),
])
def test_refusals(kw: dict, strategy: Strategy, match: str) -> None:
    cluster = f"1x{strategy.cp}xA100-80GB"
    with pytest.raises(PlanError, match=match):
        _estimate(strategy, cluster, **kw)


class _MaskedBlock(nn.Module):
    """Attention with an explicit boolean mask built from the token positions (as Hugging Face models pass it):
    the causal one, or a sliding window of `window` tokens."""

    def __init__(self, hidden: int = 32, heads: int = 4, window: int | None = None) -> None:
        super().__init__()
        self.qkv, self.out, self.heads, self.window = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden), heads, \
            window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        pos = torch.arange(t, device=x.device)
        mask = pos[None, :] <= pos[:, None]
        if self.window:
            mask = mask & (pos[:, None] - pos[None, :] < self.window)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.out(y.transpose(1, 2).reshape(b, t, h))


class _MaskedLM(nn.Module):
    def __init__(self, window: int | None = None) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(64, 32), nn.Linear(32, 64)
        self.blocks = nn.ModuleList([_MaskedBlock(window=window), _MaskedBlock(window=window)])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("window", [None, 8])
def test_an_explicit_causal_mask_splits_a_sliding_window_does_not(window: int | None) -> None:
    with torch.device("meta"):
        model = _MaskedLM(window)
    idx, target = torch.randint(0, 64, (2, 64)), torch.randint(0, 64, (2, 64))
    if window is None:
        est = autopar.estimate(model, "1x2xA100-80GB", Strategy(cp=2), (idx,), target, lm_loss)
        assert est.plan.pipelines[0].stages[0].predicted["cp_calls"] == 2
    else:
        with pytest.raises(PlanError, match="not the causal one"):
            autopar.estimate(model, "1x2xA100-80GB", Strategy(cp=2), (idx,), target, lm_loss)


def test_a_model_without_attention_has_no_cp() -> None:
    c = mlp(device="meta")
    with pytest.raises(PlanError, match="no scaled_dot_product_attention"):
        autopar.estimate(c.model, "1x2xA100-80GB", Strategy(cp=2), c.example_inputs, c.example_target, c.loss_fn)
    plan = autopar.plan(c.model, "1x2xA100-80GB", c.example_inputs, c.example_target, c.loss_fn)
    assert "cp" not in plan.predicted


# ---- the search's choice -----------------------------------------------------------------------------------------


def short_of_one_sample(seq: int, fraction: float = 0.6, devices: int = 4, **kw) -> dict:
    """`devices` CPU devices, each with `fraction` of what one device needs to train one sample at `seq` tokens
    (the ring's blocks run fused on CPUs); bench/long_context.py's cluster."""
    need = _estimate(Strategy(), "1x1xcpu", seq=seq, **kw).plan.predicted["peak_memory_bytes"][0]
    dev = {"name": "cpu-small", "based_on": "cpu", "memory_GiB": need * fraction / 2**30}
    return {"nodes": [{"device": dev, "devices_per_node": devices}]}


LONG = dict(batch=1, seq=8192, hidden=64, layers=2, heads=4, vocab=256)


def test_plan_chooses_cp_when_one_sample_does_not_fit_a_device() -> None:
    cluster = short_of_one_sample(**LONG)
    plan = _plan(cluster, **LONG)
    assert {st.cp for p in plan.pipelines for st in p.stages} == {4}
    cp = plan.predicted["cp"]
    assert cp["chosen"] == 4 and set(cp["considered"]) == {"1", "2", "4"}
    assert cp["considered"]["4"] == plan.predicted["step_time_s"] < cp["considered"]["1"]
    assert "context parallelism: cp=4" in plan.explain()
    # delayed updates are neither priced nor run with cp: the plan stays synchronous and says why
    c = _gpt(**LONG)
    asy = autopar.plan(c.model, cluster, c.example_inputs, c.example_target, c.loss_fn, sync="2bw")
    assert asy.predicted["async"]["sync"] == "sync" and "cp=4" in asy.predicted["async"]["reason"]
    assert Plan.from_json(plan.to_json()).predicted["cp"] == cp
    # what travels, priced both ways over the 4 devices: the weights (cp 4 + ZeRO-3: activations stay with their
    # tokens) or the activations (pp 4: each stage keeps its weights); one sample, so the pipeline runs its stages
    # one after another and the weights travel faster
    travel = cp["travel"]
    assert travel["weights"]["plan"] == "cp 4 + ZeRO-3" and travel["activations"]["plan"] == "pp 4"
    assert travel["weights"]["step_time_s"] < travel["activations"]["step_time_s"]
    assert "Weights travel (cp 4 + ZeRO-3)" in plan.explain() and "activations travel (pp 4)" in plan.explain()


def test_plan_keeps_cp1_for_short_sequences() -> None:
    plan = _plan("1x4xA100-80GB", batch=8, seq=64, hidden=64, layers=2, heads=4, vocab=128)
    assert {st.cp for p in plan.pipelines for st in p.stages} == {1}
    assert plan.predicted["cp"]["chosen"] == 1 and plan.predicted["cp"]["reason"].startswith("not considered")
    assert "context parallelism" not in plan.explain()
    # a long sequence whose plan does not split a sample is not considered either
    long = _plan("1x2xA100-80GB", batch=2, seq=CP_MIN_TOKENS, hidden=64, layers=2, heads=4, vocab=128)
    assert long.pipelines[0].stages[0].cp == 1 and "not considered" in long.predicted["cp"]["reason"]


def test_considered_and_not_chosen_says_why() -> None:
    # one sample on 4 devices: the cp = 1 plan splits it (tp, pp); every cp ring would cross the slow links
    plan = _plan(SLOW, batch=1, seq=8192, hidden=512, layers=4, heads=8, vocab=512)
    assert {st.cp for p in plan.pipelines for st in p.stages} == {1}
    cp = plan.predicted["cp"]
    assert cp["chosen"] == 1 and set(cp["considered"]) == {"1", "2", "4"}
    assert "considered" in cp["reason"] and "not faster" in cp["reason"]
    lines = [line for line in plan.explain().splitlines() if line.startswith("context parallelism")]
    assert lines == [f"context parallelism: cp=1, {cp['reason']}"]
