"""Layer split of one pipeline: which layers each stage runs, with which memory options.

A pipeline is a list of `Slot`s (stage positions: device type, tensor- and data-parallel groups,
in-flight micro-batches, the device's memory budget). `Splitter.stage` picks a stage's option (ZeRO
level, recompute, CPU offload) for a layer range: the one minimising m (fwd + bwd) + sync among those
with which the device still fits (offload and sharding only add time, so they enter only when memory
requires them). A device running several stages (interleaved chunks) is checked as `pricing.rank_peak`
prices it: its chunks' static memory summed, the largest in-flight activations and workspace once
(`RankState`), and so is what it offloads, against its share of its node's host memory (`Slot.host_budget`;
on unified-memory devices also against its own memory, pricing.py's docstring). `Splitter.split` chooses
the ranges (see its docstring); `surrogate.surrogate` is the objective it minimises. Sends between stages are
priced as the plan will send them (`CostModel.boundary_send`).
"""

from __future__ import annotations

import itertools
import math
import operator

from ...ir.plan import even_split, simulated_step_time
from ...ir.schedule import SPLIT_SCHEDULES
from ..budget import WallGuard
from ..pricing.pricing import (
    CostModel,
    Option,
    StageBase,
    StageMemory,
    StageTimes,
    lower_bound,
    settled_work,
    tied_sync,
)
from ..pricing.stage_memory import recomputed
from ..pricing.wgrad import wgrad_share, zero_bubble_backward
from .monotone import largest_true
from .stage_model import StageModel
from .surrogate import (
    NO_CHUNKS,
    Choice,
    Closest,
    RankState,
    Slot,
    Split,
    Unit,
    priced_surrogate,
    rank_fits,
    surrogate,
)

# the offload sets tried; ("optimizer", "params") without activations wins where activations fit but
# weights do not (tests/test_exhaustive_memory.py); ("params",) and ("activations", "params") are not tried
OFFLOAD_LADDER = ((), ("optimizer",), ("activations",), ("optimizer", "activations"), ("optimizer", "params"),
                  ("optimizer", "activations", "params"))
SPLIT_ENUMERATION = 64  # layer splits up to which every split is simulated
# the stage model's deterministic time limit per pipeline class (CP-SAT's unit; on these models a deterministic
# second took 5-10 s of CPU, 2026-12-06). Not proven by then: its best split with its larger gap, or the incumbent.
# Every stage model of bench/planner.py's cases and the OPT-350M / GPT-Neo-2.7B ones ends well under it (proven or
# pruned), but GPT-3 175B's 64-stage interleaved finalist: at 2.0 it found a split under its cap that did not change
# the plan, for ~16 s of CPU; at 0.5 none (the incumbent kept), the same plan (bench/plan_identity.py)
STAGE_MODEL_TIME_S = 0.5
PARETO_COMBOS = 256  # option combinations per layer split up to which `_enumerate(pareto=True)` tries them all
EXACT_SPLIT_LIMIT = 6_000  # stages x layers^2 up to which the surrogate is minimised exactly

# `Splitter.stage` takes the first option that fits without the floor check (which needs every option's memory)
# where the option's device need stays this fraction under the budget: the floor's activation term is rebuilt
# by a division and may round a few ulps above the least option's
CLEAR = 1e-9


class _Priced:
    """One range's options at one micro-batch size and slot kind: their times, and their memory priced on
    demand (`memory`) or all at once (`memories`), as `CostModel.options_memory` prices it."""

    __slots__ = ("D", "base", "layerwise", "mems", "opts", "out_bytes", "t", "times", "work")

    def __init__(self, base: StageBase, opts: list[Option], times: list[StageTimes], t: int, D: int,
                 layerwise: bool) -> None:
        self.base, self.opts, self.times, self.t, self.D, self.layerwise = base, opts, times, t, D, layerwise
        self.mems: list[StageMemory | None] = [None] * len(opts)
        self.work = [(tm.fwd + tm.bwd, tm.sync) for tm in times]  # what `ranked` scores them by, per micro-batch
        # `Choice.out_bytes` by the device kinds of the slot's tensor-parallel group (what `CostModel.base` keys on
        # beyond this entry's key)
        self.out_bytes: dict[tuple[str, ...], float] = {}

    def memory(self, cm: CostModel, i: int) -> StageMemory:
        mem = self.mems[i]
        if mem is None:
            mem = self.mems[i] = cm.stage_memory(self.base, self.opts[i], self.t, self.D, self.layerwise)
        return mem

    def memories(self, cm: CostModel) -> list[StageMemory]:
        if any(mem is None for mem in self.mems):
            self.mems = list(cm.options_memory(self.base, self.opts, self.t, self.D, self.layerwise))
        return self.mems  # type: ignore[return-value]


