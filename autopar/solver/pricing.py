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
                 (`intra_op_pricing.LayerPricer`, one solve per block class, device type, tp group and n):
                 its per-op strategies' compute (kernels split by their sharding) and collectives, its
                 parameter share per rank (N counts it) and its saved activations per rank (replicated
                 tensors, e.g. layernorm inputs, count whole); `StageBase.tp_source` = "ilp". The ILP is
                 restricted to what the DTensor runtime runs, and its parameter placements become
                 `Stage.sharding` (`stage_sharding`; intra_op_pricing.py's docstring).
                 Else (the layers around the blocks, or no ILP solution in time): Megatron's closed form,
                 compute / t, 2 all-reduces of the block's output activation in forward and 2 in backward
                 (1 + 1 for the layers before/after the blocks), parameters and activations / t

host_f / host_b: host/framework seconds per micro-batch (views, module calls, autograd nodes, the micro-batch's
setup; cost_models/overhead.py), host_f paid again by recomputed blocks; sync adds the optimizer step's host time.

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

Compressed sends (`CostModel.compress_choice`): a stage boundary is sent in COMPRESS_DTYPE (bf16, fp32's
exponent range, so gradients neither overflow nor flush to zero; relative rounding error <= 2^-9 per
element and transfer) when (1) the plan trains in fp32/tf32 (in bf16/fp16 mixed precision the activations
already travel in 2 bytes), (2) the link is slow (<= 10 Gb/s, SLOW_LINK_BYTES_PER_S: on faster links the
saving is too small to be worth the numerical change) and (3) the cast-inclusive send is faster. The search
plans every eligible boundary compressed (the simulated step only grows with a send time) and
`search.Search.run` drops compression from the final plan unless it shortens the predicted step.

`stage_memory` (per device): solver/stage_memory.py's docstring.

Expert parallelism (ep > 1, solver/experts.py): of N, the X expert elements a device holds have only
H = D / ep holders (its position in every chunk of ep replicas). X = Xp + Xs, Xs those in stacked (E, ...)
tensors (Mixtral), which the runtime keeps out of ZeRO. So ZeRO-partitioned state (the N / D above, and N'
of the optimizer step) is (N - X) / D + Xp / H + Xs per device, and every AR/RS/AG(N) above is
AR/RS/AG(N - X) over the dp group + AR/RS/AG(Xp) over the H holders + AR(Xs g) over them in sync.

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
    with N' = N / D (+ the expert terms above) for zero >= 1, else N (`pricing_plan.offload_host_bytes`)

A node's host memory (`Node.host_memory`, cluster file `host_memory_GiB`, defaults in host_memory.py) holds
the sum over its devices: it fits when that is at most (1 - memory_reserve) of it (`price`). The search
gives each device an even share of its node's usable host memory (`CostModel.host_budget`), which is
sufficient for the node. On unified-memory devices (Jetson boards, the `cpu` device: the host's memory is
theirs) what a device offloads also counts in its own peak: offloading there saves nothing.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import NamedTuple

from ..checks import check_memory_reserve
from ..cluster import Cluster
from ..cost_models.compute import ComputeModel, kernel_flops
from ..cost_models.memory import activation_corrections, optimizer_name, runtime_reserve_bytes, state_bytes_per_param
from ..cost_models.overhead import stage_host_seconds
from ..errors import PlanError
from ..graph import TrainingGraph
from ..host_memory import UNIFIED_KINDS
from ..plan import (
    OFFLOAD_KINDS,
    Estimate,
    Pipeline,
    Plan,
    Stage,
    Strategy,
    cached_schedule,
    layerwise_stages,
    plan_from_strategy,
    recompute_count,
)
from ..schedule import SPLIT_SCHEDULES, peak_inflight
from . import experts
from .intra_op_pricing import LayerPricer, stage_sharding, tp_layer_cost, tp_reason
from .objective import cost_figures, idle_devices
from .pricing_comm import CommPricing
from .pricing_plan import (  # the wire constants are read here by callers (tests/test_edge.py)
    ACT_BYTES,  # noqa: F401
    COMPRESS_DTYPE,  # noqa: F401
    SLOW_LINK_BYTES_PER_S,  # noqa: F401
    WIRE_BYTES,  # noqa: F401
    check_plan,
    host_problem,
    idle_split,
    lower_bound,
    memory_problem,
    rank_host,
    rank_peak,
    tied_sync,
)
from .stage_memory import StageMemory, bucketed_gradients, recomputed, runtime_note, stage_memory
from .wgrad import wgrad_share

# Host memory bandwidth (bytes/s) one device's offloaded optimizer step gets: a server's ~200 GB/s of DRAM
# bandwidth shared by 8 GPUs; an edge board's CPU cores reach about as much of their LPDDR.
HOST_UPDATE_BANDWIDTH = 25e9


class Option(NamedTuple):
    """Per-stage memory/time trade-offs."""

    zero: int = 0
    recompute: bool | int = False  # True / False: all / none of the stage's blocks; k: its first k
    offload: tuple[str, ...] = ()


@dataclass(frozen=True)
class StageBase:
    """Option-independent sums over a layer range, for one micro-batch size and tp group."""

    fwd: float
    bwd: float
    fwd_comm: float
    bwd_comm: float
    recompute: float  # forward compute + comm of the blocks, paid again in backward with recompute
    params: int  # parameters of the range, shared ones included
    max_layer_params: int
    act: float  # saved activation bytes per micro-batch per device
    act_recompute: float  # the same with recompute
    act_work: float  # one block's activations, live while it is recomputed
    out_bytes: float  # activation bytes sent to the next stage
    has_blocks: bool
    tp_source: str = "none"  # tp > 1: "ilp" when every block was priced by the ILP, else "closed_form"
    # parameters per tensor-parallel rank beyond params / t (the ILP's strategies may replicate weights),
    # and the largest layer's parameters per rank under those strategies
    tp_extra: float = 0.0
    tp_max_layer: float = 0.0
    moe_layers: int = 0  # expert-parallel MoE layers in the range (solver/experts.py)
    moe_bytes: float = 0.0  # per such layer and micro-batch: bytes each rank dispatches (tokens x top_k x hidden)
    expert_params: float = 0.0  # of `params`, the expert parameters this device holds
    expert_stacked: float = 0.0  # of those, the ones in stacked (E, ...) tensors, which ZeRO leaves whole
    multi_layer: float = 0.0  # of `params`, those read by several layers (tied embeddings): kept whole-step
    block_params: float = 0.0  # of `params`, those of the range's repeated blocks
    bwd_transient: float = 0.0  # per device: the largest backward transient of an fp32 op (cost_models/memory.py)
    host_step: float = 0.0  # host seconds of the optimizer step over the range's tensors (cost_models/overhead.py)
    # per repeated block of the range, in layer order: (recompute seconds: forward compute + comm + host,
    # saved activation bytes per micro-batch, its input's bytes, its parameters), for selective recompute
    block_parts: tuple[tuple[float, float, float, float], ...] = ()


@dataclass(frozen=True)
class StageTimes:
    fwd: float  # per micro-batch, communication included
    bwd: float
    comm: float  # the communication part of fwd + bwd
    sync: float  # per step
    # the part of fwd (and of bwd) that the stage's per-layer GATHER_F (GATHER_B) memory actions take, and
    # the part of bwd its REDUCEs take (lowering.py; `Plan.simulate` runs them as actions)
    gather: float = 0.0
    reduce: float = 0.0


def inflight_closed_form(schedule: str, ranks: int, microbatches: int, chunks: int = 1) -> list[int]:
    """`peak_inflight` of the generated schedule, per rank, without generating it (the search's hot path)."""
    p, m = ranks, microbatches
    if schedule == "gpipe":
        return [m] * p
    if schedule == "1f1b":
        return [min(p - r, m) for r in range(p)]
    if schedule == "zb_h1":  # activations live until W: min(p, m) on every rank (schedule.zb_h1)
        return [min(p, m)] * p
    return [min(min(2 * (p - r - 1) + (chunks - 1) * p, m * chunks) + 1, m * chunks) for r in range(p)]


class CostModel(CommPricing):
    """Costs of layer ranges of one annotated graph on one cluster; everything is memoised.

    Identical blocks share one cost class, and on a uniform chain (prologue, identical blocks, epilogue)
    a range is keyed by how many blocks it holds, so a 96-block model costs as few ranges as a 2-block one.
    """

    def __init__(self, graph: TrainingGraph, cluster: Cluster, precision: str = "bf16",
                 optimizer: object = "adamw", memory_reserve: float = 0.1, intra_op: bool = True,
                 intra_op_time_limit_s: float = 2.0) -> None:
        check_memory_reserve(memory_reserve)
        if not graph.layers:
            raise PlanError("the graph has no layers; annotate it first.")
        self.graph, self.cluster, self.precision = graph, cluster, precision
        self.optimizer = optimizer_name(optimizer)
        self.state = state_bytes_per_param(self.optimizer, precision)
        self.reserve = memory_reserve
        self.B = graph.batch_size
        self.L = len(graph.layers)
        self.specs = {t: cluster.spec(t) for t in cluster.device_types()}
        self.models = {t: ComputeModel(spec, dtype=precision) for t, spec in self.specs.items()}
        self._init_layers()
        self._memo: dict[tuple, object] = {}
        self._sigs: dict[tuple, int] = {}
        self._sig_of_group: dict[tuple[int, ...], int] = {}
        self.intra_op, self.intra_op_time_limit_s = intra_op, intra_op_time_limit_s
        self._pricers: dict[tuple, LayerPricer | None] = {}
        # the expert-parallel degree priced and the graph's MoE layers (solver/experts.py)
        self.expert_parallel = experts.ExpertParallel.of(graph)

    # ---- layer data ---------------------------------------------------------------------------
    def _init_layers(self) -> None:
        g, L = self.graph, self.L
        self.is_block = [layer.kind == "block" for layer in g.layers]
        users: dict[str, set[int]] = {}
        for node in g.nodes.values():
            for a in node.args:
                if a in g.params:
                    users.setdefault(a, set()).add(node.layer)
        self.own_params = [0] * L
        self.shared: list[tuple[int, int, frozenset[int]]] = []  # (numel, owner layer, user layers)
        for name, info in g.params.items():
            if info.tied_to:  # a second placeholder of a tied parameter: its users use the original
                users.setdefault(info.tied_to, set()).update(users.get(name, set()))
        for name, info in g.params.items():
            if not info.counts:
                continue
            used = users.get(name, set())
            owner = min(used | {max(info.layer, 0)})
            self.own_params[owner] += info.meta.numel
            if used - {owner}:
                self.shared.append((info.meta.numel, owner, frozenset(used)))
        inputs = sum(g.input_meta[n].nbytes for n in g.inputs[:1])
        # fp32-kept saved tensors under autocast and backward transients (cost_models/memory.py)
        fp32_saved, self.bwd_transient = activation_corrections(g, self.precision)
        self.saved = [float(layer.saved_bytes) + x for layer, x in zip(g.layers, fp32_saved, strict=True)]
        self.boundary = [float(layer.boundary_bytes) for layer in g.layers]
        self.in_bytes = [float(inputs)] + self.boundary[:-1]
        classes: dict[tuple, int] = {}
        self.cls: list[int] = []
        self.kernels: list[tuple[tuple, tuple]] = []
        for i, layer in enumerate(g.layers):
            key = (layer.kind, layer.signature if layer.kind == "block" else i, layer.flops_fwd,
                   layer.flops_bwd, self.saved[i], self.boundary[i], self.in_bytes[i], self.own_params[i],
                   tuple(sorted(layer.time_fwd.items())), tuple(sorted(layer.time_bwd.items())))
            if key not in classes:
                classes[key] = len(classes)
                nodes = [g.nodes[n] for n in layer.nodes]
                fwd = Counter((k.kind, kernel_flops(k), k.nbytes) for node in nodes for k in node.kernels_fwd)
                bwd = Counter((k.kind, kernel_flops(k), k.nbytes) for node in nodes for k in node.kernels_bwd)
                self.kernels.append((tuple(sorted(fwd.items())), tuple(sorted(bwd.items()))))
            self.cls.append(classes[key])
        blocks = [i for i in range(L) if self.is_block[i]]
        self.first_block = blocks[0] if blocks else L
        self.num_blocks = len(blocks)
        end = self.first_block + self.num_blocks
        self.uniform = (bool(blocks) and blocks == list(range(self.first_block, end))
                        and len({self.cls[i] for i in blocks}) == 1
                        and not any(self.is_block[u] for _, _, us in self.shared for u in us))

    def range_key(self, a: int, e: int) -> tuple:
        """Ranges with equal keys have equal costs (blocks of a uniform chain are interchangeable): the
        part before the blocks, the block count, the part after."""
        if not self.uniform:
            return (a, e)
        p0, p1 = self.first_block, self.first_block + self.num_blocks
        blocks = max(0, (e if e < p1 else p1) - (a if a > p0 else p0))
        return (a if a < p0 else p0, e if e < p0 else p0, blocks, a if a > p1 else p1, e if e > p1 else p1)

    def range_params(self, a: int, e: int) -> tuple[int, int]:
        """(parameters a stage holding layers [a, e) stores, its largest layer's parameters)."""
        own = self.own_params[a:e]
        extra = sum(n for n, owner, us in self.shared if not a <= owner < e and any(a <= u < e for u in us))
        return sum(own) + extra, max(own)

    def peak_inflight(self, schedule: str, ranks: int, microbatches: int, chunks: int) -> dict[int, int]:
        """`schedule.peak_inflight` of the generated schedule (memoised: replicas share it)."""
        key = ("inflight", schedule, ranks, microbatches, chunks)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = peak_inflight(cached_schedule(schedule, ranks, microbatches, chunks))
        return hit  # type: ignore[return-value]

    def usable(self, device: int) -> float:
        """Bytes the plan's tensors may fill: (1 - memory_reserve) of the capacity, less what the runtime
        holds outside tensors on a GPU (CUDA context, cuBLAS workspace, NCCL buffers: `runtime_reserve`)."""
        return self.cluster.devices[device].spec.memory * (1 - self.reserve) - self.runtime_reserve(device)

    def runtime_reserve(self, device: int) -> int:
        """`cost_models.memory.runtime_reserve_bytes` of one device of this cluster."""
        spec = self.cluster.devices[device].spec
        return runtime_reserve_bytes(spec.kind, self.cluster.world_size > 1, spec.name)

    def host_usable(self, node: int) -> float:
        """Bytes of a node's host memory its devices may fill with what they offload."""
        return self.cluster.nodes[node].host_memory * (1 - self.reserve)

    def host_budget(self, device: int) -> float:
        """The search's host budget of a device: an even share of its node's usable host memory."""
        node = self.cluster.nodes[self.cluster.devices[device].node]
        return self.host_usable(node.index) / len(node.devices)

    def unified(self, device: int) -> bool:
        """Whether the device's memory is its host's (what it offloads stays in its own memory)."""
        return self.cluster.devices[device].spec.kind in UNIFIED_KINDS

    # ---- compute ------------------------------------------------------------------------------
    def layer_compute(self, layer: int, dtype: str, n: int, tp: int) -> tuple[float, float]:
        """(forward, backward) seconds of one layer for n samples split tp ways."""
        key = ("c", self.cls[layer], dtype, n, tp)
        hit = self._memo.get(key)
        if hit is None:
            scale = n / (self.B * tp)
            op_time = self.models[dtype].op_time
            fwd, bwd = self.kernels[self.cls[layer]]
            hit = self._memo[key] = (sum(c * op_time(k, f * scale, b * scale) for (k, f, b), c in fwd),
                                     sum(c * op_time(k, f * scale, b * scale) for (k, f, b), c in bwd))
        return hit  # type: ignore[return-value]

    def base(self, a: int, e: int, dtype: str, n: int, tp_group: tuple[int, ...]) -> StageBase:
        key = ("b", self.range_key(a, e), dtype, n, self.group_sig(tp_group))
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._base(a, e, dtype, n, tp_group)
        return hit  # type: ignore[return-value]

    def _base(self, a: int, e: int, dtype: str, n: int, tp_group: tuple[int, ...]) -> StageBase:
        t, frac = len(tp_group), n / self.B
        f = b = fc = bc = rc = act = act_rc = work = transient = 0.0
        extra = tp_max = 0.0
        ilp = t > 1 and any(self.is_block[a:e])
        parts = []
        for i in range(a, e):
            c = tp_layer_cost(self, i, dtype, n, tp_group)
            f, b, fc, bc = f + c.fwd, b + c.bwd, fc + c.fwd_comm, bc + c.bwd_comm
            saved = c.act if c.act >= 0 else self.saved[i] * frac / t
            act += saved
            extra += self.own_params[i] * (c.param_frac - 1 / t)
            tp_max = max(tp_max, self.own_params[i] * c.param_frac)
            ilp = ilp and (c.ilp or not self.is_block[i])
            if self.is_block[i]:
                rc += c.fwd + c.fwd_comm
                act_rc += self.in_bytes[i] * frac
                work = max(work, saved)
                parts.append((c.fwd + c.fwd_comm + stage_host_seconds(self, i, i + 1, dtype).recompute, saved,
                              self.in_bytes[i] * frac, float(self.own_params[i])))
            else:
                act_rc += saved
            transient = max(transient, self.bwd_transient[i] * frac / t)
        host = stage_host_seconds(self, a, e, dtype)  # host/framework time (cost_models/overhead.py)
        f, b, rc = f + host.fwd, b + host.bwd, rc + host.recompute
        params, biggest = self.range_params(a, e)
        multi = float(sum(n for n, _, us in self.shared if any(a <= u < e for u in us)))
        blocks = float(sum(self.own_params[i] for i in range(a, e) if self.is_block[i]))
        base = StageBase(f, b, fc, bc, rc, params, biggest, act, act_rc, work, self.boundary[e - 1] * frac,
                         any(self.is_block[a:e]), "none" if t == 1 else "ilp" if ilp else "closed_form",
                         extra, tp_max, multi_layer=multi, block_params=blocks, bwd_transient=transient,
                         host_step=host.step, block_parts=tuple(parts))
        return experts.adjust_base(self, a, e, dtype, n, t, base)

    def layer_pricer(self, dtype: str, tp_group: tuple[int, ...]) -> LayerPricer | None:
        """The intra-op ILP's per-layer pricer for a tensor-parallel group (None when it is switched off)."""
        key = (dtype, self.group_sig(tp_group))
        if key not in self._pricers:
            self._pricers[key] = LayerPricer(self.graph, len(tp_group), dtype, self.cluster, tp_group,
                                             self.intra_op_time_limit_s) if self.intra_op else None
        return self._pricers[key]

    # ---- options ------------------------------------------------------------------------------
    def stage_times(self, base: StageBase, opt: Option, dtype: str, tp_group: tuple[int, ...],
                    dp_group: tuple[int, ...], dp_sig: int | None = None, layerwise: bool = True,
                    mixed_tp: bool = False) -> StageTimes:
        """Per-micro-batch times and the per-step sync of a stage with option `opt` (module docstring).
        `dp_sig` is `group_sig(dp_group)` when the caller has it. Without `layerwise` (`plan.layerwise_stages`)
        the runtime's ZeRO-2/3 is whole-step: one gather at the start of the step and one reduction after the
        schedule, i.e. ZeRO-1's communication (and memory), priced so. `mixed_tp`: the stage's data-parallel
        peers run at different tensor-parallel degrees (a tp per pipeline class), so the sync moves what
        runtime/zero.py moves then: whole (unsharded) tensors among the groups' first ranks, after each group
        gathers them and before it broadcasts the result (`_mixed_tp_sync`)."""
        w, g, o = self.state.weights, self.state.grads, self.state.optimizer
        t, D = len(tp_group), len(dp_group)
        N = base.params / t + base.tp_extra
        z = opt.zero if D > 1 else 0
        if not layerwise:
            z = min(z, 1)
        key = ("dp", N, self.group_sig(dp_group) if dp_sig is None else dp_sig, t)  # same for every option
        hit = self._memo.get(key) if not mixed_tp else self._mixed_tp_sync(base, tp_group, dp_group)
        if hit is None:
            # the stage's t data-parallel groups (one per tp rank) sync at once: they share the nodes' NICs
            hit = self._memo[key] = (self.collective("all_gather", N * w, dp_group, t),
                                     self.collective("reduce_scatter", N * g, dp_group, t),
                                     self.collective("all_reduce", N * g, dp_group, t))
        ag, rs, ar = hit  # type: ignore[misc]
        host = self.specs[dtype].host_link
        h2d = lambda x: host.latency + x / host.bandwidth if x > 0 else 0.0  # host link: latency + bytes / bandwidth
        rc_time, act, _, _ = recomputed(base, opt.recompute)
        # expert parallelism: all-to-alls, and expert state synced (and ZeRO-partitioned) among its holders only
        a2a_f, a2a_b, moe_sync = experts.a2a_times(self, base, tp_group, dp_group, z) if base.moe_layers \
            else (0.0, 0.0, 0.0)
        fc, bc = base.fwd_comm + a2a_f, base.bwd_comm + a2a_b
        if z == 3:
            fc, bc = fc + ag, bc + ag
        if z >= 2:
            bc += rs
        if "params" in opt.offload:
            fc, bc = fc + h2d(N * w), bc + h2d(N * w) + h2d(N * g)
        if "activations" in opt.offload:
            fc, bc = fc + h2d(act), bc + h2d(act)
        sync = (ar, rs + ag, ag, 0.0)[z] + moe_sync + base.host_step
        local = N / D + (experts.zero_extra(self, base, D) if base.moe_layers else 0.0) if z >= 1 else N
        if "optimizer" in opt.offload:
            sync += 0.0 if "params" in opt.offload else h2d(local * g) + h2d(local * w)
            sync += 2 * (w + g + o) * local / HOST_UPDATE_BANDWIDTH
        else:
            sync += 2 * (w + g + o) * local / self.models[dtype].bandwidth
        fwd = base.fwd + fc
        bwd = base.bwd + bc + rc_time
        streamed = "params" in opt.offload
        gather = (ag if z == 3 else 0.0) + (h2d(N * w) if streamed else 0.0)
        reduce = (rs if z >= 2 else 0.0) + (h2d(N * g) if streamed else 0.0)
        return StageTimes(fwd, bwd, fc + bc, sync, gather, reduce)

    def _mixed_tp_sync(self, base: StageBase, tp_group: tuple[int, ...], dp_group: tuple[int, ...]
                       ) -> tuple[float, float, float]:
        """(all-gather, reduce-scatter, all-reduce) seconds of a stage whose data-parallel peers differ in
        tensor-parallel degree: runtime/zero.py reduces whole tensors (all of the stage's parameters, E)
        among the groups' first ranks, once (not t groups at once), and a tp group first gathers its shards
        (all-gather of E g over it) and then broadcasts the result to its ranks (as much again)."""
        w, g = self.state.weights, self.state.grads
        E = float(base.params)
        inner = 2 * self.collective("all_gather", E * g, tp_group)
        return (self.collective("all_gather", E * w, dp_group) + inner,
                self.collective("reduce_scatter", E * g, dp_group) + inner,
                self.collective("all_reduce", E * g, dp_group) + inner)

    def stage_memory(self, base: StageBase, opt: Option, tp: int, dp: int, layerwise: bool = True) -> StageMemory:
        """Peak device (and host) bytes of a stage, as the runtime keeps them (solver/stage_memory.py)."""
        return stage_memory(self, base, opt, tp, dp, layerwise)


# ---- pricing a plan ---------------------------------------------------------------------------------


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
                  mixed_tp: set[int] = frozenset()) -> tuple[list[dict], list[tuple], list[StageMemory]]:
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
                if j + 1 < len(pipe.stages) else 0.0)
        sync = tf.sync + tied[j]
        vals.append((tf.fwd, ts.fwd, tf.bwd, ts.bwd, send, sync))  # (lower_bound reads the first six)
        mems.append(cm.stage_memory(base, opt, len(tp_group), len(dp_group), j in layerwise))
        m_full = len(sizes) - n_small
        preds.append({"fwd_s": tf.fwd, "bwd_s": tf.bwd, "fwd_small_s": ts.fwd, "bwd_small_s": ts.bwd,
                      "send_s": send, "sync_s": sync, "tp_source": base.tp_source,
                      "tp_reason": tp_reason(cm, st.layers[0], st.layers[1], dtype, full, tp_group),
                      "gather_s": tf.gather, "reduce_s": tf.reduce,
                      # the weight-gradient part of bwd_s: a zero-bubble schedule's W (solver/wgrad.py)
                      "bwd_w_s": wgrad_share(cm, st.layers[0], st.layers[1], dtype) * tf.bwd,
                      "compute_s": m_full * (tf.fwd + tf.bwd - tf.comm)
                      + n_small * (ts.fwd + ts.bwd - ts.comm),
                      "comm_s": m_full * tf.comm + n_small * ts.comm + sync
                      + len(sizes) * (send + (vals[j - 1][4] if j else 0.0))})
    return preds, vals, mems


