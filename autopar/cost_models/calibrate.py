"""Calibration: time a sweep of ops on the local device and fit `compute.Profile` curves to it.

Ops are timed the way training runs them: out-of-place (fresh outputs, so large ones pay their
page faults on a CPU), backward kernels with the operand layouts autograd gives them, at the thread
count torch already uses, with the FLOP and byte conventions of `compute`. Fits:
- per-op overhead: the per-kernel cost of a training step of tiny layers (Python module calls,
  autograd bookkeeping and views between kernels, spread over the kernels): what a small op costs
  in a real step. Isolated timings carry only the bare dispatch cost, so they are shifted by the
  difference before fitting;
- bandwidth-bound kinds (elementwise, norm, softmax, reduction, embedding, gather): a table of efficiency
  against log10(bytes), a running median of the measured points (cache levels make it non-monotone);
  elementwise and softmax also get a constant flop efficiency, the median over their
  transcendental ops (GELU, exp) where moving the data cannot explain the time;
- compute kinds (matmul, attention, conv): eff_max, half and ai_half of the saturating curve, by a
  grid search minimising a soft-L1 log error weighted by sqrt(time);
- CPU page faults: the bandwidth at which blocks over glibc's mmap threshold get their pages.
Other processes on a shared host stall timings: every timing is the fastest of several groups of
calls, points timed while others held half a CPU or far off the first fit are timed again (the
faster kept) and the curves refitted. Past 60% of the time budget (18 s quick, 85 s full) each op is
timed with the fewest repeats and re-timing stops; `meta["other_load_cpus"]` records the disturbance.
"""

from __future__ import annotations

import json
import math
import platform
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .compute import (
    OP_KINDS,
    ComputeModel,
    Profile,
    host_path_path,
    load_profile,
    pointwise_flops,
    profile_path,
    write_atomic,
)
from .gpu_profiles import kind_peak
from .host import FAULT_THRESHOLD, OtherLoad, Timer, measure_cpu_peaks, measure_framework, page_fault_bandwidth

Sample = tuple[str, float, float, float, str]  # kind, flops, nbytes, seconds, op name
Made = tuple[float, float, Callable[[], Any]]  # flops, nbytes, the call to time
Job = tuple[str, str, bool, Callable[[], Made]]  # kind, op name, needs autograd, builder


def _nb(*ts: Any) -> float:
    return float(sum(t.numel() * t.element_size() for t in ts if t is not None))


# ---- sweeps: each yields jobs whose builder makes the tensors only when timed --------------------


