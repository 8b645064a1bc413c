"""Lower bounds on a search config's simulated step time: what branch and bound (search.py) prunes with.

A config (t, grouping, sigma, v, b) gets the larger of two bounds, both valid for every layer split and
every choice of per-stage options the inner search may make (search.py's docstring):

  work bound (`ConfigBounds.work`)
      one pipeline class: X = share x (per-sample forward + backward of every layer, each on the fastest
      device type of the pipeline, at the cheapest option), then X/m / (1 - (1 - 1/m)^p) for
      gpipe / 1f1b / zb_h1 (the minimum over real stage splits of max_s [forward prefix + stage work]) and
      max(X/p, X/m) for interleaved. Several classes (pipelines whose per-sample work w_d differs, so the
      batch split may give them different shares): f_d(s) = that bound for share s (X = s w_d, m the count
      a replica of share s runs, `microbatch_count`) bounds pipeline d's step, so the step is at least
          min over integer s_d >= 1 with sum_d s_d = B of max_d f_d(s_d) =: T*.
      Relaxed: T is taken as feasible when every class c (k_c pipelines) has a share with f_c <= T and
      sum_c k_c min{s: f_c(s) <= T} <= B <= sum_c k_c max{s: f_c(s) <= T}; every T >= T* is (the optimal
      shares are witnesses), feasibility grows with T, so the least feasible value of the tables is <= T*.
      It is never below the throughput bound B / sum_d (p / w_d) (which it takes the larger of): with
      f_d(s) >= s w_d / p, shares summing to B reach max_d s_d w_d / p >= B / sum_d (p / w_d).

  mixed pipelines (`ConfigBounds.capacity`): X prices each layer on the pipeline's fastest type, as if every
      device were that fast. A unit u of a slower type is at least r_u(S) = min over the layers l of S of
      cost_u(l) / min_v cost_v(l) slower on any set S of layers; with F_S the fastest per-sample seconds of S, the
      busiest device of a replica of share s then takes T >= s F_S / sum_u 1 / r_u(S) (each device's time over
      its r_u is at least s times its layers' fastest work, and those sum to s F_S). S is taken as all layers and
      as the repeated blocks (whose slowdowns agree), with the per-micro-batch setup of one stage counted once
      (m >= s / b micro-batches): f(s) >= s (setup / b + F_S / (b C_S)) for either S, written s w / capacity
      (`_pipeline_work`). On a pipeline of one type C_S is p and the bound the weaker X / p.

  memory bound (`ConfigBounds.memory`), one device type, replicas alike (B divisible by D), uniform chain
      The p devices tile the L_b repeated blocks, so one of them holds k >= ceil(L_b / p) blocks in its v
      chunks, the largest of which has g >= ceil(k / v) blocks. Costs and memory grow with the blocks
      held, so that device's work is at least
          min over options o of the big chunk that fit alone,
              m (fwd + bwd)(g blocks, o) + LP(k - g blocks, budget - need(g blocks, o))
      where need is the chunk's static memory plus its in-flight activation term (`RankState.need`) and LP
      the fractional relaxation of giving the remaining blocks options: min sum_o x_o t_o subject to
      sum_o x_o = k - g, sum_o x_o s_o <= the budget left, with t_o (s_o) a per-block time (static bytes)
      that no range of up to k blocks beats on average (the smaller of the one-block figure and the
      k-block figure over k: exact for costs affine in the block count). At most two options mix in the
      optimum of that one-constraint LP. For one chunk (v = 1) the big chunk is the stage and its sync
      joins its work (`pricing.plan.lower_bound`: a stage's sync follows its last backward). Micro-batches
      are all taken at the smallest size, host memory is not checked, and each device position's own
      in-flight count and budget are used, the minimum over positions taken: relaxations, so the result
      stays a lower bound.

The search visits configs in increasing bound order and stops when the bound reaches the incumbent, so a
tighter bound means fewer configs solved, never a different optimum.
"""

from __future__ import annotations

import bisect
import itertools
import math
from typing import NamedTuple

import numpy as np

from ..pricing.pricing import CostModel, Option, StageMemory, StageTimes, settled_work
from ..split.split import Slot, Splitter, Unit
from .configs import microbatch_count
from .ilp_ahead import IlpAhead

Ranked = list[tuple[float, Option, StageTimes, StageMemory]]


class BoundConfig(NamedTuple):
    """What a bound needs of a search config (`search.Config` has these fields)."""

    pipelines: tuple[tuple[Unit, ...], ...]
    schedule: str
    chunks: int
    b: int


def _chunk_need(mem: StageMemory, inflight: int, microbatches: int | None) -> float:
    act = (min(inflight, 1) if mem.offload_act else inflight) * mem.act
    return mem.static + act + settled_work(mem, inflight, microbatches)


