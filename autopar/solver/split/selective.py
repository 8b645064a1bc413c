"""Selective recompute: a stage recomputes only its first k blocks where that fits and is faster.

The search's option ladder (`split.Splitter.ranked`) has recompute off or all of a stage's blocks; with
thousands of configs and ranges, every k would multiply its table by the block count. `selective` refines
a solved split instead (the search applies it to the configs it re-solves, `search.Search._refine`): for a
stage that recomputes all its blocks, recomputing the first k costs k blocks' forward again in the backward
(`stage_memory.recomputed`) and keeps the other blocks' activations, so its time grows and its memory
shrinks with k. Per ZeRO level and offload set whose no-recompute option is faster than the stage's
choice, the smallest k with which the device still fits (all its chunks together, `split.rank_fits`) is
found by bisection; the fastest of these replaces the choice. The ranges stay; the simulator judges the
result like any candidate. The runtime runs `Stage.recompute = k` as priced (runtime/program.py, tests in
tests/test_selective_recompute.py).
"""

from __future__ import annotations

from ..pricing.pricing import Option, StageMemory
from .split import Choice, Slot, Split, Splitter, priced_surrogate, rank_fits


def _with_k(splitter: Splitter, slot: Slot, a: int, e: int, n: int, opt: Option, k: int,
            others: list[StageMemory]) -> Choice | None:
    """Layers [a, e) on `slot` with `opt`'s ZeRO and offload recomputing its first k blocks, if its device
    fits with its other chunks (`others`)."""
    cm = splitter.cm
    base = cm.base(a, e, slot.dtype, n, slot.tp_group)
    option = Option(opt.zero, k, opt.offload)
    tm = cm.stage_times(base, option, slot.dtype, slot.tp_group, slot.dp_group, slot.sigs[1], slot.layerwise,
                        slot.mixed_tp)
    mem = cm.stage_memory(base, option, len(slot.tp_group), len(slot.dp_group), slot.layerwise)
    fits = rank_fits(others + [mem], slot.inflight, slot, slot.microbatches)
    return Choice(option, tm, mem, base.out_bytes) if fits else None


def _smallest_k(splitter: Splitter, slot: Slot, a: int, e: int, n: int, opt: Option, blocks: int,
                others: list[StageMemory]) -> Choice | None:
    """The choice with the fewest recomputed blocks (1..blocks-1) that fits, by bisection; None if none."""
    lo, hi, found = 1, blocks - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        got = _with_k(splitter, slot, a, e, n, opt, mid, others)
        if got is None:
            lo = mid + 1
        else:
            found, hi = got, mid - 1
    return found


def selective(splitter: Splitter, slots: list[Slot], split: Split, m: int, n: int, chunks: int) -> Split:
    """`split` with each stage that recomputes all its blocks recomputing only its first k where that is
    faster and its device still fits (module docstring). Ranges are kept."""
    cm, p = splitter.cm, len(slots) // chunks
    stages = list(split.stages)
    changed = False
    for j, (a, e, c) in enumerate(stages):
        blocks = sum(cm.is_block[a:e])
        if c.option.recompute is not True or blocks < 2:
            continue
        others = [stages[i][2].memory for i in range(j % p, len(stages), p) if i != j]
        best, best_cost = c, m * (c.times.fwd + c.times.bwd) + c.times.sync
        for cost, opt, _, _ in splitter.ranked(slots[j], a, e, m, n):
            if cost >= best_cost:
                break  # sorted: this option and every later one are no faster, with any k
            if opt.recompute is not False:
                continue
            found = _smallest_k(splitter, slots[j], a, e, n, opt, blocks, others)
            if found is not None:
                k_cost = m * (found.times.fwd + found.times.bwd) + found.times.sync
                if k_cost < best_cost * (1 - 1e-12):
                    best, best_cost = found, k_cost
        if best is not c:
            stages[j] = (a, e, best)
            changed = True
    if not changed:
        return split
    return Split(stages, priced_surrogate(cm, slots, stages, chunks, m))


__all__ = ["selective"]
