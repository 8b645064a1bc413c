"""The planner's search: best-first branch and bound over device groupings, exact pricing at the leaves.

Formulation
-----------
Given the coarse layer chain 0..L-1 (prologue, blocks, epilogue), a cluster of devices and the global
batch B, choose

    t                tensor-parallel degree (divides every node's device count: tp stays inside a node)
    pipelines        a partition of the tp groups into D pipelines of p ranks each
    sigma, v         schedule (gpipe, 1f1b, interleaved_1f1b with v chunks per rank) and chunks
    b                micro-batch size (pipeline d runs m_d = ceil(s_d / b) micro-batches)
    [a_j, e_j)       per pipeline, the layer range of each of its p*v stages
    o_j              per stage, ZeRO level 0-3, recompute, CPU offload of optimizer/activations/params
    s_d              per pipeline, its integer batch share

to minimise the simulated step time  max_d simulate(schedule(sigma, p, m_d, v), stage times)  subject to

    (C1) every pipeline's stages tile [0, L), one layer at least each            `_split`, `check_plan`
    (C2) every device's peak memory (static state of its stages + peak in-flight micro-batches x
         activations + recompute workspace) <= (1 - reserve) x capacity          `_stage`, `price`
    (C3) sum_d s_d = B, 1 <= m_d <= s_d, m_d % p == 0 for interleaved            `_batch_split`, `_solve`
    (C4) every device in exactly one tp group of one pipeline rank              `_groupings`

Decomposition
-------------
Outer (`_configs`): enumerate (t, grouping, sigma, v, b). Groupings on one device type: Megatron's
stage-major order (stage s of replica d = tp group s*D + d) and replica-major order (a replica on
consecutive groups). On several types: "mixed" pipelines (each holds an equal slice of every type,
stages in cluster order, faster and slower devices alternate along one pipeline) and "by-type"
pipelines (each on one device type; replicas of different types). Every config gets a valid lower
bound on its step time (`_config_bound`): for a single pipeline class with X the work of its largest
share at the fastest device type's per-sample cost, X/m / (1 - (1 - 1/m)^p) for gpipe/1f1b (the min
over real stage splits of max_s [prefix forward + stage work]), max(X/p, X/m) for interleaved, and the
throughput bound B / sum_d (p_d / w_d) for several classes. Configs are visited in increasing bound
order and the search stops when the bound reaches the best simulated step (branch and bound).

Inner, per config and pipeline class:
  * layer split and stage options (`_split`): minimise the surrogate
        E = max_j [ F_j + m c_j + max(Q_j, sync_j) ]
    (F_j, Q_j: forward/backward prefix of the stages before j with sends; c_j = fwd_j + bwd_j per
    micro-batch; the bound `pricing.lower_bound` uses the same terms) by bisection on E with a greedy
    feasibility test: each stage takes the most layers that keep its term under the threshold and its
    memory under budget (C2). Stage costs are monotone in the range, so each stage is a binary search.
    `_stage` picks the option o_j minimising m c_j + sync_j among those that fit (offload and ZeRO only
    enter when memory requires them: they only add time). On a uniform chain a range is costed by its
    block count, so deep models cost as few evaluations as shallow ones.
  * batch split (`_batch_split`, CP-SAT) when replicas differ (by-type groupings): integer s_c
    (per-replica share of class c with k_c replicas), r_c replicas taking one more sample,
        min Z  s.t.  sum_c k_c s_c + r_c = B,   Z >= E_c(s_c + [r_c > 0])  (AddElement on a table of
    E_c over shares that fit in memory), with a fixed seed and the deterministic interleaved search.
    Splits are then re-solved at the chosen shares.
Leaves (`pricing.price`): the chosen candidate is priced exactly (memory per device, simulate() of each
distinct pipeline); it is only simulated when its lower bound beats the incumbent.

Determinism: the enumeration order, bisection and tie-breaking (first in canonical order wins) are
fixed and CP-SAT runs with a fixed seed and interleaved (deterministic) search, so equal inputs give
equal plans. A time limit returns the best plan found so far with a warning.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import InfeasibleError
from ..plan import Pipeline, Plan, Stage, simulate_stages
from ..report import fmt_bytes, fmt_time
from .pricing import (
    CostModel,
    Option,
    StageMemory,
    StageTimes,
    inflight_closed_form,
    lower_bound,
    model_summary,
    price,
)

Progress = Callable[[int, int, float | None], None]
OFFLOAD_LADDER = ((), ("optimizer",), ("activations",), ("optimizer", "activations"),
                  ("optimizer", "activations", "params"))
CHUNKS = (2, 4)
EXACT_SPLIT_LIMIT = 40_000  # stages x layers^2 up to which the layer split is solved exactly
SHARE_TABLE_EXACT = 64  # batch shares up to which the batch split's table solves a split per share
Unit = tuple[int, ...]  # a tensor-parallel group


class Config(NamedTuple):
    bound: float
    index: int
    tp: int
    grouping: str
    pipelines: tuple[tuple[Unit, ...], ...]
    schedule: str
    chunks: int
    b: int


class Slot(NamedTuple):
    """One stage position of a pipeline: where it runs and what memory it may use."""

    dtype: str
    tp_group: Unit
    dp_group: Unit
    inflight: int
    budget: float
    sigs: tuple[int, int]  # CostModel.group_sig of the tp and dp groups


class Choice(NamedTuple):
    option: Option
    times: StageTimes
    memory: StageMemory
    out_bytes: float


@dataclass
class Split:
    stages: list[tuple[int, int, Choice]]
    surrogate: float


class Solved(NamedTuple):
    build: Callable[[], Plan]  # the plan without predictions (built only for a new incumbent)
    bound: float  # no simulated step of this plan is shorter
    pipelines: list[tuple[int, int, list[tuple]]]  # (share, micro-batches, stage times) of distinct replicas


# ---- enumeration --------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _units(cm: CostModel, t: int) -> list[Unit]:
    return [tuple(node.devices[i:i + t]) for node in cm.cluster.nodes for i in range(0, len(node.devices), t)]


def _groupings(cm: CostModel, units: list[Unit]) -> list[tuple[str, tuple[tuple[Unit, ...], ...]]]:
    by_type: dict[str, list[Unit]] = {}
    for u in units:
        by_type.setdefault(cm.cluster.devices[u[0]].spec.name, []).append(u)
    U, out = len(units), []
    for D in _divisors(U):
        p = U // D
        if p > cm.L or D > cm.B:
            continue
        if len(by_type) == 1:
            out.append(("stage-major", tuple(tuple(units[s * D + d] for s in range(p)) for d in range(D))))
            if D > 1 and p > 1:
                out.append(("replica-major", tuple(tuple(units[d * p:(d + 1) * p]) for d in range(D))))
            continue
        if all(len(us) % D == 0 for us in by_type.values()):
            out.append(("mixed", tuple(tuple(u for us in by_type.values()
                                             for u in us[d * len(us) // D:(d + 1) * len(us) // D])
                                       for d in range(D))))
        if all(len(us) % p == 0 for us in by_type.values()):
            out.append(("by-type", tuple(tuple(us[k * p:(k + 1) * p]) for us in by_type.values()
                                         for k in range(len(us) // p))))
    return out


def _microbatch_sizes(share: int) -> list[int]:
    if share <= 8:
        return list(range(1, share + 1))
    sizes = [1 << k for k in range(share.bit_length()) if (1 << k) < share]
    return sizes + [share]


def _schedules(p: int, L: int) -> list[tuple[str, int]]:
    if p == 1:
        return [("1f1b", 1)]
    return [("gpipe", 1), ("1f1b", 1)] + [("interleaved_1f1b", v) for v in CHUNKS if p * v <= L]


def _even(total: int, parts: int) -> list[int]:
    q, r = divmod(total, parts)
    return [q + 1 if i < r else q for i in range(parts)]


def _microbatches(share: int, b: int, ranks: int, schedule: str) -> int | None:
    m = -(-share // b)
    if schedule == "interleaved_1f1b" and m % ranks:
        m += ranks - m % ranks
    return m if m <= share else None


def surrogate(times: list[StageTimes], sends: list[float], ranks: int, mult: float) -> float:
    """The inner objective: max over stages j on rank r of
        F_r + max(W_r, v w_j) + max(Q_r + sync_0, send_{j-1} + sync_j),    w_j = mult (fwd_j + bwd_j)
    with F_r, Q_r the forward/backward prefix (sends included) of the stages before rank r's first one,
    W_r the rank's total work (mult = micro-batches). It bounds `pricing.lower_bound` from above (so a
    config's bound also bounds it from below); v w_j keeps interleaved chunks even."""
    chunks = len(times) // ranks
    fwd_pre, bwd_pre, work = [0.0] * ranks, [0.0] * ranks, [0.0] * ranks
    pf = pb = worst = 0.0
    for j, t in enumerate(times):
        r = j % ranks
        if j < ranks:
            fwd_pre[r], bwd_pre[r] = pf, pb
            pf, pb = pf + t.fwd + sends[j], pb + t.bwd + sends[j]
        w = mult * (t.fwd + t.bwd)
        work[r] += w
        tail = max(bwd_pre[r] + times[0].sync, (sends[j - 1] if j else 0.0) + t.sync)
        worst = max(worst, fwd_pre[r] + max(work[r], chunks * w) + tail)
    return worst


