"""What one device holds at its peak for one stage: the memory half of the planner's cost model.

The figures are what the runtime keeps (runtime/zero.py, zero_layers.py, precision.py); bench/memory.py
measures them at the allocator on gloo ranks. Units: bytes; N, P, D, t, w, g, o as in pricing.py.

`stage_memory` (per device; peak = static + in-flight x act + work), what the runtime holds at its peak
(runtime/zero.py, zero_layers.py). z is the stage's ZeRO level where it runs per layer (`layerwise`: the
stage is in `plan.layerwise_stages`: every replica alike, t = 1, no experts, not ZeRO-3 with offloaded
parameters), else min(z, 1): the whole-step path gathers every parameter and keeps every gradient until
after the schedule, so ZeRO-2/3 there save nothing at the peak. "Streamed" parameters: params and optimizer
offloaded, t = 1, z <= 2 (brought in one layer at a time, gradients accumulated on the host); params
offloaded otherwise come back for the whole step and count as resident. T = tied parameters' elements
(read by several layers: never per layer):

    weights  N w / D if z 3 else N w  (+ T w (1 - 1/D) at z 3)       streamed: T w
    grads    N g / D if z >= 2 else N g  (+ T g (1 - 1/D) at z >= 2)  streamed: T g
    optim.   N o / D if zero >= 1 else N o         (0 with the optimizer offloaded)
    buffers  z 3: 2 w P / t (the layer in use and the prefetched next one); z >= 2: g P / t (one layer's
             reduction in flight); streamed: (w + g) P / t
    sync     after the schedule, when the activations are gone (peak = static + max(act terms, sync)): one
             flat bucket (<= SYNC_BUCKET_BYTES) of the gradients reduced there (N g under ZeRO-0/1, N g / D
             under whole-step ZeRO-2/3, none where they were reduced per layer) or of an owner's updated
             values broadcast (N w / D, ZeRO-1/2 and whole-step ZeRO-3); none for DDP-style bucketed plans;
             or, when larger, what the optimizer step on the device allocates beside its state
             (cost_models/memory.py `optimizer_step_bytes`: 2 fp32 buffers of the largest owned tensor for
             AdamW on the CPU, one of all N' owned elements with CUDA's foreach step)
    act      per micro-batch: saved activations x n / B / t; with recompute (k of the stage's blocks, its
             first k: `recomputed`; True = all) only each recomputed block's input (n / B of the previous
             layer's boundary) is kept for it, the other blocks keep their full activations, plus `work` =
             one recomputed block's full activations while it is rebuilt (the largest of the k), less the
             full activations F of the blocks kept whole: the first k are rebuilt in the backward after it
             has freed those (`recomputed`), so work = max(0, W - F) (W with every block recomputed);
             with activations offloaded only one micro-batch stays on the device;
             mixed precision adds autocast's low-precision weight copies (`StateBytes.cast_copy` x the N
             that ops on autocast's lower-precision list read, `StageBase.cast_params`: not embedding
             tables, not norm weights; per micro-batch, the recomputed blocks' only while one is
             recomputed); ops autocast runs in fp32 (softmax, log-softmax / cross-entropy) keep what they
             save in 4 bytes (cost_models/memory.py)
    work     + `StageBase.bwd_transient`: the two fp32 gradient buffers the backward of the stage's largest
             such op holds next to its saved tensor (the loss's d/d log-probs and d/d logits: 8 bytes per
             logit), or any op's output gradient, less what the stage's later layers saved (their backwards
             freed it first; `bwd_transient_recompute` when blocks are recomputed, which keep only their
             inputs), live once, while one micro-batch goes through it; under per-layer ZeRO-2/3 it
             comes before the first gradient, so only what exceeds the in-flight gradient buffer counts
             or, when larger, `StageBase.bwd_workspace`: the largest buffer one op's backward allocates
             beside autograd's tensors on the stage's device kind, per device whatever the micro-batch (a CPU
             convolution's weight gradient in oneDNN's padded layout: cost_models/conv_workspace.py); the two
             belong to different ops and never coexist, and the in-flight gradients do not reduce this one;
             nor does, at cp > 1, an attention call's context-parallel transient (`StageBase.cp_work`: the K/V
             blocks in flight, with the dK/dV accumulators in backward, or Ulysses' all-to-all buffers), the larger
             of the three counting (context.py)
           + the gradient accumulation's transient: where a backward finds a parameter's `.grad` already there
             (every micro-batch after the first, or a DDP-style bucketed plan whose gradients are views of the
             buckets from the start), autograd computes the new gradient in a tensor of its own and adds it in,
             beside the output gradient of the op that read the parameter, so the largest parameter's gradient
             (g P_max / t, gradients kept whole: z <= 1, not streamed) is briefly live twice: the transient term
             is max(that, the largest op output gradient `StageBase.bwd_out_grad` + g P_max / t) (measured: a pp 4
             embedding stage at 8 micro-batches, 1.07x its plan without it; a loss's two buffers come before the
             head's weight gradient, so the last stage's peak stays the loss's). `StageMemory.accumulation` is
             what it adds to `work`; a device's peak counts it only where its backward at the peak's in-flight
             count meets a `.grad` (`plan.settled_work`: by the step's micro-batch and in-flight counts, which
             the search's stage positions carry, `split.Slot.microbatches`)

A pipeline stage's messages (runtime/program.py): `act` + its output (`StageBase.out_bytes`, kept per micro-batch for
its backward) and, after the first stage, its received input (`StageBase.in_bytes`, kept to send its gradient back;
`act` counts it in CostModel._base, where the tensors only later stages save leave the stage that made them,
`Layer.saved_later`), `work` + the received output gradient and one batch of send buffers (the larger of its output
and its input; a last stage only the latter).

At cp > 1 (solver/pricing/context.py) t is the tensor-parallel degree (the group naming the stage holds cp x t
devices) and D the dp x cp holders of the stage's parameters; act is per cp rank (T / cp tokens).

The device's capacity is what its tensors may fill: `CostModel.usable` takes the runtime's own device
memory (CUDA context, cuBLAS workspace, NCCL buffers; cost_models/memory.py) off it on GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...cost_models.conv_workspace import CPU_KIND
from ...cost_models.memory import SYNC_BUCKET_BYTES, optimizer_step_bytes
from ...ir.plan import Plan
from ...report import fmt_bytes
from . import experts
from .plan import HOST_GRAD_BYTES, HOST_MASTER_BYTES, offload_host_bytes

if TYPE_CHECKING:
    from .model import CostModel, Option, StageBase


@dataclass(frozen=True)
class StageMemory:
    static: float  # weights + grads + optimizer state + buffers
    act: float  # per in-flight micro-batch
    work: float
    offload_act: bool
    host: float = 0.0  # bytes kept in host memory: offloaded optimizer state and parameter copies
    host_act: float = 0.0  # host bytes per in-flight micro-batch (offloaded activations)
    # the flat bucket a gradient reduction or parameter broadcast packs after the schedule, when the
    # activations are gone: the peak is static + max(activation term, sync)
    sync: float = 0.0
    # the offloaded optimizer's step (runtime/zero.py `ZeroRuntime.step`), for one memory holding both the
    # device's tensors and its host share (`pricing.plan.rank_shared`): of `host`, the fp32 gradient copies it
    # makes (on the host from the step on only), the device gradient bytes of `static` it drops as it copies
    # them, and what it adds on top: its CPU optimizer's buffers while it updates a parameter
    # (OPTIMIZER_STEP_BUFFERS; at least the one gradient copied while the device's still exists)
    host_step: float = 0.0
    step_freed: float = 0.0
    host_work: float = 0.0
    # of `sync`: what the device's own optimizer step allocates beside its state (it comes after the
    # reductions; a DDP-style bucketed plan, whose reductions pack nothing, keeps this part)
    step: float = 0.0
    # of `work`: the gradient accumulation's transient (module docstring), which only a backward that finds its
    # parameters' `.grad` there has (`plan.settled_work`); `accumulates`: every backward does (the gradients are
    # the buckets' views from the start: `bucketed_gradients`, which pricing sets per plan; the search assumes it
    # wherever the option allows it)
    accumulation: float = 0.0
    accumulates: bool = False
    # of `work`: what a step's first backward does not reach (no `.grad` there yet: neither the accumulation's
    # transient nor, at the loss's transient, the stage's gradients, which `static` counts); at least
    # `accumulation` (`plan.settled_work`)
    first: float = 0.0
    # of `static`: the parameters, gradients and optimizer state the stage keeps (the rest of it, prefetched
    # layers and gradients in flight, are buffers): how a device's peak divides (`pricing.peak_parts`)
    params: float = 0.0
    grads: float = 0.0
    optim: float = 0.0

    def peak(self, inflight: int) -> float:
        act = (min(inflight, 1) if self.offload_act else inflight) * self.act + self.work
        return self.static + max(act, self.sync)


def recomputed_blocks(base: StageBase, recompute: bool | int) -> int:
    """How many of the stage's blocks `recompute` (True = all, False = none, or k, clamped) recomputes: what
    `recomputed` depends on. Memo keys use it, never the raw value: True == 1 in Python, so an option recomputing
    all of a stage's blocks and one recomputing its first block would otherwise share an entry."""
    n = len(base.block_parts)
    return (n if recompute else 0) if isinstance(recompute, bool) else min(int(recompute), n)


