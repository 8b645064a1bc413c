"""Triton code generation for fused regions: a tiny kernel IR, forward and backward codegen, a kernel cache.

A region (see fusion.py) is lowered into a `KernelProgram`: straight-line instructions over *prims* (add, exp,
row sum, ...). Every prim has a `tl` expression and a vector-Jacobian rule in `PRIMS`; the forward kernel
evaluates the program and the backward kernel recomputes it and runs reverse-mode AD over it, so both
kernels come from the graph's ops, not from hand-written per-op kernels.

Layout: a region works on its domain viewed as [M, N] row-major (N = last dim). One program owns
BLOCK_M rows and, up to ROW_BLOCK elements, the whole row (BLOCK_N >= N), so row reductions (norms,
softmax, cross-entropy) stay in registers; longer rows loop over column blocks in passes (`schedule`).
Pure elementwise regions use a virtual row of 1024 elements. Value classes in a kernel:
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

VIRTUAL_ROW = 1024
# Triton's floating-point fusion (a * b + c contracted to one FMA, rounded once) for every kernel built, said
# explicitly: Triton 3.9 defaults it on and warns that 3.10 turns it off, which would change the generated
# kernels' rounding with a pip upgrade, unasked. On is what these kernels were built and checked with; eager
# CUDA kernels (nvcc's default --fmad=true) contract within each kernel too.
FP_FUSION = True


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
class KernelProgram:
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
    """Builds a KernelProgram from a region's ops; expansions in fusion.py call `input` and `op`."""

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

    def finish(self, outputs: list[tuple[Any, tuple[int, ...], torch.dtype]]) -> KernelProgram:
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
        return KernelProgram(self.domain, self.inputs, self.instrs, self.host, outs, self.cls, self.dt, rows)


# ---------------------------------------------------------------------------------------------- codegen
_MASK = {"E": "mask", "R": "rmask", "C": "cmask"}


def _fmt(a: Any) -> str:
    if isinstance(a, (str, bool)):
        return str(a)
    if isinstance(a, float) and (a != a or a in (float("inf"), float("-inf"))):
        return f'float("{a}")'
    return repr(float(a)) if isinstance(a, float) else repr(int(a))


def _args(ins: Instr, p: KernelProgram) -> list[str]:
    """Arguments as code; bool/int values feeding float arithmetic are cast to float32 first."""
    out = []
    for k, x in enumerate(ins.args):
        s = _fmt(x)
        promote = p.dt[ins.out] == "f" and ins.prim not in COMPARE and not (ins.prim == "where" and k == 0)
        if isinstance(x, str) and promote and p.dt[x] != "f":
            s = f"{s}.to(tl.float32)"
        out.append(s)
    return out


def _expr(ins: Instr, p: KernelProgram) -> str:
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


def _vjp(ins: Instr, g: str, p: KernelProgram) -> list[tuple[int, str, str]]:
    """(arg index, contribution expression, its class) for each differentiable argument."""
    a = _args(ins, p)
    o = ins.out
    if ins.prim in ("rsum", "tsum", "csum"):
        return [(0, g, {"rsum": "R", "tsum": "S", "csum": "C"}[ins.prim])]
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


@dataclass(frozen=True)
class Stmt:
    """One line of a kernel body. `name` None is a store. `red` is a reduction across the whole row:
    "rsum"/"rmax" of `arg` to a per-row value, "ssum" of `arg` to the program's scalar."""

    name: str | None
    cls: str  # E, C: vary along the row (recomputed per column block when rows loop); R, S: do not
    expr: str = ""
    red: str = ""
    arg: str = ""


_VARYING = {"E", "C"}
_IDENT = re.compile(r"\b[A-Za-z_]\w*\b")


