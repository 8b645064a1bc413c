"""Attention under context parallelism: every rank of a cp group holds 1/cp of each sequence's tokens, and the
kernels here exchange keys and values (or heads) across the group so that each rank gets exactly its rows of
attention over the whole sequence.

Token layout (`zigzag_positions`, the causal load balancing of Megatron and torchtitan). The sequence is cut
into 2*cp equal chunks; rank i holds chunk i followed by chunk 2*cp-1-i. Under a causal mask, chunk a attends
to chunk b fully when b < a, on its diagonal when b == a, and not at all when b > a; pairing an early chunk
with a late one gives every rank the same amount of work (cp=2: rank 0 holds chunks 0 and 3, rank 1 chunks 1
and 2).

`ring_attention` (ring / blockwise attention). q, k and v of a rank are two chunks each. The K/V blocks travel
around the group: at step s (0..cp-1) a rank holds the K/V of rank index-s, and before computing on it posts
one `batch_isend_irecv` holding both the send of that block to the next rank and the receive of the next
block from the previous rank (so the transfer overlaps the computation, and the send and its receive are
always posted together, as NCCL requires). Per (q chunk, kv chunk) pair: entirely in the future -> skipped,
entirely in the past -> no mask, the same chunk -> a lower-triangular mask. Causal, each rank computes 2*cp+1
pairs per call (3 with its own block, 2 with each other one), of which 2 masked; non-causal, all 4*cp.
Partial results merge by online softmax: each block yields its output and log-sum-exp (fp32), and
out = sum_b exp(lse_b - lse) out_b with lse = logsumexp_b lse_b. A block runs torch's fused CPU attention
(flash attention for CPU, which returns the log-sum-exp and never holds the block's scores) on CPU ranks, and
an unfused fp32 formulation elsewhere (one chunk pair's scores at a time; priced so by cost_models/context.py).
Grouped-query attention (Hkv < H): K/V travel with their Hkv heads only; a block repeats them for its query
heads and adds the query heads' gradients back up.

The backward recomputes each block's probabilities from the saved q, k, v, output and log-sum-exp (nothing
per block is kept from the forward: the fused kernel's backward takes the call's final output and
log-sum-exp, as ring flash attention does) and rings K/V again; the dK/dV of a block are accumulated (fp32, or the
input's dtype when wider) into buffers that travel with it, one rank behind: after computing on a block a
rank adds its contribution to the buffers it received and sends them on. After the last step one more
exchange sends the buffers home, so each rank ends with the dK/dV of its own tokens.

`ulysses_attention` (DeepSpeed-Ulysses). An all-to-all turns the sequence-sharded [B, H, T/cp, D] into
head-sharded [B, H/cp, T, D] (the tokens concatenated in rank order, then sorted by position), each rank runs
`F.scaled_dot_product_attention` over the whole sequence for its heads, and a second all-to-all returns the
result to the sequence layout. The backward is the same two all-to-alls on the gradients (an all-to-all with
equal splits is its own adjoint). gloo implements `all_to_all_single` on CPU tensors, NCCL on CUDA ones.

Bytes one rank sends per call (`exchange_bytes`; kv = B * Hkv * T_local * D * itemsize, q = the same with H):

    ring     forward   (cp-1) * 2 kv                        K and V, cp-1 steps
             backward  (cp-1) * 2 kv + cp * 2 kv_acc        K/V again; dK/dV buffers at every step and home
                                                            (kv_acc: kv at the accumulators' itemsize)
    ulysses  forward   2 q + 2 kv'                          all_to_all inputs, the rank's own 1/cp included
             backward  2 q + 2 kv'                          (the convention of cost_models/comm.py);
                                                            kv' with lcm(Hkv, cp) heads (GQA expanded)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..cost_models.context import MODES, cp_exchange_bytes
from .dist import all_to_all, wait

aten = torch.ops.aten


def zigzag_positions(seq: int, cp: int, index: int) -> torch.Tensor:
    """The global token positions (int64) that rank `index` of a cp group of size `cp` holds: chunk `index`
    then chunk 2*cp-1-index of the sequence cut into 2*cp equal chunks. cp == 1 holds arange(seq)."""
    if cp < 1 or not 0 <= index < cp:
        raise ValueError(f"zigzag_positions: cp must be >= 1 and 0 <= index < cp (got cp={cp}, index={index})")
    if cp == 1:
        return torch.arange(seq, dtype=torch.int64)
    if seq % (2 * cp):
        raise ValueError(
            f"context parallelism cuts a sequence into 2*cp equal chunks, but seq={seq} is not divisible by "
            f"2*cp={2 * cp} (cp={cp}): pad the sequence to a multiple of {2 * cp} or choose another cp")
    c = seq // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, dtype=torch.int64) for i in _chunk_ids(cp, index)])


def exchange_bytes(batch: int, heads_kv: int, t_local: int, head_dim: int, cp: int, itemsize: int,
                   mode: str, *, heads: int | None = None) -> dict[str, int]:
    """Bytes one rank sends per attention call, {"forward": ..., "backward": ...}, as `ring_attention`
    (mode "ring") or `ulysses_attention` ("ulysses") send them: the planner's count
    (cost_models/context.py `cp_exchange_bytes`, the one formula; the tests check it against the tensors these
    functions hand to torch.distributed). `itemsize` is that of the attention's dtype (after autocast); `heads`
    is q's head count (default `heads_kv`: no grouped-query attention), which only Ulysses sends."""
    if mode not in MODES:
        raise ValueError(f"exchange_bytes: mode must be one of {MODES}, got {mode!r}")
    return cp_exchange_bytes(batch, heads_kv, t_local, head_dim, cp, itemsize, mode, heads_q=heads)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Any, causal: bool = True,
                   scale: float | None = None) -> torch.Tensor:
    """This rank's rows of softmax(q k^T * scale + causal mask over global positions) v, for q, k, v
    [B, H(kv), T_local, D] holding the tokens at zigzag_positions(T_local * cp, cp, rank in `group`), by
    ring attention (module docstring). k/v may have fewer heads (H % Hkv == 0). Under torch.autocast the
    inputs are cast as F.scaled_dot_product_attention casts them; the output has q's (cast) dtype."""
    q, k, v = _autocast_inputs(q, k, v)
    _check_shapes(q, k, v)
    group = dist.group.WORLD if group is None else group
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    with torch.autocast(q.device.type, enabled=False):  # the kernels choose their own precisions
        return _RingAttention.apply(q, k, v, group, causal, scale)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Any, causal: bool = True,
                      scale: float | None = None) -> torch.Tensor:
    """The same contract as `ring_attention`, by two all-to-alls over heads (DeepSpeed-Ulysses). Needs
    H % cp == 0; when Hkv % cp != 0, k and v are repeated to lcm(Hkv, cp) heads first."""
    q, k, v = _autocast_inputs(q, k, v)
    _check_shapes(q, k, v)
    group = dist.group.WORLD if group is None else group
    cp = dist.get_world_size(group)
    heads, heads_kv, t_local = q.shape[1], k.shape[1], q.shape[2]
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=heads != heads_kv)
    if heads % cp:
        raise ValueError(
            f"ulysses_attention shards the heads over the cp group, but H={heads} query heads are not divisible "
            f"by cp={cp}: use ring_attention or a cp that divides {heads}")
    if heads_kv % cp:
        repeat = math.lcm(heads_kv, cp) // heads_kv
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    positions = torch.cat([zigzag_positions(t_local * cp, cp, i) for i in range(cp)]).to(q.device)
    qh, kh, vh = (_AllToAll.apply(t, group, True) for t in (q, k, v))
    if causal:  # to position order, so that is_causal masks the right pairs
        order = torch.argsort(positions)
        qh, kh, vh = qh[:, :, order], kh[:, :, order], vh[:, :, order]
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale,
                                         enable_gqa=qh.shape[1] != kh.shape[1])
    if causal:
        out = out[:, :, positions]
    return _AllToAll.apply(out, group, False)


