"""The joint stage model: every pipeline class's split and options and the integer batch shares in one model.

Where a config's replicas differ (by-type groupings: pipeline class c on its own device type, k_c replicas
of it), the step is the slowest replica's, and how the batch B is shared decides which that is. The search's
inner loop decides shares and splits apart (`search.Search._batch_split`: a table of one split per share);
this model decides them together, over the stage model's tables (stage_model.py) of every class at every
candidate share:

    variables   y[c,s] in {0,1}       class c's replicas run s samples each (the larger share, s in S_c)
                z_c in {0,1}, l_c in [0, k_c - 1]   l_c of them run s - 1 instead (z_c: l_c > 0)
                w[c,s] in {0,1}       = y[c,s] and z_c
                x^{c,s}, x^{c,s-1}    the stage model's x[j,r,o] of class c's table at share s (its replicas
                                      with s samples) and at s - 1 (those with s - 1), each table's own copy
                Z                     the step surrogate: the slowest replica's E (integer nanoseconds)

    minimize    Z
    subject to
      (S1) share choice     sum_s y[c,s] = 1;  z_c <= l_c <= (k_c - 1) z_c;  w[c,s] <= y[c,s],
                            w[c,s] <= z_c, w[c,s] >= y[c,s] + z_c - 1;  w[c,s] = 0 where s - 1 has no table
      (S2) the batch        sum_c (k_c sum_s s y[c,s] - l_c) = B
      (S3) the splits       per table (c, s): the stage model's (T), (M), (H), (A), (E) (`StageTable.add`)
                            with sum_{r,o} x[j,r,o] = y[c,s] for every stage j, and E := Z; the table
                            (c, s - 1) of the same with w[c,s]. An unchosen share's variables are all 0,
                            and then its constraints hold trivially: no big-M is needed
      (C) cap and bound     Z <= C(U) (stage_model.py: U the decomposition's value, its shares with each
                            class's best known split, `split.Splitter.split`); Z >= the config's lower
                            bound (bounds.py: it bounds the slowest replica's surrogate)

Each table is the stage model's at its share s: m_c(s) = `configs.microbatch_count(s, min(b, s), p, sigma)`
micro-batches of n = ceil(s / m) samples, so the bilinear work m x (fwd + bwd)(n) and the schedule's
in-flight activations (which depend on m) are constants of the table: the share is discretised over its
candidate values with one table each, not multiplied out. Candidate shares S_c: from the largest share the
other classes leave (one sample each) down, the largest H_c whose table under the cap is not empty; then
at least what the other classes cannot take (B - sum_{c' != c} k_c' H_c', over k_c); and of those, the
shares whose table under the cap is not empty (at most MAX_SHARE_TABLES tables per class and MAX_ENTRIES
entries in all, else no model is built). The share enters only through which table is active, not as a
coefficient: the work m(s) (fwd + bwd)(n(s)) and the in-flight counts are not linear in s, and an inactive
table's constraints vanish with its x, so no big-M row is needed (a big-M form was not built). What is proven
is as in stage_model.py: no table or an infeasible model, the decomposition is within GAP; else the
solution's gap 1 - (bound - R) / value.

Where it runs: `search.Search._refine`, on the finalists with several pipeline classes; the shares it
returns go through the search's `_solve` (each class re-split by the stage model at its share) and the
simulator, and replace the decomposition's only if the plan simulates faster. Measured (bench/planner.py
case 4, gpt2-medium on 3x4 V100 + 4 T4, B = 32, 8 interleaved stages): 31 tables built, the
decomposition's shares (10, 10, 10, 2) confirmed within 0.95%, 60-100 ms of CPU per finalist.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from .. import budget
from ..budget import WallGuard
from ..pricing.pricing import CostModel
from ..search.configs import microbatch_count
from .split import Slot, Splitter, priced_surrogate
from .stage_model import GAP, MAX_ENTRIES, NS, StageTable, cap_ns, rounding_slack, solver_for

# shares per class whose tables `JointModel.candidates` builds at most (each costs milliseconds: its ranges are
# priced at that share's micro-batch size): beyond, no joint model is built and the decomposition's shares stand
MAX_SHARE_TABLES = 256


class _TooLarge(Exception):
    """More candidate shares or entries than the joint model is built for (MAX_SHARE_TABLES, MAX_ENTRIES)."""


class ShareClass(NamedTuple):
    """One pipeline class of a config: its replicas' pipeline indices and its stage positions at m micro-batches."""

    pipelines: list[int]
    slots: Callable[[int], list[Slot]]


