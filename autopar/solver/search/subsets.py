"""Plans that may leave devices out: the search over device subsets for a cost objective or a budget, and
the fallback onto a subset when no plan uses every device, whatever the objective.

The branch and bound of search.py minimises the step time on every device of the cluster. With
`objective="cost"` or a `budget_per_hour` (solver/search/objective.py), using fewer devices can win: a user with
8 A100 and 8 T4 may be best served (per sample, or within a budget) by the A100 alone. Candidates are the
non-empty unions of the cluster's device types (with k types, 2^k - 1 sub-clusters, `Cluster.subset`),
each searched for its fastest plan on its own work budget (`Search`'s work_limit configurations and CP-SAT's
deterministic limits), the wall-clock time left of the overall limit only its guard (`budget.WallGuard`; it
warns where it stops a search or the loop over the subsets, module docstring "Wall clock"). Each plan is written back on
the whole cluster (its device indices mapped, the devices it does not use idle, with the reason) and priced
there (`pricing.price`), and the best `objective.score` wins. Finer subsets (some devices of a type) are not
enumerated: within one type a plan on fewer devices is never cheaper per sample under this cost model
unless memory or the batch forbids using them all, which the fallback below handles.

Fallback (`fallback_plan`): when the search on the whole cluster (or on every union of types) finds no plan,
the planner leaves devices idle rather than refuse. Three reasons, the first two as infeasible.py words them:
  layout  no layout uses every device (too small a global batch for the replicas, too few layers for the
          stages, node sizes tp cannot divide). Candidates (`layout_candidates`): per node group (nodes
          alike, `Node.group`) its first n nodes with the first c devices of each, every combination that
          has a layout (`configs.layouts`), at most B x L x (largest node) devices and memory enough for the
          training state, taking turns by device count (the largest and the smallest first, the most peak
          FLOP/s first within a count), at most SUBSET_SEARCHES of them. Each is
          searched with the best step found so far as its cutoff (`Search(cutoff=)`), so a subset that
          cannot beat the incumbent ends at its first configuration's bound.
  memory  layouts exist but nothing fits: a device type too small to hold even its smallest share. The
          candidates are the unions of node groups that leave at least one out (whole groups: within a group
          fewer devices only hold more each), those with a layout, the most device memory first.
  budget  every union of device types costs more than `budget_per_hour`: the layout candidates, scored.
The fastest plan (or the best `objective.score`) over the candidates is written back on the whole cluster,
each left-out device idle with the reason in `predicted["idle_devices"]`. Only when no candidate has a plan is
the whole cluster's InfeasibleError raised, the same reason holding on its subsets (memory), or, for a layout
refusal whose subsets all run out of memory, the memory message of the largest of them.

Too slow to pay for itself (`without_slow_types`): with the default objective, a plan on every device can
still be slower than one without a slow device type (a Jetson beside A100s over a 1 GB/s network holds the
pipeline back; a split gives it at least a whole layer or sample). The fastest k device types by peak FLOP/s
(`fastest_types`, k = types - 1 down to 1) are searched with the best step so far as the cutoff, so a subset
that cannot win ends at its bounds. Only the slowest types are left out: a slow type beside faster ones is
what may not pay for itself, and 2^k - 2 searches per plan would cost too much planning time.

Wall clock: the subsets searched and each search's result are decided by counted work (at most SUBSET_SEARCHES
candidates, each search's work budget), so the plan is the same on any machine. The overall `time_limit_s` is one
guard (`budget.WallGuard`) over the loops: each subset search gets the time left of it as its own guard (not a
share, which a loaded host would exhaust before the search's work budget), and a loop whose guard has passed stops
before its next subset, warning that the plan then depends on the machine's speed and load (the fallback only
once it has a plan, the union-of-types search once it has one within the budget).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import replace

from ...cluster import Cluster
from ...errors import InfeasibleError
from ...ir.plan import Plan
from ...report import fmt_time
from ..budget import WallGuard, loop_stopped
from ..pricing.pricing import CostModel, price
from . import infeasible
from .objective import score

# (cost model, seconds, cutoff): the fastest plan faster than the cutoff step time, InfeasibleError if none
Searcher = Callable[[CostModel, float, float], Plan]
SUBSET_SEARCHES = 48  # candidate sub-clusters the fallback searches at most
ENUMERATION_LIMIT = 20000  # (nodes, devices per node) combinations the layout fallback looks at at most


def type_subsets(cm: CostModel) -> list[list[int]]:
    """Device indices of every non-empty union of device types, the whole cluster first."""
    by_type: dict[str, list[int]] = {}
    for i, d in enumerate(cm.cluster.devices):
        by_type.setdefault(d.spec.name, []).append(i)
    types = sorted(by_type)
    out = []
    for k in range(len(types), 0, -1):
        for combo in itertools.combinations(types, k):
            out.append(sorted(i for t in combo for i in by_type[t]))
    return out


def on_whole_cluster(cm: CostModel, plan: Plan, keep: list[int], why: str) -> Plan:
    """`plan`, made on `cluster.subset(keep)`, as a plan of the whole cluster (priced there, the devices
    not in `keep` idle for the reason `why`; the search's word on context parallelism, `predicted["cp"]`, kept)."""
    pipelines = [replace(p, stages=[replace(st, devices=[keep[d] for d in st.devices], predicted={})
                                    for st in p.stages]) for p in plan.pipelines]
    whole = replace(plan, pipelines=pipelines, cluster=cm.cluster.to_dict(), predicted={})
    left = [i for i in range(cm.cluster.world_size) if i not in keep]
    out = price(cm, whole, idle_reasons=dict.fromkeys(left, why)).plan
    if "cp" in plan.predicted:
        out.predicted["cp"] = {**plan.predicted["cp"], **out.predicted.get("cp", {})}
    return out


def best_subset_plan(cm: CostModel, run: Searcher, time_limit_s: float, objective: str,
                     budget_per_hour: float | None) -> Plan:
    """The plan with the best `objective.score` among the fastest plans of every device-type subset."""
    subsets = type_subsets(cm)
    guard = WallGuard(time_limit_s)
    best, best_score, last_error, planned = None, math.inf, None, False
    for i, keep in enumerate(subsets):
        if best is not None and guard.passed():
            loop_stopped(guard, i, len(subsets), "unions of device types")
            break
        sub = cm if len(keep) == cm.cluster.world_size else cm.on_subset(keep)
        try:
            plan = run(sub, guard.left(), math.inf)
        except InfeasibleError as e:
            last_error = e
            continue
        planned = True
        left = sorted({d.spec.name for i, d in enumerate(cm.cluster.devices) if i not in keep})
        goal = "lowest cost per sample" if objective == "cost" else "fastest"
        budget = f" within {budget_per_hour}/hour" if budget_per_hour is not None else ""
        why = (f"the {goal} plan{budget} over every union of device types leaves the {'/'.join(left)} "
               f"devices out")
        whole = plan if sub is cm else on_whole_cluster(cm, plan, keep, why)
        s = score(whole.predicted, cm.cluster, objective, budget_per_hour)
        if s < best_score:
            best, best_score = whole, s
    if best is None and planned:  # every union of types costs more than the budget: fewer devices may not
        over = InfeasibleError(f"every plan found costs more than budget_per_hour={budget_per_hour}, on the whole "
                               f"cluster and on every subset searched: raise the budget or use cheaper devices.")
        return fallback_plan(cm, run, guard.left(), over, objective, budget_per_hour, cause="budget")
    if best is None:
        return fallback_plan(cm, run, guard.left(), last_error or InfeasibleError("no device subset of the cluster "
                                                                                  "has a plan that fits."),
                             objective, budget_per_hour)
    return best


def fastest_types(cm: CostModel) -> list[list[int]]:
    """The devices of the fastest k device types (by peak FLOP/s at the plan's precision), for k = 1 .. all
    types - 1, most types first: the subsets that leave the slowest types out."""
    speed: dict[str, float] = {}
    for d in cm.cluster.devices:
        speed[d.spec.name] = d.spec.flops(cm.precision)
    ranked = sorted(speed, key=lambda t: -speed[t])
    return [[d.index for d in cm.cluster.devices if d.spec.name in ranked[:k]] for k in range(len(ranked) - 1, 0, -1)]


def without_slow_types(cm: CostModel, run: Searcher, whole: Plan, time_limit_s: float) -> Plan:
    """`whole` (the fastest plan on every device), or a faster one that leaves the slowest device types out
    (module docstring, "Too slow to pay for itself"): the fastest k types (`fastest_types`), each searched with
    the best step so far as its cutoff, the devices it drops idle with both step times as the reason."""
    subsets = fastest_types(cm)
    if not subsets:
        return whole
    guard = WallGuard(time_limit_s)
    best, best_keep = whole, None
    for i, keep in enumerate(subsets):
        if guard.passed():
            loop_stopped(guard, i, len(subsets), "subsets without the slowest device types")
            break
        try:
            best = run(cm.on_subset(keep), guard.left(), best.predicted["step_time_s"])
        except InfeasibleError:
            continue
        best_keep = keep
    if best_keep is None:
        return best
    left = sorted({d.spec.name for i, d in enumerate(cm.cluster.devices) if i not in best_keep})
    why = (f"a device too slow to pay for itself: the fastest plan using every device takes "
           f"{fmt_time(whole.predicted['step_time_s'])}/step, the fastest without the {'/'.join(left)} devices "
           f"{fmt_time(best.predicted['step_time_s'])}")
    return on_whole_cluster(cm, best, best_keep, why)


def _groups(cluster: Cluster) -> list[list[int]]:
    """Node indices by node group (nodes alike), in cluster order."""
    groups: dict[int, list[int]] = {}
    for n in cluster.nodes:
        groups.setdefault(n.group, []).append(n.index)
    return list(groups.values())


def _devices(cluster: Cluster, choice: tuple[tuple[int, int], ...], groups: list[list[int]]) -> list[int]:
    """The device indices of a choice of (nodes, devices per node) per node group."""
    return [d for (n, c), nodes in zip(choice, groups, strict=True) for k in nodes[:n]
            for d in cluster.nodes[k].devices[:c]]


def _node_counts(count: int) -> list[int]:
    """How many of a group's `count` nodes a candidate takes: 1-4, the powers of two and all of them."""
    return sorted({n for n in range(1, min(count, 4) + 1)} | {1 << k for k in range(count.bit_length())
                                                              if 1 << k <= count} | {count})


def _alternate(xs: list) -> list:
    """[a, b, c, d, e] -> [e, a, d, b, c]: the largest and the smallest first, then inwards."""
    out, lo, hi = [], 0, len(xs) - 1
    while lo <= hi:
        out.append(xs[hi])
        if lo < hi:
            out.append(xs[lo])
        lo, hi = lo + 1, hi - 1
    return out


def layout_candidates(cm: CostModel) -> list[list[int]]:
    """Device subsets for a cluster no layout covers (module docstring, "layout"): the first n nodes of each
    node group (n = 1-4, the powers of two and all) with the first c devices of each, every combination with
    a layout, at most B x L x the largest node's devices and memory enough for the training state
    (`infeasible.least_state_bytes`). Ordered so that every size gets its turn before SUBSET_SEARCHES cuts
    the list: the subsets of each device count by peak FLOP/s (most first), then in rounds over the counts,
    the largest and the smallest first and inwards (a big model needs many devices, a small one is fastest
    on few), the best of each count, then the second best of each, ..."""
    cluster, flops = cm.cluster, [d.spec.flops(cm.precision) for d in cm.cluster.devices]
    groups = _groups(cluster)
    cap = cm.B * cm.L * max(len(n.devices) for n in cluster.nodes)
    least = infeasible.least_state_bytes(cm) / (1 - cm.reserve)
    options = [[(0, 0)] + [(n, c) for n in _node_counts(len(nodes))
                           for c in range(1, min(len(cluster.nodes[k].devices) for k in nodes) + 1)]
               for nodes in groups]
    by_count: dict[int, list[tuple[float, int, list[int]]]] = {}
    for i, choice in enumerate(itertools.islice(itertools.product(*options), ENUMERATION_LIMIT)):
        count = sum(n * c for n, c in choice)
        if count == 0 or count > cap or count == cluster.world_size:
            continue
        memory = sum(n * c * cluster.devices[cluster.nodes[nodes[0]].devices[0]].spec.memory
                     + sum(cluster.nodes[k].host_memory for k in nodes[:n])
                     for (n, c), nodes in zip(choice, groups, strict=True) if n)
        if memory < least:  # not even the training state fits, wherever it is kept
            continue
        devices = _devices(cluster, choice, groups)
        if infeasible.layouts(cm, cluster=cluster.subset(devices)):
            by_count.setdefault(count, []).append((-sum(flops[d] for d in devices), i, devices))
    ranked = [sorted(v) for _, v in _alternate(sorted(by_count.items()))]
    return [r[k][2] for k in range(max(map(len, ranked), default=0)) for r in ranked if k < len(r)]


def memory_candidates(cm: CostModel) -> list[list[int]]:
    """Device subsets for a cluster on which nothing fits (module docstring, "memory"): every union of whole
    node groups that leaves one out and has a layout, the most device memory first."""
    cluster, groups = cm.cluster, _groups(cm.cluster)
    scored = []
    for k in range(len(groups) - 1, 0, -1):
        for i, combo in enumerate(itertools.combinations(range(len(groups)), k)):
            devices = sorted(d for g in combo for n in groups[g] for d in cluster.nodes[n].devices)
            if infeasible.layouts(cm, cluster=cluster.subset(devices)):
                scored.append((-sum(cluster.devices[d].spec.memory for d in devices), -len(devices), k, i, devices))
    return [devices for *_, devices in sorted(scored)]


def _layout_limits(cm: CostModel) -> str:
    return (f"no parallel layout uses all {cm.cluster.world_size} devices (a global batch of {cm.B} allows at "
            f"most {cm.B} data-parallel replica(s), the {cm.L}-layer chain at most {cm.L} stages each, and tp "
            f"stays inside a node)")


def _idle_reason(cm: CostModel, cause: str, searched: int, objective: str, budget: float | None) -> str:
    """Why the fallback's plan leaves a device idle (`predicted["idle_devices"]`)."""
    if cause == "layout":
        why = _layout_limits(cm)
        fixes = infeasible.layout_fixes(cm, subset=False)
        if fixes:
            why += f"; to use them all, {' or '.join(fixes)}"
    elif cause == "memory":
        why = "no plan using every device of the cluster fits in memory"
    else:
        why = f"the plans using more devices cost more than budget_per_hour={budget}"
    goal = "cheapest plan per sample" if objective == "cost" else "fastest plan"
    within = f" within budget_per_hour={budget}" if budget is not None else ""
    return f"{why}. The {goal}{within} over the {searched} device subset(s) searched leaves it idle"


def fallback_plan(cm: CostModel, run: Searcher, time_limit_s: float, error: InfeasibleError,
                  objective: str = "time", budget_per_hour: float | None = None, cause: str | None = None) -> Plan:
    """The best plan on a subset of the cluster when none uses every device (module docstring, "Fallback"),
    on the whole cluster with the devices it leaves out idle and why; `error` (the whole cluster's refusal)
    when no candidate has a plan either. `cause`: "layout" or "memory" (default: which one refused the whole
    cluster), or "budget" (every union of types over `budget_per_hour`: its finer subsets, as for "layout")."""
    cause = cause or ("layout" if not infeasible.layouts(cm) else "memory")
    cands = (memory_candidates if cause == "memory" else layout_candidates)(cm)[:SUBSET_SEARCHES]
    if not cands:
        raise error
    guard = WallGuard(time_limit_s)
    found: list[tuple[float, int, list[int], Plan]] = []
    largest: tuple[int, InfeasibleError] | None = None
    for i, keep in enumerate(cands):
        if found and guard.passed():
            loop_stopped(guard, i, len(cands), "device subsets")
            break
        cutoff = min((f[0] for f in found), default=math.inf) if objective == "time" else math.inf
        sub = cm.on_subset(keep)
        try:
            plan = run(sub, guard.left(), cutoff)
        except InfeasibleError as e:
            memory = sum(cm.cluster.devices[d].spec.memory for d in keep)
            if not found and (largest is None or memory > largest[0]):
                largest = (memory, e)
            continue
        s = score(plan.predicted, sub.cluster, objective, budget_per_hour)
        if s < math.inf:
            found.append((s, i, keep, plan))
    if not found:
        if cause != "layout" or largest is None:
            raise error
        sub = cm.cluster.subset(max(cands, key=lambda k: sum(cm.cluster.devices[d].spec.memory for d in k)))
        raise InfeasibleError(f"no plan on {cm.cluster.describe()}: {_layout_limits(cm)}, and on each of the "
                              f"{len(cands)} device subset(s) with a layout searched nothing fits in memory. On "
                              f"the one with the most device memory ({sub.describe()}): {largest[1]}") from error
    _, _, keep, plan = min(found, key=lambda f: f[:2])
    return on_whole_cluster(cm, plan, keep, _idle_reason(cm, cause, len(cands), objective, budget_per_hour))


__all__ = ["ENUMERATION_LIMIT", "SUBSET_SEARCHES", "best_subset_plan", "fallback_plan", "layout_candidates",
           "memory_candidates", "on_whole_cluster", "fastest_types", "type_subsets", "without_slow_types"]
