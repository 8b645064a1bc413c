"""Choosing the context-parallel degree (cp) of a plan: which searches run, and what `predicted["cp"]` says.

search.search runs `choose` around every search of one cost model (so plans that leave devices out choose too).
The search runs at cp = 1 first. cp > 1 is tried only for long sequences (T >= CP_MIN_TOKENS) and only where it
can pay, i.e. where one sample is what limits the plan:

  * no cp = 1 plan fits (InfeasibleError): a sample's activations at T / cp tokens, and ZeRO over dp x cp
    holders, may fit where nothing did (unless the training state alone exceeds all device and host memory); or
  * the cp = 1 plan runs micro-batches of one sample and still splits a sample's work or memory
    (`sample_bound`): tensor or pipeline parallelism, recompute, or offloaded activations. cp divides a sample's
    tokens, so it can replace those (fewer all-reduces, fewer stages, less recompute). A plan that fits with
    larger micro-batches, or runs one-sample micro-batches whole on every device, has nothing cp could take over
    (its data-parallel replicas are at least as good as cp siblings: the same compute, no exchange).

CP_MIN_TOKENS (4096) keeps the pretraining lengths of the usual models (GPT-2/3, LLaMA, BERT: 512-2048 tokens,
every model of bench/planner.py and of the tests before cp) at cp = 1, whatever else happens: their plans and
planning time stay what they were (an infeasible one included: cp is no fix for a layout or a model too big), a
ring block of at most 1024 tokens leaves little compute to hide the exchange behind, and the checks the runtime
makes before it runs cp (no other op mixing tokens, a token-mean loss: passes/sequence_split.py) cannot be made by
the planner, so cp is not offered where it is not needed. `Strategy(cp=...)` prices any length.

The model must allow cp at all (solver/pricing/context.py `ContextParallel.blocker`: torch SDPA attention, causal or
unmasked, no random ops in training, ...). Then each candidate (`context.candidates`: cp = 2, 4, ... dividing the
world, 2 cp dividing T) is searched with ring attention and the best step so far as the search's cutoff (only
faster plans count; a search whose configurations' lower bounds all reach it stops at once), and a faster plan's
Ulysses variant is priced too (where the heads allow; the faster kept). So planning time grows only for models
whose cp = 1 plan is sample-bound, and there by at most one bounded search per candidate.

`predicted["cp"]`: {"chosen": cp, "attention", "exchange" (pricing), "reason": one line, "considered": step per cp
tried (when any was)}; without attention in the model there is none.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ...errors import InfeasibleError, PlanError
from ...ir.plan import Strategy, even_split
from ...report import fmt_time
from ..budget import WallGuard, loop_stopped
from ..pricing import context
from ..pricing.pricing import CostModel, price, price_strategy
from .infeasible import least_state_bytes

CP_MIN_TOKENS = 4096  # sequences at least this long are "long": cp > 1 is considered for them (module docstring)


def sample_bound(plan: Any) -> str:
    """What of one sample the cp = 1 `plan` splits while its micro-batches hold one sample ("" when its micro-batches
    hold more, or it splits nothing: then cp cannot pay; module docstring)."""
    if any(p.microbatch_size > 1 for p in plan.pipelines):
        return ""
    stages = [st for p in plan.pipelines for st in p.stages]
    why = [w for w, hit in (("tensor parallelism", any(st.tp > 1 for st in stages)),
                            ("pipeline stages", any(len(p.stages) > 1 for p in plan.pipelines)),
                            ("recompute", any(st.recompute for st in stages)),
                            ("offloaded activations", any("activations" in st.offload for st in stages))) if hit]
    return " and ".join(why)


def _memory(cm: CostModel) -> float:
    """The usable bytes of the cluster's device and host memory together (infeasible.py's figure)."""
    return (sum(d.spec.memory for d in cm.cluster.devices) + sum(n.host_memory for n in cm.cluster.nodes)) \
        * (1 - cm.reserve)


def _fmt(v: Any) -> str:
    return f"{fmt_time(v)}/step" if isinstance(v, float) else str(v)


def choose(cm: CostModel, run: Callable[[CostModel, float, float], Any], time_limit_s: float,
           cutoff: float = math.inf) -> Any:
    """The plan of the fastest degree (module docstring); `run(cost model, seconds, cutoff)` searches one."""
    ctx = cm.context
    if not ctx.has_attention:
        return run(cm, time_limit_s, cutoff)
    guard = WallGuard(time_limit_s)  # each degree's search gets the time left of it, not a share (budget.py)
    best, error = None, None
    try:
        best = run(cm, time_limit_s, cutoff)
    except InfeasibleError as e:
        error = e
    cands = context.candidates(cm)
    why_not = ("cp not possible: " + ctx.blocker if ctx.blocker else
               f"not considered: {ctx.seq} tokens per sequence (cp is considered from {CP_MIN_TOKENS} on)"
               if ctx.seq < CP_MIN_TOKENS else
               "" if cands else f"cp not possible: no cp > 1 divides the world with 2 cp dividing the {ctx.seq} tokens")
    if best is None and not why_not and least_state_bytes(cm) > _memory(cm):
        raise error  # type: ignore[misc]  # the training state alone fits nowhere: cp cannot help
    if best is not None and not why_not:
        if not sample_bound(best):
            why_not = ("not considered: the plan fits with micro-batches of more than one sample"
                       if any(p.microbatch_size > 1 for p in best.pipelines) else
                       "not considered: one-sample micro-batches run whole on each device")
    if why_not:
        if best is None:
            raise error  # type: ignore[misc]
        best.predicted["cp"] = {"chosen": 1, "reason": why_not}
        return best
    tried: dict[str, Any] = {"1": best.predicted["step_time_s"] if best is not None else "no plan fits"}
    for k, cp in enumerate(cands):
        if best is not None and guard.passed():
            loop_stopped(guard, k, len(cands), "context-parallel degrees > 1")
            break
        limit = guard.left()
        # (without a plan yet, a finite cutoff all the same: a search that finds nothing then skips the
        # infeasibility message, which the cp = 1 search's error already gives)
        bar = min(cutoff, best.predicted["step_time_s"] if best is not None else sys.float_info.max)
        try:
            plan = run(cm.with_context(cp, context.RING), limit, bar)
        except (InfeasibleError, PlanError):
            tried[str(cp)] = "no faster plan" if best is not None else "no plan fits"
            continue
        tried[str(cp)] = plan.predicted["step_time_s"]
        if best is None or plan.predicted["step_time_s"] < best.predicted["step_time_s"]:
            best = _with_ulysses(cm, plan)
            tried[str(cp)] = best.predicted["step_time_s"]
    if best is None:
        raise error  # type: ignore[misc]
    chosen = best.pipelines[0].stages[0].cp
    pred = dict(best.predicted.get("cp") or {"chosen": 1})
    pred["considered"] = tried
    others = ", ".join(f"cp {k}: {_fmt(v)}" for k, v in tried.items() if k != str(chosen))
    pred["reason"] = (f"cp>1 considered ({sample_bound(best) or 'one-sample micro-batches'} at cp=1) and not "
                      f"faster: {others}" if chosen == 1 else f"chosen over {others}")
    pred["travel"] = travel(cm)
    best.predicted["cp"] = pred
    return best


def travel(cm: CostModel) -> dict[str, Any]:
    """What moves for a long sequence over the whole cluster, priced both ways (TawPipe's question): the weights
    (cp over every device with ZeRO-3: each rank keeps its tokens' activations, every layer's weights come to it
    right before the layer runs and its gradients go back to their owner) or the activations (a pipeline over
    every device: each stage keeps its layers' weights, activations and their gradients cross the stage
    boundaries). Each: its step time, exposed communication per step, whether it fits, or why it cannot run."""
    world, blocks = cm.cluster.world_size, cm.num_blocks
    # a pipeline over every device: blocks spread evenly; the layers before and after the blocks on the first and
    # last stage alone where there are fewer blocks than stages
    split = None if blocks >= world else [0, *even_split(blocks, world - 2), 0] if blocks >= world - 2 else None
    out: dict[str, Any] = {}
    for name, strategy in (("weights", Strategy(cp=world, zero=3, microbatch_size=1)),
                           ("activations", Strategy(pp=world, microbatch_size=1, layer_split=split))):
        try:
            cmk = cm.with_context(world, context.RING) if strategy.cp > 1 else cm
            est = price_strategy(cmk, strategy)
        except (PlanError, InfeasibleError) as e:
            out[name] = {"plan": _describe(strategy), "error": str(e).split(". ")[0]}
            continue
        comm = max(sum(st.predicted.get("comm_s", 0.0) for st in p.stages) for p in est.plan.pipelines)
        out[name] = {"plan": _describe(strategy), "step_time_s": est.plan.predicted["step_time_s"],
                     "comm_s": comm, "fits": est.fits}
    return out


def _describe(strategy: Any) -> str:
    return f"cp {strategy.cp} + ZeRO-3" if strategy.cp > 1 else f"pp {strategy.pp}"


def _with_ulysses(cm: CostModel, plan: Any) -> Any:
    """The ring plan, or its Ulysses variant where its heads allow it and it prices faster (and fits)."""
    other = replace(plan, pipelines=[replace(p, stages=[replace(st, cp_attention=context.ULYSSES, predicted={})
                                                        for st in p.stages]) for p in plan.pipelines], predicted={})
    try:
        priced = price(cm, other)
    except PlanError:
        return plan
    if priced.fits and priced.plan.predicted["step_time_s"] < plan.predicted["step_time_s"]:
        return priced.plan
    return plan


__all__ = ["CP_MIN_TOKENS", "choose", "sample_bound", "travel"]
