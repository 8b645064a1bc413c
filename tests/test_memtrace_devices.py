"""memtrace counts one device's memory: on a CPU rank only the CPU allocator's events (a host copy of a CUDA
tensor, or a CUDA allocation, is another device's), on a CUDA rank that device's caching-allocator counters.

CPU only: the profiler tree is synthetic and torch.cuda's counters are mocked.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch._C._profiler import _EventType

from autopar.runtime import memtrace
from autopar.runtime.memtrace import MemoryTrace, allocations, fill, track_memory


def _alloc(t: int, nbytes: int, ptr: int, device: str) -> Any:
    return SimpleNamespace(tag=_EventType.Allocation, start_time_ns=t, children=[], parent=None, name="[memory]",
                           extra_fields=SimpleNamespace(alloc_size=nbytes, ptr=ptr, device=torch.device(device)))


def _tree() -> list[Any]:
    op = SimpleNamespace(tag=_EventType.TorchOp, name="aten::to", start_time_ns=0, parent=None, children=[])
    events = [_alloc(1, 1000, 1, "cpu"), _alloc(2, 8000, 2, "cuda:0"),  # a CUDA tensor
              _alloc(3, 8000, 3, "cpu"),  # its host copy
              _alloc(4, -8000, 3, "cpu"), _alloc(5, 4000, 4, "cuda:1"), _alloc(6, 500, 5, "cpu"),
              _alloc(7, -8000, 2, "cuda:0")]
    for e in events:
        e.parent = op
    op.children = events
    return [op]


def _peak(device: str) -> tuple[int, int]:
    trace = MemoryTrace(device=device)
    fill(trace, allocations(_tree(), device))
    return trace.peak_bytes, trace.final_bytes


def test_a_rank_counts_only_its_own_devices_events() -> None:
    assert _peak("cpu") == (9000, 1500)  # 1000 + host copy 8000, never the CUDA tensors
    assert _peak("cuda:0") == (8000, 0)
    assert _peak("cuda:1") == (4000, 4000)
    assert {a.device for a in allocations(_tree(), "cpu")} == {"cpu"}
    assert allocations(_tree(), "cpu")[0].what == "aten::to"


def test_cpu_window_ignores_cuda_events_from_the_profiler(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real = memtrace.allocations

    def spy(roots: list[Any], device: str = "cpu") -> list[Any]:
        seen.append(device)
        return real(roots, device)

    monkeypatch.setattr(memtrace, "allocations", spy)
    with track_memory() as trace:
        x = torch.empty(1000)
    assert seen == ["cpu"] and trace.peak_bytes == 4000 and trace.device == "cpu"
    del x


def test_cuda_window_reads_that_devices_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []
    state = {"allocated": 1 << 20, "peak": 1 << 20}

    def record(name: str, value: Any = None) -> Any:
        def f(device: Any = None) -> Any:
            calls.append((name, str(device)))
            return value(state) if callable(value) else value
        return f

    def reset(device: Any = None) -> None:
        calls.append(("reset", str(device)))
        state["peak"] = state["allocated"]

    cuda = SimpleNamespace(synchronize=record("synchronize"),
                           memory_allocated=record("allocated", lambda s: s["allocated"]),
                           max_memory_allocated=record("max", lambda s: s["peak"]), reset_peak_memory_stats=reset,
                           memory_reserved=record("reserved", 6 << 20), current_device=lambda: 1)
    monkeypatch.setattr(memtrace.torch, "cuda", cuda)
    monkeypatch.setattr(memtrace, "profile", lambda *a, **k: pytest.fail("the profiler sums every device"))
    with track_memory("cuda:1") as trace:
        state["peak"], state["allocated"] = (1 << 20) + 5000, (1 << 20) + 1000
    assert (trace.peak_bytes, trace.final_bytes, trace.reserved_bytes) == (5000, 1000, 6 << 20)
    assert trace.device == "cuda:1" and trace.summary()["reserved_bytes"] == 6 << 20
    assert {d for _, d in calls} == {"cuda:1"}  # every counter of this rank's device, never another's
    assert [n for n, _ in calls].index("reset") < [n for n, _ in calls].index("max")
    assert memtrace.device_name("cuda") == "cuda:1"