class _Body:
    """Statements of one kernel, with fresh temporaries for reductions split out of expressions."""

    def __init__(self) -> None:
        self.stmts: list[Stmt] = []
        self.cls: dict[str, str] = {}
        self._n = 0

    def add(self, name: str | None, cls: str, expr: str = "", red: str = "", arg: str = "") -> str:
        self.stmts.append(Stmt(name, cls, expr, red, arg))
        if name is not None:
            self.cls[name] = cls
        return name or ""

    def temp(self, cls: str, expr: str = "", red: str = "", arg: str = "") -> str:
        self._n += 1
        return self.add(f"t{self._n}", cls, expr, red, arg)

    def reduce_to(self, expr: str, src: str, dst: str) -> str:
        """`expr` (of class `src`) broadcast or summed to class `dst`; sums over the row become statements."""
        if src == dst:
            return expr
        if (src, dst) in (("S", "E"), ("S", "R"), ("S", "C"), ("R", "E"), ("C", "E")):
            shape = {"E": "[BLOCK_M, BLOCK_N]", "R": "[BLOCK_M, 1]", "C": "[1, BLOCK_N]"}[dst]
            return f"({expr} + tl.zeros({shape}, tl.float32))"
        if dst == "S" and src == "R":
            return self.temp("S", f"tl.sum(tl.where(rmask, {expr}, 0.0))")
        if dst == "C":  # over the rows of this program: within one column block
            return self.temp("C", f"tl.sum(tl.where(mask, {expr}, 0.0), axis=0, keep_dims=True)")
        arg = self.temp(src, expr)
        return self.temp(dst, red="rsum" if dst == "R" else "ssum", arg=arg)


def _deps(st: Stmt, defined: set[str]) -> set[str]:
    return {t for t in _IDENT.findall(f"{st.expr} {st.arg}") if t in defined}


def _red_line(st: Stmt) -> str:
    """A row sum or max over one block (the whole row, or one column block when rows loop)."""
    if st.red == "rmax":
        return f'tl.max(tl.where(mask, {st.arg}, -float("inf")), axis=1, keep_dims=True)'
    return f"tl.sum(tl.where(mask, {st.arg}, 0.0), axis=1, keep_dims=True)"


def _live(stmts: list[Stmt]) -> list[Stmt]:
    """Statements a store depends on, in order."""
    defined = {st.name for st in stmts if st.name is not None}
    need: set[str] = set()
    out = []
    for st in reversed(stmts):
        if st.name is None or st.name in need:
            need |= _deps(st, defined)
            out.append(st)
    return out[::-1]


def _one_block(stmts: list[Stmt], cls: dict[str, str]) -> list[str]:
    lines = []
    for st in stmts:
        if st.name is None:
            lines.append(f"    {st.expr}")
        elif st.red == "ssum":
            lines.append(f"    {st.name} = tl.sum(tl.where({_MASK[cls[st.arg]]}, {st.arg}, 0.0))")
        elif st.red:
            lines.append(f"    {st.name} = {_red_line(st)}")
        else:
            lines.append(f"    {st.name} = {st.expr}")
    return lines


def schedule(stmts: list[Stmt]) -> list[list[Stmt]]:
    """Split a kernel body into passes over the row's column blocks when a row does not fit one block.

    A value that varies along the row and depends on row reductions finished in pass k is computed
    in pass k (or later); a reduction of it ends in pass k. So pass k computes, per column block, the
    varying statements the reductions and stores of pass k need (recomputing from the inputs rather
    than keeping the row), and the per-row values between passes follow from the finished sums. The
    result is passes[k] = the varying statements of loop k (with its reductions and stores); the
    per-row statements are placed by `row_groups`."""
    live = _live(stmts)
    defined = {st.name for st in live if st.name is not None}
    lvl: dict[str, int] = {}
    at: list[tuple[Stmt, int]] = []
    for st in live:
        d = max((lvl[x] for x in _deps(st, defined)), default=0)
        if st.red:
            at.append((st, d))
            lvl[st.name or ""] = d + 1
        else:
            if st.name is not None:
                lvl[st.name] = d
            if st.name is None and st.cls in _VARYING:
                at.append((st, d))
    n = 1 + max((k for _, k in at), default=-1)
    by_name = {st.name: st for st in live if st.name is not None}
    passes: list[list[Stmt]] = []
    for k in range(n):
        roots = [st for st, j in at if j == k]
        need: set[str] = set()
        stack = [x for st in roots for x in _deps(st, defined)]
        while stack:
            x = stack.pop()
            sx = by_name[x]
            if x in need or sx.red or sx.cls not in _VARYING:
                continue
            need.add(x)
            stack += _deps(sx, defined)
        passes.append([st for st in live if st.name in need or any(st is r for r in roots)])
    return passes


