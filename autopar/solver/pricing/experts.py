"""Pricing and choosing expert parallelism (MoE) for the planner.

MoE layers are found in the captured graph (`find_moe`): a layer with a `topk` router whose nodes read
parameters under an `experts` module. Supported layouts (what runtime/expert_parallel.py can spread over
ranks): autopar's `models.MoE` (`<m>.experts.<i>.fc/proj`) and Mixtral's stacked experts
(`<m>.experts.gate_up_proj`, `<m>.experts.down_proj`). Other MoE layers are priced replicated (ep = 1).

Compute. Every MoE layer is priced as a routed (sparse) implementation: each token runs top_k of the E
experts. autopar's own `models.MoE` computes densely (every expert sees every token, unselected ones get
gate 0, which keeps it exportable with static shapes), so its expert kernels in the graph are scaled by
top_k / E; Mixtral's `batched_mm` experts are already routed in the graph. So the data-parallel baseline
(ep = 1, experts replicated) is priced as a user's sparse MoE would run, not as the dense reference
module; under ep > 1 the runtime is genuinely sparse (it dispatches tokens). With ep > 1 the busiest
rank of an expert-parallel group gets IMBALANCE times the mean routed tokens (router load imbalance with
the usual balancing loss), and the backward recomputes the local experts' forward once (the runtime
keeps no received tokens between forward and backward). With tensor parallelism (tp > 1) and ep > 1 the
experts are not split over the tp group: each of its ranks runs its whole experts on all of the group's
(replicated) tokens, so routed expert compute and activations are not divided by tp.

Communication, per MoE layer and micro-batch of T tokens with hidden size H (bytes per element w, the
graph's activation dtype), over the expert-parallel group, i.e. the ranks at one tensor-parallel index of
ep consecutive replicas (`collective_time("all_to_all")`, so a group inside a node is priced on
NVLink-class links and one spanning nodes on the network; the tp indices run theirs side by side):
    forward   2 all-to-alls of T k H w   (dispatch, combine)
    backward  one of 2 T k H w (tokens re-sent with their output gradients) and one of T k H w.

Memory. A rank holds E / ep experts' weights, gradients and optimizer state, whole under any tp (they
count in `tp_extra`, the parameters per rank beyond params / tp); per in-flight micro-batch
the routed expert activations (dense graph activations scaled by top_k / E for autopar's MoE) plus the
dispatch buffers, send and receive, of T k H w each (times IMBALANCE with ep > 1).

ZeRO. A stage's N parameters per rank (pricing.py) include the X = Xp + Xs expert elements it holds (Xs in
Mixtral's stacked tensors, which the runtime leaves out of ZeRO: `expert_parallel.zero_levels`). The
experts a rank holds are held by only H = D / ep data-parallel ranks, its position in every chunk of ep
replicas (`holders`), so ZeRO partitions them over H, the rest of the stage over the D replicas:
    weights (zero 3), grads (zero >= 2), optimizer state (zero >= 1), and the optimizer step's N':
        (N - X) / D + Xp / H + Xs     per rank, i.e. N / D + `zero_extra`
    communication, by level z (`_zero_comm`: AR for zero 0, RS + AG for 1, AG for 2, none for 3 in the
    step's sync; AG in forward and backward for 3, RS in backward for >= 2):
        comm(N - X over the dp group, z) + comm(Xp over the H holders, z) + comm(Xs over the holders, 0)
`a2a_times` returns that minus the comm(N over the dp group, z) `stage_times` already counts.

The cost model. The degree and the MoE layers are one declared field of `CostModel`, `expert_parallel` (an
`ExpertParallel`), set when it is built (degree 1) and changed only by `with_degree`, which returns
`CostModel.with_expert_degree`'s copy; the hooks here (`adjust_base` in `CostModel.base`, `a2a_times` in
`CostModel.stage_times`, `zero_bytes` / `zero_extra` in `stage_memory`) read it and cache their prices in the
model's memo through `CostModel.memoised`.

Choice. The searcher runs once per candidate degree: ep = 1 and every ep > 1 dividing E and the world
size; a config (any tp) is admissible for ep > 1 when its replicas group into chunks of ep identical
pipelines (`config_ok`), which is what the runtime needs. The fastest predicted plan wins; its stages
may use any ZeRO level and offload (priced as above).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from ...cost_models.compute import kernel_flops
from ...errors import InfeasibleError, PlanError
from ...ir.graph import DTYPE_BYTES, TrainingGraph
from ..budget import WallGuard, loop_stopped

IMBALANCE = 1.1  # busiest expert rank's routed tokens / mean, with ep > 1
_OWN = re.compile(r"^(?P<m>.+)\.experts\.\d+\.(fc|proj)\.(weight|bias)$")
_MIXTRAL = re.compile(r"^(?P<m>.+)\.experts\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class MoELayer:
    layer: int  # index in the layer chain
    module: str  # the MoE module's path (parameter-name prefix)
    experts: int
    top_k: int
    hidden: int
    tokens: int  # tokens of the captured (global) batch
    elem_bytes: int
    dense: bool  # the graph runs every expert on every token (autopar's models.MoE)
    supported: bool  # runtime/expert_parallel.py can spread it
    params: int  # expert parameter elements
    saved: float  # bytes of the expert nodes' outputs in the graph (their activations)
    kernels_fwd: tuple  # ((kind, flops, bytes), count) of the expert nodes, as CostModel.kernels
    kernels_bwd: tuple

    @property
    def stacked(self) -> bool:
        """Mixtral's layout: all experts in (E, ...) tensors, which ZeRO leaves whole under ep."""
        return self.supported and not self.dense