def _matmul_jobs(torch: Any, dev: Any, quick: bool, dt: Any = None) -> Iterator[Job]:
    if quick:
        shapes = [(32, 32, 32), (128, 128, 128), (512, 512, 512), (8, 256, 256), (32, 512, 512),
                  (128, 256, 1024), (512, 1024, 256), (2048, 512, 512), (256, 512, 2048), (1024, 1024, 1024),
                  (4096, 256, 256), (8, 1024, 4096)]
    else:
        shapes = [(16, 16, 16), (32, 32, 32), (64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512),
                  (1024, 1024, 1024)]
        for m in (8, 32, 128, 512, 2048, 8192):
            for k, n in ((256, 256), (512, 512), (256, 1024), (1024, 256), (512, 2048), (2048, 512)):
                # Outputs under 32 MiB: larger ones pay page faults, modelled apart (out_bytes).
                if m * k * n <= 2**31 and 4 * m * max(k, n) < FAULT_THRESHOLD:
                    shapes.append((m, k, n))
    for m, k, n in shapes:
        f = 2.0 * m * n * k

        def make(which: str, m: int = m, k: int = k, n: int = n, f: float = f) -> Made:
            x, w = torch.randn(m, k, device=dev, dtype=dt), torch.randn(n, k, device=dev, dtype=dt)
            b, dy = torch.randn(n, device=dev, dtype=dt), torch.randn(m, n, device=dev, dtype=dt)
            # Forward of a linear layer, then the two backward matmuls with autograd's layouts.
            if which == "addmm":
                return f, _nb(x, w, b, dy), lambda: torch.addmm(b, x, w.t())
            if which == "mm_grad_input":
                return f, _nb(dy, w, x), lambda: torch.mm(dy, w)
            return f, _nb(dy, x, w), lambda: torch.mm(dy.t(), x)

        for which in ("addmm", "mm_grad_input", "mm_grad_weight"):
            yield "matmul", which, False, lambda make=make, which=which: make(which)
    # Batched matmuls of hand-written attention: q @ k^T and p @ v.
    for bh, s, d in ((32, 64, 32), (64, 128, 64), (128, 256, 64))[: 2 if quick else 3]:
        f = 2.0 * bh * s * s * d

        def make_bmm(qk: bool, bh: int = bh, s: int = s, d: int = d, f: float = f) -> Made:
            q, k = torch.randn(bh, s, d, device=dev, dtype=dt), torch.randn(bh, s, d, device=dev, dtype=dt)
            p = torch.randn(bh, s, s, device=dev, dtype=dt)
            if qk:
                return f, _nb(q, k, p), lambda: torch.bmm(q, k.transpose(1, 2))
            return f, _nb(p, q, q), lambda: torch.bmm(p, q)

        yield "matmul", "bmm_qk", False, lambda make_bmm=make_bmm: make_bmm(True)
        yield "matmul", "bmm_pv", False, lambda make_bmm=make_bmm: make_bmm(False)


def _elementwise_jobs(torch: Any, dev: Any, quick: bool) -> Iterator[Job]:
    F, aten = torch.nn.functional, torch.ops.aten
    names = ["add", "mul", "relu", "gelu", "gelu_backward"]
    names += [] if quick else ["threshold_backward", "clone"]
    for e in range(10, 25, 2) if quick else range(10, 25):
        for name in names:

            def make(name: str = name, n: int = 2**e) -> Made:
                x, y = torch.randn(n, device=dev), torch.randn(n, device=dev)
                fns: dict[str, tuple[int, Callable[[], Any]]] = {
                    "add": (3, lambda: torch.add(x, y)), "mul": (3, lambda: torch.mul(x, y)),
                    "relu": (2, lambda: torch.relu(x)), "gelu": (2, lambda: F.gelu(x)),
                    "gelu_backward": (3, lambda: aten.gelu_backward(y, x)),
                    "threshold_backward": (3, lambda: aten.threshold_backward(y, x, 0.0)),
                    "clone": (2, lambda: x.clone()),
                }
                tensors, fn = fns[name]
                return pointwise_flops(name, n), 4.0 * n * tensors, fn

            yield "elementwise", name, False, make


def _rows(quick: bool) -> list[tuple[int, int]]:
    rows = [(64, 256), (256, 512), (1024, 512), (4096, 512), (8192, 1024), (32768, 512)]
    if not quick:
        rows += [(16, 256), (512, 256), (2048, 1024), (4096, 2048), (16384, 1024), (65536, 512)]
    return rows


def _norm_jobs(torch: Any, dev: Any, quick: bool) -> Iterator[Job]:
    aten = torch.ops.aten
    for r, h in _rows(quick):

        def make(bwd: bool, r: int = r, h: int = h) -> Made:
            x, w, b = torch.randn(r, h, device=dev), torch.randn(h, device=dev), torch.randn(h, device=dev)
            y, mean, rstd = aten.native_layer_norm(x, [h], w, b, 1e-5)
            if not bwd:
                return (8.0 * r * h, _nb(x, w, b, y, mean, rstd),
                        lambda: aten.native_layer_norm(x, [h], w, b, 1e-5))
            return (12.0 * r * h, _nb(y, x, mean, rstd, w, b, x, w, b),
                    lambda: aten.native_layer_norm_backward(y, x, [h], mean, rstd, w, b, [True, True, True]))

        yield "norm", "layer_norm", False, lambda make=make: make(False)
        yield "norm", "layer_norm_backward", False, lambda make=make: make(True)


