"""Plans that may leave devices out: the search over device subsets for a cost objective or a budget.

The branch and bound of search.py minimises the step time on every device of the cluster. With
`objective="cost"` or a `budget_per_hour` (solver/search/objective.py), using fewer devices can win: a user with
8 A100 and 8 T4 may be best served (per sample, or within a budget) by the A100 alone. Candidates are the
non-empty unions of the cluster's device types (with k types, 2^k - 1 sub-clusters, `Cluster.subset`),
each searched for its fastest plan within an equal share of the time limit. Each plan is written back on
the whole cluster (its device indices mapped, the devices it does not use idle, with the reason) and priced
there (`pricing.price`), and the best `objective.score` wins. Finer subsets (some devices of a type) are not
enumerated: within one type a plan on fewer devices is never cheaper per sample under this cost model
unless memory or the batch forbids using them all, which the full-type search already handles.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import replace

from ...errors import InfeasibleError
from ...ir.plan import Plan
from ..pricing.pricing import CostModel, price
from .objective import score

Searcher = Callable[[CostModel, float], Plan]


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
    not in `keep` idle for the reason `why`)."""
    pipelines = [replace(p, stages=[replace(st, devices=[keep[d] for d in st.devices], predicted={})
                                    for st in p.stages]) for p in plan.pipelines]
    whole = replace(plan, pipelines=pipelines, cluster=cm.cluster.to_dict(), predicted={})
    left = [i for i in range(cm.cluster.world_size) if i not in keep]
    return price(cm, whole, idle_reasons=dict.fromkeys(left, why)).plan


def best_subset_plan(cm: CostModel, run: Searcher, time_limit_s: float, objective: str,
                     budget_per_hour: float | None) -> Plan:
    """The plan with the best `objective.score` among the fastest plans of every device-type subset."""
    subsets = type_subsets(cm)
    share = time_limit_s / len(subsets)
    best, best_score, last_error = None, math.inf, None
    for keep in subsets:
        sub = cm if len(keep) == cm.cluster.world_size else CostModel(
            cm.graph, cm.cluster.subset(keep), cm.precision, cm.optimizer, cm.reserve, compress=cm.compress)
        try:
            plan = run(sub, share)
        except InfeasibleError as e:
            last_error = e
            continue
        left = sorted({d.spec.name for i, d in enumerate(cm.cluster.devices) if i not in keep})
        goal = "lowest cost per sample" if objective == "cost" else "fastest"
        budget = f" within {budget_per_hour}/hour" if budget_per_hour is not None else ""
        why = (f"the {goal} plan{budget} over every union of device types leaves the {'/'.join(left)} "
               f"devices out")
        whole = plan if sub is cm else on_whole_cluster(cm, plan, keep, why)
        s = score(whole.predicted, cm.cluster, objective, budget_per_hour)
        if s < best_score:
            best, best_score = whole, s
    if best is None:
        raise last_error or InfeasibleError("no device subset of the cluster has a plan that fits.")
    return best


__all__ = ["best_subset_plan", "on_whole_cluster", "type_subsets"]
