"""One pipeline step simulated from per-stage times: the planner's hot path and `Plan.simulate`'s engine.

A stage's times are the tuple (fwd, fwd_small, bwd, bwd_small, send, sync[, bwd_w]) of `simulate_stages`
(plan.py's `stage_times` reads them off a `Stage`'s predictions). Nothing here knows a `Plan`: plan.py's
`simulate_pipeline` runs `simulate_times` on a plan's lowered schedule, and the search calls
`simulated_step_time` (memoised) on the times it prices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from .schedule import Schedule, make_schedule
from .simulate import WGRAD_FRACTION, SimResult, simulate, step_time


@functools.lru_cache(maxsize=64)
def cached_schedule(name: str, ranks: int, microbatches: int, chunks: int) -> Schedule:
    """`make_schedule`, memoised: the planner simulates many replicas of few shapes. Do not mutate."""
    return make_schedule(name, ranks, microbatches, chunks)


def simulate_stages(schedule: str, chunks: int, batch_share: int, num_microbatches: int,
                    times: list[tuple[float, float, float, float, float, float]]) -> SimResult:
    """Simulate one step of a pipeline whose stage j takes times[j] = (fwd, fwd_small, bwd, bwd_small,
    send, sync[, bwd_w]): fwd/bwd of a full micro-batch, of a one-sample-smaller one, the activation transfer
    to stage j + 1, the end-of-step gradient sync and, optionally, the weight-gradient part of the full bwd
    (what a zero-bubble schedule's W takes; `wgrad_times`)."""
    sched = cached_schedule(schedule, len(times) // chunks, num_microbatches, chunks)
    return simulate_times(sched, batch_share, num_microbatches, times)


def simulate_times(sched: Schedule, batch_share: int, num_microbatches: int, times: Sequence[Sequence[float]],
                   gather: Sequence[float] | None = None, reduce: Sequence[float] | None = None,
                   memory: dict[Any, float] | None = None) -> SimResult:
    """`simulate` of `sched` with `simulate_stages`' per-stage times; with memory actions in `sched`, F and B
    lose the stage's `gather` (and B its `reduce`) seconds, which its memory actions take (`memory`:
    seconds by (kind, stage), `lowering.priced_schedule`)."""
    return simulate(sched, **_arguments(batch_share, num_microbatches, times, gather, reduce, memory))


def _arguments(batch_share: int, num_microbatches: int, times: Sequence[Sequence[float]],
               gather: Sequence[float] | None = None, reduce: Sequence[float] | None = None,
               memory: dict[Any, float] | None = None) -> dict[str, Any]:
    """`simulate`'s keyword arguments for `simulate_times`."""
    r = batch_share % num_microbatches  # micro-batches 0..r-1 are the full ones (all when r == 0)
    full = [r == 0 or i < r for i in range(num_microbatches)]
    g = gather or [0.0] * len(times)
    rd = reduce or [0.0] * len(times)
    bwd = lambda s, m: (times[s][2] if full[m] else times[s][3]) - g[s] - rd[s]  # noqa: E731
    return dict(
        fwd_time=lambda s, m: (times[s][0] if full[m] else times[s][1]) - g[s],
        bwd_time=bwd,
        # the gradient going back from stage s to s-1 has the size of the activation s-1 sent forward
        p2p_time=lambda src, dst: times[min(src, dst)][4],
        allreduce_time=[t[5] for t in times],
        memory_time=(lambda a: memory.get((a.kind, a.stage), 0.0)) if memory else 0.0,
        wgrad_time=wgrad_times(times, bwd),
    )


def wgrad_times(times: Sequence[Sequence[float]], bwd: Callable[[int, int], float]
                ) -> Callable[[int, int], float] | None:
    """W's seconds f(stage, micro-batch) from the stages' optional 7th time (bwd_w of a full micro-batch, as
    a share of its bwd for the smaller ones); None (simulate's default share) when no stage has one."""
    if all(len(t) < 7 for t in times):
        return None
    share = [t[6] / t[2] if len(t) > 6 and t[2] > 0 else WGRAD_FRACTION for t in times]
    return lambda s, m: share[s] * bwd(s, m)


def simulated_step_time(schedule: str, chunks: int, batch_share: int, num_microbatches: int,
                        times: list[tuple[float, float, float, float, float, float]]) -> float:
    """`simulate_stages(...).step_time`, memoised: the planner meets the same stage times in many
    configurations, and keeps only the step time (not the events)."""
    return _step_time(schedule, chunks, batch_share, num_microbatches, tuple(tuple(t) for t in times))


@functools.lru_cache(maxsize=8192)
def _step_time(schedule: str, chunks: int, batch_share: int, num_microbatches: int,
               times: tuple[tuple[float, ...], ...]) -> float:
    # `simulate_stages(...).step_time`, without recording the events
    sched = cached_schedule(schedule, len(times) // chunks, num_microbatches, chunks)
    return step_time(sched, **_arguments(batch_share, num_microbatches, times))


__all__ = ["cached_schedule", "simulate_stages", "simulate_times", "simulated_step_time", "wgrad_times"]