def _softmax_jobs(torch: Any, dev: Any, quick: bool) -> Iterator[Job]:
    aten = torch.ops.aten
    for r, c in _rows(quick) + [(4096, 64), (16384, 128), (2048, 8192)]:
        for name in ("softmax", "softmax_backward") + (() if quick else ("log_softmax",)):

            def make(name: str = name, r: int = r, c: int = c) -> Made:
                x = torch.randn(r, c, device=dev)
                y = torch.softmax(x, -1)
                if name == "softmax":
                    return pointwise_flops("_softmax", r * c), _nb(x, y), lambda: aten._softmax(x, -1, False)
                if name == "log_softmax":
                    return (pointwise_flops("_log_softmax", r * c), _nb(x, y),
                            lambda: aten._log_softmax(x, -1, False))
                return (pointwise_flops("_softmax_backward_data", r * c), _nb(x, y, y),
                        lambda: aten._softmax_backward_data(x, y, -1, torch.float32))

            yield "softmax", name, False, make


def _reduction_jobs(torch: Any, dev: Any, quick: bool) -> Iterator[Job]:
    for r, h in _rows(quick):

        def make(dim0: bool, r: int = r, h: int = h) -> Made:
            x = torch.randn(r, h, device=dev)
            if dim0:  # a bias gradient
                return float(r * h), _nb(x) + 4.0 * h, lambda: x.sum(0)
            return float(r * h), _nb(x) + 4.0 * r, lambda: x.mean(-1)

        yield "reduction", "sum_dim0", False, lambda make=make: make(True)
        yield "reduction", "mean_last", False, lambda make=make: make(False)
    aten = torch.ops.aten
    for n, c, hw in ((8, 16, 32), (32, 32, 32), (32, 64, 16), (64, 64, 32))[: 2 if quick else 4]:

        def make_pool(bwd: bool, n: int = n, c: int = c, hw: int = hw) -> Made:
            x = torch.randn(n, c, hw, hw, device=dev)
            y, idx = aten.max_pool2d_with_indices(x, [2, 2], [2, 2])
            if not bwd:
                return (float(x.numel()), _nb(x, y, idx),
                        lambda: aten.max_pool2d_with_indices(x, [2, 2], [2, 2]))
            return (float(x.numel()), _nb(y, x, idx, x),
                    lambda: aten.max_pool2d_with_indices_backward(y, x, [2, 2], [2, 2], [0, 0], [1, 1], False,
                                                                  idx))

        yield "reduction", "max_pool2d", False, lambda make_pool=make_pool: make_pool(False)
        yield "reduction", "max_pool2d_backward", False, lambda make_pool=make_pool: make_pool(True)


def _embedding_jobs(torch: Any, dev: Any, quick: bool) -> Iterator[Job]:
    aten = torch.ops.aten
    sizes = ((1000, 256, 256), (8192, 512, 2048), (32000, 512, 8192), (50257, 768, 4096), (4096, 256, 16384))
    for vocab, dim, tokens in sizes[: 3 if quick else 5]:

        def make(bwd: bool, vocab: int = vocab, dim: int = dim, tokens: int = tokens) -> Made:
            w = torch.randn(vocab, dim, device=dev)
            idx = torch.randint(0, vocab, (tokens,), device=dev)
            g = torch.randn(tokens, dim, device=dev)
            if not bwd:  # bytes touched: the gathered rows read and written, the indices
                return 0.0, 2.0 * _nb(g) + _nb(idx), lambda: aten.embedding(w, idx)
            return (float(g.numel()), _nb(g, idx, w),
                    lambda: aten.embedding_dense_backward(g, idx, vocab, -1, False))

        yield "embedding", "embedding", False, lambda make=make: make(False)
        yield "embedding", "embedding_backward", False, lambda make=make: make(True)