def _row_level(stmts: list[Stmt]) -> list[tuple[Stmt, int]]:
    """The per-row statements (loads, arithmetic, stores of R/S values) and the pass they follow."""
    live = _live(stmts)
    defined = {st.name for st in live if st.name is not None}
    lvl: dict[str, int] = {}
    out = []
    for st in live:
        d = max((lvl[x] for x in _deps(st, defined)), default=0)
        if st.red:
            lvl[st.name or ""] = d + 1
            continue
        if st.name is not None:
            lvl[st.name] = d
        if st.cls not in _VARYING:
            out.append((st, d))
    return out


_COLS = ["cols = c0 + tl.arange(0, BLOCK_N)[None, :]", "offs = rows * N + cols", "cmask = cols < N",
         "mask = rmask & cmask & (offs < NUMEL)"]


def _looped(stmts: list[Stmt], cls: dict[str, str]) -> list[str]:
    passes = schedule(stmts)
    rows = _row_level(stmts)
    stores = [st for st, _ in rows if st.name is None]
    lines: list[str] = []

    def row_stmts(k: int) -> None:
        lines.extend(f"    {st.name} = {st.expr}" for st, j in rows if j == k and st.name is not None)

    for k, body in enumerate(passes):
        row_stmts(k)
        reds = [st for st in body if st.red]
        for st in reds:
            acc = "[1, 1]" if st.red == "ssum" and cls[st.arg] == "C" else "[BLOCK_M, 1]"
            init = f'tl.full({acc}, -float("inf"), tl.float32)' if st.red == "rmax" else f"tl.zeros({acc}, tl.float32)"
            lines.append(f"    acc_{st.name} = {init}")
        lines.append("    for c0 in range(0, N, BLOCK_N):")
        lines += [f"        {c}" for c in _COLS]
        for st in body:
            if st.name is None:
                lines.append(f"        {st.expr}")
            elif st.red == "rmax":
                lines.append(f"        acc_{st.name} = tl.maximum(acc_{st.name}, {_red_line(st)})")
            elif st.red:
                m = _MASK[cls[st.arg]] if st.red == "ssum" else "mask"
                lines.append(f"        acc_{st.name} = acc_{st.name} + "
                             f"tl.sum(tl.where({m}, {st.arg}, 0.0), axis=1, keep_dims=True)")
            else:
                lines.append(f"        {st.name} = {st.expr}")
        for st in reds:
            lines.append(f"    {st.name} = " + (f"tl.sum(acc_{st.name})" if st.red == "ssum" else f"acc_{st.name}"))
    row_stmts(len(passes))
    lines += [f"    {st.expr}" for st in stores]
    return lines


ROW_BLOCK = 8192  # longest row one program keeps in registers; longer rows loop over column blocks


