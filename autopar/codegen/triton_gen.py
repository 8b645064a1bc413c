"""Triton code generation for fused regions: a tiny kernel IR, forward and backward codegen, a kernel cache.

A region (see fusion.py) is lowered into a `Program`: straight-line instructions over *prims* (add, exp,
row sum, ...). Every prim has a `tl` expression and a vector-Jacobian rule in `PRIMS`; the forward kernel
evaluates the program and the backward kernel recomputes it and runs reverse-mode AD over it, so both
kernels come from the graph's ops, not from hand-written per-op kernels.

Layout: a region works on its domain viewed as [M, N] row-major (N = last dim). One program owns
BLOCK_M rows and the whole row (BLOCK_N >= N), so row reductions (norms, softmax, cross-entropy) stay in
registers. Pure elementwise regions use a virtual row of 1024 elements. Value classes in a kernel:
E [BLOCK_M, BLOCK_N], R per row [BLOCK_M, 1], C per column [1, BLOCK_N], S scalar; T (a total over all
rows) and CP (a column sum over all rows) are written as per-program partials and summed in torch.
Ops on T values ("host ops", e.g. the mean of a cross-entropy) run in torch after the kernel.

Kernels are cached by the hash of their source (in memory, and as files under $AUTOPAR_KERNEL_CACHE or
the temp dir), so identical regions (repeated blocks) share one kernel. kernels.py launches them and
wraps them in an autograd Function.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MAX_ROW = 32768  # longest row a persistent-row kernel holds in registers
VIRTUAL_ROW = 1024


class Unfusible(Exception):
    """A region (or one op of it) cannot become a kernel; the message is the reason the report shows."""


_TIE = "tl.where({{{1}}} {0} {{{2}}}, {{g}}, tl.where({{{1}}} == {{{2}}}, {{g}} * 0.5, 0.0))"
_EXP2 = "tl.exp(-2.0 * tl.abs({0}))"
# prim -> (tl expression, {arg index: vjp expression}); {0},{1},{2} args, {o} output, {g} output grad
PRIMS: dict[str, tuple[str, dict[int, str]]] = {
    "ident": ("{0}", {0: "{g}"}),
    "stopgrad": ("{0}", {}),
    "add": ("{0} + {1}", {0: "{g}", 1: "{g}"}),
    "sub": ("{0} - {1}", {0: "{g}", 1: "-{g}"}),
    "mul": ("{0} * {1}", {0: "{g} * {1}", 1: "{g} * {0}"}),
    "div": ("{0} / {1}", {0: "{g} / {1}", 1: "-{g} * {o} / {1}"}),
    "neg": ("-{0}", {0: "-{g}"}),
    "exp": ("tl.exp({0})", {0: "{g} * {o}"}),
    "log": ("tl.log({0})", {0: "{g} / {0}"}),
    "sqrt": ("tl.sqrt({0})", {0: "{g} * 0.5 / {o}"}),
    "rsqrt": ("tl.rsqrt({0})", {0: "-0.5 * {g} * {o} * {o} * {o}"}),
    # tl has no tanh the interpreter runs; with e = exp(-2|x|) both forms are exact near saturation
    "tanh": ("tl.where({0} >= 0, 1.0, -1.0) * (1.0 - _E) / (1.0 + _E)".replace("_E", _EXP2),
             {0: "{g} * 4.0 * _E / ((1.0 + _E) * (1.0 + _E))".replace("_E", _EXP2)}),
    "sigmoid": ("tl.sigmoid({0})", {0: "{g} * {o} * (1.0 - {o})"}),
    "erf": ("tl.erf({0})", {0: "{g} * 1.1283791670955126 * tl.exp(-{0} * {0})"}),
    "sin": ("tl.sin({0})", {0: "{g} * tl.cos({0})"}),
    "cos": ("tl.cos({0})", {0: "-{g} * tl.sin({0})"}),
    "sign": ("tl.where({0} > 0, 1.0, tl.where({0} < 0, -1.0, 0.0))", {}),
    "abs": ("tl.abs({0})", {0: "tl.where({0} > 0, {g}, tl.where({0} < 0, -{g}, 0.0))"}),
    "relu": ("tl.maximum({0}, 0.0)", {0: "tl.where({o} > 0, {g}, 0.0)"}),
    # ties split the gradient, as torch does
    "maximum": ("tl.maximum({0}, {1})", {0: _TIE.format(">", 0, 1), 1: _TIE.format(">", 1, 0)}),
    "minimum": ("tl.minimum({0}, {1})", {0: _TIE.format("<", 0, 1), 1: _TIE.format("<", 1, 0)}),
    "where": ("tl.where({0}, {1}, {2})", {1: "tl.where({0}, {g}, 0.0)", 2: "tl.where({0}, 0.0, {g})"}),
    "eq": ("{0} == {1}", {}), "ne": ("{0} != {1}", {}), "lt": ("{0} < {1}", {}), "le": ("{0} <= {1}", {}),
    "gt": ("{0} > {1}", {}), "ge": ("{0} >= {1}", {}), "and": ("{0} & {1}", {}), "not": ("{0} == 0", {}),
}
COMPARE = {"eq", "ne", "lt", "le", "gt", "ge", "and", "not"}
REDUCE = {"rsum", "rmax", "tsum", "csum"}
_REDUCED = {("rsum", "E"): "R", ("rmax", "E"): "R", ("tsum", "E"): "T", ("tsum", "R"): "T",
            ("csum", "E"): "CP"}
# host ops: the few prims that may act on T values after the kernel
HOST = {"ident": lambda a: a, "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
        "neg": torch.neg, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt}
_TL_FLOAT = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16"}
_TL_INT = {torch.int64: "tl.int64", torch.int32: "tl.int32", torch.int16: "tl.int16", torch.int8: "tl.int8",
           torch.uint8: "tl.uint8"}


@dataclass(frozen=True)
class Instr:
    out: str
    prim: str
    args: tuple[Any, ...]  # value names (str) or Python constants
    attr: Any = None


@dataclass(frozen=True)
class Input:
    name: str  # value name inside the kernel
    kind: str  # E full, P periodic suffix, X expanded in torch, C column, R row, S scalar
    dtype: torch.dtype
    shape: tuple[int, ...]
    period: int = 0


@dataclass
class Program:
    domain: tuple[int, ...]
    inputs: list[Input]
    instrs: list[Instr]
    host: list[Instr]
    outputs: list[tuple[str, str, tuple[int, ...], torch.dtype]]  # value, kind (E R S T CP), shape, dtype
    cls: dict[str, str]
    dt: dict[str, str]  # f float, i int, b bool
    rows: bool  # real rows (N = last dim) rather than a virtual row

    @property
    def numel(self) -> int:
        return _numel(self.domain)

    @property
    def n(self) -> int:
        return (self.domain[-1] if self.domain else 1) if self.rows else min(VIRTUAL_ROW, pow2(self.numel))

    @property
    def m(self) -> int:
        return -(-self.numel // self.n)


def _numel(shape: tuple[int, ...] | torch.Size) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _join(classes: list[str]) -> str:
    s = set(classes) - {"K"}
    if "E" in s or {"R", "C"} <= s:
        return "E"
    for c in ("R", "C", "S"):
        if c in s:
            return c
    return "K"


class Builder:
    """Builds a Program from a region's ops; expansions in fusion.py call `input` and `op`."""

    def __init__(self, domain: tuple[int, ...]) -> None:
        self.domain = tuple(int(s) for s in domain)
        self.N = self.domain[-1] if self.domain else 1
        self.M = _numel(self.domain) // max(self.N, 1)
        self.inputs: list[Input] = []
        self.instrs: list[Instr] = []
        self.host: list[Instr] = []
        self.cls: dict[str, str] = {}
        self.dt: dict[str, str] = {}
        self._keys: dict[Any, str] = {}
        self.sources: list[Any] = []  # the key each input was requested with, in input order
        self.n_rand = 0

    def _new(self, cls: str, dt: str) -> str:
        name = f"v{len(self.cls)}"
        self.cls[name], self.dt[name] = cls, dt
        return name

    def input(self, key: Any, shape: tuple[int, ...], dtype: torch.dtype, role: str | None = None) -> str:
        """A region input of this shape; role 'row' means one value per row (a class index per row)."""
        if (key, role) in self._keys:
            return self._keys[(key, role)]
        shape = tuple(int(s) for s in shape)
        if dtype == torch.float64 or dtype.is_complex:
            raise Unfusible(f"{dtype} input (kernels compute in float32)")
        numel, d = _numel(shape), self.domain
        padded = (1,) * (len(d) - len(shape)) + shape if len(shape) <= len(d) else None
        kind, period = "X", 0
        if role == "row":
            if numel != self.M:
                raise Unfusible(f"per-row input of shape {shape} does not match {self.M} rows")
            kind = "R"
        elif numel == 1:
            kind = "S"
        elif numel == _numel(d) and shape and shape[-1] == self.N:
            kind = "E"
        elif padded is not None and d and padded == d[:-1] + (1,):
            kind = "R"
        elif padded is not None:
            core = list(shape)
            while core and core[0] == 1:
                core.pop(0)
            if core and tuple(core) == d[len(d) - len(core):]:
                kind, period = ("C", 0) if tuple(core) == (self.N,) else ("P", _numel(core))
        if kind == "X" and (padded is None or any(a not in (1, b) for a, b in zip(padded, d, strict=True))):
            raise Unfusible(f"input of shape {shape} does not broadcast to the region's {d}")
        cls = {"E": "E", "P": "E", "X": "E", "C": "C", "R": "R", "S": "S"}[kind]
        dt = "f" if dtype.is_floating_point else "b" if dtype == torch.bool else "i"
        name = self._new(cls, dt)
        self.inputs.append(Input(name, kind, dtype, shape, period))
        self.sources.append(key)
        self._keys[(key, role)] = name
        return name

    def op(self, prim: str, *args: Any, attr: Any = None) -> str:
        classes = [self.cls[a] if isinstance(a, str) else "K" for a in args]
        dts = [self.dt[a] if isinstance(a, str) else
               "b" if isinstance(a, bool) else "f" if isinstance(a, float) else "i" for a in args]
        if "CP" in classes:
            raise Unfusible("a column sum over all rows is used inside the kernel")
        if "T" in classes:
            if prim not in HOST or set(classes) - {"T", "K"}:
                raise Unfusible(f"'{prim}' mixes a total over the whole tensor with per-element values")
            out = self._new("T", "f")
            self.host.append(Instr(out, prim, args, attr))
            return out
        if prim in REDUCE:
            if prim in ("rsum", "rmax") and classes[0] in ("R", "S"):
                return args[0]  # reducing a size-1 last dim
            cls = _REDUCED.get((prim, classes[0]))
            if cls is None or dts[0] != "f":
                kind = "float" if dts[0] == "f" else "integer"
                raise Unfusible(f"{prim} of a {classes[0]}-class {kind} value")
            dt = "f"
        elif prim in ("rand", "colidx"):  # per-element random numbers, per-column index
            cls, dt, attr = ("E", "f", self.n_rand) if prim == "rand" else ("C", "i", None)
            self.n_rand += prim == "rand"
        else:
            cls = _join(classes)
            if cls == "K":
                raise Unfusible(f"'{prim}' of constants only")
            if prim in COMPARE:
                dt = "b"
            elif prim == "cast":
                dt = "f" if attr.is_floating_point else "b" if attr == torch.bool else "i"
            elif prim in ("where", "ident", "stopgrad"):
                dt = "f" if "f" in dts[-2:] else dts[-1]
            elif "f" in dts:
                dt = "f"
            else:
                raise Unfusible(f"integer arithmetic '{prim}'")
        out = self._new(cls, dt)
        self.instrs.append(Instr(out, prim, args, attr))
        return out

    def finish(self, outputs: list[tuple[Any, tuple[int, ...], torch.dtype]]) -> Program:
        outs = []
        for value, shape, dtype in outputs:
            if not isinstance(value, str):
                raise Unfusible("an output is a constant")
            cls, numel = self.cls[value], _numel(shape)
            if cls == "C":
                raise Unfusible(f"output of shape {tuple(shape)} holds one value per column")
            kind = cls
            expect = {"E": _numel(self.domain), "R": self.M, "S": 1, "T": 1, "CP": self.N}[kind]
            if numel != expect:
                raise Unfusible(f"output of shape {tuple(shape)} is a {cls}-class value of the kernel")
            outs.append((value, kind, tuple(int(s) for s in shape), dtype))
        rows = any(i.kind in ("C", "R") for i in self.inputs) or any(
            i.prim in REDUCE for i in self.instrs) or any(k in ("R", "CP") for _, k, _, _ in outs)
        if _numel(self.domain) >= 2**31:
            raise Unfusible("2^31 or more elements (kernels index with int32)")
        if rows and self.N > MAX_ROW:
            raise Unfusible(f"row of {self.N} elements is longer than the {MAX_ROW} a kernel keeps in "
                            f"registers")
        return Program(self.domain, self.inputs, self.instrs, self.host, outs, self.cls, self.dt, rows)