def _gather_jobs(torch: Any, dev: Any, quick: bool) -> Iterator[Job]:
    # Message passing: gather node rows per edge (index_select) and scatter-add them back (index_add), with
    # random indices; bytes as annotation counts them (every tensor argument and the output).
    graphs = ((1024, 8192, 64), (4096, 32768, 128), (16384, 131072, 64), (2048, 16384, 256))
    for nodes, edges, dim in graphs[: 2 if quick else 4]:

        def make_graph(scatter: bool, nodes: int = nodes, edges: int = edges, dim: int = dim) -> Made:
            x = torch.randn(nodes, dim, device=dev)
            idx = torch.randint(0, nodes, (edges,), device=dev)
            msg = torch.randn(edges, dim, device=dev)
            if not scatter:
                return 0.0, _nb(x, idx, msg), lambda: torch.index_select(x, 0, idx)
            return float(msg.numel()), _nb(x, idx, msg, x), lambda: torch.index_add(x, 0, idx, msg)

        yield "gather", "index_select", False, lambda make_graph=make_graph: make_graph(False)
        yield "gather", "index_add", False, lambda make_graph=make_graph: make_graph(True)


def _attention_jobs(torch: Any, dev: Any, quick: bool, dt: Any = None) -> Iterator[Job]:
    F = torch.nn.functional
    shapes = [(8, 4, 64, 32), (8, 8, 128, 64), (16, 8, 256, 64), (4, 8, 512, 64), (32, 8, 128, 32)]
    for b, h, s, d in shapes[: 3 if quick else 5]:

        def make(which: str, b: int = b, h: int = h, s: int = s, d: int = d) -> Made:
            q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
            f = 4.0 * b * h * s * s * d
            nb = _nb(q, k, v, q)
            if which == "sdpa_causal":
                return f / 2, nb, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if which == "sdpa":
                return f, nb, lambda: F.scaled_dot_product_attention(q, k, v)
            o = F.scaled_dot_product_attention(q, k, v)
            go = torch.randn_like(o)
            # FlashAttention's backward recomputes the scores: 5 matmuls to the forward's 2.
            return 2.5 * f, 2 * nb + _nb(go), lambda: torch.autograd.grad(o, (q, k, v), go, retain_graph=True)

        for which in ("sdpa_causal", "sdpa", "sdpa_backward"):
            yield "attention", which, True, lambda make=make, which=which: make(which)


def _conv_jobs(torch: Any, dev: Any, quick: bool) -> Iterator[Job]:
    F = torch.nn.functional
    # Small-CNN shapes on both sides of oneDNN's CPU algorithm switch (at about N*H*W > 8192 a 3x3
    # conv runs several times slower per FLOP), so the fit lands between them.
    shapes = [(8, 3, 32, 32, 16), (32, 16, 32, 32, 32), (32, 32, 16, 16, 64), (16, 3, 32, 32, 32),
              (32, 64, 8, 8, 128), (8, 64, 32, 32, 64), (32, 32, 32, 32, 32), (32, 128, 8, 8, 128)]
    for n, c, hh, ww, co in shapes[: 4 if quick else 8]:

        def make(bwd: bool, n: int = n, c: int = c, hh: int = hh, ww: int = ww, co: int = co) -> Made:
            x = torch.randn(n, c, hh, ww, device=dev, requires_grad=True)
            w = torch.randn(co, c, 3, 3, device=dev, requires_grad=True)
            b = torch.randn(co, device=dev, requires_grad=True)
            y = F.conv2d(x, w, b, padding=1)
            f = 2.0 * y.numel() * c * 9
            if not bwd:
                return f, _nb(x, w, b, y), lambda: F.conv2d(x, w, b, padding=1)
            gy = torch.randn_like(y)
            return (2 * f, _nb(gy, x, w, x, w, b),
                    lambda: torch.autograd.grad(y, (x, w, b), gy, retain_graph=True))

        yield "conv", "conv2d", True, lambda make=make: make(False)
        yield "conv", "conv2d_backward", True, lambda make=make: make(True)


