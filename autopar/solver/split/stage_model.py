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
                            at b (a path through the chain)                      `StageTable.tiling`
      (M) device memory     one stage per device (v = 1): a (range, option) is in the table only if it
                            fits its device (`split.Slot.fits`, `pricing.rank_peak`), so the constraint
                            is in the domain; v > 1 (a device runs v chunks, `pricing.rank_peak`):
                               sum_c static_c + G_k + [unified] host_k <= budget_k,
                               G_k >= A_k + K_k,  G_k >= Y_k,  A_k >= act_c,  K_k >= work_c,  Y_k >= sync_c
                            (act_c = in-flight micro-batches x activation bytes, one micro-batch if
                            offloaded), with every term a linear sum over x of chunk c  `StageTable.memory`
      (H) host memory       per device, sum_c host_c + H_k <= host_budget_k (its even share of its node's
                            host memory, `CostModel.host_budget`), H_k >= inflight_k host_act_c;
                            v = 1: in the table's domain like (M)                  `StageTable.memory`
      (A) in-flight activations  the schedule's peak in-flight micro-batches per device
                            (`pricing.inflight_closed_form`, in `Slot.inflight`) scale act_c in (M) and
                            host_act_c in (H)                                     `StageTable._entries`
      (E) objective         for every stage j on device q = j mod p, chunk c = j div p:
                               E >= F_q + P_j + max(Q_q + sync_0, send_{j-1} + sync_j)
                               E >= F_q + v w_j + max(Q_q + sync_0, send_{j-1} + sync_j)
                            (each max written as two constraints), w_j = m (fwd_j + bwd_j), P_j the work
                            of device q's chunks up to c, F_q / Q_q the forward / backward prefix (sends
                            included) of the first-chunk stages before q: exactly `split.surrogate`, a
                            linearisation of the simulator's step (bottleneck stage, bubble = the
                            prefixes, sync after the last backward, sends) that bounds
                            `pricing.lower_bound` from above                    `StageTable.objective`
      (C) cap               E <= C = ceil((1 - GAP) U) + R - 1, U the incumbent's surrogate (the best
                            split known: the dynamic program, the bisection or Megatron's even split), R
                            the rounding slack below (`cap_ns`)                   `StageModel.solve`

The table (`StageTable`): per stage, range and option the forward, backward and sync seconds (integer
nanoseconds), the memory terms (KiB, needs rounded up and budgets down, so a solution the model admits
fits) and the send to the next stage (`CostModel.stage_send`), from `split.Splitter.pareto` (memoised per
range class). Nothing that could be in a solution with E <= C is left out:
  * options: an option is dropped where another that fits is no slower in forward, backward and sync and,
    for v > 1, needs no more of any memory term (E is monotone in each);
  * ranges: an entry whose own lower bound on E, F_q^min + max(v w_j, P_j^min + w_j) +
    max(Q_q^min + sync_0^min, sync_j) (the prefixes at the smallest entries of the stages before), exceeds
    C is out, and so are the longer ranges from its start (costs and memory grow with the range);
  * reachability: on a uniform chain stage j's layer count lies in [L - sum_{i != j} k_i^max,
    L - sum_{i != j} k_i^min], k_j^max first found by bisection on the count with the own term
    v w_j + sync_j alone (`_count_bounds`: only the counts in between are costed), then iterated to a
    fixed point on the table (`_reach`); else an interval is kept only if its start is an end of the
    previous stage's intervals and its end a start of the next stage's (or L).
The incumbent enters as the cap, not as a solution hint (it violates the cap), and no lower bound comes
from outside: the search's `lo` (a config's bound) bounds its slowest pipeline class, not every class at
its share, and a capped model proven infeasible needs none. So the cap is the incumbent's gap made a
constraint: the model is a feasibility question "is there a split at least GAP shorter?", which the
pruning alone (no stage left with an entry) or presolve and propagation on the pruned domains usually
settle at once. On a uniform chain the table over (stage, layer count,
option) is the count-based form: after the pruning a stage keeps a few counts (GPT-3: 1-4), so an integer
count per stage and option with costs affine in it would not make the model smaller.