def _pareto(states: list[tuple]) -> list[tuple]:
    """The states no other state beats on all of its first four fields (first found wins ties); the
    fifth, the last send, is the same for every state of a front."""
    states = sorted(states, key=_FIRST_FOUR)
    kept: list[tuple] = []
    for st in states:
        f, b, s0 = st[1], st[2], st[3]
        for k in kept:  # k[0] <= st[0]: sorted
            if k[1] <= f and k[2] <= b and k[3] <= s0:
                break
        else:
            kept.append(st)
    return kept


_FIRST_FOUR = operator.itemgetter(0, 1, 2, 3)


class Splitter:
    """Memoised stage choices and layer splits on one cost model."""

    def __init__(self, cm: CostModel, guard: WallGuard | None = None) -> None:
        self.cm = cm
        self.guard = guard  # the planning run's wall-clock guard, for the stage model's solves (budget.py)
        self._choices: dict[tuple, Choice | None] = {}
        self._sorted: dict[tuple, list[tuple[float, Option, StageTimes, StageMemory]]] = {}
        self._timed: dict[tuple, tuple[_Priced, list[tuple[float, Option, StageTimes, int]]]] = {}
        self._options: dict[tuple, _Priced] = {}
        self._pareto: dict[tuple, list[Choice]] = {}
        self._by_start: dict[tuple, dict[int, Choice | None]] = {}
        self._floors: dict[int, tuple[list, tuple[float, ...]]] = {}
        # what stopped the options of a stage that found none, for the infeasibility message (`Closest`)
        self.closest: Closest | None = None
        self.closest_host: Closest | None = None

    def stage(self, slot: Slot, a: int, e: int, m: int, n: int, rank: RankState = NO_CHUNKS) -> Choice | None:
        """The fastest option for layers [a, e) on `slot` whose device still fits: `rank` holds what the
        device's earlier chunks (interleaved schedules) already use and how many chunks follow, which are
        assumed to need this one's static memory each (`RankState.need`)."""
        key = (self.cm.range_key(a, e), m, n, slot.inflight, slot.budget, slot.host_budget, slot.unified, rank,
              slot.dtype, slot.sigs, slot.layerwise, slot.mixed_tp)
        if key in self._choices:
            return self._choices[key]
        # the first option in time order that fits, its memory priced on demand: the fastest options usually
        # fit, and a range's options are many. Where one fits clear of the budget, the floor (`_floor`, no more
        # than its terms) fits too, so the full check below, which needs every option's memory, would pick it
        priced, timed = self._timings(slot, a, e, m, n)
        for _, opt, tm, i in timed:
            mem = priced.memory(self.cm, i)
            if rank.fits(mem, slot):
                host = rank.host_need(mem, slot.inflight) if slot.unified else 0.0
                if rank.need(mem, slot.inflight, slot.microbatches) + host <= slot.budget * (1 - CLEAR):
                    kinds = self.cm.device_kinds(slot.tp_group)
                    out = priced.out_bytes.get(kinds)
                    if out is None:
                        out = priced.out_bytes[kinds] = self.cm.base(a, e, slot.dtype, n, slot.tp_group).out_bytes
                    choice = self._choices[key] = Choice(opt, tm, mem, out)
                    return choice
                break
        ranked = self.ranked(slot, a, e, m, n)
        floor = self._floor(ranked, slot.inflight)
        choice = None
        if rank.fits(floor, slot):
            for _, opt, tm, mem in ranked:
                if rank.fits(mem, slot):
                    choice = Choice(opt, tm, mem, self.cm.base(a, e, slot.dtype, n, slot.tp_group).out_bytes)
                    break
        if choice is None:
            self._note_closest(slot, ranked, rank, (a, e), floor)
        self._choices[key] = choice
        return choice

    def _floor(self, ranked: list[tuple[float, Option, StageTimes, StageMemory]], inflight: int) -> StageMemory:
        """Every memory term's smallest value over the options of `ranked` (with `inflight` micro-batches in
        flight): `RankState.need` and `host_need` grow with each term, so where this does not fit, no
        option does."""
        hit = self._floors.get(id(ranked))
        if hit is None:
            mems = [entry[3] for entry in ranked]
            kept = [mem.act for mem in mems if not mem.offload_act]
            dropped = [mem.act for mem in mems if mem.offload_act]
            hit = self._floors[id(ranked)] = (ranked, (  # the list itself kept, so its id stays its own
                min(mem.static for mem in mems), min(kept, default=math.inf), min(dropped, default=math.inf),
                min(mem.work - mem.first for mem in mems), min(mem.host for mem in mems),
                min(mem.host_act for mem in mems), min(mem.sync for mem in mems)))
        static, kept_act, dropped_act, work, host, host_act, sync = hit[1]
        act = min(inflight * kept_act, min(inflight, 1) * dropped_act) if inflight else 0.0
        return StageMemory(static, act / inflight if inflight else 0.0, work, False, host, host_act, sync)

    def _ends(self, slot: Slot, a: int, m: int, n: int, rank: RankState) -> dict:
        """`stage`'s choices for ranges starting at `a` by their end, filled as `greedy` asks (one key built
        per stage of a greedy pass instead of one per range it tries)."""
        key = (a, m, n, slot.inflight, slot.budget, slot.host_budget, slot.unified, rank, slot.dtype, slot.sigs,
               slot.layerwise, slot.mixed_tp)
        hit = self._by_start.get(key)
        if hit is None:
            hit = self._by_start[key] = {}
        return hit

    def ranked(self, slot: Slot, a: int, e: int, m: int, n: int) -> list[tuple[float, Option, StageTimes, StageMemory]]:
        """Every option of layers [a, e) on `slot` as (m (fwd + bwd) + sync, option, times, memory), fastest
        first (ties in the canonical, simplest-first order); memoised per range class."""
        key = (slot.dtype, slot.sigs, self.cm.range_key(a, e), n, slot.layerwise, slot.mixed_tp, m)
        ranked = self._sorted.get(key)
        if ranked is None:
            priced, timed = self._timings(slot, a, e, m, n)
            mems = priced.memories(self.cm)
            ranked = self._sorted[key] = [(score, opt, tm, mems[i]) for score, opt, tm, i in timed]
        return ranked

    def _timings(self, slot: Slot, a: int, e: int, m: int, n: int
                 ) -> tuple[_Priced, list[tuple[float, Option, StageTimes, int]]]:
        """`ranked` without the memory: the range's priced options, and (m (fwd + bwd) + sync, option, times,
        index in them), fastest first, in `ranked`'s order."""
        key = (slot.dtype, slot.sigs, self.cm.range_key(a, e), n, slot.layerwise, slot.mixed_tp)
        hit = self._timed.get(key + (m,))
        if hit is None:
            priced = self._options.get(key)
            if priced is None:  # times and memory per micro-batch: the same at every micro-batch count
                priced = self._options[key] = self._priced_options(slot, a, e, n)
            scores = [m * w + sync for w, sync in priced.work]
            # stable sort, rounded: ties (up to float noise) keep the canonical, simplest-first order
            order = sorted(range(len(scores)), key=lambda i: round(scores[i], 12))
            opts, times = priced.opts, priced.times
            timed = [(scores[i], opts[i], times[i], i) for i in order]
            hit = self._timed[key + (m,)] = (priced, timed)
        return hit

    def _priced_options(self, slot: Slot, a: int, e: int, n: int) -> _Priced:
        """Every option of layers [a, e) on `slot` in the canonical, simplest-first order, with its times at
        micro-batch size n (and its memory, priced when asked for: `_Priced`)."""
        cm = self.cm
        base = cm.base(a, e, slot.dtype, n, slot.tp_group)
        D, t = len(slot.dp_group), len(slot.tp_group)
        opts = [Option(z, rc, off) for off in OFFLOAD_LADDER
                for z in range((4 if slot.layerwise else 2) if D > 1 else 1)
                for rc in ((False, True) if base.has_blocks else (False,)) if not (z == 3 and "params" in off)]
        times = cm.options_times(base, opts, slot.dtype, slot.tp_group, slot.dp_group, slot.sigs[1], slot.layerwise,
                                 slot.mixed_tp)
        return _Priced(base, opts, times, t, D, slot.layerwise)

    def _note_closest(self, slot: Slot, ranked: list[tuple[float, Option, StageTimes, StageMemory]],
                      rank: RankState, layers: tuple[int, int], floor: StageMemory) -> None:
        """Keep the stage nearest to fitting: by device memory (its smallest need over the options), and,
        among options whose device memory fits, by host memory (then host memory is what stops it).
        `floor` (`_floor`) bounds both from below: a stage it shows cannot beat the kept ones is skipped."""
        low_host = rank.host_need(floor, slot.inflight)
        low_dev = rank.need(floor, slot.inflight, slot.microbatches) + (low_host if slot.unified else 0.0)
        dev_can = self.closest is None or low_dev - slot.budget < self.closest.need - self.closest.budget
        host_can = low_dev <= slot.budget and (self.closest_host is None or low_host - slot.host_budget
                                               < self.closest_host.host - self.closest_host.host_budget)
        if not dev_can and not host_can:
            return
        best_dev = best_host = None
        for _, opt, _, mem in ranked:
            host = rank.host_need(mem, slot.inflight)
            dev = rank.need(mem, slot.inflight, slot.microbatches) + (host if slot.unified else 0.0)
            c = Closest(dev, slot.budget, host, slot.host_budget, slot.dtype, slot.tp_group[0], opt, layers)
            if best_dev is None or dev < best_dev.need:
                best_dev = c
            if dev <= slot.budget and (best_host is None or host < best_host.host):
                best_host = c
        assert best_dev is not None
        if self.closest is None or best_dev.need - best_dev.budget < self.closest.need - self.closest.budget:
            self.closest = best_dev
        if best_host is not None and (self.closest_host is None or best_host.host - best_host.host_budget
                                      < self.closest_host.host - self.closest_host.host_budget):
            self.closest_host = best_host

    def greedy(self, slots: list[Slot], T: float, m: int, n: int, chunks: int) -> Split | None:
        """Each stage in chain order takes the most layers that keep its surrogate term (see `surrogate`)
        under T and its device's memory (all its chunks together, `RankState`) under budget, leaving one
        layer for each later stage."""
        cm, S, p = self.cm, len(slots), len(slots) // chunks
        fwd_pre, bwd_pre, work = [0.0] * p, [0.0] * p, [0.0] * p
        held = [RankState(later=chunks - 1)] * p
        a, pf, pb, worst, prev_send = 0, 0.0, 0.0, 0.0, 0.0
        out: list[tuple[int, int, Choice]] = []

        def term(c: Choice) -> float:
            w = m * (c.times.fwd + c.times.bwd)
            first_sync = out[0][2].times.sync if out else c.times.sync
            tail = max(bwd_pre[r] + first_sync, prev_send + c.times.sync)
            return fwd_pre[r] + max(work[r] + w, chunks * w) + tail

        def fits(e: int) -> bool:
            c = ends.get(e, ends)
            if c is ends:
                c = ends[e] = self.stage(slot, a, e, m, n, held[r])
            return c is not None and term(c) <= T  # type: ignore[union-attr]

        for j, slot in enumerate(slots):
            r = j % p
            if j < p:
                fwd_pre[r], bwd_pre[r] = pf, pb
            lo, hi = (cm.L, cm.L) if j == S - 1 else (a + 1, cm.L - (S - 1 - j))
            ends = self._ends(slot, a, m, n, held[r])
            # the largest e that fits (stage costs grow with the range), searched from the previous stage's
            # size outwards: stages of a balanced split are alike, so a few probes find it
            size = out[-1][1] - out[-1][0] if out else -(-cm.L // S)
            got = largest_true(fits, lo, hi, a + size)
            if got is None:
                return None
            lo = got
            c = ends[lo]
            assert c is not None
            held[r] = held[r].add(c.memory, slot.inflight, slot.microbatches)
            worst = max(worst, term(c))
            work[r] += m * (c.times.fwd + c.times.bwd)
            nxt = slots[j + 1].tp_group if j + 1 < S else slot.tp_group
            prev_send = cm.stage_send(c.out_bytes, slot.tp_group, nxt)  # 0 to itself
            if j < p:
                pf, pb = pf + c.times.fwd + prev_send, pb + c.times.bwd + prev_send
            out.append((a, lo, c))
            a = lo
        return Split(out, worst)

    def split(self, slots: list[Slot], share: int, m: int, schedule: str, chunks: int, lo: float = 0.0,
              fast: bool = False, cutoff: float = math.inf, model: bool = False, prune: bool = False
              ) -> Split | None:
        """The layer split of one pipeline (with its stage options) for `share` samples in m micro-batches.

        Few possible splits: all are scored by their lower bound and simulated in bound order (exact).
        Otherwise the surrogate is minimised, exactly by `_exact` on non-interleaved medium chains,
        else by bisection between `lo` (a bound the surrogate cannot beat) and the memory-only split,
        with the greedy feasibility test (always, with `fast`). The chunks of one device (interleaved
        schedules) are checked together against its memory, as `pricing.rank_peak` prices them.
        `cutoff`: a step the caller already has; candidates whose lower bound reaches it are not simulated
        (the one returned then has a bound >= cutoff, so the caller discards it). `model`: then the CP-SAT
        stage model (stage_model.py: split and per-stage options together, the best of the above as its
        incumbent, proven within its GAP of the surrogate's optimum, `Split.gap`), on every chain. `prune`: the
        caller drops any split whose lower bound reaches `cutoff` (and uses none of its parts), so `_exact` may
        drop states whose term reaches it where the surrogate bounds `pricing.lower_bound` from below (`_exact`).
        """
        n = -(-share // m)
        if not fast and math.comb(self.cm.L - 1, len(slots) - 1) <= SPLIT_ENUMERATION:
            return self._enumerate(slots, share, m, schedule, chunks, cutoff, pareto=model)
        best = self.greedy(slots, math.inf, m, n, chunks)
        if best is None:
            return None
        if fast:
            return self._bisect(slots, m, n, chunks, lo, best, None)
        even = self.even(slots, m, n, chunks)
        if chunks == 1 and len(slots) * self.cm.L ** 2 <= EXACT_SPLIT_LIMIT:
            # the dynamic program drops states whose term reaches the incumbent's: start from the better one
            start = even if even is not None and even.surrogate < best.surrogate else best
            # all micro-batches full and B not split from W: a split's lower bound (`values` adds the tied sync)
            # is at least its surrogate, so a state whose term reaches the cutoff leads to no split the caller keeps
            full = prune and not model and share % m == 0 and schedule not in SPLIT_SCHEDULES
            known = [self._exact(slots, m, n, start, cutoff if full else math.inf), even]
        else:
            known = [self._bisect(slots, m, n, chunks, lo, best, even), even]
        if model:
            incumbent = min((sp for sp in known if sp is not None),
                            key=lambda sp: priced_surrogate(self.cm, slots, sp.stages, chunks, m))
            sm = StageModel(self.cm, self, slots, m, n, chunks, incumbent, guard=self.guard)
            got = sm.solve(STAGE_MODEL_TIME_S)
            if got is not None and got.stages is incumbent.stages:  # proven within the gap: not simulated twice
                known[known.index(incumbent)] = got
            else:
                known[:0] = [got, *sm.pool]
        return self._simulated_best(known, slots, share, m, schedule, chunks, cutoff)

    def _bisect(self, slots: list[Slot], m: int, n: int, chunks: int, lo: float, best: Split,
                even: Split | None) -> Split:
        """The bisection on the surrogate between `lo` and the better of `best` (the memory-only split) and
        `even`, with the greedy feasibility test: the best split it finds."""
        hi = best.surrogate
        if even is not None:  # Megatron's split, where it fits, is a tighter start than the memory-only one
            hi = min(hi, even.surrogate)
        while hi - lo > 1e-3 * hi:  # the surrogate only guides the split; 0.1% is plenty
            mid = (lo + hi) / 2
            got = self.greedy(slots, mid, m, n, chunks)
            if got is None:
                lo = mid
            else:
                hi = got.surrogate
                if got.surrogate < best.surrogate:
                    best = got
        return best

    def even(self, slots: list[Slot], m: int, n: int, chunks: int) -> Split | None:
        """Megatron's split: the repeated blocks evenly over the stages (the first ones one more when they
        do not divide), the layers before/after them on the first/last stage; None if it does not fit or
        the stages run on several device types."""
        cm, S, p = self.cm, len(slots), len(slots) // chunks
        if cm.num_blocks < S or len({slot.dtype for slot in slots}) > 1:
            return None  # on mixed device types an even split is no natural candidate
        edges = [0]
        for j, count in enumerate(even_split(cm.num_blocks, S)):
            edges.append((cm.first_block if j == 0 else edges[-1]) + count)
        edges[-1] = cm.L
        # options: each chunk the fastest that fits with the chunks before it, first without, then with
        # the projection of the later chunks (`RankState`); the faster of the two that fit
        found = []
        for later in (0, chunks - 1):
            held = [RankState(later=later)] * p
            out = []
            for j, slot in enumerate(slots):
                c = self.stage(slot, edges[j], edges[j + 1], m, n, held[j % p])
                if c is None:
                    break
                held[j % p] = held[j % p].add(c.memory, slot.inflight, slot.microbatches)
                out.append((edges[j], edges[j + 1], c))
            if len(out) == S:
                found.append(Split(out, surrogate([c.times for _, _, c in out], [0.0] * S, p, m)))
        return min(found, key=lambda sp: sp.surrogate) if found else None

    def _simulated_best(self, splits: list[Split | None], slots: list[Slot], share: int, m: int, schedule: str,
                        chunks: int, cutoff: float = math.inf) -> Split:
        """The candidate whose simulated step is shortest (the first on ties). Candidates are simulated in
        lower-bound order while their bound beats the best step so far and `cutoff`; when none does, the
        one with the smallest bound is returned unsimulated."""
        found = [split for split in splits if split is not None]
        if len(found) == 1:
            return found[0]
        q, r = divmod(share, m)
        sizes = even_split(share, m)
        scored = []
        zb = (q + (1 if r else 0)) if schedule in SPLIT_SCHEDULES else 0
        for k, split in enumerate(found):
            vals = self.values(slots, split, q if r else 0, zero_bubble=zb)
            scored.append((lower_bound(vals, sizes, len(slots) // chunks, schedule in SPLIT_SCHEDULES), k, split, vals))
        scored.sort(key=lambda x: x[:2])
        best, best_step = scored[0][2], cutoff
        for bound, _, split, vals in scored:
            if bound >= best_step:
                break
            step = simulated_step_time(schedule, chunks, share, m, vals)
            if step < best_step:
                best, best_step = split, step
        return best

    def pareto(self, slot: Slot, a: int, e: int, m: int, n: int, chunks: int = 1) -> list[Choice]:
        """The options of layers [a, e) on `slot` that fit its device alone and that no other such option
        dominates: no slower in forward, backward and sync and, with several chunks per device, needing no
        more of any memory term (the simulated step and the surrogate are monotone in each)."""
        key = (slot, self.cm.range_key(a, e), m, n, chunks)
        hit = self._pareto.get(key)
        if hit is not None:
            return hit
        inflight = slot.inflight
        out_bytes = self.cm.base(a, e, slot.dtype, n, slot.tp_group).out_bytes
        kept: list[tuple] = []
        out: list[Choice] = []
        for _, opt, tm, mem in self.ranked(slot, a, e, m, n):
            if not NO_CHUNKS.fits(mem, slot):
                continue
            vec: tuple = (tm.fwd, tm.bwd, tm.sync)
            if chunks > 1:
                act = (min(inflight, 1) if mem.offload_act else inflight) * mem.act
                vec += (mem.static, act, settled_work(mem, inflight, slot.microbatches), mem.sync, mem.host,
                        inflight * mem.host_act)
            if not any(all(k <= v for k, v in zip(kv, vec, strict=True)) for kv in kept):
                kept.append(vec)
                out.append(Choice(opt, tm, mem, out_bytes))
        self._pareto[key] = out
        return out

    def _combos(self, slots: list[Slot], edges: tuple[int, ...], m: int, n: int, chunks: int,
                pareto: bool) -> list[list[tuple[int, int, Choice]]]:
        """The option choices of one layer split: each stage the fastest option that fits with its device's
        chunks before it (exact device peak, `rank_peak`; sufficient, not optimal), or, with `pareto`,
        every combination of each stage's `pareto` options whose devices fit (at most PARETO_COMBOS)."""
        S, p = len(slots), len(slots) // chunks
        if pareto:
            lists = [self.pareto(slots[j], edges[j], edges[j + 1], m, n, chunks) for j in range(S)]
            if all(lists) and math.prod(map(len, lists)) <= PARETO_COMBOS:
                out = []
                for combo in itertools.product(*lists):
                    if chunks == 1 or all(rank_fits([c.memory for c in combo[q::p]], slots[q].inflight, slots[q],
                                                    slots[q].microbatches)
                                          for q in range(p)):
                        out.append([(edges[j], edges[j + 1], c) for j, c in enumerate(combo)])
                return out
        held = [NO_CHUNKS] * p
        stages = []
        for j in range(S):
            c = self.stage(slots[j], edges[j], edges[j + 1], m, n, held[j % p])
            if c is None:
                return []
            held[j % p] = held[j % p].add(c.memory, slots[j].inflight, slots[j].microbatches)
            stages.append((edges[j], edges[j + 1], c))
        return [stages]

    def _enumerate(self, slots: list[Slot], share: int, m: int, schedule: str, chunks: int,
                   cutoff: float = math.inf, pareto: bool = False) -> Split | None:
        """Every layer split (with `_combos`' options), simulated in lower-bound order: exact under the
        simulator for the options tried."""
        cm, S, n = self.cm, len(slots), -(-share // m)
        q, r = divmod(share, m)
        sizes = even_split(share, m)
        scored = []
        for cuts in itertools.combinations(range(1, cm.L), S - 1):
            for stages in self._combos(slots, (0, *cuts, cm.L), m, n, chunks, pareto):
                split = Split(stages, 0.0)
                vals = self.values(slots, split, q if r else 0, zero_bubble=n if schedule in SPLIT_SCHEDULES else 0)
                scored.append((lower_bound(vals, sizes, S // chunks, schedule in SPLIT_SCHEDULES), len(scored), split,
                               vals))
        if not scored:
            return None
        scored.sort(key=lambda x: x[:2])
        best, best_step = None, math.inf
        for bound, _, split, vals in scored:
            if bound >= min(best_step, cutoff):
                break
            step = simulated_step_time(schedule, chunks, share, m, vals)
            if step < best_step:
                best, best_step = split, step
        if best is None:  # no split beats the cutoff: the smallest bound (unsimulated), for the caller to drop
            best, best_step = scored[0][2], scored[0][0]
        best.surrogate = best_step
        return best

    def _exact(self, slots: list[Slot], m: int, n: int, incumbent: Split, cutoff: float = math.inf) -> Split:
        """The split minimising the surrogate, by dynamic programming over (stage, first free layer) with
        Pareto fronts of (max term so far, forward prefix, backward prefix, stage 0's sync): the prefix
        sums decide later terms, so one value per state is not enough. Non-interleaved schedules only.
        States whose term reaches the incumbent's surrogate or `cutoff` are dropped (terms only grow along a
        split, and a state that dominates one kept is below both too): the incumbent is returned where no
        split is under both."""
        cm, S = self.cm, len(slots)
        # state: (max term, fwd prefix, bwd prefix, sync of stage 0, last send, back pointer)
        fronts: dict[int, list[tuple]] = {0: [(0.0, 0.0, 0.0, 0.0, 0.0, None)]}
        cap = min(incumbent.surrogate, cutoff)
        for j, slot in enumerate(slots):
            new: dict[int, list[tuple]] = {}
            nxt = slots[j + 1].tp_group if j + 1 < S else slot.tp_group
            for a, states in fronts.items():
                ends = self._ends(slot, a, m, n, NO_CHUNKS)  # `stage`'s choices by end, shared with `greedy`
                for e in ([cm.L] if j == S - 1 else range(a + 1, cm.L - (S - 1 - j) + 1)):
                    c = ends.get(e, ends)
                    if c is ends:
                        c = ends[e] = self.stage(slot, a, e, m, n)
                    if c is None:
                        break  # longer ranges need more memory still
                    send = cm.stage_send(c.out_bytes, slot.tp_group, nxt)
                    times = c.times
                    w = m * (times.fwd + times.bwd)
                    f, b, sync = times.fwd + send, times.bwd + send, times.sync
                    into = None
                    for st in states:
                        s0 = sync if j == 0 else st[3]
                        # max(st[0], st[1] + w + max(st[2] + s0, st[4] + sync)), spelled out (the hot loop)
                        tail, other = st[2] + s0, st[4] + sync
                        worst = st[1] + w + (other if other > tail else tail)
                        if st[0] >= worst:
                            worst = st[0]
                        if worst < cap:
                            if into is None:  # (an end joins `new` with its first state: the fronts' order)
                                into = new.setdefault(e, [])
                            into.append((worst, st[1] + f, st[2] + b, s0, send, (st, a, e, c)))
            fronts = {e: _pareto(states) for e, states in new.items()}
        if cm.L not in fronts:
            return incumbent
        state = min(fronts[cm.L], key=lambda st: st[0])
        value, stages = state[0], []
        while state[5] is not None:
            state, a, e, c = state[5]
            stages.append((a, e, c))
        return Split(stages[::-1], value)

    def values(self, slots: list[Slot], split: Split, small: int, pipe: tuple[Unit, ...] | None = None,
               zero_bubble: int = 0) -> list[tuple]:
        """`simulate_stages` times of `split` solved on `slots`, run on `pipe` (default: the slots' own
        groups; another pipeline must have equivalent groups). `zero_bubble`: under a zero-bubble schedule,
        the full micro-batch size (B and W each recompute, `wgrad.zero_bubble_backward`, as `price` prices)."""
        cm, vals = self.cm, []
        if pipe is None:
            pipe = tuple(slot.tp_group for slot in slots[:len({s.tp_group for s in slots})])
        p = len(pipe)
        tied = tied_sync(cm, [(a, e, slots[j].tp_group, slots[j].dp_group) for j, (a, e, _) in enumerate(split.stages)])
        for j, (a, e, c) in enumerate(split.stages):
            slot = slots[j]
            ts = (cm.stage_times(cm.base(a, e, slot.dtype, small, slot.tp_group), c.option, slot.dtype,
                                 slot.tp_group, slot.dp_group, layerwise=slot.layerwise, mixed_tp=slot.mixed_tp)
                  if small else StageTimes(0.0, 0.0, 0.0, 0.0))
            last = j + 1 == len(slots)
            send = 0.0 if last else cm.stage_send(c.out_bytes, pipe[j % p], pipe[(j + 1) % p])
            bwd, bwd_w, bwd_small = c.times.bwd, wgrad_share(cm, a, e, slot.dtype) * c.times.bwd, ts.bwd
            if zero_bubble and c.option.recompute:
                rc = recomputed(cm.base(a, e, slot.dtype, zero_bubble, slot.tp_group), c.option.recompute)[0]
                bwd, bwd_w = zero_bubble_backward(cm, a, e, slot.dtype, c.times.bwd, rc, j == 0)
                if small:
                    rc_small = recomputed(cm.base(a, e, slot.dtype, small, slot.tp_group), c.option.recompute)[0]
                    bwd_small = zero_bubble_backward(cm, a, e, slot.dtype, ts.bwd, rc_small, j == 0)[0]
            vals.append((c.times.fwd, ts.fwd, bwd, bwd_small, send, c.times.sync + tied[j], bwd_w))  # W: wgrad.py
        return vals


__all__ = ["NO_CHUNKS", "Choice", "Closest", "RankState", "Slot", "Split", "Splitter", "Unit", "priced_surrogate",
           "rank_fits", "surrogate"]