_SWEEPS = {"matmul": _matmul_jobs, "elementwise": _elementwise_jobs, "norm": _norm_jobs,
           "softmax": _softmax_jobs, "reduction": _reduction_jobs, "embedding": _embedding_jobs,
           "gather": _gather_jobs, "attention": _attention_jobs, "conv": _conv_jobs}


def _run(job: Job, timer: Timer) -> Sample:
    import torch

    kind, name, needs_grad, make = job
    with torch.set_grad_enabled(needs_grad):
        flops, nbytes, fn = make()
        return kind, flops, nbytes, timer(fn), name


# ---- fitting ------------------------------------------------------------------------------------


def _bw_table(samples: list[Sample], overhead: float, bw: float, step: float = 0.25) -> list[list[float]]:
    """[[log10 bytes, efficiency], ...]: running median over +-1.2 steps of the measured points."""
    xs = np.array([math.log10(max(s[2], 1.0)) for s in samples])
    eff = np.array([s[2] / (max(s[3] - overhead, 0.1 * s[3]) * bw) for s in samples])
    table: list[list[float]] = []
    for x in np.arange(math.floor(xs.min() / step) * step, xs.max() + step, step):
        near = np.abs(xs - x) <= 1.2 * step
        if near.any():
            table.append([round(float(x), 4), float(np.clip(np.median(eff[near]), 1e-3, 100.0))])
    return table


def _fit_flop_curve(samples: list[Sample], overhead: float, peak: float, bw_table: list[list[float]],
                    bw: float) -> dict:
    """Grid search of (eff_max, half, ai_half) minimising the soft-L1 log error of the roofline,
    weighted by sqrt(time): long ops matter more to a step's total."""
    f = np.array([s[1] for s in samples])
    b = np.array([s[2] for s in samples])
    t = np.array([s[3] for s in samples])
    w = np.sqrt(t) / np.sqrt(t).sum()
    ai = f / np.maximum(b, 1.0)
    xs, ys = np.array([p[0] for p in bw_table]), np.array([p[1] for p in bw_table])
    t_bw = b / (bw * np.interp(np.log10(np.maximum(b, 1.0)), xs, ys))
    effs = np.geomspace(0.02, 3.0, 100)
    halves = np.concatenate([[0.0], np.geomspace(max(f.min() / 100, 1.0), f.max() * 2, 50)])
    ai_halves = np.concatenate([[0.0], np.geomspace(0.05, max(ai.max(), 1.0), 40)])
    # Axes (half, ai_half, sample); one eff_max at a time keeps the arrays small.
    shape = (halves[:, None, None] + f[None, None, :]) / f[None, None, :]
    shape = shape * (ai[None, None, :] + ai_halves[None, :, None]) / ai[None, None, :]
    t_unit = f[None, None, :] / peak * shape
    best = (math.inf, 0, 0, 0)
    for i, e in enumerate(effs):
        pred = overhead + np.maximum(t_unit / e, t_bw[None, None, :])
        r = np.log(pred / t[None, None, :]) / 0.2
        err = np.sum(w * (np.sqrt(1.0 + r * r) - 1.0), axis=-1)  # soft-L1: a stalled timing cannot dominate
        j, k = np.unravel_index(int(np.argmin(err)), err.shape)
        if err[j, k] < best[0]:
            best = (float(err[j, k]), i, int(j), int(k))
    _, i, j, k = best
    return {"eff_max": float(effs[i]), "half": float(halves[j]), "ai_half": float(ai_halves[k])}


def _flop_eff(heavy: list[Sample], overhead: float, peak: float, table: list[list[float]],
              bw: float) -> float:
    """Constant flop efficiency of transcendental pointwise ops: the median over points where
    moving the data cannot explain the time (not cache-resident ones paying page faults) and fixed
    costs do not dominate (>= 20 us)."""
    xs, ys = np.array([p[0] for p in table]), np.array([p[1] for p in table])
    eff = []
    for _, f, b, t, _ in heavy:
        t_bw = b / (bw * float(np.interp(math.log10(max(b, 1.0)), xs, ys)))
        if t >= 2e-5 and t - overhead > 1.5 * t_bw:
            eff.append(f / (peak * (t - overhead)))
    if len(eff) < 2:
        eff = [f / (peak * max(t - overhead, 0.1 * t)) for _, f, _, t, _ in heavy]
    return float(np.median(eff))