What is proven (`StageModel.solve`, `Split.gap`): every coefficient is rounded to the nanosecond and one
term of (E) sums at most 4p + v - 3 of them, so a split's model value and its surrogate differ by less
than R = 2p + v + 2 ns (`rounding_slack`).
  * no entry survives, or CP-SAT proves the capped model infeasible: no split is shorter than
    (1 - GAP) U, the incumbent is returned with gap 1 - (1 - GAP) U / U <= GAP;
  * CP-SAT finds splits under the cap and stops at relative gap GAP (`relative_gap_limit`): the best one,
    with gap 1 - (bound - R) / value (<= GAP up to the R ns); then up to POOL more splits within POOL_RTOL
    of its value, next best first (`_near_optimal`: each solve cuts off the splits found before), go to the
    simulator with it (`StageModel.pool`): splits of equal or near surrogate simulate apart (few
    micro-batches), and without the pool bench/planner.py case 4's plan simulated 6.5% slower (solving on
    to gap 0 did not change that, and cost GPT-3 on 4096 A100 seconds);
  * its deterministic time limit (STAGE_MODEL_TIME_S, `split.py`; the pool's POOL_DETERMINISTIC_S) ends first:
    the best split found with its (larger) gap, or None when it found none, and the caller keeps the
    incumbent. Measured 2026-12-06: GPT-3 175B on 1024 A100's 64-stage interleaved finalist ends so (with
    CP-SAT's LP cuts: none found at 0.5 deterministic seconds, 5.1 s of wall on a quiet 2-core host; without
    them, `solver_for`, a split under the cap that the simulator does not take, 0.9 s: the same plan; its
    32-stage finalist's four pool solves 4.2 -> 0.6 s; all nine plans of bench/plan_identity.py identical).
The gap is the surrogate's: the simulator (`plan.simulated_step_time`) still judges, `split.Splitter.split`
keeps the fastest simulated of the model's split, its pool, the incumbent and Megatron's even split.

Where it runs: `split.Splitter.split(model=True)`, on every chain length and schedule, interleaved
included, with more than 64 possible splits (fewer: every split with every non-dominated option
combination is simulated, exact under the simulator); `search.Search._refine` asks it for the finalists.
It is not in the search's inner loop, where a split must cost milliseconds. Measured (CPU seconds, shared
machine): GPT-3 175B on 1024 A100 (bench/planner.py case 2, 98 layers, 8-32 stages, 1f1b and interleaved):
of its 7 finalists 5 are settled by the pruning and 2 by CP-SAT (48 entries, infeasible), 2-17 ms each,
0.05 s in all, every known split proven within 1%; gpt2-medium on 3x4 V100 + 4 T4 (case 4, 26 layers,
8 interleaved stages): 140-171 entries, CP-SAT finds splits 2.5% shorter than the known ones and proves
them optimal; with the pool the plan simulates 7.8% faster than the known splits' (0.1639 against
0.1777 s), the whole search 11-13 s of CPU.

Batch shares: where a config's pipeline classes differ (by-type groupings) `stage_model_shares.py` joins
one table per class and candidate share in one model with the integer shares (its docstring).