def recomputed(base: StageBase, recompute: bool | int) -> tuple[float, float, float, float]:
    """What recomputing a stage's first k blocks (`recompute`: True = all, False = none, or k; clamped to
    the stage's blocks) costs and saves: (seconds its backward adds, activation bytes kept per micro-batch,
    the recompute workspace, the recomputed blocks' parameters autocast casts). The workspace is one rebuilt block's
    activations (the largest of the k) less the activations of the blocks kept whole, which that
    micro-batch's backward frees before it reaches the first k (module docstring). k = all gives `StageBase.recompute`,
    `act_recompute`, `act_work`, `block_params` exactly; so does any k > 0 on a stage with expert-parallel MoE
    layers, whose runtime recomputes the whole stage in one checkpoint (runtime/program.py)."""
    n, k = len(base.block_parts), recomputed_blocks(base, recompute)
    if not base.has_blocks or k <= 0:
        return 0.0, base.act, 0.0, 0.0
    if k >= n or base.moe_layers:
        return base.recompute, base.act_recompute, base.act_work, base.block_params
    parts, kept = base.block_parts[:k], base.block_parts[k:]
    work = max(0.0, max(x[1] for x in parts) - sum(x[1] for x in kept))
    return (sum(x[0] for x in parts), base.act - sum(x[1] - x[2] for x in parts), work, sum(x[3] for x in parts))