# ---------------------------------------------------------------------------------------------- codegen
_MASK = {"E": "mask", "R": "rmask", "C": "cmask"}


def _fmt(a: Any) -> str:
    if isinstance(a, (str, bool)):
        return str(a)
    if isinstance(a, float) and (a != a or a in (float("inf"), float("-inf"))):
        return f'float("{a}")'
    return repr(float(a)) if isinstance(a, float) else repr(int(a))


def _args(ins: Instr, p: Program) -> list[str]:
    """Arguments as code; bool/int values feeding float arithmetic are cast to float32 first."""
    out = []
    for k, x in enumerate(ins.args):
        s = _fmt(x)
        promote = p.dt[ins.out] == "f" and ins.prim not in COMPARE and not (ins.prim == "where" and k == 0)
        if isinstance(x, str) and promote and p.dt[x] != "f":
            s = f"{s}.to(tl.float32)"
        out.append(s)
    return out


def _expr(ins: Instr, p: Program) -> str:
    a = _args(ins, p)
    if ins.prim == "cast":
        if p.dt[ins.out] == "b":
            return f"({a[0]} != 0)"
        if ins.attr in _TL_FLOAT:  # round like the eager dtype, keep computing in fp32
            return f"{a[0]}.to({_TL_FLOAT[ins.attr]}).to(tl.float32)"
        return f"{a[0]}.to({_TL_INT.get(ins.attr, 'tl.float32')})"
    if ins.prim == "rand":
        return f"tl.rand(SEED + {ins.attr}, offs)"
    if ins.prim == "colidx":
        return "cols"
    if ins.prim == "rsum":
        return f"tl.sum(tl.where(mask, {a[0]}, 0.0), axis=1, keep_dims=True)"
    if ins.prim == "rmax":
        return f'tl.max(tl.where(mask, {a[0]}, -float("inf")), axis=1, keep_dims=True)'
    if ins.prim == "tsum":
        return f"tl.sum(tl.where({_MASK[p.cls[ins.args[0]]]}, {a[0]}, 0.0))"
    if ins.prim == "csum":
        return f"tl.sum(tl.where(mask, {a[0]}, 0.0), axis=0, keep_dims=True)"
    if ins.prim == "pow":
        return _pow(a[0], ins.attr)
    return PRIMS[ins.prim][0].format(*a)


