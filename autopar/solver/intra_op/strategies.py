"""Sharding strategies of single ops on a 1-D mesh of `tp` devices, for the intra-op ILP (`intra_op.py`).

A tensor's layout on the mesh is R (every device holds all of it), S(d) (device i holds the i-th of `tp`
equal slices along dim d) or P (every device holds a full-shaped partial sum; the tensor is their sum).
Layouts are ints: `R` = -1, `P` = -2, d >= 0 for S(d).

A `Strategy` fixes the layout each tensor input must arrive in, the layout its gradient leaves in (P where
the op consumes a replicated input while its output is split, e.g. the input of a column-parallel linear or
the weight of a batch-sharded one), the output layout, how many ways the op's work is split, and any
collective the op runs itself (vocab-parallel cross-entropy's statistics). Strategy 0 of every op is "R":
all inputs replicated and the op run whole on every device, valid for any op.

Most ops are described as a loop nest over labelled dims (`_loop`): sharding an output dim splits every
operand that has it and replicates the others (whose gradients are then partial); sharding a contracted dim
splits the operands that have it and leaves a partial-sum output. Megatron's column-parallel ("col"),
row-parallel ("row") and batch-sharded ("S(d)") linear, head- or batch-sharded attention and vocab-parallel
embedding fall out of that. Views map an input layout to an output layout (`view_map`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

from ...cost_models.compute import base_name, classify
from ...ir.graph import OpNode, TensorMeta

R = -1
P = -2


def layout_name(layout: int) -> str:
    return "R" if layout == R else "P" if layout == P else f"S({layout})"


class TensorArg(NamedTuple):
    """Stands for the `index`-th tensor input in `OpSpec.args`."""

    index: int


MISSING = object()  # an argument the graph did not record (no fx graph): callers fall back to "R" only


@dataclass(frozen=True)
class Strategy:
    name: str
    out: int  # layout of every output
    ins: tuple[int, ...]  # required layout of each positional tensor input
    in_grads: tuple[int, ...]  # layout each input's gradient comes out in
    split_fwd: int = 1  # forward work is divided this many ways
    split_bwd: int = 1
    comm_fwd: tuple[tuple[str, float], ...] = ()  # collectives the op runs itself: (kind, bytes)
    # collectives of its own output activations: (kind, output index), priced at the activation's bytes in
    # the plan's precision and micro-batch (the runtime's all-reduce right after a row-parallel linear)
    comm_out: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class OpSpec:
    """What strategy enumeration sees of one node."""

    op: str  # base aten name: "linear", "view", "getitem", ...
    target: str
    outs: tuple[TensorMeta, ...]
    ins: tuple[TensorMeta, ...]  # positional tensor inputs
    params: frozenset[int] = frozenset()  # positions in `ins` that are parameters
    args: tuple | None = None  # fx args with tensors as TensorArg; None when unknown
    kwargs: dict = field(default_factory=dict)

    def arg(self, pos: int, key: str, default: Any = None) -> Any:
        if self.args is None:
            return MISSING
        if len(self.args) > pos:
            return self.args[pos]
        return self.kwargs.get(key, default)


# ---- views ----------------------------------------------------------------------------------------

RESHAPES = {"view", "_unsafe_view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as",
            "_reshape_alias"}
# Ops that leave values and shape alone; they are linear, so a partial sum stays one.
IDENTITIES = {"alias", "detach", "to", "_to_copy", "clone", "contiguous", "lift_fresh", "lift_fresh_copy",
              "type_as", "getitem"}
VIEWS = RESHAPES | IDENTITIES | {"permute", "transpose", "t", "swapaxes", "swapdims", "unbind", "select",
                                 "chunk", "split", "split_with_sizes", "tensor_split", "slice", "narrow",
                                 "expand"}


def _norm_dim(d: int, rank: int) -> int:
    return d % rank if rank else 0


def reshape_map(src: Sequence[int], dst: Sequence[int], d: int, tp: int, first_only: bool = False) -> int | None:
    """The output dim a shard of input dim `d` lands on through a reshape `src` -> `dst`, or None.

    Merging `d` with the dims after it keeps its shard contiguous. Splitting `d` puts the shard on the
    outermost factor divisible by `tp`; when that is not the first factor, each device's slice is whole
    only if the producer's features are permuted (Megatron permutes the fused QKV weight this way so a
    column shard holds whole heads), which codegen must do for that strategy. With `first_only` (what
    DTensor's view propagation does) only the first factor may carry the shard.
    """
    prefix = math.prod(src[:d])
    size = src[d]
    starts = [e for e in range(len(dst)) if math.prod(dst[:e]) == prefix and dst[e] != 1]
    if not starts:
        return None
    e = starts[0]
    if dst[e] == size:
        return e
    if dst[e] > size:
        merged = math.prod(dst[: e + 1])
        return e if any(math.prod(src[:k]) == merged for k in range(d + 1, len(src) + 1)) else None
    for e2 in range(e + 1, len(dst) + 1):
        if math.prod(dst[e:e2]) == size:
            found = [f for f in range(e, e2) if dst[f] % tp == 0 and dst[f] >= tp][:1]
            return found[0] if found and (not first_only or found[0] == e) else None
    return None


def view_map(spec: OpSpec, layout: int, tp: int, runtime: bool = False) -> int | None:
    """Output layout of view-like `spec` when its first input has `layout`; None where it cannot follow
    (with `runtime`, also where DTensor's propagation cannot: a split shard on a later factor)."""
    if layout in (R, P):
        return layout
    src, dst = spec.ins[0].shape, spec.outs[0].shape
    op, d = spec.op, layout
    if op in IDENTITIES:
        return d if len(src) == len(dst) else None
    if op in RESHAPES:
        return reshape_map(src, dst, d, tp, runtime)
    if op == "expand":
        e = d + len(dst) - len(src)
        return e if dst[e] == src[d] else None
    if op == "t":
        return 1 - d if len(src) == 2 else d
    if op == "permute":
        perm = spec.arg(1, "dims")
        return None if perm is MISSING else [_norm_dim(x, len(src)) for x in perm].index(d)
    if op in ("transpose", "swapaxes", "swapdims"):
        a, b = spec.arg(1, "dim0"), spec.arg(2, "dim1")
        if a is MISSING:
            return None
        a, b = _norm_dim(a, len(src)), _norm_dim(b, len(src))
        return b if d == a else a if d == b else d
    # ops that select along one dim: a shard survives only on the other dims
    dim = spec.arg(1 if op in ("unbind", "select", "slice", "narrow") else 2, "dim", 0)
    if dim is MISSING:
        return None
    dim = _norm_dim(dim, len(src))
    if d != dim:
        return d - (d > dim) if op in ("unbind", "select") else d
    return d if op in ("slice", "narrow") and dst[dim] == src[dim] else None


# ---- the loop-nest engine -------------------------------------------------------------------------


def _divides(size: int, tp: int) -> bool:
    return size >= tp and size % tp == 0


def _aligned(labels: Sequence[str], rank: int) -> tuple[str, ...]:
    """Labels of a broadcast operand of `rank` dims, right-aligned against `labels`."""
    return tuple(labels[len(labels) - rank:]) if rank else ()


def _loop(spec: OpSpec, tp: int, operands: Sequence[Sequence[str] | None], out: Sequence[str],
          shard: dict[str, str], reduce: dict[str, str], reduce_split: tuple[int, int] | None = None,
          ) -> list[Strategy]:
    """Strategies sharding one label of a loop nest; `operands[i]` labels input i's dims (None: replicate).

    `shard` names the output labels that may be split (splitting one replicates the operands without it,
    whose gradients become partial); `reduce` names the contracted labels (splitting one leaves a partial
    output, and operands without it keep whole gradients). A size-1 operand dim is a broadcast.
    """
    n = len(spec.ins)
    found = [replicated(n)]
    for label, name in [*shard.items(), *reduce.items()]:
        is_reduce = label in reduce
        ins, grads, ok = [], [], True
        for meta, labels in zip(spec.ins, operands, strict=True):
            if labels is not None and label in labels and meta.shape[labels.index(label)] != 1:
                j = labels.index(label)
                ok &= _divides(meta.shape[j], tp)
                ins.append(j)
                grads.append(j)
            else:
                ins.append(R)
                grads.append(R if is_reduce else P)
        if is_reduce:
            out_layout = P
        elif label in out:
            out_layout = out.index(label)
            ok &= _divides(spec.outs[0].shape[out_layout], tp)
        else:
            out_layout = R  # reduced away (a mean loss): its gradient is replicated anyway
        if ok and any(x != R for x in ins):
            sf, sb = reduce_split if (is_reduce and reduce_split) else (tp, tp)
            found.append(Strategy(name, out_layout, tuple(ins), tuple(grads), sf, sb))
    return found


def replicated(n_inputs: int) -> Strategy:
    return Strategy("R", R, (R,) * n_inputs, (R,) * n_inputs)


def _batch_labels(rank: int) -> tuple[str, ...]:
    return tuple(f"b{i}" for i in range(rank))


def _matmul(spec: OpSpec, tp: int) -> list[Strategy] | None:
    op, ins = spec.op, spec.ins
    bias = None
    if op in ("addmm", "baddbmm") and len(ins) == 3:
        bias, a, b = ins
    elif len(ins) >= 2:
        a, b = ins[0], ins[1]
    else:
        return None
    ra, rb = len(a.shape), len(b.shape)
    weight_is_param = (1 if bias is None else 2) in spec.params
    col = "col" if weight_is_param or op == "linear" else None
    row = "row" if weight_is_param or op == "linear" else "P"
    if op == "linear" and ra >= 1 and rb == 2:
        batch = _batch_labels(ra - 1)
        operands = [(*batch, "k"), ("n", "k")] + [_aligned(("n",), len(m.shape)) for m in ins[2:]]
        out = (*batch, "n")
    elif op in ("mm", "addmm", "matmul") and ra >= 2 and rb == 2:
        batch = _batch_labels(ra - 1)
        operands = [(*batch, "k"), ("k", "n")]
        out = (*batch, "n")
    elif op in ("bmm", "baddbmm", "matmul") and ra == rb >= 3 and a.shape[:-2] == b.shape[:-2]:
        batch = _batch_labels(ra - 2)
        operands = [(*batch, "m", "k"), (*batch, "k", "n")]
        out = (*batch, "m", "n")
        batch = (*batch, "m")
        col = None
    else:
        return None
    if bias is not None:
        operands = [_aligned(out, len(bias.shape)), *operands]
    shard = {x: f"S({i})" for i, x in enumerate(batch)}
    shard["n"] = col or f"S({len(out) - 1})"
    return _loop(spec, tp, operands, out, shard, {"k": row})


def _attention(spec: OpSpec, tp: int) -> list[Strategy] | None:
    q = spec.ins[0]
    if len(spec.ins) < 3 or len(q.shape) < 3:
        return None
    batch = _batch_labels(len(q.shape) - 2)
    operands: list[Sequence[str] | None] = [(*batch, "l", "e"), (*batch, "s", "e"), (*batch, "s", "f")]
    operands += [_aligned((*batch, "l", "s"), len(m.shape)) for m in spec.ins[3:]]
    shard = {x: f"S({i})" for i, x in enumerate(batch)}
    shard["l"] = f"S({len(batch)})"
    return _loop(spec, tp, operands, (*batch, "l", "f"), shard, {})


def _embedding(spec: OpSpec, tp: int) -> list[Strategy] | None:
    w, ids = spec.ins[0], spec.ins[1]
    if len(w.shape) != 2:
        return None
    batch = _batch_labels(len(ids.shape))
    shard = {x: f"S({i})" for i, x in enumerate(batch)}
    shard["h"] = "col"
    # Vocab-parallel: each device looks up its rows and writes a full-sized, mostly-zero output.
    return _loop(spec, tp, [("v", "h"), batch], (*batch, "h"), shard, {"v": "vocab"}, reduce_split=(1, tp))


def _cross_entropy(spec: OpSpec, tp: int) -> list[Strategy] | None:
    logits = spec.ins[0]
    if len(logits.shape) < 2 or len(spec.ins) < 2:
        return None
    rest = _batch_labels(len(logits.shape) - 2)
    reduction = spec.arg(3, "reduction", 1)  # 0 = none, 1 = mean, 2 = sum
    out = ("n", *rest) if reduction == 0 else ()
    operands: list[Sequence[str] | None] = [("n", "c", *rest), ("n", *rest)] + [("c",)] * (len(spec.ins) - 2)
    shard = {"n": "S(0)", **{x: f"S({i + 2})" for i, x in enumerate(rest)}}
    found = _loop(spec, tp, operands, out, shard, {})
    if spec.op == "cross_entropy_loss" and _divides(logits.shape[1], tp):
        # Megatron's vocab-parallel loss: all-reduce the row max, the sum of exps and the target logit.
        rows = logits.numel // logits.shape[1]
        ins = (1, R) + (0,) * (len(spec.ins) - 2)
        found.append(Strategy("vocab", R, ins, ins, tp, tp, (("all_reduce", rows * 4.0),) * 3))
    return found


def _norm(spec: OpSpec, tp: int) -> list[Strategy] | None:
    rank = len(spec.ins[0].shape)
    if spec.op in ("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"):
        shape = spec.arg(1, "normalized_shape")
        if shape is MISSING:  # the weight has the normalized shape
            shape = spec.ins[1].shape if len(spec.ins) > 1 else (0,)
        k = len(shape)
    elif spec.op in ("group_norm", "native_group_norm"):
        k = rank - 1
    else:
        return None  # batch norm couples the whole batch
    batch = _batch_labels(rank - k)
    x = (*batch, *(f"n{i}" for i in range(k)))
    shard = {b: f"S({i})" for i, b in enumerate(batch)}
    return _loop(spec, tp, [x] + [None] * (len(spec.ins) - 1), x, shard, {})


def _elementwise(spec: OpSpec, tp: int) -> list[Strategy] | None:
    out = spec.outs[0].shape
    labels = _batch_labels(len(out))
    for m in spec.ins:
        r = len(m.shape)
        if r > len(out) or any(s not in (1, o) for s, o in zip(m.shape, out[len(out) - r:], strict=True)):
            return None
    operands = [_aligned(labels, len(m.shape)) for m in spec.ins]
    return _loop(spec, tp, operands, labels, {x: f"S({i})" for i, x in enumerate(labels)}, {})


def _partial(spec: OpSpec) -> list[Strategy]:
    """DTensor's partial-sum rules of linear elementwise ops: a sum or difference of partial sums (replicated
    inputs are turned into partial ones locally), a partial sum times or divided by a replicated value, and
    dropout with p = 0 (the identity)."""
    n = len(spec.ins)
    if spec.op in ("add", "sub"):
        return [Strategy("P", P, (P,) * n, (R,) * n)]
    if spec.op in ("mul", "div") and n == 1 or spec.op == "dropout" and n == 1 and spec.arg(1, "p", 0.5) == 0:
        return [Strategy("P", P, (P,), (R,))]
    if spec.op in ("mul", "div") and n == 2:
        return [Strategy("P", P, (P, R), (R, P))] + ([Strategy("P1", P, (R, P), (P, R))] if spec.op == "mul" else [])
    return []


def _softmax(spec: OpSpec, tp: int) -> list[Strategy] | None:
    dim = spec.arg(1, "dim", -1)
    if dim is MISSING:
        dim = -1
    rank = len(spec.outs[0].shape)
    labels = _batch_labels(rank)
    keep = {x: f"S({i})" for i, x in enumerate(labels) if i != _norm_dim(dim, rank)}
    return _loop(spec, tp, [labels], labels, keep, {})


def _sum(spec: OpSpec, tp: int) -> list[Strategy] | None:
    dims, keepdim = spec.arg(1, "dim"), spec.arg(2, "keepdim", False)
    if dims is MISSING:
        return None
    rank = len(spec.ins[0].shape)
    dims = set(range(rank)) if not dims else {_norm_dim(x, rank) for x in dims}
    labels = _batch_labels(rank)
    out = tuple(x for i, x in enumerate(labels) if keepdim or i not in dims)
    kept = {x: f"S({out.index(x)})" for i, x in enumerate(labels) if i not in dims}
    return _loop(spec, tp, [labels], out, kept, {labels[i]: "P" for i in sorted(dims)})


def _cat(spec: OpSpec, tp: int) -> list[Strategy] | None:
    dim = spec.arg(1, "dim", 0)
    if dim is MISSING:
        return None
    labels = _batch_labels(len(spec.outs[0].shape))
    if any(len(m.shape) != len(labels) for m in spec.ins):
        return None
    dim = _norm_dim(dim, len(labels))
    keep = {x: f"S({i})" for i, x in enumerate(labels) if i != dim}
    return _loop(spec, tp, [labels] * len(spec.ins), labels, keep, {})


def _view(spec: OpSpec, tp: int, runtime: bool = False) -> list[Strategy]:
    rank = len(spec.ins[0].shape)
    n = len(spec.ins)
    found, names = [], set()
    for layout in (R, P, *range(rank)):
        if layout >= 0 and not _divides(spec.ins[0].shape[layout], tp):
            continue
        out = view_map(spec, layout, tp, runtime)
        if out is None or layout_name(out) in names:
            continue
        names.add(layout_name(out))
        split = tp if layout >= 0 else 1
        ins = (layout,) + (R,) * (n - 1)
        # a view of a partial sum passes its (replicated) output gradient straight back
        grads = (R if layout == P else layout,) + (R,) * (n - 1)
        found.append(Strategy(layout_name(out), out, ins, grads, split, split))
    return found


def _source(spec: OpSpec, tp: int) -> list[Strategy]:
    shape = spec.outs[0].shape
    return [replicated(0)] + [Strategy(f"S({d})", d, (), (), tp, tp) for d, s in enumerate(shape)
                              if _divides(s, tp)]


_HANDLERS = {
    **dict.fromkeys(("linear", "mm", "addmm", "bmm", "baddbmm", "matmul"), _matmul),
    "scaled_dot_product_attention": _attention,
    "embedding": _embedding,
    **dict.fromkeys(("cross_entropy_loss", "nll_loss", "nll_loss_nd"), _cross_entropy),
    **dict.fromkeys(("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm",
                     "native_group_norm", "batch_norm", "native_batch_norm"), _norm),
    **dict.fromkeys(("softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"), _softmax),
    **dict.fromkeys(("sum", "mean"), _sum),
    "cat": _cat,
}


def enumerate_strategies(spec: OpSpec, tp: int, runtime: bool = False) -> list[Strategy]:
    """Every strategy of `spec` on `tp` devices; the first is always replicated execution ("R"). With
    `runtime`, only those the DTensor runtime (runtime/tensor_parallel.py) executes as priced."""
    if not spec.outs:
        return [replicated(len(spec.ins))]
    if not spec.ins:
        return _source(spec, tp)
    if spec.op in VIEWS:
        return _view(spec, tp, runtime)
    handler = _HANDLERS.get(spec.op)
    if handler is None and classify(spec.target) == "elementwise":
        handler = _elementwise
    found = handler(spec, tp) if handler is not None else None
    if runtime and handler is _elementwise and found:
        found += _partial(spec)
    if runtime and handler is _matmul and found:
        # the runtime all-reduces a row-parallel linear's output right away (tensor_parallel.sharding_spec)
        found = [replace(s, out=R, comm_out=(("all_reduce", 0),)) if s.name == "row" else s for s in found]
    if runtime and found and handler is _attention:
        # the runtime shards attention over heads only (the dim before the sequence), never from a batch dim
        heads = f"S({len(spec.ins[0].shape) - 3})" if len(spec.ins[0].shape) >= 4 else "R"
        found = [s for s in found if s.name in ("R", heads)]
    return found or [replicated(len(spec.ins))]


def op_spec(node: OpNode, fx_node: torch.fx.Node | None, meta: Callable[[str], TensorMeta],
            params: Container[str]) -> tuple[OpSpec, list[str]]:
    """The OpSpec of `node` and the names of its positional tensor inputs (from fx when the graph has it)."""
    op = base_name(node.target)
    if fx_node is None:
        names = list(node.args)
        return OpSpec(op, node.target, tuple(node.outputs), tuple(meta(a) for a in names),
                      frozenset(i for i, a in enumerate(names) if a in params)), names
    if op == "getitem":
        parent, idx = fx_node.args[0], fx_node.args[1]
        outs = parent.meta.get("val")
        parent_meta = TensorMeta(tuple(outs[idx].shape), str(outs[idx].dtype).removeprefix("torch."))
        spec = OpSpec(op, node.target, tuple(node.outputs), (parent_meta,), args=(TensorArg(0), idx))
        return spec, [parent.name]
    names: list[str] = []

    def mark(a: object) -> object:
        if isinstance(a, torch.fx.Node):
            if isinstance(a.meta.get("val"), torch.Tensor):
                names.append(a.name)
                return TensorArg(len(names) - 1)
            return repr(a.meta.get("val"))
        return a

    args = torch.fx.node.map_aggregate(fx_node.args, mark)
    kwargs = torch.fx.node.map_aggregate(dict(fx_node.kwargs), mark)
    return OpSpec(op, node.target, tuple(node.outputs), tuple(meta(a) for a in names),
                  frozenset(i for i, a in enumerate(names) if a in params), tuple(args), dict(kwargs)), names


__all__ = ["MISSING", "OpSpec", "P", "R", "Strategy", "TensorArg", "enumerate_strategies", "layout_name",
           "op_spec", "reshape_map", "view_map"]
