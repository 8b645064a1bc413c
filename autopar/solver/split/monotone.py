"""Searching a monotone predicate over integers: what the greedy layer split (split.py) uses to find the
longest range a stage can take (costs and memory grow with the range, so "fits" is true up to a point)."""

from __future__ import annotations

from collections.abc import Callable


def largest_true(ok: Callable[[int], bool], lo: int, hi: int, guess: int) -> int | None:
    """The largest e in [lo, hi] with ok(e), for ok true up to some point and false after it; None when
    ok(lo) is false. Gallops from `guess` (clamped) and bisects the bracket it finds."""
    if lo > hi:
        return None
    g = min(max(guess, lo), hi)
    if ok(g):
        good, step = g, 1
        while good < hi and ok(min(good + step, hi)):
            good, step = min(good + step, hi), step * 2
        bad = min(good + step, hi + 1)  # ok(bad) false, or past hi
    else:
        bad, step = g, 1
        while bad > lo:
            cand = max(bad - step, lo)
            if ok(cand):
                break
            bad, step = cand, step * 2
        else:
            return None
        good = cand
    while bad - good > 1:
        mid = (good + bad) // 2
        if ok(mid):
            good = mid
        else:
            bad = mid
    return good


__all__ = ["largest_true"]
