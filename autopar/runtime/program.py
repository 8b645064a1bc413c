"""The per-rank training program: the executor of a rank's lowered action list, p2p, gradient sync, optimizer.

Every rank runs the same script. `lowering.lower(plan, graph, rank)` says what the rank executes: its
(pipeline, stages), groups, parameter placements and its action list. The program cuts the stage programs
for its layers (at each of its pipeline's micro-batch sizes) and executes the list: forward, send
activations, receive gradients, backward, and the per-layer memory actions around them (zero_layers.py).
Micro-batch losses are weighted by size / global batch and replica gradients summed, so one step equals
one single-device step on the whole global batch (for losses that average over the batch). Each stage's ZeRO level and
CPU offload (`StageLayout.zero`, `.offload`) are carried out by `zero.ZeroRuntime`; see zero.py for what
each level partitions and at which granularity. Plain data-parallel layouts all-reduce gradients in
buckets overlapped with backward (grad_sync.py). Stage transfers carry every value in its own dtype, or
floating values in the boundary's `StageLayout.compress` dtype (bf16 / fp16; see `dist.pack`).
`eval_step` (eval.py) runs the forward only and returns the model output on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental import implicit_replication

from ..codegen.split import StageProgram, model_outputs, split_stages
from ..errors import FusedKernelWarning, PlanError
from ..ir.graph import TrainingGraph
from ..ir.lowered import PipelineLayout, RankProgram
from ..ir.schedule import MEMORY_OF, Action
from ..ir.schedule_nccl import TRANSFER_KINDS
from ..lowering import layout_of, lower
from ..passes.capture import Captures, LossFn
from ..passes.randomness import Draws, draws, draws_random, keyed_randomness, remembering
from ..passes.sequence_split import loss_is_token_mean, sequence_roles
from .context_parallel import ContextParallel
from .devices import CommDevices, check_one_device_kind, move_to, plan_rank_device
from .dist import (
    DEFAULT_TIMEOUT_S,
    Groups,
    PeerLostError,
    backend_of,
    batch_p2p,
    message_bytes,
    on_comm_device,
    pack,
    unpack,
    wait,
)
from .elastic import naming_lost_ranks, start_heartbeat
from .expert_parallel import expert_groups, expert_runtime
from .grad_sync import BucketedGradSync, first_use_order, plain_data_parallel
from .layered import NoHooks, layer_calls, layered, node_layers
from .plan_check import PlanCheck, RunReport, stage_times
from .precision import PrecisionPolicy
from .split_backward import PendingWeights, backward_input, backward_weight
from .straggler import StageTimer, StragglerReport
from .tensor_parallel import TPSpec, TPStage, megatron_spec, sharding_spec
from .weights import ModelWeights, WeightsArg
from .zero import ZeroRuntime, offload_activations
from .zero_layers import LayerwiseMemory

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class PendingRecv:
    """A receive posted in a batch (`Program._post`), waited and unpacked where its values are consumed."""

    def __init__(self, works: list[Any], flat: torch.Tensor, metas: list, wire: Any, st: StageProgram,
                 names: list[str], grad: bool, what: str, peer: int) -> None:
        self.works, self.flat, self.metas, self.wire = works, flat, metas, wire
        self.st, self.names, self.grad, self.what, self.peer = st, names, grad, what, peer

    def take(self, timeout_s: float) -> list[torch.Tensor]:
        for work in self.works:
            wait(work, self.what, self.peer, timeout_s)
        out = unpack(self.flat, self.metas, self.wire)
        self.works, self.flat = [], None  # the message is unpacked into fresh tensors: its buffer goes now
        for n, t in zip(self.names, out, strict=True):
            if self.grad and n in self.st.grad_values:
                t.requires_grad_(True)
        return out


def finish_sends(sends: list[tuple[Any, Any, list[torch.Tensor]]], what: str, timeout_s: float) -> None:
    """Wait for a batch's sends (`Program._post`'s second result). A function, not a loop in the executor: a
    loop's variables would keep the last message's buffer alive until the next batch."""
    for work, peer, _buffers in sends:
        wait(work, what, peer, timeout_s)


def structure_capture(captures: Captures, model: nn.Module, plan: Any, rank: int, inputs: tuple, target: Any,
                      loss_fn: LossFn | None) -> TrainingGraph:
    """The capture a rank's Program lowers with when it has none at the global batch: the one at the rank's first
    micro-batch size, which its stages then take from the memo (what lowering reads of a graph, its layers,
    parameters and nodes, does not depend on the batch size; each stage's capture is checked to have the same
    layers). The global batch's when the plan does not say its layer count. `inputs`, `target`: the global
    batch as the capture reads it (`ModelWeights.capture_args`)."""
    size = batch = plan.global_batch
    if plan.model.get("num_layers") is not None:
        layout = layout_of(plan, plan.model["num_layers"])
        pos = layout.position(rank)
        size = min(layout.pipelines[pos.pipeline if pos is not None else 0].microbatch_sizes)
    mb_target = batch_slice(target, batch, 0, size) if target is not None else None
    return captures.capture(model, tuple(batch_slice(x, batch, 0, size) for x in inputs), loss_fn, mb_target,
                            sources=False)


def batch_slice(x: Any, batch: int, start: int, size: int) -> Any:
    """Samples [start, start + size) of an input whose first dimension is the global batch; any other value as is."""
    if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch:
        return x[start:start + size]
    return x


def make_optimizer(optimizer: str | OptimizerFactory, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if callable(optimizer):
        return optimizer(params)
    table = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
    if optimizer not in table:
        raise PlanError(f"unknown optimizer {optimizer!r}: pass one of {sorted(table)} or a factory "
                        f"`lambda params: torch.optim.X(params, ...)`.")
    return table[optimizer](params, lr=1e-3) if optimizer != "sgd" else table[optimizer](params, lr=1e-2)


class Program:
    """A compiled training program; `step()` trains on one global batch across the whole cluster.

    `params` maps canonical names to this rank's parameters (tensor-parallel shards as DTensors). Between
    steps, those a rank does not keep under ZeRO-3 or keeps on the host ("params" offload) have their
    storage freed (`untyped_storage().nbytes() == 0`); read values through `state_dict()`. `optimizer` is
    the user's optimizer over the parameters this rank updates (their CPU copies with "optimizer"
    offload), or None when it updates none.
    """

    def __init__(self, model: nn.Module, plan: Any, example_inputs: tuple, example_target: Any,
                 loss_fn: LossFn | None, optimizer: str | OptimizerFactory, rank: int, world_size: int,
                 timeout_s: float = DEFAULT_TIMEOUT_S, kernels: str = "auto",
                 weights: WeightsArg = None, graph: TrainingGraph | None = None,
                 device: torch.device | None = None, seed: int = 0, captures: Captures | None = None) -> None:
        """`plan`: an `autopar.Plan` (what `autopar.plan`, `estimate` or `plan_from_strategy` return).
        `graph`: the model's capture at the global batch (`capture(model, example_inputs, ...)`), when the
        caller has it (a compile where autopar plans does); without it the program lowers with its first
        micro-batch capture, which it makes for its stages anyway (`structure_capture`). `captures`: the memo of the
        model's captures this program takes its micro-batch captures from and adds its own to (compile keeps one
        per compile, so a rebuilt program of the same model captures nothing it has). `device`: where this rank
        computes (default: the plan's device of `rank`, devices.py's rule; the device audit passes meta).
        `seed`: what the random ops' keyed stream starts from (passes/randomness.py), the same on every rank."""
        self.plan = plan
        self.seed = seed
        self.kernels = kernels
        self.kernel_reports: dict[tuple[int, int], Any] = {}
        self.rank, self.world_size = rank, world_size
        self.loss_fn = loss_fn
        self.timeout_s = timeout_s
        self.step_count = 0
        self._model = model
        # the rank's device, not the model's: its share of the parameters, its inputs and messages go there
        self.device = torch.device(device) if device is not None else plan_rank_device(plan, rank)
        # forward/backward seconds per step, for straggler_report(): CUDA events on a GPU rank, the host clock else
        self.timer = StageTimer(rank, device=self.device)
        self.comm = CommDevices.of_plan(plan, self.device)  # where each group's tensors go (the mixed-world rule)
        # values of this rank's tensors (weights.py): `weights` is checked against the model before any collective
        self._weights = ModelWeights(model, weights, device=self.device)
        # the values the user gave: a meta-built model is captured from meta stand-ins, but the cp loss check reads
        # which tokens the target counts
        self._example_target = example_target
        example_inputs, example_target = self._weights.capture_args(example_inputs, example_target)
        self.amp = PrecisionPolicy.of_plan(plan, self.device, timeout_s)  # autocast / loss scaling (precision.py)
        self._has_target = loss_fn is not None
        self._captures = captures if captures is not None else Captures()
        self.graph = graph if graph is not None else \
            structure_capture(self._captures, model, plan, rank, example_inputs, example_target, loss_fn)
        self.lowered: RankProgram = lower(plan, self.graph, rank)  # what this rank executes
        layout = self.lowered.layout
        if world_size != layout.world_size:
            raise PlanError(f"the plan is for {layout.world_size} ranks but {world_size} processes were "
                            f"started; launch one process per device (e.g. torchrun --nproc-per-node "
                            f"{layout.world_size}).")
        self.layout = layout
        self._check_device_kinds()
        self.holders = self.lowered.holders
        self.experts = expert_runtime(model, layout, rank, timeout_s)  # None without expert parallelism
        ep_sets = self.experts.group_sets(self.holders) if self.experts else set()
        if self.experts:
            self.holders = self.experts.restrict_holders(self.holders)
        reps = {tuple(g[0] for g in groups) for groups in self.holders.values()}  # experts restrict holders
        self.groups = Groups(sorted(set(self.lowered.groups) | reps | ep_sets), world_size)
        if self.experts:
            self.experts.bind(self.groups)
        self.position = layout.position(rank)
        self.tp: TPStage | None = None
        if self.position is not None:
            my_group = tuple(self.pipeline.stages[self.position.stages[0]].ranks)
            if len(my_group) > 1:
                mesh = DeviceMesh.from_group(self.groups.get(my_group), self.device.type)
                spec = TPSpec()
                # with experts, placements come from the graph the stages run (MoE blocks dispatching)
                spec_graph = self.experts.capture(model, example_inputs, loss_fn, example_target) \
                    if self.experts else self.graph
                for s in self.position.stages:
                    st = self.pipeline.stages[s]
                    part = (megatron_spec(spec_graph, st.layers) if st.sharding is None
                            else sharding_spec(spec_graph, st.layers, dict(st.sharding)))
                    spec.params.update(part.params)
                    spec.relayout.update(part.relayout)
                self.tp = TPStage(mesh, spec)
                if self.experts:
                    self.experts.adapt_tp(self.tp, spec_graph)
        self.cp = self._context_parallel(example_inputs)  # None without context parallelism
        self._stages: dict[tuple[int, int], StageProgram] = {}  # (stage, micro-batch size) -> program
        self.params: dict[str, nn.Parameter] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        if self.position is not None:
            pipe = self.pipeline
            for size in sorted(set(pipe.microbatch_sizes)):
                programs = self._capture_stages(model, example_inputs, example_target, pipe, size)
                for s in self.position.stages:
                    self._stages[(s, size)] = self.amp.prepare(programs[s])
            for st in self._stages.values():
                self._weights.retarget(st)  # devices named in the capture (arange, to) -> the rank's
                for name in st.params:
                    if name not in self.params:
                        value = self._weights.param(name, self.tp, self.experts)
                        if value is None:
                            continue  # another rank's expert: the stage gets a placeholder
                        self.params[name] = nn.Parameter(value)
                        if self.tp is not None:
                            self.tp.keep_grad_placement(self.params[name])
                for name in st.buffers:
                    if name not in self.buffers:
                        self.buffers[name] = self._weights.constant(st.constants[name]) \
                            if name in st.constants else self._weights.buffer(name)
        self.zero = self._zero_runtime()
        self.layers = self._layer_hooks()
        for (s, size), st in self._stages.items():
            self._with_kernels(st, s, size)
        self._say_how_kernels_round()
        self.grad_sync = self._bucketed_sync()
        self.optimizer = self.zero.build_optimizer(lambda params: make_optimizer(optimizer, params))
        if world_size > 1:
            self._first_world_collective()
            start_heartbeat()  # lets a failed rank's peers name it (elastic.peer_lost)

    # ---- construction helpers --------------------------------------------------------------------
    def _check_device_kinds(self) -> None:
        """PlanError when a tensor-parallel or expert-parallel group spans `cpu` and accelerator ranks
        (devices.check_one_device_kind): those cannot stage through the host."""
        from ..cluster import Cluster

        groups = {f"stage {s} of pipeline {p.index} (its tensor-parallel group)": st.ranks
                  for p in self.layout.pipelines for s, st in enumerate(p.stages) if len(st.ranks) > 1}
        if self.layout.ep > 1:
            groups.update({f"expert-parallel group {i}": g for i, g in enumerate(expert_groups(self.layout))})
        check_one_device_kind(groups, Cluster.load(self.plan.cluster))

    def _first_world_collective(self) -> None:
        """One all-reduce over the world group on every rank, before any transfer. torch's
        `batch_isend_irecv` docstring: "if this API is the first collective call in the group passed to
        dist.P2POp, all ranks of the group must participate in this API call"; a step's batches use the
        world group and ranks outside a pipeline's transfers never call them, so the world's first
        collective is this one (on the world's comm device: every rank the same backend). gloo has no such
        rule, and a program rebuilt while survivors re-route (gloo only) must not meet the abort watch here."""
        if backend_of(dist.group.WORLD, self.comm.world) == "gloo":
            return
        t = torch.zeros(1, device=self.device)
        wait(on_comm_device(dist.all_reduce, self.comm.world, t, group=dist.group.WORLD, async_op=True),
             "the world group's first collective (program setup)", "in the job", self.timeout_s,
             device=self.comm.world)

    @property
    def pipeline(self) -> PipelineLayout:
        assert self.position is not None
        return self.layout.pipelines[self.position.pipeline]

    def _zero_runtime(self) -> ZeroRuntime:
        offload = {n: set(k) for n, k in self.lowered.offload.items()}
        sizes = {info.name: info.meta.numel for info in self.graph.params.values() if not info.is_buffer}
        levels = dict(self.lowered.levels)
        if self.experts:
            levels = self.experts.zero_levels(levels)
        return ZeroRuntime(self.params, self.holders, levels, sizes, offload,
                           self.rank, self.lowered.tp_group, self.groups, self.tp, self.timeout_s, self.comm)

    def _layer_hooks(self) -> LayerwiseMemory | None:
        """Run stages layer by layer where the lowered program says so: recompute per block, and the
        per-layer memory actions of its action list (layered.py, zero_layers.py). Tensor-parallel stages
        recompute per block too (each layer through the DTensor interpreter) but have no per-layer memory
        actions (whole-step ZeRO); expert-parallel stages keep whole-stage programs (their recompute is one
        checkpoint per stage, priced so: `pricing.stage_memory`)."""
        low = self.lowered
        self._memory: dict[tuple, list[Action]] = {}  # (kind, stage, micro-batch) -> its memory actions
        for a in low.actions:
            if a.kind in MEMORY_OF:
                self._memory.setdefault((MEMORY_OF[a.kind], a.stage, a.microbatch), []).append(a)
        self._layered = low.layered_stages() if self.position is not None and not self.experts else set()
        if not self._layered:
            return None
        hooks: LayerwiseMemory | NoHooks = LayerwiseMemory(self.zero, low) if self._memory else NoHooks()
        run = self.tp.interpret if self.tp is not None else None
        for (s, _), st in self._stages.items():
            if s in self._layered:
                stage = self.pipeline.stages[s]
                layer_of = node_layers(st.gm, st.node_layers, stage.layers[0])  # type: ignore[attr-defined]
                st.gm = layered(st.gm, layer_of, hooks, set(low.recompute.get(s, ())), run)
        return hooks if isinstance(hooks, LayerwiseMemory) else None

    def _bucketed_sync(self) -> BucketedGradSync | None:
        """DDP-style overlapped gradient all-reduce where the layout is plain data parallel (grad_sync.py)."""
        if self.world_size == 1 or self.position is None or not self.params or self.experts \
                or not plain_data_parallel(self.graph, self.layout, self.holders):
            return None
        reps = {tuple(g[0] for g in self.holders[n]) for n in self.params}
        if len(reps) != 1 or len(next(iter(reps))) == 1:
            return None
        group = next(iter(reps))
        carry_loss = len(group) == self.world_size and all(len(p.stages) == 1 for p in self.layout.pipelines)
        return BucketedGradSync(self.params, first_use_order(self.graph, set(self.params)),
                                self.groups.get(group), self.timeout_s, carry_loss, self.comm.of(group))

    def _context_parallel(self, inputs: tuple) -> ContextParallel | None:
        """This rank's context-parallel part (runtime/context_parallel.py), or None when its pipeline has cp 1."""
        if self.position is None or self.pipeline.seq_part[1] == 1:
            return None
        c, cp = self.pipeline.seq_part
        first = next((x for x in inputs if isinstance(x, torch.Tensor) and x.dim() >= 2), None)
        if first is None:
            raise PlanError(f"context parallelism (cp={cp}) splits each sequence along dimension 1 of the model's "
                            f"inputs, but no input has two dimensions (batch, seq): use cp=1 for this model.")
        if self.experts:
            raise PlanError("context parallelism with expert parallelism is not supported: use cp=1 or ep=1.")
        pos = self.position
        group = tuple(q.stages[pos.stages[0]].ranks[pos.tp_index] for q in self.layout.cp_siblings(pos.pipeline))
        plan_stage = self.plan.pipelines[self.pipeline.plan_index].stages[pos.stages[0]]
        return ContextParallel(int(first.shape[1]), cp, c, self.groups.get(group), plan_stage.cp_attention,
                               self.device)

    def _micro_capture(self, model: nn.Module, mb_inputs: tuple, mb_target: Any, size: int) -> TrainingGraph:
        """The capture at one micro-batch size: the program's own graph at the global batch, else the memo's
        (made once per size and model; the program's graph is the memo's when it lowered with a micro-batch
        capture)."""
        if size == self.plan.global_batch:
            return self.graph
        return self._captures.capture(model, mb_inputs, self.loss_fn, mb_target, sources=False)

    def _capture_stages(self, model: nn.Module, inputs: tuple, target: Any, pipe: PipelineLayout,
                        size: int) -> list[StageProgram]:
        mb_inputs = tuple(self._slice(x, 0, size) for x in inputs)
        mb_target = self._slice(target, 0, size) if target is not None else None
        if self.cp is not None:
            g, finish = self._capture_tokens(model, mb_inputs, mb_target, size)
        else:
            if self.experts:  # the swapped forward names this program's dispatch contexts: not kept
                g = self.experts.capture(model, mb_inputs, self.loss_fn, mb_target, sources=False)
            else:
                g = self._micro_capture(model, mb_inputs, mb_target, size)
            if len(g.layers) != len(self.graph.layers):
                raise PlanError(f"capturing at micro-batch size {size} gave {len(g.layers)} layers, not "
                                f"{len(self.graph.layers)}; the model's structure depends on the batch size.")
            finish = keyed_randomness  # plan-invariant masks (passes/randomness.py)
        programs = split_stages(g, pipe.bounds())
        layer_of = {name: node.layer for name, node in g.nodes.items()}
        for st in programs:
            st.grad_values = {n for n in st.recv + st.send if g.nodes[n].requires_grad}  # type: ignore[attr-defined]
            st.node_layers = layer_of  # type: ignore[attr-defined]
            st.gm = finish(st.gm)
            if st.eval_gm is not None:
                st.eval_gm = finish(st.eval_gm)
        return programs

    def _capture_tokens(self, model: nn.Module, mb_inputs: tuple, mb_target: Any, size: int
                        ) -> tuple[TrainingGraph, Callable[[Any], Any]]:
        """The capture of this rank's tokens (at the local sequence length, checked against the capture at the
        full length: `sequence_roles`) and what makes its stage programs run them: their token aranges and
        attentions replaced (`ContextParallel.rewrite`)."""
        cp = self.cp
        assert cp is not None
        full = self._micro_capture(model, mb_inputs, mb_target, size)
        local_in = tuple(cp.tokens(x) for x in mb_inputs)
        local_target = cp.tokens(mb_target)
        g = self._captures.capture(model, local_in, self.loss_fn, local_target, sources=False)
        if len(g.layers) != len(self.graph.layers):
            raise PlanError(f"capturing at {cp.seq_local} tokens per sequence gave {len(g.layers)} layers, not "
                            f"{len(self.graph.layers)}; the model's structure depends on the sequence length: "
                            f"use cp=1.")
        random = draws_random(g.gm)
        if random:
            raise PlanError(f"context parallelism (cp={cp.cp}) with random ops in training ({', '.join(random)}) is "
                            f"not supported: their masks would differ from the one-device program's. Set dropout to "
                            f"0 or use cp=1.")
        roles = sequence_roles(full, g, cp.seq, cp.seq_local, cp.cp, model_outputs(g.gm) or None,
                               masks_of=self.graph)  # the planner's capture: its mask checks are made
        if self._has_target and not self._loss_checked:
            self._check_token_mean(full, self._slice(self._example_target, 0, size))
        return g, functools.partial(cp.rewrite, roles=roles)

    _loss_checked = False

    def _check_token_mean(self, full: TrainingGraph, target: Any) -> None:
        """PlanError unless the loss of the example batch is the mean of each cp rank's loss on its tokens
        (what weighing each rank's loss by 1 / cp computes), with random stand-ins for the model's output."""
        cp = self.cp
        assert cp is not None
        outs = model_outputs(full.gm)
        metas = [full.nodes[o].outputs[0] for o in outs if o in full.nodes]
        if isinstance(target, torch.Tensor) and target.is_meta:
            raise PlanError(f"context parallelism (cp={cp.cp}) checks on the example target that the loss is a mean "
                            f"over tokens, and this one is on the meta device: pass example_target with values "
                            f"(e.g. the first batch's labels), or use cp=1.")
        if len(metas) != 1 or not isinstance(target, torch.Tensor):
            raise PlanError(f"context parallelism (cp={cp.cp}) splits the loss by tokens, which it checks for a model "
                            f"with one output tensor and one target tensor; this one has {len(metas)} output(s). "
                            f"Use cp=1.")
        gen = torch.Generator().manual_seed(0)
        stand_in = torch.randn(metas[0].shape, generator=gen, dtype=torch.float64)
        if not loss_is_token_mean(self.loss_fn, stand_in, target.cpu(), ContextParallel.parts(cp.seq, cp.cp)):
            raise PlanError(f"context parallelism (cp={cp.cp}) weighs each rank's loss by its share of the tokens "
                            f"(1/{cp.cp}), which equals the loss only for a mean over tokens in which every rank "
                            f"holds as many counted tokens; on the example batch this loss_fn is not (a sum, a "
                            f"per-sample weighting, or ignored tokens unevenly spread). Use cp=1.")
        self._loss_checked = True

    def _with_kernels(self, st: StageProgram, stage: int, size: int) -> None:
        """Swap fusible regions of a stage program for generated Triton kernels (see codegen/kernels.py);
        in a layered stage each layer's program on its own, so regions stay inside layers as priced."""
        from ..codegen.kernels import apply_kernels
        from ..passes.fusion_pricing import check_mode

        check_mode(self.kernels)
        if self.kernels == "torch" or self.tp is not None:  # DTensor stages keep torch ops
            return
        if stage not in self._layered:
            st.gm, report = apply_kernels(st.gm, self.kernels)
            self.kernel_reports[(stage, size)] = [report]
            return
        reports = self.kernel_reports[(stage, size)] = []
        for call in layer_calls(st.gm):
            call.inner, report = apply_kernels(call.inner, self.kernels)
            reports.append(report)

    def _say_how_kernels_round(self) -> None:
        """FusedKernelWarning (rank 0, once per program) when generated kernels will run in place of torch ops."""
        fused = [r for reports in self.kernel_reports.values() for rep in reports for r in rep.fused]
        if not fused or self.rank != 0 or not (self.kernels == "triton" or self.device.type == "cuda"):
            return
        how = ["another evaluation order and fused multiply-adds (fp32 results within rounding of torch's)"]
        if self.plan.precision in ("bf16", "fp16"):
            how.append(f"intermediates kept in fp32 inside a region, where torch's {self.plan.precision} autocast "
                       f"rounds each op's output")
        warnings.warn(FusedKernelWarning(
            f"{len(fused)} fused region(s) run as generated Triton kernels (kernels={self.kernels!r}) and round "
            f"differently from the torch ops they replace: {'; '.join(how)}. kernels='torch' runs torch's ops."),
            stacklevel=3)

    def _slice(self, x: Any, start: int, size: int) -> Any:
        return batch_slice(x, self.layout.global_batch, start, size)

    def _inputs_of(self, x: Any, start: int, size: int) -> Any:
        """A micro-batch's slice of a step input or target: its samples, and under cp this rank's tokens."""
        x = self._slice(x, start, size)
        return x if self.cp is None else self.cp.tokens(x)

    # ---- one training step ------------------------------------------------------------------------
    def step(self, *inputs: Any, target: Any = None) -> float:
        """Forward, backward and optimizer step on one global batch; returns the global mean loss (reading it,
        the final `float`, is the step's one host-device sync: tests/test_host_syncs.py)."""
        if self._has_target and target is None:
            raise PlanError("this program was compiled with a loss_fn: pass target= to step().")
        if self.plan_check is not None:
            self.plan_check.step_started()
        local_loss = torch.zeros((), dtype=torch.float64, device=self.device)  # NCCL reduces device tensors
        inputs, target = self.to_rank_device(inputs, target)
        with naming_lost_ranks(self.rank, f"step {self.step_count + 1}"):
            summed, loss_work = None, None
            if self.position is not None:
                self.zero.prepare()
                if self.grad_sync is not None:
                    self.grad_sync.prepare()
                if self.layers is not None:
                    self.layers.resident.clear()  # the last step's release freed every gathered layer
                local_loss += self._run(self.lowered.actions, inputs, target)
                summed = self._sync_gradients()
            if summed is not None:  # the loss rode in the last gradient bucket
                local_loss.fill_(summed)
            elif self.world_size > 1:  # overlaps the optimizer step
                loss_work = on_comm_device(dist.all_reduce, self.comm.world, local_loss, group=dist.group.WORLD,
                                           async_op=True)
            # fp16: every rank unscales and all agree whether to step
            stepping = self.amp.scaler is None or self.amp.unscale(self.zero.gradient_holders(), self.optimizer,
                                                                   self.world_size, self.comm.world)
            if self.position is not None:
                self.zero.step(self.optimizer if stepping else None)
            if loss_work is not None:
                wait(loss_work, "loss all-reduce", "in its group", self.timeout_s)
        self.timer.end_step()
        self.step_count += 1
        loss = float(local_loss)
        self._step_checked()
        return loss

    # ---- the plan's check of itself (runtime/plan_check.py) ---------------------------------------------
    plan_check: PlanCheck | None = None  # set by autopar.compile, which opened its window before building

    def _step_checked(self) -> None:
        if self.plan_check is not None:
            self.plan_check.step_done()

    def _end_check_window(self) -> None:
        """Before what the plan does not price (an eval, the full state gathered, a checkpoint): the memory
        window's verdict on the steps so far, so that it never measures them (a user's eval between the first
        steps would otherwise read as the plan's drift)."""
        if self.plan_check is not None:
            self.plan_check.close()

    def report(self) -> RunReport:
        """Every rank's predicted vs measured peak memory and step time (a collective: call it on every rank);
        `print(prog.report())` shows the table. See runtime/plan_check.py."""
        check = self.plan_check
        if check is None:
            check = self.plan_check = PlanCheck(self.plan, self.rank, self.device)
            check.figures.not_measured = "the program was not built by autopar.compile"
        check.close()  # fewer steps than the window's: the verdict on what ran so far
        if self.position is not None:
            recorded = self.timer.stage_steps
            # the steps after the memory window (the profiler slows those inside it on the CPU), else all
            timed = self.step_count - check.figures.window_steps
            after = recorded[max(0, len(recorded) - timed):] if timed > 0 else []
            check.figures.stage_times = stage_times(self.plan, self.pipeline.plan_index, self.rank,
                                                    after or recorded)
        return check.report(self.world_size, self._object_group if self.world_size > 1 else None)

    def to_rank_device(self, inputs: tuple, target: Any) -> tuple[tuple, Any]:
        """The step's inputs and target with those this rank's stages read moved to its device (the others
        are not read here and stay where they are)."""
        n = len(inputs)
        read = {i for st in self._stages.values() for i in st.inputs}
        moved = tuple(move_to(x, self.device) if i in read else x for i, x in enumerate(inputs))
        return moved, (move_to(target, self.device) if n in read and self._has_target else target)

    def eval_step(self, *inputs: Any) -> Any:
        """Forward only on one global batch (no gradients, no update): the model's full output for the
        whole batch, the same on every rank. Collective; see eval.py."""
        from .eval import eval_step

        self._end_check_window()
        return eval_step(self, inputs)

    def _peer(self, stage: int) -> int | None:
        """The rank of `stage` (of this rank's pipeline) this rank receives from (`PipelineLayout.source`, what
        the NCCL check resolves too); None outside the pipeline."""
        pipe = self.pipeline
        if not 0 <= stage < len(pipe.stages):
            return None
        return pipe.source(stage, self.position.tp_index)

    def _peers(self, stage: int) -> list[int]:
        """The ranks of `stage` this rank sends to (`PipelineLayout.targets`)."""
        t = len(self.pipeline.stages[self.position.stages[0]].ranks)
        return list(self.pipeline.targets(stage, self.position.tp_index, t))

    def _run(self, actions: tuple[Action, ...] | list[Action], inputs: tuple, target: Any, train: bool = True
             ) -> Any:
        """Execute this rank's action list: the one executor of training steps and of `eval_step` (which
        passes the forward-only list, `train=False`, under no_grad). Returns the rank's weighted loss sum
        (train; a float64 device tensor, read on the host once, at the end of `step`) or the last stage's
        outputs per micro-batch (eval). Memory actions run inside their F/B,
        at its layer boundaries (zero_layers.py)."""
        pipe, pos = self.pipeline, self.position
        sizes = pipe.microbatch_sizes
        n_mb = len(sizes)
        starts = [pipe.batch_offset + sum(sizes[:m]) for m in range(n_mb)]
        args = tuple(inputs) + ((target,) if self._has_target else ())
        recv_in: dict[tuple[int, int], list[torch.Tensor]] = {}
        outputs: dict[tuple[int, int], Any] = {}
        grads_out: dict[tuple[int, int], list[torch.Tensor]] = {}
        sends: list[tuple[dist.Work, int, list[torch.Tensor]]] = []
        evaluated: list[tuple[torch.Tensor, ...]] = []
        # the weighted losses stay on the device: reading each on the host would sync once per micro-batch
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        # zero-bubble schedules: B computes input gradients, W the weight gradients later (split_backward.py)
        split = any(a.kind == "W" for a in actions)
        pending: dict[tuple[int, int], PendingWeights] = {}  # (stage, micro-batch) -> what its W runs
        if split and self._memory:
            raise PlanError("the action list splits the backward (B and W) and has per-layer memory actions: the "
                            "runtime reduces a layer's gradients as its B ends, so zero-bubble schedules run "
                            "ZeRO whole-step (lowering.lower); the rank's program and its action list disagree.")
        last_b = max((i for i, a in enumerate(actions) if a.kind == ("W" if split else "B")), default=-1)
        what = "" if train else " (eval)"
        index = {a: i for i, a in enumerate(actions)}

        def outgoing(a: Action) -> tuple[list[torch.Tensor], str | None]:
            key = (a.stage, a.microbatch)
            if a.kind == "SEND_F":
                values = [o.detach() for o in outputs[key]] if train else list(outputs.pop(key))
                return values, pipe.stages[a.stage].compress
            st = self._stages[(a.stage, sizes[a.microbatch])]
            ins = [x for x, n in zip(recv_in.pop(key), st.recv, strict=True) if n in st.grad_values]
            grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in ins]
            return grads, pipe.stages[a.stage - 1].compress

        def incoming(a: Action) -> tuple[StageProgram, list[str], str, bool, str | None]:
            st = self._stages[(a.stage, sizes[a.microbatch])]
            if a.kind == "RECV_F":
                return st, st.recv, "activations" + what, train, pipe.stages[a.stage - 1].compress
            return st, [n for n in st.send if n in st.grad_values], "gradients", False, pipe.stages[a.stage].compress

        for step in self.lowered.steps_of(actions):
            if step[0].kind in TRANSFER_KINDS:  # one batch_isend_irecv; receives waited where consumed
                # the previous batch's sends finish before the next batch goes out, as in torch's pipelining
                # schedules (and on NCCL, where the stream orders them anyway): a stage holds one batch's send
                # buffers, not every message of the step
                finish_sends(sends, "send" + what, self.timeout_s)
                sends = []  # the waited buffers go before the next batch packs its own
                posted, sends = self._post(step, outgoing, incoming)
                for a, recv in posted.items():
                    (recv_in if a.kind == "RECV_F" else grads_out)[(a.stage, a.microbatch)] = recv
                continue
            action = step[0]
            i = index[action]
            s, m, kind = action.stage, action.microbatch, action.kind
            if kind == "ALLREDUCE" or kind in MEMORY_OF:
                continue  # gradients are synchronized after the schedule; memory actions run inside F/B
            key = (s, m)
            st = self._stages[(s, sizes[m])]
            memory = self._memory.get((kind, s, m), []) if train else []
            if memory and self.layers is None:
                raise PlanError(f"{action} has memory actions {memory[0]}... but stage {s} does not run layer by "
                                f"layer on this rank: the rank's program and its action list disagree.")
            if kind == "F":
                if isinstance(recv_in.get(key), PendingRecv):
                    recv_in[key] = recv_in[key].take(self.timeout_s)
                mb_args = [self._inputs_of(args[i], starts[m], sizes[m]) for i in st.inputs]
                held = [self.params[p] if p in self.params else self.experts.placeholder for p in st.params]
                received = recv_in.get(key, []) if train else recv_in.pop(key, [])  # SEND_B reads them
                vals = held + [self.buffers[b] for b in st.buffers] + mb_args + received
                gm = st.eval_gm if (st.is_last and not train) else st.gm
                n_p = len(st.params)
                run = (lambda *v, gm=gm, n_p=n_p: self.tp.run(gm, list(v[:n_p]), list(v[n_p:]))) \
                    if self.tp else gm
                if self.layers is not None:
                    self.layers.begin(action, memory)
                with offload_activations(train and "activations" in pipe.stages[s].offload), \
                        self.timer.compute(s) if train else contextlib.nullcontext(), self.amp.forward(), \
                        draws(Draws(self.seed, self.step_count, starts[m], sizes[m])):
                    if train and pipe.stages[s].recompute and s not in self._layered:  # layered: per block
                        out = torch.utils.checkpoint.checkpoint(remembering(run), *vals, use_reentrant=False)
                    else:
                        out = run(*vals)
                if self.layers is not None:
                    self.layers.end(action)
                if train:
                    outputs[key] = out
                elif st.is_last:
                    evaluated.append(tuple(out))
                else:
                    outputs[key] = out
            elif kind == "B":
                # the micro-batch's share of the samples and, under cp, of their tokens (1 / cp each rank)
                weight = sizes[m] / self.layout.global_batch / pipe.seq_part[1]
                if self.grad_sync is not None:  # all-reduce buckets launch during the last backward
                    self.grad_sync.final = i == last_b
                if self.layers is not None:  # per-layer memory actions: REDUCE as each layer's backward ends
                    self.layers.begin(action, memory)
                # the gradient received from the next stage is waited for outside the compute timer (a wait for a
                # transfer is no compute: `report()` sets these seconds against the plan's compute_s)
                out_grads = None if st.is_last else grads_out.pop(key).take(self.timeout_s)
                with implicit_replication() if self.tp else contextlib.nullcontext(), self.timer.compute(s):
                    if st.is_last:
                        loss = outputs.pop(key)
                        if pos.tp_index == 0:
                            loss_sum += loss.detach().reshape(()).to(torch.float64) * weight
                        if self.grad_sync is not None:
                            self.grad_sync.loss = loss_sum
                        outs = [self.amp.scale(loss * weight)]
                    else:
                        outs = [o for o, n in zip(outputs.pop(key), st.send, strict=True)
                                if n in st.grad_values]
                    if split:  # zero-bubble B: the received inputs' gradients only
                        pending[key] = backward_input(outs, out_grads, recv_in.get(key, []),
                                                      [self.params[p] for p in st.params if p in self.params])
                    else:
                        torch.autograd.backward(outs, out_grads)
                    # the micro-batch's output and its received gradient go now, not when the next B rebinds these
                    del outs, out_grads
                if self.layers is not None:
                    self.layers.end(action)
            elif kind == "W":  # zero-bubble W: the weight gradients its B left
                if self.grad_sync is not None:  # the buckets launch during the last W
                    self.grad_sync.final = i == last_b
                with implicit_replication() if self.tp else contextlib.nullcontext(), self.timer.compute(s):
                    backward_weight(pending.pop(key))
        finish_sends(sends, "send" + what, self.timeout_s)
        return loss_sum if train else evaluated

    def _post(self, step: tuple[Any, ...], outgoing: Callable[[Any], tuple[list[torch.Tensor], str | None]],
              incoming: Callable[[Any], tuple[StageProgram, list[str], str, bool, str | None]]
              ) -> tuple[dict[Any, PendingRecv], list[tuple[Any, Any, list[torch.Tensor]]]]:
        """Issue a batch of transfer actions (`RankProgram.steps`) with one `batch_isend_irecv` per comm device
        (`dist.batch_p2p`: pairs of accelerator ranks on the device, pairs with a rank computing on the CPU on the
        host), so NCCL progresses the device ones together (schedule_nccl.py); peers as the lowering resolves
        them (`PipelineLayout.peers`). Matching is by order, as on NCCL: every message has tag 0, so gloo
        matches them in order as well.
        `outgoing(a)`: a send's values and compression; `incoming(a)`: a receive's stage, value names, what
        for messages, whether it needs grad, compression. Returns the receives (wait with `take`) and the
        (work, peer, buffers) to wait for at the end."""
        ops: list[tuple[bool, torch.Tensor, int]] = []
        metas: dict[Any, tuple] = {}
        tp = self.position.tp_index
        for a in step:
            if a.kind.startswith("SEND"):
                values, compress = outgoing(a)
                targets = self.pipeline.peers(a, tp)
                if not targets:
                    continue
                # one message per transfer, every value in its own dtype (or the stage's compressed wire dtype)
                flat = pack(values, self.amp.wire(compress), self.device)
                ops += [(True, flat, peer) for peer in targets]
            else:
                st, names, what, grad, compress = incoming(a)
                value_metas = [(tuple(st.value_meta[n].shape), getattr(torch, st.value_meta[n].dtype)) for n in names]
                wire = self.amp.wire(compress)
                flat = torch.empty(message_bytes(value_metas, wire), dtype=torch.uint8, device=self.device)
                (peer,) = self.pipeline.peers(a, tp)
                metas[a] = (len(ops), flat, value_metas, wire, st, names, grad,
                            f"receiving {what} for stage {st.index}", peer)
                ops.append((False, flat, peer))
        # a pair with a rank computing on the CPU transfers on the host (gloo), others on the device (NCCL)
        works, sent = batch_p2p(ops, [self.comm.of((self.rank, peer)) for _, _, peer in ops]) if ops else ([], [])
        posted = {a: PendingRecv(works[k], flat, vm, wire, st, names, grad, what, peer)
                  for a, (k, flat, vm, wire, st, names, grad, what, peer) in metas.items()}
        return posted, sent

    def _sync_gradients(self) -> torch.Tensor | None:
        """Sum each parameter's gradient over every stage copy holding it (data-parallel replicas, tied
        weights); under ZeRO-2/3 only the owner keeps the sum (see `zero.ZeroRuntime.sync_gradients`).
        Plain data parallelism finishes the overlapped bucket all-reduces instead (grad_sync.py) and
        returns the global loss when it travelled with them."""
        if self.grad_sync is not None:
            return self.grad_sync.finish()
        self.zero.sync_gradients()
        return None

    # ---- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Full, unsharded state on every rank, under every ZeRO level and offload: {"model": <original
        model's state_dict>, "optimizer": {param name: state}, "step": n}, in host memory (CPU tensors).
        Each parameter's owner (its first holder without ZeRO) supplies it, moved to the host as soon as it is
        assembled, and the pieces are gathered as objects over a CPU group, so no device ever holds the whole
        state. `model.load_state_dict(sd["model"])` restores the original model."""
        self._end_check_window()
        host = lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t  # noqa: E731
        mine_p, mine_o = {}, {}
        for name in sorted(self.params):  # same order on every member of a tensor-parallel group
            if not self.zero.is_source(name):
                continue
            value, state = self.zero.full_param(name), self.zero.full_opt_state(name, self.optimizer)
            if self.zero.state[name].owner[0] == self.rank:
                mine_p[name], mine_o[name] = host(value), {k: host(v) for k, v in state.items()}
        if self.experts:  # shards of stacked expert tensors, concatenated after the gather
            mine_p, mine_o = self.experts.tag(mine_p), self.experts.tag(mine_o)
        mine = {"params": mine_p, "optimizer": mine_o,
                "buffers": {n: host(b) for n, b in self.buffers.items()}}  # copied below or by the pickling
        parts = [mine]
        if self.world_size > 1:
            parts = [None] * self.world_size
            dist.all_gather_object(parts, mine, group=self._object_group)
        params, opt, buffers = {}, {}, {}
        for part in parts:
            params.update(part["params"])
            opt.update(part["optimizer"])
            buffers.update(part["buffers"])
        if self.experts:
            params, opt = self.experts.untag(params), self.experts.untag(opt)
        model_sd = {}
        for fqn, t in self._model.state_dict(keep_vars=False).items():
            canon = self._canonical.get(fqn, fqn)
            model_sd[fqn] = params.get(canon, buffers.get(fqn, t)).clone()
        return {"model": model_sd, "optimizer": opt, "step": self.step_count}

    @functools.cached_property
    def _object_group(self) -> Any:
        """The group `state_dict` gathers objects over: the default one when it has a CPU backend (torch
        2.13's `_get_object_coll_device` then picks "cpu", as for "gloo" or "cpu:gloo,cuda:nccl"), else a
        gloo group over the world, made once (collectively, on the first `state_dict`): over NCCL alone
        every rank's pickles would be copied into GPU memory, the whole state on each device."""
        backend = str(dist.get_backend())
        if backend == "gloo" or "cpu:" in backend:
            return None
        return dist.new_group(list(range(self.world_size)), backend="gloo")

    @functools.cached_property
    def _canonical(self) -> dict[str, str]:
        """Model parameter name -> the name its values are kept under (a tied parameter's original)."""
        return {info.name: self.graph.canonical(p) for p, info in self.graph.params.items()}

    def load_state_dict(self, sd: dict) -> None:
        """Load a full state (from `state_dict`, any layout): each rank keeps its shards and, under ZeRO,
        only the parameters and optimizer state it holds."""
        model_sd = sd["model"]
        canon = self._canonical
        by_canon = {canon.get(k, k): v for k, v in model_sd.items()}
        for name in self.params:
            value, state = by_canon[name], sd.get("optimizer", {}).get(name) or {}
            if self.experts:
                value, state = self.experts.local_value(name, value), self.experts.local_state(name, state)
            self.zero.load_param(name, value)
            self.zero.load_opt_state(name, self.optimizer, state)
        with torch.no_grad():
            for name, b in self.buffers.items():
                if name in model_sd:  # non-persistent buffers (e.g. rotary tables) are not in state dicts
                    b.copy_(model_sd[name])
        self.step_count = int(sd.get("step", self.step_count))

    def save(self, path: str) -> None:
        """Write a sharded DCP checkpoint (model, optimizer state, step) to directory `path`: each entry
        by one rank. Collective. Loads under any plan or world size; see checkpoint.py."""
        from . import checkpoint

        self._end_check_window()
        if self.experts:
            self.experts.check_checkpoint()
        with naming_lost_ranks(self.rank, f"saving checkpoint {path}"):
            checkpoint.save(self, path)

    def load(self, path: str) -> None:
        """Load a checkpoint written by `save` under any plan (resharding to this one). Collective."""
        from . import checkpoint

        self._end_check_window()
        if self.experts:
            self.experts.check_checkpoint()
        with naming_lost_ranks(self.rank, f"loading checkpoint {path}"):
            checkpoint.load(self, path)

    def straggler_report(self, window: int | None = None, threshold: float = 1.5) -> StragglerReport:
        """Measured vs predicted compute per rank over the last `window` steps. Collective."""
        from . import straggler

        return straggler.report(self, window, threshold)

    def dump(self, directory: str) -> None:
        """Write this rank's generated program as rank{r}.py."""
        from pathlib import Path

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        lines = [f"# autopar generated program for rank {self.rank} of {self.world_size}"]
        if self.position is None:
            lines.append("# idle rank: takes part in collectives only")
        else:
            pipe = self.pipeline
            lines.append(f"# pipeline {pipe.index}, device group {self.position.group}, stages "
                         f"{list(self.position.stages)} of {len(pipe.stages)}, tensor-parallel index "
                         f"{self.position.tp_index}")
            lines.append(f"# batch share {pipe.batch_size} samples from offset {pipe.batch_offset}, "
                         f"micro-batches {pipe.microbatch_sizes}, schedule {pipe.schedule}")
            if self.grad_sync is not None:
                lines.append(f"# gradients: {len(self.grad_sync.buckets)} bucket(s) all-reduced during the last "
                             f"backward (grad_sync.py)")
            for s in self.position.stages:
                if pipe.stages[s].compress:
                    lines.append(f"# stage {s} sends activations to stage {s + 1} (and gets gradients back) as "
                                 f"{pipe.stages[s].compress}")
            memory = self.zero.describe()
            if memory:
                lines.append("# ZeRO / offload per parameter:")
                lines.extend(memory)
            for (s, size), st in sorted(self._stages.items()):
                lines.append(f"# --- stage {s} (layers {st.layers}), micro-batch size {size}: receives "
                             f"{st.recv}, sends {st.send}")
                lines.append(st.code)
        from ..codegen.kernels import write_kernels

        for (stage, size), reports in sorted(self.kernel_reports.items()):
            for i, report in enumerate(reports):  # one per layer program when the stage runs layer by layer
                sub = f"rank{self.rank}_kernels/stage{stage}_mb{size}" + (f"/layer{i}" if len(reports) > 1 else "")
                write_kernels(report, d / sub)
                layer = f", layer program {i}" if len(reports) > 1 else ""
                lines.append(f"# --- kernels of stage {stage}, micro-batch size {size}{layer} (files in {sub}/)")
                lines += ["# " + line for line in report.text(f"{sub}/").splitlines()]
        (d / f"rank{self.rank}.py").write_text("\n".join(lines) + "\n")


__all__ = ["Program", "PeerLostError", "make_optimizer"]
