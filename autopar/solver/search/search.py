"""The planner's search: best-first branch and bound over device groupings, exact pricing at the leaves.

Formulation
-----------
Given the coarse layer chain 0..L-1 (prologue, blocks, epilogue), a cluster of devices and the global
batch B, choose

    t                tensor-parallel degree (divides every node's device count: tp stays inside a node), one
                     for the plan or, on several device types, one per type (`configs.mixed_tp_layouts`)
    pipelines        a partition of the tp groups into D pipelines of p ranks each
    sigma, v         schedule (gpipe, 1f1b, interleaved_1f1b with v chunks per rank) and chunks
    b                micro-batch size (pipeline d runs m_d = ceil(s_d / min(b, s_d)) micro-batches)
    [a_j, e_j)       per pipeline, the layer range of each of its p*v stages
    o_j              per stage, ZeRO level 0-3, recompute (none, all, or the first k blocks), CPU offload of
                     optimizer/activations/params
    c_j              per stage boundary, the dtype its sends travel in (compressed or not)
    s_d              per pipeline, its integer batch share

to minimise the simulated step time  max_d simulate(schedule(sigma, p, m_d, v), stage times)  subject to

    (C1) every pipeline's stages tile [0, L), one layer at least each     `Splitter.split`, `check_plan`
    (C2) every device's peak memory (static state of all its stages, i.e. interleaved chunks together,
         + peak in-flight micro-batches x activations + recompute workspace, with the gradient
         accumulation's transient where a backward meets a `.grad`, by m_d: `pricing.rank_peak`)
         <= (1 - reserve) x capacity              `Splitter.stage` with `split.RankState`, `_fits`, `price`
         ZeRO-2/3 only where every replica gets the same split and micro-batch count at t = 1, so the
         runtime runs them per layer (`Slot.layerwise`, `plan.layerwise_stages`)
    (C2') every node's host memory: what its devices offload (`pricing.rank_host`) <= (1 - reserve) x the
         node's host memory; the search holds each device to an even share of it      `Slot.host_budget`
    (C3) sum_d s_d = B, 1 <= m_d <= s_d, m_d % p == 0 for interleaved            `_batch_split`, `_solve`
    (C4) every device in exactly one tp group of one pipeline rank              `groupings`
    (C5) c_j compressed only where `CostModel.compress_choice` allows it (fp32/tf32 plan, link <= 10 Gb/s,
         faster send) and only if it shortens the step             `CostModel.boundary_send`, `run`

Decomposition
-------------
Outer (`_configs`): enumerate (t, grouping, sigma, v, b). Micro-batch sizes (`config_microbatch_sizes`):
with replicas of one kind, every size giving a distinct micro-batch count up to the even share when it
is at most MICROBATCH_ENUMERATION samples, else powers of two and the share; with replicas that differ
(uneven shares) and a largest possible share of at most MICROBATCH_ENUMERATION, every size up to it, so
a replica with a small share runs it as one micro-batch while another splits its larger one. Groupings
on one device type: Megatron's stage-major order (stage s of replica d = tp group s*D + d) and
replica-major order (a replica on consecutive groups). On several types: "mixed" pipelines (each holds
an equal slice of every type, its stages in cluster order, or with the types in reverse order for
"mixed-reversed", so one pipeline spans device types and the split gives the faster ones more layers)
and "by-type" pipelines (each on one device type; the batch split gives faster replicas more samples).
A tp per device type (`configs.mixed_tp_layouts`): every assignment of degrees to the types, within a
factor 2 of each other, not all equal, on by-type pipelines (a tp per pipeline class) and, on two types,
also on mixed ones (stages of one pipeline at different degrees; the runtime sends between them as
runtime/program.py `_peers` says and `CostModel.stage_send` prices).
Every config gets a valid lower bound on its step time, the larger of bounds.py's two (its docstring):
the work bound (per-sample work at the cheapest option, with the pipeline bubble; pipelines of different
speeds: the min over integer batch splits of the slowest pipeline's bound at its share) when the config is
built, and the memory bound (the device holding the most blocks must fit them: the cheapest options that
do, relaxed to an LP over per-block costs) when it first comes up, the config going back into the queue
if that raises its bound. Configs are visited in increasing bound order and the search stops when the
bound reaches the best simulated step (branch and bound): the plan returned is optimal over the configs
under their inner solves (the gap to every unsolved config's bound is >= 0).

Inner, per config and pipeline class:
  * stage options (`split.Splitter.stage`): for a layer range, the option o_j minimising m c_j + sync_j
    (c_j = fwd_j + bwd_j per micro-batch) among those whose memory fits (C2); offload and ZeRO only add
    time, so they enter only when memory requires them. On a uniform chain a range is costed by its
    block count, so a 96-block model costs as few ranges as a 2-block one.
  * layer split (`split.Splitter.split`): with at most 64 possible splits, every split is scored by its
    lower bound and simulated in bound order (exact under the simulator, given the options). Otherwise
    it minimises the surrogate (`split.surrogate`, `pricing.lower_bound` with full micro-batches)
        E = max over stages j on rank r of  F_r + max(W_r, v m c_j) + max(Q_r + sync_0, send + sync_j)
    (F_r, Q_r: forward/backward prefix of the stages before rank r's first one, sends included; W_r: the
    rank's work): exactly by dynamic programming over (stage, first free layer) with Pareto fronts of
    the prefix sums on non-interleaved chains of moderate size, else by bisection on E between the
    config's bound and the memory-only split with a greedy test (each stage takes the most layers that
    keep its term under the threshold and its memory under budget; costs grow with the range, so each
    stage is a binary search). An interleaved device's chunks are checked together: each chunk's option
    must fit with the chunks placed before it on the device, counting the chunks still to come at its
    own static size (`split.RankState`, exact for the last chunk).
  * batch split (`_batch_split`, CP-SAT) when replicas differ (by-type groupings): integer s_c
    (per-replica share of class c with k_c replicas), r_c replicas taking one more sample,
        min Z  s.t.  sum_c k_c s_c + r_c = B,   Z >= E_c(s_c + [r_c > 0])
    with AddElement on a table of the surrogate E_c per share (`_share_table`; shares that do not fit
    in memory, that lose to a greedy split's value, or whose work bound at that share (bounds.py,
    `ConfigBounds.shares`) reaches the incumbent, are left out of the domains, the last unsolved). Splits
    are then re-solved at the chosen shares, class by class, stopping at the first whose lower bound
    reaches the incumbent (the config could not win).
Leaves: a config's candidate is simulated (each distinct replica once) only when its lower bound
beats the incumbent (inside `Splitter.split` too: `cutoff`); the incumbents are priced in full by
`pricing.price` (memory per device) once the search ends, fastest first, the first that fits returned
(`_best_priced`).

Refinement (`_refine`): the configs simulating within REFINE_WINDOW of the best (at most REFINE) are
solved again with the layer split and the per-stage options decided together instead of the option
ladder's fastest-fitting choice per range: with at most 64 splits, every split with every combination of
each stage's non-dominated options (`Splitter.pareto`), simulated in bound order; otherwise, on every
chain length and schedule, the CP-SAT stage model (stage_model.py, its formulation in its docstring),
whose incumbent is the best split the dynamic program, the bisection or Megatron's even split finds and
caps E: it proves the surrogate's optimum within its GAP = 1% (`Split.gap`; GPT-3 175B on 1024 A100:
every finalist's known split proven within 1% in 2-20 ms). Configs with several pipeline classes
(by-type groupings) are then solved once more at the batch shares of the joint model
(stage_model_shares.py: every class's split and options and the integer shares in one CP-SAT model,
`_batch_split`'s shares its incumbent, proven within GAP too) where those differ from `_batch_split`'s.
Then each stage recomputing all its blocks tries recomputing only its first k (selective.py: per ZeRO
level and offload set, the fewest that fit, by bisection). The simulator judges: a refined plan replaces
the incumbent only if it simulates faster.

Context parallelism (cp, solver/pricing/context.py): one search per degree. The search above runs at cp = 1; where
cp can pay (search/context.py: nothing fits, or a long sequence whose plan runs one-sample micro-batches and still
splits a sample), `search` runs it again on the cost model at each candidate cp > 1, with the best step so far as
its cutoff. There a unit is cp tensor-parallel groups of t consecutive devices (`configs.cp_units`, inside a node or
spanning whole nodes), priced as one stage position (the cost model reads it as cp groups), a stage's data-parallel
group is the first device of every tensor-parallel group of its replicas (dp x cp holders), ZeRO-2/3 run per
layer where t = 1, and the plan's stages carry cp and the attention mode.

Determinism: the enumeration order, bisection and tie-breaking (first in canonical order wins) are
fixed, and every budget that can end a part of the search is counted work (solver/budget.py): the configurations
solved (`work_limit`) and CP-SAT's deterministic time (the batch split's, the stage models' and the intra-op
ILP's, single-threaded with a fixed seed), so equal inputs give equal plans on any machine. The wall clock
(`time_limit_s`) is one outer guard, `budget.WallGuard`: the search loop, `_refine` and every CP-SAT solve
(its wall limit is the guard's time left) stop at it, and each warns when it does (the plan then depends on the
machine's speed and load); tests/test_plan_budget.py plans under a frozen and a racing clock. Large searches
solve configurations ahead on forked workers (speculative.py): `run` takes each result in its own order and only
when it was solved with the cutoff it would have given it, so every step, and the plan, are the one-process run's;
while the configurations' bounds are built, before those workers fork, a helper shares the intra-op ILPs
the bounds ask for (ilp_ahead.py: only ILP answers cross over, into the cache keyed by all they depend on).
"""

