"""`apply_kernels`: replace the fusible regions of an aten-level fx graph by generated Triton kernels.

Each fused region becomes one call to a `FusedRegion` submodule (outputs picked by getitem); a bias head
(`linear`/`addmm` whose bias starts the region) is split so its matmul stays in torch. At run time a
`FusedRegion` lowers its region at the actual input shapes, generates and caches the kernels, and runs
them through `RegionFunction` (an autograd Function whose backward is the generated backward kernel);
with mode "auto" it does so only for CUDA tensors and otherwise runs its own copy of the region's torch
ops. That copy is also the fallback when a region cannot be lowered at the actual shapes or (mode "auto")
a kernel fails on its first use (e.g. Triton rejects it): the report's notes and a KernelFallbackWarning
naming the region, its ops and the error say so. With mode "triton" a failing kernel is a KernelError.
"""

from __future__ import annotations

import contextlib
import heapq
import operator
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from ..errors import KernelError, KernelFallbackWarning, PlanError
from ..passes.fusion_pricing import KERNEL_MODES, check_mode
from . import triton_gen
from .fusion import Region, find_regions, fused_bytes, lower, meta
from .triton_gen import CompiledRegion, Instr, KernelProgram, Unfusible, interpreted_stdlib


@dataclass
class RegionReport:
    name: str
    kind: str
    ops: list[str]
    nodes: list[str]
    fused: bool
    reason: str
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    bytes_before: int = 0  # forward traffic as separate torch ops (fusion.fused_bytes)
    bytes_after: int = 0
    kernel: str = ""  # file name in the dump directory
    notes: list[str] = field(default_factory=list)  # what happened at run time (fallbacks)
    source: str = field(default="", repr=False)  # the text of `kernel`: header and generated kernels


@dataclass
class KernelReport:
    mode: str
    regions: list[RegionReport]

    @property
    def fused(self) -> list[RegionReport]:
        return [r for r in self.regions if r.fused]

    @property
    def not_fused(self) -> list[RegionReport]:
        return [r for r in self.regions if not r.fused]

    def text(self, prefix: str = "") -> str:
        """One line per region; `prefix` goes before kernel file names (their directory)."""
        lines = [f"kernels mode={self.mode}: {len(self.fused)} region(s) fused, "
                 f"{len(self.not_fused)} left in torch"]
        for r in self.regions:
            ops = ", ".join(o.removeprefix("aten.") for o in r.ops)
            if r.fused:
                lines.append(f"{r.name}: FUSED [{ops}] nodes {r.nodes}; in {r.inputs}; out {r.outputs}; "
                             f"forward bytes {r.bytes_before} -> {r.bytes_after}; {prefix}{r.kernel}")
            else:
                lines.append(f"{r.name}: not fused [{ops}] nodes {r.nodes}: {r.reason}")
            lines += [f"    {note}" for note in r.notes]
        return "\n".join(lines) + "\n"


def _key_name(k: Any) -> str:
    return k.name if isinstance(k, fx.Node) else f"{k[1].name}.matmul"


# ---------------------------------------------------------------------------------------------- running
@dataclass(frozen=True)
class LaunchConfig:
    """How a program's kernels are launched: BLOCK_M rows by BLOCK_N columns per program, `grid` programs."""

    block_m: int
    block_n: int
    grid: int
    num_warps: int