def price(cm: CostModel, plan: Plan, idle_reasons: dict[int, str] | None = None) -> Priced:
    """Fill in `plan`'s predictions: stage times, per-device peak memory, the simulated step.

    Raises PlanError when the plan is inconsistent (`check_plan`); a plan that does not fit is priced
    anyway, with `fits` False and the `problems` spelled out. Devices the plan leaves out are idle:
    `predicted["idle_devices"]` maps each to why (`idle_reasons` from the caller, else the reason the plan
    already carries, else `objective.idle_devices`' default). With prices in the cluster file it also
    predicts `cost_per_hour` and `cost_per_sample` (solver/objective.py)."""
    check_plan(cm, plan)
    reasons = {**{int(d): r for d, r in (plan.predicted.get("idle_devices") or {}).items()}, **(idle_reasons or {})}
    cm = experts.checked(cm, plan)
    devices = cm.cluster.devices
    pipes: list[Pipeline] = []
    peak: dict[int, int] = {}
    host: dict[int, float] = {}  # device -> host bytes it fills
    problems: list[str] = []
    bound = 0.0
    dp_groups = [tuple(p.stages[j].devices[0] for p in plan.pipelines if j < len(p.stages))
                 for j in range(max(len(p.stages) for p in plan.pipelines))]
    # which stages' ZeRO runs per layer: the same stages in every pipeline, or none (plan.layerwise_stages)
    layerwise = {j for _, j in layerwise_stages([(p.num_microbatches, [(tuple(st.layers), len(st.devices))
                                                                        for st in p.stages])
                                                 for p in plan.pipelines])
                 if plan.schedule not in SPLIT_SCHEDULES}  # zero-bubble: whole-step ZeRO (lowering.lower)
    # stages whose data-parallel peers run at different tensor-parallel degrees (a tp per pipeline class)
    mixed_tp = {j for j in range(len(dp_groups))
                if len({len(p.stages[j].devices) for p in plan.pipelines if j < len(p.stages)}) > 1}
    bucketed = bucketed_gradients(cm, plan)
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
            seen[key] = _stage_values(cm, pipe, dp_groups, layerwise, mixed_tp)
        preds, vals, mems = seen[key]
        stages = [replace(st, offload=list(stage_option(st).offload), predicted=dict(pr),
                          sharding=stage_sharding(cm, st.layers[0], st.layers[1], devices[st.devices[0]].spec.name,
                                                  pipe.microbatch_size, tuple(st.devices)))
                  for st, pr in zip(pipe.stages, preds, strict=True)]
        sizes = pipe.microbatch_sizes()
        inflight = cm.peak_inflight(plan.schedule, ranks, pipe.num_microbatches, plan.chunks)
        if bucketed:
            mems = [replace(m, sync=0.0) for m in mems]
        for r in range(ranks):
            need = rank_peak(mems[r::ranks], inflight[r])
            on_host = rank_host(mems[r::ranks], inflight[r])
            for d in pipe.stages[r].devices:
                host[d] = on_host
                shared = on_host if cm.unified(d) else 0.0
                peak[d] = math.ceil(need + shared)
                if need + shared > cm.usable(d):
                    problems.append(memory_problem(cm, d, i, r, need + shared, mems[r::ranks], inflight[r], shared)
                                    + runtime_note(cm, d))
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
        "memory_capacity_bytes": {d: devices[d].spec.memory for d in sorted(peak)},
        # per node (cluster order): bytes its devices offload to host memory, and its host memory
        "host_memory_bytes": [math.ceil(x) for x in node_host],
        "host_capacity_bytes": [node.host_memory for node in cm.cluster.nodes],
        "idle_devices": idle_devices(cm.cluster, out, reasons),
        **cost_figures(cm.cluster, sorted(peak), cm.B / step),
    }
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
