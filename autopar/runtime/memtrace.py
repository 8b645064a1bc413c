"""Peak live tensor bytes of a piece of work, measured at the allocator (torch.profiler memory events).

`torch.profiler.profile(activities=[CPU], profile_memory=True)` records one `[memory]` event per allocator
call: `alloc_size` is signed (+n bytes allocated, -n freed) and exactly the requested size (no rounding
to the CPU allocator's 64-byte alignment, no malloc overhead). Their running sum in time order is the
bytes allocated inside the window that are still live; its maximum is the window's peak. Tensors that were
alive before the window are not counted: their frees are skipped (the allocator does not report most of them
anyway; torch warns once, "Memory block of unknown size was allocated before the profiling started"), so
the sum never goes below zero. Views, `detach()` and parameter wrappers allocate nothing.

Allocations made on threads the profiler does not follow are not seen (checked for a plain Python thread;
likely also communication library worker threads); autograd's CPU backward runs on the calling thread.

Only the measured device's events count (`track_memory(device)`, "cpu" by default): the profiler reports
every allocator it sees, so a host copy of a CUDA tensor (or a CUDA allocation on a CPU rank's thread) would
otherwise be summed into one device's peak. A CUDA device is measured with its caching allocator's own
counters instead (`torch.cuda.reset_peak_memory_stats` / `max_memory_allocated` / `memory_allocated` /
`memory_reserved` of that device): the peak is the highest allocated bytes above those allocated when the
window opened, and `reserved_bytes` what the caching allocator holds at its close (what the device really
lends out, rounding and fragmentation included); no attribution there.

Each allocation is attributed from its ancestors in the profiler's event tree: the outermost `phase()`
label around it, and what it belongs to (optimizer step, backward, a collective, else the top-level op:
e.g. `aten::clone` for a copied parameter). `MemoryTrace.at_peak` sums the allocations live at the peak
by that label, which tells where the peak's bytes came from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

T = TypeVar("T")
PHASE = "memtrace: "  # prefix of the record_function labels `phase` opens
# ancestor name prefixes that say what an allocation is for, checked innermost first
KINDS = (("Optimizer.step", "optimizer step"), ("Optimizer.zero_grad", "optimizer step"),
         ("autograd::engine::evaluate_function", "backward"), ("c10d::", "collective"))
UNSEEN_FREE = "free seen by address reuse"
UNTRACED = "no op (storage resize_)"  # e.g. ZeRO-3's gathers refill freed storages outside any op
MAX_TIMELINE = 2000  # points kept in `MemoryTrace.timeline`
# closers of the profiler windows open in this process that give way to a new one (plan_check.py's): the
# profiler is one per process, so this is the process's own state, not a channel between passes
OPEN_WINDOWS: set[Callable[[], None]] = set()


@dataclass
class Allocation:
    """One allocator event: signed bytes, time (ns since the window opened), attribution."""

    nbytes: int
    t_ns: int
    phase: str  # the outermost `phase()` label around it ("" outside any)
    what: str  # what it is for: optimizer step, backward, collective, or the top-level op
    ptr: int
    device: str = "cpu"  # the allocator's device ("cpu", "cuda:0")

    @property
    def label(self) -> str:
        return f"{self.phase}: {self.what}" if self.phase else self.what


@dataclass
class MemoryTrace:
    """What `track_memory` measured. Bytes are those allocated inside the window."""

    peak_bytes: int = 0
    final_bytes: int = 0  # still live when the window closed
    peak_t_ns: int = 0
    peak_label: str = ""  # the allocation that reached the peak
    at_peak: dict[str, int] = field(default_factory=dict)  # label -> bytes live at the peak
    phase_peaks: dict[str, int] = field(default_factory=dict)  # phase -> highest live bytes inside it
    timeline: list[tuple[int, int]] = field(default_factory=list)  # (ns, live bytes), thinned
    events: int = 0
    # frees inferred from address reuse (made on threads the profiler does not follow); such a block counts
    # as live until then, so the peak is an upper bound when this is not 0
    unseen_free_bytes: int = 0
    device: str = "cpu"  # the device measured
    reserved_bytes: int | None = None  # CUDA: what the caching allocator holds when the window closes

    def summary(self, top: int = 8) -> dict[str, Any]:
        """A JSON-friendly digest: peak, final, where the peak's bytes came from (largest first)."""
        items = sorted(self.at_peak.items(), key=lambda kv: -kv[1])
        return {"peak_bytes": self.peak_bytes, "final_bytes": self.final_bytes, "peak_label": self.peak_label,
                "at_peak": dict(items[:top]), "at_peak_other": sum(v for _, v in items[top:]),
                "phase_peaks": dict(self.phase_peaks), "events": self.events,
                "unseen_free_bytes": self.unseen_free_bytes, "device": self.device,
                "reserved_bytes": self.reserved_bytes}


