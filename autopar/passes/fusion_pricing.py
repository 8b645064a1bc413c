"""Price fused regions as the one kernel each runs as (used by passes/annotate.py).

Where the kernels mode fuses on a device type (`fusing_types`), `codegen.fusion.find_regions` picks the
regions the runtime will fuse, and each region is priced as one kernel: its external inputs read once
and its outputs written once (`fusion.fused_bytes`), intermediates never materialised, one launch. The
matmul of a bias head stays its own kernel; its bias add (and the bias-gradient sum) move into the
region's kernels. The backward kernel reads the region's inputs (which `RegionFunction` saves) and the
gradients of its outputs, and writes the gradients of its inputs that need them. Where rows are longer than
`triton_gen.ROW_BLOCK` the kernels loop over column blocks and read their row-sized inputs once per pass
(`fusion.input_passes`), and are priced so.

Regions are found per layer (a fused region never spans layers here, as it cannot span pipeline
stages), once per block signature: identical blocks reuse the result by node position.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx

from ..cluster import Cluster
from ..cost_models.compute import pointwise_flops
from ..errors import PlanError
from ..ir.graph import Kernel, Layer, OpNode

KERNEL_MODES = ("auto", "triton", "torch")
# region kind -> the cost-model kind of its kernel
_KERNEL_KIND = {"norm": "norm", "residual_norm": "norm", "softmax": "softmax", "cross_entropy": "softmax"}


def check_mode(kernels: str) -> str:
    if kernels not in KERNEL_MODES:
        raise PlanError(f"unknown kernels mode {kernels!r}: use one of {', '.join(repr(m) for m in KERNEL_MODES)}.")
    return kernels


def fusing_types(cluster: Cluster | None, kernels: str) -> list[str]:
    """Device types whose programs run fused kernels: all with "triton", none with "torch", and with
    "auto" the CUDA ones (the runtime fuses only CUDA tensors; the cpu device type runs torch ops)."""
    if cluster is None or check_mode(kernels) == "torch":
        return []
    types = cluster.device_types()
    return types if kernels == "triton" else [t for t in types if cluster.spec(t).kind != "cpu"]


@dataclass(frozen=True)
class RegionSpec:
    """A fused region of a layer, by node position in `Layer.nodes` (valid for every identical block)."""

    kind: str
    members: tuple[int, ...]
    heads: tuple[int, ...]
    inputs: tuple[tuple, ...]  # ("L", pos) layer node, ("A", pos, i) i-th input of a member, ("M", pos) matmul
    targets: tuple[str, ...]  # member targets, to check a reuse
    before: int  # forward bytes as separate ops / as one kernel (fusion.fused_bytes, graph dtypes)
    after: int
    bwd_reads: tuple[int, ...] = ()  # per input, reads by the backward kernel (more than one where rows loop)
    grad_reads: int = 1  # reads of each output gradient by the backward kernel


def _layer_module(members: list[fx.Node]) -> fx.GraphModule:
    """The layer's nodes as a graph of their own: outside values become placeholders (with their
    metadata), values read outside the layer become outputs."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    mset = set(members)
    for n in members:
        for a in n.all_input_nodes:
            if a not in mset and a not in env:
                env[a] = g.placeholder(a.name)
                env[a].meta = dict(a.meta)
        env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[n] for n in members if any(u not in mset for u in n.users)))
    return fx.GraphModule(torch.nn.Module(), g)  # export graphs read parameters as placeholders


def layer_regions(gm: Any, layer: Layer) -> list[RegionSpec]:
    from ..codegen import triton_gen
    from ..codegen.fusion import find_regions, fused_bytes, input_passes

    fx_nodes = {n.name: n for n in gm.graph.nodes}
    members = [fx_nodes[x] for x in layer.nodes if x in fx_nodes]
    sub = _layer_module(members)
    pos = {x: i for i, x in enumerate(layer.nodes)}
    out = []
    for r in find_regions(sub):
        if not r.fused:
            continue
        mem = {n.name for n in r.nodes}
        inputs: list[tuple] = []
        for k in r.inputs:
            if isinstance(k, tuple):
                inputs.append(("M", pos[k[1].name]))
            elif k.name in pos:
                inputs.append(("L", pos[k.name]))
            else:
                m, i = next((m, i) for m in r.nodes for i, a in enumerate(m.all_input_nodes) if a is k)
                inputs.append(("A", pos[m.name], i))
        before, after = fused_bytes(r)
        reads = triton_gen.input_reads(r.program, "bwd") if r.program is not None else {}
        grad_reads = max([n for k, n in reads.items() if k.startswith("go_")], default=1)
        out.append(RegionSpec(r.kind, tuple(sorted(pos[x] for x in mem)), tuple(pos[h.name] for h in r.heads),
                              tuple(inputs), tuple(str(n.target) for n in sorted(r.nodes, key=lambda n: pos[n.name])),
                              before, after, tuple(input_passes(r, "bwd")), grad_reads))
    return out


