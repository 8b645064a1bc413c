"""Context parallelism (cp): what one rank of a cp group sends per attention call, and what it holds.

A cp group of cp ranks splits every sequence of T tokens into 2 cp chunks; rank c holds chunks c and
2cp-1-c (zigzag), T_l = T / cp tokens. Per attention call (one causal self-attention over B samples, Hq query
heads, Hkv key/value heads of head_dim D, elements of `itemsize` bytes in the compute dtype; heads and samples
as the rank holds them, i.e. after tensor parallelism split the heads) let

    blk = B x Hkv x T_l x D x itemsize        the bytes of one K (or V) block
    acc = B x Hkv x T_l x D x max(itemsize, 4)  one dK (or dV) accumulator: sums of cp partial gradients are
                                              kept and sent in fp32 (bf16 sums would lose precision)

Ring attention ("ring", the default)
    forward   cp - 1 ring steps; in each the rank sends its current K and V block to the next rank (and receives
              one from the previous), overlapped with the block computation on the block it holds:
              (cp - 1) x 2 blk
    backward  the K/V blocks travel around the ring again with the dK/dV accumulators, cp - 1 steps of
              2 blk + 2 acc each, plus one final send of the dK/dV accumulators home (2 acc, not overlapped):
              (cp - 1) x 2 blk (K, V) + cp x 2 acc (dK, dV)
    memory    kept for the backward: the attention's output (B x Hq x T_l x D x itemsize) and an fp32
              log-sum-exp (B x Hq x T_l x 4); in flight while an attention runs: the K/V block computed on and
              the one arriving (4 blk) in forward, and in backward also the dK/dV accumulators, computed on
              and arriving (4 blk + 4 acc); and one chunk pair's block at a time (c = T / (2 cp) tokens of the
              chunk). On a CPU the block runs torch's fused attention (runtime/ring_attention.py), which holds
              fp32 rows of the chunk only (Q = B x Hq x c x D x 4): its output, log-sum-exp and the merge in
              forward (5 Q), the gradients and their fp32 copies in backward (4.5 Q; the kernel's per-thread buffers
              add a fixed ~1 MiB, more than that at small head sizes). Elsewhere it runs unfused,
              holding fp32 scores (S = B x Hq x c x c x 4): scores, their shifted copy and probabilities in
              forward (3 S), scores, probabilities and their gradients in backward (5 S). Measured at the
              allocator (tests/test_cp_pricing.py)

Ulysses ("ulysses": all-to-all by heads; needs Hq divisible by cp, and k, v are repeated to lcm(Hkv, cp) heads
where cp does not divide Hkv: Hkv below stands for that)
    forward   an all-to-all of q, k, v (tokens -> heads) and one of the output back (heads -> tokens)
    backward  the mirror: the output's gradient in, dq, dk, dv back
    The buffers handed to the all-to-alls: forward q + k + v + out, backward the same sizes again, q and out
    being B x Hq x T_l x D x itemsize and k, v B x Hkv x T_l x D x itemsize each (`cp_exchange_bytes` counts
    these, as the runtime hands them over; of each a rank keeps 1/cp and sends (cp - 1)/cp over the wire, what
    `ExchangeSteps.forward` / `backward` hold).
    memory    the all-to-all's send and receive buffers (2 x the tensors it moves) while it runs

`cp_exchange_bytes` gives the totals, `exchange_steps` the steps a time model needs (bytes one rank sends per
step, in order, and how many of them overlap a block computation), `attention_memory` the bytes above.
Pure integer arithmetic: the runtime's own count (runtime/ring_attention.py `exchange_bytes`) must agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import PlanError

RING, ULYSSES = "ring", "ulysses"
MODES = (RING, ULYSSES)
LSE_BYTES = 4  # the log-sum-exp ring attention keeps per query row and head is fp32
ACC_BYTES = 4  # the dK/dV accumulators travel in fp32 (or the compute dtype where wider)
SCORE_BYTES = 4  # a block's scores, probabilities and merged rows are fp32
# tensors alive at once in one block's forward / backward: fused (CPU), fp32 [B, Hq, c, D] rows; unfused, fp32
# [B, Hq, c, c] scores (module docstring)
FUSED_BLOCK, UNFUSED_BLOCK = (5, 4.5), (3, 5)


def _check(batch: int, heads_kv: int, t_local: int, head_dim: int, cp: int, itemsize: int, mode: str,
           heads_q: int) -> None:
    for name, v in (("batch", batch), ("heads_kv", heads_kv), ("t_local", t_local), ("head_dim", head_dim),
                    ("cp", cp), ("itemsize", itemsize), ("heads_q", heads_q)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanError(f"cp_exchange_bytes: {name} must be a positive integer, got {v!r}.")
    if mode not in MODES:
        raise PlanError(f"cp_exchange_bytes: mode {mode!r}; choose one of {list(MODES)}.")
    if mode == ULYSSES and heads_q % cp:
        raise PlanError(f"Ulysses attention moves whole heads: cp={cp} must divide the local query heads ({heads_q}).")


def ulysses_kv_heads(heads_kv: int, cp: int) -> int:
    """The key/value heads Ulysses moves: Hkv, or lcm(Hkv, cp) where cp does not divide it (k and v repeated)."""
    return heads_kv if heads_kv % cp == 0 else math.lcm(heads_kv, cp)


def kv_block_bytes(batch: int, heads_kv: int, t_local: int, head_dim: int, itemsize: int) -> int:
    """Bytes of one K (or V) block a rank holds: B x Hkv x T_l x D x itemsize."""
    return batch * heads_kv * t_local * head_dim * itemsize


@dataclass(frozen=True)
class ExchangeSteps:
    """One attention call's exchange as a time model prices it: per direction, the bytes one rank sends in each
    step, in order; the first `overlapped_*` steps run beside a block computation (ring: the transfer of step i
    overlaps the computation on the block the rank holds), the rest are exposed. `kind`: "p2p" (ring: one send to
    the next rank and one receive from the previous per step) or "all_to_all" (Ulysses: bytes = what the rank
    sends to the others, (cp - 1)/cp of its buffer; `buffers` the whole buffers, as collectives are priced)."""

    mode: str
    kind: str
    forward: tuple[int, ...]
    backward: tuple[int, ...]
    overlapped_forward: int
    overlapped_backward: int
    buffers_forward: tuple[int, ...] = ()
    buffers_backward: tuple[int, ...] = ()

    def totals(self) -> dict[str, int]:
        """`cp_exchange_bytes`' figures: the bytes a ring rank sends, the buffers an all-to-all is handed."""
        if self.kind == "all_to_all":
            return {"forward": sum(self.buffers_forward), "backward": sum(self.buffers_backward)}
        return {"forward": sum(self.forward), "backward": sum(self.backward)}


