"""Compile generated kernels ahead of time for CUDA targets, on a machine without a GPU.

`triton.compile` runs the whole NVIDIA pipeline (TTIR, TTGIR, LLVM IR, PTX, and the cubin through the
ptxas that ships in the triton wheel) for a `GPUTarget` without touching a driver, so a kernel that
Triton or ptxas would reject on a GPU is rejected here too, and ptxas's resource report (registers per
thread, spill stores, stack frame) says whether it would crawl. `compile_for_target` builds a region's
forward and backward kernel with the block sizes and warps the runtime would launch on CUDA
(`kernels.launch_config`); `KernelBuild.text` is one report line.

The interpreter (TRITON_INTERPRET=1 at triton's import) turns triton.language's own @jit helpers into
interpreted functions; for the duration of a build they are swapped for compiled copies (the inverse of
`triton_gen.interpreted_stdlib`), so this works in a process that also runs interpreted kernels.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import triton_gen
from .triton_gen import KernelProgram

# (compute capability, why it is checked): Hopper (H100/H200), Ampere (A100), Volta (V100)
DEFAULT_TARGETS = (90, 80, 70)
_TL_PTR = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
           torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
           torch.bool: "i1"}


@dataclass(frozen=True)
class KernelBuild:
    """One kernel compiled for one CUDA target: whether it built, and ptxas's resource report."""

    name: str  # region (or program title) and fwd / bwd
    arch: int  # compute capability, e.g. 90
    block_m: int
    block_n: int
    num_warps: int
    ok: bool
    error: str = ""
    n_regs: int = 0  # registers per thread
    spill_stores: int = 0  # bytes of register spill stores per thread (local memory traffic)
    spill_loads: int = 0
    stack: int = 0  # bytes of stack frame per thread
    shared: int = 0  # bytes of shared memory Triton allocates (reduction scratch)

    def text(self) -> str:
        head = (f"{self.name} sm_{self.arch} BLOCK_M={self.block_m} BLOCK_N={self.block_n} "
                f"num_warps={self.num_warps}: ")
        if not self.ok:
            return head + f"FAILED: {self.error}"
        return head + (f"{self.n_regs} registers, {self.spill_stores} bytes spill stores, "
                       f"{self.spill_loads} bytes spill loads, {self.stack} bytes stack, {self.shared} bytes shared")


@contextlib.contextmanager
def compiled_stdlib() -> Iterator[None]:
    """triton.language's @jit helpers as compiled functions and the interpret knob off, for one build."""
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    saved = []
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        for mod in (tl, tl.standard, tl.random, tl.math):
            for name, value in list(vars(mod).items()):
                if isinstance(value, InterpretedFunction):
                    saved.append((mod, name, value))
                    setattr(mod, name, JITFunction(value.fn))
        try:
            yield
        finally:
            for mod, name, value in saved:
                setattr(mod, name, value)


def _ptr(dtype: torch.dtype) -> str:
    return "*" + _TL_PTR[dtype]


def signature(p: KernelProgram, which: str, arg_names: list[str]) -> dict[str, str]:
    """Triton argument types of a program's `fwd` or `bwd` kernel, as kernels.run_forward / run_backward
    allocate and pass them (partials and gradients of broadcast inputs in fp32)."""
    inputs = {f"in_{i.name}": i for i in p.inputs}
    sig: dict[str, str] = {}
    for a in arg_names:
        if a in ("BLOCK_M", "BLOCK_N"):
            sig[a] = "constexpr"
        elif a in inputs:
            sig[a] = _ptr(inputs[a].dtype)
        elif a.startswith(("out_", "gout_")):
            _, kind, _, dtype = p.outputs[int(a.split("_")[1])]
            sig[a] = "*fp32" if which == "fwd" and kind in ("S", "CP") else _ptr(dtype)
        elif a.startswith(("tp_", "gt_")):
            sig[a] = "*fp32"
        elif a.startswith("gin_"):
            i = inputs["in_" + a.removeprefix("gin_")]
            sig[a] = _ptr(i.dtype) if i.kind in ("E", "R") else "*fp32"
        else:  # M, N, NUMEL, SEED, periods
            sig[a] = "i32"
    return sig