def _pow(x: str, e: float) -> str:
    if e == 0.5:
        return f"tl.sqrt({x})"
    if e == -0.5:
        return f"tl.rsqrt({x})"
    k = int(abs(e))
    prod = " * ".join([x] * k) if k else "1.0"
    return f"(1.0 / ({prod}))" if e < 0 else f"({prod})"


def _vjp(ins: Instr, g: str, p: Program) -> list[tuple[int, str, str]]:
    """(arg index, contribution expression, its class) for each differentiable argument."""
    a = _args(ins, p)
    o = ins.out
    if ins.prim in ("rsum", "tsum", "csum"):
        return [(0, g, {"rsum": "R", "tsum": "S", "csum": "C"}[ins.prim])]
    if ins.prim == "rmax":  # ties share the gradient, as torch.amax's backward does
        cnt = f"tl.sum(tl.where(mask & ({a[0]} == {o}), 1.0, 0.0), axis=1, keep_dims=True)"
        return [(0, f"tl.where({a[0]} == {o}, {g} / {cnt}, 0.0)", "E")]
    if ins.prim == "cast":
        return [(0, g, p.cls[o])] if p.dt[o] == "f" else []
    if ins.prim == "pow":
        e = ins.attr
        d = {0.5: f"0.5 / {o}", -0.5: f"-0.5 * {o} * {o} * {o}"}.get(
            e, f"{_fmt(float(e))} * {_pow(a[0], e - 1)}")
        return [(0, f"{g} * {d}", p.cls[o])]
    if ins.prim not in PRIMS:
        return []
    return [(i, t.format(*a, g=g, o=o), p.cls[o]) for i, t in PRIMS[ins.prim][1].items()]


