"""Price one concrete configuration: per-stage times and per-device memory, then simulate the step.

Units: seconds and bytes. ``B`` is the captured global batch, ``n`` a micro-batch's samples, ``t`` the
stage's tensor-parallel degree, ``D`` its data-parallel degree (the number of pipelines), ``w, g, o`` the
bytes per parameter of weights, gradients and optimizer state (`state_bytes_per_param`), ``N`` the
stage's parameters per tensor-parallel rank (shared parameters, like tied embeddings, count on every
stage that uses them).

Per micro-batch, stage [a, e) on device type T (`tp_layer_cost`, summed by `CostModel.base`):

    compute      layer kernels re-priced at n/(B t) of the captured batch (FLOPs and bytes scaled), so
                 small micro-batches pay launch overhead and lower efficiency; at n = B, t = 1 this is
                 the annotated layer time
    tensor par.  t > 1, a repeated block: the intra-op ILP's optimum at micro-batch n
                 (`intra_op.pricing.LayerPricer`, one solve per block class, device type, tp group and n):
                 its per-op strategies' compute (kernels split by their sharding) and collectives, its
                 parameter share per rank (N counts it) and its saved activations per rank (replicated
                 tensors, e.g. layernorm inputs, count whole); `StageBase.tp_source` = "ilp". The ILP is
                 restricted to what the DTensor runtime runs, and its parameter placements become
                 `Stage.sharding` (`stage_sharding`; intra_op/pricing.py's docstring).
                 Else (the layers around the blocks, or no ILP solution in time): Megatron's closed form,
                 compute / t, 2 all-reduces of the block's output activation in forward and 2 in backward
                 (1 + 1 for the layers before/after the blocks), parameters and activations / t

host_f / host_b: host/framework seconds per micro-batch (kernel launches, views, module calls, autograd nodes,
the micro-batch's setup; cost_models/overhead.py), host_f paid again by recomputed blocks; sync adds the optimizer
step's host time. On a device that runs asynchronously to its host (a GPU) `compute_f + host_f` below stands for
the larger of the kernels' device time and host_f (`overhead.floored`: the host-bound floor); on a CPU for their sum.

`stage_times` adds the per-stage option costs (AR/RS/AG = all-reduce/reduce-scatter/all-gather over
the stage's data-parallel group, h2d(x) = host-link latency + x / bandwidth):

    fwd  = compute_f + tp_f + host_f + [zero 3] AG(N w) + [offload params] h2d(N w) + [offload act.] h2d(act)
    bwd  = compute_b + tp_b + host_b + [recompute] (compute_f + tp_f + host_f of the k recomputed blocks: the
           stage's first k, all of them with recompute=True; `stage_memory.recomputed`) + [zero 3] AG(N w)
           + [zero >= 2] RS(N g) + [offload params] h2d(N w) + h2d(N g) + [offload act.] h2d(act)
    sync = AR(N g) | RS(N g) + AG(N w) | AG(N w) | 0          for zero 0 | 1 | 2 | 3  (per step)
           + optimizer step: 2 (w + g + o) N' / memory bandwidth, or with the optimizer offloaded
           h2d(N' g) + h2d(N' w) + 2 (w + g + o) N' / HOST_UPDATE_BANDWIDTH (the host CPU's update, bound by
           its memory bandwidth as ZeRO-Offload's CPU Adam is); N' = N / D for zero >= 1
           + [parameters several stages hold, e.g. tied embeddings] AR(E g) over every copy (all holding
           stages of all replicas) - AR(E g) over D, E their elements per rank (`tied_sync`, added by `price`
           and `split.Splitter.values`: it needs the whole pipeline)
    send = latency + bytes / bandwidth to the next stage, the same for the gradient sent back; compressed
           (`Stage.compress`): 2-byte elements on the wire plus a cast on each end (read + write of the
           elements at the device's memory bandwidth)

Compressed sends (`CostModel.compress_choice`): only when the user allows them (`plan(..., compress="bf16")`,
`CostModel.compress`: compression rounds what the stages exchange, so it is never chosen unasked), a stage
boundary is sent in that dtype (bf16: fp32's exponent range, so gradients neither overflow nor flush to zero;
relative rounding error <= 2^-9 per element and transfer; fp16: 2^-11, a narrower range) when (1) the plan
trains in fp32/tf32 (in bf16/fp16 mixed precision the activations
already travel in 2 bytes), (2) the link is slow (<= 10 Gb/s, SLOW_LINK_BYTES_PER_S: on faster links the
saving is too small to be worth the numerical change) and (3) the cast-inclusive send is faster. The search
plans every eligible boundary compressed (the simulated step only grows with a send time) and
`search.Search.run` drops compression from the final plan unless it shortens the predicted step.

`stage_memory` (per device): solver/pricing/stage_memory.py's docstring.

Expert parallelism (ep > 1, solver/pricing/experts.py): of N, the X expert elements a device holds have only
H = D / ep holders (its position in every chunk of ep replicas). X = Xp + Xs, Xs those in stacked (E, ...)
tensors (Mixtral), which the runtime keeps out of ZeRO. So ZeRO-partitioned state (the N / D above, and N'
of the optimizer step) is (N - X) / D + Xp / H + Xs per device, and every AR/RS/AG(N) above is
AR/RS/AG(N - X) over the dp group + AR/RS/AG(Xp) over the H holders + AR(Xs g) over them in sync.

Context parallelism (cp > 1, solver/pricing/context.py; bytes in cost_models/context.py): a stage's devices are cp
tensor-parallel groups of t; cp rank c computes the stage on T / cp tokens of each of the micro-batch's n samples.
With blk = n (Hkv / t) (T / cp) D x itemsize, one K or V block of an attention call (compute dtype), and c_f, c_b
one ring block's computation (the call's kernels at 1/cp of the rank's FLOPs), per micro-batch:

    compute      every layer at n / cp samples' worth of tokens (kernels at n / (B t cp)); t > 1: Megatron's
                 closed form on T / cp tokens (all-reduces of 1/cp of the bytes), not the ILP
    ring         per attention call: the call's kernels priced as cp blocks (cp c_f forward, cp c_b backward) and
                 the exposed exchange, x(b) = the slowest p2p link between cp neighbours for b bytes (the t
                 tensor-parallel indices sending at once):
                     forward   (cp - 1) max(0, x(2 blk) - c_f)
                     backward  (cp - 1) max(0, x(4 blk) - c_b) + x(2 blk)          (the dK/dV sent home)
                 bytes sent per call: forward (cp - 1) 2 blk, backward (cp - 1) 4 blk + 2 blk (`cp_exchange_bytes`)
    ulysses      the call unchanged (all T tokens, 1/cp of the heads) + all-to-alls over the cp ranks at one
                 tensor-parallel index: forward A(q + k + v) + A(out), backward A(out) + A(q + k + v)
    act          saved activations x n / (B cp t), + per ring call the fp32 log-sum-exp (and output) the captured
                 attention does not already save; work + the largest in-flight exchange of one call (ring: 4 blk
                 forward, 8 blk backward with the dK/dV accumulators; Ulysses: the all-to-all buffers)
    send         the boundary's T / cp tokens, each cp rank to its own peer
    sync         a parameter's replicas are its dp x cp holders: D above (and ZeRO's partitions) = dp x cp, the
                 stage's data-parallel group being the first device of every cp rank's tensor-parallel group
                 of every replica; ZeRO-2/3 run per layer as for dp x cp pipelines at tensor-parallel degree t

`predicted["cp"]` holds the degree, the mode and the exchange (per call, per ring step against c_f / c_b, per step);
each stage's predictions its calls, `cp_exchange_bytes` (per full micro-batch and rank) and `cp_exchange_s` (exposed).

The in-flight count per device is `schedule.peak_inflight` (for interleaved schedules, the most
micro-batch chunks held at once times the largest chunk's activations). A device fits when its peak is
at most (1 - memory_reserve) of its capacity.

Host memory (`StageMemory.host`, `host_act`; per device, what runtime/zero.py keeps in CPU memory;
host peak = host + in-flight x host_act, `rank_host`):

    optimizer offload   N' (4 + 4 + m): the optimizer runs over fp32 CPU copies of the owned parameters
                        (4 B), with an fp32 CPU copy of their gradients (4 B) and its moments (m =
                        OPTIMIZER_STATE_BYTES, 8 for Adam/AdamW), in any precision
    params offload      K w, K the parameters whose value the device keeps between steps (N' under
                        ZeRO-3, else N), less N' w when the optimizer is offloaded too (the owned ones'
                        fp32 copy serves); plus (N - N') 4 under ZeRO-1/2: the parameters it does not
                        own are streamed per layer and accumulate fp32 gradients on the host
                        (runtime/zero_layers.py; counted for all, also those read by several layers)
    activations offload in-flight x act: save_on_cpu moves every in-flight micro-batch's saved tensors
    with N' = N / D (+ the expert terms above) for zero >= 1, else N (`pricing.plan.offload_host_bytes`)

A node's host memory (`Node.host_memory`, cluster file `host_memory_GiB`, defaults in host_memory.py) holds
the sum over its devices: it fits when that is at most (1 - memory_reserve) of it (`price`). The search
gives each device an even share of its node's usable host memory (`CostModel.host_budget`), which is
sufficient for the node. On unified-memory devices (Jetson boards, the `cpu` device: the host's memory is
theirs) what a device offloads also counts in its own peak: offloading there saves nothing. The `cpu` device's
peak is that of its one allocator as the runtime fills it (`rank_shared`: the offloaded optimizer's gradient
copies exist from its step on, when the device's gradients and activations are gone, and its CPU optimizer adds
its buffers); a Jetson computes on CUDA, whose caching allocator keeps the blocks the step frees, so there the
device peak and the host bytes add up. `predicted["host_overlap_bytes"]` is, per device, what a rank computing
it on the CPU holds beyond its peak (`rank_shared` less the peak: an accelerator's stages on a machine without
CUDA hold their host share in the same allocator; runtime/plan_check.py adds it).

Where it is: this module prices a whole plan (`price` -> `Priced`, `price_strategy` for `autopar.estimate`,
`stage_option`, `model_summary`). The formulas above are computed by `CostModel` in pricing/model.py (with
its types `Option`, `StageBase`, `StageTimes` and `inflight_closed_form`), whose parts are pricing/comm.py
(collectives and sends), intra_op/pricing.py (tensor parallelism), stage_memory.py (memory), experts.py
(expert parallelism), context.py (context parallelism) and wgrad.py; the plan-level pieces (`check_plan`,
`lower_bound`, `rank_peak`, `rank_host`, `tied_sync`, memory problems) are pricing/plan.py. Every name callers
read here is re-exported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ...cluster import Cluster
from ...errors import PlanError
from ...ir.graph import TrainingGraph
from ...ir.plan import (
    OFFLOAD_KINDS,
    Estimate,
    Pipeline,
    Plan,
    Stage,
    Strategy,
    layerwise_stages,
    plan_from_strategy,
    recompute_count,
)
from ...ir.plan_simulate import cached_schedule
from ...ir.schedule import SPLIT_SCHEDULES
from ..intra_op.pricing import stage_sharding, tp_layer_cost, tp_reason
from ..search.objective import cost_figures, idle_devices
from . import context, experts
from .comm import boundary_copies
from .model import HOST_UPDATE_BANDWIDTH, CostModel, Option, StageBase, StageTimes, inflight_closed_form
from .plan import (
    ACT_BYTES,
    SLOW_LINK_BYTES_PER_S,
    WIRE_BYTES,
    check_plan,
    host_problem,
    idle_split,
    lower_bound,
    memory_problem,
    rank_host,
    rank_peak,
    rank_peak_ordered,
    rank_shared,
    settled_work,
    tied_sync,
)
from .stage_memory import StageMemory, bucketed_gradients, recomputed, runtime_note
from .wgrad import wgrad_share, zero_bubble_backward


@dataclass
class Priced:
    """A plan with its predictions filled in, and whether every device fits."""

    plan: Plan
    fits: bool
    problems: list[str]
    lower_bound: float  # `lower_bound` of its slowest pipeline: the step cannot be shorter


def model_summary(graph: TrainingGraph) -> dict:
    return {"name": graph.model_name, "num_layers": len(graph.layers), "params": graph.num_params(),
            "blocks": sum(layer.kind == "block" for layer in graph.layers),
            "layer_names": [layer.name for layer in graph.layers]}


def stage_option(stage: Stage, cm: CostModel | None = None) -> Option:
    """The stage's options; with `cm`, its recompute as the number of blocks it recomputes (so that True and
    an integer naming the same blocks are one option, and True and 1 on a stage of several blocks are not)."""
    rc = stage.recompute
    if cm is not None:
        rc = recompute_count(rc, sum(cm.is_block[stage.layers[0]:stage.layers[1]]))
    return Option(stage.zero, rc, tuple(k for k in OFFLOAD_KINDS if k in stage.offload))


def _stage_values(cm: CostModel, pipe: Pipeline, dp_groups: list[tuple[int, ...]], layerwise: set[int],
                  mixed_tp: set[int] = frozenset(), split: bool = False
                  ) -> tuple[list[dict], list[tuple], list[StageMemory]]:
    """Per stage of one pipeline: its predictions, the (fwd, fwd_small, bwd, bwd_small, send, sync) times
    for `lower_bound`, and its memory (`layerwise`: the stage indices whose ZeRO runs per layer; `mixed_tp`:
    those whose data-parallel peers differ in tensor-parallel degree, `CostModel.stage_times`)."""
    devices = cm.cluster.devices
    sizes, full = pipe.microbatch_sizes(), pipe.microbatch_size
    n_small = sum(s != full for s in sizes)
    preds, vals, mems = [], [], []
    tied = tied_sync(cm, [(st.layers[0], st.layers[1], tuple(st.devices), dp_groups[j])
                          for j, st in enumerate(pipe.stages)])
    for j, st in enumerate(pipe.stages):
        dtype = devices[st.devices[0]].spec.name
        tp_group, dp_group = tuple(st.devices), dp_groups[j]
        opt = stage_option(st, cm)
        base = cm.base(st.layers[0], st.layers[1], dtype, full, tp_group)
        tf = cm.stage_times(base, opt, dtype, tp_group, dp_group, layerwise=j in layerwise, mixed_tp=j in mixed_tp)
        ts = cm.stage_times(cm.base(st.layers[0], st.layers[1], dtype, full - 1, tp_group), opt, dtype,
                            tp_group, dp_group, layerwise=j in layerwise, mixed_tp=j in mixed_tp) \
            if n_small else StageTimes(0.0, 0.0, 0.0, tf.sync)
        send = (cm.send_time(base.out_bytes, st.devices[0], pipe.stages[j + 1].devices[0], st.compress)
                * boundary_copies(tp_group, tuple(pipe.stages[j + 1].devices)) if j + 1 < len(pipe.stages) else 0.0)
        sync = tf.sync + tied[j]
        # under a zero-bubble schedule (`split`) B and W each recompute (wgrad.zero_bubble_backward)
        bwd, bwd_w = (zero_bubble_backward(cm, st.layers[0], st.layers[1], dtype, tf.bwd,
                                           recomputed(base, opt.recompute)[0], j == 0) if split
                      else (tf.bwd, wgrad_share(cm, st.layers[0], st.layers[1], dtype) * tf.bwd))
        bwd_small = ts.bwd if not (split and n_small) else zero_bubble_backward(
            cm, st.layers[0], st.layers[1], dtype, ts.bwd,
            recomputed(cm.base(st.layers[0], st.layers[1], dtype, full - 1, tp_group), opt.recompute)[0], j == 0)[0]
        vals.append((tf.fwd, ts.fwd, bwd, bwd_small, send, sync))  # (lower_bound reads the first six)
        mems.append(cm.stage_memory(base, opt, len(tp_group), len(dp_group), j in layerwise))
        m_full = len(sizes) - n_small
        preds.append({"fwd_s": tf.fwd, "bwd_s": bwd, "fwd_small_s": ts.fwd, "bwd_small_s": bwd_small,
                      "send_s": send, "sync_s": sync, "tp_source": base.tp_source,
                      "tp_reason": tp_reason(cm, st.layers[0], st.layers[1], dtype, full, tp_group)
                      if st.cp == 1 else _cp_tp_reason(cm, st),
                      # which layers' compute the block profile measured (`plan(..., profile=)`), "" for none
                      "compute_source": cm.compute_source(st.layers[0], st.layers[1], dtype, full, len(tp_group)),
                      "gather_s": tf.gather, "reduce_s": tf.reduce,
                      # the weight-gradient part of bwd_s: a zero-bubble schedule's W (solver/pricing/wgrad.py)
                      "bwd_w_s": bwd_w,
                      "compute_s": m_full * (tf.fwd + bwd - tf.comm)
                      + n_small * (ts.fwd + bwd_small - ts.comm),
                      "comm_s": m_full * tf.comm + n_small * ts.comm + sync
                      + len(sizes) * (send + (vals[j - 1][4] if j else 0.0)),
                      **context.stage_predictions(cm, base)})
    return preds, vals, mems


def _cp_tp_reason(cm: CostModel, st: Stage) -> str:
    """A cp > 1 stage's `tp_reason`: its tensor parallelism is Megatron's closed form (context.py)."""
    if st.tp < 2 or not any(cm.is_block[st.layers[0]:st.layers[1]]):
        return ""
    return (f"Megatron's closed form: with context parallelism (cp={st.cp}) the blocks run Megatron's placements "
            f"on T/{st.cp} tokens")


def peak_parts(mems: list[StageMemory], need: float, peak: int) -> dict[str, int]:
    """A device's predicted peak (`peak` bytes; `need` of them its own device tensors, the rest what a unified
    device holds of its host share) by part: the parameters, gradients and optimizer state its stages keep, the
    rest of their static bytes (prefetched layers, gradients in flight, other modes' extra state) as buffers, and
    what the peak adds on top: in-flight activations with the recompute workspace and transient buffers
    ("activations"), and the host share. The parts sum to `peak`."""
    params, grads, optim = (math.ceil(sum(getattr(m, k) for m in mems)) for k in ("params", "grads", "optim"))
    static = math.ceil(sum(m.static for m in mems))
    out = {"parameters": params, "gradients": grads, "optimizer state": optim,
           "buffers": max(0, static - params - grads - optim)}
    out["activations"] = max(0, math.ceil(need) - sum(out.values()))
    host = peak - sum(out.values())
    if host > 0:
        out["host share"] = host
    elif host < 0:  # rounding, or a peak the allocator model puts below the parts' sum: the activations give way
        out["activations"] = max(0, out["activations"] + host)
    return {k: v for k, v in out.items() if v}


def price(cm: CostModel, plan: Plan, idle_reasons: dict[int, str] | None = None) -> Priced:
    """Fill in `plan`'s predictions: stage times, per-device peak memory, the simulated step.

    Raises PlanError when the plan is inconsistent (`check_plan`); a plan that does not fit is priced
    anyway, with `fits` False and the `problems` spelled out. Devices the plan leaves out are idle:
    `predicted["idle_devices"]` maps each to why (`idle_reasons` from the caller, else the reason the plan
    already carries, else `objective.idle_devices`' default). With prices in the cluster file it also
    predicts `cost_per_hour` and `cost_per_sample` (solver/search/objective.py)."""
    check_plan(cm, plan)
    reasons = {**{int(d): r for d, r in (plan.predicted.get("idle_devices") or {}).items()}, **(idle_reasons or {})}
    cm = context.for_plan(experts.checked(cm, plan), plan)
    devices = cm.cluster.devices
    pipes: list[Pipeline] = []
    peak: dict[int, int] = {}
    parts: dict[int, dict[str, int]] = {}  # device -> its peak by part (`peak_parts`)
    host: dict[int, float] = {}  # device -> host bytes it fills
    overlap: dict[int, int] = {}  # device -> what its host share adds in one CPU allocator
    problems: list[str] = []
    bound = 0.0
    # a stage's data-parallel group: the first device of every tensor-parallel group holding its parameters (at
    # cp > 1 each cp rank's: dp x cp replicas, context.py)
    dp_groups = [tuple(g[0] for p in plan.pipelines if j < len(p.stages) for g in p.stages[j].cp_groups())
                 for j in range(max(len(p.stages) for p in plan.pipelines))]
    # which stages' ZeRO runs per layer: the same stages in every pipeline, or none (plan.layerwise_stages; the
    # runtime lowers each cp rank of a pipeline as a pipeline of its own)
    layerwise = {j for _, j in layerwise_stages([(p.num_microbatches, [(tuple(st.layers), st.tp) for st in p.stages])
                                                 for p in plan.pipelines for _ in range(p.stages[0].cp)])
                 if plan.schedule not in SPLIT_SCHEDULES}  # zero-bubble: whole-step ZeRO (lowering.lower)
    # stages whose data-parallel peers run at different tensor-parallel degrees (a tp per pipeline class)
    mixed_tp = {j for j in range(len(dp_groups))
                if len({len(p.stages[j].devices) for p in plan.pipelines if j < len(p.stages)}) > 1}
    bucketed = bucketed_gradients(cm, plan)
    comms = cm.communicators(plan)  # NCCL buffers per device: its groups and pipeline peers
    seen: dict[tuple, tuple[list[dict], list[tuple], list[StageMemory]]] = {}
    for i, pipe in enumerate(plan.pipelines):
        ranks = len(pipe.stages) // plan.chunks
        # replicas that differ only in which (equivalent) devices they use are priced once
        key = (pipe.batch_share, pipe.num_microbatches, tuple(
            (tuple(st.layers), devices[st.devices[0]].spec.name, cm.group_sig(tuple(st.devices)),
             cm.group_sig(dp_groups[j]), stage_option(st, cm), st.compress,
             cm.group_sig((st.devices[0], pipe.stages[j + 1].devices[0])) if j + 1 < len(pipe.stages) else -1)
            for j, st in enumerate(pipe.stages)))
        if key not in seen:
            seen[key] = _stage_values(cm, pipe, dp_groups, layerwise, mixed_tp, plan.schedule in SPLIT_SCHEDULES)
        preds, vals, mems = seen[key]
        stages = [replace(st, offload=list(stage_option(st).offload), predicted=dict(pr),
                          sharding=stage_sharding(cm, st.layers[0], st.layers[1], devices[st.devices[0]].spec.name,
                                                  pipe.microbatch_size, tuple(st.devices)) if st.cp == 1 else None)
                  for st, pr in zip(pipe.stages, preds, strict=True)]
        sizes = pipe.microbatch_sizes()
        inflight = cm.peak_inflight(plan.schedule, ranks, pipe.num_microbatches, plan.chunks)
        # bucketed: no reduction buckets (the step's own buffers), and every backward accumulates into the
        # buckets' views; otherwise only a backward that finds its `.grad` does (`settled_work`)
        mems = [replace(m, sync=m.step, accumulates=True) if bucketed else replace(m, accumulates=False)
                for m in mems]
        ordered = plan.chunks > 1 and not any(m.offload_act for m in mems)
        order = cached_schedule(plan.schedule, ranks, pipe.num_microbatches, plan.chunks) if ordered else None
        for r in range(ranks):
            need = rank_peak_ordered(mems[r::ranks], order.actions[r], ranks, plan.schedule in SPLIT_SCHEDULES) \
                if order is not None else rank_peak(mems[r::ranks], inflight[r], pipe.num_microbatches)
            on_host = rank_host(mems[r::ranks], inflight[r])
            one = rank_shared(mems[r::ranks], inflight[r], need)  # device and host share in one CPU allocator
            for d in pipe.stages[r].devices:
                host[d] = on_host
                # on unified devices what they offload stays in their memory: the cpu device's allocator holds
                # it as `rank_shared` walks it; an edge board computes on CUDA, whose caching allocator keeps
                # the blocks the step frees, so the two add up
                total = (one if cm.host_allocator(d) else need + on_host) if cm.unified(d) else need
                peak[d] = math.ceil(total)
                parts[d] = peak_parts(mems[r::ranks], need, peak[d])
                overlap[d] = math.ceil(one) - peak[d]
                if total > cm.usable(d, comms.get(d)):
                    problems.append(memory_problem(cm, d, i, r, total, mems[r::ranks], inflight[r], total - need,
                                                   comms.get(d)) + runtime_note(cm, d, comms.get(d)))
        bound = max(bound, lower_bound(vals, sizes, ranks, plan.schedule in SPLIT_SCHEDULES))
        pipes.append(replace(pipe, stages=stages))
    node_host = [sum(host.get(d, 0.0) for d in node.devices) for node in cm.cluster.nodes]
    problems += [host_problem(cm, k, need, host) for k, need in enumerate(node_host) if need > cm.host_usable(k)]
    out = replace(plan, pipelines=pipes)
    results = out.simulate()
    step = max(r.step_time for r in results)
    idle: tuple[list[float], list[float], list[float]] = ([], [], [])  # per device rank: bubble, sync, wait
    for pipe, res in zip(pipes, results, strict=True):
        ranks = len(pipe.stages) // plan.chunks
        bubble, tail, wait = idle_split(res, ranks, step)
        for j, st in enumerate(pipe.stages):
            st.predicted["bubble_s"] = bubble[j % ranks]
        for acc, per_rank in zip(idle, (bubble, [tail] * ranks, [wait] * ranks), strict=True):
            acc.extend(per_rank)
    flops = sum(layer.flops_fwd + layer.flops_bwd for layer in cm.graph.layers)
    peak_flops = sum(devices[d].spec.flops(cm.precision) for d in peak)
    out.predicted = {
        "step_time_s": step, "samples_per_s": cm.B / step,
        "tflops_per_device": flops / step / len(peak) / 1e12, "mfu": flops / step / peak_flops,
        "bubble_fraction": sum(idle[0]) / len(idle[0]) / step,
        "exposed_sync_fraction": sum(idle[1]) / len(idle[1]) / step,
        "replica_wait_fraction": sum(idle[2]) / len(idle[2]) / step,
        "fits": not problems, "memory_problems": list(problems),
        "peak_memory_bytes": dict(sorted(peak.items())),
        "peak_memory_parts_bytes": dict(sorted(parts.items())),
        # per device: what a rank computing it on the CPU holds beyond its peak, its host share being in the
        # same allocator (`rank_shared`; 0 on the cpu device, whose peak includes it; runtime/plan_check.py)
        "host_overlap_bytes": dict(sorted(overlap.items())),
        "memory_capacity_bytes": {d: devices[d].spec.memory for d in sorted(peak)},
        # per node (cluster order): bytes its devices offload to host memory, and its host memory
        "host_memory_bytes": [math.ceil(x) for x in node_host],
        "host_capacity_bytes": [node.host_memory for node in cm.cluster.nodes],
        "idle_devices": idle_devices(cm.cluster, out, reasons),
        **cost_figures(cm.cluster, sorted(peak), cm.B / step),
    }
    cp = context.plan_prediction(cm, out)  # context parallelism: its degree, mode and exchange (context.py)
    if cp is not None:
        out.predicted["cp"] = cp
    return Priced(out, not problems, problems, bound)


def price_strategy(cm: CostModel, strategy: Strategy) -> Estimate:
    """`autopar.estimate` on an existing cost model."""
    skeleton = plan_from_strategy(
        strategy, world_size=cm.cluster.world_size, global_batch=cm.B, num_layers=cm.L,
        first_block=cm.first_block if cm.num_blocks else cm.L, num_blocks=cm.num_blocks,
        precision=cm.precision, optimizer=cm.optimizer, cluster=cm.cluster.to_dict(),
        model=model_summary(cm.graph), memory_reserve=cm.reserve)
    skeleton.experts = experts.describe(experts.with_degree(cm, strategy.ep), skeleton)
    priced = price(cm, skeleton)
    return Estimate(priced.plan, priced.fits, priced.problems)


def price_plan(cm: CostModel, plan: Plan) -> Estimate:
    """`autopar.estimate` of a Plan: its layout, shares and stage options priced afresh on this cost model, its
    own predictions dropped (the reasons it gives for idle devices kept). PlanError when it does not match the
    cost model's cluster, precision or optimizer, naming which."""
    types = [d.spec.name for d in Cluster.load(plan.cluster).devices]
    for what, mine, theirs in (("devices", [d.spec.name for d in cm.cluster.devices], types),
                               ("precision", cm.precision, plan.precision),
                               ("optimizer", cm.optimizer, plan.optimizer)):
        if mine != theirs:
            raise PlanError(f"the plan was made for {what} {theirs!r} but is estimated with {mine!r}: pass the plan's "
                            f"cluster, precision and optimizer (Plan.cluster, .precision, .optimizer).")
    idle = {int(d): r for d, r in (plan.predicted.get("idle_devices") or {}).items()}
    fresh = replace(plan, predicted={}, pipelines=[
        replace(p, stages=[replace(st, predicted={}) for st in p.stages]) for p in plan.pipelines])
    priced = price(cm, fresh, idle_reasons=idle)
    return Estimate(priced.plan, priced.fits, priced.problems)


# what callers read here (the cost model's types, pricing/model.py; the wire constants, tests/test_edge.py; the
# plan-level pieces, pricing/plan.py), besides what this module defines
__all__ = ["ACT_BYTES", "HOST_UPDATE_BANDWIDTH", "SLOW_LINK_BYTES_PER_S", "WIRE_BYTES", "CostModel",
           "Option", "Priced", "StageBase", "StageMemory", "StageTimes", "inflight_closed_form", "lower_bound",
           "model_summary", "peak_parts", "price", "price_plan", "price_strategy", "rank_host", "rank_peak",
           "settled_work", "stage_option", "tied_sync", "tp_layer_cost"]
