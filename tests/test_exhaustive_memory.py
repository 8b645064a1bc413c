"""The planner against a brute force written from scratch, on two small heterogeneous clusters whose memory
is too small for the plain plans, so memory options and layer split interact.

The brute force does not use the search's enumerators (no search.py / split.py / stage_model.py code):
it lists every plan of its space itself, builds each as an explicit `Plan` and prices it with
`solver.pricing.price`, the planner's judge. Its space, on two devices A and B (one per node):
  * one pipeline A -> B or B -> A: every layer cut, gpipe and 1f1b, every micro-batch count 1..batch,
    per stage every recompute x offload subset (ZeRO is moot with one replica);
  * two replicas, one per device: every batch split (s, batch - s), every micro-batch count per replica,
    per replica every ZeRO level 0-1 x recompute x offload subset (both ZeRO 0 or both 1: the replicas
    form one data-parallel group, and the runtime runs ZeRO-2/3 per layer only where both replicas are
    alike, which uneven shares are not).
The planner's space contains this one (and interleaved schedules besides), so its plan must be at least
as fast: predicted step <= the brute force's best * (1 + 1e-9). Both are predictions of one cost model.
"""

from __future__ import annotations

import itertools
import math

import pytest

from autopar.api import cost_model
from autopar.ir.plan import OFFLOAD_KINDS, Pipeline, Plan, Stage
from autopar.models import gpt
from autopar.solver.pricing.pricing import CostModel, model_summary, price
from autopar.solver.search.search import search

OFFLOADS = [tuple(k for i, k in enumerate(OFFLOAD_KINDS) if mask >> i & 1) for mask in range(1 << len(OFFLOAD_KINDS))]


def _cluster(a: tuple[str, float], b: tuple[str, float]) -> dict:
    return {"nodes": [{"device": {"name": f"small-{name}", "based_on": name, "memory_GiB": gib},
                       "devices_per_node": 1, "count": 1} for name, gib in (a, b)]}


def _plan(cm: CostModel, schedule: str, pipes: list[tuple[int, int, list[Stage]]]) -> Plan:
    pipelines = [Pipeline(share, -(-share // m), m, stages) for share, m, stages in pipes]
    return Plan(cm.B, cm.precision, cm.optimizer, schedule, 1, cm.cluster.to_dict(), model_summary(cm.graph),
                pipelines, {}, cm.reserve)


def _step(cm: CostModel, plan: Plan) -> float:
    priced = price(cm, plan)
    return priced.plan.predicted["step_time_s"] if priced.fits else math.inf


def brute_force(cm: CostModel) -> tuple[float, Plan | None, int]:
    """(best predicted step over the module docstring's space, that plan, plans that fit)."""
    B, L = cm.B, cm.L
    best, best_plan, fitting = math.inf, None, 0
    # one pipeline over both devices, either order
    for order in ((0, 1), (1, 0)):
        for cut in range(1, L):
            for schedule in ("gpipe", "1f1b"):
                for m in range(1, B + 1):
                    for (rc0, off0), (rc1, off1) in itertools.product(
                            itertools.product((False, True), OFFLOADS), repeat=2):
                        stages = [Stage([0, cut], [order[0]], 0, rc0, list(off0)),
                                  Stage([cut, L], [order[1]], 0, rc1, list(off1))]
                        plan = _plan(cm, schedule, [(B, m, stages)])
                        step = _step(cm, plan)
                        fitting += step < math.inf
                        if step < best:
                            best, best_plan = step, plan
    # two replicas of the whole model, one per device
    for s in range(1, B):
        for m0, m1 in itertools.product(range(1, s + 1), range(1, B - s + 1)):
            for zero in (0, 1):
                for (rc0, off0), (rc1, off1) in itertools.product(
                        itertools.product((False, True), OFFLOADS), repeat=2):
                    pipes = [(s, m0, [Stage([0, L], [0], zero, rc0, list(off0))]),
                             (B - s, m1, [Stage([0, L], [1], zero, rc1, list(off1))])]
                    plan = _plan(cm, "1f1b", pipes)
                    step = _step(cm, plan)
                    fitting += step < math.inf
                    if step < best:
                        best, best_plan = step, plan
    return best, best_plan, fitting


CASES = {
    # fast device with little memory next to a slow one with more: the split trades speed for memory
    "a100-small+t4": (("A100-80GB", 0.02), ("T4", 0.03)),
    "v100-small+l4": (("V100-16GB", 0.018), ("L4", 0.026)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_planner_at_least_as_good_as_brute_force(name: str) -> None:
    mc = gpt(batch=4, seq=64, vocab=512, hidden=256, layers=3, heads=4)
    cm = cost_model(mc.model, _cluster(*CASES[name]), mc.example_inputs, mc.example_target, mc.loss_fn)
    best, best_plan, fitting = brute_force(cm)
    assert fitting > 0 and best_plan is not None
    plan = search(cm)
    assert plan.predicted["step_time_s"] <= best * (1 + 1e-9), (plan.predicted["step_time_s"], best, best_plan)