def launch_config(p: KernelProgram, interpret: bool) -> LaunchConfig:
    """The launch of a program's kernels under the interpreter or on CUDA."""
    bn = triton_gen.ROW_BLOCK if triton_gen.row_loop(p) else triton_gen.pow2(p.n) if p.rows else p.n
    tile = 1 << 16 if interpret else 4096  # the interpreter pays per program, a GPU per register
    bm = max(1, min(triton_gen.pow2(p.m), tile // bn))
    return LaunchConfig(bm, bn, -(-p.m // bm), 4 if bm * bn <= 4096 else 8)


def _prep(p: KernelProgram, xs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    out = []
    for i, x in zip(p.inputs, xs, strict=True):
        x = x.expand(p.domain).contiguous() if i.kind == "X" else x.contiguous()
        out.append(x)
    return out


def _launch(kernel: Any, args: list[Any], p: KernelProgram, seed: int, cfg: LaunchConfig, interpret: bool) -> None:
    blocks = {"BLOCK_M": cfg.block_m}
    if interpret or not triton_gen.row_loop(p):  # on CUDA a looping kernel's BLOCK_N is autotuned
        blocks["BLOCK_N"] = cfg.block_n
    periods = [i.period for i in p.inputs if i.kind == "P"]
    with interpreted_stdlib() if interpret else contextlib.nullcontext():
        kernel[(cfg.grid,)](*args, *periods, p.m, p.n, p.numel, seed, **blocks,
                            enable_fp_fusion=triton_gen.FP_FUSION)  # the interpreter drops it


def tuned_config(kernel: Any) -> str:
    """The configuration autotuning chose for a launched kernel ('' under the interpreter)."""
    best = getattr(kernel, "best_config", None)
    if best is None:
        return ""
    return ", ".join([f"{k}={v}" for k, v in best.kwargs.items()] + [f"num_warps={best.num_warps}"])


def _run_host(host: list[Instr], env: dict[str, torch.Tensor]) -> None:
    for ins in host:
        env[ins.out] = triton_gen.HOST[ins.prim](*[env[a] if isinstance(a, str) else a for a in ins.args])


def run_forward(r: CompiledRegion, xs: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], dict]:
    p = r.program
    dev = xs[0].device
    cfg = launch_config(p, r.interpret)
    grid = cfg.grid
    seed = int(torch.randint(0, 2**31 - 1024, ()).item()) if any(i.prim == "rand" for i in p.instrs) else 0
    raw: dict[int, torch.Tensor] = {}
    for k in triton_gen.kernel_outputs(p):
        _, kind, shape, dtype = p.outputs[k]
        raw[k] = (torch.empty(grid, device=dev, dtype=torch.float32) if kind == "S" else
                  torch.empty(grid, p.n, device=dev, dtype=torch.float32) if kind == "CP" else
                  torch.empty(shape, device=dev, dtype=dtype))
    parts = {v: torch.empty(grid, device=dev, dtype=torch.float32) for v in triton_gen.totals(p)}
    args = _prep(p, xs) + list(raw.values()) + list(parts.values())
    _launch(r.fwd, args, p, seed, cfg, r.interpret)
    env = {v: t.sum() for v, t in parts.items()}
    tvals = dict(env)
    _run_host(p.host, env)
    outs = []
    for k, (v, kind, shape, dtype) in enumerate(p.outputs):
        t = env[v] if kind == "T" else raw[k][0] if kind == "S" else raw[k].sum(0) if kind == "CP" else raw[k]
        outs.append(t.reshape(shape).to(dtype))
    return outs, {"seed": seed, "t": tvals}


def run_backward(r: CompiledRegion, xs: tuple[torch.Tensor, ...], state: dict,
                 gouts: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
    p = r.program
    dev = xs[0].device
    cfg = launch_config(p, r.interpret)
    grid = cfg.grid
    gt: dict[str, torch.Tensor] = {}
    if triton_gen.totals(p):  # gradients of the totals through the host ops: torch autograd on a few scalars
        with torch.enable_grad():
            leaves = {v: state["t"][v].detach().requires_grad_(True) for v in triton_gen.totals(p)}
            env: dict[str, torch.Tensor] = dict(leaves)
            _run_host(p.host, env)
            pairs = [(env[v], gouts[k]) for k, (v, kind, _, _) in enumerate(p.outputs)
                     if kind == "T" and gouts[k] is not None and env[v].requires_grad]
            got = torch.autograd.grad([o for o, _ in pairs], list(leaves.values()),
                                      [g.reshape(o.shape).to(o.dtype) for o, g in pairs],
                                      allow_unused=True) if pairs else [None] * len(leaves)
        gt = {v: (g.detach().float() if g is not None else torch.zeros((), device=dev)).reshape(1)
              for v, g in zip(leaves, got, strict=True)}
    go = []
    for k in triton_gen.grad_outputs(p):
        _, _, shape, dtype = p.outputs[k]
        g = gouts[k] if gouts[k] is not None else torch.zeros(shape, device=dev, dtype=dtype)
        go.append(g.contiguous())
    gin_inputs = [i for i in p.inputs if i.dtype.is_floating_point]
    gin = [torch.empty(i.shape, device=dev, dtype=i.dtype) if i.kind in ("E", "R") else
           torch.empty(p.numel, device=dev, dtype=torch.float32) if i.kind in ("P", "X") else
           torch.empty(grid, p.n, device=dev, dtype=torch.float32) if i.kind == "C" else
           torch.empty(grid, device=dev, dtype=torch.float32) for i in gin_inputs]
    args = _prep(p, xs) + go + [gt[v] for v in triton_gen.totals(p)] + gin
    _launch(r.bwd, args, p, state["seed"], cfg, r.interpret)
    by_name = {}
    for i, g in zip(gin_inputs, gin, strict=True):
        if i.kind in ("P", "X"):
            g = g.view(p.domain).sum_to_size(i.shape)
        elif i.kind in ("C", "S"):
            g = g.sum(0)
        by_name[i.name] = g.reshape(i.shape).to(i.dtype)
    return [by_name.get(i.name) for i in p.inputs]


@dataclass(eq=False)
class _Kernels:
    """A region's kernels for one input signature."""

    compiled: CompiledRegion
    order: list[int]  # the region input feeding each kernel input
    owner: FusedRegion
    key: tuple
    ran_fwd: bool = False  # once a kernel has run, a later failure is a real error, not a compile problem
    ran_bwd: bool = False


def _torch_grads(fallback: fx.GraphModule, xs: tuple[torch.Tensor, ...],
                 gouts: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in xs]
        outs = fallback(*leaves)
        pairs = [(o, g) for o, g in zip(outs, gouts, strict=True) if g is not None and o.requires_grad]
        diff = [x for x in leaves if x.requires_grad]
        got = iter(torch.autograd.grad([o for o, _ in pairs], diff, [g for _, g in pairs], allow_unused=True))
    return [next(got) if x.requires_grad else None for x in leaves]


_dense = torch.ops.aten.is_non_overlapping_and_dense.default


def _same_layout(t: torch.Tensor, stride: tuple[int, ...]) -> bool:
    return all(a == b for a, b, s in zip(t.stride(), stride, t.shape, strict=True) if s > 1)


def _restride(t: torch.Tensor, stride: tuple[int, ...] | None) -> torch.Tensor:
    """`t` (written contiguous by a kernel) with the strides the region's torch ops give their output: later
    ops of the graph (a `view` after a transpose) depend on them."""
    if stride is None or _same_layout(t, stride):
        return t
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


class RegionFunction(torch.autograd.Function):
    """Runs a region's forward kernel; backward runs its generated backward kernel."""

    @staticmethod
    def forward(ctx: Any, k: _Kernels, strides: tuple, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs, state = run_forward(k.compiled, tuple(xs[i] for i in k.order))
        outs = [_restride(o, s) for o, s in zip(outs, strides, strict=True)]
        ctx.k, ctx.state = k, state
        ctx.save_for_backward(*xs)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *gouts: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        k, xs = ctx.k, ctx.saved_tensors
        grads: list[torch.Tensor | None] = [None] * len(xs)
        try:
            got = run_backward(k.compiled, tuple(xs[i] for i in k.order), ctx.state, gouts)
            for i, g in zip(k.order, got, strict=True):  # an input read twice (two roles) sums its grads
                grads[i] = g if grads[i] is None or g is None else grads[i] + g
            k.ran_bwd = True
        except Exception as e:
            # recomputing in torch would draw another dropout mask, so a random region cannot fall back
            if k.ran_bwd or any(i.prim == "rand" for i in k.compiled.program.instrs):
                raise
            k.owner.fail(k, "backward", e)
            grads = _torch_grads(k.owner.fallback, xs, gouts)
        return (None, None, *[g if n else None for g, n in zip(grads, ctx.needs_input_grad[2:], strict=True)])


class FusedRegion(nn.Module):
    """One fused region: generated kernels at run time, or its torch ops (`fallback`)."""

    def __init__(self, region: Region, fallback: fx.GraphModule, mode: str, info: RegionReport,
                 dump_dir: Path | None) -> None:
        super().__init__()
        self.fallback = fallback
        self.mode = mode
        self.info = info
        self.dump_dir = dump_dir
        self._members = [n for n in fallback.graph.nodes if n.op == "call_function"]
        self._placeholders = [n for n in fallback.graph.nodes if n.op == "placeholder"]
        self._compiled: dict[tuple, _Kernels | str] = {}
        self._strides: dict[tuple, tuple] = {}
        self._outputs = list(region.outputs)

    def _note(self, text: str) -> None:
        if text not in self.info.notes:
            self.info.notes.append(text)

    def fail(self, k: _Kernels, which: str, e: Exception) -> None:
        """A kernel failed on its first run (e.g. Triton rejected it): with kernels="triton" that is an
        error; otherwise this signature runs in torch, with a KernelFallbackWarning and a report note."""
        ops = ", ".join(o.removeprefix("aten.") for o in self.info.ops)
        err = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        if self.mode == "triton":
            raise KernelError(f"autopar region {self.info.name} ({self.info.kind}: {ops}): the {which} kernel "
                              f"failed on first use: {err}. kernels='triton' forces the generated kernels; "
                              f"kernels='auto' would run the region's torch ops instead.") from e
        text = f"{which} kernel failed on first use, running in torch: {err}"
        self._note(text)
        warnings.warn(f"autopar region {self.info.name} ({self.info.kind}: {ops}): {text}", KernelFallbackWarning,
                      stacklevel=2)
        self._compiled[k.key] = text

    def runs_kernels(self, xs: tuple[torch.Tensor, ...]) -> bool:
        """Whether these inputs go to the generated kernels (mode "triton", or "auto" on CUDA tensors)."""
        return self.mode == "triton" or self.mode == "auto" and any(x.is_cuda for x in xs)

    def compile_for(self, xs: tuple[torch.Tensor, ...]) -> _Kernels | str:
        """Kernels for these inputs (cached by shapes, dtypes, device), or the reason there are none."""
        key = tuple((tuple(x.shape), x.dtype, x.device.type) for x in xs)
        hit = self._compiled.get(key)
        if hit is not None:
            return hit
        try:
            b, program, _, _, _ = lower(self._members, values=dict(zip(self._placeholders, xs, strict=True)))
            src = triton_gen.generate(program, f"{self.info.name} ({self.info.kind})")
            compiled = triton_gen.load(program, src, interpret=xs[0].device.type != "cuda")
            self._write(src, program)
            hit = _Kernels(compiled, [self._placeholders.index(k) for k in b.sources], self, key)
        except Unfusible as e:
            hit = f"runtime fallback to torch for inputs {[k[0] for k in key]}: {e}"
            self._note(hit)
            warnings.warn(f"autopar region {self.info.name} ({self.info.kind}): {hit}", KernelFallbackWarning,
                          stacklevel=3)
        self._compiled[key] = hit
        return hit

    def strides_for(self, xs: tuple[torch.Tensor, ...], k: _Kernels) -> tuple:
        """Per output, the strides the region's torch ops give it for these inputs (their layouts included):
        found by running the torch copy on meta tensors, once per input signature."""
        key = tuple((tuple(x.shape), tuple(x.stride()), x.dtype) for x in xs)
        hit = self._strides.get(key)
        if hit is None:
            try:
                fake = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta") for x in xs]
                outs = [o.stride() if _dense(o) else None for o in self.fallback(*fake)]
            except Exception:  # an op without a meta kernel: the layouts the graph was captured with
                outs = [m.stride() if (m := meta(o)) is not None and tuple(m.shape) == shape else None
                        for o, (_, _, shape, _) in zip(self._outputs, k.compiled.program.outputs, strict=True)]
            hit = self._strides[key] = tuple(tuple(s) if s is not None else None for s in outs)
        return hit

    def _write(self, src: str, program: triton_gen.KernelProgram) -> None:
        text = self.info.source = _kernel_header(self.info, program) + src
        if self.dump_dir is None:
            return
        path = self.dump_dir / self.info.kernel
        if not path.exists() or path.read_text() != text:
            path.write_text(text)

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.runs_kernels(xs):
            return self.fallback(*xs)
        if any(type(x) not in (torch.Tensor, nn.Parameter) for x in xs):  # DTensor, FakeTensor (tracing)
            return self.fallback(*xs)
        if len({x.device for x in xs}) > 1:
            self._note("runtime fallback to torch: inputs on different devices")
            return self.fallback(*xs)
        k = self.compile_for(xs)
        if isinstance(k, str):
            return self.fallback(*xs)
        strides = self.strides_for(xs, k)
        if k.ran_fwd:
            return RegionFunction.apply(k, strides, *xs)
        try:  # the first launch compiles the kernel
            out = RegionFunction.apply(k, strides, *xs)
        except Exception as e:
            self.fail(k, "forward", e)
            return self.fallback(*xs)
        k.ran_fwd = True
        tuned = tuned_config(k.compiled.fwd)
        if tuned:
            self._note(f"forward kernel autotuned for rows of {k.compiled.program.n}: {tuned} "
                       f"(of {triton_gen.tune_configs(k.compiled.program)})")
        return out


def _kernel_header(info: RegionReport, program: triton_gen.KernelProgram) -> str:
    return (f"# region {info.name} ({info.kind}): {', '.join(info.ops)}\n"
            f"# graph nodes {info.nodes}; inputs {info.inputs}; outputs {info.outputs}\n"
            f"# domain {list(program.domain)}; kernel hash "
            f"{triton_gen.source_hash(triton_gen.generate(program))}\n")


def _fallback_module(r: Region) -> fx.GraphModule:
    """The region's own ops as a small graph: inputs in `r.inputs` order, outputs in `r.outputs` order."""
    g = fx.Graph()
    env: dict[Any, fx.Node] = {}
    for i, k in enumerate(r.inputs):
        env[k] = g.placeholder(f"in{i}_{_key_name(k).replace('.', '_')}")
        m = meta(k) if isinstance(k, fx.Node) else meta(k[1])
        if m is not None:
            env[k].meta["val"] = m
    for n in r.nodes:
        if n in r.heads:
            bias = n.args[2] if str(n.target) == "aten.linear.default" else n.args[0]
            new = g.call_function(torch.ops.aten.add.Tensor, (env[("mm", n)], env[bias]))
            new.meta = dict(n.meta)
        else:
            new = g.node_copy(n, lambda a: env[a])
        env[n] = new
    g.output(tuple(env[o] for o in r.outputs))
    return fx.GraphModule(nn.Module(), g, class_name=f"Region_{r.name}")


def _copy_attr(src: nn.Module, dst: nn.Module, target: str) -> None:
    *prefix, name = target.split(".")
    for item in prefix:
        nxt = getattr(dst, item, None)
        if nxt is None:
            nxt = nn.Module()
            setattr(dst, item, nxt)
        src, dst = getattr(src, item), nxt
    value = getattr(src, name)
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        dst.register_buffer(name, value)
    else:
        setattr(dst, name, value)


def _rewrite(gm: fx.GraphModule, regions: list[Region], modules: dict[str, FusedRegion]) -> fx.GraphModule:
    fused = [r for r in regions if r.fused]
    owner = {n: r for r in fused for n in r.nodes}
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    items: list[Any] = list(dict.fromkeys(owner.get(n, n) for n in nodes))
    first = {it: index[it.nodes[0] if isinstance(it, Region) else it] for it in items}
    item_of = lambda n: owner.get(n, n)

    def deps(it: Any) -> set:
        srcs = [a for m in it.nodes for a in m.all_input_nodes] if isinstance(it, Region) \
            else it.all_input_nodes
        return {item_of(a) for a in srcs} - {it}

    # topological order of nodes and regions, as close to the original order as possible
    waiting = {id(it): len(deps(it)) for it in items}
    users: dict[int, list[Any]] = {}
    for it in items:
        for d in deps(it):
            users.setdefault(id(d), []).append(it)
    heap = [(first[it], id(it), it) for it in items if waiting[id(it)] == 0]
    heapq.heapify(heap)
    ordered = []
    while heap:
        _, _, it = heapq.heappop(heap)
        ordered.append(it)
        for u in users.get(id(it), []):
            waiting[id(u)] -= 1
            if waiting[id(u)] == 0:
                heapq.heappush(heap, (first[u], id(u), u))
    assert len(ordered) == len(items), "fused regions made the graph cyclic"
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    root = nn.Module()
    for it in ordered:
        if isinstance(it, Region):
            mm = {}
            for h in it.heads:
                target = torch.ops.aten.linear.default if str(h.target) == "aten.linear.default" \
                    else torch.ops.aten.mm.default
                operands = h.args[:2] if target is torch.ops.aten.linear.default else h.args[1:3]
                mm[h] = g.call_function(target, tuple(env[a] for a in operands))
                mm[h].meta["val"] = h.meta.get("val")
            args = tuple(env[k] if isinstance(k, fx.Node) else mm[k[1]] for k in it.inputs)
            call = g.call_module(f"fused_{it.name}", args)
            for i, o in enumerate(it.outputs):
                env[o] = g.call_function(operator.getitem, (call, i))
                env[o].meta = dict(o.meta)
            continue
        n = it
        if any(a not in env for a in n.all_input_nodes):
            continue  # an assert on a value that now lives inside a kernel
        env[n] = g.node_copy(n, lambda a: env[a])
        if n.op in ("get_attr", "call_module"):
            _copy_attr(gm, root, str(n.target))
    for name, mod in modules.items():
        root.add_module(name, mod)
    g.lint()
    return fx.GraphModule(root, g, class_name=type(gm).__name__)


def _annotate(gm: fx.GraphModule, example_inputs: tuple | list) -> None:
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function"):
        for n, x in zip(phs, example_inputs, strict=False):
            if isinstance(x, torch.Tensor) and "val" not in n.meta:
                n.meta["val"] = torch.empty(x.shape, dtype=x.dtype, device="meta")
    else:
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        FakeTensorProp(gm).propagate(*example_inputs)


def apply_kernels(gm: fx.GraphModule, mode: str = "auto", dump_dir: str | os.PathLike | None = None, *,
                  example_inputs: tuple | list | None = None) -> tuple[fx.GraphModule, KernelReport]:
    """Replace the fusible regions of `gm` by generated kernels; returns the new module (`gm` itself when
    nothing is fused) and a report listing every candidate region, fused or not and why.

    mode "auto": Triton kernels for CUDA tensors, the region's torch ops on CPU; "triton": Triton always
    (the Triton interpreter on CPU, slow: for tests); "torch": `gm` unchanged. `dump_dir` receives
    regions.txt and kernel_<region>.py per fused region. `example_inputs` (optional) give placeholders
    their shapes when the graph has none (stage programs), so kernels are generated for the right
    input kinds up front; without them that happens at the first call. It records shapes in `gm`'s
    node metadata.
    """
    check_mode(mode)
    if mode == "triton" and not triton_gen.triton_available():
        raise PlanError("kernels mode 'triton' needs the triton package: pip install 'autopar[kernels]'.")
    if example_inputs is not None:
        _annotate(gm, example_inputs)
    regions = find_regions(gm)
    no_triton = mode == "auto" and not triton_gen.triton_available()
    infos, modules = [], {}
    dump = Path(dump_dir) if dump_dir is not None else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
    for r in regions:
        if r.fused and mode == "torch":
            r.fused, r.reason = False, "kernels mode 'torch'"
        elif r.fused and no_triton:
            r.fused, r.reason = False, "triton is not installed"
        before, after = fused_bytes(r) if r.fused else (0, 0)
        info = RegionReport(r.name, r.kind, r.ops, [n.name for n in r.nodes], r.fused, r.reason,
                            [_key_name(k) for k in r.inputs], [o.name for o in r.outputs], before, after,
                            f"kernel_{r.name}.py" if r.fused else "")
        infos.append(info)
        if r.fused:
            modules[f"fused_{r.name}"] = FusedRegion(r, _fallback_module(r), mode, info, dump)
            if r.program is not None:
                note = "# input kinds guessed (no shapes for some inputs); rewritten at the first call\n" \
                    if r.guessed else ""
                info.source = _kernel_header(info, r.program) + note + triton_gen.generate(
                    r.program, f"{r.name} ({r.kind})")
    report = KernelReport(mode, infos)
    new = gm if mode == "torch" or not modules else _rewrite(gm, regions, modules)
    if dump is not None:
        write_kernels(report, dump)
    return new, report


def write_kernels(report: KernelReport, directory: str | os.PathLike) -> Path:
    """Write regions.txt and every fused region's kernel file (as `report.text()` names them) there."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for r in report.fused:
        if r.source:
            (d / r.kernel).write_text(r.source)
    (d / "regions.txt").write_text(report.text())
    return d


__all__ = ["apply_kernels", "write_kernels", "KernelReport", "RegionReport", "FusedRegion", "KERNEL_MODES"]