Solver: CP-SAT, one worker, fixed seed (deterministic; on these models faster than the 8-worker portfolio,
whose interleaved search also aborts on some infeasible capped models in ortools 9.15), a deterministic time
limit; the wall clock only as the planning run's guard (solver/budget.py), which warns where it cuts a solve
short (the plan then depends on the machine's load).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from .. import budget
from ..budget import WallGuard
from ..pricing.pricing import CostModel, settled_work
from .monotone import largest_true
from .surrogate import Choice, Slot, Split, priced_surrogate

if TYPE_CHECKING:
    from .split import Splitter

NS = 1e9  # objective unit: nanoseconds
KIB = 1024.0  # memory unit of the model: KiB
GAP = 0.01  # the relative gap proven: (value - lower bound) / value
# near-optimal splits handed to the simulator besides the optimum: at most POOL, within POOL_RTOL of its value
POOL = 4
POOL_RTOL = 0.01
POOL_DETERMINISTIC_S = 0.125  # CP-SAT deterministic seconds of each pool solve (a pool is worth less than the optimum)
# (stage, range, option) entries above which no model is built (the caller keeps its split): building the model
# in Python takes about 65 us an entry (measured on GPT-3's finalists), the pruned tables measured stay under 2,000
MAX_ENTRIES = 20_000


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


def rounding_slack(ranks: int, chunks: int) -> int:
    """R: how far (ns) a split's model value may lie from its surrogate, at most: each coefficient is rounded by
    at most 0.5 ns and one term of (E) sums at most 4 ranks + chunks - 3 of them."""
    return 2 * ranks + chunks + 2


def cap_ns(value: float, ranks: int, chunks: int, gap: float = GAP) -> int:
    """C: the largest model value of a split at least `gap` shorter than `value` seconds (module docstring)."""
    return math.ceil(value * NS * (1 - gap)) + rounding_slack(ranks, chunks) - 1


class StageTable:
    """The pruned (stage, range, option) table of one pipeline class at one share under a cap (ns), and the
    constraints that make it a split (module docstring); `add` puts them into a CP-SAT model."""

    def __init__(self, cm: CostModel, splitter: Splitter, slots: list[Slot], m: int, n: int, chunks: int,
                 cap: int) -> None:
        self.cm, self.splitter, self.slots = cm, splitter, slots
        self.m, self.n, self.chunks, self.cap = m, n, chunks, cap
        self.S, self.p = len(slots), len(slots) // chunks
        # the compact form: on a uniform chain with a one-layer (or no) prologue and epilogue, a middle
        # stage's costs depend only on its layer count
        self.compact = cm.uniform and cm.first_block <= 1 and cm.L - (cm.first_block + cm.num_blocks) <= 1
        self.entries: list[list[Entry]] = []
        self.counts: list[tuple[int, int]] | None = None  # compact form: per stage, its fewest and most layers
        self.too_large = False
        self.ok = self._build()  # False: no split has a model value <= cap (or the table is too large)

    # ---- the table ------------------------------------------------------------------------------
    def _ranges(self, j: int, starts: list[int]) -> list[tuple[int, int, int]]:
        """(a, e, layers) candidates of stage j from `starts`, shortest first within each start."""
        cm, S, L = self.cm, self.S, self.cm.L
        top = L - (S - 1)  # the most layers one stage can take
        if self.compact:
            if j == 0:
                return [(0, k, k) for k in range(1, top + 1)]
            if j == S - 1:
                return [(L - k, L, k) for k in range(1, top + 1)]
            a0 = cm.first_block
            return [(a0, a0 + k, k) for k in range(1, min(top, L - 1 - a0) + 1)]
        out = []
        for a in starts:
            ends = [L] if j == S - 1 else range(a + 1, L - (S - 1 - j) + 1)
            out += [(a, e, e - a) for e in ends]
        return out

    def _count_bounds(self) -> list[tuple[int, int]] | None:
        """Compact form: per stage, the fewest and most layers it can hold under the cap, k_j^max the largest
        count with an option whose own term v w + sync stays under it (a bisection: terms and memory grow with
        the count), k_j^min = L - sum_{i != j} k_i^max; None when they cannot tile the chain."""
        cap, v, L = self.cap, self.chunks, self.cm.L
        top = []
        for j, slot in enumerate(self.slots):
            ranges = self._ranges(j, [0])

            def ok(k: int, slot: Slot = slot, ranges: list = ranges) -> bool:
                a, e, _ = ranges[k - 1]
                return any(v * _ns(self.m * (c.times.fwd + c.times.bwd)) + _ns(c.times.sync) <= cap
                           for c in self.splitter.pareto(slot, a, e, self.m, self.n, v))

            got = largest_true(ok, 1, len(ranges), -(-L // self.S))
            if got is None:
                return None
            top.append(got)
        low = [max(1, L - (sum(top) - k)) for k in top]
        return None if any(lo > hi for lo, hi in zip(low, top, strict=True)) else list(zip(low, top, strict=True))

    def _build(self) -> bool:
        cm, slots, S, p = self.cm, self.slots, self.S, self.p
        if self.compact:
            self.counts = self._count_bounds()
            if self.counts is None:
                return False
        low_f, low_b = [0] * (p + 1), [0] * (p + 1)  # F_q^min, Q_q^min
        low_work = [0] * p  # per device, the smallest work of its chunks placed so far
        sync0 = 0
        starts = [0]
        total = 0
        for j, slot in enumerate(slots):
            q = j % p
            nxt = slots[j + 1].tp_group if j + 1 < S else slot.tp_group
            row = self._entries(j, slot, nxt, starts, low_f[q], low_b[q] + sync0, low_work[q])
            if not row:
                return False
            total += len(row)
            if total > MAX_ENTRIES:
                self.too_large = True
                return False
            self.entries.append(row)
            if j == 0:
                sync0 = min(en.sync for en in row)
            if j < p:
                low_f[q + 1] = low_f[q] + min(en.fwd + en.send for en in row)
                low_b[q + 1] = low_b[q] + min(en.bwd + en.send for en in row)
            low_work[q] += min(en.work for en in row)
            starts = sorted({en.e for en in row if en.e < cm.L})
        return self._reach()

    def _entries(self, j: int, slot: Slot, nxt: tuple, starts: list[int], low_f: int, low_tail: int,
                 low_work: int) -> list[Entry]:
        """Stage j's entries whose lower bound on E stays under the cap (module docstring)."""
        cm, m, v, cap = self.cm, self.m, self.chunks, self.cap
        row: list[Entry] = []
        last_a, dead = None, False
        ranges = self._ranges(j, starts)
        if self.compact:
            lo, hi = self.counts[j]
            ranges = ranges[lo - 1:hi]
        for a, e, size in ranges:
            if a != last_a:
                last_a, dead = a, False
            if dead:
                continue  # longer ranges from this start need more memory and time still
            choices = self.splitter.pareto(slot, a, e, m, self.n, v)
            if not choices:
                dead = True
                continue
            send = _ns(cm.stage_send(choices[0].out_bytes, slot.tp_group, nxt)) if j + 1 < self.S else 0
            grew = True
            for c in choices:
                f, b, s = _ns(c.times.fwd), _ns(c.times.bwd), _ns(c.times.sync)
                w = _ns(m * (c.times.fwd + c.times.bwd))
                if low_f + max(v * w, low_work + w) + max(low_tail if j else 0, s) > cap:
                    continue
                grew = False
                mem, inflight = c.memory, slot.inflight
                act = (min(inflight, 1) if mem.offload_act else inflight) * mem.act
                work = settled_work(mem, inflight, slot.microbatches)
                row.append(Entry(a, e, size, c, f, b, w, s, send, _kib_up(mem.static), _kib_up(act),
                                 _kib_up(work), _kib_up(mem.sync), _kib_up(mem.host),
                                 _kib_up(inflight * mem.host_act)))
            if grew:
                dead = True  # every option of this range already exceeds the cap
        return row

    def _reach(self) -> bool:
        """Drop entries no tiling can use (module docstring); False when a stage is left with none."""
        L, rows = self.cm.L, self.entries
        if self.compact:
            while True:
                lo = [min(en.size for en in row) for row in rows]
                hi = [max(en.size for en in row) for row in rows]
                kept = [[en for en in row if L - (sum(hi) - hi[j]) <= en.size <= L - (sum(lo) - lo[j])]
                        for j, row in enumerate(rows)]
                if not all(kept):
                    return False
                if sum(map(len, kept)) == sum(map(len, rows)):
                    return True
                rows = self.entries = kept
        for j in range(len(rows) - 1, -1, -1):  # ends that a later stage starts at; then starts reached
            ends = {L} if j == len(rows) - 1 else {en.a for en in rows[j + 1]}
            rows[j] = [en for en in rows[j] if en.e in ends]
            if not rows[j]:
                return False
        for j in range(1, len(rows)):
            reached = {en.e for en in rows[j - 1]}
            rows[j] = [en for en in rows[j] if en.a in reached]
        return True

    # ---- the constraints ------------------------------------------------------------------------
    def add(self, md, E, active=None, tag: str = "") -> list[list]:
        """Add this table's variables and constraints (T), (M), (H), (E) to `md` with objective variable E;
        with `active` (a BoolVar) every stage takes an entry only where it is true (all x are 0 otherwise, so
        every other constraint holds trivially). Returns the x variables, per stage."""
        x = [[md.NewBoolVar(f"x{tag}_{j}_{k}") for k in range(len(row))] for j, row in enumerate(self.entries)]
        self.tiling(md, x, active)
        self.memory(md, x, tag)
        self.objective(md, x, E)
        return x

    def _lin(self, x: list[list], j: int, field: str):
        """sum over stage j's entries of `field` x."""
        return sum(getattr(en, field) * xv for en, xv in zip(self.entries[j], x[j], strict=True))

    def tiling(self, md, x: list[list], active=None) -> None:
        """(T): one entry per stage; the ranges tile the chain."""
        L = self.cm.L
        for xs in x:
            if active is None:
                md.AddExactlyOne(xs)
            else:
                md.Add(sum(xs) == active)
        if self.compact:
            md.Add(sum(self._lin(x, j, "size") for j in range(self.S)) == (L if active is None else L * active))
            return
        for j in range(self.S - 1):
            for b in range(1, L):
                ending = [xv for en, xv in zip(self.entries[j], x[j], strict=True) if en.e == b]
                starting = [xv for en, xv in zip(self.entries[j + 1], x[j + 1], strict=True) if en.a == b]
                if ending or starting:
                    md.Add(sum(ending) == sum(starting))

    def memory(self, md, x: list[list], tag: str = "") -> None:
        """(M), (H), (A) for devices running several chunks; one chunk: already in the table."""
        if self.chunks == 1:
            return
        for q in range(self.p):
            js = list(range(q, self.S, self.p))
            slot = self.slots[q]
            budget, host_budget = _kib_down(slot.budget), _kib_down(slot.host_budget)
            A, K, Y, G, H = (md.NewIntVar(0, 1 << 50, f"{t}{tag}_{q}") for t in "AKYGH")
            for j in js:
                md.Add(A >= self._lin(x, j, "act"))
                md.Add(K >= self._lin(x, j, "wsp"))
                md.Add(Y >= self._lin(x, j, "msync"))
                md.Add(H >= self._lin(x, j, "host_act"))
            md.Add(G >= A + K)
            md.Add(G >= Y)
            host = sum(self._lin(x, j, "host") for j in js) + H
            if budget >= 0:  # (a budget that is not finite bounds nothing)
                md.Add(sum(self._lin(x, j, "static") for j in js) + G + (host if slot.unified else 0) <= budget)
            if host_budget >= 0:
                md.Add(host <= host_budget)

    def objective(self, md, x: list[list], E) -> None:
        """(E): the surrogate, two (or four, interleaved) linear constraints per stage."""
        p, v, S = self.p, self.chunks, self.S
        fwd, bwd, work, sync, send = ([self._lin(x, j, f) for j in range(S)]
                                      for f in ("fwd", "bwd", "work", "sync", "send"))
        F = [sum(fwd[i] + send[i] for i in range(q)) for q in range(p)]
        Q = [sum(bwd[i] + send[i] for i in range(q)) for q in range(p)]
        for j in range(S):
            q, c = j % p, j // p
            P = sum(work[q + k * p] for k in range(c + 1))
            for tail in (Q[q] + sync[0], (send[j - 1] if j else 0) + sync[j]):
                md.Add(E >= F[q] + P + tail)
                if v > 1:
                    md.Add(E >= F[q] + v * work[j] + tail)

    def stages(self, solver, x: list[list]) -> list[tuple[int, int, Choice]]:
        """The split a solution chose."""
        stages, a = [], 0
        for row, xs in zip(self.entries, x, strict=True):
            en = next(en for en, xv in zip(row, xs, strict=True) if solver.BooleanValue(xv))
            start = a if self.compact else en.a
            stages.append((start, start + en.size, en.choice))
            a = start + en.size
        assert a == self.cm.L
        return stages


def solver_for(time_limit_s: float, gap: float = GAP, guard: WallGuard | None = None):
    """A CP-SAT solver as the stage models run it: one worker, fixed seed, relative gap `gap`, a deterministic
    time limit; the wall clock only as the planning run's guard (budget.py: it warns where it cuts a solve)."""
    solver = budget.cpsat(max(0.05, time_limit_s), guard, gap)
    # no LP cuts: on a capped model (a feasibility question near the incumbent) the cut rounds filled the
    # deterministic time's wall clock 10x over without a split or a proof (GPT-3 175B on 1024 A100's 64-stage
    # finalist: 5.1 s of wall for 0.5 deterministic seconds, UNKNOWN; without cuts 0.9 s, a split found)
    solver.parameters.cut_level = 0
    return solver


class StageModel:
    """The CP-SAT model of one pipeline class (module docstring); `solve()` returns its split and gap."""

    def __init__(self, cm: CostModel, splitter: Splitter, slots: list[Slot], m: int, n: int, chunks: int,
                 incumbent: Split, gap: float = GAP, guard: WallGuard | None = None) -> None:
        self.cm, self.splitter, self.slots, self.gap = cm, splitter, slots, gap
        self.guard = guard  # the planning run's wall-clock guard (budget.py)
        self.m, self.n, self.chunks = m, n, chunks
        self.S, self.p = len(slots), len(slots) // chunks
        self.incumbent = incumbent
        self.U = self.value(incumbent.stages)
        self.cap = cap_ns(self.U, self.p, chunks, gap)
        self.table: StageTable | None = None
        self.pool: list[Split] = []  # near-optimal alternatives of the last solve (`_near_optimal`)
        # how the last solve ended: "pruned", "infeasible", "optimal", "feasible", "unknown", "too large"
        self.status = ""

    def value(self, stages: list[tuple[int, int, Choice]]) -> float:
        """`split.surrogate` of a split on this model's slots (float seconds)."""
        return priced_surrogate(self.cm, self.slots, stages, self.chunks, self.m)

    def _proven(self, lower_ns: int) -> Split:
        """The incumbent, no split being shorter than `lower_ns` (model units)."""
        lb = (lower_ns - rounding_slack(self.p, self.chunks)) / NS
        return Split(self.incumbent.stages, self.U, max(0.0, 1 - lb / self.U))

    def solve(self, time_limit_s: float) -> Split | None:
        """The split minimising the surrogate within the model's gap (GAP unless given; module docstring: what
        is proven), its `gap` set; None when the time limit ended the search with no split found under the cap,
        or the table is too large to build."""
        from ortools.sat.python import cp_model

        self.table = table = StageTable(self.cm, self.splitter, self.slots, self.m, self.n, self.chunks, self.cap)
        if not table.ok:
            if table.too_large:
                self.status = "too large"
                return None
            self.status = "pruned"
            return self._proven(self.cap + 1)
        md = cp_model.CpModel()
        E = md.NewIntVar(0, self.cap, "E")
        x = table.add(md, E)
        md.Minimize(E)
        solver = solver_for(time_limit_s, self.gap, self.guard)
        status = budget.solve(solver, md, f"the stage model of a {self.S}-stage pipeline")
        if status == cp_model.INFEASIBLE:
            self.status = "infeasible"
            return self._proven(self.cap + 1)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            self.status = "unknown"
            return None
        self.status = "optimal" if status == cp_model.OPTIMAL else "feasible"
        stages = table.stages(solver, x)
        value = self.value(stages)
        lb = (math.floor(solver.BestObjectiveBound()) - rounding_slack(self.p, self.chunks)) / NS
        if status == cp_model.OPTIMAL:
            self.pool = self._near_optimal(md, E, x, solver)
        return Split(stages, value, max(0.0, 1 - lb / value))

    def _near_optimal(self, md, E, x: list[list], solver) -> list[Split]:
        """Up to POOL more splits whose model value is within POOL_RTOL of the optimum `solver` found, next best
        first: each solve excludes the splits found before (a cut on their chosen entries). The surrogate only
        approximates the simulated step (with few micro-batches, splits of equal surrogate simulate apart), so
        the caller's simulator judges among them (`split.Splitter.split`)."""
        from ortools.sat.python import cp_model

        assert self.table is not None
        md.Add(E <= int(round(solver.ObjectiveValue()) * (1 + POOL_RTOL)) + rounding_slack(self.p, self.chunks))
        out: list[Split] = []
        for _ in range(POOL):
            chosen = [next(xv for xv in xs if solver.BooleanValue(xv)) for xs in x]
            md.Add(sum(chosen) <= len(chosen) - 1)
            solver = solver_for(POOL_DETERMINISTIC_S, 0.0, self.guard)
            if budget.solve(solver, md, f"the stage model's near-optimal pool of a {self.S}-stage pipeline") != \
                    cp_model.OPTIMAL:
                break
            stages = self.table.stages(solver, x)
            out.append(Split(stages, self.value(stages)))
        return out


def solve_split(cm: CostModel, splitter: Splitter, slots: list[Slot], m: int, n: int, chunks: int,
                incumbent: Split, time_limit_s: float = 10.0, guard: WallGuard | None = None) -> Split | None:
    """The stage model's split of one pipeline class within GAP of the optimum (module docstring), or None
    (see `StageModel.solve`)."""
    return StageModel(cm, splitter, slots, m, n, chunks, incumbent, guard=guard).solve(time_limit_s)


__all__ = ["GAP", "Entry", "StageModel", "StageTable", "cap_ns", "rounding_slack", "solve_split", "solver_for"]
