"""Find fusible regions in an aten-level fx graph, and say what each aten op means in kernel prims.

`RULES` maps an aten op to an expansion into triton_gen prims (the same table serves the export training IR
of stage programs and the post-autograd forward/backward graphs of torch.compile). `find_regions` grows
regions greedily in topological order: a node joins the region of one (or, merged, several) of its
producers when the region stays acyclic and still lowers to one kernel; the dry run that decides it is
the same lowering the kernel generator uses, so a region that is found can always be generated.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from . import triton_gen
from .fusion_rules import RULES, Resolver, Rule, bind, meta  # noqa: F401  (re-exported)
from .triton_gen import Builder, KernelProgram, Unfusible


# ---------------------------------------------------------------------------------------------- regions
@dataclass(eq=False)
class Region:
    """A connected set of graph nodes that lowers to one kernel (or a candidate that did not)."""

    name: str
    nodes: list[fx.Node]
    kind: str = "elementwise"
    inputs: list[Any] = field(default_factory=list)  # fx.Node, or ("mm", head) for a head's matmul
    outputs: list[fx.Node] = field(default_factory=list)
    domain: tuple[int, ...] = ()
    fused: bool = True
    reason: str = ""
    program: KernelProgram | None = None  # lowered at the graph's shapes (see `guessed`)
    guessed: bool = False  # some input had no shape metadata, so the program's input kinds are a guess
    sources: list[Any] = field(default_factory=list)  # the input key of each of the program's inputs

    @property
    def ops(self) -> list[str]:
        return [str(n.target) for n in self.nodes if n.target is not operator.getitem]

    @property
    def heads(self) -> list[fx.Node]:
        return [n for n in self.nodes if _label(n) == "head"]


def _label(n: fx.Node) -> str:
    r = RULES.get(str(n.target))
    return r.label if r else ""


_IGNORED_USERS = {"aten._assert_tensor_metadata.default"}  # asserts on values a region keeps internal


def _used_outside(n: fx.Node, members: set[fx.Node]) -> bool:
    return any(u not in members and str(u.target) not in _IGNORED_USERS for u in n.users)


def tensors(val: Any) -> list[torch.Tensor]:
    return [t for t in (val if isinstance(val, (tuple, list)) else [val]) if isinstance(t, torch.Tensor)]


def lower(nodes: list[fx.Node], values: Mapping[Any, torch.Tensor] | None = None
          ) -> tuple[Builder, KernelProgram, list[Any], list[fx.Node], bool]:
    """Lower region nodes (topological order) to a KernelProgram; `values` are runtime inputs by key, else the
    graph's metadata gives the shapes. Returns builder, program, input keys, output nodes, guessed."""
    members = set(nodes)
    outputs = [n for n in nodes if _used_outside(n, members)]
    shapes = [tuple(v.shape) for v in (values or {}).values()]
    for n in nodes:
        shapes += [tuple(t.shape) for t in tensors(n.meta.get("val"))]
        skip = _mm_operands(n) if _label(n) == "head" else []
        shapes += [tuple(m.shape) for a in n.all_input_nodes
                   if a not in members and a not in skip and (m := meta(a)) is not None]
    domain = max(shapes, key=lambda s: int(torch.Size(s).numel()), default=())
    b = Builder(domain)
    env: dict[fx.Node, Any] = {}
    guessed = False

    def v(x: Any, role: str | None = None, like: tuple[int, ...] | None = None) -> Any:
        nonlocal guessed
        if isinstance(x, fx.Node) and x in members:
            return env[x]
        if isinstance(x, (fx.Node, tuple)):
            t = values.get(x) if values is not None else meta(x[1] if isinstance(x, tuple) else x)
            if t is None:
                guessed = True
            shape = tuple(t.shape) if t is not None else like or domain
            return b.input(x, shape, t.dtype if t is not None else torch.float32, role)
        if isinstance(x, (bool, int, float)):
            return x
        raise Unfusible(f"argument {x!r} is neither a tensor nor a number")

    for n in nodes:
        if n.target is operator.getitem:
            got = env[n.args[0]][n.args[1]]
            if got is None:
                raise Unfusible("an output the op does not compute")
            env[n] = got
        else:
            env[n] = RULES[str(n.target)].expand(b, bind(n), v)
    outs = []
    for o in outputs:
        m = meta(o)
        if isinstance(env[o], list) or m is None:
            raise Unfusible(f"{o.name} is used as a whole tuple outside the region")
        outs.append((env[o], tuple(m.shape), m.dtype))
    program = b.finish(outs)
    # tensors an op takes but its expansion does not read (e.g. the bias of layer_norm_backward) are
    # inputs too, so the region's torch copy can still run
    extra = [a for n in nodes for a in n.all_input_nodes if a not in members
             and not (_label(n) == "head" and a in _mm_operands(n))]
    keys = list(dict.fromkeys(b.sources + extra))
    return b, program, keys, outputs, guessed


