"""memtrace measures live tensor bytes exactly: the requested sizes, no allocator rounding."""

from __future__ import annotations

import torch

from autopar.runtime.memtrace import measure_peak, phase, track_memory


def test_peak_and_final_are_the_known_live_bytes() -> None:
    def work() -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 B
        b = torch.empty(250, 4, dtype=torch.float64)  # 8000 B
        view = b[:10].t()  # views allocate nothing
        del a
        c = torch.empty(3, dtype=torch.uint8)  # 3 B: the requested size, not the 64-byte aligned block
        return view, c

    (view, c), peak, trace = measure_peak(work)
    assert peak == 4000 + 8000
    assert trace.final_bytes == 8000 + 3
    assert view.untyped_storage().nbytes() == 8000 and c.nbytes == 3


def test_storage_resize_counts_as_free_and_alloc() -> None:
    # ZeRO-3 frees a parameter's storage with resize_(0) and brings it back with resize_
    p = torch.nn.Parameter(torch.zeros(100))  # allocated before the window: not counted
    with track_memory() as trace:
        p.untyped_storage().resize_(0)  # its free is not reported either (allocated before)
        p.untyped_storage().resize_(400)
        q = torch.zeros(50)
        q.untyped_storage().resize_(0)
        r = torch.ones(10)
    assert trace.peak_bytes == 400 + 200
    assert trace.final_bytes == 400 + 40
    assert r.sum() == 10


def test_attribution_at_peak_by_phase_and_kind() -> None:
    model = torch.nn.Linear(64, 32)
    x = torch.randn(8, 64)
    with track_memory() as trace:
        with phase("setup"):
            opt = torch.optim.AdamW(model.parameters())
            keep = torch.empty(1000)  # 4000 B, live to the end
        with phase("step"):
            model(x).sum().backward()
            opt.step()
    n = sum(p.numel() for p in model.parameters()) * 4
    summary = trace.summary(top=100)
    assert summary["at_peak"]["setup: aten::empty"] == 4000
    # AdamW's exp_avg and exp_avg_sq, allocated lazily in the first step
    assert trace.at_peak.get("step: optimizer step", 0) >= 2 * n
    assert trace.at_peak.get("step: backward", 0) >= n  # the gradients
    assert sum(trace.at_peak.values()) == trace.peak_bytes
    assert trace.phase_peaks["step"] == trace.peak_bytes >= 4000 + 3 * n
    assert keep.numel() == 1000
    assert trace.timeline[-1][1] == trace.final_bytes
    assert max(b for _, b in trace.timeline) == trace.peak_bytes


def test_frees_of_blocks_from_before_the_window_are_not_subtracted() -> None:
    with track_memory() as first:
        old = torch.empty(500)  # 2000 B, allocated in the first window
    assert first.peak_bytes == first.final_bytes == 2000
    with track_memory() as second:
        del old  # the allocator reports this free (it knows the size), but the block is not this window's
        new = torch.empty(10)
    assert second.peak_bytes == second.final_bytes == 40
    assert min(b for _, b in second.timeline) >= 0 and new.numel() == 10