_PTXAS = {"regs": re.compile(r"Used (\d+) registers"), "stores": re.compile(r"(\d+) bytes spill stores"),
          "loads": re.compile(r"(\d+) bytes spill loads"), "stack": re.compile(r"(\d+) bytes stack frame")}


def _ptxas_report(ptx: str, arch: int) -> dict[str, int]:
    """ptxas -v on the kernel's PTX: Triton deletes its own ptxas log, and a cached build has none."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run([get_ptxas(arch).path, "-v", "--regAllocOptLevel=2",
                              f"--gpu-name={sm_arch_from_capability(arch)}", str(src), "-o", str(Path(d) / "k.o")],
                             capture_output=True, text=True, check=True)
    log = run.stdout + run.stderr
    return {k: int(m.group(1)) if (m := r.search(log)) else 0 for k, r in _PTXAS.items()}


def compile_program(p: KernelProgram, arch: int = 90, name: str = "kernel", *, which: tuple[str, ...] = ("fwd", "bwd"),
                    num_warps: int | None = None, block: tuple[int, int] | None = None) -> list[KernelBuild]:
    """Compile a program's kernels for CUDA compute capability `arch` in every configuration autotuning may
    launch on CUDA (or the one `num_warps` / `block` = (BLOCK_M, BLOCK_N) give); one KernelBuild each."""
    from .kernels import launch_config

    triton_gen.import_triton()
    src = triton_gen.generate(p, name)
    compiled = triton_gen.load(p, src, interpret=False)
    cfg = launch_config(p, interpret=False)
    if block is not None or num_warps is not None:
        bm, bn = block or (cfg.block_m, cfg.block_n)
        configs = [(bm, bn, num_warps or cfg.num_warps)]
    else:  # every configuration autotuning may pick
        configs = [(cfg.block_m, c.get("BLOCK_N", cfg.block_n), c["num_warps"]) for c in triton_gen.tune_configs(p)]
    return [_build(p, compiled.fwd if w == "fwd" else compiled.bwd, w, arch, name, bm, bn, warps)
            for w in which for bm, bn, warps in configs]


def _build(p: KernelProgram, fn: Any, w: str, arch: int, name: str, bm: int, bn: int, warps: int) -> KernelBuild:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.autotuner import Autotuner

    fn = fn.fn if isinstance(fn, Autotuner) else fn
    label = f"{name} {w}"
    try:
        with compiled_stdlib():
            ast = triton.compiler.ASTSource(fn=fn, signature=signature(p, w, list(fn.arg_names)),
                                            constexprs={"BLOCK_M": bm, "BLOCK_N": bn})
            options = {"num_warps": warps, "enable_fp_fusion": triton_gen.FP_FUSION}
            k = triton.compile(ast, target=GPUTarget("cuda", arch, 32), options=options)
        res = _ptxas_report(k.asm["ptx"], arch)
    except Exception as e:  # the build failing is the finding
        msg = " ".join(str(e).split())[:400]
        return KernelBuild(label, arch, bm, bn, warps, False, f"{type(e).__name__}: {msg}")
    return KernelBuild(label, arch, bm, bn, warps, True, "", res["regs"], res["stores"], res["loads"], res["stack"],
                       int(getattr(k.metadata, "shared", 0)))


def compile_for_target(kernel: Any, targets: tuple[int, ...] | int = DEFAULT_TARGETS, **kw: Any) -> list[KernelBuild]:
    """AOT-compile a region's kernels for CUDA targets (compute capabilities) without a GPU.

    `kernel` is a `KernelProgram`, a `fusion.Region` (its program at the graph's shapes) or a
    `kernels.KernelReport` (every fused region of it that has a program); keyword arguments go to
    `compile_program`."""
    from .fusion import Region
    from .kernels import KernelReport

    archs = (targets,) if isinstance(targets, int) else tuple(targets)
    title = kw.pop("name", None)
    if isinstance(kernel, KernelReport):
        items = [(r.name, r.program) for r in kernel.fused if r.program is not None]
    elif isinstance(kernel, Region):
        items = [(title or kernel.name, kernel.program)] if kernel.program is not None else []
    else:
        items = [(title or "kernel", kernel)]
    return [b for name, p in items for arch in archs for b in compile_program(p, arch, name, **kw)]


__all__ = ["KernelBuild", "compile_for_target", "compile_program", "compiled_stdlib", "signature",
           "DEFAULT_TARGETS"]