def tune_configs(p: KernelProgram) -> list[dict[str, int]]:
    """The configurations `triton.autotune` times on CUDA (keyed on the row length N), the first being the
    default: num_warps, and for looping rows the column block BLOCK_N too (a one-block kernel's BLOCK_N
    is the row, and BLOCK_M fixes the grid and its partial buffers, so neither is tuned there)."""
    if row_loop(p):
        return [{"BLOCK_N": bn, "num_warps": w} for bn in (ROW_BLOCK, ROW_BLOCK // 2) for w in (8, 16)]
    return [{"num_warps": w} for w in (4, 8)]


def row_loop(p: KernelProgram) -> bool:
    """Whether a program's kernels loop over column blocks of ROW_BLOCK (rows longer than that)."""
    return p.rows and pow2(p.n) > ROW_BLOCK


def _emit(p: KernelProgram, name: str, args: list[str], body: _Body) -> list[str]:
    if not row_loop(p):
        return _header(name, args) + _one_block(_live(body.stmts), body.cls)
    return _header(name, args)[:4] + ["    rmask = rows < M"] + _looped(body.stmts, body.cls)


def _load(i: Input, ptr: str) -> str:
    cast = ".to(tl.float32)" if i.dtype.is_floating_point else ""
    other = "0.0" if i.dtype.is_floating_point else "0"
    if i.kind == "S":
        return f"tl.load({ptr}){cast}"
    where, m = {"E": ("offs", "mask"), "X": ("offs", "mask"), "P": (f"offs % P_{i.name}", "mask"),
                "C": ("cols", "cmask"), "R": ("rows", "rmask")}[i.kind]
    return f"tl.load({ptr} + {where}, mask={m}, other={other}){cast}"


_LOAD_CLS = {"E": "E", "X": "E", "P": "E", "C": "C", "R": "R", "S": "S"}


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


def _store(b: _Body, kind: str, ptr: str, v: str, cls: str) -> None:
    cls = {"CP": "C", "T": "S"}.get(cls, cls)  # already reduced inside this program
    if kind in ("E", "X"):
        b.add(None, "E", f"tl.store({ptr} + offs, {b.reduce_to(v, cls, 'E')}, mask=mask)")
    elif kind == "R":
        b.add(None, "R", f"tl.store({ptr} + rows, {b.reduce_to(v, cls, 'R')}, mask=rmask)")
    elif kind in ("C", "CP"):  # per-program column partials
        b.add(None, "C", f"tl.store({ptr} + pid * N + cols, {b.reduce_to(v, cls, 'C')}, mask=cmask)")
    else:  # per-program partial (or a scalar)
        b.add(None, "S", f"tl.store({ptr} + pid, {b.reduce_to(v, cls, 'S')})")


def _period_args(p: KernelProgram) -> list[str]:
    return [f"P_{i.name}" for i in p.inputs if i.kind == "P"]


def kernel_outputs(p: KernelProgram) -> list[int]:
    """Indices of the outputs the forward kernel writes (totals come from `totals` and host ops)."""
    return [k for k, (_, kind, _, _) in enumerate(p.outputs) if kind != "T"]


def totals(p: KernelProgram) -> list[str]:
    return [ins.out for ins in p.instrs if ins.prim == "tsum"]


def grad_outputs(p: KernelProgram) -> list[int]:
    """Kernel-written float outputs, whose gradients the backward kernel reads."""
    return [k for k in kernel_outputs(p)
            if p.outputs[k][3].is_floating_point and p.dt[p.outputs[k][0]] == "f"]


def _instr(b: _Body, ins: Instr, p: KernelProgram) -> None:
    cls = {"T": "S", "CP": "C"}.get(p.cls[ins.out], p.cls[ins.out])
    a0 = ins.args[0] if ins.args else None
    if ins.prim in ("rsum", "rmax"):
        b.add(ins.out, "R", red=ins.prim, arg=a0)
    elif ins.prim == "tsum" and p.cls[a0] in _VARYING:
        b.add(ins.out, "S", red="ssum", arg=a0)
    else:
        b.add(ins.out, cls, _expr(ins, p))


def _forward_body(p: KernelProgram) -> _Body:
    b = _Body()
    for i in p.inputs:
        b.add(i.name, _LOAD_CLS[i.kind], _load(i, f"in_{i.name}"))
    for ins in p.instrs:
        _instr(b, ins, p)
    for k in kernel_outputs(p):
        v, kind, _, _ = p.outputs[k]
        _store(b, kind, f"out_{k}", v, p.cls[v])
    for v in totals(p):
        _store(b, "T", f"tp_{v}", v, "S")
    return b


def generate(p: KernelProgram, title: str = "") -> str:
    """Python source of the forward kernel `fwd` and the backward kernel `bwd` of a program."""
    kinds = [(i.kind, str(i.dtype).removeprefix("torch.")) for i in p.inputs]
    layout = "flat" if not p.rows else f"rows looped in blocks of {ROW_BLOCK}" if row_loop(p) else "rows"
    lines = [f"# generated by autopar.codegen.triton_gen{': ' + title if title else ''}",
             f"# {layout} layout; inputs (kind, dtype): {kinds}",
             "import triton.language as tl", "", ""]
    outs = kernel_outputs(p)
    lines += _emit(p, "fwd", [f"in_{i.name}" for i in p.inputs] + [f"out_{k}" for k in outs]
                   + [f"tp_{v}" for v in totals(p)] + _period_args(p), _forward_body(p))
    lines += ["", ""] + _backward(p)
    return "\n".join(lines) + "\n"


def _backward_body(p: KernelProgram) -> _Body:
    b = _Body()
    grads: dict[str, str] = {}
    gcls: dict[str, str] = {}
    count = [0]

    def add(v: str, expr: str, cls: str) -> None:
        target = {"T": "S", "CP": "C"}.get(p.cls[v], p.cls[v])
        e = b.reduce_to(expr, cls, target)
        count[0] += 1
        name = f"g{count[0]}_{v}"
        b.add(name, target, f"{grads[v]} + {e}" if v in grads else e)
        grads[v], gcls[v] = name, target

    for i in p.inputs:
        b.add(i.name, _LOAD_CLS[i.kind], _load(i, f"in_{i.name}"))
    for ins in p.instrs:
        if ins.prim not in ("tsum", "csum"):
            _instr(b, ins, p)
    for k in grad_outputs(p):
        v, kind, _, _ = p.outputs[k]
        where, m, cls = {"E": ("offs", "mask", "E"), "R": ("rows", "rmask", "R"),
                         "CP": ("cols", "cmask", "C"), "S": ("", "", "S")}[kind]
        load = f"tl.load(gout_{k} + {where}, mask={m}, other=0.0)" if where else f"tl.load(gout_{k})"
        add(v, b.add(f"go_{k}", cls, f"{load}.to(tl.float32)"), cls)
    for v in totals(p):
        add(v, b.add(f"go_{v}", "S", f"tl.load(gt_{v}).to(tl.float32)"), "S")
    for ins in reversed(p.instrs):
        if ins.out not in grads or p.dt[ins.out] != "f":
            continue
        if ins.prim == "rmax":  # ties share the gradient, as torch.amax's backward does
            x, o = _args(ins, p)[0], ins.out
            hit = b.temp("E", f"tl.where({x} == {o}, 1.0, 0.0)")
            cnt = b.temp("R", red="rsum", arg=hit)
            contrib = [(0, f"tl.where({x} == {o}, {grads[o]} / {cnt}, 0.0)", "E")]
        else:
            contrib = _vjp(ins, grads[ins.out], p)
        for idx, expr, cls in contrib:
            arg = ins.args[idx]
            if isinstance(arg, str) and p.dt[arg] == "f":
                add(arg, expr, cls)
    for i in p.inputs:
        if i.dtype.is_floating_point:
            kind = {"P": "E", "X": "E"}.get(i.kind, i.kind)
            _store(b, kind, f"gin_{i.name}", grads.get(i.name, "0.0"), gcls.get(i.name, "S"))
    return b


def _backward(p: KernelProgram) -> list[str]:
    gin = [i for i in p.inputs if i.dtype.is_floating_point]
    args = ([f"in_{i.name}" for i in p.inputs] + [f"gout_{k}" for k in grad_outputs(p)]
            + [f"gt_{v}" for v in totals(p)] + [f"gin_{i.name}" for i in gin] + _period_args(p))
    return _emit(p, "bwd", args, _backward_body(p))


def input_reads(p: KernelProgram, which: str = "fwd") -> dict[str, int]:
    """How many times the `fwd` or `bwd` kernel reads each input (by value name) and, for `bwd`, each
    output gradient (`go_<k>`): once, or once per pass over the column blocks when rows loop."""
    b = _forward_body(p) if which == "fwd" else _backward_body(p)
    names = {i.name for i in p.inputs} | {f"go_{k}" for k in grad_outputs(p)}
    reads = {st.name: 1 for st in _live(b.stmts) if st.name in names}
    if row_loop(p):
        for name in reads:
            n = sum(any(st.name == name for st in body) for body in schedule(b.stmts))
            reads[name] = max(1, n)
    return reads


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

    program: KernelProgram
    source: str
    fwd: Any
    bwd: Any
    interpret: bool
    key: str = ""


_LOADED: dict[tuple[str, bool], CompiledRegion] = {}


def import_triton() -> None:
    """Import triton (optional, so only once a kernel is needed). Without CUDA it can only interpret: every
    interpreted launch runs under `interpreted_stdlib`, which turns triton's interpret knob on and swaps
    triton.language's @jit helpers for interpreted copies, so no TRITON_INTERPRET=1 is needed before the import
    (and none is set in this process's environment, which its subprocesses would inherit)."""
    import triton  # noqa: F401


def load(p: KernelProgram, source: str, interpret: bool) -> CompiledRegion:
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
    def compiled(f: Any) -> Any:
        import triton

        configs = [triton.Config({k: v for k, v in c.items() if k != "num_warps"}, num_warps=c["num_warps"])
                   for c in tune_configs(p)]
        # a fresh seed per call must not recompile; the row length keys the tuning
        return triton.autotune(configs=configs, key=["N"])(JITFunction(f, do_not_specialize=["SEED"]))

    wrap: Callable[[Any], Any] = InterpretedFunction if interpret else compiled
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