def _fit(groups: dict[str, list[Sample]], overhead: float, peaks: dict[str, float], bw: float) -> dict[str, dict]:
    """Curves of every kind; `peaks`: the FLOP/s each kind's efficiencies are relative to."""
    curves: dict[str, dict] = {}
    for kind in ("elementwise", "softmax"):
        # Ops at ~1 flop per element move data (the bandwidth table); transcendental ones (GELU,
        # softmax's exp) fit a constant flop efficiency on top.
        moving = [s for s in groups[kind] if s[1] <= 0.5 * s[2]]
        heavy = [s for s in groups[kind] if s[1] > 0.5 * s[2]]
        table = _bw_table(moving or groups[kind], overhead, bw)
        flop = {"eff_max": _flop_eff(heavy, overhead, peaks[kind], table, bw)} if heavy else None
        curves[kind] = {"flop": flop, "bw": {"table": table}}
    ew_table = curves["elementwise"]["bw"]["table"]
    for kind in ("norm", "reduction", "embedding", "gather"):
        curves[kind] = {"flop": None, "bw": {"table": _bw_table(groups[kind], overhead, bw)}}
    curves["other"] = {"flop": None, "bw": {"table": ew_table}}
    roof = max(p[1] for p in ew_table)  # compute kinds: the fastest bandwidth seen is the roof
    for kind in ("matmul", "attention", "conv"):
        curves[kind] = {"flop": _fit_flop_curve(groups[kind], overhead, peaks[kind], [[0.0, roof]], bw),
                        "bw": {"eff_max": roof}}
    return curves


def _precision_curves(torch: Any, dev: Any, quick: bool, timer: Timer, spec: Any, overhead: float, shift: float,
                      groups: dict[str, list[Sample]]) -> dict[str, dict[str, dict]]:
    """CUDA: the matmul and attention flop curves of every training precision (compute.py `flop_by_dtype`),
    each relative to `gpu_profiles.kind_peak`: fp32 from the main sweep, tf32 the same sweep with
    `allow_tf32`, fp16 and (Ampere+) bf16 with 16-bit tensors."""
    from .gpu_profiles import has_tf32

    roof = max(p[1] for p in _bw_table(groups["elementwise"], overhead, spec.memory_bandwidth))
    variants = [("fp32", torch.float32, False), ("tf32", torch.float32, True), ("fp16", torch.float16, False)]
    variants += [("bf16", torch.bfloat16, False)] if has_tf32(spec) else []
    out: dict[str, dict[str, dict]] = {"matmul": {}, "attention": {}}
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, dt, tf32 in variants:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            for kind, sweep in (("matmul", _matmul_jobs), ("attention", _attention_jobs)):
                samples = groups[kind] if name == "fp32" else [
                    (k, f, b, t + shift, n) for k, f, b, t, n in (_run(j, timer) for j in sweep(torch, dev, quick, dt))]
                curve = _fit_flop_curve(samples, overhead, kind_peak(spec, kind, name), [[0.0, roof]],
                                        spec.memory_bandwidth)
                out[kind][name] = {**curve, "source": f"calibrated on {spec.name} in {name}"}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return out


def _log_errors(groups: dict[str, list[Sample]], model: ComputeModel) -> dict[str, list[float]]:
    return {k: [math.log(model.op_time(kd, f, b) / t) for kd, f, b, t, _ in v] for k, v in groups.items()}


# ---- entry point --------------------------------------------------------------------------------


