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
from autopar.solver.pricing.pricing import CostModel, Option, model_summary, price
from autopar.solver.search.search import search

OFFLOADS = [tuple(k for i, k in enumerate(OFFLOAD_KINDS) if mask >> i & 1) for mask in range(1 << len(OFFLOAD_KINDS))]


def _cluster(a: tuple[str, float], b: tuple[str, float]) -> dict:
    return {"nodes": [{"device": {"name": f"small-{name}", "based_on": name, "memory_GiB": gib},
                       "devices_per_node": 1, "count": 1} for name, gib in (a, b)]}


def _plan(cm: CostModel, schedule: str, pipes: list[tuple[int, int, list[Stage]]], cluster: dict, model: dict) -> Plan:
    pipelines = [Pipeline(share, -(-share // m), m, stages) for share, m, stages in pipes]
    return Plan(cm.B, cm.precision, cm.optimizer, schedule, 1, cluster, model, pipelines, {}, cm.reserve)


def _step(cm: CostModel, plan: Plan) -> float:
    priced = price(cm, plan)
    return priced.plan.predicted["step_time_s"] if priced.fits else math.inf


def _stage_figures(cm: CostModel, memo: dict, share: int, m: int, stage: Stage, dp: tuple[int, ...]
                   ) -> tuple[float, float, float]:
    """(compute-stream seconds of the stage's micro-batches, its least static bytes, its device's most usable
    bytes) for `_cannot_beat`, from `price`'s own `stage_times` and `stage_memory`."""
    key = (share, m, tuple(stage.layers), tuple(stage.devices), stage.zero, stage.recompute, tuple(stage.offload), dp)
    if key not in memo:
        (a, e), dev = stage.layers, stage.devices[0]
        dtype, n, m_full = cm.cluster.devices[dev].spec.name, -(-share // m), share % m or m
        opt = Option(stage.zero, stage.recompute, tuple(stage.offload))
        base = cm.base(a, e, dtype, n, (dev,))
        tf = cm.stage_times(base, opt, dtype, (dev,), dp)
        ts = cm.stage_times(cm.base(a, e, dtype, n - 1, (dev,)), opt, dtype, (dev,), dp) if m_full < m else tf
        seconds = (m_full * (tf.fwd + tf.bwd - 2 * tf.gather - tf.reduce)
                   + (m - m_full) * (ts.fwd + ts.bwd - 2 * tf.gather - tf.reduce))
        static = min(cm.stage_memory(base, opt, 1, len(dp), layerwise).static for layerwise in (True, False))
        memo[key] = (seconds, static, math.inf if cm.unified(dev) else cm.usable(dev, 0))
    return memo[key]


def _plan_bound(cm: CostModel, memo: dict, pipes: list[tuple[int, int, list[Stage]]],
                dps: list[list[tuple[int, ...]]]) -> float:
    """A step the plan of `pipes` (one stage per device; `dps` each stage's data-parallel group) cannot price
    below as a fitting plan: inf when it cannot fit, else the most seconds a device spends on its compute stream.

    * a device's priced peak (`rank_peak`) is its stage's static bytes plus a non-negative rest; `price` computes
      them with its layerwise flag (the smaller of both taken here) and flags the device when the peak exceeds
      `usable` with its NCCL communicators, at most `usable(d, 0)` (unified devices not judged): it never fits;
    * `Plan.simulate` runs a device's F, B and W actions (and memory actions, >= 0 seconds) one after another on
      its compute stream, so the step is at least the sum of their durations: per micro-batch fwd - gather for
      F and bwd - gather - reduce for B + W (plan_simulate._arguments, simulate._duration), parts of
      `stage_times` that do not depend on the layerwise mode `price` passes (ZeRO's gathers and reductions,
      which do, are the memory actions' share)."""
    bound = 0.0
    for (share, m, stages), dp in zip(pipes, dps, strict=True):
        for stage, group in zip(stages, dp, strict=True):
            seconds, static, usable = _stage_figures(cm, memo, share, m, stage, group)
            if static > usable:
                return math.inf
            bound = max(bound, seconds)
    return bound


def brute_force(cm: CostModel) -> tuple[float, Plan | None, int]:
    """(best predicted step over the module docstring's space, that plan, plans priced that fit). A plan whose
    `_plan_bound` is at least the best step so far (times 1 + 1e-6: the bound sums in another order than the
    simulator) is not priced: it does not fit or prices no faster, and a later plan replaces the best only when
    strictly faster, so the best and its plan are those of pricing every plan."""
    B, L = cm.B, cm.L
    cluster, model, memo = cm.cluster.to_dict(), model_summary(cm.graph), {}  # the same for every plan
    best, best_plan, fitting = math.inf, None, 0

    def consider(schedule: str, pipes: list[tuple[int, int, list[Stage]]], dps: list[list[tuple[int, ...]]]) -> None:
        nonlocal best, best_plan, fitting
        if _plan_bound(cm, memo, pipes, dps) * (1 - 1e-6) >= best:
            return
        plan = _plan(cm, schedule, pipes, cluster, model)
        step = _step(cm, plan)
        fitting += step < math.inf
        if step < best:
            best, best_plan = step, plan

    # one pipeline over both devices, either order
    for order in ((0, 1), (1, 0)):
        for cut in range(1, L):
            for schedule in ("gpipe", "1f1b"):
                for m in range(1, B + 1):
                    for (rc0, off0), (rc1, off1) in itertools.product(
                            itertools.product((False, True), OFFLOADS), repeat=2):
                        stages = [Stage([0, cut], [order[0]], 0, rc0, list(off0)),
                                  Stage([cut, L], [order[1]], 0, rc1, list(off1))]
                        consider(schedule, [(B, m, stages)], [[(order[0],), (order[1],)]])
    # two replicas of the whole model, one per device
    for s in range(1, B):
        for m0, m1 in itertools.product(range(1, s + 1), range(1, B - s + 1)):
            for zero in (0, 1):
                for (rc0, off0), (rc1, off1) in itertools.product(
                        itertools.product((False, True), OFFLOADS), repeat=2):
                    consider("1f1b", [(s, m0, [Stage([0, L], [0], zero, rc0, list(off0))]),
                                      (B - s, m1, [Stage([0, L], [1], zero, rc1, list(off1))])], [[(0, 1)], [(0, 1)]])
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
