"""The planner's cost model: `CostModel`, the per-stage prices of one annotated graph on one cluster.

It holds what the formulas in pricing.py's docstring read (the layer chain's classes, parameters, saved
and boundary bytes, every device type's compute model) and computes them, memoised: a layer range's
option-independent sums (`CostModel.base` -> `StageBase`: compute and tensor-parallel cost per micro-batch,
host time, activations, parameters, MoE terms), an option's per-micro-batch times and per-step sync
(`CostModel.stage_times` -> `StageTimes`), and a stage's peak memory (`CostModel.stage_memory`, the formulas
in stage_memory.py). Its parts live beside it: the communication half it inherits (pricing/comm.py), the
tensor-parallel price of a layer (intra_op/pricing.py), expert parallelism (experts.py, which reads the
`expert_parallel` field and changes it only through `with_expert_degree`), context parallelism (context.py: the
`context` field, changed only through `with_context`), the weight-gradient share (wgrad.py). Pricing a whole plan
with it is pricing.py (`price`), which re-exports everything here.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple, TypeVar

from ...checks import check_memory_reserve
from ...cluster import Cluster
from ...cost_models.compute import ComputeModel, Profile, check_profiles, kernel_flops
from ...cost_models.conv_workspace import CPU_KIND
from ...cost_models.measured_blocks import BlockProfile, Measured
from ...cost_models.memory import (
    activation_corrections,
    autocast_cast_params,
    backward_workspace,
    optimizer_name,
    runtime_reserve_bytes,
    state_bytes_per_param,
)
from ...cost_models.overhead import floored, stage_host_seconds
from ...errors import PlanError
from ...host_memory import UNIFIED_KINDS
from ...ir.graph import TrainingGraph
from ...ir.plan import Plan
from ...ir.plan_simulate import cached_schedule
from ...ir.schedule import peak_inflight
from ...lowering import plan_communicators
from ..intra_op.pricing import LayerPricer, tp_layer_cost
from . import context, experts
from .comm import CommPricing
from .plan import check_compress
from .stage_memory import StageMemory, recomputed, recomputed_blocks, stage_memories, stage_memory

T = TypeVar("T")

TP_DP_SYNCS = ("whole", "shards")  # `CostModel.tp_dp_sync`

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
    moe_layers: int = 0  # expert-parallel MoE layers in the range (solver/pricing/experts.py)
    moe_bytes: float = 0.0  # per such layer and micro-batch: bytes each rank dispatches (tokens x top_k x hidden)
    expert_params: float = 0.0  # of `params`, the expert parameters this device holds
    expert_stacked: float = 0.0  # of those, the ones in stacked (E, ...) tensors, which ZeRO leaves whole
    multi_layer: float = 0.0  # of `params`, those read by several layers (tied embeddings): kept whole-step
    # of `params`, those autocast copies to 2 bytes in mixed precision (read by a matmul / linear / conv:
    # cost_models/memory.py `autocast_cast_params`; not embedding tables, not norm weights), and of those the
    # ones of the range's repeated blocks (what recomputing them re-casts)
    cast_params: float = 0.0
    block_params: float = 0.0
    # per device: the largest backward transient of an op (cost_models/memory.py) less what the range's later layers
    # freed before it, without recompute and with its blocks recomputed (they keep only their inputs)
    bwd_transient: float = 0.0
    bwd_transient_recompute: float = 0.0
    bwd_out_grad: float = 0.0  # per device: the largest op output gradient of the range (cost_models/memory.py)
    # per device, on the stage ending the model: its last layer's backward transient (the loss's), which a step's
    # first backward reaches before it has made any gradient, and the transient of the stage's other layers
    # (without and with recompute); 0 elsewhere
    bwd_loss: float = 0.0
    bwd_rest: float = 0.0
    bwd_rest_recompute: float = 0.0
    # per device, whatever the micro-batch: the largest buffer an op's backward allocates besides autograd's
    # tensors on the stage's device kind (a CPU convolution's weight gradient in oneDNN's layout)
    bwd_workspace: float = 0.0
    device_kind: str = ""  # the kind of the range's devices (`DeviceSpec.kind`; a tp group is of one kind)
    host_step: float = 0.0  # host seconds of the optimizer step over the range's tensors (cost_models/overhead.py)
    max_param: float = 0.0  # elements of the range's largest parameter tensor (an offloaded step's buffers)
    # per repeated block of the range, in layer order: (recompute seconds: forward compute + comm + host,
    # saved activation bytes per micro-batch, its input's bytes, its parameters), for selective recompute
    block_parts: tuple[tuple[float, float, float, float], ...] = ()
    # the block profile's optimizer step over the measured layers' parameters, and how many parameters it covers
    measured_step: float = 0.0
    measured_step_params: float = 0.0
    # context parallelism (cp > 1, context.py): the range's attention calls, per micro-batch and rank the bytes its
    # exchange sends (forward, backward) and its exposed seconds (in fwd_comm / bwd_comm), and the largest transient
    # one attention holds (K/V blocks in flight, all-to-all buffers)
    cp_calls: int = 0
    cp_bytes: tuple[float, float] = (0.0, 0.0)
    cp_exposed: tuple[float, float] = (0.0, 0.0)
    cp_work: float = 0.0
    in_bytes: float = 0.0  # activation bytes received from the previous stage (0 for a pipeline's first)


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
                 intra_op_time_limit_s: float = 2.0, *, compress: str | None = None,
                 tp_dp_sync: str = "whole", profiles: dict[str, Profile] | None = None,
                 block_profile: BlockProfile | None = None, context_parallel: context.ContextParallel | None = None,
                 world_size: int | None = None) -> None:
        check_memory_reserve(memory_reserve)
        check_compress(compress)
        if tp_dp_sync not in TP_DP_SYNCS:
            raise PlanError(f"tp_dp_sync={tp_dp_sync!r}: choose one of {sorted(TP_DP_SYNCS)}.")
        if not graph.layers:
            raise PlanError("the graph has no layers; annotate it first.")
        self.graph, self.cluster, self.precision = graph, cluster, precision
        self.world_size = world_size or cluster.world_size
        """The ranks a plan priced here runs among: the cluster's, or on a sub-cluster (`on_subset`) the whole
        cluster's, whose idle ranks join the world communicator, so each group of every device of the sub-cluster is
        a communicator of its own (`communicators`)."""
        self.compress = compress
        self.tp_dp_sync = tp_dp_sync
        """How data-parallel replicas of a tensor-parallel stage (one degree) sync: "whole" as autopar's runtime
        does (runtime/zero.py: whole tensors among the groups' first ranks, then a broadcast in each group), or
        "shards" as Megatron-LM does (each tp rank all-reduces its own shard with the same shard of every
        replica), each tp rank holding 1/tp of every layer's parameters as Megatron-LM shards them (a fused QKV
        by heads, vocabulary-parallel tables; `intra_op.pricing.closed_form`): for pricing runs of other systems
        (bench/measured.py), not autopar's plans."""
        """The wire dtype the user allows stage sends to be compressed to (`plan(..., compress=)`), or None:
        compression rounds activations and gradients, so the planner never chooses it unasked."""
        self.optimizer = optimizer_name(optimizer)
        self.state = state_bytes_per_param(self.optimizer, precision)
        self.reserve = memory_reserve
        self.B = graph.batch_size
        self.L = len(graph.layers)
        self.specs = {t: cluster.spec(t) for t in cluster.device_types()}
        # compute profiles by device type priced instead of the saved ones (`plan(..., profiles=)`)
        self.profiles = check_profiles(profiles, cluster)
        self.models = {t: ComputeModel(spec, self.profiles.get(t), dtype=precision) for t, spec in self.specs.items()}
        # measured blocks (`plan(..., profile=)`, cost_models/measured_blocks.py): priced instead of the analytic
        # compute and host terms of the layers, device types and tensor-parallel degrees it has
        if block_profile is not None:
            block_profile.check(graph)
        self.block_profile = block_profile
        self._init_layers()
        if block_profile is not None and self.uniform:  # blocks measured apart may differ: price each range
            self.uniform = block_profile.same_for([i for i in range(self.L) if self.is_block[i]])
        self._memo: dict[tuple, object] = {}  # every memoised price, by a key naming what it depends on (`memoised`)
        self._sigs: dict[tuple, int] = {}
        self._sig_of_group: dict[tuple[int, ...], int] = {}
        self._kinds_of_group: dict[tuple[int, ...], tuple[str, ...]] = {}
        self.intra_op, self.intra_op_time_limit_s = intra_op, intra_op_time_limit_s
        self._pricers: dict[tuple, LayerPricer | None] = {}
        self.expert_parallel: experts.ExpertParallel = experts.ExpertParallel.of(graph)
        """The expert-parallel degree priced and the graph's MoE layers (experts.py): degree 1 when built;
        `with_expert_degree` gives a copy at another degree (prices depend on it, so it is never set in place)."""
        self.context: context.ContextParallel = context_parallel or context.ContextParallel.of(graph)
        """The context-parallel degree and attention mode priced, the graph's attention calls and whether the model
        can run cp > 1 (context.py): degree 1 when built; `with_context` gives a copy at another degree. At cp > 1
        every group naming a stage (the `tp_group` arguments) is the stage's devices, cp tensor-parallel groups
        (`tp_part`: the first of them). `context_parallel`: what a cost model of the same graph found (`on_subset`)."""

    def memoised(self, key: tuple, compute: Callable[[], T]) -> T:
        """The cost model's memo entry `key`, computed by `compute` and stored when absent (or None): how the
        parts beside it (experts.py, intra_op/pricing.py, ...) cache their prices in it. A key names
        everything the value depends on, its first element the kind of price."""
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = compute()
        return hit  # type: ignore[return-value]

    def with_expert_degree(self, ep: int) -> CostModel:
        """A copy of this cost model pricing expert-parallel degree `ep`, with a fresh memo (its prices depend on
        the degree); the rest (layer data, group signatures, intra-op pricers) is shared. `experts.with_degree`
        checks `ep` and returns this model itself at its own degree."""
        out = copy.copy(self)
        out._memo = {}
        out.expert_parallel = replace(self.expert_parallel, degree=ep)
        return out

    def with_context(self, cp: int, attention: str = "ring") -> CostModel:
        """A copy of this cost model pricing context-parallel degree cp with `attention` ("ring" | "ulysses"),
        with a fresh memo (prices depend on them); the rest is shared. `context.with_degree` checks the model can
        run it and returns this model itself at its own degree."""
        out = copy.copy(self)
        out._memo = {}
        out.context = replace(self.context, degree=cp, mode=attention)
        return out

    def tp_part(self, group: tuple[int, ...]) -> tuple[int, ...]:
        """The tensor-parallel group of a stage named by `group`: the group itself at cp = 1, else its first
        len(group) / cp devices (cp rank 0's; the others are alike)."""
        cp = self.context.degree
        return group if cp == 1 else group[:len(group) // cp]

    def on_subset(self, devices: list[int]) -> CostModel:
        """This cost model on `cluster.subset(devices)`: the same graph, precision, optimizer, reserve, wire
        compression, tp/dp sync, intra-op search, compute profiles (of the types the subset keeps) and measured
        blocks, so a plan that leaves devices out is priced as the whole cluster's would be; at cp = 1 (its attention
        calls found once). Fresh memos."""
        sub = self.cluster.subset(devices)
        kept = set(sub.device_types())
        return CostModel(self.graph, sub, self.precision, self.optimizer, self.reserve, self.intra_op,
                         self.intra_op_time_limit_s, compress=self.compress, tp_dp_sync=self.tp_dp_sync,
                         profiles={t: p for t, p in self.profiles.items() if t in kept},
                         block_profile=self.block_profile, context_parallel=replace(self.context, degree=1),
                         world_size=self.world_size)

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
        self.own_max = [0] * L  # the largest parameter tensor a layer owns
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
            self.own_max[owner] = max(self.own_max[owner], info.meta.numel)
            if used - {owner}:
                self.shared.append((info.meta.numel, owner, frozenset(used)))
        # autocast's 2-byte weight copies: per layer, the elements of weights only that layer casts; weights
        # several layers cast (a tied embedding read by the logits' matmul, ...) once per stage reading them
        cast = autocast_cast_params(g)
        self.cast_own = [0] * L
        self.cast_shared: list[tuple[int, frozenset[int]]] = []
        for numel, layers in cast.values():
            if len(layers) == 1:
                self.cast_own[next(iter(layers))] += numel
            else:
                self.cast_shared.append((numel, layers))
        inputs = sum(g.input_meta[n].nbytes for n in g.inputs[:1])
        # fp32-kept saved tensors under autocast and backward transients (cost_models/memory.py)
        fp32_saved, self.bwd_transient, self.bwd_out_grad = activation_corrections(g, self.precision)
        # batch-independent backward buffers, per device kind (cost_models/memory.py `backward_workspace`)
        self.bwd_workspace = {kind: backward_workspace(g, self.precision, kind)
                              for kind in sorted({spec.kind for spec in self.specs.values()})}
        self.saved = [float(layer.saved_bytes) + x for layer, x in zip(g.layers, fp32_saved, strict=True)]
        self.boundary = [float(layer.boundary_bytes) for layer in g.layers]
        self.saved_later = [layer.saved_later for layer in g.layers]
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

    def range_max_param(self, a: int, e: int) -> int:
        """Elements of the largest parameter tensor a stage holding layers [a, e) stores (shared ones included)."""
        return max([*self.own_max[a:e], *(n for n, _, us in self.shared if any(a <= u < e for u in us))])

    def peak_inflight(self, schedule: str, ranks: int, microbatches: int, chunks: int) -> dict[int, int]:
        """`schedule.peak_inflight` of the generated schedule (memoised: replicas share it)."""
        key = ("inflight", schedule, ranks, microbatches, chunks)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = peak_inflight(cached_schedule(schedule, ranks, microbatches, chunks))
        return hit  # type: ignore[return-value]

    def usable(self, device: int, communicators: int | None = None) -> float:
        """Bytes the plan's tensors may fill: (1 - memory_reserve) of the capacity, less what the runtime
        holds outside tensors on a GPU (CUDA context, cuBLAS workspace, NCCL buffers: `runtime_reserve`)."""
        return (self.cluster.devices[device].spec.memory * (1 - self.reserve)
                - self.runtime_reserve(device, communicators))

    def runtime_reserve(self, device: int, communicators: int | None = None) -> int:
        """`cost_models.memory.runtime_reserve_bytes` of one device of this cluster whose process creates
        `communicators` NCCL communicators (`communicators`); None: the world's only, the least a
        multi-device plan creates (an upper bound on what a plan's tensors may fill)."""
        spec = self.cluster.devices[device].spec
        n = int(self.world_size > 1) if communicators is None else communicators
        return runtime_reserve_bytes(spec.kind, n, spec.name)

    def communicators(self, plan: Plan) -> dict[int, int]:
        """Device -> how many NCCL communicators its process creates under `plan` (`lowering.plan_communicators`:
        the world, its tensor- and data-parallel groups, one per pipeline peer). They follow from which devices
        hold which layers alone (`price` has checked the rest of the plan), so plans alike in that share one."""
        key = ("communicators", plan.chunks, tuple(tuple((tuple(st.layers), tuple(st.devices)) for st in p.stages)
                                                   for p in plan.pipelines))
        return self.memoised(key, lambda: {d: len(sets) for d, sets in
                                           plan_communicators(plan, self.graph, self.world_size).items()})

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

    def host_allocator(self, device: int) -> bool:
        """Whether the device computes in its host's memory through the CPU allocator (the `cpu` device kind)."""
        return self.cluster.devices[device].spec.kind == CPU_KIND

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

    def measured(self, layer: int, dtype: str, n: int, tp: int) -> Measured | None:
        """The block profile's seconds of `layer` per micro-batch of n samples on device type `dtype` at
        tensor-parallel degree tp, or None where it has none (memoised)."""
        if self.block_profile is None:
            return None
        return self.memoised(("measured", layer, dtype, n, tp), lambda: self.block_profile.times(  # type: ignore[union-attr]
            dtype, layer, tp, self.precision, n) or False) or None

    def compute_source(self, a: int, e: int, dtype: str, n: int, tp: int) -> str:
        """Where the compute of layers [a, e) on `dtype` came from (a plan stage's `compute_source`): which layers
        the block profile measured, or "" when none (all analytic)."""
        if self.block_profile is None or self.context.degree > 1:  # cp: measured on whole sequences, not used
            return ""
        hits = [(i, m) for i in range(a, e) if (m := self.measured(i, dtype, n, tp)) is not None]
        if not hits:
            return (f"analytic: {self.block_profile.name} has no layer on {dtype} at tensor-parallel degree {tp} "
                    f"(measured: {', '.join(self.block_profile.coverage()) or 'nothing'})")
        rest = (e - a) - len(hits)
        span = f"layer {hits[0][0]}" if len(hits) == 1 else f"{len(hits)} layers {hits[0][0]}..{hits[-1][0]}"
        return (f"{span} from {hits[0][1].source}"
                + (f"; {rest} other layer(s) analytic" if rest else ""))

    def device_kinds(self, group: tuple[int, ...]) -> tuple[str, ...]:
        """The device kinds (`DeviceSpec.kind`) among a group's devices, sorted (memoised)."""
        hit = self._kinds_of_group.get(group)
        if hit is None:
            hit = self._kinds_of_group[group] = tuple(sorted({self.cluster.devices[d].spec.kind for d in group}))
        return hit

    def base(self, a: int, e: int, dtype: str, n: int, tp_group: tuple[int, ...]) -> StageBase:
        key = ("b", self.range_key(a, e), dtype, n, self.group_sig(tp_group), self.device_kinds(tp_group))
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._base(a, e, dtype, n, tp_group)
        return hit  # type: ignore[return-value]

    def _base(self, a: int, e: int, dtype: str, n: int, group: tuple[int, ...]) -> StageBase:
        cp = self.context.degree  # cp > 1: each rank computes n / cp samples' worth of tokens (context.py)
        tp_group = self.tp_part(group)
        t, frac = len(tp_group), n / (self.B * cp)
        cp_calls, cp_f, cp_b, cp_xf, cp_xb, cp_work = 0, 0.0, 0.0, 0.0, 0.0, 0.0
        f = b = fc = bc = rc = rc_comm = act = act_rc = work = transient = workspace = 0.0
        workspaces = [self.bwd_workspace[k] for k in self.device_kinds(tp_group)]
        extra = tp_max = 0.0
        ilp = t > 1 and any(self.is_block[a:e])
        parts = []
        measured: list[int] = []
        stepped: list[int] = []
        later: list[tuple[float, float, float]] = []  # per layer: backward transient, bytes kept, kept under recompute
        out_grad = 0.0
        mf = mb = mrc = ms = msp = 0.0  # measured layers' seconds (host time included: no host terms, no floor)
        for i in range(a, e):
            if cp > 1:
                x = context.layer_cost(self, i, dtype, n, group)
                c, m = x.cost, None
                cp_calls, cp_f, cp_b, cp_xf, cp_xb = (cp_calls + x.calls, cp_f + x.bytes_f, cp_b + x.bytes_b,
                                                      cp_xf + x.exposed_f, cp_xb + x.exposed_b)
                cp_work = max(cp_work, x.work)
            else:
                c = tp_layer_cost(self, i, dtype, n, tp_group)
                m = self.measured(i, dtype, n, t)
            if m is not None:
                measured.append(i)
                mf, mb = mf + m.fwd_s, mb + m.bwd_s
                mrc += m.recompute_s if self.is_block[i] else 0.0
                step = self.block_profile.step_seconds(dtype, i, t, self.precision, self.optimizer)  # type: ignore[union-attr]
                if step is not None:
                    stepped.append(i)
                    ms, msp = ms + step, msp + self.own_params[i]
                c = c._replace(fwd=0.0, bwd=0.0)
            f, b, fc, bc = f + c.fwd, b + c.bwd, fc + c.fwd_comm, bc + c.bwd_comm
            saved = c.act if c.act >= 0 else self.saved[i] * frac / t
            # what only layers past the stage save (its output, mostly) stays with them: the next stage keeps its
            # received copy (`recv` below), not this one
            cross = sum(nbytes for first, nbytes in self.saved_later[i] if first >= e)
            if cross:
                saved = max(0.0, saved - cross * frac / t)
            act += saved
            extra += self.own_params[i] * (c.param_frac - 1 / t)
            tp_max = max(tp_max, self.own_params[i] * c.param_frac)
            ilp = ilp and (c.ilp or not self.is_block[i])
            if self.is_block[i]:
                rc, rc_comm = rc + c.fwd, rc_comm + c.fwd_comm
                act_rc += self.in_bytes[i] * frac
                work = max(work, saved)
                h = stage_host_seconds(self, i, i + 1, dtype)
                again = (m.recompute_s if m is not None else
                         floored(c.fwd, h.recompute, h.launch_recompute, h.charged_recompute, h.bound))
                # a recomputed first block keeps the stage's received input, already counted (`recv`)
                parts.append((again + c.fwd_comm, saved, self.in_bytes[i] * frac if i > a or a == 0 else 0.0,
                              float(self.cast_own[i])))
            else:
                act_rc += saved
            # a layer's backward transient comes after the later layers' backwards freed what they saved (under
            # recompute their blocks keep only their inputs): the stage's is the largest, less that
            kept_rc = self.in_bytes[i] * frac if self.is_block[i] else saved
            later.append((self.bwd_transient[i] * frac / t, saved, kept_rc))
            out_grad = max(out_grad, self.bwd_out_grad[i] * frac / t)
            workspace = max([workspace] + [per_kind[i] for per_kind in workspaces])
        # a stage after the first keeps each in-flight micro-batch's received input (runtime/program.py: its
        # gradient is sent back from it), saved by its layers or not; a recomputed first block's kept input is it
        recv = self.in_bytes[a] * frac if a > 0 else 0.0
        act += recv
        act_rc += 0.0 if self.is_block[a] else recv
        freed = freed_rc = transient_rc = rest = rest_rc = 0.0
        loss = later[-1][0] if e == self.L and later else 0.0  # (stage_memory.py: a step's first backward)
        for j, (tr, saved_i, kept_rc) in enumerate(reversed(later)):
            transient, transient_rc = max(transient, tr - freed), max(transient_rc, tr - freed_rc)
            if j or not loss:
                rest, rest_rc = max(rest, tr - freed), max(rest_rc, tr - freed_rc)
            freed, freed_rc = freed + saved_i, freed_rc + kept_rc
        # host/framework time: the floor under the kernels, or added to them on a CPU (cost_models/overhead.py)
        host = stage_host_seconds(self, a, e, dtype, tuple(measured), tuple(stepped))
        f = floored(f, host.fwd, host.launch_fwd, host.charged_fwd, host.bound) + mf
        b = floored(b, host.bwd, host.launch_bwd, host.charged_bwd, host.bound) + mb
        rc = floored(rc, host.recompute, host.launch_recompute, host.charged_recompute, host.bound) + rc_comm + mrc
        params, biggest = self.range_params(a, e)
        multi = float(sum(n for n, _, us in self.shared if any(a <= u < e for u in us)))
        blocks = float(sum(self.cast_own[i] for i in range(a, e) if self.is_block[i]))
        cast = float(sum(self.cast_own[a:e]) + sum(n for n, us in self.cast_shared if any(a <= u < e for u in us)))
        base = StageBase(f, b, fc, bc, rc, params, biggest, act, act_rc, work, self.boundary[e - 1] * frac,
                         any(self.is_block[a:e]), "none" if t == 1 else "ilp" if ilp else "closed_form",
                         extra, tp_max, multi_layer=multi, cast_params=cast, block_params=blocks,
                         bwd_transient=transient, bwd_transient_recompute=transient_rc, bwd_out_grad=out_grad,
                         bwd_loss=loss, bwd_rest=rest, bwd_rest_recompute=rest_rc,
                         bwd_workspace=workspace,
                         device_kind=self.device_kinds(tp_group)[0],
                         host_step=host.step, max_param=float(self.range_max_param(a, e)),
                         block_parts=tuple(parts), measured_step=ms, measured_step_params=msp,
                         cp_calls=cp_calls, cp_bytes=(cp_f, cp_b), cp_exposed=(cp_xf, cp_xb), cp_work=cp_work,
                         in_bytes=recv)
        return experts.adjust_base(self, a, e, dtype, n / cp if cp > 1 else n, t, base)

    def layer_pricer(self, dtype: str, tp_group: tuple[int, ...]) -> LayerPricer | None:
        """The intra-op ILP's per-layer pricer for a tensor-parallel group (None when it is switched off)."""
        key = (dtype, self.group_sig(tp_group))
        if key not in self._pricers:
            self._pricers[key] = LayerPricer(self.graph, len(tp_group), dtype, self.cluster, tp_group,
                                             self.intra_op_time_limit_s, profile=self.profiles.get(dtype)
                                             ) if self.intra_op else None
        return self._pricers[key]

    # ---- options ------------------------------------------------------------------------------
    def stage_times(self, base: StageBase, opt: Option, dtype: str, tp_group: tuple[int, ...],
                    dp_group: tuple[int, ...], dp_sig: int | None = None, layerwise: bool = True,
                    mixed_tp: bool = False) -> StageTimes:
        """Per-micro-batch times and the per-step sync of a stage with option `opt` (pricing.py's docstring).
        `dp_sig` is `group_sig(dp_group)` when the caller has it. Without `layerwise` (`plan.layerwise_stages`)
        the runtime's ZeRO-2/3 is whole-step: one gather at the start of the step and one reduction after the
        schedule, i.e. ZeRO-1's communication (and memory), priced so. `mixed_tp`: the stage's data-parallel
        peers run at different tensor-parallel degrees (a tp per pipeline class), so the sync moves what
        runtime/zero.py moves then: whole (unsharded) tensors among the groups' first ranks, after each group
        gathers them and before it broadcasts the result (`_mixed_tp_sync`). Memoised per base (by identity,
        the entry holding the base so its id stays its own), option, groups and modes: the search prices one
        range's options at many micro-batch counts, which these times do not depend on."""
        key = ("st", id(base), opt.zero, recomputed_blocks(base, opt.recompute), opt.offload, dtype, tp_group, dp_group,
               layerwise, mixed_tp)
        hit = self._memo.get(key)
        if hit is None or hit[0] is not base:  # type: ignore[index]
            hit = self._memo[key] = (base, self.options_times(base, [opt], dtype, tp_group, dp_group, dp_sig,
                                                              layerwise, mixed_tp)[0])
        return hit[1]  # type: ignore[index]

    def options_times(self, base: StageBase, opts: list[Option], dtype: str, tp_group: tuple[int, ...],
                      dp_group: tuple[int, ...], dp_sig: int | None = None, layerwise: bool = True,
                      mixed_tp: bool = False) -> list[StageTimes]:
        """`stage_times` of one stage under each of `opts` (not memoised): what does not depend on the option
        (the data-parallel collectives, the host link, the all-to-alls) is computed once for all of them."""
        w, g, o = self.state.weights, self.state.grads, self.state.optimizer
        tp_group = self.tp_part(tp_group)  # (at cp > 1 the stage's devices name it: `context`)
        t, D = len(tp_group), len(dp_group)
        N = base.params / t + base.tp_extra
        key = ("dp", N, self.group_sig(dp_group) if dp_sig is None else dp_sig, t)  # same for every option
        # tensor-parallel replicas (mixed degrees or not) sync as runtime/zero.py does: whole tensors among the
        # groups' first ranks (`_mixed_tp_sync`)
        whole = mixed_tp or (t > 1 and D > 1 and self.tp_dp_sync == "whole")
        hit = self._memo.get(key) if not whole else self._mixed_tp_sync(base, tp_group, dp_group)
        if hit is None:
            # the stage's data-parallel group syncs its shards (t = 1)
            hit = self._memo[key] = (self.collective("all_gather", N * w, dp_group, t),
                                     self.collective("reduce_scatter", N * g, dp_group, t),
                                     self.collective("all_reduce", N * g, dp_group, t))
        ag, rs, ar = hit  # type: ignore[misc]
        host = self.specs[dtype].host_link
        h2d = lambda x: host.latency + x / host.bandwidth if x > 0 else 0.0  # host link: latency + bytes / bandwidth
        h2d_w, h2d_g = h2d(N * w), h2d(N * g)
        bandwidth = self.models[dtype].bandwidth
        zero_extra = experts.zero_extra(self, base, D) if base.moe_layers else 0.0
        recomputes: dict[int, tuple[float, float, float, float]] = {}
        a2a: dict[int, tuple[float, float, float]] = {}
        out = []
        for opt in opts:
            z = opt.zero if D > 1 else 0
            if not layerwise:
                z = min(z, 1)
            k = recomputed_blocks(base, opt.recompute)
            rc = recomputes.get(k)
            if rc is None:
                rc = recomputes[k] = recomputed(base, opt.recompute)
            rc_time, act = rc[0], rc[1]
            # expert parallelism: all-to-alls, and expert state synced (and ZeRO-partitioned) among its holders only
            moe = a2a.get(z)
            if moe is None:
                moe = a2a[z] = experts.a2a_times(self, base, tp_group, dp_group, z) if base.moe_layers \
                    else (0.0, 0.0, 0.0)
            a2a_f, a2a_b, moe_sync = moe
            fc, bc = base.fwd_comm + a2a_f, base.bwd_comm + a2a_b
            if z == 3:
                fc, bc = fc + ag, bc + ag
            if z >= 2:
                bc += rs
            streamed = "params" in opt.offload
            if streamed:
                fc, bc = fc + h2d_w, bc + h2d_w + h2d_g
            if "activations" in opt.offload:
                fc, bc = fc + h2d(act), bc + h2d(act)
            sync = (ar, rs + ag, ag, 0.0)[z] + moe_sync + base.host_step
            local = N / D + zero_extra if z >= 1 else N
            if "optimizer" in opt.offload:
                sync += 0.0 if streamed else h2d(local * g) + h2d(local * w)
                sync += 2 * (w + g + o) * local / HOST_UPDATE_BANDWIDTH
            elif base.measured_step and N:  # the profile's measured step over its share, the rest analytic
                share = min(1.0, base.measured_step_params / base.params) if base.params else 0.0
                sync += base.measured_step * local / N + 2 * (w + g + o) * local * (1 - share) / bandwidth
            else:
                sync += 2 * (w + g + o) * local / bandwidth
            fwd = base.fwd + fc
            bwd = base.bwd + bc + rc_time
            gather = (ag if z == 3 else 0.0) + (h2d_w if streamed else 0.0)
            reduce = (rs if z >= 2 else 0.0) + (h2d_g if streamed else 0.0)
            out.append(StageTimes(fwd, bwd, fc + bc, sync, gather, reduce))
        return out

    def _mixed_tp_sync(self, base: StageBase, tp_group: tuple[int, ...], dp_group: tuple[int, ...]
                       ) -> tuple[float, float, float]:
        """(all-gather, reduce-scatter, all-reduce) seconds of a stage whose data-parallel peers are
        tensor-parallel groups (of one degree or several): runtime/zero.py reduces whole tensors (all of the
        stage's parameters, E) among the groups' first ranks, once (not t groups at once), and a tp group
        first gathers its shards (all-gather of E g over it) and then broadcasts the result to its ranks (as
        much again)."""
        w, g = self.state.weights, self.state.grads
        E = float(base.params)

        def compute() -> tuple[float, float, float]:
            inner = 2 * self.collective("all_gather", E * g, tp_group)
            return (self.collective("all_gather", E * w, dp_group) + inner,
                    self.collective("reduce_scatter", E * g, dp_group) + inner,
                    self.collective("all_reduce", E * g, dp_group) + inner)

        return self.memoised(("dp-mixed-tp", E, tp_group, dp_group), compute)

    def stage_memory(self, base: StageBase, opt: Option, tp: int, dp: int, layerwise: bool = True) -> StageMemory:
        """Peak device (and host) bytes of a stage, as the runtime keeps them (solver/pricing/stage_memory.py); memoised
        as `stage_times` is. `tp`: the devices of the group naming the stage (at cp > 1, cp tensor-parallel groups:
        the tensor-parallel degree is tp / cp); `dp`: its parameters' replicas (at cp > 1, dp x cp)."""
        tp = max(1, tp // self.context.degree)
        key, mem = self._memory_entry(base, opt, tp, dp, layerwise)
        if mem is None:
            mem = stage_memory(self, base, opt, tp, dp, layerwise)
            self._memo[key] = (base, mem)
        return mem

    def options_memory(self, base: StageBase, opts: list[Option], tp: int, dp: int, layerwise: bool = True
                       ) -> list[StageMemory]:
        """`stage_memory` of one stage under each of `opts`, what does not depend on the option computed once;
        the entries join `stage_memory`'s memo."""
        tp = max(1, tp // self.context.degree)
        entries = [self._memory_entry(base, opt, tp, dp, layerwise) for opt in opts]
        out = [mem for _, mem in entries]
        missing = [i for i, mem in enumerate(out) if mem is None]
        if missing:
            mems = stage_memories(self, base, [opts[i] for i in missing], tp, dp, layerwise)
            for i, mem in zip(missing, mems, strict=True):
                self._memo[entries[i][0]] = (base, mem)
                out[i] = mem
        return out  # type: ignore[return-value]

    def _memory_entry(self, base: StageBase, opt: Option, tp: int, dp: int, layerwise: bool
                      ) -> tuple[tuple, StageMemory | None]:
        """`stage_memory`'s memo key (`tp` per tensor-parallel group already) and its entry, None when absent or
        left by another `base` under a reused id."""
        key = ("sm", id(base), opt.zero, recomputed_blocks(base, opt.recompute), opt.offload, tp, dp, layerwise)
        hit = self._memo.get(key)
        return key, (hit[1] if hit is not None and hit[0] is base else None)  # type: ignore[index]


__all__ = ["HOST_UPDATE_BANDWIDTH", "CostModel", "Option", "StageBase", "StageTimes", "inflight_closed_form"]