def find_moe(graph: TrainingGraph) -> list[MoELayer]:
    """The MoE layers of a captured graph (module docstring)."""
    out = []
    by_layer: dict[int, list] = {}
    for n in graph.nodes.values():
        by_layer.setdefault(n.layer, []).append(n)
    for layer, nodes in sorted(by_layer.items()):
        topk = [n for n in nodes if n.target == "aten.topk.default"]
        experts = {graph.params[a].name.split(".experts")[0] for n in nodes for a in n.args
                   if a in graph.params and ".experts" in graph.params[a].name and not graph.params[a].is_buffer}
        if not topk or not experts:
            continue
        names = {graph.params[a].name for n in nodes for a in n.args if a in graph.params}
        for prefix in sorted(experts):
            mine = sorted(x for x in names if x.startswith(prefix + ".experts"))
            own = all(_OWN.match(x) for x in mine)
            supported = own or (all(_MIXTRAL.match(x) for x in mine) and len(mine) == 2)
            k_node = topk[0]
            k = k_node.outputs[0].shape[-1]
            E = graph.nodes[k_node.args[0]].outputs[0].shape[-1]
            tokens = k_node.outputs[0].numel // k
            infos = [i for i in graph.params.values() if i.name in mine]
            params = sum(i.meta.numel for i in infos)
            routers = [graph.params[a].meta.shape for n in nodes for a in n.args if a in graph.params
                       and ".experts" not in graph.params[a].name and graph.params[a].meta.shape[:1] == (E,)
                       and len(graph.params[a].meta.shape) == 2]
            hidden = routers[0][1] if routers else min(i.meta.shape[-1] for i in infos)
            ex_nodes = [n for n in nodes if "experts" in n.module.split(".")]
            fwd = Counter((k_.kind, kernel_flops(k_), k_.nbytes) for n in ex_nodes for k_ in n.kernels_fwd)
            bwd = Counter((k_.kind, kernel_flops(k_), k_.nbytes) for n in ex_nodes for k_ in n.kernels_bwd)
            saved = float(sum(o.nbytes for n in ex_nodes if not n.is_view for o in n.outputs))
            out.append(MoELayer(layer, prefix, E, k, hidden, tokens,
                                DTYPE_BYTES.get(k_node.outputs[0].dtype, 4), own, supported, params, saved,
                                tuple(sorted(fwd.items())), tuple(sorted(bwd.items()))))
    return out