def exchange_steps(batch: int, heads_kv: int, t_local: int, head_dim: int, cp: int, itemsize: int,
                   mode: str = RING, *, heads_q: int | None = None) -> ExchangeSteps:
    """The steps of one attention call's exchange (module docstring); `heads_q` defaults to `heads_kv`."""
    hq = heads_kv if heads_q is None else heads_q
    _check(batch, heads_kv, t_local, head_dim, cp, itemsize, mode, hq)
    blk = kv_block_bytes(batch, heads_kv, t_local, head_dim, itemsize)
    if cp == 1:
        return ExchangeSteps(mode, "p2p" if mode == RING else "all_to_all", (), (), 0, 0)
    if mode == RING:
        acc = kv_block_bytes(batch, heads_kv, t_local, head_dim, max(itemsize, ACC_BYTES))
        return ExchangeSteps(RING, "p2p", (2 * blk,) * (cp - 1), (2 * blk + 2 * acc,) * (cp - 1) + (2 * acc,),
                             cp - 1, cp - 1)
    q = kv_block_bytes(batch, hq, t_local, head_dim, itemsize)
    qkv, out = q + 2 * kv_block_bytes(batch, ulysses_kv_heads(heads_kv, cp), t_local, head_dim, itemsize), q
    sent = lambda x: (cp - 1) * x // cp  # noqa: E731  (exact: the heads divide by cp)
    return ExchangeSteps(ULYSSES, "all_to_all", (sent(qkv), sent(out)), (sent(out), sent(qkv)), 0, 0,
                         (qkv, out), (out, qkv))