def _static_reason(n: fx.Node, r: Rule) -> str | None:
    ts = tensors(n.meta.get("val"))
    if not ts:
        return "no shape metadata"
    if any(not isinstance(s, int) for t in ts for s in t.shape):
        return "dynamic shapes"
    if any(t.dtype == torch.float64 or t.dtype.is_complex for t in ts):
        return f"{ts[0].dtype} (kernels compute in float32)"
    if any(t.device.type not in ("cpu", "cuda", "meta") for t in ts):
        return f"device {ts[0].device.type}"
    return r.check(n, bind(n)) if r.check else None


def _acyclic_reason(members: list[fx.Node], order: dict[fx.Node, int]) -> str | None:
    mset = set(members)
    if any(a in mset for h in members if _label(h) == "head" for a in _mm_operands(h)):
        return "the matmul of a bias head would read the region's own output"
    lo = min(order[m] for m in mset)
    stack = [a for m in mset for a in m.all_input_nodes if a not in mset and order[a] > lo]
    seen: set[fx.Node] = set()
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        for a in x.all_input_nodes:
            if a in mset:
                return "fusing would create a cycle through an op outside the region"
            if order[a] > lo:
                stack.append(a)
    return None


def _check(members: list[fx.Node], order: dict[fx.Node, int]) -> str | None:
    members = sorted(members, key=order.__getitem__)
    why = _acyclic_reason(members, order)
    if why:
        return why
    try:
        lower(members)
    except Unfusible as e:
        return str(e)
    return None


def _mm_operands(h: fx.Node) -> list[fx.Node]:
    ops = h.args[:2] if str(h.target) == "aten.linear.default" else h.args[1:3]
    return [a for a in ops if isinstance(a, fx.Node)]


def _with_items(n: fx.Node) -> list[fx.Node]:
    return [n] + [u for u in n.users if u.target is operator.getitem]


def _kind(nodes: list[fx.Node]) -> str:
    labels = {_label(n) for n in nodes}
    for lab, kind in (("cross_entropy", "cross_entropy"), ("softmax", "softmax")):
        if lab in labels:
            return kind
    targets = {str(n.target) for n in nodes}
    if "norm" in labels or "reduce" in labels and "aten.rsqrt.default" in targets:  # also hand-written norms
        return "residual_norm" if any(map(_residual_add, nodes)) else "norm"
    if "head" in labels and "activation" in labels:
        return "bias_act"
    return "dropout" if any(map(_dropping, nodes)) else "elementwise"


def _residual_add(n: fx.Node) -> bool:
    """An add of two activations: a residual connection, not a bias or an epsilon."""
    ms = [meta(a) for a in n.args[:2]]
    return str(n.target) == "aten.add.Tensor" and None not in ms and all(
        m.dim() and m.numel() > m.shape[-1] for m in ms)


def _dropping(n: fx.Node) -> bool:
    return _label(n) == "dropout" and bind(n)["p"] > 0 and bind(n)["train"] is not False


# ops whose backward needs their (floating) inputs, so autograd saves them: a softmax output they read is
# kept for the backward whether or not the softmax is fused
_SAVING_MATMULS = {"aten.matmul.default", "aten.bmm.default", "aten.mm.default", "aten.linear.default",
                   "aten.einsum.default", "aten.baddbmm.default"}


def _softmax_kept_anyway(nodes: list[fx.Node]) -> fx.Node | None:
    """A softmax of the region whose output a matmul outside it reads (attention's probabilities @ V). The
    matmul saves that output for its backward; torch's softmax saves only its output too, so eager keeps one
    copy. The fused region saves its inputs (kernels.RegionFunction) and recomputes the softmax from them:
    the pre-softmax scores (seq x seq per head) would be kept besides the probabilities, for the same bytes
    moved (torch's softmax is one kernel each way already)."""
    members = set(nodes)
    for n in nodes:
        if _label(n) == "softmax" and str(n.target) in ("aten.softmax.int", "aten._softmax.default",
                                                        "aten._safe_softmax.default"):
            if any(u not in members and str(u.target) in _SAVING_MATMULS for u in n.users):
                return n
    return None


def _not_worth(nodes: list[fx.Node]) -> str | None:
    compute = [n for n in nodes if n.target is not operator.getitem and _label(n) != "identity"]
    labels = {_label(n) for n in compute}
    if (sm := _softmax_kept_anyway(compute)) is not None:
        return (f"{sm.name} feeds a matmul, which saves its output: fused, the region would also keep its "
                f"inputs for the backward (twice the bytes torch keeps, for the same bytes moved)")
    if len(compute) > 1 or labels & {"norm", "softmax", "cross_entropy"} or any(map(_dropping, compute)):
        return None
    if not compute:
        return "only views and copies"
    if labels == {"head"}:
        return "a bias add with no elementwise op after it: it stays in the matmul"
    return f"a single op ({compute[0].target}): a kernel would move the same bytes as torch"