def _resolve_device(device: str) -> tuple[Any, str, Any]:
    """(torch.device, profile name, DeviceSpec or None for the CPU)."""
    import torch

    if device == "local":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev, "cpu", None
    if dev.type != "cuda":
        raise ValueError(f"calibrate() supports 'local', 'cpu' or 'cuda[:N]', not {device!r}")
    from ..cluster import catalog_name_for_gpu, device_spec

    index = dev.index or 0
    spec = device_spec(catalog_name_for_gpu(torch.cuda.get_device_name(index), index))
    return torch.device("cuda", index), spec.name, spec


def calibrate(device: str = "local", quick: bool = False, save: bool = True) -> Profile:
    """Time an op sweep on `device` ('local': the first CUDA GPU if any, else the CPU; or 'cpu',
    'cuda:N'), fit the curves and (with `save`) write them to profile_dir()/<device name>.json.
    quick: ~12 s on 2 idle CPU cores (fewer sizes and repeats), full: ~45 s; budgets 18 s / 85 s
    (a busy host stretches them: it takes the CPUs the timings wait for). A run during which other
    processes held over half a CPU is marked unreliable and does not replace a reliable profile."""
    import torch

    t_start = time.perf_counter()
    deadline = t_start + (18.0 if quick else 85.0)
    total_load = OtherLoad()
    dev, name, spec = _resolve_device(device)
    timer = Timer(dev, quick)
    if dev.type == "cpu":
        peak, bw = measure_cpu_peaks(torch, timer)
    else:
        peak, bw = spec.flops("fp32"), spec.memory_bandwidth
    bare, overhead, host = measure_framework(torch, dev, timer)
    fault = {"threshold": FAULT_THRESHOLD, "bandwidth": page_fault_bandwidth(torch, timer)} \
        if dev.type == "cpu" else None
    jobs = {kind: list(sweep(torch, dev, quick)) for kind, sweep in _SWEEPS.items()}
    # Isolated timings carry the bare dispatch cost; an op in a training step costs `overhead`.
    shift = overhead - bare
    load = OtherLoad()
    contended: set[tuple[str, int]] = set()

    def run(job: Job, key: tuple[str, int]) -> Sample:
        timer.hurry = time.perf_counter() > t_start + 0.6 * (deadline - t_start)
        load.since()
        k, f, b, t, n = _run(job, timer)
        if load.since() > 0.5:  # another process had half a CPU: time it again later
            contended.add(key)
        else:
            contended.discard(key)
        return k, f, b, t + shift, n

    groups = {kind: [run(j, (kind, i)) for i, j in enumerate(js)] for kind, js in jobs.items()}
    per_dtype = _precision_curves(torch, dev, quick, timer, spec, overhead, shift, groups) if spec else {}
    if dev.type == "cpu":
        # The peaks were measured once, maybe while another process ran: keep the best seen.
        if time.perf_counter() < deadline - 2:
            peak2, bw2 = measure_cpu_peaks(torch, timer)
            peak, bw = max(peak, peak2), max(bw, bw2)
        peak = max([peak] + [f / (t - overhead) for _, f, _, t, _ in groups["matmul"] if t > 2 * overhead])
    from ..catalog import DeviceSpec, Link

    probe_spec = spec or DeviceSpec("cpu", dict.fromkeys(("fp32", "tf32", "bf16", "fp16"), peak), 1, bw,
                                    Link(bw, 1e-6), Link(bw, 1e-6), kind="cpu")
    ref_peak, ref_bw = (peak, bw) if dev.type == "cpu" else (None, None)

    def fitted() -> tuple[Profile, dict[str, list[float]]]:
        peaks = {k: peak if spec is None else kind_peak(spec, k, "fp32") for k in OP_KINDS}
        curves = _fit(groups, overhead, peaks, bw)
        for kind, by_dtype in per_dtype.items():
            curves[kind]["flop_by_dtype"] = by_dtype
        prof = Profile(device=name, curves=curves, overhead_s=overhead,
                       peak_flops=ref_peak, memory_bandwidth=ref_bw,
                       meta={"dtype": "fp32", "page_fault": fault})
        return prof, _log_errors(groups, ComputeModel(probe_spec, prof, dtype="fp32"))

    profile, errors = fitted()
    retimed = 0
    for attempt in range(3):
        off = {(k, i): abs(e) for k, errs in errors.items() for i, e in enumerate(errs)
               if abs(e) > math.log(1.3)}
        again = sorted(contended | set(off), key=lambda key: -off.get(key, 10.0))
        if not again or time.perf_counter() > deadline:
            break
        if attempt and contended:
            time.sleep(0.2 * attempt)  # give a burst of other work a moment to pass
        for kind, i in again:
            if time.perf_counter() > deadline:
                break
            k, f, b, t, n = run(jobs[kind][i], (kind, i))
            if t < groups[kind][i][3]:
                groups[kind][i] = (k, f, b, t, n)
            retimed += 1
        profile, errors = fitted()
    seconds = time.perf_counter() - t_start
    others = total_load.since()
    rms = {k: round(math.sqrt(sum(e * e for e in v) / len(v)), 4) for k, v in errors.items() if v}
    profile.meta = {
        "dtype": "fp32", "threads": torch.get_num_threads(), "torch": torch.__version__,
        "device_type": dev.type, "host": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "quick": quick, "page_fault": fault, "bare_dispatch_s": bare, "measured_peak_flops": peak,
        "measured_bandwidth": bw, "framework": host,
        "rms_log_error": rms, "samples": sum(len(s) for s in groups.values()), "retimed": retimed,
        "other_load_cpus": round(others, 2), "seconds": round(seconds, 2),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "kinds": [k for k in OP_KINDS if k in profile.curves],
    }
    profile.meta["reliable"] = reliable = others <= 0.5
    path = profile_path(name)
    old = load_profile(name) if save and path.is_file() else None
    keep_old = not reliable and old is not None and old.meta.get("reliable", True)
    if not reliable:
        warnings.warn(f"other processes kept {others:.1f} CPUs busy during calibration, so its timings are "
                      f"pessimistic{'; kept the existing profile' if keep_old else ''}. Calibrate on an "
                      f"idle host for a faithful profile.", stacklevel=2)
    if save and not keep_old:
        profile.save(path)
        if name == "cpu":
            from . import host

            host.cpu_spec.cache_clear()
    return profile