def _reduce_to(expr: str, src: str, dst: str) -> str:
    if src == dst:
        return expr
    if (src, dst) in (("S", "E"), ("S", "R"), ("S", "C"), ("R", "E"), ("C", "E")):
        shape = {"E": "[BLOCK_M, BLOCK_N]", "R": "[BLOCK_M, 1]", "C": "[1, BLOCK_N]"}[dst]
        return f"({expr} + tl.zeros({shape}, tl.float32))"
    if dst == "S":
        return f"tl.sum(tl.where({_MASK[src]}, {expr}, 0.0))"
    axis = {"R": 1, "C": 0}[dst]
    return f"tl.sum(tl.where(mask, {expr}, 0.0), axis={axis}, keep_dims=True)"


def _load(i: Input, ptr: str) -> str:
    cast = ".to(tl.float32)" if i.dtype.is_floating_point else ""
    other = "0.0" if i.dtype.is_floating_point else "0"
    if i.kind == "S":
        return f"tl.load({ptr}){cast}"
    where, m = {"E": ("offs", "mask"), "X": ("offs", "mask"), "P": (f"offs % P_{i.name}", "mask"),
                "C": ("cols", "cmask"), "R": ("rows", "rmask")}[i.kind]
    return f"tl.load({ptr} + {where}, mask={m}, other={other}){cast}"