# ---- the cost model at a degree ----------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertParallel:
    """What a cost model prices of expert parallelism (`CostModel.expert_parallel`): the degree ep and
    the graph's MoE layers by chain index (`find_moe`)."""

    degree: int
    layers: dict[int, MoELayer]

    @classmethod
    def of(cls, graph: TrainingGraph, degree: int = 1) -> ExpertParallel:
        return cls(degree, {m.layer: m for m in find_moe(graph)})


def moe_layers(cm: Any) -> dict[int, MoELayer]:
    """The cost model's MoE layers by chain index (found when it is built: `ExpertParallel.of`)."""
    return cm.expert_parallel.layers


def degree(cm: Any) -> int:
    return cm.expert_parallel.degree


def with_degree(cm: Any, ep: int) -> Any:
    """The cost model pricing expert degree `ep`: itself at its own degree, else its copy at `ep`
    (`CostModel.with_expert_degree`: a fresh memo, since costs depend on the degree)."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise PlanError(f"the expert-parallel degree must be a positive integer, got {ep!r}.")
    if ep == degree(cm):
        return cm
    return cm.with_expert_degree(ep)


def _expert_time(cm: Any, m: MoELayer, kernels: tuple, dtype: str, n: int, tp: int, routed: bool) -> float:
    scale = n / (cm.B * tp)
    if routed:
        scale *= (m.top_k / m.experts if m.dense else 1.0) * (IMBALANCE if degree(cm) > 1 else 1.0)
    op_time = cm.models[dtype].op_time
    return sum(c * op_time(kind, f * scale, b * scale) for (kind, f, b), c in kernels)


def _expert_times(cm: Any, m: MoELayer, dtype: str, n: int, tp: int, t_ex: int) -> tuple[float, float, float, float]:
    """(dense forward, routed forward, dense backward, routed backward) seconds of layer `m`'s experts: dense as
    the graph has them split tp ways, routed split `t_ex` ways."""
    return tuple(_expert_time(cm, m, ks, dtype, n, tp if not routed else t_ex, routed)  # type: ignore[return-value]
                 for ks in (m.kernels_fwd, m.kernels_bwd) for routed in (False, True))


def adjust_base(cm: Any, a: int, e: int, dtype: str, n: int, tp: int, base: Any) -> Any:
    """`CostModel.base` hook: routed expert compute, activations and dispatch buffers, and expert
    parameters divided by the degree, for the MoE layers in [a, e)."""
    layers = [m for i, m in moe_layers(cm).items() if a <= i < e]
    if not layers:
        return base
    ep = degree(cm)
    frac = n / cm.B
    fwd, bwd, rc, act, act_rc, params, biggest = (base.fwd, base.bwd, base.recompute, base.act,
                                                  base.act_recompute, base.params, base.max_layer_params)
    extra, tp_max = base.tp_extra, base.tp_max_layer
    a2a_bytes = held = stacked = 0.0
    saved: dict[int, float] = {}  # expert elements a rank does not hold, per layer
    count = 0
    for m in layers:
        ep_m = ep if m.supported else 1
        # with ep > 1 the experts are not split by tensor parallelism: each rank of a tp group runs its whole
        # experts on all of the group's (replicated) tokens
        t_ex = 1 if ep_m > 1 else tp
        dense_f, routed_f, dense_b, routed_b = cm.memoised(("moe", m.layer, dtype, n, tp),
                                                           partial(_expert_times, cm, m, dtype, n, tp, t_ex))
        fwd += routed_f - dense_f
        bwd += routed_b - dense_b + (routed_f if ep_m > 1 else 0.0)
        if cm.is_block[m.layer]:
            rc += routed_f - dense_f
        slots = m.tokens * frac * m.top_k * m.hidden * m.elem_bytes
        buffers = 2 * slots * (IMBALANCE if ep_m > 1 else 1.0)
        routed_act = m.saved * frac / t_ex * (m.top_k / m.experts if m.dense else 1.0)
        act += routed_act - m.saved * frac / tp + buffers
        act_rc += buffers if not cm.is_block[m.layer] else 0.0
        params -= m.params * (1 - 1 / ep_m)
        saved[m.layer] = saved.get(m.layer, 0.0) + m.params * (1 - 1 / ep_m)
        if ep_m > 1:
            held += m.params / ep_m
            stacked += m.params / ep_m if m.stacked else 0.0
            a2a_bytes += slots
            count += 1
            extra += m.params / ep_m * (1 - 1 / tp)  # per rank: params / tp + tp_extra counts them whole
            tp_max = max(tp_max, m.params / ep_m) if tp > 1 else tp_max
    if any(saved.values()):  # the largest layer as held: each layer less its own experts' savings
        biggest = max(cm.own_params[i] - saved.get(i, 0.0) for i in range(a, e))
        tp_max = biggest if tp == 1 else tp_max  # (with tp > 1: its share / tp, or its experts / ep, at most)
    return replace(base, fwd=fwd, bwd=bwd, recompute=rc, act=max(act, 0.0), act_recompute=act_rc,
                   params=int(params), max_layer_params=int(max(biggest, 1)), tp_extra=extra, tp_max_layer=tp_max,
                   moe_layers=count, moe_bytes=a2a_bytes / count if count else 0.0, expert_params=held,
                   expert_stacked=stacked,
                   # expert weights are matmul weights: those this rank does not hold are not cast here either
                   cast_params=max(0.0, base.cast_params - (base.params - params)))


def ep_group(cm: Any, tp_group: tuple[int, ...], dp_group: tuple[int, ...]) -> tuple[int, ...]:
    """The expert-parallel group of a stage: its chunk of ep consecutive replicas, at the tensor-parallel
    index of `dp_group` (index 0; the other indices run the same all-to-all on their own ranks at once)."""
    ep = degree(cm)
    i = dp_group.index(tp_group[0]) if tp_group[0] in dp_group else 0
    start = i - i % ep
    return dp_group[start:start + ep]


def holders(cm: Any, tp_group: tuple[int, ...], dp_group: tuple[int, ...]) -> tuple[int, ...]:
    """The ranks of `dp_group` holding the same experts as the stage's rank there: its position in every
    chunk of ep consecutive replicas (dp / ep of them)."""
    ep = degree(cm)
    i = dp_group.index(tp_group[0]) if tp_group[0] in dp_group else 0
    return dp_group[i % ep::ep]


def _zero_comm(cm: Any, n: float, group: tuple[int, ...], z: int) -> tuple[float, float, float]:
    """(forward, backward, sync) seconds of `stage_times`'s data-parallel collectives for n elements per
    rank over `group` at ZeRO level z (pricing.py's docstring)."""
    w, g = cm.state.weights, cm.state.grads
    if z == 0:
        return 0.0, 0.0, cm.collective("all_reduce", n * g, group)
    ag, rs = cm.collective("all_gather", n * w, group), cm.collective("reduce_scatter", n * g, group)
    gather = ag if z == 3 else 0.0
    return gather, gather + (rs if z >= 2 else 0.0), (0.0, rs + ag, ag, 0.0)[z]


def zero_extra(cm: Any, base: Any, dp: int) -> float:
    """Elements per rank of a ZeRO-partitioned state beyond the N / dp `stage_memory` counts: the experts
    are partitioned over their dp / ep holders only, stacked ones not at all (module docstring)."""
    held = max(1, dp // degree(cm))
    part = base.expert_params - base.expert_stacked
    return part * (1 / held - 1 / dp) + base.expert_stacked * (1 - 1 / dp)


def zero_bytes(cm: Any, base: Any, opt: Any, dp: int) -> float:
    """`CostModel.stage_memory` hook (zero >= 1): bytes per rank beyond its N / dp partitions."""
    s, z = cm.state, opt.zero
    on_host = "params" in opt.offload
    per = (0.0 if on_host else (s.weights if z == 3 else 0.0) + (s.grads if z >= 2 else 0.0)) \
        + (0.0 if "optimizer" in opt.offload else s.optimizer)
    return zero_extra(cm, base, dp) * per if per else 0.0


def a2a_times(cm: Any, base: Any, tp_group: tuple[int, ...], dp_group: tuple[int, ...], zero: int = 0
              ) -> tuple[float, float, float]:
    """`CostModel.stage_times` hook: (forward, backward) seconds of one micro-batch's all-to-alls, plus
    the ZeRO-3 gathers / ZeRO >= 2 reduce-scatters correction, and the correction to the step's sync:
    expert state is synced (and ZeRO-partitioned) among the dp / ep ranks holding the same experts, the
    rest over the whole data-parallel group (module docstring, "ZeRO")."""
    if not base.moe_layers or degree(cm) == 1:
        return 0.0, 0.0, 0.0
    group, hold = ep_group(cm, tp_group, dp_group), holders(cm, tp_group, dp_group)
    n = base.params / len(tp_group) + base.tp_extra  # per rank, as stage_times counts it; experts whole
    ne, ns = base.expert_params, base.expert_stacked
    key = ("ep", base.moe_layers, base.moe_bytes, n, ne, ns, zero, cm.group_sig(group), cm.group_sig(dp_group),
           cm.group_sig(hold))

    def times() -> tuple[float, float, float]:
        one = cm.collective("all_to_all", base.moe_bytes, group)
        two = cm.collective("all_to_all", 2 * base.moe_bytes, group)
        parts = (_zero_comm(cm, n - ne, dp_group, zero),) + (
            (_zero_comm(cm, ne, hold, 0),) if zero == 0 else (_zero_comm(cm, ne - ns, hold, zero),
                                                             _zero_comm(cm, ns, hold, 0)))
        counted = _zero_comm(cm, n, dp_group, zero)
        f, b, s = (sum(p[k] for p in parts) - counted[k] for k in range(3))
        return base.moe_layers * 2 * one + f, base.moe_layers * (two + one) + b, s

    return cm.memoised(key, times)


# ---- choosing the degree ----------------------------------------------------------------------------


def candidates(cm: Any) -> list[int]:
    """ep = 1 and the degrees > 1 dividing every supported layer's expert count and the world size."""
    layers = [m for m in moe_layers(cm).values() if m.supported]
    if not layers:
        return [1]
    g = 0
    for m in layers:
        g = math.gcd(g, m.experts)
    return [d for d in range(1, g + 1) if g % d == 0 and cm.cluster.world_size % d == 0]


def config_ok(cm: Any, tp: int, pipelines: tuple[tuple[tuple[int, ...], ...], ...]) -> bool:
    """Whether a search config can run expert degree `degree(cm)`: chunks of ep consecutive replicas on
    identical device types (so they get identical pipelines). Any tp: a config's tp groups all have tp
    ranks, and the tp ranks at one index across a chunk's replicas form the expert-parallel groups."""
    ep = degree(cm)
    if ep == 1:
        return True
    if len(pipelines) % ep:
        return False
    types = [tuple(cm.cluster.devices[u[0]].spec.name for u in p) for p in pipelines]
    return all(len(set(types[c:c + ep])) == 1 for c in range(0, len(types), ep))


def describe(cm: Any, plan: Any) -> dict | None:
    """The plan's `experts` entry (plain JSON); PlanError when the plan cannot run degree `degree(cm)`."""
    layers = moe_layers(cm)
    if not layers:
        if degree(cm) > 1:
            raise PlanError(f"expert parallelism (ep={degree(cm)}) was asked for, but the model has no MoE "
                            f"layer (a top-k router over an `experts` module).")
        return None
    ep = degree(cm)
    supported = [m for m in layers.values() if m.supported]
    groups: list[list[int]] = []
    if ep > 1:
        if not supported:
            raise PlanError(f"ep={ep}: none of the model's MoE layers ({[m.module for m in layers.values()]}) "
                            f"is one the runtime can spread (autopar.models.MoE, Mixtral); use ep=1.")
        bad = [m.module for m in supported if m.experts % ep]
        if bad:
            raise PlanError(f"ep={ep} does not divide the expert count of {bad}; choose one of {candidates(cm)}.")
        pipes = plan.pipelines
        if len(pipes) % ep:
            raise PlanError(f"ep={ep} must divide the number of data-parallel replicas ({len(pipes)}).")
        for c in range(0, len(pipes), ep):
            chunk = pipes[c:c + ep]
            shape = {(tuple(tuple(s.layers) for s in p.stages), p.num_microbatches,
                      tuple(s.recompute for s in p.stages), tuple(len(s.devices) for s in p.stages)) for p in chunk}
            if len(shape) > 1:
                raise PlanError(f"ep={ep}: replicas {list(range(c, c + ep))} must run identical pipelines "
                                f"(stage bounds, micro-batches, recompute, tp per stage).")
            # one group per stage and tensor-parallel index: the ranks at that index in the chunk's replicas
            groups += [[p.stages[s].devices[t] for p in chunk] for s in range(len(chunk[0].stages) // plan.chunks)
                       for t in range(len(chunk[0].stages[s].devices))]
    first = supported[0] if supported else next(iter(layers.values()))
    return {"degree": ep, "groups": groups, "layers": [m.layer for m in supported],
            "modules": [m.module for m in supported], "experts": first.experts, "top_k": first.top_k,
            "experts_per_rank": first.experts // ep, "imbalance": IMBALANCE if ep > 1 else 1.0,
            "replicated": [m.module for m in layers.values() if not m.supported or ep == 1]}


def for_plan(cm: Any, plan: Any) -> Any:
    """The cost model at the plan's expert degree (unchanged for a plan without an `experts` entry yet:
    the searcher's own candidates, priced at the degree being searched)."""
    return cm if plan.experts is None else with_degree(cm, int(plan.experts.get("degree", 1)))


def checked(cm: Any, plan: Any) -> Any:
    """The cost model at the plan's expert degree, after checking the plan can run it (`describe`)."""
    out = for_plan(cm, plan)
    if plan.experts is not None and degree(out) > 1:
        describe(out, plan)
    return out


def choose(cm: Any, run: Callable[[Any, float], Any], time_limit_s: float) -> Any:
    """Run the search (`run(cost model, seconds)`) once per candidate degree; the fastest plan wins.

    Degrees > 1 go first (their configs are few); each search runs on its work budget, the time left of
    `time_limit_s` only its guard (solver/budget.py), and the loop stops, warning, once the guard has passed."""
    cands = candidates(cm)
    if len(cands) == 1 and not moe_layers(cm):
        return run(cm, time_limit_s)
    guard = WallGuard(time_limit_s)  # each degree's search gets the time left of it, not a share (budget.py)
    best, error = None, None
    order = sorted(cands, reverse=True)
    for k, ep in enumerate(order):
        if best is not None and guard.passed():
            loop_stopped(guard, k, len(order), "expert-parallel degrees")
            break
        c = with_degree(cm, ep)
        try:
            plan = run(c, guard.left())
            plan.experts = describe(c, plan)
        except (InfeasibleError, PlanError) as e:
            error = error or e
            continue
        if best is None or plan.predicted["step_time_s"] < best.predicted["step_time_s"]:
            best = plan
    if best is None:
        raise error or InfeasibleError("no plan fits at any expert-parallel degree.")
    return best


__all__ = ["IMBALANCE", "ExpertParallel", "MoELayer", "a2a_times", "adjust_base", "candidates", "checked", "choose",
           "config_ok", "describe", "find_moe", "for_plan", "holders", "with_degree", "zero_bytes", "zero_extra"]
