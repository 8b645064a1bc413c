"""Find fusible regions in an aten-level fx graph, and say what each aten op means in kernel prims.

`RULES` maps an aten op to an expansion into triton_gen prims (the same table serves the export training IR
of stage programs and the post-autograd forward/backward graphs of torch.compile). `find_regions` grows
regions greedily in topological order: a node joins the region of one (or, merged, several) of its
producers when the region stays acyclic and still lowers to one kernel; the dry run that decides it is
the same lowering the kernel generator uses, so a region that is found can always be generated.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from .triton_gen import Builder, Program, Unfusible

Resolver = Callable[..., Any]
_IGNORED_USERS = {"aten._assert_tensor_metadata.default"}  # asserts on values a region keeps internal


@dataclass
class Rule:
    expand: Callable[[Builder, dict, Resolver], Any]
    label: str = "pointwise"  # pointwise identity head norm softmax cross_entropy reduce activation dropout
    check: Callable[[fx.Node, dict], str | None] | None = None


RULES: dict[str, Rule] = {}


def rule(*names: str, label: str = "pointwise",
         check: Callable[[fx.Node, dict], str | None] | None = None) -> Callable:
    def deco(fn: Callable) -> Callable:
        for n in names:
            RULES[f"aten.{n}"] = Rule(fn, label, check)
        return fn
    return deco


def bind(node: fx.Node) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in."""
    out = {}
    for i, a in enumerate(node.target._schema.arguments):  # type: ignore[union-attr]
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    out["_node"] = node
    return out