# ---- shared --------------------------------------------------------------------------------------------------


def _chunk_ids(cp: int, index: int) -> tuple[int, ...]:
    return (0,) if cp == 1 else (index, 2 * cp - 1 - index)


def _autocast_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v as autocast casts an F.scaled_dot_product_attention's inputs (lower precision: floating
    tensors other than float64 to the autocast dtype), unchanged outside autocast."""
    device = q.device.type
    if not torch.is_autocast_enabled(device):
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in (q, k, v))


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"attention expects q, k, v of [B, H, T_local, D] with k and v alike; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    (b, h, t, d), (bk, hk, tk, dk) = q.shape, k.shape
    if (b, t, d) != (bk, tk, dk) or h % hk:
        raise ValueError(f"attention expects k/v with q's batch, tokens and head size and a head count dividing "
                         f"q's; got q {tuple(q.shape)}, k/v {tuple(k.shape)}")


# ---- ring ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ring:
    """Where a rank sits in its cp group: its position, neighbours (global ranks) and chunk size."""

    group: Any
    cp: int
    index: int
    nxt: int
    prv: int
    chunk: int

    @staticmethod
    def of(group: Any, t_local: int) -> _Ring:
        cp, index = dist.get_world_size(group), dist.get_rank(group)
        if cp > 1:
            zigzag_positions(t_local * cp, cp, 0)  # raises on a length that does not cut into 2*cp chunks
        return _Ring(group, cp, index, dist.get_global_rank(group, (index + 1) % cp),
                     dist.get_global_rank(group, (index - 1) % cp), t_local // len(_chunk_ids(cp, 0)))

    def chunks(self, index: int) -> tuple[int, ...]:
        return _chunk_ids(self.cp, index)

    def slot(self, t: torch.Tensor, s: int) -> torch.Tensor:
        """Chunk slot `s` (0 or 1) of a [B, Hkv, T_local, D] tensor."""
        return t[:, :, s * self.chunk:(s + 1) * self.chunk]

    def shift(self, tensors: list[torch.Tensor], what: str) -> _Shift:
        return _Shift(self, tensors, what)


class _Shift:
    """One ring step: `tensors` sent to the next rank and as many received from the previous one, posted
    together in one `batch_isend_irecv`. `wait()` completes both and returns what was received."""

    def __init__(self, ring: _Ring, tensors: list[torch.Tensor], what: str) -> None:
        self.ring, self.what = ring, what
        if ring.cp == 1:
            self.works: list[Any] = []
            self.received = tensors
            return
        self.sent = [t.contiguous() for t in tensors]  # kept alive until the sends complete
        self.received = [torch.empty_like(t) for t in self.sent]
        ops = [dist.P2POp(dist.isend, t, ring.nxt, ring.group) for t in self.sent]
        ops += [dist.P2POp(dist.irecv, t, ring.prv, ring.group) for t in self.received]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        ring = self.ring
        peers = str(ring.prv) if ring.prv == ring.nxt else f"{ring.prv} or {ring.nxt}"
        for work in self.works:  # each once: a second wait of a gloo receive blocks
            wait(work, f"ring attention ({self.what})", peers, group=ring.group, device=self.received[0].device)
        self.works = []
        return self.received


def _pairs(mine: tuple[int, ...], theirs: tuple[int, ...], causal: bool) -> list[tuple[int, int, bool]]:
    """(q slot, kv slot, diagonal) of the chunk pairs that see anything: causal, a kv chunk after the q chunk
    is skipped and the same chunk is masked on its diagonal."""
    return [(a, b, causal and kb == qa) for a, qa in enumerate(mine) for b, kb in enumerate(theirs)
            if not causal or kb <= qa]


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """k or v [B, Hkv, N, D] with each kv head repeated for its H / Hkv query heads."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fused(q: torch.Tensor) -> bool:
    """Whether a block runs torch's fused CPU attention kernel (flash attention for CPU), which returns the
    log-sum-exp a merge needs and never holds a block's scores; elsewhere the block runs unfused (fp32 scores of
    one chunk pair at a time: cost_models/context.py prices them)."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: fp32 output and log-sum-exp of q [B, H, c, D] against k, v [B, Hkv, c, D] (causal: the
    lower-triangular mask of a chunk against itself); matmuls in the input dtype, statistics in fp32."""
    k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    if _fused(q):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=None,
                                                                    scale=scale)
        return out.float(), lse
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).tril(), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    return torch.matmul(p.to(v.dtype), v).float(), lse


