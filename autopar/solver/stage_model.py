"""The stage model: one CP-SAT model chooses a pipeline's layer split and every stage's memory options.

Given one outer candidate of the search (tensor-parallel degree, grouping, schedule sigma with v chunks,
micro-batch size; `search.Config`) and one pipeline class of it (its stage positions, `split.Slot`: device
type, tp and dp groups, in-flight micro-batches, memory budgets), with m micro-batches of n samples:

    variables   x[j,r,o] in {0,1}     stage j (0..S-1, S = p v) runs layer range r with memory option o
                                      (ZeRO level, recompute, offload of optimizer / activations /
                                      params: `pricing.Option`); on a uniform chain r is the stage's
                                      layer count, else an interval [a, e) of the chain
                G_k, A_k, K_k, Y_k, H_k >= 0   per device k of an interleaved schedule: its peak above
                                      the static memory, and the largest activation, recompute
                                      workspace, sync bucket and host activation of its chunks
                E >= 0                the step-time surrogate (integer nanoseconds)

    minimize    E
    subject to
      (T) tiling            sum_{r,o} x[j,r,o] = 1 for every stage j; on a uniform chain
                            sum_{j,r,o} r x[j,r,o] = L, stage 0 holding the prologue and stage S-1 the
                            epilogue; else the intervals chain: stage 0 starts at 0, stage S-1 ends at L,
                            and for every layer b the stages ending at b equal the next stages starting
                            at b (a path through the chain)                             `_tiling`
      (M) device memory     one stage per device (v = 1): a (range, option) is in the table only if it
                            fits its device (`split.Slot.fits`, `pricing.rank_peak`), so the constraint
                            is in the domain; v > 1 (a device runs v chunks, `pricing.rank_peak`):
                               sum_c static_c + G_k + [unified] host_k <= budget_k,
                               G_k >= A_k + K_k,  G_k >= Y_k,  A_k >= act_c,  K_k >= work_c,  Y_k >= sync_c
                            (act_c = in-flight micro-batches x activation bytes, one micro-batch if
                            offloaded), with every term a linear sum over x of chunk c   `_memory`
      (H) host memory       per device, sum_c host_c + H_k <= host_budget_k (its even share of its node's
                            host memory, `CostModel.host_budget`), H_k >= inflight_k host_act_c;
                            v = 1: in the table's domain like (M)                       `_memory`
      (A) in-flight activations  the schedule's peak in-flight micro-batches per device
                            (`pricing.inflight_closed_form`) scale act_c in (M) and host_act_c in (H)
      (E) objective         for every stage j on device q = j mod p, chunk c = j div p:
                               E >= F_q + P_j + max(Q_q + sync_0, send_{j-1} + sync_j)
                               E >= F_q + v w_j + max(Q_q + sync_0, send_{j-1} + sync_j)
                            (each max written as two constraints), w_j = m (fwd_j + bwd_j), P_j the work
                            of device q's chunks up to c, F_q / Q_q the forward / backward prefix (sends
                            included) of the first-chunk stages before q: exactly `split.surrogate`, a
                            linearisation of the simulator's step (bottleneck stage, bubble = the
                            prefixes, sync after the last backward, sends) that bounds
                            `pricing.lower_bound` from above                             `_objective`

The coefficients come from the table `_candidates` builds with `split.Splitter.ranked` (one costing per
range class and option, memoised): per stage, range and option the forward, backward and sync seconds
(integer nanoseconds), the memory terms (KiB, needs rounded up and budgets down, so a solution the model
admits fits) and the send to the next stage (`CostModel.boundary_send`). Options are pruned only by
dominance: an option is dropped where another that fits is no slower in forward, backward and sync and,
for v > 1, needs no more of any memory term (E is monotone in each). Ranges whose own term
v w_j + sync_j already exceeds the incumbent (a known split's surrogate, also the solution hint) are left
out, as are ranges longer than one that does not fit (memory grows with the range).

Where it runs: `search.Search._refine` re-solves the fastest configs with `split.Splitter.split(model=True)`,
which uses this model on chains of at most `split.STAGE_MODEL_LAYERS` layers with more than 64 possible
splits (fewer: every split with every non-dominated option combination is simulated, which is exact under
the simulator). It is not in the search's inner loop: there a split must cost milliseconds (thousands of
configs and batch shares), and this model takes 20 ms to 0.5 s on 14-layer chains and does not prove
the optimum within 10 s on GPT-3's 98-layer chain (its LP bound is weak: the objective is a max of
prefix sums), where the dynamic program (non-interleaved, milliseconds to seconds) or the bisection decide.

The batch shares of pipeline classes that differ (by-type groupings) are not variables of this model:
`search.Search._batch_split` chooses them (CP-SAT over a per-share table of this model's optimum or a
greedy split), and the stage model then solves each class at its share. The simulator
(`plan.simulated_step_time`, `pricing.price`) judges the final candidates: `split.Splitter.split` keeps the
CP-SAT split or Megatron's even split, whichever simulates faster.

Solver: CP-SAT with 8 workers interleaved (`interleave_search`: deterministic, and the LP / LNS
portfolio that closes the gap even on 2 cores), fixed seed, relative gap 0; `solve` returns None when it
cannot prove optimality within its time limit, and the caller falls back to the dynamic program or the
bisection.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from .pricing import CostModel, StageTimes
from .split import Choice, Slot, Split, Splitter, surrogate

NS = 1e9  # objective unit: nanoseconds
KIB = 1024.0  # memory unit of the model: KiB
# (stage, range, option) entries above which the model is not built: beyond it CP-SAT rarely proves the
# optimum within seconds (measured: 96-block GPT-3, 16 stages, ~4,000 entries: not proven in 10 s), and
# `split.Splitter.split` uses its dynamic program or bisection instead
MAX_ENTRIES = 1_500


class Entry(NamedTuple):
    """One (stage, range, option) candidate with its integer coefficients."""

    a: int  # the range [a, e) (on a uniform chain: a representative range of its layer count)
    e: int
    size: int  # layers
    choice: Choice
    fwd: int  # ns per micro-batch
    bwd: int
    work: int  # m (fwd + bwd), ns
    sync: int
    send: int  # to the next stage, ns
    static: int  # KiB
    act: int  # in-flight activation term (inflight x act, or one micro-batch when offloaded), KiB
    wsp: int  # recompute workspace, KiB
    msync: int  # sync bucket, KiB
    host: int  # KiB
    host_act: int  # inflight x host activation, KiB


def _ns(x: float) -> int:
    return int(round(x * NS))


def _kib_up(x: float) -> int:
    return int(math.ceil(x / KIB))


def _kib_down(x: float) -> int:
    return int(math.floor(x / KIB)) if math.isfinite(x) else -1


class StageModel:
    """The CP-SAT model of one pipeline class (module docstring); `solve()` returns its optimal Split."""

    def __init__(self, cm: CostModel, splitter: Splitter, slots: list[Slot], m: int, n: int, chunks: int,
                 incumbent: Split) -> None:
        self.cm, self.splitter, self.slots = cm, splitter, slots
        self.m, self.n, self.chunks = m, n, chunks
        self.S, self.p = len(slots), len(slots) // chunks
        self.incumbent = incumbent
        # the compact form: on a uniform chain with a one-layer (or no) prologue and epilogue, a middle
        # stage's costs depend only on its layer count
        self.compact = cm.uniform and cm.first_block <= 1 and cm.L - (cm.first_block + cm.num_blocks) <= 1
        self.entries: list[list[Entry]] = []
        self.model = None
        self.x: list[list] = []

    # ---- the table ------------------------------------------------------------------------------
    def _ranges(self, j: int) -> list[tuple[int, int, int]]:
        """(a, e, layers) candidates of stage j, shortest first within each start."""
        cm, S, L = self.cm, self.S, self.cm.L
        top = L - (S - 1)  # the most layers one stage can take
        if self.compact:
            if j == 0:
                return [(0, k, k) for k in range(1, top + 1)]
            if j == S - 1:
                return [(L - k, L, k) for k in range(1, top + 1)]
            a0 = cm.first_block
            return [(a0, a0 + k, k) for k in range(1, min(top, L - 1 - a0) + 1)]
        starts = [0] if j == 0 else range(j, L - (S - j) + 1)
        out = []
        for a in starts:
            ends = [L] if j == S - 1 else range(a + 1, L - (S - 1 - j) + 1)
            out += [(a, e, e - a) for e in ends]
        return out

    def _candidates(self) -> bool:
        """Fill `entries`; False when some stage has none (or the model would be too large)."""
        cm, slots, m, v = self.cm, self.slots, self.m, self.chunks
        ub = self.ub = _ns(self.incumbent.surrogate) + 8 * self.S  # + rounding of the integer coefficients
        total = 0
        for j, slot in enumerate(slots):
            nxt = slots[j + 1].tp_group if j + 1 < self.S else slot.tp_group
            row: list[Entry] = []
            last_a, dead = None, False
            for a, e, size in self._ranges(j):
                if a != last_a and not self.compact:
                    last_a, dead = a, False
                if dead:
                    continue  # longer ranges from this start need more memory and time still
                choices = self.splitter.pareto(slot, a, e, self.m, self.n, self.chunks)
                if not choices:
                    dead = True
                    continue
                send = _ns(cm.stage_send(choices[0].out_bytes, slot.tp_group, nxt)) if j + 1 < self.S else 0
                grew = True
                for c in choices:
                    f, b, s = _ns(c.times.fwd), _ns(c.times.bwd), _ns(c.times.sync)
                    w = _ns(m * (c.times.fwd + c.times.bwd))
                    if v * w + s > ub:
                        continue
                    grew = False
                    mem, inflight = c.memory, slot.inflight
                    act = (min(inflight, 1) if mem.offload_act else inflight) * mem.act
                    row.append(Entry(a, e, size, c, f, b, w, s, send, _kib_up(mem.static), _kib_up(act),
                                     _kib_up(mem.work), _kib_up(mem.sync), _kib_up(mem.host),
                                     _kib_up(inflight * mem.host_act)))
                if grew:
                    dead = True  # every option of this range already costs more than the incumbent
            if not row:
                return False
            total += len(row)
            if total > MAX_ENTRIES:
                return False
            self.entries.append(row)
        return True

    # ---- the model ------------------------------------------------------------------------------
    def build(self) -> bool:
        """Build the CP-SAT model; False when no table could be built (then there is no model)."""
        from ortools.sat.python import cp_model

        if not self._candidates():
            return False
        self.model = cp_model.CpModel()
        self.x = [[self.model.NewBoolVar(f"x{j}_{k}") for k in range(len(row))]
                  for j, row in enumerate(self.entries)]
        self._tiling()
        self._memory()
        self._objective()
        self._hint()
        return True

    def _lin(self, j: int, field: str):
        """sum over stage j's entries of `field` x."""
        return sum(getattr(en, field) * x for en, x in zip(self.entries[j], self.x[j], strict=True))

    def _tiling(self) -> None:
        """(T): one entry per stage; the ranges tile the chain."""
        md, L = self.model, self.cm.L
        for xs in self.x:
            md.AddExactlyOne(xs)
        if self.compact:
            md.Add(sum(self._lin(j, "size") for j in range(self.S)) == L)
            return
        for j in range(self.S - 1):
            for b in range(1, L):
                ending = [x for en, x in zip(self.entries[j], self.x[j], strict=True) if en.e == b]
                starting = [x for en, x in zip(self.entries[j + 1], self.x[j + 1], strict=True) if en.a == b]
                if ending or starting:
                    md.Add(sum(ending) == sum(starting))

    def _memory(self) -> None:
        """(M), (H), (A) for devices running several chunks; one chunk: already in the table."""
        if self.chunks == 1:
            return
        md = self.model
        for q in range(self.p):
            js = list(range(q, self.S, self.p))
            slot = self.slots[q]
            budget, host_budget = _kib_down(slot.budget), _kib_down(slot.host_budget)
            A, K, Y, G, H = (md.NewIntVar(0, 1 << 50, f"{t}{q}") for t in "AKYGH")
            for j in js:
                md.Add(A >= self._lin(j, "act"))
                md.Add(K >= self._lin(j, "wsp"))
                md.Add(Y >= self._lin(j, "msync"))
                md.Add(H >= self._lin(j, "host_act"))
            md.Add(G >= A + K)
            md.Add(G >= Y)
            host = sum(self._lin(j, "host") for j in js) + H
            md.Add(sum(self._lin(j, "static") for j in js) + G + (host if slot.unified else 0) <= budget)
            if host_budget >= 0:
                md.Add(host <= host_budget)

    def _objective(self) -> None:
        """(E): the surrogate, two (or four, interleaved) linear constraints per stage."""
        md, p, v = self.model, self.p, self.chunks
        E = self.E = md.NewIntVar(0, self.ub, "E")
        fwd = [self._lin(j, "fwd") for j in range(self.S)]
        bwd = [self._lin(j, "bwd") for j in range(self.S)]
        work = [self._lin(j, "work") for j in range(self.S)]
        sync = [self._lin(j, "sync") for j in range(self.S)]
        send = [self._lin(j, "send") for j in range(self.S)]
        F = [sum(fwd[i] + send[i] for i in range(q)) for q in range(p)]
        Q = [sum(bwd[i] + send[i] for i in range(q)) for q in range(p)]
        for j in range(self.S):
            q, c = j % p, j // p
            P = sum(work[q + k * p] for k in range(c + 1))
            tails = [Q[q] + sync[0], (send[j - 1] if j else 0) + sync[j]]
            for tail in tails:
                md.Add(E >= F[q] + P + tail)
                if v > 1:
                    md.Add(E >= F[q] + v * work[j] + tail)
        md.Minimize(E)

    def _hint(self) -> None:
        """The incumbent split as the solution hint, where its (range, option) entries are in the table."""
        for j, (a, e, c) in enumerate(self.incumbent.stages):
            for en, x in zip(self.entries[j], self.x[j], strict=True):
                same = en.size == e - a if self.compact else (en.a, en.e) == (a, e)
                self.model.AddHint(x, int(same and en.choice.option == c.option))

    # ---- solving --------------------------------------------------------------------------------
    def solve(self, time_limit_s: float) -> Split | None:
        """The split minimising the surrogate, proven optimal; None when the model has no table, is
        infeasible (nothing beats the incumbent) or is not proven optimal within `time_limit_s`."""
        from ortools.sat.python import cp_model

        if self.model is None and not self.build():
            return None
        solver = cp_model.CpSolver()
        prm = solver.parameters
        prm.num_workers = 8  # the LP / LNS portfolio; interleaved, so deterministic
        prm.interleave_search = True
        prm.random_seed = 0
        prm.relative_gap_limit = 0.0
        prm.max_time_in_seconds = max(0.05, time_limit_s)
        if solver.Solve(self.model) != cp_model.OPTIMAL:
            return None
        stages, a = [], 0
        for j, row in enumerate(self.entries):
            en = next(en for en, x in zip(row, self.x[j], strict=True) if solver.BooleanValue(x))
            start = a if self.compact else en.a
            stages.append((start, start + en.size, en.choice))
            a = start + en.size
        assert a == self.cm.L
        return Split(stages, self.value(stages))

    def value(self, stages: list[tuple[int, int, Choice]]) -> float:
        """`split.surrogate` of a split on this model's slots (float seconds)."""
        cm, slots = self.cm, self.slots
        sends = [0.0 if j + 1 == self.S else cm.stage_send(c.out_bytes, slots[j].tp_group, slots[j + 1].tp_group)
                 for j, (_, _, c) in enumerate(stages)]
        times: list[StageTimes] = [c.times for _, _, c in stages]
        return surrogate(times, sends, self.p, self.m)


def solve_split(cm: CostModel, splitter: Splitter, slots: list[Slot], m: int, n: int, chunks: int,
                incumbent: Split, time_limit_s: float = 10.0) -> Split | None:
    """The stage model's optimal split of one pipeline class (module docstring), or None (see `solve`)."""
    return StageModel(cm, splitter, slots, m, n, chunks, incumbent).solve(time_limit_s)


__all__ = ["Entry", "StageModel", "solve_split"]