def cp_exchange_bytes(batch: int, heads_kv: int, t_local: int, head_dim: int, cp: int, itemsize: int,
                      mode: str = RING, *, heads_q: int | None = None) -> dict[str, int]:
    """Bytes one rank sends per attention call: {"forward": ..., "backward": ...} (module docstring). `batch`
    samples, `heads_kv` key/value heads (and `heads_q` query heads, for Ulysses; default `heads_kv`) as the rank
    holds them, `t_local` = T / cp tokens, `head_dim`, `itemsize` bytes per element in the compute dtype."""
    return exchange_steps(batch, heads_kv, t_local, head_dim, cp, itemsize, mode, heads_q=heads_q).totals()


def attention_memory(batch: int, heads_kv: int, t_local: int, head_dim: int, cp: int, itemsize: int,
                     mode: str = RING, *, heads_q: int | None = None, fused: bool = False) -> dict[str, int]:
    """Bytes one rank holds for one attention call beyond the plain attention on its tokens (module docstring):
    "saved" (ring: the output and the fp32 log-sum-exp kept for the backward; a pricing subtracts what the
    captured attention already saves of them), "forward" and "backward" (transient while the call runs)."""
    hq = heads_kv if heads_q is None else heads_q
    _check(batch, heads_kv, t_local, head_dim, cp, itemsize, mode, hq)
    if cp == 1:
        return {"saved": 0, "forward": 0, "backward": 0}
    blk = kv_block_bytes(batch, heads_kv, t_local, head_dim, itemsize)
    q = kv_block_bytes(batch, hq, t_local, head_dim, itemsize)
    if mode == RING:
        acc = kv_block_bytes(batch, heads_kv, t_local, head_dim, max(itemsize, ACC_BYTES))
        chunk = t_local // 2
        if fused:  # fp32 rows of one chunk (module docstring)
            unit, (fwd, bwd) = batch * hq * chunk * head_dim * SCORE_BYTES, FUSED_BLOCK
        else:  # one chunk pair's fp32 scores
            unit, (fwd, bwd) = batch * hq * chunk * chunk * SCORE_BYTES, UNFUSED_BLOCK
        return {"saved": q + batch * hq * t_local * LSE_BYTES, "forward": 4 * blk + math.ceil(fwd * unit),
                "backward": 4 * blk + 4 * acc + math.ceil(bwd * unit)}
    qkv = q + 2 * kv_block_bytes(batch, ulysses_kv_heads(heads_kv, cp), t_local, head_dim, itemsize)
    return {"saved": 0, "forward": 2 * qkv, "backward": 2 * qkv}


def ring_call_seconds(compute_f: float, compute_b: float, steps: ExchangeSteps, seconds: dict[int, float]
                      ) -> tuple[float, float, float, float]:
    """One ring attention call's (forward compute, forward exposed exchange, backward compute, backward exposed
    exchange) seconds from the block computation of one step (`compute_f`, `compute_b`: 1/cp of the rank's
    attention) and the transfer seconds of each step size (`seconds`: bytes -> seconds over the slowest ring
    link). cp block computations; each overlapped step costs max(block, transfer), so the exposed part is the
    excess of the transfer over the block; the final homecoming send is exposed."""
    cp = len(steps.forward) + 1
    fwd = sum(max(0.0, seconds[x] - compute_f) for x in steps.forward[:steps.overlapped_forward])
    fwd += sum(seconds[x] for x in steps.forward[steps.overlapped_forward:])
    bwd = sum(max(0.0, seconds[x] - compute_b) for x in steps.backward[:steps.overlapped_backward])
    bwd += sum(seconds[x] for x in steps.backward[steps.overlapped_backward:])
    return cp * compute_f, fwd, cp * compute_b, bwd


__all__ = ["ACC_BYTES", "FUSED_BLOCK", "LSE_BYTES", "MODES", "RING", "SCORE_BYTES", "ULYSSES", "UNFUSED_BLOCK",
           "ExchangeSteps", "attention_memory", "cp_exchange_bytes", "exchange_steps", "kv_block_bytes",
           "ring_call_seconds", "ulysses_kv_heads"]
