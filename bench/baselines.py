"""The baselines `planner.py` (and wl_edge.py, wl_moe.py) compare autopar's plan with; planner.py's docstring
defines them. Each is priced like `autopar.estimate` (`price_strategy`) on the case's cost model, so they get
the options autopar's plan may use: ZeRO, recompute, gradient accumulation, uneven batch shares (DP-speed)
and compressed stage sends where `CostModel.compress_choice` allows them (the grid)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import replace

from autopar.errors import PlanError
from autopar.ir.plan import Estimate, Plan, Strategy, even_split
from autopar.solver.pricing.pricing import CostModel, price, price_strategy
from autopar.solver.search.search import divisors

GRID_CHUNKS = (2, 4)
DP_MICROBATCH_COUNTS = (1, 2, 4, 8)


def _try(cm: CostModel, st: Strategy) -> Estimate | None:
    try:
        return price_strategy(cm, st)
    except PlanError:
        return None


def _faster(est: Estimate | None, best: Estimate | None) -> bool:
    return est is not None and est.fits and (
        best is None or est.predicted["step_time_s"] < best.predicted["step_time_s"])


def dp_only(cm: CostModel) -> tuple[Estimate | None, Strategy | None, int]:
    W = cm.cluster.world_size
    shares = even_split(cm.B, W) if cm.B >= W else None
    if shares is None:
        return None, None, 0
    split = None if cm.B % W == 0 else shares
    common = math.gcd(*shares)  # Strategy needs a micro-batch size that divides every share
    priced = 0
    for zero in range(4 if W > 1 else 1):
        best: tuple[Estimate | None, Strategy | None] = (None, None)
        for m in DP_MICROBATCH_COUNTS:
            mbs = common // m
            if mbs < 1 or common % m:
                continue
            for rc in (False, True):
                st = Strategy(dp=W, microbatch_size=mbs, zero=zero, recompute=rc, batch_split=split)
                est = _try(cm, st)
                priced += est is not None
                if _faster(est, best[0]):
                    best = (est, st)
        if best[0] is not None:
            return best[0], best[1], priced
    return None, None, priced


def speed_shares(cm: CostModel) -> list[int] | None:
    """Per-device batch shares proportional to each device's speed on the model (forward + backward seconds
    per sample at the even share, from the cost model), at least one each, summing to the batch (largest
    remainders first); None when the batch has fewer samples than the cluster has devices."""
    W = cm.cluster.world_size
    if cm.B < W:
        return None
    n, per = -(-cm.B // W), {}
    for d in cm.cluster.devices:
        if d.spec.name not in per:
            b = cm.base(0, cm.L, d.spec.name, n, (d.index,))
            per[d.spec.name] = n / (b.fwd + b.bwd + b.fwd_comm + b.bwd_comm)
    speed = [per[d.spec.name] for d in cm.cluster.devices]
    raw = [cm.B * s / sum(speed) for s in speed]
    shares = [max(1, math.floor(r)) for r in raw]
    while sum(shares) != cm.B:
        if sum(shares) < cm.B:
            shares[max(range(W), key=lambda i: raw[i] - shares[i])] += 1
        else:
            shares[min((i for i in range(W) if shares[i] > 1), key=lambda i: raw[i] - shares[i])] -= 1
    return shares


def _accumulate(cm: CostModel, est: Estimate, m: int) -> Estimate:
    """`est`'s plan with every replica running min(m, share) micro-batches of its own share, priced."""
    pipes = [replace(p, microbatch_size=-(-p.batch_share // min(m, p.batch_share)),
                     num_microbatches=min(m, p.batch_share)) for p in est.plan.pipelines]
    priced = price(cm, replace(est.plan, pipelines=pipes))
    return Estimate(priced.plan, priced.fits, priced.problems)


def dp_speed(cm: CostModel) -> tuple[Estimate | None, Strategy | None, int]:
    """The DP-speed baseline (module docstring): the smallest ZeRO stage at which a plan fits, at that stage
    the fastest of 1/2/4/8 micro-batches per replica x recompute off/on."""
    shares = speed_shares(cm)
    if shares is None:
        return None, None, 0
    W, priced = cm.cluster.world_size, 0
    for zero in range(4 if W > 1 else 1):
        best: tuple[Estimate | None, Strategy | None] = (None, None)
        for rc in (False, True):
            st = Strategy(dp=W, zero=zero, recompute=rc, batch_split=shares)
            one = _try(cm, st)
            if one is None:
                continue
            for m in DP_MICROBATCH_COUNTS:
                est = one if m == 1 else _accumulate(cm, one, m)
                priced += 1
                if _faster(est, best[0]):
                    best = (est, replace(st, microbatch_size=-(-max(shares) // m)))
        if best[0] is not None:
            return best[0], best[1], priced
    return None, None, priced


def compressed(cm: CostModel, plan: Plan) -> Plan | None:
    """`plan` with each stage boundary sent as autopar's plan may send it (`CostModel.compress_choice`);
    None when that changes no boundary."""
    pipes, changed = [], False
    for pipe in plan.pipelines:
        stages = []
        for j, st in enumerate(pipe.stages):
            wire = None
            if j + 1 < len(pipe.stages):
                out = cm.base(st.layers[0], st.layers[1], cm.cluster.devices[st.devices[0]].spec.name,
                              pipe.microbatch_size, tuple(st.devices)).out_bytes
                wire = cm.compress_choice(out, st.devices[0], pipe.stages[j + 1].devices[0])
            changed |= wire != st.compress
            stages.append(replace(st, compress=wire))
        pipes.append(replace(pipe, stages=stages))
    return replace(plan, pipelines=pipes) if changed else None


def grid_strategies(cm: CostModel) -> Iterator[Strategy]:
    W, blocks = cm.cluster.world_size, cm.num_blocks
    per_node = math.gcd(*(len(n.devices) for n in cm.cluster.nodes))
    for tp in (t for t in divisors(per_node) if t & (t - 1) == 0):
        for pp in divisors(blocks) if blocks else [1]:
            if W % (tp * pp) or cm.B % (W // (tp * pp)):
                continue
            dp = W // (tp * pp)
            share = cm.B // dp
            for mbs in (b for b in divisors(share) if b & (b - 1) == 0 or b == share):
                m = share // mbs
                scheds: list[tuple[str, int | None]] = [("1f1b", None)]
                if pp > 1 and m % pp == 0:
                    scheds += [("interleaved_1f1b", v) for v in GRID_CHUNKS if blocks % (pp * v) == 0]
                for (sched, v), zero, rc in itertools.product(scheds, (0, 1), (False, True)):
                    yield Strategy(dp=dp, tp=tp, pp=pp, microbatch_size=mbs, schedule=sched, zero=zero,
                                   recompute=rc, chunks=v)


def megatron_grid(cm: CostModel) -> tuple[Estimate | None, Strategy | None, int, int]:
    best: Estimate | None = None
    best_st = None
    priced = fit = 0
    for st in grid_strategies(cm):
        est = _try(cm, st)
        tries = [(est, st)]
        wire = compressed(cm, est.plan) if est is not None and st.pp > 1 else None
        if wire is not None:
            p = price(cm, wire)
            tries.append((Estimate(p.plan, p.fits, p.problems), replace(st, compress=cm.compress)))
        for e, s in tries:
            priced += e is not None
            fit += e is not None and e.fits
            if _faster(e, best):
                best, best_st = e, s
    return best, best_st, priced, fit