def _pareto(states: list[tuple]) -> list[tuple]:
    """The states no other state beats on all of its first five fields (first found wins ties)."""
    states = sorted(states, key=lambda st: st[:5])
    kept: list[tuple] = []
    for st in states:
        if not any(all(k[i] <= st[i] for i in range(5)) for k in kept):
            kept.append(st)
    return kept


# ---- the search -----------------------------------------------------------------------------------


class Search:
    def __init__(self, cm: CostModel, time_limit_s: float = 60.0, progress: Progress | None = None) -> None:
        self.cm = cm
        self.deadline = time.perf_counter() + time_limit_s
        self.time_limit_s = time_limit_s
        self.progress = progress
        self._choices: dict[tuple, Choice | None] = {}
        self._sorted: dict[tuple, list[tuple[float, Option, StageTimes, StageMemory]]] = {}
        self._work: dict[tuple, float] = {}
        self.closest: tuple[float, float, str] | None = None  # (need, budget, device type) nearest to fitting
        self._dp_cache: tuple[object, list[Unit]] = (None, [])

    # -- configs --
    def _configs(self) -> list[Config]:
        cm = self.cm
        gcd = 0
        for node in cm.cluster.nodes:
            gcd = math.gcd(gcd, len(node.devices))
        out: list[Config] = []
        for t in _divisors(gcd):
            for name, pipes in _groupings(cm, _units(cm, t)):
                p = len(pipes[0])
                for schedule, v in _schedules(p, cm.L):
                    for b in _microbatch_sizes(-(-cm.B // len(pipes))):
                        cfg = Config(0.0, len(out), t, name, pipes, schedule, v, b)
                        bound = self._config_bound(cfg)
                        if bound is not None:
                            out.append(cfg._replace(bound=bound))
        return sorted(out)

    def _per_sample(self, pipe: tuple[Unit, ...], b: int) -> float:
        """Seconds per sample of the whole model at micro-batch size b (the most efficient size a
        micro-batch of this config has), each layer on the fastest device type of the pipeline."""
        cm = self.cm
        units = {cm.cluster.devices[u[0]].spec.name: u for u in reversed(pipe)}
        key = tuple((d, cm.group_sig(u)) for d, u in sorted(units.items())) + (b,)
        if key not in self._work:
            total = 0.0
            for i in range(cm.L):
                costs = [cm.base(i, i + 1, d, b, u) for d, u in units.items()]
                total += min(c.fwd + c.bwd + c.fwd_comm + c.bwd_comm for c in costs)
            self._work[key] = total / b
        return self._work[key]

    def _config_bound(self, cfg: Config) -> float | None:
        cm, pipes = self.cm, cfg.pipelines
        D, p = len(pipes), len(pipes[0])
        per = [self._per_sample(pipe, cfg.b) for pipe in pipes]
        if len(set(per)) > 1:
            return cm.B / sum(p / w for w in per)
        share = -(-cm.B // D)
        m = _microbatches(share, cfg.b, p, cfg.schedule)
        if m is None or (cfg.b > share):
            return None
        X = share * per[0]
        if cfg.schedule == "interleaved_1f1b":
            return max(X / p, X / m)
        return X / m / (1 - (1 - 1 / m) ** p)

    # -- stage choice --
    def _stage(self, slot: Slot, a: int, e: int, m: int, n: int) -> Choice | None:
        cm = self.cm
        key = (slot.dtype, slot.sigs, cm.range_key(a, e), m, n)
        ck = (key, slot.inflight, slot.budget)
        if ck in self._choices:
            return self._choices[ck]
        ranked = self._sorted.get(key)
        base = cm.base(a, e, slot.dtype, n, slot.tp_group)
        if ranked is None:
            D, t = len(slot.dp_group), len(slot.tp_group)
            ranked = []
            for off in OFFLOAD_LADDER:
                for z in range(4) if D > 1 else (0,):
                    for rc in (False, True) if base.has_blocks else (False,):
                        if z == 3 and "params" in off:
                            continue
                        opt = Option(z, rc, off)
                        tm = cm.stage_times(base, opt, slot.dtype, slot.tp_group, slot.dp_group)
                        mem = cm.stage_memory(base, opt, t, D)
                        ranked.append((m * (tm.fwd + tm.bwd) + tm.sync, opt, tm, mem))
            # stable sort, rounded: ties (up to float noise) keep the canonical, simplest-first order
            ranked.sort(key=lambda x: round(x[0], 12))
            self._sorted[key] = ranked
        choice = None
        for _, opt, tm, mem in ranked:
            if mem.peak(slot.inflight) <= slot.budget:
                choice = Choice(opt, tm, mem, base.out_bytes)
                break
        if choice is None:
            need = min(mem.peak(slot.inflight) for _, _, _, mem in ranked)
            if self.closest is None or need - slot.budget < self.closest[0] - self.closest[1]:
                self.closest = (need, slot.budget, slot.dtype)
        self._choices[ck] = choice
        return choice

    # -- layer split --
    def _greedy(self, slots: list[Slot], T: float, m: int, n: int, chunks: int) -> Split | None:
        """Each stage in chain order takes the most layers that keep its surrogate term (see `surrogate`)
        under T and its memory under budget, leaving one layer for each later stage."""
        cm, S, p = self.cm, len(slots), len(slots) // chunks
        fwd_pre, bwd_pre, work = [0.0] * p, [0.0] * p, [0.0] * p
        a, pf, pb, worst, prev_send = 0, 0.0, 0.0, 0.0, 0.0
        out: list[tuple[int, int, Choice]] = []

        def term(c: Choice) -> float:
            w = m * (c.times.fwd + c.times.bwd)
            first_sync = out[0][2].times.sync if out else c.times.sync
            tail = max(bwd_pre[r] + first_sync, prev_send + c.times.sync)
            return fwd_pre[r] + max(work[r] + w, chunks * w) + tail

        def fits(e: int) -> bool:
            c = self._stage(slot, a, e, m, n)
            return c is not None and term(c) <= T

        for j, slot in enumerate(slots):
            r = j % p
            if j < p:
                fwd_pre[r], bwd_pre[r] = pf, pb
            lo, hi = (cm.L, cm.L) if j == S - 1 else (a + 1, cm.L - (S - 1 - j))
            if lo > hi or not fits(lo):
                return None
            while lo < hi:  # the largest e that fits: stage costs grow with the range
                mid = (lo + hi + 1) // 2
                if fits(mid):
                    lo = mid
                else:
                    hi = mid - 1
            c = self._stage(slot, a, lo, m, n)
            assert c is not None
            worst = max(worst, term(c))
            work[r] += m * (c.times.fwd + c.times.bwd)
            nxt = slots[j + 1].tp_group[0] if j + 1 < S else slot.tp_group[0]
            prev_send = cm.send_time(c.out_bytes, slot.tp_group[0], nxt)  # 0 to itself
            if j < p:
                pf, pb = pf + c.times.fwd + prev_send, pb + c.times.bwd + prev_send
            out.append((a, lo, c))
            a = lo
        return Split(out, worst)

    def _split(self, slots: list[Slot], m: int, n: int, chunks: int, lo: float = 0.0) -> Split | None:
        """Bisection on the surrogate between `lo` (a bound it cannot beat) and the memory-only split."""
        best = self._greedy(slots, math.inf, m, n, chunks)
        if best is None:
            return None
        if chunks == 1 and len(slots) * self.cm.L ** 2 <= EXACT_SPLIT_LIMIT:
            return self._split_exact(slots, m, n, best)
        hi = best.surrogate
        while hi - lo > 1e-3 * hi:  # the surrogate only guides the split; 0.1% is plenty
            mid = (lo + hi) / 2
            got = self._greedy(slots, mid, m, n, chunks)
            if got is None:
                lo = mid
            else:
                hi = got.surrogate
                if got.surrogate < best.surrogate:
                    best = got
        return best

    def _split_exact(self, slots: list[Slot], m: int, n: int, incumbent: Split) -> Split:
        """The split minimising the surrogate, by dynamic programming over (stage, first free layer) with
        Pareto fronts of (max term so far, forward prefix, backward prefix, stage 0's sync): the prefix
        sums decide later terms, so one value per state is not enough. Non-interleaved schedules only."""
        cm, S = self.cm, len(slots)
        # state: (max term, fwd prefix, bwd prefix, sync of stage 0, last send, back pointer)
        fronts: dict[int, list[tuple]] = {0: [(0.0, 0.0, 0.0, 0.0, 0.0, None)]}
        for j, slot in enumerate(slots):
            new: dict[int, list[tuple]] = {}
            for a, states in fronts.items():
                for e in ([cm.L] if j == S - 1 else range(a + 1, cm.L - (S - 1 - j) + 1)):
                    c = self._stage(slot, a, e, m, n)
                    if c is None:
                        break  # longer ranges need more memory still
                    nxt = slots[j + 1].tp_group[0] if j + 1 < S else slot.tp_group[0]
                    send = cm.send_time(c.out_bytes, slot.tp_group[0], nxt)
                    w = m * (c.times.fwd + c.times.bwd)
                    f, b = c.times.fwd + send, c.times.bwd + send
                    for st in states:
                        s0 = c.times.sync if j == 0 else st[3]
                        worst = max(st[0], st[1] + w + max(st[2] + s0, st[4] + c.times.sync))
                        if worst < incumbent.surrogate:
                            state = (worst, st[1] + f, st[2] + b, s0, send, (st, a, e, c))
                            new.setdefault(e, []).append(state)
            fronts = {e: _pareto(states) for e, states in new.items()}
        if cm.L not in fronts:
            return incumbent
        state = min(fronts[cm.L], key=lambda st: st[0])
        value, stages = state[0], []
        while state[5] is not None:
            state, a, e, c = state[5]
            stages.append((a, e, c))
        return Split(stages[::-1], value)

    def _slots(self, cfg: Config, pipe: tuple[Unit, ...], m: int) -> list[Slot]:
        cm, p, v = self.cm, len(pipe), cfg.chunks
        inflight = inflight_closed_form(cfg.schedule, p, m, v)
        if self._dp_cache[0] is not cfg.pipelines:
            groups = [tuple(other[r][0] for other in cfg.pipelines) for r in range(p)]
            self._dp_cache = (cfg.pipelines, groups)
        dp = self._dp_cache[1]
        return [Slot(cm.cluster.devices[pipe[j % p][0]].spec.name, pipe[j % p], dp[j % p], inflight[j % p],
                     min(cm.usable(d) for d in pipe[j % p]) / v,
                     (cm.group_sig(pipe[j % p]), cm.group_sig(dp[j % p]))) for j in range(p * v)]

    def _values(self, pipe: tuple[Unit, ...], slots: list[Slot], split: Split, small: int) -> list[tuple]:
        """`simulate_stages` times of `pipe` run with `split` (solved on `slots`, of equivalent groups)."""
        cm, p, vals = self.cm, len(pipe), []
        for j, (a, e, c) in enumerate(split.stages):
            slot = slots[j]
            ts = (cm.stage_times(cm.base(a, e, slot.dtype, small, slot.tp_group), c.option, slot.dtype,
                                 slot.tp_group, slot.dp_group) if small else StageTimes(0.0, 0.0, 0.0, 0.0))
            last = j + 1 == len(slots)
            send = 0.0 if last else cm.send_time(c.out_bytes, pipe[j % p][0], pipe[(j + 1) % p][0])
            vals.append((c.times.fwd, ts.fwd, c.times.bwd, ts.bwd, send, c.times.sync))
        return vals

    # -- batch split --
    def _batch_split(self, cfg: Config, classes: dict[tuple, list[int]]) -> list[int] | None:
        from ortools.sat.python import cp_model

        cm = self.cm
        n_pipes = len(cfg.pipelines)
        top = cm.B - (n_pipes - 1)
        tables = [self._share_table(cfg, cfg.pipelines[ix[0]], top) for ix in classes.values()]
        big = 1 + max((x for t in tables for x in t if x is not None), default=0)
        model = cp_model.CpModel()
        Z = model.NewIntVar(0, big, "Z")
        count = []
        for c, (ix, table) in enumerate(zip(classes.values(), tables, strict=True)):
            k = len(ix)
            ok = [s for s in range(1, top + 1) if table[s] is not None]
            if not ok:
                return None
            dom = cp_model.Domain.FromValues(ok)
            s_c, hi_c = model.NewIntVarFromDomain(dom, f"s{c}"), model.NewIntVarFromDomain(dom, f"hi{c}")
            r_c, extra = model.NewIntVar(0, k - 1, f"r{c}"), model.NewBoolVar(f"x{c}")
            model.Add(r_c >= 1).OnlyEnforceIf(extra)
            model.Add(r_c == 0).OnlyEnforceIf(extra.Not())
            model.Add(hi_c == s_c + extra)  # the replicas that take one sample more
            t_c = model.NewIntVar(0, big, f"t{c}")
            model.AddElement(hi_c, [big if x is None else x for x in table], t_c)
            model.Add(Z >= t_c)
            count.append((k, s_c, r_c))
        model.Add(sum(k * s + r for k, s, r in count) == cm.B)
        model.Minimize(Z)
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 8
        solver.parameters.interleave_search = True  # deterministic
        solver.parameters.random_seed = 0
        solver.parameters.max_time_in_seconds = max(1.0, min(10.0, self.deadline - time.perf_counter()))
        if solver.Solve(model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        shares: list[int] = [0] * n_pipes
        for (_, s, r), ix in zip(count, classes.values(), strict=True):
            sv, rv = solver.Value(s), solver.Value(r)
            for pos, d in enumerate(ix):
                shares[d] = sv + (1 if pos < rv else 0)
        return shares

    def _share_table(self, cfg: Config, pipe: tuple[Unit, ...], top: int) -> list[int | None]:
        """Surrogate step time (ns) of one replica on `pipe` for every batch share 1..top; None where it
        does not fit. The split is solved at every share when there are few, else at powers of two,
        and a share between them reuses the split of the next solved share up (memory re-checked)."""
        cm, p = self.cm, len(pipe)
        anchors = list(range(1, top + 1)) if top <= SHARE_TABLE_EXACT else \
            sorted({1 << k for k in range(top.bit_length()) if 1 << k < top} | {top})
        solved: dict[int, tuple[list[Slot], Split | None, int]] = {}
        table: list[int | None] = [None]
        for s in range(1, top + 1):
            m = _microbatches(s, min(cfg.b, s), p, cfg.schedule)
            if m is None:
                table.append(None)
                continue
            a = next(x for x in anchors if x >= s)
            if a not in solved:
                ma = _microbatches(a, min(cfg.b, a), p, cfg.schedule) or m
                slots = self._slots(cfg, pipe, ma)
                solved[a] = (slots, self._split(slots, ma, -(-a // ma), cfg.chunks), -(-a // ma))
            slots, split, n_a = solved[a]
            if split is None or (a != s and not self._fits(cfg, slots, split, m, -(-s // m))):
                table.append(None)
                continue
            sends = [0.0 if j + 1 == len(slots) else
                     cm.send_time(c.out_bytes, pipe[j % p][0], pipe[(j + 1) % p][0])
                     for j, (_, _, c) in enumerate(split.stages)]
            table.append(round(surrogate([c.times for _, _, c in split.stages], sends, p, s / n_a) * 1e9))
        return table

    def _fits(self, cfg: Config, slots: list[Slot], split: Split, m: int, n: int) -> bool:
        """Whether `split`'s stages and options fit with m micro-batches of n samples."""
        cm, p = self.cm, len(slots) // cfg.chunks
        inflight = inflight_closed_form(cfg.schedule, p, m, cfg.chunks)
        for j, (a, e, c) in enumerate(split.stages):
            slot = slots[j]
            base = cm.base(a, e, slot.dtype, n, slot.tp_group)
            mem = cm.stage_memory(base, c.option, len(slot.tp_group), len(slot.dp_group))
            if mem.peak(inflight[j % p]) > slot.budget:
                return False
        return True

    # -- one config --
    def _solve(self, cfg: Config) -> Solved | None:
        cm, pipes = self.cm, cfg.pipelines
        p = len(pipes[0])
        types = [tuple(cm.cluster.devices[u[0]].spec.name for u in pipe) for pipe in pipes]
        classes: dict[tuple, list[int]] = {}
        for d, key in enumerate(types):
            classes.setdefault(key, []).append(d)
        shares = _even(cm.B, len(pipes)) if len(classes) == 1 else self._batch_split(cfg, classes)
        if shares is None or min(shares) < 1:
            return None
        splits: dict[tuple, tuple[list[Slot], Split]] = {}
        distinct: dict[tuple, tuple[int, int, list[tuple]]] = {}
        keys = []
        for d, pipe in enumerate(pipes):
            share = shares[d]
            m = _microbatches(share, min(cfg.b, share), p, cfg.schedule)
            if m is None:
                return None
            key = (types[d], share, m)
            if key not in splits:
                slots = self._slots(cfg, pipe, m)
                split = self._split(slots, m, -(-share // m), cfg.chunks, lo=cfg.bound)
                if split is None:
                    return None
                splits[key] = (slots, split)
            keys.append(key)
            # replicas whose stages talk over equivalent links behave the same: simulate one of each
            links = tuple(cm.group_sig((pipe[j % p][0], pipe[(j + 1) % p][0]))
                          for j in range(p * cfg.chunks - 1))
            if key + (links,) not in distinct:
                slots, split = splits[key]
                small = share // m if share % m else 0
                distinct[key + (links,)] = (share, m, self._values(pipe, slots, split, small))
        bound = 0.0
        for share, m, vals in distinct.values():
            q, r = divmod(share, m)
            bound = max(bound, lower_bound(vals, [q + 1] * r + [q] * (m - r), p))

        def build() -> Plan:
            out = []
            for pipe, key in zip(pipes, keys, strict=True):
                _, share, m = key
                stages = [Stage([a, e], list(pipe[j % p]), c.option.zero, c.option.recompute,
                                list(c.option.offload)) for j, (a, e, c) in enumerate(splits[key][1].stages)]
                out.append(Pipeline(share, -(-share // m), m, stages))
            return Plan(cm.B, cm.precision, cm.optimizer, cfg.schedule, cfg.chunks, cm.cluster.to_dict(),
                        model_summary(cm.graph), out, {}, cm.reserve)

        return Solved(build, bound, list(distinct.values()))

    # -- driver --
    def run(self) -> Plan:
        configs = self._configs()
        best: Plan | None = None
        best_step = math.inf
        stopped_early = False
        for k, cfg in enumerate(configs):
            if cfg.bound >= best_step:
                break  # configs come in bound order: none of the rest can win
            if time.perf_counter() > self.deadline and best is not None:
                stopped_early = True
                break
            solved = self._solve(cfg)
            if solved is not None and solved.bound < best_step:
                step = max(simulate_stages(cfg.schedule, cfg.chunks, share, m, vals).step_time
                           for share, m, vals in solved.pipelines)
                if step < best_step:
                    priced = price(self.cm, solved.build())
                    # the search's per-stage memory checks are sufficient for the per-device ones
                    assert priced is not None and priced.fits
                    best, best_step = priced.plan, priced.plan.predicted["step_time_s"]
            if self.progress is not None:
                self.progress(k + 1, len(configs), best_step if best is not None else None)
        if best is None:
            raise InfeasibleError(self._infeasible_message())
        if stopped_early:
            warnings.warn(f"planning stopped at the time limit ({self.time_limit_s:g} s) after {k} of "
                          f"{len(configs)} configurations; returning the best plan so far "
                          f"({fmt_time(best_step)}/step). Raise time_limit_s for a possibly better one.",
                          stacklevel=3)
        return best

    def _infeasible_message(self) -> str:
        cm = self.cm
        devices = cm.cluster.devices
        state = cm.graph.num_params() * cm.state.total
        total = sum(d.spec.memory for d in devices)
        per_sample = sum(cm.saved) / cm.B
        msg = (f"no plan fits in memory on {cm.cluster.describe()}. The training state alone "
               f"({cm.graph.num_params():,} parameters x {cm.state.total} bytes for {cm.optimizer} in "
               f"{cm.precision}) is {fmt_bytes(state)}; the cluster has {fmt_bytes(total)} of device memory "
               f"in all ({fmt_bytes(total * (1 - cm.reserve))} usable with the {100 * cm.reserve:.0f}% "
               f"reserve).")
        if self.closest is not None:
            need, budget, dtype = self.closest
            msg += (f" Even with ZeRO-3 across replicas, recompute, CPU offload and micro-batches of one "
                    f"sample, a {dtype} needs at least {fmt_bytes(need)} for its share but has "
                    f"{fmt_bytes(budget)} usable.")
            need_cap = need / (1 - cm.reserve)
            msg += f" To fit: use devices with at least {fmt_bytes(need_cap)} of memory,"
        else:
            msg += " To fit: use devices with more memory,"
        return msg + (f" add devices (pipeline and tensor parallelism split the model further), or lower "
                      f"the global batch or sequence length (activations take {fmt_bytes(per_sample)} per "
                      f"sample).")


def search(cm: CostModel, time_limit_s: float = 60.0, progress: Progress | None = None) -> Plan:
    """The fastest plan that fits; see the module docstring for the formulation."""
    return Search(cm, time_limit_s, progress).run()


__all__ = ["Config", "Search", "search"]