def meta(x: Any) -> torch.Tensor | None:
    v = x.meta.get("val") if isinstance(x, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _last_dim(node: fx.Node, dim: Any) -> str | None:
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    x = meta(node.args[0])
    ndim = x.dim() if x is not None else None
    if len(dims) == 1 and (dims[0] == -1 or ndim is not None and dims[0] == ndim - 1):
        return None
    return f"dim {dim} is not the last dim"


# ---------------------------------------------------------------------------------------------- pointwise
def _binary(prim: str, swap: bool = False) -> Callable:
    def ex(b: Builder, a: dict, v: Resolver) -> str:
        x, y = (v(a["other"]), v(a["self"])) if swap else (v(a["self"]), v(a["other"]))
        alpha = a.get("alpha", 1)  # scales `other` (for rsub, `self`)
        return b.op(prim, x, y if alpha in (None, 1) else b.op("mul", y, float(alpha)))
    return ex


for _n in ("add", "sub", "mul", "div"):
    rule(f"{_n}.Tensor", f"{_n}.Scalar",
         check=(lambda n, a: "rounding division" if a.get("rounding_mode") else None) if _n == "div" else None
         )(_binary(_n))
rule("rsub.Scalar", "rsub.Tensor")(_binary("sub", swap=True))
rule("maximum.default")(_binary("maximum"))
rule("minimum.default")(_binary("minimum"))
for _n in ("eq", "ne", "lt", "le", "gt", "ge"):
    rule(f"{_n}.Tensor", f"{_n}.Scalar")(_binary(_n))
for _n in ("neg", "exp", "log", "sqrt", "rsqrt", "erf", "abs", "sin", "cos"):
    rule(f"{_n}.default")(lambda b, a, v, _p=_n: b.op(_p, v(a["self"])))
for _n in ("relu", "sigmoid", "tanh"):
    rule(f"{_n}.default", label="activation")(lambda b, a, v, _p=_n: b.op(_p, v(a["self"])))
rule("sign.default", "sgn.default")(lambda b, a, v: b.op("sign", v(a["self"])))
rule("reciprocal.default")(lambda b, a, v: b.op("div", 1.0, v(a["self"])))
rule("log1p.default")(lambda b, a, v: b.op("log", b.op("add", v(a["self"]), 1.0)))
rule("where.self")(lambda b, a, v: b.op("where", v(a["condition"]), v(a["self"]), v(a["other"])))


@rule("silu.default", label="activation")
def _silu(b: Builder, a: dict, v: Resolver) -> str:
    x = v(a["self"])
    return b.op("mul", x, b.op("sigmoid", x))


def _gelu_tanh(b: Builder, x: str) -> str:
    cube = b.op("mul", b.op("mul", x, x), x)
    return b.op("tanh", b.op("mul", b.op("add", x, b.op("mul", cube, 0.044715)), 0.7978845608028654))


def _gelu_of(b: Builder, x: str, approximate: str) -> str:
    if approximate == "tanh":
        return b.op("mul", b.op("mul", x, 0.5), b.op("add", _gelu_tanh(b, x), 1.0))
    return b.op("mul", b.op("mul", x, 0.5), b.op("add", b.op("erf", b.op("mul", x, 0.7071067811865476)), 1.0))


rule("gelu.default", label="activation")(lambda b, a, v: _gelu_of(b, v(a["self"]), a["approximate"]))
_POW_OK = {-4.0, -3.0, -2.0, -1.0, -0.5, 0.5, 1.0, 2.0, 3.0, 4.0}
rule("pow.Tensor_Scalar", check=lambda n, a: None if float(a["exponent"]) in _POW_OK else
     f"pow with exponent {a['exponent']}")(
    lambda b, a, v: b.op("pow", v(a["self"]), attr=float(a["exponent"])))
rule("pow.Scalar", check=lambda n, a: None if float(a["self"]) > 0 else "pow of a non-positive base")(
    lambda b, a, v: b.op("exp", b.op("mul", v(a["exponent"]), float(torch.tensor(float(a["self"])).log()))))


def _identity_check(n: fx.Node, a: dict) -> str | None:
    x, y = meta(n.args[0]), meta(n)
    if x is None or y is None:
        return "no shape metadata"
    if x.numel() != y.numel() or (x.dim() and y.dim() and x.shape[-1] != y.shape[-1]):
        return "a view that changes the last dim"
    return None


rule("clone.default", "detach.default", "alias.default", "view.default", "_unsafe_view.default",
     "reshape.default", "flatten.using_ints", "lift_fresh_copy.default", label="identity",
     check=_identity_check)(lambda b, a, v: b.op("ident", v(a["self"])))


def _cast(b: Builder, a: dict, v: Resolver, dtype: Any) -> str:
    x = v(a["self"])
    return b.op("ident", x) if dtype is None else b.op("cast", x, attr=dtype)


rule("to.dtype", label="identity")(lambda b, a, v: _cast(b, a, v, a["dtype"]))
def _to_copy_check(n: fx.Node, a: dict) -> str | None:
    x, dev = meta(n.args[0]), a.get("device")
    if dev is not None and (x is None or torch.device(dev) != x.device):
        return "a device copy"
    return "a layout change" if a.get("layout") not in (None, torch.strided) else None


rule("_to_copy.default", label="identity", check=_to_copy_check)(
    lambda b, a, v: _cast(b, a, v, a.get("dtype")))


# ---------------------------------------------------------------------------------------------- dropout
# the mask is regenerated from (seed, element index) in the backward kernel instead of being saved
_p_check = lambda n, a: "dropout with p >= 1" if a["p"] >= 1 else None


@rule("native_dropout.default", label="dropout", check=_p_check)
def _native_dropout(b: Builder, a: dict, v: Resolver) -> list[str]:
    p = float(a["p"]) if a["train"] is not False else 0.0
    keep = b.op("ge", b.op("rand"), p)
    return [b.op("where", keep, b.op("mul", v(a["input"]), 1.0 / (1.0 - p)), 0.0), keep]


rule("dropout.default", label="dropout", check=_p_check)(lambda b, a, v: b.op("ident", v(a["input"])) if (
    not a["train"] or a["p"] == 0) else _native_dropout(b, a, v)[0])


rule("native_dropout_backward.default")(
    lambda b, a, v: b.op("mul", b.op("mul", v(a["grad_output"]), v(a["mask"])), float(a["scale"])))


# ---------------------------------------------------------------------------------------------- backward ops
@rule("gelu_backward.default")
def _gelu_backward(b: Builder, a: dict, v: Resolver) -> str:
    g, x = v(a["grad_output"]), v(a["self"])
    if a["approximate"] == "tanh":
        t = _gelu_tanh(b, x)
        left = b.op("mul", b.op("add", t, 1.0), 0.5)
        slope = b.op("mul", b.op("add", b.op("mul", b.op("mul", x, x), 0.134145), 1.0), 0.7978845608028654)
        dt = b.op("mul", b.op("sub", 1.0, b.op("mul", t, t)), slope)
        return b.op("mul", g, b.op("add", left, b.op("mul", b.op("mul", x, 0.5), dt)))
    cdf = b.op("mul", b.op("add", b.op("erf", b.op("mul", x, 0.7071067811865476)), 1.0), 0.5)
    pdf = b.op("mul", b.op("exp", b.op("mul", b.op("mul", x, x), -0.5)), 0.3989422804014327)
    return b.op("mul", g, b.op("add", cdf, b.op("mul", x, pdf)))


rule("threshold_backward.default")(lambda b, a, v: b.op(
    "where", b.op("le", v(a["self"]), float(a["threshold"])), 0.0, v(a["grad_output"])))
rule("sigmoid_backward.default")(lambda b, a, v: b.op("mul", v(a["grad_output"]), b.op(
    "mul", v(a["output"]), b.op("sub", 1.0, v(a["output"])))))
rule("tanh_backward.default")(lambda b, a, v: b.op("mul", v(a["grad_output"]), b.op(
    "sub", 1.0, b.op("mul", v(a["output"]), v(a["output"])))))


@rule("silu_backward.default")
def _silu_backward(b: Builder, a: dict, v: Resolver) -> str:
    x = v(a["self"])
    s = b.op("sigmoid", x)
    ds = b.op("mul", s, b.op("add", b.op("mul", x, b.op("sub", 1.0, s)), 1.0))
    return b.op("mul", v(a["grad_output"]), ds)


# ---------------------------------------------------------------------------------------------- rows
def _norm_check(n: fx.Node, a: dict) -> str | None:
    return None if len(a["normalized_shape"]) == 1 else "normalization over more than the last dim"


def _layer_norm(b: Builder, a: dict, v: Resolver) -> tuple[str, str, str]:
    x = v(a["input"])
    n = b.N
    mean = b.op("div", b.op("rsum", x), float(n))
    xc = b.op("sub", x, mean)
    var = b.op("div", b.op("rsum", b.op("mul", xc, xc)), float(n))
    rstd = b.op("rsqrt", b.op("add", var, float(a["eps"])))
    y = b.op("mul", xc, rstd)
    if a["weight"] is not None:
        y = b.op("mul", y, v(a["weight"], like=(n,)))
    if a["bias"] is not None:
        y = b.op("add", y, v(a["bias"], like=(n,)))
    return y, mean, rstd


rule("layer_norm.default", label="norm", check=_norm_check)(lambda b, a, v: _layer_norm(b, a, v)[0])
rule("native_layer_norm.default", label="norm", check=_norm_check)(lambda b, a, v: list(_layer_norm(b, a, v)))


@rule("native_layer_norm_backward.default", label="norm", check=_norm_check)
def _layer_norm_backward(b: Builder, a: dict, v: Resolver) -> list[str | None]:
    g, x = v(a["grad_out"]), v(a["input"])
    n = float(b.N)
    xhat = b.op("mul", b.op("sub", x, v(a["mean"])), v(a["rstd"]))
    gx = b.op("mul", g, v(a["weight"], like=(b.N,))) if a["weight"] is not None else g
    dx = b.op("mul", v(a["rstd"]), b.op("sub", b.op("sub", gx, b.op("div", b.op("rsum", gx), n)), b.op(
        "mul", xhat, b.op("div", b.op("rsum", b.op("mul", gx, xhat)), n))))
    mask = a["output_mask"]
    return [dx if mask[0] else None, b.op("csum", b.op("mul", g, xhat)) if mask[1] else None,
            b.op("csum", g) if mask[2] else None]


@rule("rms_norm.default", label="norm", check=_norm_check)
def _rms_norm(b: Builder, a: dict, v: Resolver) -> str:
    x = v(a["input"])
    eps = a["eps"] if a["eps"] is not None else torch.finfo(torch.float32).eps
    ms = b.op("div", b.op("rsum", b.op("mul", x, x)), float(b.N))
    y = b.op("mul", x, b.op("rsqrt", b.op("add", ms, float(eps))))
    return b.op("mul", y, v(a["weight"], like=(b.N,))) if a["weight"] is not None else y


def _softmax_check(n: fx.Node, a: dict) -> str | None:
    if a.get("dtype") is not None or a.get("half_to_float"):
        return "softmax with a dtype change"
    return _last_dim(n, a["dim"])


def _lse(b: Builder, x: str) -> str:
    # the max only shifts for stability: softmax does not depend on it, so no gradient flows through it
    m = b.op("stopgrad", b.op("rmax", x))
    return b.op("add", b.op("log", b.op("rsum", b.op("exp", b.op("sub", x, m)))), m)


def _softmax(b: Builder, a: dict, v: Resolver) -> str:
    x = v(a["self"])
    e = b.op("exp", b.op("sub", x, b.op("stopgrad", b.op("rmax", x))))
    return b.op("div", e, b.op("rsum", e))


rule("softmax.int", "_softmax.default", "_safe_softmax.default", label="softmax",
     check=_softmax_check)(_softmax)
rule("log_softmax.int", "_log_softmax.default", label="softmax", check=_softmax_check)(
    lambda b, a, v: b.op("sub", v(a["self"]), _lse(b, v(a["self"]))))
rule("_softmax_backward_data.default", label="softmax", check=lambda n, a: _last_dim(n, a["dim"]))(
    lambda b, a, v: b.op("mul", v(a["output"]), b.op("sub", v(a["grad_output"]), b.op(
        "rsum", b.op("mul", v(a["grad_output"]), v(a["output"]))))))
rule("_log_softmax_backward_data.default", label="softmax", check=lambda n, a: _last_dim(n, a["dim"]))(
    lambda b, a, v: b.op("sub", v(a["grad_output"]), b.op("mul", b.op("exp", v(a["output"])), b.op(
        "rsum", v(a["grad_output"])))))


def _ce_check(n: fx.Node, a: dict) -> str | None:
    x, t = meta(n.args[0]), meta(n.args[1])
    if a.get("weight") is not None or a.get("label_smoothing", 0.0):
        return "class weights or label smoothing"
    if x is None or x.dim() != 2 or t is not None and (t.dim() != 1 or t.dtype.is_floating_point):
        return "input is not (rows, classes) with one class index per row"
    return None


def _pick(b: Builder, x: str, t: str, ignore: int) -> tuple[str, str]:
    valid = b.op("ne", t, int(ignore))
    return b.op("rsum", b.op("where", b.op("eq", b.op("colidx"), t), x, 0.0)), valid


def _reduce_rows(b: Builder, loss: str, valid: str, reduction: int) -> list[str]:
    count = b.op("tsum", b.op("cast", valid, attr=torch.float32))
    if reduction == 0:
        return [loss, count]
    total = b.op("tsum", loss)
    return [b.op("div", total, count) if reduction == 1 else total, count]


@rule("cross_entropy_loss.default", label="cross_entropy", check=_ce_check)
def _cross_entropy(b: Builder, a: dict, v: Resolver) -> str:
    x, t = v(a["self"]), v(a["target"], role="row")
    xt, valid = _pick(b, x, t, a["ignore_index"])
    loss = b.op("where", valid, b.op("sub", _lse(b, x), xt), 0.0)
    return _reduce_rows(b, loss, valid, a["reduction"])[0]


@rule("nll_loss_forward.default", label="cross_entropy", check=_ce_check)
def _nll_forward(b: Builder, a: dict, v: Resolver) -> list[str]:
    x, t = v(a["self"]), v(a["target"], role="row")
    xt, valid = _pick(b, x, t, a["ignore_index"])
    return _reduce_rows(b, b.op("where", valid, b.op("neg", xt), 0.0), valid, a["reduction"])


@rule("nll_loss_backward.default", label="cross_entropy",
      check=lambda n, a: _ce_check(n, {**a, "self": n.args[1]}) or (
          "unreduced loss" if a["reduction"] == 0 else None))
def _nll_backward(b: Builder, a: dict, v: Resolver) -> str:
    t = v(a["target"], role="row")
    g = v(a["grad_output"])
    if a["reduction"] == 1:
        g = b.op("div", g, v(a["total_weight"]))
    hit = b.op("and", b.op("eq", b.op("colidx"), t), b.op("ne", t, int(a["ignore_index"])))
    return b.op("where", hit, b.op("neg", g), 0.0)


# ---------------------------------------------------------------------------------------------- reductions
def _dims(n: fx.Node, dim: Any) -> str | None:
    """'all', 'last' or 'leading' (all but the last) for the reduced dims; None when none of those."""
    x = meta(n.args[0])
    nd = x.dim() if x is not None else 0
    dims = sorted({d % nd for d in dim}) if dim and nd else list(range(nd))
    return {tuple(range(nd)): "all", (nd - 1,): "last", tuple(range(nd - 1)): "leading"}.get(tuple(dims)) \
        if x is not None else None


def _reduce_check(n: fx.Node, a: dict) -> str | None:
    if a.get("dtype") is not None:
        return "reduction with a dtype change"
    what = _dims(n, a.get("dim"))
    if what is None:
        return "reduces dims other than the last, all leading, or all"
    if what == "last" and not a.get("keepdim"):
        return "reduces the last dim without keepdim"
    return None


def _sum(b: Builder, a: dict, v: Resolver, mean: bool = False) -> str:
    x = v(a["self"])
    kind = _dims(a["_node"], a.get("dim"))
    if kind == "last":
        s = b.op("rsum", x)
        return b.op("div", s, float(b.N)) if mean else s
    if kind == "leading":
        return b.op("csum", b.op("div", x, float(b.M)) if mean else x)
    s = b.op("tsum", x)
    return b.op("div", s, float(b.M * b.N)) if mean else s


rule("sum.dim_IntList", "sum.default", label="reduce", check=_reduce_check)(_sum)
rule("mean.dim", label="reduce", check=_reduce_check)(lambda b, a, v: _sum(b, a, v, True))
rule("amax.default", label="reduce", check=lambda n, a: _last_dim(n, a["dim"]) or (
    None if a["keepdim"] else "amax without keepdim"))(lambda b, a, v: b.op("rmax", v(a["self"])))


# ---------------------------------------------------------------------------------------------- heads
def _head_check(n: fx.Node, a: dict) -> str | None:
    bias = a["bias"] if str(n.target) == "aten.linear.default" else a["self"]
    if bias is None:
        return "no bias"
    if str(n.target) == "aten.addmm.default" and (a["beta"] != 1 or a["alpha"] != 1):
        return "scaled addmm"
    bm, out = meta(bias), meta(n)
    if bm is not None and out is not None and bm.numel() != out.shape[-1]:
        return "bias is not one value per output feature"
    return None


# the matmul stays in torch (see kernels.py); the region starts at its bias add
def _head(b: Builder, a: dict, v: Resolver) -> str:
    node = a["_node"]
    bias = a["bias"] if str(node.target) == "aten.linear.default" else a["self"]
    return b.op("add", v(("mm", node)), v(bias, like=(meta(node).shape[-1],)))


rule("linear.default", "addmm.default", label="head", check=_head_check)(_head)


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
    program: Program | None = None  # lowered at the graph's shapes (see `guessed`)
    guessed: bool = False  # some input had no shape metadata, so the program's input kinds are a guess

    @property
    def ops(self) -> list[str]:
        return [str(n.target) for n in self.nodes if n.target is not operator.getitem]

    @property
    def heads(self) -> list[fx.Node]:
        return [n for n in self.nodes if _label(n) == "head"]


def _label(n: fx.Node) -> str:
    r = RULES.get(str(n.target))
    return r.label if r else ""


def _used_outside(n: fx.Node, members: set[fx.Node]) -> bool:
    return any(u not in members and str(u.target) not in _IGNORED_USERS for u in n.users)


def tensors(val: Any) -> list[torch.Tensor]:
    return [t for t in (val if isinstance(val, (tuple, list)) else [val]) if isinstance(t, torch.Tensor)]


def lower(nodes: list[fx.Node], values: Mapping[Any, torch.Tensor] | None = None
          ) -> tuple[Builder, Program, list[Any], list[fx.Node], bool]:
    """Lower region nodes (topological order) to a Program; `values` are runtime inputs by key, else the
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


def _not_worth(nodes: list[fx.Node]) -> str | None:
    compute = [n for n in nodes if n.target is not operator.getitem and _label(n) != "identity"]
    labels = {_label(n) for n in compute}
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
            _, reg.program, reg.inputs, reg.outputs, reg.guessed = lower(members)
            reg.domain = reg.program.domain
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
    reads each region input once and writes each region output once. `sizes` (node name -> bytes)
    fills in tensors without shape metadata, e.g. from TrainingGraph.nodes / params.
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
    after = sum(nbytes(k) for k in region.inputs) + sum(nbytes(o) for o in region.outputs)
    return before, after