def _attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, scale: float, causal: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's fp32 dq, dk, dv from the call's final output `out` and log-sum-exp `lse` of these rows (the
    probabilities of the block are exp(scores - lse): the block's share of the whole softmax)."""
    heads, heads_kv = q.shape[1], k.shape[1]
    ke, ve = _expand(k, heads), _expand(v, heads)
    if _fused(q):
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, ke, ve, out, lse, 0.0, causal, attn_mask=None, scale=scale)
        dq, dk, dv = dq.float(), dk.float(), dv.float()
    else:
        s = torch.matmul(q, ke.transpose(-1, -2)).float() * scale
        if causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).tril(), -math.inf)
        p = torch.exp(s - lse[..., None])
        delta = (dout.float() * out.float()).sum(-1)
        dv = torch.matmul(p.to(dout.dtype).transpose(-1, -2), dout).float()
        ds = p * (torch.matmul(dout, ve.transpose(-1, -2)).float() - delta[..., None])
        dq = torch.matmul(ds.to(ke.dtype), ke).float() * scale
        dk = torch.matmul(ds.to(q.dtype).transpose(-1, -2), q).float() * scale
    if heads != heads_kv:  # the query heads of a kv head add up their gradients
        b, _, n, d = dk.shape
        dk = dk.view(b, heads_kv, heads // heads_kv, n, d).sum(2)
        dv = dv.view(b, heads_kv, heads // heads_kv, n, d).sum(2)
    return dq, dk, dv


def _merge(acc: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor, lse: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    new = torch.logaddexp(acc_lse, lse)
    return acc_out * torch.exp(acc_lse - new)[..., None] + out * torch.exp(lse - new)[..., None], new


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, causal: bool,
                scale: float) -> torch.Tensor:
        ring = _Ring.of(group, q.shape[2])
        qs = [ring.slot(q, a) for a in range(len(ring.chunks(0)))]
        acc: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(qs)
        kc, vc = k.contiguous(), v.contiguous()
        for step in range(ring.cp):
            # posted before the computation on the current block, which it overlaps
            nxt = ring.shift([kc, vc], "K/V") if step < ring.cp - 1 else None
            owner = (ring.index - step) % ring.cp
            for a, b, diagonal in _pairs(ring.chunks(ring.index), ring.chunks(owner), causal):
                out_b, lse_b = _attend(qs[a], ring.slot(kc, b), ring.slot(vc, b), scale, diagonal)
                acc[a] = _merge(acc[a], out_b, lse_b)
            if nxt is not None:
                kc, vc = nxt.wait()
        out = torch.cat([o for o, _ in acc], dim=2).to(q.dtype)  # type: ignore[misc]
        ctx.save_for_backward(q, k, v, out, torch.stack([lse for _, lse in acc]))  # type: ignore[misc]
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = _ring_backward(q, k, v, out, lse, dout.to(q.dtype), ctx.group, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None


def _ring_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   dout: torch.Tensor, group: Any, causal: bool, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ring = _Ring.of(group, q.shape[2])
    slots = range(len(ring.chunks(0)))
    qs, douts, outs = ([ring.slot(t, a) for a in slots] for t in (q, dout, out))
    dqs = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in qs]
    acc_dtype = torch.promote_types(k.dtype, torch.float32)
    kc, vc = k.contiguous(), v.contiguous()
    carried: _Shift | None = None  # the dK/dV buffers of the block this rank computes on next, in flight
    for step in range(ring.cp):
        nxt = ring.shift([kc, vc], "K/V, backward") if step < ring.cp - 1 else None
        owner = (ring.index - step) % ring.cp
        dk_b = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
        dv_b = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
        for a, b, diagonal in _pairs(ring.chunks(ring.index), ring.chunks(owner), causal):
            dq, dk, dv = _attend_backward(qs[a], ring.slot(kc, b), ring.slot(vc, b), douts[a], outs[a], lse[a],
                                          scale, diagonal)
            dqs[a] += dq
            ring.slot(dk_b, b).add_(dk)
            ring.slot(dv_b, b).add_(dv)
        if carried is not None:
            dk_in, dv_in = carried.wait()
            dk_b += dk_in
            dv_b += dv_in
        # after the last step this is the way home: the buffers of the previous rank's block
        carried = ring.shift([dk_b, dv_b], "dK/dV")
        if nxt is not None:
            kc, vc = nxt.wait()
    assert carried is not None
    dk, dv = carried.wait()
    return torch.cat(dqs, dim=2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---- ulysses -------------------------------------------------------------------------------------------------


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Slice i of x's first dimension goes to rank i of `group`; slice i of the result came from rank i."""
    return all_to_all(x, None, None, group, "ulysses attention (all-to-all)")


def _seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[B, H, T_local, D] sequence-sharded -> [B, H/cp, cp * T_local, D] head-sharded, tokens in rank order."""
    cp = dist.get_world_size(group)
    b, h, t, d = x.shape
    send = x.reshape(b, cp, h // cp, t, d).transpose(0, 1).contiguous()
    return _all_to_all(send, group).permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * t, d)


def _heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The inverse of `_seq_to_heads`."""
    cp = dist.get_world_size(group)
    b, h, t, d = x.shape
    send = x.reshape(b, h, cp, t // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    return _all_to_all(send, group).transpose(0, 1).reshape(b, cp * h, t // cp, d)


class _AllToAll(torch.autograd.Function):
    """`_seq_to_heads` (to_heads) or `_heads_to_seq`; the gradient goes back by the other one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return _seq_to_heads(x, group) if to_heads else _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        back = _heads_to_seq(grad, ctx.group) if ctx.to_heads else _seq_to_heads(grad, ctx.group)
        return back, None, None


__all__ = ["exchange_bytes", "ring_attention", "ulysses_attention", "zigzag_positions"]
