"""Annotate: FLOPs, memory traffic, saved activations and per-device-type times for every node.

Each node is executed once in isolation on meta tensors (shapes only, nothing allocated) under autograd:
a dispatch mode records the aten kernels eager PyTorch launches for it (forward, then backward), and
saved-tensor hooks record what autograd keeps for backward. Results are cached by the node's signature
(op, argument shapes, which arguments need grad), so the 96 identical layers of GPT-3 cost one run.
FLOPs use torch.utils.flop_counter's formulas, so totals agree with FlopCounterMode.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from ..cluster import Cluster
from ..cost_models.compute import ComputeModel, Profile, classify, kernel_flops
from ..cost_models.conv_workspace import (
    CPU_KIND,
    ConvGeometry,
    contiguous_channels_last,
    local_isa,
    strides_like_channels_last,
    weight_grad_transient,
)
from ..ir.graph import Kernel, Layer, OpNode, TrainingGraph
from ..ir.precision import ELEMENT_BYTES, check_name
from .fusion_pricing import apply_overrides, check_mode, fused_overrides, fusing_types
from .randomness import keyed_call

aten = torch.ops.aten
# flop_counter has no formula for the CPU flash-attention kernels; use its generic sdpa formulas (full score
# matrix even when causal, as FlopCounterMode counts: the fused kernels' skipped upper half is not priced).
_EXTRA_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *a, out_val=None, **kw: sdpa_flop_count(
        q.shape, k.shape, v.shape
    ),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: lambda go, q, k, v, *a, out_val=None, **kw: (
        sdpa_backward_flop_count(go.shape, q.shape, k.shape, v.shape)
    ),
}


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    packet = func._overloadpacket
    if packet in flop_registry:
        return float(flop_registry[packet](*args, **kwargs, out_val=out))
    if packet in _EXTRA_FLOPS:
        return float(_EXTRA_FLOPS[packet](*args, out_val=out, **kwargs))
    return 0.0


def _sdpa_as_flash(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Price sdpa as the fused flash kernel real devices run, not the math fallback meta tensors pick."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)
    return aten._scaled_dot_product_flash_attention_for_cpu.default(
        q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )[0]


def _grad_mask(args: list, kwargs: dict) -> bool:
    """Whether sdpa's attention mask needs a gradient (a learned bias, T5's): no fused kernel of torch's CPU
    backend takes one, so torch runs (and prices here) the math formulation, its softmax saved for backward."""
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    return isinstance(mask, torch.Tensor) and mask.requires_grad


class _KernelRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.kernels: list[Kernel] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        kind = classify(name)
        flops = _flops(func, args, kwargs, out)
        nbytes = 0.0
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if func is aten.embedding.default:
            # a gather touches the rows it reads, not the whole table (as calibration measures it)
            nbytes = float(2 * sum(t.numel() * t.element_size() for t in outs) + args[1].numel() * 8)
        elif kind != "view":
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            nbytes = float(sum(t.numel() * t.element_size() for t in tensors))
        self.kernels.append(Kernel(name, kind, flops, nbytes, elems=outs[0].numel() if outs else 0))
        return out


@dataclass(frozen=True)
class _NodeCost:
    kernels_fwd: tuple[Kernel, ...]
    kernels_bwd: tuple[Kernel, ...]
    saved_args: tuple[int, ...]  # indices (into tensor args) of inputs autograd saves
    saved_outputs: tuple[int, ...]
    saved_internal_bytes: int


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _spec(x: Any, grad: dict[str, bool]) -> Any:
    if isinstance(x, torch.fx.Node):
        val = x.meta.get("val")
        if isinstance(val, torch.Tensor):
            return ("T", tuple(val.shape), tuple(val.stride()), val.dtype, grad.get(x.name, False))
        return ("V", repr(val))
    if isinstance(x, (list, tuple)):
        return tuple(_spec(v, grad) for v in x)
    if isinstance(x, torch.device):  # measured on meta, whatever device the op names
        return ("D",)
    return x


def _materialize(spec: Any) -> Any:
    if isinstance(spec, tuple) and spec and spec[0] == "T":
        _, shape, stride, dtype, rg = spec
        t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        return t.requires_grad_(rg) if rg and dtype.is_floating_point else t
    if isinstance(spec, tuple) and spec and spec[0] == "V":
        raise _Unmeasurable
    if spec == ("D",):
        return torch.device("meta")
    if isinstance(spec, tuple):
        return tuple(_materialize(s) for s in spec)
    return spec


class _Unmeasurable(Exception):
    pass


def _hashable(x: Any) -> Any:
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)


@functools.lru_cache(maxsize=4096)
def _measure(target: Any, arg_specs: tuple, kwarg_specs: tuple) -> _NodeCost:
    args = [_materialize(s) for s in arg_specs]
    kwargs = {k: _materialize(v) for k, v in kwarg_specs}
    schema = getattr(target, "_schema", None)
    if schema is not None and schema.is_mutable:
        # an in-place op of the graph writes into an activation; a meta leaf that requires grad refuses that
        # (hf_falcon's add_), so what it writes is a non-leaf copy here
        written = {i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write}
        args = [a.clone() if i in written and isinstance(a, torch.Tensor) and a.requires_grad else a
                for i, a in enumerate(args)]
    # the node's tensor arguments whose storage identifies a saved tensor
    tensor_args = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    packed: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t)
        return t

    keyed = keyed_call(target, tuple(args), kwargs, 0)  # a random op: priced as the keyed draw that runs
    if keyed is not None:
        target, args, kwargs = keyed[0], list(keyed[1]), keyed[2]
    elif target is aten.scaled_dot_product_attention.default and not _grad_mask(args, kwargs):
        target = _sdpa_as_flash
    rec = _KernelRecorder()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), rec:
        out = target(*args, **kwargs)
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    arg_ids = {_storage(t): i for i, t in reversed(list(enumerate(tensor_args)))}
    out_ids = {_storage(t): i for i, t in reversed(list(enumerate(outs)))}
    saved_args, saved_outs, internal, seen = set(), set(), 0, set()
    for t in packed:
        key = _storage(t)
        if key in seen:
            continue
        seen.add(key)
        if key in arg_ids:
            saved_args.add(arg_ids[key])
        elif key in out_ids:
            saved_outs.add(out_ids[key])
        else:
            internal += t.untyped_storage().nbytes()
    bwd: list[Kernel] = []
    diff_out = [o for o in outs if o.requires_grad]
    diff_in = [t for t in tensor_args if t.requires_grad]
    if diff_out and diff_in:
        rec_b = _KernelRecorder()
        with rec_b:
            torch.autograd.grad(
                diff_out, diff_in, grad_outputs=[torch.empty_like(o) for o in diff_out], allow_unused=True
            )
        bwd = rec_b.kernels
    return _NodeCost(
        tuple(rec.kernels), tuple(bwd), tuple(sorted(saved_args)), tuple(sorted(saved_outs)), internal
    )


def _kernel_time(model: ComputeModel, k: Kernel) -> float:
    return model.op_time(k.kind, kernel_flops(k), k.nbytes)


def _fallback_cost(node: OpNode, arg_bytes: float) -> _NodeCost:
    """The price of an op `_measure` cannot measure: its bytes, no FLOPs, nothing saved for backward (what the
    warning says; saving its inputs instead over-priced T5's attention with a learned bias by 16 % on the
    allocator, tests/test_hf_architectures.py)."""
    kind = classify(node.target)
    nbytes = 0.0 if kind == "view" else arg_bytes + node.out_bytes
    k = Kernel(node.target, kind, 0.0, nbytes)
    return _NodeCost((k,), (k, k) if node.requires_grad else (), (), (), 0)


def _warn_unpriced(unpriced: dict[str, list[tuple[str, float]]]) -> None:
    if not unpriced:
        return
    import warnings

    from ..errors import UnpricedOpWarning

    ops = "; ".join(f"{target} ({len(v)} node(s), e.g. {v[0][0]}: 0 FLOPs, {v[0][1] / 2**20:.3g} MiB moved)"
                    for target, v in sorted(unpriced.items()))
    warnings.warn(UnpricedOpWarning(
        f"the cost model could not measure {sum(map(len, unpriced.values()))} op node(s) and priced them by "
        f"their bytes (no FLOPs, nothing saved for backward): {ops}. The plan's time for them may be low, and "
        f"its memory too if they save tensors for backward; report the op to autopar to have it priced."),
        stacklevel=3)


def annotate(graph: TrainingGraph, cluster: Cluster | None = None, precision: str = "fp32",
             kernels: str = "auto", profiles: dict[str, Profile] | None = None) -> TrainingGraph:
    """Return a copy of `graph` with costs on every node and layer, priced for each device type of `cluster`.

    `precision` is the training compute dtype: "fp32" (also tf32) or mixed "bf16"/"fp16", which halves the
    bytes of floating-point activations and uses the tensor-core peak. `kernels` is the mode programs will
    run with (`autopar.compile(kernels=...)`): on the device types where it fuses ("auto": CUDA types,
    "triton": all, "torch": none) each fusible region is priced as the one kernel it runs as
    (fusion_pricing.py). When every device type fuses, the nodes' kernels and saved tensors are those of
    the fused program; otherwise only the fusing types' times are. `profiles`: compute profiles by device type
    name, priced instead of the saved ones (`autopar calibrate`'s) for those types.
    """
    check_mode(kernels)
    check_name(precision)
    ep = graph.gm
    fx_nodes = {n.name: n for n in ep.graph.nodes} if ep is not None else {}
    grad = {name: info.counts or bool(info.tied_to) for name, info in graph.params.items()}
    grad.update({n.name: n.requires_grad for n in graph.nodes.values()})
    scale = ELEMENT_BYTES[precision] / 4
    roots: dict[str, str] = {}  # value name -> storage root name
    root_bytes: dict[str, int] = {}
    for name in graph.params:
        roots[name] = name
    for name in graph.inputs:
        roots[name] = name
        root_bytes[name] = graph.input_meta[name].nbytes
    new_nodes: dict[str, OpNode] = {}
    isa = local_isa()  # the "cpu" device kind is this host (cost_models/host.py)
    unpriced: dict[str, list[tuple[str, float]]] = {}  # op target -> (node, bytes priced) of the unmeasured
    for name, node in graph.nodes.items():
        fxn = fx_nodes.get(name)
        tensor_arg_names = (
            [
                a.name
                for a in tree_flatten((fxn.args, fxn.kwargs))[0]
                if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
            ]
            if fxn is not None
            else []
        )
        if fxn is not None and fxn.target is operator.getitem:
            parent, idx = fxn.args[0].name, fxn.args[1]
            # items of a view op's list (unbind, split) alias the parent's storage root
            roots[name] = (
                roots[parent]
                if graph.nodes[parent].is_view
                else roots.get(f"{parent}#{idx}", f"{parent}#{idx}")
            )
            new_nodes[name] = node
            continue
        if node.is_view and tensor_arg_names:
            roots[name] = roots.get(tensor_arg_names[0], tensor_arg_names[0])
        else:
            roots[name] = name
            root_bytes[name] = node.out_bytes
            for i, t in enumerate(node.outputs):
                if len(node.outputs) > 1:
                    roots[f"{name}#{i}"] = f"{name}#{i}"
                    root_bytes[f"{name}#{i}"] = t.nbytes
        try:
            if fxn is None:
                raise _Unmeasurable
            arg_specs = tuple(_hashable(_spec(a, grad)) for a in fxn.args)
            kwarg_specs = tuple(sorted((k, _hashable(_spec(v, grad))) for k, v in fxn.kwargs.items()))
            cost = _measure(fxn.target, arg_specs, kwarg_specs)
        except Exception:  # an op with no meta kernel: price it by its bytes, say so, keep going
            arg_bytes = sum(new_nodes[a].out_bytes for a in node.args if a in new_nodes)
            cost = _fallback_cost(node, arg_bytes)
            unpriced.setdefault(str(node.target), []).append((name, cost.kernels_fwd[0].nbytes * scale))
        saved = [
            roots.get(tensor_arg_names[i], tensor_arg_names[i])
            for i in cost.saved_args
            if i < len(tensor_arg_names)
        ]
        saved += [(f"{name}#{i}" if len(node.outputs) > 1 else roots[name]) for i in cost.saved_outputs]
        kf = [replace(k, nbytes=k.nbytes * scale) for k in cost.kernels_fwd]
        kb = [replace(k, nbytes=k.nbytes * scale) for k in cost.kernels_bwd]
        new_nodes[name] = replace(
            node,
            kernels_fwd=kf,
            kernels_bwd=kb,
            flops_fwd=sum(k.flops for k in kf),
            flops_bwd=sum(k.flops for k in kb),
            bytes_fwd=sum(k.nbytes for k in kf),
            bytes_bwd=sum(k.nbytes for k in kb),
            saved=sorted(set(saved)),
            saved_internal_bytes=int(cost.saved_internal_bytes * scale),
            bwd_workspace=_bwd_workspace(fxn, grad, isa),
        )
    _warn_unpriced(unpriced)
    device_types = cluster.device_types() if cluster is not None else []
    profiles = profiles or {}
    models = {t: ComputeModel(cluster.spec(t), profiles.get(t), dtype=precision) for t in device_types}
    fusing = fusing_types(cluster, kernels)
    over = fused_overrides(ep, graph.layers, new_nodes, grad, roots, scale) if fusing else {}
    rewrite = bool(fusing) and set(fusing) == set(device_types)
    if rewrite:
        new_nodes = {k: apply_overrides(n, over[k], True) if k in over else n for k, n in new_nodes.items()}
    for name, node in new_nodes.items():
        fused = {t: name in over and not rewrite and t in fusing for t in models}
        node.time_fwd = {
            t: sum(_kernel_time(m, k) for k in (over[name][0] if fused[t] else node.kernels_fwd))
            for t, m in models.items()
        }
        node.time_bwd = {
            t: sum(_kernel_time(m, k) for k in (over[name][1] if fused[t] else node.kernels_bwd))
            for t, m in models.items()
        }
    layers = _layer_totals(graph, new_nodes, roots, root_bytes, scale)
    return replace(graph, nodes=new_nodes, layers=layers, device_types=device_types, dtype=precision,
                   kernels=kernels, fused_types=fusing)


_CONV_TARGETS = (aten.conv2d.default, aten.conv2d.padding, aten.convolution.default)


def _pair(v: Any) -> tuple[int, int]:
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return (int(v[0]), int(v[-1]))


def conv_geometry(fxn: torch.fx.Node, grad: dict[str, bool]) -> ConvGeometry | None:
    """What a convolution node's backward computes its weight gradient over, from the captured tensors'
    shapes and strides (cost_models/conv_workspace.py); None when that does not apply: not a 2-D fp32
    convolution, transposed, or no weight gradient."""
    if fxn.target not in _CONV_TARGETS:
        return None
    schema = fxn.target._schema
    vals = {a.name: v for a, v in zip(schema.arguments, fxn.args, strict=False)}
    vals.update(fxn.kwargs)
    for a in schema.arguments:
        if a.name not in vals and a.has_default_value():
            vals[a.name] = a.default_value
    x_node, w_node, b_node = vals.get("input"), vals.get("weight"), vals.get("bias")
    if not isinstance(x_node, torch.fx.Node) or not isinstance(w_node, torch.fx.Node) or vals.get("transposed"):
        return None
    x, w = x_node.meta.get("val"), w_node.meta.get("val")
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)) or x.dim() != 4 or w.dim() != 4:
        return None
    if x.dtype != torch.float32 or w.dtype != torch.float32 or not grad.get(w_node.name, False):
        return None
    xs, ws = tuple(int(n) for n in x.shape), tuple(int(n) for n in w.shape)
    kernel, dilation = (ws[2], ws[3]), _pair(vals.get("dilation", 1))
    padding = vals.get("padding", 0)
    if isinstance(padding, str):  # "valid": none; "same": torch pads d (k - 1) / 2 a side
        padding = [0, 0] if padding == "valid" else [d * (k - 1) // 2 for d, k in zip(dilation, kernel, strict=True)]
    shape_x, stride_x = xs, tuple(int(n) for n in x.stride())
    shape_w, stride_w = ws, tuple(int(n) for n in w.stride())
    return ConvGeometry(
        in_channels=xs[1], out_channels=ws[0], groups=int(vals.get("groups", 1)), kernel=kernel,
        input_hw=(xs[2], xs[3]), stride=_pair(vals.get("stride", 1)), padding=_pair(padding), dilation=dilation,
        bias=isinstance(b_node, torch.fx.Node) and grad.get(b_node.name, False),
        channels_last=strides_like_channels_last(shape_x, stride_x) or strides_like_channels_last(shape_w, stride_w),
        weight_channels_last=contiguous_channels_last(shape_w, stride_w))


def _bwd_workspace(fxn: torch.fx.Node | None, grad: dict[str, bool], isa: str | None) -> dict[str, int]:
    """`OpNode.bwd_workspace` of a node: on the "cpu" kind, a convolution's weight-gradient transient."""
    geo = conv_geometry(fxn, grad) if fxn is not None else None
    nbytes = weight_grad_transient(geo, isa) if geo is not None else 0
    return {CPU_KIND: nbytes} if nbytes else {}


def _layer_totals(
    graph: TrainingGraph,
    nodes: dict[str, OpNode],
    roots: dict[str, str],
    root_bytes: dict[str, int],
    scale: float,
) -> list[Layer]:
    root_layer = {r: nodes[r].layer for r in root_bytes if r in nodes}
    for r in root_bytes:
        if "#" in r:
            root_layer[r] = nodes[r.split("#")[0]].layer
    for name in graph.inputs:
        root_layer[name] = 0
    saved_roots: dict[int, set[str]] = {}
    first_saver: dict[str, int] = {}
    for n in nodes.values():
        for r in n.saved:
            if r in graph.params:
                continue
            saved_roots.setdefault(root_layer.get(r, n.layer), set()).add(r)
            first_saver[r] = min(first_saver.get(r, n.layer), n.layer)
    boundary: dict[int, set[str]] = {}
    for n in nodes.values():
        for a in n.args:
            r = roots.get(a, a)
            if r in graph.params or r in graph.inputs or r not in root_layer:  # every rank has the batch
                continue
            for k in range(root_layer[r], n.layer):
                boundary.setdefault(k, set()).add(r)
    layers = []
    for layer in graph.layers:
        members = [nodes[x] for x in layer.nodes]
        floating = lambda r: int(root_bytes.get(r, 0) * (scale if _is_float_root(r, nodes, graph) else 1))
        saved = sum(floating(r) for r in saved_roots.get(layer.index, ()))
        saved += sum(n.saved_internal_bytes for n in members)
        layers.append(
            replace(
                layer,
                flops_fwd=sum(n.flops_fwd for n in members),
                flops_bwd=sum(n.flops_bwd for n in members),
                param_bytes=sum(graph.params[p].meta.nbytes for p in layer.params if graph.params[p].counts),
                saved_bytes=saved,
                saved_later=tuple(sorted((first_saver[r], floating(r)) for r in saved_roots.get(layer.index, ())
                                         if first_saver[r] > layer.index)),
                boundary_bytes=sum(floating(r) for r in boundary.get(layer.index, ())),
                time_fwd={t: sum(n.time_fwd.get(t, 0.0) for n in members) for t in _types(members)},
                time_bwd={t: sum(n.time_bwd.get(t, 0.0) for n in members) for t in _types(members)},
            )
        )
    return layers


def _types(members: list[OpNode]) -> list[str]:
    return list(members[0].time_fwd) if members else []


def _is_float_root(root: str, nodes: dict[str, OpNode], graph: TrainingGraph) -> bool:
    base, _, idx = root.partition("#")
    if base in nodes:
        outs = nodes[base].outputs
        t = outs[int(idx)] if idx else (outs[0] if outs else None)
    else:
        t = graph.input_meta.get(base)
    return t is not None and t.dtype.startswith(("float", "bfloat"))


__all__ = ["annotate", "tree_map"]