def _header(name: str, args: list[str]) -> list[str]:
    return [f"def {name}({', '.join(args)}, M, N, NUMEL, SEED,",
            "        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):",
            "    pid = tl.program_id(0)",
            "    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]",
            "    cols = tl.arange(0, BLOCK_N)[None, :]",
            "    offs = rows * N + cols",
            "    rmask = rows < M",
            "    cmask = cols < N",
            "    mask = rmask & cmask & (offs < NUMEL)"]


def _store(kind: str, ptr: str, v: str, cls: str) -> str:
    cls = {"CP": "C", "T": "S"}.get(cls, cls)  # already reduced inside this program
    if kind in ("E", "X"):
        return f"    tl.store({ptr} + offs, {_reduce_to(v, cls, 'E')}, mask=mask)"
    if kind == "R":
        return f"    tl.store({ptr} + rows, {_reduce_to(v, cls, 'R')}, mask=rmask)"
    if kind in ("C", "CP"):  # per-program column partials
        return f"    tl.store({ptr} + pid * N + cols, {_reduce_to(v, cls, 'C')}, mask=cmask)"
    return f"    tl.store({ptr} + pid, {_reduce_to(v, cls, 'S')})"  # per-program partial (or a scalar)


def _period_args(p: Program) -> list[str]:
    return [f"P_{i.name}" for i in p.inputs if i.kind == "P"]