def stage_memory(cm: CostModel, base: StageBase, opt: Option, tp: int, dp: int, layerwise: bool = True
                 ) -> StageMemory:
    """Peak device (and host) bytes of a stage, as the runtime keeps them (module docstring).
    `layerwise`: the stage is one of `plan.layerwise_stages`, so its ZeRO-2/3 runs per layer; elsewhere
    the runtime gathers and reduces for the whole step, whose peak is ZeRO-1's."""
    return stage_memories(cm, base, [opt], tp, dp, layerwise)[0]


def stage_memories(cm: CostModel, base: StageBase, opts: list[Option], tp: int, dp: int, layerwise: bool = True
                   ) -> list[StageMemory]:
    """`stage_memory` of one stage under each of `opts`: what does not depend on the option is computed once
    (the search prices every option of a range together)."""
    w, g, o = cm.state.weights, cm.state.grads, cm.state.optimizer
    N, P = base.params / tp + base.tp_extra, max(base.max_layer_params / tp, base.tp_max_layer)
    whole = base.multi_layer / tp  # tied parameters: never per layer
    spread = (1 - 1 / dp) if dp > 1 else 0.0
    cast = cm.state.cast_copy
    recomputes: dict[int, tuple[float, float, float, float]] = {}
    out = []
    for opt in opts:
        z = opt.zero if dp > 1 else 0
        offload = opt.offload
        per_layer = layerwise and tp == 1 and not base.moe_layers and not (z == 3 and "params" in offload)
        zm = z if per_layer else min(z, 1)  # what ZeRO does to the peak
        # offloaded parameters stream per layer where the stage runs layer by layer and the optimizer (which
        # updates them) is on the host too; otherwise they come back for the whole step
        streamed = "params" in offload and "optimizer" in offload and tp == 1 and zm <= 2 \
            and not base.moe_layers
        if streamed:
            params, grads = whole * w, whole * g
        else:
            params = N * w / (dp if zm == 3 else 1) + whole * w * (zm == 3) * spread
            grads = N * g / (dp if zm >= 2 else 1) + whole * g * (zm >= 2) * spread
        optim = 0.0 if "optimizer" in offload else N * o / (dp if z >= 1 else 1)
        static = params + grads + optim
        if z and base.moe_layers:  # expert state is partitioned over its dp / ep holders only
            static += experts.zero_bytes(cm, base, opt._replace(zero=zm), dp)
        if zm == 3:
            static += 2 * P * w  # the layer in use and the next one, prefetched
        in_flight_grads = P * g if zm >= 2 else 0.0
        static += in_flight_grads  # ZeRO-2/3: one layer's gradients in flight to their owners during the backward
        if streamed:
            static += P * (w + g)  # the layer in use and its gradient
        # N' owned parameters, as the optimizer step's `local` in stage_times
        owned = N / dp + (experts.zero_extra(cm, base, dp) if base.moe_layers else 0.0) if z >= 1 else N
        host = offload_host_bytes(cm.optimizer, w, N, owned, z, offload)
        host_step = step_freed = host_work = 0.0
        if "optimizer" in offload:
            # the step copies each owned gradient to the host and drops the device's (streamed parameters'
            # are on the host already: only the tied ones are copied then), then updates the host copies
            # one parameter at a time
            host_step = min(whole, owned) * HOST_GRAD_BYTES if streamed else owned * HOST_GRAD_BYTES
            step_freed = whole * g if streamed else N * g / (dp if zm >= 2 else 1) + (
                whole * g * (1 - 1 / dp) if zm >= 2 and dp > 1 else 0.0)
            # (at least one: each gradient's host copy exists before the device's is dropped)
            largest = min(base.max_param / tp, owned)
            host_work = max(optimizer_step_bytes(cm.optimizer, CPU_KIND, owned, largest), HOST_MASTER_BYTES * largest)
        off_act = "activations" in offload
        k = recomputed_blocks(base, opt.recompute)
        rc = recomputes.get(k)
        if rc is None:
            rc = recomputes[k] = recomputed(base, opt.recompute)
        _, act, work, recomputed_params = rc
        # the loss's backward comes before any layer's gradient exists: its transient and the in-flight
        # gradients above never coexist. An op's backward buffer (a CPU convolution's weight gradient in
        # oneDNN's layout) comes later, with those gradients, and never with the loss's transient: one op at a
        # time; so does a context-parallel attention's transient (K/V blocks in flight, all-to-all buffers:
        # `StageBase.cp_work`)
        transient = base.bwd_transient_recompute if k else base.bwd_transient
        op_work = max(max(0.0, transient - in_flight_grads), base.bwd_workspace, base.cp_work)
        accum = base.max_param / tp * g if zm <= 1 and not streamed else 0.0
        with_accum = max(op_work, base.bwd_out_grad + accum) if accum else op_work
        work += with_accum
        bucketable = dp > 1 and tp == 1 and z == 0 and not {"params", "optimizer"} & set(offload) \
            and not base.moe_layers
        # a step's first backward reaches the loss's transient before it has made any of the stage's gradients
        # (they are None until then; ZeRO, offload and streaming keep gradients of their own: not counted there).
        # Measured on tp 1 only: tensor-parallel stages measured their full plan there (bench/long_context.py's
        # tp 4 rows went 1.09-1.13 -> 1.15-1.19 of the plan with it), so they keep it
        op_first = op_work
        if base.bwd_loss and tp == 1 and z == 0 and not offload and not base.moe_layers:
            rest = base.bwd_rest_recompute if k else base.bwd_rest
            op_first = max(base.bwd_loss - grads, rest, base.bwd_workspace, base.cp_work)
        # a pipeline stage's messages (runtime/program.py): each micro-batch's output stays for its backward
        # (autograd saves none of it); during a backward the received output gradient, and one batch of send
        # buffers (the previous batch's sends finish before the next goes out), are live
        act += base.out_bytes
        work += base.out_bytes + max(base.out_bytes, base.in_bytes) if base.out_bytes else base.in_bytes
        # autocast keeps a low-precision copy of each weight a matmul / linear / conv reads for the backward;
        # embedding tables and norm weights are never cast (`StageBase.cast_params`)
        if cast and base.params:
            share = min(1.0, base.cast_params / base.params)
            act += cast * max(0.0, N * share - recomputed_params / tp)
            work += cast * (P * share if recomputed_params else 0.0)
        # after the schedule, one bucket at a time: gradients reduced there (all of them under ZeRO-0/1, an
        # owner's share under whole-step ZeRO-2/3), and updated values broadcast from their owners
        sync = 0.0
        if dp > 1:
            after = not (per_layer and zm >= 2)
            red = min(SYNC_BUCKET_BYTES, N * g / (dp if z >= 2 else 1)) if after else 0.0
            bcast = min(SYNC_BUCKET_BYTES, N * w / dp) if z in (1, 2) or (z == 3 and not per_layer) else 0.0
            sync = max(red, bcast)
        step = 0.0 if "optimizer" in offload else \
            optimizer_step_bytes(cm.optimizer, base.device_kind, owned, base.max_param / tp)
        out.append(StageMemory(static, act, work, off_act, host, act if off_act else 0.0, max(sync, step), host_step,
                               step_freed, host_work, step, with_accum - op_work, bucketable, with_accum - op_first,
                               params, grads, optim))
    return out


