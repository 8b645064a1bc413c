"""What each aten op means in kernel prims: `RULES` maps an aten op to its expansion into triton_gen prims
(the same table serves the export training IR of stage programs and the post-autograd forward/backward
graphs of torch.compile). Region finding, which consults it, is in fusion.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from .triton_gen import Builder

Resolver = Callable[..., Any]


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
# A drawing dropout is not fused: it runs as autopar's keyed draw in torch (passes/randomness.py), whose masks
# do not depend on the plan; pricing (fusion_pricing) and the runtime share this rule.
_p_check = lambda n, a: "dropout draws plan-invariant keyed masks in torch (passes/randomness.py)" if (
    a["p"] > 0 and a["train"] is not False) else None


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
