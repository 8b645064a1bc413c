"""What the search minimises: the step time, or the cost per sample, optionally under a price budget.

Prices come from the cluster file (`price_per_hour` on a node group: what one of its devices costs per
hour, autopar/cluster.py). For a priced plan (every device it uses has a price):

    cost_per_hour    = sum of the used devices' price_per_hour          (devices the plan leaves out cost
                                                                        nothing: the user need not rent them)
    cost_per_sample  = cost_per_hour / 3600 x step_time_s / samples per step
                     = cost_per_hour / (3600 x samples_per_s)

Objectives (`score`, lower is better; a plan that does not fit scores inf):

    "time"   step_time_s                       the fastest plan; with `budget` (per hour) the fastest whose
                                               cost_per_hour is within it (others score inf)
    "cost"   cost_per_sample                   the cheapest per sample; with `budget` also within it

The figures are predictions of the cost model (step time) times the prices the file gives.

Interface for the search (solver/search/search.py calls these; `price` fills the predictions they read):

    score(plan_predicted, cluster, objective, budget) -> float   `Plan.predicted` as `pricing.price` fills
                                                                   it: step_time_s, samples_per_s, fits,
                                                                   peak_memory_bytes (its keys are the
                                                                   used devices), cost_per_hour if priced
    used_devices(plan) -> list[int]                               the devices a Plan's stages name
    check_objective(objective, budget, cluster)                   PlanError for a bad objective / budget,
                                                                   or "cost" / a budget on an unpriced cluster
    cost_figures(cluster, devices, samples_per_s) -> dict         {"cost_per_hour", "cost_per_sample"}, {}
                                                                   when a device has no price
"""

from __future__ import annotations

import math
from typing import Any

from ...checks import check_number
from ...cluster import Cluster
from ...errors import PlanError
from ...ir.plan import Plan

OBJECTIVES = ("time", "cost")
SECONDS_PER_HOUR = 3600.0


def used_devices(plan: Plan) -> list[int]:
    """The devices `plan` gives work (sorted); the cluster's others are idle."""
    return sorted({d for p in plan.pipelines for st in p.stages for d in st.devices})


def unpriced(cluster: Cluster, devices: list[int] | None = None) -> list[int]:
    """Of `devices` (default: all of the cluster), those whose node group has no `price_per_hour`."""
    return [d for d in (range(cluster.world_size) if devices is None else devices)
            if cluster.price_per_hour(d) is None]


def check_objective(objective: str, budget: float | None, cluster: Cluster) -> None:
    """PlanError unless `objective` is one of OBJECTIVES and `budget` (per hour) None or a number >= 0, and
    the cluster prices every device when the objective or the budget needs prices."""
    if objective not in OBJECTIVES:
        raise PlanError(f"objective={objective!r}; choose 'time' (the fastest plan) or 'cost' (the lowest cost "
                        f"per sample, from the cluster file's price_per_hour).")
    check_number("budget_per_hour", budget, low=0, optional=True,
                 hint="the most the devices a plan uses may cost per hour, in the cluster file's currency")
    if objective == "cost" or budget is not None:
        missing = unpriced(cluster)
        if missing:
            groups = sorted({cluster.nodes[cluster.devices[d].node].group for d in missing})
            what = "objective='cost'" if objective == "cost" else f"budget_per_hour={budget}"
            raise PlanError(f"{what} needs a price for every device, but node group(s) {groups} of cluster "
                            f"{cluster.name!r} have none (devices {missing[:8]}{'...' if len(missing) > 8 else ''});"
                            f" give each node group price_per_hour (what one of its devices costs per hour).")


def cost_figures(cluster: Cluster, devices: list[int], samples_per_s: float) -> dict[str, float]:
    """cost_per_hour and cost_per_sample of a plan using `devices` at `samples_per_s` (module docstring);
    empty when one of the devices has no price."""
    if not devices or unpriced(cluster, devices):
        return {}
    per_hour = float(sum(cluster.price_per_hour(d) or 0.0 for d in devices))
    per_sample = per_hour / (SECONDS_PER_HOUR * samples_per_s) if samples_per_s > 0 else math.inf
    return {"cost_per_hour": per_hour, "cost_per_sample": per_sample}


def score(plan_predicted: dict[str, Any], cluster: Cluster, objective: str = "time",
          budget: float | None = None) -> float:
    """The objective's value of a priced plan (`Plan.predicted`), lower is better: its step time ("time")
    or its cost per sample ("cost"); inf when it does not fit, or costs more per hour than `budget`."""
    if plan_predicted.get("fits") is False:
        return math.inf
    step = float(plan_predicted["step_time_s"])
    if objective == "time" and budget is None:
        return step
    figures = plan_predicted if "cost_per_hour" in plan_predicted else cost_figures(
        cluster, sorted(int(d) for d in plan_predicted.get("peak_memory_bytes", {})),
        float(plan_predicted.get("samples_per_s", 0.0)))
    if "cost_per_hour" not in figures:
        raise PlanError(f"objective={objective!r} (budget {budget}) needs the used devices' prices; the cluster "
                        f"{cluster.name!r} does not price all of them (check_objective says which).")
    if budget is not None and figures["cost_per_hour"] > budget * (1 + 1e-12):
        return math.inf
    return step if objective == "time" else float(figures["cost_per_sample"])


def idle_devices(cluster: Cluster, plan: Plan, reasons: dict[int, str] | None = None) -> dict[int, str]:
    """Device -> why it is left out, for the devices of `cluster` that `plan` gives no work: the reason
    the caller gives (the search knows what it compared), else what leaving it out means."""
    used = set(used_devices(plan))
    out = {}
    for d in range(cluster.world_size):
        if d in used:
            continue
        given = (reasons or {}).get(d)
        if given is None:
            price = cluster.price_per_hour(d)
            given = ("the plan gives it no stage and no batch share (its rank idles)"
                     + (f"; leaving it out saves {price:.4g} per hour" if price else ""))
        out[d] = given
    return out


__all__ = ["OBJECTIVES", "check_objective", "cost_figures", "idle_devices", "score", "unpriced", "used_devices"]