class Joint(NamedTuple):
    shares: list[int]  # per pipeline of the config
    value: float  # the slowest replica's surrogate, seconds
    gap: float  # no batch split and splits have a surrogate below (1 - gap) x value
    status: str  # "pruned", "infeasible" (the decomposition's shares kept), "optimal", "feasible"


class JointModel:
    """The joint model of one config (module docstring); `solve()` returns its shares."""

    def __init__(self, cm: CostModel, splitter: Splitter, classes: list[ShareClass], b: int, schedule: str,
                 chunks: int, incumbent: list[int], lower: float = 0.0, gap: float = GAP,
                 guard: WallGuard | None = None) -> None:
        self.cm, self.splitter, self.classes, self.gap = cm, splitter, classes, gap
        self.guard = guard  # the planning run's wall-clock guard (budget.py)
        self.b, self.schedule, self.chunks, self.incumbent = b, schedule, chunks, incumbent
        self.p = len(classes[0].slots(1)) // chunks
        self.R = rounding_slack(self.p, chunks)
        self.lower = lower
        self._tables: dict[tuple[int, int], StageTable | None] = {}
        self.U = self._incumbent_value()
        self.cap = cap_ns(self.U, self.p, chunks, gap) if self.U is not None else -1

    def _m(self, share: int) -> int | None:
        return microbatch_count(share, min(self.b, share), self.p, self.schedule)

    def _incumbent_value(self) -> float | None:
        """The decomposition's value: its slowest replica's surrogate with each share's best known split."""
        worst = 0.0
        for cls in self.classes:
            for share in {self.incumbent[d] for d in cls.pipelines}:
                m = self._m(share)
                if m is None:
                    return None
                slots = cls.slots(m)
                split = self.splitter.split(slots, share, m, self.schedule, self.chunks)
                if split is None:
                    return None
                worst = max(worst, priced_surrogate(self.cm, slots, split.stages, self.chunks, m))
        return worst

    def table(self, c: int, share: int) -> StageTable | None:
        """Class c's stage table at `share` under the cap (memoised); None where no split fits under it."""
        key = (c, share)
        if key not in self._tables:
            m = None if share < 1 else self._m(share)
            got = None
            if m is not None:
                got = StageTable(self.cm, self.splitter, self.classes[c].slots(m), m, -(-share // m), self.chunks,
                                 self.cap)
            self._tables[key] = got if got is not None and got.ok else None
        return self._tables[key]

    def candidates(self) -> list[list[int]] | None:
        """S_c per class (module docstring); None when some class has none."""
        B = self.cm.B
        counts = [len(cls.pipelines) for cls in self.classes]
        top = []
        for c, k in enumerate(counts):
            s = -(-(B - (sum(counts) - k)) // k)
            while s >= 1 and self.table(c, s) is None:
                s -= 1
                if len(self._tables) > MAX_SHARE_TABLES * len(counts):
                    raise _TooLarge
            if s < 1:
                return None
            top.append(s)
        cover = sum(k * s for k, s in zip(counts, top, strict=True))
        out = []
        for c, k in enumerate(counts):
            least = max(1, -(-(B - (cover - k * top[c])) // k))
            if top[c] - least > MAX_SHARE_TABLES:
                raise _TooLarge
            shares = [s for s in range(least, top[c] + 1) if self.table(c, s) is not None]
            if not shares:
                return None
            out.append(shares)
        if sum(sum(map(len, t.entries)) for t in self._tables.values() if t) > MAX_ENTRIES:
            raise _TooLarge
        return out

    def _proven(self, status: str) -> Joint:
        lb = (self.cap + 1 - self.R) / NS
        return Joint(self.incumbent, self.U, max(0.0, 1 - lb / self.U), status)

    def solve(self, time_limit_s: float) -> Joint | None:
        """The shares minimising the slowest replica's surrogate within the gap (GAP unless given); None when the
        decomposition has no value (a share that cannot run), the model would be too large (MAX_SHARE_TABLES,
        MAX_ENTRIES) or the time limit ended the search with nothing under the cap."""
        from ortools.sat.python import cp_model

        if self.U is None:
            return None
        least = max(0, math.floor(self.lower * NS) - self.R)
        try:
            cands = None if least > self.cap else self.candidates()
        except _TooLarge:
            return None
        if cands is None:
            return self._proven("pruned")
        md = cp_model.CpModel()
        Z = md.NewIntVar(least, self.cap, "Z")
        total, chosen = [], []
        for c, shares in enumerate(cands):
            k = len(self.classes[c].pipelines)
            y = {s: md.NewBoolVar(f"y{c}_{s}") for s in shares}
            md.AddExactlyOne(y.values())
            z, lows = md.NewBoolVar(f"z{c}"), md.NewIntVar(0, k - 1, f"l{c}")
            md.Add(lows >= z)
            md.Add(lows <= (k - 1) * z)
            blocks = []
            for s in shares:
                blocks.append((s, y[s], self.table(c, s), self.table(c, s).add(md, Z, y[s], f"{c}_{s}")))
                low = self.table(c, s - 1) if k > 1 else None
                if low is None:
                    md.AddImplication(y[s], z.Not())
                    continue
                w = md.NewBoolVar(f"w{c}_{s}")
                md.AddImplication(w, y[s])
                md.AddImplication(w, z)
                md.AddBoolOr([w, y[s].Not(), z.Not()])
                blocks.append((s - 1, w, low, low.add(md, Z, w, f"{c}_{s}m")))
            total.append(k * sum(s * v for s, v in y.items()) - lows)
            chosen.append((y, lows, blocks))
        md.Add(sum(total) == self.cm.B)
        md.Minimize(Z)
        solver = solver_for(time_limit_s, self.gap, self.guard)
        status = budget.solve(solver, md, f"the joint stage model of {len(self.classes)} pipeline classes")
        if status == cp_model.INFEASIBLE:
            return self._proven("infeasible")
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        shares, value = [0] * len(self.incumbent), 0.0
        for cls, (y, lows, blocks) in zip(self.classes, chosen, strict=True):
            hi, n_low = next(s for s, v in y.items() if solver.BooleanValue(v)), solver.Value(lows)
            for pos, d in enumerate(cls.pipelines):
                shares[d] = hi - 1 if pos >= len(cls.pipelines) - n_low else hi
            for _, act, tab, x in blocks:
                if solver.BooleanValue(act):
                    value = max(value, priced_surrogate(self.cm, tab.slots, tab.stages(solver, x), self.chunks, tab.m))
        lb = (math.floor(solver.BestObjectiveBound()) - self.R) / NS
        return Joint(shares, value, max(0.0, 1 - lb / value),
                     "optimal" if status == cp_model.OPTIMAL else "feasible")


def joint_shares(cm: CostModel, splitter: Splitter, classes: list[ShareClass], b: int, schedule: str, chunks: int,
                 incumbent: list[int], lower: float = 0.0, time_limit_s: float = 10.0,
                 guard: WallGuard | None = None) -> Joint | None:
    """The joint model's batch shares (module docstring), or None (see `JointModel.solve`)."""
    return JointModel(cm, splitter, classes, b, schedule, chunks, incumbent, lower, guard=guard).solve(time_limit_s)


__all__ = ["Joint", "JointModel", "ShareClass", "joint_shares"]