from __future__ import annotations

import heapq
import inspect
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import NamedTuple

from ...collector import collector_paused
from ...errors import InfeasibleError
from ...ir.plan import Pipeline, Plan, Stage, even_split, simulated_step_time
from ...ir.schedule import SPLIT_SCHEDULES
from ...lowering import communicator_counts
from ...report import fmt_time
from .. import budget
from ..budget import WallGuard
from ..pricing import context, experts
from ..pricing.pricing import CostModel, StageMemory, inflight_closed_form, lower_bound, model_summary, price
from ..split.selective import selective
from ..split.split import STAGE_MODEL_TIME_S, Slot, Split, Splitter, Unit, priced_surrogate, rank_fits
from ..split.surrogate import position_microbatches
from .bounds import ConfigBounds
from .configs import (
    config_microbatch_sizes,
    divisors,
    groupings,
    layouts,
    microbatch_count,
    microbatch_sizes,
    schedules,
    tp_units,
)
from .context import choose as choose_context
from .ilp_ahead import IlpAhead, bound_items
from .speculative import Speculative, workers_for

Progress = Callable[..., None]  # (done, total, best step or None[, least lower bound left or None])
SHARE_TABLE_EXACT = 64  # batch shares up to which the batch split's table solves a split per share
# configs whose splits and options are re-solved exactly (`_refine`): those simulating within REFINE_WINDOW of
# the best, at most REFINE of them, fastest first
REFINE = 8
REFINE_WINDOW = 0.05
# the search's work budget: configurations solved before it returns the best so far (deterministic, whatever the
# machine's load); the wall-clock limit is only a guard that warns
WORK_LIMIT = 2000
SHARES_DETERMINISTIC_S = 1.0  # CP-SAT deterministic seconds of the batch split's integer shares
SEARCH, REFINE_SPLITS, REFINE_MODEL = 0, 1, 2  # how a config is solved: the search loop's, `_refine`'s two passes