def _input_name(spec: tuple, layer: Layer, fx_nodes: dict[str, fx.Node]) -> str:
    if spec[0] in ("L", "M"):
        return layer.nodes[spec[1]]
    return fx_nodes[layer.nodes[spec[1]]].all_input_nodes[spec[2]].name


def _work(kernels: list[Kernel]) -> float:
    return sum(pointwise_flops(k.op, k.elems) for k in kernels if k.kind in ("elementwise", "softmax"))


def fuse_layer(specs: list[RegionSpec], layer: Layer, nodes: dict[str, OpNode], fx_nodes: dict[str, fx.Node],
               grad: dict[str, bool], roots: dict[str, str], scale: float, nbytes: Any) -> dict[str, Any]:
    """name -> (fwd kernels, bwd kernels, saved roots, saved internal bytes) for the nodes of the layer's
    fused regions, as the fused program runs them. `nbytes(name)` is a value's bytes (graph dtype)."""
    out: dict[str, Any] = {}
    for s in specs:
        names = [layer.nodes[p] for p in s.members]
        if tuple(str(fx_nodes[x].target) for x in names) != s.targets:
            continue  # not the same structure after all: leave this region unfused in the pricing
        heads = {layer.nodes[p] for p in s.heads}
        body = [x for x in names if x not in heads]
        inputs = [_input_name(i, layer, fx_nodes) for i in s.inputs]
        removed_f = [k for x in body for k in nodes[x].kernels_fwd]
        removed_b = [k for x in body for k in nodes[x].kernels_bwd]
        kf = Kernel(f"fused.{s.kind}", _KERNEL_KIND.get(s.kind, "elementwise"), 0.0, s.after * scale,
                    elems=int(_work(removed_f)))  # elems: elementwise work in add-equivalents
        trains = any(nodes[x].kernels_bwd for x in names)
        outs = [x for x in names if any(u.name not in names for u in fx_nodes[x].users)]
        reads = s.bwd_reads or (1,) * len(inputs)
        bwd_bytes = (sum(nbytes(x) * k for x, k in zip(inputs, reads, strict=True))
                     + sum(nbytes(x) * s.grad_reads for x in outs)
                     + sum(nbytes(x) for x in inputs if grad.get(x, False)))
        kb = Kernel(f"fused.{s.kind}.backward", kf.kind, 0.0, bwd_bytes * scale, elems=int(_work(removed_b)))
        for x in heads:  # the bias-gradient sum moves into the region's backward kernel
            n = nodes[x]
            out[x] = (list(n.kernels_fwd), [k for k in n.kernels_bwd if k.kind != "reduction"], list(n.saved),
                      n.saved_internal_bytes)
        saved = sorted({roots.get(x, x) for x in inputs}) if trains else []
        for i, x in enumerate(body):
            out[x] = ([kf], [kb] if trains else [], saved, 0) if i == 0 else ([], [], [], 0)
    return out


def fused_overrides(gm: Any, layers: list[Layer], nodes: dict[str, OpNode],
                    grad: dict[str, bool], roots: dict[str, str], scale: float) -> dict[str, Any]:
    """fuse_layer over every layer, finding regions once per block signature."""
    if gm is None:
        return {}
    fx_nodes = {n.name: n for n in gm.graph.nodes}

    def nbytes(name: str) -> int:
        n = fx_nodes.get(name)
        v = n.meta.get("val") if n is not None else None
        return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0

    cache: dict[str, list[RegionSpec]] = {}
    out: dict[str, Any] = {}
    for layer in layers:
        key = layer.signature if layer.kind == "block" and layer.signature else None
        specs = cache.get(key) if key is not None else None
        if specs is None:
            specs = layer_regions(gm, layer)
            if key is not None:
                cache[key] = specs
        out.update(fuse_layer(specs, layer, nodes, fx_nodes, grad, roots, scale, nbytes))
    return out


def apply_overrides(node: OpNode, over: tuple, rewrite: bool) -> OpNode:
    """The node with its fused kernels (and, when every device type fuses, fused saved tensors)."""
    kf, kb, saved, internal = over
    if not rewrite:
        return node
    return replace(node, kernels_fwd=kf, kernels_bwd=kb, bytes_fwd=sum(k.nbytes for k in kf),
                   bytes_bwd=sum(k.nbytes for k in kb), saved=saved, saved_internal_bytes=internal)


__all__ = ["fusing_types", "fused_overrides", "apply_overrides", "check_mode", "KERNEL_MODES", "RegionSpec"]