def calibrate_host(quick: bool = False, save: bool = True) -> dict:
    """Measure the host path of eager PyTorch on this host's CPU (`host.measure_framework` with tensors of a
    few elements: Python, dispatcher, autograd and allocator time per kernel, view, module call, autograd node,
    micro-batch and optimizer step) and, with `save`, write it to `compute.host_path_path()`, where GPUs
    without figures measured on themselves take their host figures from (`overhead.gpu_host_from_path`)."""
    import torch

    t0 = time.perf_counter()
    load = OtherLoad()
    timer = Timer(torch.device("cpu"), quick)
    bare, overhead, framework = measure_framework(torch, torch.device("cpu"), timer)
    others = load.since()
    out = {"framework": framework, "bare_dispatch_s": bare, "torch": torch.__version__, "host": platform.node(),
           "processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
           "quick": quick, "other_load_cpus": round(others, 2), "reliable": others <= 0.5,
           "seconds": round(time.perf_counter() - t0, 2), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if not out["reliable"]:
        warnings.warn(f"other processes kept {others:.1f} CPUs busy while the host path was measured, so its "
                      f"figures are pessimistic. Measure on an idle host for faithful ones.", stacklevel=2)
    if save:
        write_atomic(host_path_path(), json.dumps(out, indent=1))
    return out


if __name__ == "__main__":  # python -m autopar.cost_models.calibrate [--quick]
    import sys

    p = calibrate(quick="--quick" in sys.argv, save=True)
    print(f"saved {profile_path(p.device)} in {p.meta['seconds']} s; rms log error "
          f"{p.meta['rms_log_error']}; other load {p.meta['other_load_cpus']} CPUs; "
          f"retimed {p.meta['retimed']}")
