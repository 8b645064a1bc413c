"""The planner's budgets: work budgets decide the plan, the wall clock only guards.

Every limit that can end a part of the search early is counted work, the same on any machine: the search's
configurations (`search.WORK_LIMIT`) and CP-SAT's deterministic time (`max_deterministic_time`, with one worker
and a fixed seed). The wall clock (`time_limit_s` of `autopar.plan` / `search`) is one outer safety limit,
`WallGuard`: the search loop and its refinement check it, and every CP-SAT solve gets the guard's time left as
its `max_time_in_seconds` (at least GUARDED_FLOOR_S; solves outside a search: WALL_FLOOR_S, or UNGUARDED_FACTOR
times their deterministic limit, whichever is larger). Wherever the guard ends something before its work budget,
the planner warns (`solve` here, `Search.run`, `Search._refine`): that plan depends on the machine's speed and
load.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

# wall-clock limit of a CP-SAT solve that no planning guard covers (a stage model solved on its own): at least
# this, and UNGUARDED_FACTOR times its deterministic limit; only a guard, it warns when it cuts a solve short
WALL_FLOOR_S = 60.0
UNGUARDED_FACTOR = 10.0
GUARDED_FLOOR_S = 1.0  # the least wall-clock time a guarded solve gets
RAISE = "raise time_limit_s (autopar.plan / search) for a plan that does not depend on the machine's load"


class WallGuard:
    """The wall-clock safety limit of one planning run: `seconds` from its creation."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.perf_counter() + seconds

    def left(self) -> float:
        """Seconds to the deadline, 0 once it has passed."""
        return max(0.0, self.deadline - time.perf_counter())

    def passed(self) -> bool:
        return time.perf_counter() > self.deadline


def loop_stopped(guard: WallGuard, done: int, total: int, what: str) -> None:
    """Warn that `guard` ended a loop of searches (over device subsets, cp or ep degrees) after `done` of its
    `total` searches of `what`: the plan returned then depends on the machine's speed and load."""
    warnings.warn(f"planning stopped at the wall-clock guard ({guard.seconds:.3g} s) after {done} of the "
                  f"{total} {what}: this plan depends on the machine's speed and load; {RAISE}.", stacklevel=4)


def wall_limit(deterministic_s: float, guard: WallGuard | None) -> float:
    """The wall-clock seconds a CP-SAT solve of `deterministic_s` deterministic seconds may run: the guard's time
    left, at least GUARDED_FLOOR_S (a search past its guard still solves until it has a plan), else the
    unguarded limit."""
    if guard is None:
        return max(WALL_FLOOR_S, UNGUARDED_FACTOR * deterministic_s)
    return max(GUARDED_FLOOR_S, guard.left())


def cpsat(deterministic_s: float, guard: WallGuard | None, gap: float | None = None) -> Any:
    """A CP-SAT solver as the planner runs it: one worker, seed 0 (deterministic), `deterministic_s` of
    deterministic time, the guard's wall-clock limit (`wall_limit`) and, where given, the relative gap."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.num_workers = 1
    prm.random_seed = 0
    prm.max_deterministic_time = deterministic_s
    prm.max_time_in_seconds = wall_limit(deterministic_s, guard)
    if gap is not None:
        prm.relative_gap_limit = gap
    return solver


def solve(solver: Any, model: Any, what: str) -> int:
    """`solver.solve(model)`, warning where the wall-clock limit, not the deterministic one, ended it before it
    proved optimality or infeasibility: then the answer depends on the machine's speed and load. `what` names the
    solve in the warning."""
    from ortools.sat.python import cp_model

    status = solver.solve(model)
    prm, spent = solver.parameters, solver.deterministic_time
    if status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE, cp_model.MODEL_INVALID) \
            and spent < prm.max_deterministic_time:
        warnings.warn(f"planning stopped at the wall-clock guard: {what} ran out of its "
                      f"{prm.max_time_in_seconds:.3g} s of wall-clock time after {spent:.3g} of "
                      f"its {prm.max_deterministic_time:g} deterministic seconds, so this plan depends on the "
                      f"machine's speed and load; {RAISE}.", stacklevel=3)
    return status


__all__ = ["GUARDED_FLOOR_S", "RAISE", "UNGUARDED_FACTOR", "WALL_FLOOR_S", "WallGuard", "cpsat", "loop_stopped",
           "solve", "wall_limit"]