def find_regions(gm: fx.GraphModule) -> list[Region]:
    """Fused regions and rejected candidates (fused=False with a reason), in graph order."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    groups: dict[int, list[fx.Node]] = {}
    gid: dict[fx.Node, int] = {}
    rejected: list[Region] = []
    fresh = iter(range(len(nodes)))
    for n in nodes:
        if n.op != "call_function" or n in gid or n.target is operator.getitem:
            continue
        r = RULES.get(str(n.target))
        if r is None:
            if torch.Tag.pointwise in getattr(n.target, "tags", ()):
                rejected.append(Region("", [n], "unsupported", fused=False,
                                       reason=f"no kernel rule for {n.target} in the op table"))
            continue
        why = _static_reason(n, r)
        if why:
            if r.label != "identity":  # a view is never a candidate on its own
                rejected.append(Region("", [n], r.label, fused=False, reason=why))
            continue
        cands = list(dict.fromkeys(gid[a] for a in sorted(n.all_input_nodes, key=order.__getitem__,
                                                              reverse=True) if a in gid))
        mine = _with_items(n)
        for opt in ([cands] if len(cands) > 1 else []) + [[c] for c in cands] + [[]]:
            if not opt and r.label == "identity":
                break
            members = [m for c in opt for m in groups[c]] + mine
            why = _check(members, order)
            if why is None:
                g = opt[0] if opt else next(fresh)
                groups[g] = sorted(members, key=order.__getitem__)
                for c in opt[1:]:
                    del groups[c]
                for m in members:
                    gid[m] = g
                break
        else:
            rejected.append(Region("", [n], r.label, fused=False, reason=why or ""))
    regions = []
    for members in groups.values():
        members = _trim(members)
        if not members:
            continue
        reg = Region("", members, _kind(members))
        why = _not_worth(members) or _check(members, order)
        if why:
            reg.fused, reg.reason = False, why
        else:
            b, reg.program, reg.inputs, reg.outputs, reg.guessed = lower(members)
            reg.domain, reg.sources = reg.program.domain, list(b.sources)
        regions.append(reg)
    out = sorted(regions + rejected, key=lambda r: order[r.nodes[0]])
    for i, reg in enumerate(out):
        reg.name = f"r{i}_{reg.kind}"
    return out


def _trim(members: list[fx.Node]) -> list[fx.Node]:
    """Drop views and copies whose users are all outside: inside they would only add an output."""
    members = list(members)
    while drop := [m for m in members if _label(m) == "identity" and not set(m.users) & set(members)]:
        members.remove(drop[-1])
    return members


def fused_bytes(region: Region, sizes: Mapping[str, int] | None = None) -> tuple[int, int]:
    """Forward memory traffic of a region: (bytes as separate torch ops, bytes as one fused kernel).

    Before: every op reads its tensor inputs and writes its outputs (views are free). After: the kernel
    reads each region input once (once per pass where rows loop, `input_passes`) and writes each region
    output once, plus the copies that run around it
    (kernels.py): a non-contiguous input made contiguous, a broadcast input expanded in torch (kind X),
    an output torch would give a permuted layout copied into it; each copy writes and reads once more.
    `sizes` (node name -> bytes) fills in tensors without shape metadata, e.g. from TrainingGraph.nodes /
    params.
    """
    def nbytes(x: Any) -> int:
        name = x.name if isinstance(x, fx.Node) else x[1].name
        if sizes is not None and name in sizes:
            return int(sizes[name])
        node = x if isinstance(x, fx.Node) else x[1]
        return sum(t.numel() * t.element_size() for t in tensors(node.meta.get("val")))

    members = set(region.nodes)
    before = 0
    for n in region.nodes:
        if n.target is operator.getitem or _label(n) == "identity":
            continue
        skip = _mm_operands(n) if _label(n) == "head" else []  # the matmul stays outside either way
        before += nbytes(n) + sum(nbytes(a) for a in n.all_input_nodes if a not in skip or a in members)
    reads = input_passes(region)
    after = sum(nbytes(k) * reads[i] for i, k in enumerate(region.inputs)) + sum(nbytes(o) for o in region.outputs)
    return before, after + 2 * _relayout_bytes(region, nbytes)


def input_passes(region: Region, which: str = "fwd") -> list[int]:
    """Per region input, how many times the region's `fwd` (or `bwd`) kernel reads it: once, or once per
    pass over the column blocks where rows are longer than triton_gen.ROW_BLOCK."""
    if region.program is None:
        return [1] * len(region.inputs)
    reads = triton_gen.input_reads(region.program, which)
    per_key: dict[Any, int] = {}
    for i, k in zip(region.program.inputs, region.sources, strict=True):
        per_key[k] = max(per_key.get(k, 1), reads.get(i.name, 1))
    return [per_key.get(k, 1) for k in region.inputs]


def _relayout_bytes(region: Region, nbytes: Any) -> int:
    """Bytes of the layout copies around a region's kernel (`kernels._prep` and `kernels._restride`)."""
    total = 0
    if region.program is not None:
        for i, k in zip(region.program.inputs, region.sources, strict=True):
            m = meta(k) if isinstance(k, fx.Node) else None
            if i.kind == "X":
                total += region.program.numel * i.dtype.itemsize
            elif m is not None and not m.is_contiguous():
                total += nbytes(k)
    return total + sum(nbytes(o) for o in region.outputs if (m := meta(o)) is not None and not m.is_contiguous())