def phase(name: str) -> contextlib.AbstractContextManager:
    """Label the allocations made inside (e.g. "compile", "step 1") for `MemoryTrace` attribution."""
    return record_function(PHASE + name)


def device_name(device: torch.device | str) -> str:
    """"cpu" or "cuda:i" (a bare "cuda" is the current device)."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def end_open_windows() -> None:
    """End the profiler windows that give way to a new one (OPEN_WINDOWS)."""
    for close in list(OPEN_WINDOWS):
        close()


@contextlib.contextmanager
def track_memory(device: torch.device | str = "cpu") -> Iterator[MemoryTrace]:
    """Measure live tensor bytes of the block on `device` (that device's allocations only); the yielded trace
    is filled in when the block exits."""
    name = device_name(device)
    trace = MemoryTrace(device=name)
    if torch.device(name).type == "cuda":
        with _cuda_window(name, trace):
            yield trace
        return
    end_open_windows()  # torch's profiler does not nest: an open plan-check window ends first
    # no with_stack: Python frames cost 2-4x the time, and with them the tree no longer links an
    # allocation to the record_function labels around it (phases and the optimizer step are lost)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield trace
    fill(trace, allocations(prof.profiler.kineto_results.experimental_event_tree(), name))


@contextlib.contextmanager
def _cuda_window(device: str, trace: MemoryTrace) -> Iterator[None]:
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    yield
    torch.cuda.synchronize(device)  # frees and allocations of queued kernels are settled
    trace.peak_bytes = max(0, torch.cuda.max_memory_allocated(device) - start)
    trace.final_bytes = max(0, torch.cuda.memory_allocated(device) - start)
    trace.reserved_bytes = torch.cuda.memory_reserved(device)


def measure_peak(fn: Callable[[], T], device: torch.device | str = "cpu") -> tuple[T, int, MemoryTrace]:
    """Run `fn()`; return its result, the peak of live tensor bytes it allocated on `device`, and the trace."""
    with track_memory(device) as trace:
        result = fn()
    return result, trace.peak_bytes, trace


def allocations(roots: list[Any], device: str = "cpu") -> list[Allocation]:
    """The allocator events on `device` in a profiler event tree (`experimental_event_tree()`), attributed,
    in time order (ns since the first of them)."""
    out: list[Allocation] = []
    top = ("", None, None)  # what a root's ancestors say: no phase, no kind, no op
    stack = [(root, top) for root in reversed(roots)]
    while stack:  # depth first, in recorded order, each node with its ancestors' attribution (`_below`)
        node, (phase, kind, op) = stack.pop()
        if node.tag == _EventType.Allocation and str(node.extra_fields.device) == device:
            ef = node.extra_fields
            out.append(Allocation(int(ef.alloc_size), node.start_time_ns, phase, kind or op or UNTRACED,
                                  int(ef.ptr), device))
        children = node.children
        if children:
            below = _below(node.name, phase, kind, op)
            stack.extend((child, below) for child in reversed(children))
    out.sort(key=lambda a: a.t_ns)  # stable: ties keep the recorded order
    t0 = out[0].t_ns if out else 0
    for a in out:
        a.t_ns -= t0
    return out


def _below(name: str, phase: str, kind: str | None, op: str | None) -> tuple[str, str | None, str | None]:
    """What the nodes under one named `name` inherit, from what its own ancestors say (phase: the outermost
    phase; kind: the innermost op that says what an allocation is for, KINDS; op: the outermost op): an
    allocation's (phase, what) is its phase and its kind, else its outermost op. Passed down the tree once,
    not walked up from every allocation."""
    if name.startswith(PHASE):
        return phase or name[len(PHASE):], kind, op
    if "::" in name or name.startswith("Optimizer."):
        return phase, next((k for prefix, k in KINDS if name.startswith(prefix)), None) or kind, op or name
    return phase, kind, op


def fill(trace: MemoryTrace, allocs: list[Allocation]) -> None:
    """Set `trace`'s peak, final bytes, attribution and timeline from one device's `allocations`."""
    live, peak_index, points = 0, -1, []
    for i, a in enumerate(_inside(allocs)):
        live += a.nbytes
        if a.what == UNSEEN_FREE:
            trace.unseen_free_bytes -= a.nbytes
        if a.phase:
            trace.phase_peaks[a.phase] = max(trace.phase_peaks.get(a.phase, 0), live)
        points.append((a.t_ns, live))
        if live > trace.peak_bytes:
            trace.peak_bytes, trace.peak_t_ns, trace.peak_label, peak_index = live, a.t_ns, a.label, i
    trace.final_bytes, trace.events = live, len(points)
    if peak_index >= 0:
        # replayed once for the peak only: a snapshot at every new maximum would be quadratic
        for nbytes, label in _live_at(allocs, peak_index).values():
            trace.at_peak[label] = trace.at_peak.get(label, 0) + nbytes
    step = max(1, len(points) // MAX_TIMELINE)
    trace.timeline = points[::step]
    if peak_index >= 0 and peak_index % step:
        trace.timeline = sorted(trace.timeline + [points[peak_index]])
    if points and (len(points) - 1) % step:
        trace.timeline.append(points[-1])


def _inside(allocs: list[Allocation]) -> Iterator[Allocation]:
    """The events of blocks allocated inside the window: a free of an earlier block (one the allocator still
    knows the size of, e.g. from a previous window) is skipped, so the sum is never below zero. An address
    handed out again while its block still counts as live was freed where the profiler does not look (gloo's
    worker thread drops the last reference of a finished collective's tensors): that free is applied then,
    as an event with `what == UNSEEN_FREE`."""
    sizes: dict[int, int] = {}
    for a in allocs:
        if a.nbytes > 0:
            old = sizes.get(a.ptr)
            if old is not None:
                yield Allocation(-old, a.t_ns, a.phase, UNSEEN_FREE, a.ptr, a.device)
            sizes[a.ptr] = a.nbytes
            yield a
        elif sizes.pop(a.ptr, None) is not None:
            yield a


def _live_at(allocs: list[Allocation], index: int) -> dict[int, tuple[int, str]]:
    """Blocks live right after the `index`-th event of `_inside(allocs)`, by pointer."""
    live: dict[int, tuple[int, str]] = {}
    for i, a in enumerate(_inside(allocs)):
        if i > index:
            break
        if a.nbytes > 0:
            live[a.ptr] = (a.nbytes, a.label)
        else:
            del live[a.ptr]
    return live


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind `tensors` (an iterable of tensors), each counted once."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = getattr(t, "_local_tensor", t)
        s = local.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


__all__ = ["Allocation", "MemoryTrace", "allocations", "device_name", "fill", "measure_peak", "phase", "tensor_bytes",
           "track_memory"]
