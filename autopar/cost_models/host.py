"""The local host: the CPU as a device (its figures are measured, not looked up), and the timing
helpers calibration uses on it (a stall-resistant timer, other processes' load, page-fault cost)."""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..catalog import DeviceSpec, GiB, Link

FAULT_THRESHOLD = 32 * 2**20  # glibc's largest mmap threshold: bigger blocks always come from mmap


@functools.lru_cache(maxsize=1)
def cpu_spec() -> DeviceSpec:
    """This host's fp32 matmul FLOP/s and memory bandwidth: from the saved CPU compute profile when
    there is one (so the cost model and its calibration agree), else measured (~0.3 s: a 512^3 matmul and
    a 64 MiB copy) once per machine and kept beside the profiles (`probe_path`): every training process
    loads a `cpu` cluster, and 128 MiB of probe buffers in each would be a peak no plan prices."""
    flops, bw = _profile_figures() or _probed()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 16 * GiB
    shm = Link(bw / 2, 1e-6, "shared-memory")
    return DeviceSpec("cpu", {"fp32": flops, "tf32": flops, "bf16": flops, "fp16": flops}, int(mem), bw,
                      intra_node=shm, host_link=shm, kind="cpu")


def _profile_figures() -> tuple[float, float] | None:
    from .compute import load_profile

    p = load_profile("cpu")
    if p is None or not p.peak_flops or not p.memory_bandwidth:
        return None
    return float(p.peak_flops), float(p.memory_bandwidth)


def probe_path() -> Path:
    """Where the measured figures of this machine are kept (one file per host name and core count)."""
    from .compute import profile_dir

    return profile_dir() / f"cpu-probe-{platform.node() or 'host'}-{os.cpu_count()}.json"


def _probed() -> tuple[float, float]:
    path = probe_path()
    try:
        d = json.loads(path.read_text())
        return float(d["flops"]), float(d["bandwidth"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    flops, bw = _measure()
    from .compute import write_atomic

    try:
        write_atomic(path, json.dumps({"flops": flops, "bandwidth": bw, "measured": time.time()}))
    except OSError:
        pass  # a read-only home: measure again next time
    return flops, bw


def _measure() -> tuple[float, float]:
    import torch

    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(3):  # best of three: other processes on the host only slow a run down
        t = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - t) / 4)
    flops = 2 * n**3 / best
    x = torch.empty(16 * 1024 * 1024)
    y = torch.empty_like(x)
    y.copy_(x)
    best = float("inf")
    for _ in range(4):
        t = time.perf_counter()
        y.copy_(x)
        best = min(best, time.perf_counter() - t)
    return flops, 2 * x.numel() * 4 / best


class Timer:
    def __init__(self, device: Any, quick: bool) -> None:
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"
        self.budget = 0.006 if quick else 0.015  # seconds of repeats per measurement
        self.hurry = False  # behind schedule (a busy host): fewest repeats, no waiting for agreement

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def _group(self, fn: Callable[[], Any], n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            fn()
        self.sync()
        return (time.perf_counter() - t) / n

    def __call__(self, fn: Callable[[], Any]) -> float:
        """Seconds per call of `fn`: the fastest of timed groups of calls (each >= ~20 us so the
        clock's cost vanishes), repeated until the two fastest agree. Not a mean: other processes on
        a shared host stall some groups (with OpenMP, one descheduled thread holds up an op for a
        whole scheduler slice, several ms)."""
        fn()
        self.sync()
        one = max(min(self._group(fn, 1) for _ in range(2)), 1e-7)
        group = max(1, int(2e-5 / one))
        n_min = 2 if self.hurry else 3 if one > 2e-3 else 5
        n_max = n_min if self.hurry else max(n_min + 5, min(100, int(2 * self.budget / (group * one))))
        times: list[float] = []
        while len(times) < n_max:
            times.append(self._group(fn, group))
            if len(times) >= n_min:
                a, b = sorted(times)[:2]
                if b <= 1.08 * a:
                    break
        return min(times)


def measure_cpu_peaks(torch: Any, timer: Timer) -> tuple[float, float]:
    """Best fp32 matmul FLOP/s over mid-size squares, and DRAM-sized copy bandwidth (bytes/s)."""
    best = 0.0
    with torch.no_grad():
        for n in (512, 768, 1024):
            a, b = torch.randn(n, n), torch.randn(n, n)
            best = max(best, 2.0 * n**3 / timer(lambda a=a, b=b: torch.mm(a, b)))
        x = torch.randn(2**23)
        y = torch.empty_like(x)
        bw = 2.0 * 4 * x.numel() / timer(lambda: y.copy_(x))
    return best, bw


def page_fault_bandwidth(torch: Any, timer: Timer) -> float:
    """Bytes/s at which fresh CPU allocations above the mmap threshold get their pages (each one
    is mmap-ed, faulted in and unmapped again: ~1 us per 4 KiB page in a VM)."""
    n = 2 * FAULT_THRESHOLD // 4
    buf = torch.empty(n)
    with torch.no_grad():
        fresh = timer(lambda: torch.empty(n).fill_(1.0))
        reuse = timer(lambda: buf.fill_(1.0))
    return 4.0 * n / max(fresh - reuse, 1e-6)


class OtherLoad:
    """CPUs other processes kept busy since the last call, from /proc/stat (0 where unavailable)."""

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float]:
        try:
            with open("/proc/stat") as fh:
                v = [float(x) for x in fh.readline().split()[1:]]
            busy = (sum(v) - v[3] - (v[4] if len(v) > 4 else 0.0)) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            busy = math.nan
        return time.perf_counter(), busy, sum(os.times()[:2])

    def since(self) -> float:
        now = self._read()
        wall, busy, own = (a - b for a, b in zip(now, self._last, strict=True))
        self._last = now
        if not wall > 0.02 or math.isnan(busy):  # /proc/stat ticks are 10 ms: too short to tell
            return 0.0
        return max(0.0, busy - own) / wall


