"""Speculative solves: the search's configurations solved ahead on forked worker processes, taken in order.

The branch and bound of search.py visits configurations in a fixed order (their lower bounds, which do not
depend on what is solved) and solves each with the incumbent's step as its cutoff; a solve is a pure function of
the configuration and that cutoff (every cache on the way memoises a pure computation). So the search can run on
several cores and still give the plan the one-process search gives, on any machine and under any load:

  * workers, forked from the searching process once its configurations and their bounds are built (so they start
    with its caches), solve configurations ahead of the search, each with the cutoff it is predicted to get: the
    incumbent's step now, lowered by every result already back for a configuration before it that beats it;
  * the search takes the results in its own order and uses one only if it was solved with the cutoff the
    one-process search gives it (the incumbent after every configuration before it), else has it solved again
    with that cutoff. The incumbent changes rarely, so nearly every result computed ahead is used (OPT-350M's
    shape on 16 mixed GPUs: 8 incumbents in 488 solves, ~500 solved);
  * a result that sets a new incumbent comes back with its plan (built in the worker), so the search never solves
    a configuration twice to build one; a result comes back with the warnings its solve raised (the wall-clock
    guard cutting a CP-SAT solve), raised again when the search takes it, so the caller is told what the
    one-process search tells;
  * the refinement (`Search._refine`) goes the same way: its finalists' two passes (splits with selective
    recompute, then the CP-SAT stage model) are solved ahead on the same workers (`restart`), keyed by how they
    are solved; finalists with several pipeline classes (a batch split between passes) are solved in the search's
    process.

Each grouping belongs to the first worker given one of its configurations (its caches then hold that grouping's
ranges and splits); a free worker takes the next configuration of its own groupings within LOOKAHEAD, else of a
grouping nobody has yet, else any. A worker that dies or raises hands its configuration back: the search solves
it in its own process (raising there, as the one-process search does, if the solve itself fails). The workers'
wall clock is the planning run's guard, which the search checks as before; workers still solving when the search
ends are stopped (what they solve then is past the search's last configuration). An interrupt (Ctrl-C) is the
searching process's: workers ignore it and are stopped with the search.

Used where it can pay and is safe (`workers_for`): on Linux (fork after torch's import, as torch's DataLoader
does; the workers touch no accelerator), not inside a torch.distributed process group (a rank's peers and threads,
and the ranks' cores are taken), with at least two cores, and at least PARALLEL_MIN_CONFIGS configurations (small
searches end before workers would pay for their start).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import pickle
import signal
import sys
import warnings
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

PARALLEL_MIN_CONFIGS = 200  # configurations a search needs before it forks workers
MAX_WORKERS = 4
AHEAD_PER_WORKER = 3  # configurations dispatched to a worker at once (one solving, the others in its pipe)
# the refinement's: one at a time, so that each is sent with the cutoff of every result before it that is back
# (its passes are few and some take a second of CP-SAT; GPT-3 175B's second finalist's stage model had been sent
# before the first pass of it, which lowered its cutoff, came back: solved twice)
AHEAD_REFINING = 1
LOOKAHEAD = 64  # how far ahead of the search a free worker looks for a configuration of its own groupings

# (key, bound, cutoff) -> (step or None, plan built when step < cutoff, else None); a key names what to solve
Solve = Callable[[Hashable, float, float], tuple[float | None, Any]]


def workers_for(configs: int, requested: int | None) -> int:
    """Worker processes for a search of `configs` configurations: `requested` where given (0 or 1: none), else
    as the module docstring says (0 where it would not pay or would not be safe)."""
    if requested is not None:
        return requested if requested > 1 and _can_fork() else 0
    if configs < PARALLEL_MIN_CONFIGS or not _can_fork() or _in_process_group():
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(MAX_WORKERS, cores) if cores > 1 else 0


def _can_fork() -> bool:
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def _in_process_group() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return False
    return dist.is_available() and dist.is_initialized()


def _serve(conn: Connection, solve: Solve) -> None:
    """A worker's loop: (key, bound, cutoff) in, (key, cutoff, (step, plan, warnings), error) out; None ends it.
    The warnings a solve raised go back with its result (the search raises them when it takes it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt is the searching process's to handle
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        i, bound, cutoff = task
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step, plan = solve(i, bound, cutoff)
            said = [(str(w.message), w.category) for w in caught]
            conn.send((i, cutoff, (step, plan, said), None))
        except Exception as e:  # the search solves it itself and raises there
            conn.send((i, cutoff, None, repr(e)))


class _Worker:
    def __init__(self, ctx: Any, solve: Solve) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, solve), daemon=True)
        self.process.start()
        child.close()
        self.queued: deque[tuple[Hashable, float]] = deque()  # (key, cutoff) sent and not answered yet
        self.alive = True

    def send(self, i: Hashable, bound: float, cutoff: float) -> bool:
        try:
            self.conn.send((i, bound, cutoff))
        except (OSError, ValueError, pickle.PicklingError):
            self.alive = False
            return False
        self.queued.append((i, cutoff))
        return True

    def close(self) -> None:
        # what it may still be solving is speculation past the search's end: stopped, not waited for
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5.0)
        self.conn.close()