def bucketed_gradients(cm: CostModel, plan: Plan) -> bool:
    """Whether the runtime syncs this plan's gradients DDP-style (runtime/grad_sync.py: gradients are views of
    the buckets, so the sync packs nothing): one chunk, no ZeRO, tp 1, no parameter or optimizer offload, no
    experts, and no parameter shared by layers on different stages (whose holders would differ). Context-parallel
    siblings are replicas there (runtime/grad_sync.py sees one pipeline per cp rank): tp 1 is one device per cp rank,
    and ZeRO partitions over dp x cp holders."""
    if plan.chunks != 1 or (plan.experts or {}).get("degree", 1) > 1:
        return False
    if len(plan.pipelines) * plan.pipelines[0].stages[0].cp == 1:  # one replica: nothing to sync, no buckets
        return False
    for pipe in plan.pipelines:
        stage_of = {layer: j for j, st in enumerate(pipe.stages) for layer in range(*st.layers)}
        if any(len({stage_of[u] for u in us}) > 1 for _, _, us in cm.shared):
            return False
        for st in pipe.stages:
            zero = st.zero and len(plan.pipelines) * st.cp > 1
            if zero or st.tp != 1 or {"params", "optimizer"} & set(st.offload):
                return False
    return True


def runtime_note(cm: CostModel, device: int, communicators: int | None = None) -> str:
    """The sentence a memory problem on a GPU adds: the usable figure also excludes the runtime's own memory
    (with the buffers of `communicators` NCCL communicators, `CostModel.runtime_reserve`)."""
    held = cm.runtime_reserve(device, communicators)
    comms = f" of {communicators} communicator(s)" if communicators else ""
    return (f" The usable figure also excludes {fmt_bytes(held)} the CUDA runtime holds outside tensors (context, "
            f"cuBLAS workspace, NCCL buffers{comms}; cost_models/memory.py)." if held else "")
