"""Plan-invariant randomness: the random ops of a stage program draw from a counter-based stream.

The rule. The value a random op draws for element e of sample g in step t is a hash of
(seed, t, the op's node name, g, e): e is the element's index within the sample's slice of the op's full
(global, unsharded) tensor, g the sample's index in the global batch. Nothing else enters it, so a sample
sees the same masks whatever the plan: how the batch is split between data-parallel pipelines (even
unevenly) and into micro-batches, which stage or rank runs the op, whether its block is recomputed (the
recomputation draws the same values: `remembering`), and tensor parallelism (a shard draws its slice of
the full tensor's values, a replicated tensor the same values on every rank). Any plan then trains
exactly like autopar's one-device program of the same model and seed (`autopar.compile(model, "1x1xcpu",
..., seed=)`).

The sample is read off the op's leading dimension: when its size is a multiple of the micro-batch's n
samples, the leading dimension holds them in order, each on size / n consecutive rows (batch-first
layouts, flattened ones such as (batch * seq, hidden) too); otherwise the op's tensor has no batch
dimension and every sample, micro-batch and rank draws the same values. A model whose activations are
sequence-first ((seq, batch, hidden)) has masks keyed by the wrong dimension: they are still
deterministic, but they change with the micro-batch size.

What differs from eager PyTorch: these values are not torch's generator's (`torch.manual_seed` does not
change them; `seed=` does), and scaled-dot-product attention with dropout_p > 0 runs as its math
formulation (scores, softmax, keyed dropout, @ V), which holds the attention probabilities as torch's math
backend does (priced so: passes/annotate.py measures this function). Ops drawn this way: dropout,
native_dropout, feature_dropout, bernoulli, rand, randn, rand_like, randn_like, and the attention's dropout;
any other random op warns (RandomnessWarning) and draws from torch's generator.

The executor says which samples a call computes (`draws(Draws(seed, step, first_sample, samples))`);
outside it (annotate's measurements, a bare call) the stream is keyed by step 0 and sample 0.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from ..errors import RandomnessWarning

aten = torch.ops.aten

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**31: a product with a 32-bit value stays below 2**63 in int64
# elements hashed at once: the draw's int64 scratch stays ~0.5 MiB on a CPU (~32 MiB on an accelerator), whatever
# the tensor (not priced). At 1 << 16 it was ~2 MiB, 1.9 MB of a 40 MiB rank's peak on the meta GPT-2 user path
_CHUNK = 1 << 14


@dataclass(frozen=True)
class Draws:
    """Which values a call draws: `samples` samples of the global batch from `first` on, in step `step`."""

    seed: int = 0
    step: int = 0
    first: int = 0
    samples: int = 0  # 0: no batch known (every tensor is batch-free)


_CURRENT: contextvars.ContextVar[Draws | None] = contextvars.ContextVar("autopar_draws", default=None)


def _current() -> Draws:
    return _CURRENT.get() or Draws()


@contextlib.contextmanager
def draws(d: Draws) -> Iterator[None]:
    """Random ops called inside draw `d`'s values."""
    token = _CURRENT.set(d)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def remembering(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` bound to the draws current now: a checkpointed forward recomputed in the backward, outside the
    executor's `draws`, draws the masks its forward drew."""
    d = _current()

    def call(*args: Any, **kwargs: Any) -> Any:
        with draws(d):
            return fn(*args, **kwargs)

    return call


def _mix_int(x: int) -> int:
    x &= _M32
    for _ in range(2):
        x ^= x >> 16
        x = (x * _MUL) & _M32
    return x ^ (x >> 16)


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """The same 32-bit finalizer on an int64 tensor of 32-bit values, in place."""
    for _ in range(2):
        x.bitwise_xor_(x >> 16).mul_(_MUL).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 16)


def op_key(name: str) -> int:
    return zlib.crc32(name.encode())


def _uniform_block(key: int, stream: int, global_shape: tuple[int, ...], local_shape: tuple[int, ...],
                   offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """float32 uniforms in [0, 1) of the block `local_shape` at `offsets` of a tensor of `global_shape`."""
    d = _current()
    base = _mix_int(_mix_int(_mix_int(_mix_int(d.seed) ^ (d.step & _M32)) ^ key) ^ stream)
    total = math.prod(global_shape)
    n = d.samples if d.samples and global_shape and global_shape[0] % d.samples == 0 else 0
    per = total // n if n else max(total, 1)
    # one key per sample (a batch-free tensor: one for all), made on the device: no host-to-device copy,
    # which would sync the host on CUDA
    keys = _mix_(torch.arange(d.first, d.first + n, dtype=torch.int64, device=device).bitwise_and_(_M32)
                 .bitwise_xor_(base)) if n else torch.full((1,), _mix_int(base ^ _M32), dtype=torch.int64,
                                                           device=device)
    whole = tuple(local_shape) == tuple(global_shape)
    gstrides = [math.prod(global_shape[i + 1:]) for i in range(len(global_shape))]
    count = math.prod(local_shape)
    out = torch.empty(count, dtype=torch.float32, device=device)
    # meta (pricing): the same kernels on the whole tensor; CUDA: larger chunks, fewer launches
    chunk = max(count, 1) if device.type == "meta" else _CHUNK if device.type == "cpu" else _CHUNK << 6
    for lo in range(0, count, chunk):
        flat = torch.arange(lo, min(lo + chunk, count), dtype=torch.int64, device=device)
        if not whole:  # the local block's element -> its index in the global tensor
            rem, flat = flat, torch.zeros_like(flat)
            for dim in reversed(range(len(local_shape))):
                flat += (rem % local_shape[dim] + offsets[dim]) * gstrides[dim]
                rem = rem // local_shape[dim]
        sample = flat // per
        h = _mix_(flat.sub_(sample * per).bitwise_and_(_M32).bitwise_xor_(0x9E3779B9))
        h.bitwise_xor_(keys[sample])
        out[lo:lo + flat.numel()] = (_mix_(h) >> 8).to(torch.float32) * (2.0 ** -24)
    return out.view(local_shape)


def block_of(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...], Any]:
    """(local tensor, global shape, offsets of the local block, DTensor layout or None)."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offsets = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
        return x.to_local(), tuple(x.shape), tuple(offsets), (x.device_mesh, x.placements, x.shape, x.stride())
    return x, tuple(x.shape), (0,) * x.dim(), None


def _rewrap(local: torch.Tensor, layout: Any) -> torch.Tensor:
    if layout is None:
        return local
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride = layout
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def uniform_like(x: torch.Tensor, key: int, stream: int = 0) -> torch.Tensor:
    """Uniforms in [0, 1) shaped (and, for a DTensor, laid out) as `x`."""
    local, shape, offsets, layout = block_of(x)
    return _rewrap(_uniform_block(key, stream, shape, tuple(local.shape), offsets, local.device), layout)


class _Masked(torch.autograd.Function):
    """x * keep * scale, saving only the boolean mask for the backward (as native_dropout does)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return x.mul(keep).mul_(scale)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        (keep,) = ctx.saved_tensors
        return g.mul(keep).mul_(ctx.scale), None, None


Block = tuple[tuple[int, ...], tuple[int, ...]]  # (global shape, offsets) of a plain tensor that is one block


def _dropped(x: torch.Tensor, p: float, key: int, mask_shape: tuple[int, ...] | None = None,
             block: Block | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    local, shape, offsets, layout = block_of(x) if block is None else (x, *block, None)
    if mask_shape is None:
        keep = _uniform_block(key, 0, shape, tuple(local.shape), offsets, local.device) >= p
    else:  # one draw per (sample, channel), broadcast over the rest (feature dropout): drawn whole
        keep = _uniform_block(key, 0, mask_shape, mask_shape, (0,) * len(mask_shape), local.device) >= p
        if layout is not None:
            keep = keep.expand(shape)[tuple(slice(o, o + s) for o, s in zip(offsets, local.shape, strict=True))]
    out = _Masked.apply(local, keep, 1.0 / (1.0 - p)) if p < 1 else local * 0
    return _rewrap(out, layout), keep


def keyed_dropout(x: torch.Tensor, p: float, train: bool, key: int) -> torch.Tensor:
    """aten.dropout, keyed."""
    if not train or p == 0:
        return x
    return _dropped(x, p, key)[0]


def keyed_native_dropout(x: torch.Tensor, p: float, train: bool | None, key: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """aten.native_dropout (output, mask), keyed."""
    if train is False or p == 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    return _dropped(x, p, key)


def keyed_feature_dropout(x: torch.Tensor, p: float, train: bool, key: int) -> torch.Tensor:
    """aten.feature_dropout (a mask per sample and channel), keyed."""
    if not train or p == 0:
        return x
    return _dropped(x, p, key, tuple(x.shape[:2]) + (1,) * (x.dim() - 2))[0]


def keyed_bernoulli(x: torch.Tensor, p: float | None, key: int) -> torch.Tensor:
    """aten.bernoulli (probabilities `x`) or bernoulli.p (probability `p`, shaped as `x`), keyed."""
    u = uniform_like(x, key)
    return (u < (x if p is None else p)).to(x.dtype)


def _normal(u1: torch.Tensor, u2: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos((2 * math.pi) * u2)


def keyed_rand_like(x: torch.Tensor, key: int, normal: bool = False, dtype: torch.dtype | None = None
                    ) -> torch.Tensor:
    """aten.rand_like / randn_like, keyed."""
    u = uniform_like(x, key)
    v = _normal(u, uniform_like(x, key, 1)) if normal else u
    return v.to(dtype or x.dtype)


def keyed_rand(size: list[int], key: int, normal: bool = False, dtype: torch.dtype | None = None,
               device: torch.device | None = None) -> torch.Tensor:
    """aten.rand / randn, keyed (the factory's device as captured: the runtime retargets captured devices)."""
    shape = tuple(int(s) for s in size)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    u = _uniform_block(key, 0, shape, shape, (0,) * len(shape), dev)
    v = _normal(u, _uniform_block(key, 1, shape, shape, (0,) * len(shape), dev)) if normal else u
    return v.to(dtype or torch.get_default_dtype())


def keyed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                    enable_gqa: bool = False, *, key: int = 0, block: Block | None = None) -> torch.Tensor:
    """aten.scaled_dot_product_attention with its dropout keyed: the math formulation (torch's math
    backend's order: scores, mask, softmax, dropout, @ V). `block`: the plain tensors are one block of the
    whole attention's (a tensor-parallel rank's heads or batch rows), the probabilities' (global shape,
    offsets), so the rank draws its slice of the whole attention's mask."""
    e = q.shape[-1]
    s = 1.0 / math.sqrt(e) if scale is None else scale
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scores = (q * s) @ k.transpose(-2, -1)
    L, S = q.shape[-2], k.shape[-2]
    if is_causal:
        causal = torch.ones(L, S, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        probs = _dropped(probs, dropout_p, key, block=block)[0]
    return probs @ v


def _dropout_p(target: Any, args: tuple, kwargs: dict) -> float | None:
    """The call's dropout_p argument (None: the op has none)."""
    names = [a.name for a in target._schema.arguments]
    if "dropout_p" not in names:
        return None
    i = names.index("dropout_p")
    return float((args[i] if len(args) > i else kwargs.get("dropout_p", 0.0)) or 0.0)


def keyed_call(target: Any, args: tuple, kwargs: dict, key: int) -> tuple[Callable[..., Any], tuple, dict] | None:
    """The keyed function and arguments that replace a call of captured random op `target` (None: the op
    draws nothing, or is not one this module keys). annotate prices the replacement, the runtime runs it."""
    t, a, kw = target, tuple(args), dict(kwargs)
    if t is aten.dropout.default:
        return keyed_dropout, (*a, key), {}
    if t is aten.native_dropout.default:
        return keyed_native_dropout, (*a, key), {}
    if t is aten.feature_dropout.default:
        return keyed_feature_dropout, (*a, key), {}
    if t is aten.bernoulli.default:
        return keyed_bernoulli, (a[0], None, key), {}
    if t is aten.bernoulli.p:
        return keyed_bernoulli, (a[0], a[1], key), {}
    if t in (aten.rand_like.default, aten.randn_like.default):
        return keyed_rand_like, (a[0], key, t is aten.randn_like.default), {"dtype": kw.get("dtype")}
    if t in (aten.rand.default, aten.randn.default):
        return keyed_rand, (a[0], key, t is aten.randn.default), {"dtype": kw.get("dtype"),
                                                                    "device": kw.get("device")}
    if t is aten.scaled_dot_product_attention.default and _dropout_p(t, a, kw):
        names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        extra = dict(zip(names, a[3:], strict=False))
        return keyed_attention, a[:3], {**extra, **kw, "key": key}
    return None


def _random(target: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a call draws from torch's generator (an op with a dropout_p argument only when it is > 0)."""
    if not (isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags):
        return False
    p = _dropout_p(target, args, kwargs)
    return p is None or p > 0


def _draws(target: Any, args: tuple, kwargs: dict) -> bool:
    """`_random`, with dropouts of p = 0 or train=False drawing nothing."""
    if not _random(target, args, kwargs):
        return False
    names = [a.name for a in target._schema.arguments]
    if "p" in names and "train" in names:
        p, train = (args[names.index(k)] if len(args) > names.index(k) else kwargs.get(k, d)
                    for k, d in (("p", 0.5), ("train", True)))
        return bool(p) and train is not False
    return True


def draws_random(gm: fx.GraphModule) -> list[str]:
    """The random ops `gm` calls that draw values (a dropout with p = 0 draws none), sorted and distinct."""
    return sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function" and _draws(n.target, n.args,
                                                                                             n.kwargs)})


def keyed_randomness(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` with every random op drawing from the keyed stream (in place; returned). An op not covered
    warns once per program (RandomnessWarning) and keeps torch's generator."""
    changed, foreign = False, set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        new = keyed_call(node.target, node.args, node.kwargs, op_key(node.name))
        if new is None:
            if _random(node.target, node.args, node.kwargs):
                foreign.add(str(node.target))
            continue
        fn, args, kwargs = new
        node.target, node.args, node.kwargs = fn, args, kwargs
        changed = True
    if foreign:
        warnings.warn(RandomnessWarning(
            f"{', '.join(sorted(foreign))} draw(s) from torch's generator, not autopar's keyed stream: their "
            f"values depend on the plan (which rank runs which samples), so training does not equal the "
            f"one-device program. Use dropout / bernoulli / rand(n)(_like) or report the op."), stacklevel=2)
    if changed:
        gm.recompile()
    return gm


__all__ = ["Draws", "block_of", "draws", "draws_random", "keyed_attention", "keyed_call", "keyed_dropout",
           "keyed_randomness", "op_key", "remembering", "uniform_like"]