def config_communicators(pipelines: tuple[tuple[Unit, ...], ...], dp: list[Unit], chunks: int, world: int,
                         cp: int = 1) -> dict[int, int]:
    """Device -> NCCL communicators its process creates under a config (`lowering.communicator_sets` on the
    config's tensor-parallel groups, data-parallel groups and pipeline neighbours), as `price` counts them
    for the plan (which also counts a tied weight's replica group across stages). At cp > 1 (units of cp
    tensor-parallel groups) each cp rank is a pipeline of its own, and every cp ring is a group too."""
    stages = [[tuple(pl[s % len(pl)][c * (len(pl[s % len(pl)]) // cp):(c + 1) * (len(pl[s % len(pl)]) // cp)])
               for s in range(len(pl) * chunks)] for pl in pipelines for c in range(cp)]
    groups = {tuple(u[c * (len(u) // cp):(c + 1) * (len(u) // cp)]) for pl in pipelines for u in pl for c in range(cp)}
    if cp > 1:
        groups |= {tuple(u[k::len(u) // cp]) for pl in pipelines for u in pl for k in range(len(u) // cp)}
    groups = sorted(groups | {tuple(sorted(g)) for g in dp})
    counts = communicator_counts(stages, groups, world)
    return {d: counts[d] for pl in pipelines for u in pl for d in u}


class Config(NamedTuple):
    """One outer choice; configs sort by their lower bound (then enumeration order)."""

    bound: float
    index: int
    tp: int
    grouping: str
    pipelines: tuple[tuple[Unit, ...], ...]
    schedule: str
    chunks: int
    b: int


class Solved(NamedTuple):
    build: Callable[[], Plan]  # the plan without predictions (built only for a new incumbent)
    bound: float  # no simulated step of this plan is shorter
    pipelines: list[tuple[int, int, list[tuple]]]  # (share, micro-batches, stage times) of distinct replicas


def _pipeline_classes(types: list[tuple]) -> dict[tuple, list[int]]:
    """The pipelines of a config by class (`Search._replica_types`: replicas alike share a split): per kind,
    its pipeline indices in order."""
    classes: dict[tuple, list[int]] = {}
    for d, key in enumerate(types):
        classes.setdefault(key, []).append(d)
    return classes


def _greedy_split_value(tables: list[list[int | None]], counts: list[int], total: int) -> int | None:
    """Max table value of the batch split that hands samples one at a time to the replica whose next
    sample costs least (optimal when tables grow with the share); None if it gets stuck."""
    heap, value, given = [], 0, 0
    for c, (table, k) in enumerate(zip(tables, counts, strict=True)):
        if len(table) < 2 or table[1] is None:
            return None
        for _ in range(k):
            heap.append((table[2] if len(table) > 2 and table[2] is not None else math.inf, c, 1))
            value, given = max(value, table[1]), given + 1
    heapq.heapify(heap)
    while given < total:
        nxt, c, share = heapq.heappop(heap)
        if nxt == math.inf:
            return None
        value, given = max(value, int(nxt)), given + 1
        after = tables[c][share + 2] if share + 2 < len(tables[c]) else None
        heapq.heappush(heap, (math.inf if after is None else after, c, share + 1))
    return value


def _takes_four(fn: Callable[..., object]) -> bool:
    """Whether a progress callback takes a fourth positional argument (the least lower bound left), so that
    callbacks written for `progress(done, total, best)` keep working."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 4 or any(p.kind == p.VAR_POSITIONAL for p in params)


# ---- the search -----------------------------------------------------------------------------------


class Search:
    """One planning run on a cost model (see the module docstring); `run()` returns the best Plan."""

    def __init__(self, cm: CostModel, time_limit_s: float = 60.0, progress: Progress | None = None,
                 work_limit: int | None = WORK_LIMIT, cutoff: float = math.inf, workers: int | None = None) -> None:
        self.cm = cm
        # processes solving configurations ahead (speculative.py; the same plan): None decides by the search's size
        self.workers = workers
        self._by_index: dict[int, Config] = {}
        self._memory_bounds: dict[int, float] = {}  # config index -> `_memory_bound`
        # a step time another search already reached (subsets.py): only faster plans count, and the search
        # ends, as with an incumbent, when the bounds reach it (InfeasibleError when nothing beats it)
        self.cutoff = cutoff
        self.guard = WallGuard(time_limit_s)  # the wall clock only guards (budget.py); it warns where it cuts
        self.time_limit_s = time_limit_s
        self.work_limit = work_limit  # configurations solved at most (None: no limit)
        self.progress = progress
        self._progress_bound = progress is not None and _takes_four(progress)
        self.splitter = Splitter(cm, self.guard)
        self.bounds = ConfigBounds(cm, self.splitter)
        self._types: dict[int, tuple[tuple, list[tuple]]] = {}
        self._link_sigs: dict[tuple, tuple[tuple, list[tuple[int, ...]]]] = {}
        self._positions: dict[tuple, tuple[tuple, list[tuple]]] = {}  # `_slots`' per-position entries
        self._anchors: dict[tuple, tuple[tuple, tuple]] = {}  # `_share_table`'s solved shares and their entries
        # per grouping (its pipelines tuple, kept so its id stays its own): its data-parallel groups and whether
        # each mixes tensor-parallel degrees; per grouping and chunks, the communicator counts
        self._dp_cache: dict[int, tuple[object, list[Unit], list[bool]]] = {}
        self._comm_cache: dict[tuple[int, int], tuple[object, dict[int, int]]] = {}
        self.best_step = cutoff  # the incumbent's simulated step
        self._incumbents: list[tuple[float, int, Callable[[], Plan]]] = []  # (step, order, build), each faster
        self.stopped_by_wall = False  # the search loop stopped at the wall-clock guard (`run` warns)
        self.refining = False  # in `_refine`: selective recompute (selective.py) on the splits
        self.model_splits = False  # in `_refine`: splits by the CP-SAT stage model too
        # best step / least lower bound of the configurations left unsolved, - 1: 0 when the search completes
        self.gap = 0.0

    # -- configs --
    def _configs(self) -> list[Config]:
        cm = self.cm
        out: list[Config] = []
        groupings = [(t, name, pipes, config_microbatch_sizes(cm, pipes)) for t, name, pipes in layouts(cm)]
        self.bounds.ahead = self._ilp_ahead(groupings)
        try:
            for t, name, pipes, sizes in groupings:
                p = len(pipes[0])
                for schedule, v in schedules(p, cm.L):
                    for b in sizes:
                        cfg = Config(0.0, len(out), t, name, pipes, schedule, v, b)
                        bound = self.bounds.work(cfg)  # None where the config cannot run
                        if bound is not None:
                            out.append(cfg._replace(bound=bound))
        finally:
            if self.bounds.ahead is not None:
                self.bounds.ahead.close()
                self.bounds.ahead = None
        return sorted(out)

    def _ilp_ahead(self, groupings: list[tuple[int, str, tuple[tuple[Unit, ...], ...], list[int]]]
                   ) -> IlpAhead | None:
        """A helper sharing the bounds' intra-op ILPs from the last (ilp_ahead.py), where the search will
        have workers (`workers_for`, on the configurations before their bounds) and there are ILPs to share."""
        configs = sum(len(schedules(len(pipes[0]), self.cm.L)) * len(sizes) for _, _, pipes, sizes in groupings)
        if not workers_for(configs, self.workers):
            return None
        items = bound_items(self.cm, [(pipes, sizes) for _, _, pipes, sizes in groupings])
        return IlpAhead(self.cm, items, self.bounds.unit_costs) if len(items) > 1 else None

    def _memory_bound(self, cfg: Config) -> float:
        """bounds.py's memory bound where it applies (replicas alike on a uniform chain), else 0 (memoised per
        config: the search's queue and the order its workers solve ahead in both ask, speculative.py)."""
        hit = self._memory_bounds.get(cfg.index)
        if hit is None:
            hit = self._memory_bounds[cfg.index] = self._memory_bound_of(cfg)
        return hit

    def _memory_bound_of(self, cfg: Config) -> float:
        cm, pipes = self.cm, cfg.pipelines
        if not cm.uniform or cm.B % len(pipes) or len(set(self._replica_types(cfg))) > 1:
            return 0.0
        share = cm.B // len(pipes)
        m = microbatch_count(share, min(cfg.b, share), len(pipes[0]), cfg.schedule)
        return 0.0 if m is None else self.bounds.memory(cfg, m, self._slots(cfg, pipes[0], m, True))

    def _links(self, cfg: Config, d: int) -> tuple[int, ...]:
        """The link signatures between consecutive stages of pipeline d (memoised per grouping and chunks)."""
        key = (id(cfg.pipelines), cfg.chunks)
        hit = self._link_sigs.get(key)
        if hit is None or hit[0] is not cfg.pipelines:
            cm, p = self.cm, len(cfg.pipelines[0])
            hit = (cfg.pipelines, [tuple(cm.group_sig((pipe[j % p][0], pipe[(j + 1) % p][0]))
                                         for j in range(p * cfg.chunks - 1)) for pipe in cfg.pipelines])
            self._link_sigs[key] = hit
        return hit[1][d]

    def _replica_types(self, cfg: Config) -> list[tuple]:
        """Per pipeline, its positions' device types and host budgets: replicas alike in these share a split
        (memoised per grouping: configs of one grouping share its pipelines tuple)."""
        hit = self._types.get(id(cfg.pipelines))
        if hit is None or hit[0] is not cfg.pipelines:
            cm = self.cm
            hit = (cfg.pipelines, [tuple((cm.cluster.devices[u[0]].spec.name, min(cm.host_budget(d) for d in u))
                                         for u in pipe) for pipe in cfg.pipelines])
            self._types[id(cfg.pipelines)] = hit
        return hit[1]

    def _split(self, cfg: Config, slots: list[Slot], share: int, m: int) -> Split | None:
        lo = self.bounds.throughput(cfg)  # where pipelines differ: a light one may split below the config's bound
        # refining, selective recompute reworks the split returned: the inner solve must not drop any
        return self.splitter.split(slots, share, m, cfg.schedule, cfg.chunks, lo=cfg.bound if lo is None else lo,
                                   cutoff=self.best_step, model=self.model_splits, prune=not self.refining)

    def _slots(self, cfg: Config, pipe: tuple[Unit, ...], m: int, alike: bool = True) -> list[Slot]:
        """The stage positions of one pipeline; `alike`: every replica of the config gets the same split and
        micro-batch count, so its ZeRO-2/3 can run per layer (`Slot.layerwise`)."""
        cm, p, v = self.cm, len(pipe), cfg.chunks
        inflight = inflight_closed_form(cfg.schedule, p, m, v)
        dp, mixed, comms = self._groups_of(cfg)
        # what a position is apart from the schedule: per grouping, chunks (the communicator counts) and pipeline
        key = (id(cfg.pipelines), v, pipe)
        hit = self._positions.get(key)
        if hit is None or hit[0] is not cfg.pipelines:
            hit = self._positions[key] = (cfg.pipelines, [
                (cm.cluster.devices[u[0]].spec.name, min(cm.usable(d, comms.get(d)) for d in u),
                 (cm.group_sig(u), cm.group_sig(dp[r])), min(cm.host_budget(d) for d in u),
                 any(cm.unified(d) for d in u), len(u) == context.degree(cm))
                for r, u in enumerate(pipe)])
        count = position_microbatches(m, v)
        out = []
        for j in range(p * v):
            r = j % p
            dtype, budget, sigs, host, unified, one_group = hit[1][r]
            out.append(Slot(dtype, pipe[r], dp[r], inflight[r], budget, sigs, host, unified, alike and one_group,
                            mixed[r], count))
        return out

    def _groups_of(self, cfg: Config) -> tuple[list[Unit], list[bool], dict[int, int]]:
        """A config's data-parallel groups per stage position, whether each mixes tensor-parallel degrees, and its
        devices' NCCL communicator counts (memoised per grouping, and per grouping and chunks)."""
        cm, p, v = self.cm, len(cfg.pipelines[0]), cfg.chunks
        cp = context.degree(cm)  # cp > 1: a unit is cp tensor-parallel groups (pricing/context.py)
        hit = self._dp_cache.get(id(cfg.pipelines))
        if hit is None or hit[0] is not cfg.pipelines:
            # a stage's replicas: the first device of every tensor-parallel group holding it (dp x cp of them)
            groups = [tuple(other[r][c * (len(other[r]) // cp)] for other in cfg.pipelines for c in range(cp))
                      for r in range(p)]
            mixed = [len({len(other[r]) for other in cfg.pipelines}) > 1 for r in range(p)]
            hit = self._dp_cache[id(cfg.pipelines)] = (cfg.pipelines, groups, mixed)
        dp, mixed = hit[1], hit[2]
        # configs come in bound order, so groupings alternate: counted once per grouping and chunks
        comm_hit = self._comm_cache.get((id(cfg.pipelines), v))
        if comm_hit is None or comm_hit[0] is not cfg.pipelines:
            comm_hit = self._comm_cache[(id(cfg.pipelines), v)] = (
                cfg.pipelines, config_communicators(cfg.pipelines, dp, v, cm.world_size, cp))
        return dp, mixed, comm_hit[1]

    # -- batch split --
    def _batch_split(self, cfg: Config, classes: dict[tuple, list[int]]) -> list[int] | None:
        from ortools.sat.python import cp_model

        cm = self.cm
        n_pipes = len(cfg.pipelines)
        top = cm.B - (n_pipes - 1)
        tables = [self._share_table(cfg, cfg.pipelines[ix[0]], top) for ix in classes.values()]
        big = 1 + max((x for t in tables for x in t if x is not None), default=0)
        # shares slower than a known split cannot be in an optimal one: prune them from the domains
        cap = _greedy_split_value(tables, [len(ix) for ix in classes.values()], cm.B) or big
        model = cp_model.CpModel()
        Z = model.NewIntVar(0, big, "Z")
        count = []
        for c, (ix, table) in enumerate(zip(classes.values(), tables, strict=True)):
            k = len(ix)
            ok = [s for s in range(1, top + 1) if table[s] is not None and table[s] <= cap]  # type: ignore[operator]
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
        # one worker with a fixed seed is deterministic (and on these small models fastest)
        solver = budget.cpsat(SHARES_DETERMINISTIC_S, self.guard)
        if budget.solve(solver, model, "the batch split's integer shares") not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        shares: list[int] = [0] * n_pipes
        for (_, s, r), ix in zip(count, classes.values(), strict=True):
            sv, rv = solver.Value(s), solver.Value(r)
            for pos, d in enumerate(ix):
                shares[d] = sv + (1 if pos < rv else 0)
        return shares

    def _share_table(self, cfg: Config, pipe: tuple[Unit, ...], top: int) -> list[int | None]:
        """Surrogate step time (ns) of one replica on `pipe` for every batch share 1..top; None where it
        does not fit, or where the share's work bound (`ConfigBounds.shares`) reaches the incumbent. The split
        is solved at every share when there are few, else at powers of two, and a share between them reuses
        the split of the next solved share up (memory re-checked)."""
        cm, p = self.cm, len(pipe)
        anchors = list(range(1, top + 1)) if top <= SHARE_TABLE_EXACT else \
            sorted({1 << k for k in range(top.bit_length()) if 1 << k < top} | {top})
        solved: dict[int, tuple[list[Slot], Split | None, int, dict, dict]] = {}
        table: list[int | None] = [None]
        exact = top <= SHARE_TABLE_EXACT
        count = lambda s: microbatch_count(s, min(cfg.b, s), p, cfg.schedule)  # noqa: E731
        # a share whose work bound (bounds.py) reaches the incumbent cannot be in a split that beats it
        lows = self.bounds.shares(cfg, self.bounds.per_sample(pipe, cfg.b), top)
        for s in range(1, top + 1):
            m = count(s)
            if m is None or lows[s] >= self.best_step:
                table.append(None)
                continue
            a = next(x for x in anchors if x >= s)
            if a not in solved:
                ma = count(a) or m
                # (with a split per share, a == s and ma == m: an entry depends on the share and its micro-batch
                # count, not on the micro-batch size that gave them, so configs of one grouping and schedule share it)
                anchor = (id(cfg.pipelines), pipe, cfg.schedule, cfg.chunks, a, ma)
                hit_a = self._anchors.get(anchor)
                if hit_a is None or hit_a[0] is not cfg.pipelines:
                    slots = self._slots(cfg, pipe, ma, False)  # several replica classes: never alike
                    # many shares: the table only guides CP-SAT, so the cheap bisection split does (from 0, not
                    # the config's bound, so configs of one grouping and schedule share it)
                    split = self.splitter.split(slots, a, ma, cfg.schedule, cfg.chunks, 0.0, fast=not exact)
                    hit_a = self._anchors[anchor] = (cfg.pipelines, (slots, split, -(-a // ma), {}, {}))
                solved[a] = hit_a[1]
            slots, split, n_a, fitting, values = solved[a]
            # what an anchor's split gives share s at m micro-batches (of n samples: whether it fits) is the same for
            # every config sharing the anchor
            if (s, m) not in values:
                value = None
                if split is not None:
                    n = -(-s // m)
                    if a != s and (m, n) not in fitting:
                        fitting[(m, n)] = self._fits(cfg, slots, split, m, n)
                    if a == s or fitting[(m, n)]:
                        value = round(priced_surrogate(cm, slots, split.stages, cfg.chunks, s / n_a) * 1e9)
                values[(s, m)] = value
            table.append(values[(s, m)])
        return table

    def _fits(self, cfg: Config, slots: list[Slot], split: Split, m: int, n: int) -> bool:
        """Whether `split`'s stages and options fit with m micro-batches of n samples."""
        cm, p = self.cm, len(slots) // cfg.chunks
        inflight = inflight_closed_form(cfg.schedule, p, m, cfg.chunks)
        mems: list[list[StageMemory]] = [[] for _ in range(p)]
        for j, (a, e, c) in enumerate(split.stages):
            slot = slots[j]
            base = cm.base(a, e, slot.dtype, n, slot.tp_group)
            mems[j % p].append(cm.stage_memory(base, c.option, len(slot.tp_group), len(slot.dp_group),
                                               slot.layerwise))
        count = position_microbatches(m, cfg.chunks)
        return all(rank_fits(mems[r], inflight[r], slots[r], count) for r in range(p))

    # -- one config --
    def _solve(self, cfg: Config, shares: list[int] | None = None) -> Solved | None:
        """The config's candidate: its batch shares (`shares`, else even or `_batch_split`'s), each distinct
        replica split; None where nothing fits or its bound cannot beat the incumbent."""
        cm, pipes = self.cm, cfg.pipelines
        p = len(pipes[0])
        types = self._replica_types(cfg)  # replicas share a split only where these are alike
        classes = _pipeline_classes(types)
        if shares is None:
            shares = even_split(cm.B, len(pipes)) if len(classes) == 1 else self._batch_split(cfg, classes)
        if shares is None or min(shares) < 1:
            return None
        splits: dict[tuple, tuple[list[Slot], Split]] = {}
        distinct: dict[tuple, tuple[int, int, list[tuple]]] = {}
        keys = []
        counts = [microbatch_count(share, min(cfg.b, share), p, cfg.schedule) for share in shares]
        alike = len({(types[d], shares[d], counts[d]) for d in range(len(pipes))}) == 1
        bound = 0.0
        for d, pipe in enumerate(pipes):
            share, m = shares[d], counts[d]
            if m is None:
                return None
            key = (types[d], share, m)
            if key not in splits:
                slots = self._slots(cfg, pipe, m, alike)
                split = self._split(cfg, slots, share, m)
                if split is None:
                    return None
                if self.refining:  # k of a stage's blocks recomputed where all were (selective.py)
                    split = selective(self.splitter, slots, split, m, -(-share // m), cfg.chunks)
                splits[key] = (slots, split)
            keys.append(key)
            # replicas whose stages talk over equivalent links behave the same: simulate one of each
            links = self._links(cfg, d)
            if key + (links,) not in distinct:
                slots, split = splits[key]
                small = share // m if share % m else 0
                zb = -(-share // m) if cfg.schedule in SPLIT_SCHEDULES else 0
                vals = self.splitter.values(slots, split, small, pipe, zb)
                distinct[key + (links,)] = (share, m, vals)
                bound = max(bound, lower_bound(vals, even_split(share, m), p, cfg.schedule in SPLIT_SCHEDULES))
                if bound >= self.best_step:
                    return None  # `_consider` would drop it: the replicas left need not be split

        cp, attention = context.degree(cm), context.mode(cm)

        def build() -> Plan:
            out = []
            for pipe, key in zip(pipes, keys, strict=True):
                _, share, m = key
                last = len(splits[key][1].stages) - 1
                stages = [Stage([a, e], list(pipe[j % p]), c.option.zero, c.option.recompute,
                                list(c.option.offload), None if j == last else
                                cm.compress_choice(c.out_bytes, pipe[j % p][0], pipe[(j + 1) % p][0]),
                                cp=cp, cp_attention=attention)
                          for j, (a, e, c) in enumerate(splits[key][1].stages)]
                out.append(Pipeline(share, -(-share // m), m, stages))
            return Plan(cm.B, cm.precision, cm.optimizer, cfg.schedule, cfg.chunks, cm.cluster.to_dict(),
                        model_summary(cm.graph), out, {}, cm.reserve)

        return Solved(build, bound, list(distinct.values()))

    # -- driver --
    def _evaluate(self, cfg: Config, shares: list[int] | None = None) -> tuple[float, Solved] | None:
        """Solve one config (at `shares`, where given): its simulated step and solution, or None (no candidate,
        or none that can beat the incumbent)."""
        solved = self._solve(cfg, shares)
        if solved is None or solved.bound >= self.best_step:
            return None
        return max(simulated_step_time(cfg.schedule, cfg.chunks, share, m, vals)
                   for share, m, vals in solved.pipelines), solved

    def _consider(self, cfg: Config, shares: list[int] | None = None) -> float | None:
        """`_evaluate`'s step; a faster one becomes the incumbent, priced in full only when the search ends
        (`_best_priced`)."""
        got = self._evaluate(cfg, shares)
        if got is None:
            return None
        self._accept(got[0], got[1].build)
        return got[0]

    def _accept(self, step: float, build: Callable[[], Plan]) -> None:
        if step < self.best_step:
            self.best_step = step
            self._incumbents.append((step, len(self._incumbents), build))

    def _solve_ahead(self, key: tuple[int, int], bound: float, cutoff: float) -> tuple[float | None, Plan | None]:
        """What a worker (speculative.py) computes: config `key[0]` at `bound` solved with `cutoff` as the
        incumbent's step, as the search loop (`key[1]` SEARCH) or one of `_refine`'s passes (REFINE_SPLITS,
        REFINE_MODEL) solves it: its step and, where it beats the cutoff, its plan."""
        index, mode = key
        self.best_step = cutoff
        was = self.refining, self.model_splits  # (here, where a worker hands a solve back, `_refine` may be on)
        self.refining, self.model_splits = mode != SEARCH, mode == REFINE_MODEL
        try:
            got = self._evaluate(self._by_index[index]._replace(bound=bound))
        finally:
            self.refining, self.model_splits = was
        if got is None:
            return None, None
        return got[0], (got[1].build() if got[0] < cutoff else None)

    def _take(self, spec: Speculative, cfg: Config, mode: int = 0) -> float | None:
        """`_consider` (as the search loop or one of `_refine`'s passes runs it: `mode`) on a result solved ahead
        with this incumbent's step (speculative.py)."""
        step, plan = spec.result((cfg.index, mode), cfg.bound, self.best_step)
        if step is not None and plan is not None:
            self._accept(step, lambda: plan)
        return step

    def _visits(self, heap: list[tuple[Config, bool]]) -> Iterator[tuple[tuple[int, int], float]]:
        """The configs `run` solves, in its order, with the bounds it solves them at (its queue's rule, on
        `heap`, a copy): what workers solve ahead. The order does not depend on the solves, only where it
        stops."""
        while heap:
            cfg, tight = heapq.heappop(heap)
            if not tight:
                bound = max(cfg.bound, self._memory_bound(cfg))
                if bound > cfg.bound:
                    heapq.heappush(heap, (cfg._replace(bound=bound), True))
                    continue
            yield (cfg.index, SEARCH), cfg.bound

    def _best_priced(self) -> Plan | None:
        """The fastest incumbent priced in full (`pricing.price`: memory per device). The search's per-stage
        memory checks are sufficient for the per-device ones; should they ever disagree, the candidate is
        dropped (and said), never returned, and the next fastest is priced."""
        for _, _, build in sorted(self._incumbents, key=lambda x: x[:2]):
            priced = price(self.cm, build())
            if priced.fits:
                return priced.plan
            warnings.warn(f"autopar planner: a candidate its memory checks admitted does not fit "
                          f"when priced in full ({priced.problems[0]}); skipped. Please report this.", stacklevel=4)
        return None

    def _refine(self, finalists: list[tuple[float, int, Config]], spec: Speculative | None = None) -> None:
        """Re-solve the fastest configs (REFINE, REFINE_WINDOW): first their inner-loop splits with selective
        recompute, then with splits and options decided together (`split.Splitter.split(model=True)`: every
        split with every non-dominated option combination where few, else the CP-SAT stage model, proven within
        its GAP), selective recompute after that too; configs with several pipeline classes then once more at
        the batch shares of the joint model (stage_model_shares.py) where they differ from `_batch_split`'s. A
        plan replaces the incumbent only if it simulates faster. Both passes, because selective recompute acts
        on the split the simulator picked: the model's split can simulate faster before it and slower after
        (GPT-3 on 4096 A100: 7.06 s against 6.48 s)."""
        from ..split.stage_model_shares import ShareClass, joint_shares

        self.refining = True
        try:
            top = sorted(finalists)[:REFINE]
            top = [f for f in top if f[0] <= top[0][0] * (1 + REFINE_WINDOW)]
            if spec is not None:  # one pipeline class: both passes solved ahead (several: solved here, below)
                spec.restart(((cfg.index, mode), cfg.bound) for _, _, cfg in top
                             if len(_pipeline_classes(self._replica_types(cfg))) == 1 and cfg.bound < self.best_step
                             for mode in (REFINE_SPLITS, REFINE_MODEL))
            for i, (_, _, cfg) in enumerate(top):
                if cfg.bound >= self.best_step:
                    continue  # no split or option of it can beat the incumbent (its bound holds for every one)
                if self.guard.passed():
                    if self.stopped_by_wall:  # `run` says so already
                        break
                    warnings.warn(f"planning stopped at the wall-clock guard ({self.time_limit_s:g} s) while "
                                  f"refining: {len(top) - i} of its {len(top)} finalists were not re-solved, so this "
                                  f"plan depends on the machine's speed and load; {budget.RAISE}.", stacklevel=4)
                    break
                classes = _pipeline_classes(self._replica_types(cfg))
                if spec is not None and len(classes) == 1:
                    self._take(spec, cfg, REFINE_SPLITS)
                    self._take(spec, cfg, REFINE_MODEL)
                    continue
                # the batch split once for both passes (None: one class, its even split)
                inner = self._batch_split(cfg, classes) if len(classes) > 1 else None
                self.model_splits = False
                self._consider(cfg, inner)
                self.model_splits = True
                self._consider(cfg, inner)
                if inner is None:
                    continue
                share_classes = [ShareClass(ix, lambda m, c=cfg, d=ix[0]: self._slots(c, c.pipelines[d], m, False))
                                 for ix in classes.values()]
                joint = joint_shares(self.cm, self.splitter, share_classes, cfg.b, cfg.schedule, cfg.chunks, inner,
                                     cfg.bound, STAGE_MODEL_TIME_S, self.guard)
                if joint is None or joint.shares == inner:
                    continue
                self._consider(cfg, joint.shares)
        finally:
            self.refining = self.model_splits = False

    def run(self) -> Plan:
        configs = self._configs()
        finalists: list[tuple[float, int, Config]] = []
        # best first on the work bound; a config's memory bound is computed when it comes up, and a config it
        # raises goes back in its place (the order stays increasing in the larger bound)
        heap = [(cfg, False) for cfg in configs]
        n = workers_for(len(configs), self.workers)
        spec = None
        if n:
            self._by_index = {cfg.index: cfg for cfg in configs}
            for cfg in configs:  # each grouping's groups once, before the fork: the workers and the queue share them
                self._groups_of(cfg)
            spec = Speculative(n, self._visits(list(heap)), lambda key: id(self._by_index[key[0]].pipelines),
                               self._solve_ahead)
        try:
            k, stopped_early, unsolved = self._loop(configs, heap, finalists, spec)
            if spec is not None and not self._incumbents and self.cutoff == math.inf:
                # nothing fits: the nearest misses were noted in the workers; the one-process search names them
                spec.close()
                spec = None
                return Search(self.cm, self.guard.left(), None, self.work_limit, self.cutoff, workers=0).run()
            return self._finish(configs, finalists, k, stopped_early, unsolved, spec)
        finally:
            if spec is not None:
                spec.close()

    def _loop(self, configs: list[Config], heap: list[tuple[Config, bool]], finalists: list[tuple[float, int, Config]],
              spec: Speculative | None) -> tuple[int, str, float]:
        """The branch and bound over `heap` (module docstring): configs solved, why it stopped early ("work",
        "wall" or ""), and the least bound left where it did."""
        stopped_early, unsolved, k = "", 0.0, 0
        while heap:
            cfg, tight = heapq.heappop(heap)
            if cfg.bound >= self.best_step and self._bounded():
                break  # configs come in bound order: none of the rest can win
            # (without an incumbent, configs no device fits are still tried: they fail at once and leave the
            # nearest miss for the infeasibility message, `Splitter.closest`)
            if not tight:
                bound = max(cfg.bound, self._memory_bound(cfg))
                if bound > cfg.bound:
                    heapq.heappush(heap, (cfg._replace(bound=bound), True))
                    continue
            out_of_work = self.work_limit is not None and k >= self.work_limit
            if (out_of_work or self.guard.passed()) and self._bounded():
                stopped_early = "work" if out_of_work else "wall"
                self.stopped_by_wall = not out_of_work
                unsolved = min(cfg.bound, heap[0][0].bound) if heap else cfg.bound  # the least bound left
                break
            step = self._consider(cfg) if spec is None else self._take(spec, cfg, SEARCH)
            if step is not None:
                finalists.append((step, k, cfg))
            k += 1
            if self.progress is not None:
                best = self.best_step if self._incumbents else None
                if self._progress_bound:  # the least lower bound left: the bound gap's denominator
                    self.progress(len(configs) - len(heap), len(configs), best, heap[0][0].bound if heap else None)
                else:
                    self.progress(len(configs) - len(heap), len(configs), best)
        return k, stopped_early, unsolved

    def _finish(self, configs: list[Config], finalists: list[tuple[float, int, Config]], k: int, stopped_early: str,
                unsolved: float, spec: Speculative | None = None) -> Plan:
        """Refine the finalists and return the best plan priced in full, warning where the search stopped early."""
        self._refine(finalists, spec)
        best = self._best_priced()
        if best is None and self.cutoff < math.inf:
            if stopped_early == "wall":  # (a subset search, subsets.py: its caller goes on as if none were faster)
                warnings.warn(f"planning stopped at the wall-clock guard ({self.time_limit_s:.3g} s) before its work "
                              f"budget, after {k} of {len(configs)} configurations, with no plan faster than the "
                              f"cutoff of {fmt_time(self.cutoff)}/step: a faster plan on these devices may be left "
                              f"unfound, so this plan depends on the machine's speed and load; {budget.RAISE}.",
                              stacklevel=3)
            raise InfeasibleError(f"no plan faster than the cutoff of {fmt_time(self.cutoff)}/step.")
        if best is None:
            raise InfeasibleError(self._infeasible_message())
        best_step = best.predicted["step_time_s"]
        if any(st.compress for pipe in best.pipelines for st in pipe.stages):
            # compression changes numerics: keep it only where it shortens the predicted step
            plain = price(self.cm, replace(best, pipelines=[
                replace(pipe, stages=[replace(st, compress=None) for st in pipe.stages]) for pipe in best.pipelines]))
            if plain.plan.predicted["step_time_s"] <= best_step:
                best = plain.plan
        if stopped_early:
            # what the unsolved configurations could still win at most, by their lower bounds
            self.gap = max(0.0, best_step / unsolved - 1) if unsolved > 0 else math.inf
            why = (f"its work budget (work_limit={self.work_limit} configurations; the same plan on any machine)"
                   if stopped_early == "work" else
                   f"the wall-clock guard ({self.time_limit_s:g} s) before its work budget: this plan depends on "
                   f"the machine's speed and load")
            fix = ("Raise work_limit" if stopped_early == "work" else
                   "Raise time_limit_s (or lower work_limit for a plan that does not depend on the machine)")
            warnings.warn(f"planning stopped at {why} after {k} of {len(configs)} configurations; returning the "
                          f"best plan so far ({fmt_time(best_step)}/step; the unsolved configurations' lower bounds "
                          f"allow one at most {100 * (1 - 1 / (1 + self.gap)):.1f}% faster). {fix} for a possibly "
                          f"better one.", stacklevel=3)
        return best

    def _bounded(self) -> bool:
        """Whether the search may stop on its bounds or budget: once it has an incumbent, or from the start
        with a cutoff (without either it goes on, so that an infeasible search records its nearest miss)."""
        return bool(self._incumbents) or self.cutoff < math.inf

    def _infeasible_message(self) -> str:
        """Why nothing was found: no layout covers the devices, or what does not fit in memory (infeasible.py)."""
        from . import infeasible  # it enumerates layouts with this module's rules

        return infeasible.message(self.cm, self.splitter)


def search(cm: CostModel, time_limit_s: float = 60.0, progress: Progress | None = None, *,
           objective: str = "time", budget_per_hour: float | None = None,
           work_limit: int | None = WORK_LIMIT) -> Plan:
    """The fastest plan that fits; see the module docstring for the formulation. `objective` / `budget_per_hour`:
    what to minimise (solver/search/objective.py `score`: "time" or "cost" per sample, within a budget per hour);
    then every union of device types is searched and the best-scoring plan may leave devices out
    (solver/search/subsets.py). `work_limit`: configurations solved at most per search, the budget that makes the
    plan the same on any machine; `time_limit_s` only guards the wall-clock time (and warns when it stops it)."""
    def one(c: CostModel, seconds: float, cutoff: float) -> Plan:
        if context.degree(c) > 1:  # (context parallelism runs without expert parallelism)
            plan = Search(c, seconds, progress, work_limit, cutoff).run()
            plan.experts = experts.describe(c, plan)
            return plan
        return experts.choose(c, lambda c2, limit: Search(c2, limit, progress, work_limit, cutoff).run(), seconds)

    def run(c: CostModel, seconds: float, cutoff: float = math.inf) -> Plan:
        return choose_context(c, one, seconds, cutoff)  # cp = 1, and cp > 1 where it can pay (context.py)

    from .subsets import best_subset_plan, fallback_plan, without_slow_types  # plans that leave devices out

    with collector_paused():  # the memo tables are many long-lived objects; the workers fork from here (collector.py)
        if objective == "time" and budget_per_hour is None:
            guard = WallGuard(time_limit_s)  # the subset searches get what is left of it (subsets.py, "Wall clock")
            try:
                whole = run(cm, time_limit_s)
            except InfeasibleError as e:  # no plan uses every device: leave some idle rather than refuse
                return fallback_plan(cm, run, guard.left(), e)
            return without_slow_types(cm, run, whole, guard.left())
        return best_subset_plan(cm, run, time_limit_s, objective, budget_per_hour)


__all__ = ["WORK_LIMIT", "Config", "Search", "config_microbatch_sizes", "divisors", "groupings", "microbatch_count",
           "microbatch_sizes", "schedules", "search", "tp_units"]