def kernel_outputs(p: Program) -> list[int]:
    """Indices of the outputs the forward kernel writes (totals come from `totals` and host ops)."""
    return [k for k, (_, kind, _, _) in enumerate(p.outputs) if kind != "T"]


def totals(p: Program) -> list[str]:
    return [ins.out for ins in p.instrs if ins.prim == "tsum"]


def grad_outputs(p: Program) -> list[int]:
    """Kernel-written float outputs, whose gradients the backward kernel reads."""
    return [k for k in kernel_outputs(p)
            if p.outputs[k][3].is_floating_point and p.dt[p.outputs[k][0]] == "f"]


def generate(p: Program, title: str = "") -> str:
    """Python source of the forward kernel `fwd` and the backward kernel `bwd` of a program."""
    kinds = [(i.kind, str(i.dtype).removeprefix("torch.")) for i in p.inputs]
    lines = [f"# generated by autopar.codegen.triton_gen{': ' + title if title else ''}",
             f"# {'rows' if p.rows else 'flat'} layout; inputs (kind, dtype): {kinds}",
             "import triton.language as tl", "", ""]
    outs = kernel_outputs(p)
    lines += _header("fwd", [f"in_{i.name}" for i in p.inputs] + [f"out_{k}" for k in outs]
                     + [f"tp_{v}" for v in totals(p)] + _period_args(p))
    lines += [f"    {i.name} = {_load(i, f'in_{i.name}')}" for i in p.inputs]
    lines += [f"    {ins.out} = {_expr(ins, p)}" for ins in p.instrs]
    for k in outs:
        v, kind, _, _ = p.outputs[k]
        lines.append(_store(kind, f"out_{k}", v, p.cls[v]))
    lines += [_store("T", f"tp_{v}", v, "S") for v in totals(p)]
    lines += ["", ""] + _backward(p)
    return "\n".join(lines) + "\n"


_NAME = re.compile(r"\bv\d+\b")


def _backward(p: Program) -> list[str]:
    body: list[str] = []
    grads: dict[str, str] = {}
    gcls: dict[str, str] = {}

    def add(v: str, expr: str, cls: str) -> None:
        target = {"T": "S", "CP": "C"}.get(p.cls[v], p.cls[v])
        e = _reduce_to(expr, cls, target)
        if v in grads:
            body.append(f"    {grads[v]} = {grads[v]} + {e}")
        else:
            grads[v], gcls[v] = f"g_{v}", target
            body.append(f"    g_{v} = {e}")

    gouts = grad_outputs(p)
    for k in gouts:
        v, kind, _, _ = p.outputs[k]
        where, m, cls = {"E": ("offs", "mask", "E"), "R": ("rows", "rmask", "R"),
                         "CP": ("cols", "cmask", "C"), "S": ("", "", "S")}[kind]
        load = f"tl.load(gout_{k} + {where}, mask={m}, other=0.0)" if where else f"tl.load(gout_{k})"
        body.append(f"    go_{k} = {load}.to(tl.float32)")
        add(v, f"go_{k}", cls)
    for v in totals(p):
        body.append(f"    go_{v} = tl.load(gt_{v}).to(tl.float32)")
        add(v, f"go_{v}", "S")
    for ins in reversed(p.instrs):
        if ins.out not in grads or p.dt[ins.out] != "f":
            continue
        for idx, expr, cls in _vjp(ins, grads[ins.out], p):
            arg = ins.args[idx]
            if isinstance(arg, str) and p.dt[arg] == "f":
                add(arg, expr, cls)
    needed = set(_NAME.findall("\n".join(body)))
    for ins in reversed(p.instrs):
        if ins.out in needed:
            needed |= {a for a in ins.args if isinstance(a, str)}
    gin = [i for i in p.inputs if i.dtype.is_floating_point]
    args = ([f"in_{i.name}" for i in p.inputs] + [f"gout_{k}" for k in gouts] + [f"gt_{v}" for v in totals(p)]
            + [f"gin_{i.name}" for i in gin] + _period_args(p))
    lines = _header("bwd", args)
    lines += [f"    {i.name} = {_load(i, f'in_{i.name}')}" for i in p.inputs if i.name in needed]
    lines += [f"    {ins.out} = {_expr(ins, p)}" for ins in p.instrs
              if ins.out in needed and ins.prim not in ("tsum", "csum")]
    lines += body
    for i in gin:
        kind = {"P": "E", "X": "E"}.get(i.kind, i.kind)
        lines.append(_store(kind, f"gin_{i.name}", grads.get(i.name, "0.0"), gcls.get(i.name, "S")))
    return lines


