"""The intra-op ILP itself (`intra_op.build` builds the problems): one-hot strategy choices, linearized products
for resharding edges, an optional memory budget; solved with CP-SAT. The formulation is in `intra_op`'s
docstring. Also the cache of answers across calls (`cached`: `intra_op.solve_intra_op`'s solutions and
`intra_op.pricing.LayerPricer`'s choices, by layer signature) and its counters (`cache_info`, `clear_cache`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ...errors import InfeasibleError, PlanError
from .. import budget
from .problem import Problem, Shared

if TYPE_CHECKING:
    from ortools.sat.python import cp_model

T = TypeVar("T")

# Answers by problem key (`cached`), the least recently used dropped beyond CACHE_ENTRIES: a long-lived process
# (a notebook, a test worker) planning many models keeps a bounded amount, while one search (a few hundred layer
# signatures at most) keeps all of its own.
CACHE: OrderedDict[tuple, Any] = OrderedDict()
CACHE_ENTRIES = 4096
STATS = {"ilp_solves": 0, "hits": 0, "misses": 0}


def cached(key: tuple, compute: Callable[[], T]) -> T:
    """CACHE[key], computed by `compute` and stored on a miss (a `compute` that raises stores nothing);
    hits and misses are counted in STATS."""
    if key in CACHE:
        STATS["hits"] += 1
        CACHE.move_to_end(key)
        return CACHE[key]
    STATS["misses"] += 1
    CACHE[key] = value = compute()
    while len(CACHE) > CACHE_ENTRIES:
        CACHE.popitem(last=False)
    return value


def cache_keys() -> set[tuple]:
    """The keys CACHE holds now (`cache_entries_since`)."""
    return set(CACHE)


def cache_entries_since(keys: set[tuple]) -> list[tuple[tuple, Any]]:
    """CACHE's (key, answer) entries whose key is not in `keys` (what was computed since `cache_keys`)."""
    return [(k, v) for k, v in CACHE.items() if k not in keys]


def add_to_cache(entries: Sequence[tuple[tuple, Any]]) -> None:
    """Answers computed elsewhere (another process's `cache_entries_since`: every key names all its problem
    depends on, so an answer is the one `cached` would compute here) into CACHE, where absent; not counted in
    STATS."""
    for key, value in entries:
        if key not in CACHE:
            CACHE[key] = value
    while len(CACHE) > CACHE_ENTRIES:
        CACHE.popitem(last=False)


def cache_info() -> dict[str, int]:
    """Counters of the solution cache: ILP solves run, cache hits and misses (per layer signature)."""
    return {**STATS, "entries": len(CACHE)}


def clear_cache() -> None:
    CACHE.clear()
    for k in STATS:
        STATS[k] = 0


def _one_hot(model: cp_model.CpModel, n: int) -> list:
    xs = [model.new_bool_var("") for _ in range(n)]
    model.add_exactly_one(xs)
    return xs


def _linearize(model: cp_model.CpModel, xu: list, xv: list) -> list[list]:
    e = [[model.new_bool_var("") for _ in xv] for _ in xu]
    for i, row in enumerate(e):
        model.add(sum(row) == xu[i])
    for j in range(len(xv)):
        model.add(sum(row[j] for row in e) == xv[j])
    return e


def _needed(model: cp_model.CpModel, xs: list[list], g: Shared) -> list:
    """Per producer strategy i, a variable that is 1 when the producer runs i and some reader needs the
    shared resharding (z >= s[u,i] + sum of that reader's strategies needing it - 1, for every reader); the
    objective keeps it at 0 otherwise."""
    zs = []
    for i in range(len(g.seconds)):
        z = model.new_bool_var("")
        on = xs[g.producer][i] if g.producer is not None else 1
        for v, part in g.readers:
            if part:
                model.add(z >= on + sum(xs[v][j] for j in part) - 1)
        zs.append(z)
    return zs


def _memory_limit(model: cp_model.CpModel, terms: list, budget: float) -> None:
    model.add(sum(terms) <= int(budget))


def solve_problems(problems: Sequence[tuple[Problem, int]], memory_budget: float | None = None,
                   time_limit_s: float = 10.0) -> list[tuple[int, ...]]:
    """Optimal strategy index per group of each problem; problem k's costs and memory count `weight` times."""
    from ortools.sat.python import cp_model  # here: a rank that only trains never imports OR-tools (0.3 s)

    model = cp_model.CpModel()
    cost_terms: list = []
    mem_terms: list = []
    tie_terms: list = []
    const_mem = 0
    xs_all = []
    for prob, weight in problems:
        xs = [_one_hot(model, len(c)) for c in prob.cost]
        xs_all.append(xs)
        const_mem += weight * prob.const_memory
        for x, c, m in zip(xs, prob.cost, prob.memory, strict=True):
            cost_terms += [weight * ci * xi for ci, xi in zip(c, x, strict=True)]
            mem_terms += [weight * mi * xi for mi, xi in zip(m, x, strict=True)]
            tie_terms += [i * xi for i, xi in enumerate(x)]
        for (u, v), mat in prob.edges.items():
            if not any(any(row) for row in mat):
                continue
            e = _linearize(model, xs[u], xs[v])
            cost_terms += [weight * mat[i][j] * e[i][j] for i in range(len(mat)) for j in range(len(mat[0]))]
        for g in prob.shared:
            cost_terms += [weight * c * z for c, z in zip(g.cost, _needed(model, xs, g), strict=True)]
    if memory_budget is not None:
        _memory_limit(model, [*mem_terms, const_mem], memory_budget)
    w = 1 + sum(len(x) - 1 for xs in xs_all for x in xs)
    model.minimize(w * sum(cost_terms) + sum(tie_terms))
    # one worker, a fixed seed and a deterministic time limit: the same strategies under any load (the wall-clock
    # limit only guards, and warns where it cuts the solve: budget.py)
    solver = budget.cpsat(time_limit_s, None)
    status = budget.solve(solver, model, "the intra-op sharding ILP")
    STATS["ilp_solves"] += 1
    if status == cp_model.INFEASIBLE:
        raise InfeasibleError("no sharding strategy fits the memory budget")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise PlanError(f"the intra-op ILP found no solution within {time_limit_s} s; raise time_limit_s.")
    return [tuple(next(i for i, xi in enumerate(x) if solver.boolean_value(xi)) for x in xs) for xs in xs_all]


__all__ = ["CACHE", "STATS", "add_to_cache", "cache_entries_since", "cache_info", "cache_keys", "cached", "clear_cache",
           "solve_problems"]