def _lp(per_block: list[tuple[float, float]], blocks: int, budget: float) -> float:
    """min sum x_o t_o s.t. sum x_o = blocks, sum x_o s_o <= budget, x >= 0; `per_block`: (s_o, t_o) sorted
    by s with t strictly decreasing (the others are dominated)."""
    if blocks == 0:
        return 0.0 if budget >= 0 else math.inf
    cap = budget / blocks
    best = math.inf
    for i, (si, ti) in enumerate(per_block):
        if si <= cap:
            best = min(best, ti)
            continue
        for sj, tj in per_block[:i]:  # mix a cheaper-in-memory option j with i to meet the budget exactly
            if sj <= cap:
                lam = (si - cap) / (si - sj)
                best = min(best, lam * tj + (1 - lam) * ti)
    return blocks * best


def _pipeline_work(X: float, m: int, p: int, schedule: str, capacity: float | None = None) -> float:
    """The work bound of one pipeline of p ranks running work X (seconds at the fastest device type of each layer)
    in m micro-batches (module docstring); `capacity`: the pipeline's devices as fastest-device equivalents
    (`ConfigBounds.capacity`), whose bound X / capacity is taken where larger."""
    fill = max(X / p, X / m) if schedule == "interleaved_1f1b" else X / m / (1 - (1 - 1 / m) ** p)
    return fill if capacity is None else max(fill, X / capacity)