# ---------------------------------------------------------------------------------------------- loading
def _cache_dir() -> Path:
    d = Path(os.environ.get("AUTOPAR_KERNEL_CACHE") or Path(tempfile.gettempdir()) / "autopar_kernels")
    d.mkdir(parents=True, exist_ok=True)
    return d


def source_hash(src: str) -> str:
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@dataclass
class CompiledRegion:
    """A program's kernels, loaded for one execution mode (interpreted on CPU, compiled on GPU)."""

    program: Program
    source: str
    fwd: Any
    bwd: Any
    interpret: bool
    key: str = ""


_LOADED: dict[tuple[str, bool], CompiledRegion] = {}


def import_triton() -> None:
    """Import triton (optional, so only once a kernel is needed). Without CUDA it can only interpret, and
    the interpreter needs TRITON_INTERPRET=1 before the first import; it is set just for that import so
    that subprocesses do not inherit it. (When torch imported triton first, see interpreted_stdlib.)"""
    if "triton" in sys.modules or torch.cuda.is_available():
        import triton  # noqa: F401
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def load(p: Program, source: str, interpret: bool) -> CompiledRegion:
    """Compile (or fetch from the cache) the kernels of `source`; the cache key is the source hash."""
    key = source_hash(source)
    hit = _LOADED.get((key, interpret))
    if hit is not None:
        return CompiledRegion(p, source, hit.fwd, hit.bwd, interpret, key)
    import_triton()
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    path = _cache_dir() / f"kernel_{key}.py"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        tmp.replace(path)
    mod_name = f"autopar_kernel_{key}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
    wrap: Callable[[Any], Any] = InterpretedFunction if interpret else (
        lambda f: JITFunction(f, do_not_specialize=["SEED"]))  # a fresh seed per call must not recompile
    region = CompiledRegion(p, source, wrap(mod.fwd), wrap(mod.bwd), interpret, key)
    _LOADED[(key, interpret)] = region
    return region


_INTERPRETED: dict[int, Any] = {}


@contextlib.contextmanager
def interpreted_stdlib() -> Iterator[None]:
    """Run the Triton interpreter as if TRITON_INTERPRET=1 had been set before triton was imported.

    torch usually imports triton first, so triton.language's own @jit helpers (tl.sum, tl.rand, ...)
    are compiled-mode functions the interpreter cannot call. For the duration of an interpreted launch
    they are swapped for interpreted copies and triton's interpret knob is on; both are restored after
    (launches are synchronous, and the environment of other processes is never touched)."""
    import numpy as np
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    saved = []
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        for mod in (tl, tl.standard, tl.random):
            for name, value in list(vars(mod).items()):
                if isinstance(value, JITFunction):
                    wrapped = _INTERPRETED.setdefault(id(value), InterpretedFunction(value.fn))
                    saved.append((mod, name, value))
                    setattr(mod, name, wrapped)
        try:
            with np.errstate(all="ignore"):  # masked-off lanes compute on padding (log(0), 0/0): harmless
                yield
        finally:
            for mod, name, value in saved:
                setattr(mod, name, value)