class Speculative:
    """Configurations solved ahead on `n` forked workers (module docstring). `order` yields (key, bound) in the
    search's visiting order (the bounds it solves with), computed apart from the search's own queue; `grouping(key)`
    names a configuration's grouping; `solve` is the search's solve, run in the workers and, for what they hand
    back, here. `restart` gives a new order (the refinement's solves) to the same workers."""

    def __init__(self, n: int, order: Iterator[tuple[Hashable, float]], grouping: Callable[[Hashable], int],
                 solve: Solve) -> None:
        self.order = order
        self.grouping = grouping
        self.solve = solve
        self.ahead: deque[tuple[Hashable, float]] = deque()  # visiting order after the last configuration taken
        # (key, cutoff) -> (step, plan, the warnings its solve raised)
        self.results: dict[tuple[Hashable, float], tuple[float | None, Any, list]] = {}
        self.sent: set[tuple[Hashable, float]] = set()
        self.failed: set[tuple[Hashable, float]] = set()  # a worker raised: solved here
        self.owner: dict[int, _Worker] = {}  # grouping -> the worker whose caches hold it
        self.depth = AHEAD_PER_WORKER  # configurations sent to a worker at once
        ctx = multiprocessing.get_context("fork")
        self.workers = [_Worker(ctx, solve) for _ in range(n)]

    def restart(self, order: Iterable[tuple[Hashable, float]], depth: int = AHEAD_REFINING) -> None:
        """Solve ahead in `order` from now on (what was ahead is dropped; results already back are kept), sending
        each worker at most `depth` at a time."""
        self.order = iter(order)
        self.ahead.clear()
        self.depth = depth

    def result(self, i: Hashable, bound: float, cutoff: float) -> tuple[float | None, Any]:
        """Configuration i's (step, plan) solved with `cutoff` (the search takes configurations in `order`):
        computed ahead (the warnings its solve raised raised again here), or waited for, or solved here."""
        self._fill(1)
        while self.ahead and self.ahead.popleft()[0] != i:
            self._fill(1)
        key = (i, cutoff)
        while key not in self.results:
            if key in self.failed or (key not in self.sent and not self._dispatch(i, bound, cutoff)):
                self.failed.discard(key)
                return self.solve(i, bound, cutoff)  # raises here if the solve raises
            self._feed(cutoff)
            self._receive()
        step, plan, said = self.results.pop(key)
        for message, category in said:
            warnings.warn(message, category, stacklevel=4)
        return step, plan

    def close(self) -> None:
        for w in self.workers:
            w.close()

    # -- internals --
    def _fill(self, k: int, cutoff: float = math.inf) -> None:
        """Pull the visiting order into `ahead` up to k configurations, and not past one whose bound reaches
        `cutoff` (the incumbent's step, which only falls): the search solves no such configuration (its loop goes
        in increasing bound order and stops at the first, its refinement skips them), and the search loop's
        order computes a memory bound for each configuration it yields."""
        while len(self.ahead) < k:
            if self.ahead and self.ahead[-1][1] >= cutoff:
                return
            nxt = next(self.order, None)
            if nxt is None:
                return
            self.ahead.append(nxt)

    def _dispatch(self, i: Hashable, bound: float, cutoff: float) -> bool:
        """Send configuration i to a worker (the least loaded, one that knows its grouping first)."""
        live = [w for w in self.workers if w.alive]
        if not live:
            return False
        g = self.grouping(i)
        w = self.owner.get(g)
        if w is None or not w.alive:
            w = self.owner[g] = min(live, key=lambda w: len(w.queued))
        if not w.send(i, bound, cutoff):
            self._hand_back(w)
            return self._dispatch(i, bound, cutoff)
        self.sent.add((i, cutoff))
        return True

    def _predicted(self, cutoff: float) -> list[tuple[Hashable, float, float]]:
        """The configurations ahead as (index, bound, cutoff it will be solved with): the incumbent's step now,
        lowered by each result already back ahead of it that beats the step before it (exact unless a result
        not yet back sets an incumbent in between)."""
        out = []
        for i, b in self.ahead:
            out.append((i, b, cutoff))
            got = self.results.get((i, cutoff))
            if got is not None and got[0] is not None and got[0] < cutoff:
                cutoff = got[0]
        return out

    def _feed(self, cutoff: float) -> None:
        """Keep the free workers busy with the configurations ahead, each solved with its predicted cutoff."""
        for w in self.workers:
            if not w.alive or len(w.queued) >= self.depth:
                continue
            self._fill(LOOKAHEAD, cutoff)
            taken = self.sent | self.failed | self.results.keys()
            # (a configuration whose bound reaches its predicted cutoff is one the search never solves: the cutoff
            # it gets is no higher)
            todo = [x for x in self._predicted(cutoff) if (x[0], x[2]) not in taken and x[1] < x[2]]
            if not todo:
                return
            mine = next((x for x in todo if self.owner.get(self.grouping(x[0])) is w), None)
            new = next((x for x in todo if self.grouping(x[0]) not in self.owner), None)
            i, b, c = mine or new or todo[0]
            self.owner.setdefault(self.grouping(i), w)
            if w.send(i, b, c):
                self.sent.add((i, c))
            else:
                self._hand_back(w)

    def _hand_back(self, w: _Worker) -> None:
        """A worker found dead (its answer or a send failed): what it was sent and did not answer is solved
        here. Left in `sent`, a configuration whose worker died before a send noticed would be waited for
        forever (`result` looped without a live worker to answer it)."""
        w.alive = False
        for key in w.queued:
            self.sent.discard(key)
            self.failed.add(key)
        w.queued.clear()

    def _receive(self) -> None:
        """Wait for answers; a worker that died hands back what it was sent (solved here)."""
        live = {w.conn: w for w in self.workers if w.alive and w.queued}
        if not live:
            return
        for conn in wait(list(live)):
            w = live[conn]
            try:
                i, cutoff, got, error = conn.recv()
            except (EOFError, OSError):
                self._hand_back(w)
                continue
            w.queued.popleft()
            self.sent.discard((i, cutoff))
            if error is None:
                self.results[(i, cutoff)] = got
            else:
                self.failed.add((i, cutoff))


__all__ = ["AHEAD_REFINING", "PARALLEL_MIN_CONFIGS", "Speculative", "workers_for"]