def _count_kernels(torch: Any, fn: Callable[[], Any]) -> int:
    """Kernels (non-view aten ops) one call of `fn` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from .compute import classify

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if classify(str(func)) != "view":
                _Count.n += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        fn()
    return _Count.n


def _slope(timer: Timer, make: Callable[[int], Callable[[], Any]], n1: int, n2: int) -> tuple[float, float]:
    """(seconds per unit, fixed seconds) of `make(n)`'s call, from timings at n1 and n2 units."""
    t1, t2 = timer(make(n1)), timer(make(n2))
    per = max(t2 - t1, 0.0) / (n2 - n1)
    return per, max(t1 - n1 * per, 0.0)


def measure_framework(torch: Any, dev: Any, timer: Timer) -> tuple[float, float, dict]:
    """(bare cost of one tiny op, per-kernel cost in a training step, host figures as meta["framework"]).

    Measured on `dev` with tensors of a few elements, so every figure is host time (overhead.py's terms):
    view_s a view of a grad-requiring tensor; module_s an nn.ReLU call less torch.relu; autograd_node_s
    and microbatch_s the slope and intercept of backward() over chains of 8 and 40 multiplies, less
    their backward kernels at the bare cost; step_s and step_tensor_s the intercept and slope of
    AdamW.step() over 4 and 32 tensors. The per-kernel cost is what a training step of 8 tiny
    Linear+ReLU layers spends per kernel once its module calls, autograd nodes and backward() call are
    taken out (at least the bare cost)."""
    nn = torch.nn
    a, m = torch.randn(1, device=dev), torch.randn(1, 1, device=dev)
    with torch.no_grad():
        tiny = (lambda: torch.add(a, a), lambda: torch.relu(a), lambda: torch.mm(m, m))
        bare = sorted(timer(fn) for fn in tiny)[1]
    w = torch.randn(2, 2, device=dev, requires_grad=True)
    view = timer(lambda: w.t())
    relu = nn.ReLU()
    with torch.no_grad():
        module = max(timer(lambda: relu(a)) - timer(lambda: torch.relu(a)), 0.0)

    def chain(n: int) -> Callable[[], Any]:
        x = torch.randn(4, device=dev, requires_grad=True)

        def run() -> None:
            y = x
            for _ in range(n):
                y = y * 1.5
            y.sum().backward()
        return run

    per_node, per_call = _slope(timer, chain, 8, 40)
    kernels_per_node = (_count_kernels(torch, chain(40)) - _count_kernels(torch, chain(8))) / 32 / 2  # fwd+bwd
    node = max(per_node - bare * (1 + kernels_per_node), 0.0)  # the forward mul and its backward kernels
    microbatch = max(per_call - 3 * bare, 0.0)  # less the sum, its backward and the grad accumulation

    def adam(n: int) -> Callable[[], Any]:
        ps = [torch.randn(4, device=dev, requires_grad=True) for _ in range(n)]
        for p in ps:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(ps, lr=1e-3)
        return opt.step

    step_tensor, step = _slope(timer, adam, 4, 32)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(8)]).to(dev)
    x = torch.randn(2, 4, device=dev)

    def train_step() -> None:
        layers.zero_grad(set_to_none=True)
        layers(x).sum().backward()

    calls = [0]
    hooks = [mod.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for mod in layers.modules()]
    kernels = _count_kernels(torch, train_step)
    for h in hooks:
        h.remove()
    out = layers(x).sum()
    seen, stack = set(), [out.grad_fn]
    while stack:  # the autograd nodes backward() runs
        fn = stack.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            stack.extend(f for f, _ in fn.next_functions)
    t_step = timer(train_step)
    rest = t_step - calls[0] * module - len(seen) * node - microbatch
    overhead = max(rest / max(kernels, 1), bare)
    src = f"measured by calibrate on {dev.type} ({time.strftime('%Y-%m-%d')})"
    host = {"stack": f"{dev.type}-eager", "kernel_s": {"value": overhead, "source": src + ": per kernel in a "
                                                                                        "tiny-layer training step"},
            "view_s": {"value": view, "source": src}, "module_s": {"value": module, "source": src},
            "autograd_node_s": {"value": node, "source": src}, "microbatch_s": {"value": microbatch, "source": src},
            "step_s": {"value": step, "source": src + " (AdamW)"},
            "step_tensor_s": {"value": step_tensor, "source": src + " (AdamW)"},
            "check": {"tiny_step_s": t_step, "kernels": kernels, "module_calls": calls[0], "autograd_nodes": len(seen)}}
    return bare, overhead, host