class ConfigBounds:
    """The bounds of the module docstring, memoised on one cost model and splitter."""

    def __init__(self, cm: CostModel, splitter: Splitter) -> None:
        self.cm = cm
        self.splitter = splitter
        self._work: dict[tuple, float] = {}
        self._device: dict[tuple, float] = {}
        self._costs: dict[tuple, list[float]] = {}
        self._capacity: dict[tuple, float] = {}
        self._per_pipes: dict[tuple[int, int], tuple[tuple, list[tuple[float, float]]]] = {}
        self._share_counts: dict[tuple, tuple[np.ndarray, ...]] = {}
        # a helper solving some of the ILPs the unit costs ask for (ilp_ahead.py), while the bounds are computed
        self.ahead: IlpAhead | None = None

    def _setup(self, dtype: str) -> float:
        """A stage's per-micro-batch host setup on `dtype` (forward and backward): paid once per stage, not per
        layer."""
        return 2 * self.cm.models[dtype].host.microbatch_s

    def unit_costs(self, u: Unit, b: int) -> list[float]:
        """Per layer, its forward + backward seconds (tensor-parallel traffic included) on unit `u` at micro-batch
        size b, less the stage's setup (`_setup`), which a bound counts once."""
        cm = self.cm
        dtype = cm.cluster.devices[u[0]].spec.name
        key = (dtype, cm.group_sig(u), b)
        hit = self._costs.get(key)
        if hit is None:
            if self.ahead is not None:
                self.ahead.before(dtype, u, b)
            setup = self._setup(dtype)
            hit = self._costs[key] = [c.fwd + c.bwd + c.fwd_comm + c.bwd_comm - setup
                                      for c in (cm.base(i, i + 1, dtype, b, u) for i in range(cm.L))]
        return hit

    def per_sample(self, pipe: tuple[Unit, ...], b: int) -> float:
        """Seconds per sample of the whole model at micro-batch size b (the most efficient size a
        micro-batch of this config has), each layer on the fastest device type of the pipeline."""
        cm = self.cm
        units = {cm.cluster.devices[u[0]].spec.name: u for u in reversed(pipe)}
        key = tuple((d, cm.group_sig(u)) for d, u in sorted(units.items())) + (b,)
        if key not in self._work:
            costs = [self.unit_costs(u, b) for u in units.values()]
            total = min(self._setup(d) for d in units)
            for i in range(cm.L):
                total += min(c[i] for c in costs)
            self._work[key] = total / b
        return self._work[key]

    def capacity(self, pipe: tuple[Unit, ...], b: int) -> float:
        """The pipeline's devices counted as devices of the fastest type per layer (module docstring, "mixed
        pipelines"), against `per_sample`'s w: w / max over two layer sets S (all layers, the repeated blocks) of
        setup / b + F_S / (b C_S), with C_S = sum_u 1 / r_u(S) and r_u(S) = min over the layers l of S of
        cost_u(l) / min_v cost_v(l) (the least slowdown of unit u's type), F_S the fastest seconds of S at
        micro-batch size b; so that s w / capacity is the largest of those bounds for a share of s samples."""
        cm = self.cm
        kinds = [(cm.cluster.devices[u[0]].spec.name, cm.group_sig(u)) for u in pipe]
        key = (b, tuple(kinds))
        hit = self._capacity.get(key)
        if hit is None:
            costs = {k: self.unit_costs(u, b) for k, u in zip(kinds, pipe, strict=True)}
            fastest = [min(c[i] for c in costs.values()) for i in range(cm.L)]
            setup = min(self._setup(k[0]) for k in costs)
            low = 0.0  # the largest per-sample bound over the layer sets
            for layers in (range(cm.L), [i for i in range(cm.L) if cm.is_block[i]]):
                live = [i for i in layers if fastest[i] > 0]
                if not live:
                    continue
                slow = {k: min(c[i] / fastest[i] for i in live) for k, c in costs.items()}
                C = sum(1 / slow[k] for k in kinds)
                low = max(low, (setup + sum(fastest[i] for i in live) / C) / b)
            hit = self._capacity[key] = self.per_sample(pipe, b) / low if low > 0 else math.inf
        return hit

    def throughput(self, cfg: BoundConfig) -> float | None:
        """Where the config's pipelines differ in per-sample work, B / sum_d (p / w_d) (module docstring), else
        None. The inner split's bisection starts from it, not from the config's bound: a pipeline lighter than
        the slowest may split below that (search.py `_split`)."""
        per = [w for w, _ in self._per_pipe(cfg)]
        return self.cm.B / sum(len(cfg.pipelines[0]) / w for w in per) if len(set(per)) > 1 else None

    def _per_pipe(self, cfg: BoundConfig) -> list[tuple[float, float]]:
        """(`per_sample`, `capacity`) of each pipeline of the config (memoised per grouping: configs share its
        tuple)."""
        cm, pipes = self.cm, cfg.pipelines
        hit = self._per_pipes.get((id(pipes), cfg.b))
        if hit is None or hit[0] is not pipes:
            # both depend on the pipeline's device types and tensor-parallel groups only: once per kind of pipeline
            of_kind: dict[tuple, tuple[float, float]] = {}
            out = []
            for pipe in pipes:
                kind = tuple((cm.cluster.devices[u[0]].spec.name, cm.group_sig(u)) for u in pipe)
                got = of_kind.get(kind)
                if got is None:
                    got = of_kind[kind] = (self.per_sample(pipe, cfg.b), self.capacity(pipe, cfg.b))
                out.append(got)
            hit = self._per_pipes[(id(pipes), cfg.b)] = (pipes, out)
        return hit[1]

    def work(self, cfg: BoundConfig) -> float | None:
        """The work bound; None where the config cannot run (a micro-batch size above the share, or no
        valid micro-batch count)."""
        cm, pipes = self.cm, cfg.pipelines
        D, p = len(pipes), len(pipes[0])
        per = self._per_pipe(cfg)
        if len(set(per)) > 1:
            return self._classes(cfg, per)
        share = -(-cm.B // D)
        m = microbatch_count(share, min(cfg.b, share), p, cfg.schedule)
        if m is None or (cfg.b > share):
            return None
        w, capacity = per[0]
        return _pipeline_work(share * w, m, p, cfg.schedule, capacity)

    def shares(self, cfg: BoundConfig, w: float, top: int, capacity: float | None = None) -> list[float]:
        """Per batch share s = 0..top, the work bound f(s) of one pipeline of `cfg` doing w seconds per sample
        with share s in the micro-batches a replica of that share runs (`microbatch_count`; inf where it cannot
        run, and at s = 0): no pipeline of that share steps faster. `capacity`: the pipeline's (`capacity`), for
        the bound of mixed pipelines too. `_pipeline_work` at every share, its arithmetic done on arrays (the
        same operations in the same order, so the same values)."""
        p = len(cfg.pipelines[0])
        key = (p, cfg.schedule, cfg.b, top)
        hit = self._share_counts.get(key)
        if hit is None:  # per share: s, its micro-batch count m, and the 1f1b fill's divisor at m
            counts = [microbatch_count(s, min(cfg.b, s), p, cfg.schedule) for s in range(1, top + 1)]
            runs = np.array([m is not None for m in counts])
            m = np.array([c or 1 for c in counts], dtype=np.float64)
            den = np.array([1 - (1 - 1 / c) ** p if c else 1.0 for c in counts])
            hit = self._share_counts[key] = (np.arange(1, top + 1, dtype=np.float64), m, den, runs)
        shares, m, den, runs = hit
        X = shares * w
        fill = np.maximum(X / p, X / m) if cfg.schedule == "interleaved_1f1b" else X / m / den
        if capacity is not None:
            fill = np.maximum(fill, X / capacity)
        return [math.inf, *np.where(runs, fill, math.inf).tolist()]

    def _classes(self, cfg: BoundConfig, per: list[tuple[float, float]]) -> float | None:
        """The work bound of pipelines whose per-sample work or capacity differs (module docstring, "several
        classes"): min over integer shares s_d >= 1 summing to B of max_d f_d(s_d), relaxed to each class's
        interval of shares at most T; None where no shares can run. `per`: each pipeline's (per-sample work,
        capacity)."""
        cm, D = self.cm, len(cfg.pipelines)
        top = cm.B - (D - 1)
        counts: dict[tuple[float, float], int] = {}
        for wc in per:
            counts[wc] = counts.get(wc, 0) + 1
        tables = [(k, self.shares(cfg, w, top, c)[1:]) for (w, c), k in counts.items()]
        # per class, the running minimum of f from the left (non-increasing) and from the right (non-decreasing):
        # the least share with f <= T is the first whose left minimum is <= T, the largest the last whose right
        # minimum is
        reach = []
        for k, f in tables:
            left = list(itertools.accumulate(f, min))
            right = list(itertools.accumulate(reversed(f), min))[::-1]
            reach.append((k, left, right))

        def feasible(T: float) -> bool:
            lo = hi = 0
            for k, left, right in reach:
                if left[-1] > T:
                    return False
                first = bisect.bisect_left(left, True, key=lambda x: x <= T)
                last = bisect.bisect_right(right, T) - 1
                lo, hi = lo + k * (first + 1), hi + k * (last + 1)
            return lo <= cm.B <= hi

        values = sorted({x for _, f in tables for x in f if x < math.inf})
        i = bisect.bisect_left(values, True, key=feasible)  # the least feasible value (feasibility grows with T)
        if i == len(values):
            return None
        return max(values[i], self.throughput(cfg) or 0.0)

    def memory(self, cfg: BoundConfig, m: int, slots: list[Slot]) -> float:
        """The memory bound of a config whose replicas are alike (the caller checks: one device type and
        host budget per position, B divisible by D, a uniform chain); `slots`: one replica's stage
        positions with m micro-batches of the (equal) share."""
        cm, p, v = self.cm, len(slots) // cfg.chunks, cfg.chunks
        n = max(1, cm.B // len(cfg.pipelines) // m)
        k = -(-cm.num_blocks // p)
        g = -(-k // v)
        # a position with fewer micro-batches in flight and no less memory cannot have a higher bound: per
        # kind of position, only the one with the fewest in flight is evaluated
        fewest: dict[tuple, Slot] = {}
        for slot in slots[:p]:
            kind = (slot.dtype, slot.sigs, slot.layerwise, slot.mixed_tp, slot.budget)
            if kind not in fewest or slot.inflight < fewest[kind].inflight:
                fewest[kind] = slot
        return min(self._device_bound(slot, k, g, m, n, v == 1) for slot in fewest.values())

    def _device_bound(self, slot: Slot, k: int, g: int, m: int, n: int, with_sync: bool) -> float:
        key = (slot.dtype, slot.sigs, slot.layerwise, slot.inflight, slot.budget, k, g, m, n, with_sync)
        hit = self._device.get(key)
        if hit is not None:
            return hit
        sp, a = self.splitter, self.cm.first_block
        per_block = self._per_block(sp.ranked(slot, a, a + 1, m, n), sp.ranked(slot, a, a + k, m, n), m, k)
        best = math.inf
        for _, _, tm, mem in sp.ranked(slot, a, a + g, m, n):
            need = _chunk_need(mem, slot.inflight, slot.microbatches)
            if need > slot.budget:
                continue
            own = m * (tm.fwd + tm.bwd) + (tm.sync if with_sync else 0.0)
            best = min(best, own + _lp(per_block, k - g, slot.budget - need))
        self._device[key] = best
        return best

    @staticmethod
    def _per_block(one: Ranked, many: Ranked, m: int, k: int) -> list[tuple[float, float]]:
        """Per option, (static bytes, m (fwd + bwd) seconds) per block that no range of 1..k blocks beats on
        average, dominated options dropped (sorted by bytes, seconds strictly decreasing)."""
        of_k = {opt: (tm, mem) for _, opt, tm, mem in many}
        points = []
        for _, opt, tm, mem in one:
            tk, mk = of_k[opt]
            points.append((min(mem.static, mk.static / k), min(m * (tm.fwd + tm.bwd), m * (tk.fwd + tk.bwd) / k)))
        points.sort()
        kept: list[tuple[float, float]] = []
        for s, t in points:
            if not kept or t < kept[-1][1]:
                kept.append((s, t))
        return kept


__all__ = ["BoundConfig", "ConfigBounds"]
