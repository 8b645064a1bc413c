"""The local CPU as a device: its figures are measured, not looked up."""

from __future__ import annotations

import functools
import os
import time

from ..cluster import GiB, DeviceSpec, Link


@functools.lru_cache(maxsize=1)
def cpu_spec() -> DeviceSpec:
    """Measure this host's fp32 matmul FLOP/s and copy bandwidth once per process (~0.3 s)."""
    import torch

    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    t = time.perf_counter()
    reps = 10
    for _ in range(reps):
        torch.mm(a, b)
    flops = 2 * n**3 * reps / (time.perf_counter() - t)
    x = torch.empty(16 * 1024 * 1024)
    y = torch.empty_like(x)
    y.copy_(x)
    t = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    bw = 2 * x.numel() * 4 * 5 / (time.perf_counter() - t)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 16 * GiB
    shm = Link(bw / 2, 1e-6, "shared-memory")
    return DeviceSpec("cpu", {"fp32": flops, "tf32": flops, "bf16": flops, "fp16": flops}, int(mem), bw,
                      intra_node=shm, host_link=shm, kind="cpu")
