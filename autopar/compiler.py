"""The entry points that build programs: `autopar.compile` (plan, or take a plan, lower it to this rank's
program and return it ready to train) and `train` (elastic training: re-plan on the devices that remain and
resume from the newest checkpoint, runtime/elastic.py). They sit above both the planner (api.py) and the
runtime, which never imports them."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .checks import check_seconds
from .cluster import Cluster
from .cost_models.compute import Profile
from .errors import AutoparError, CaptureError, PlanError, PrecisionChangeWarning
from .ir.graph import TrainingGraph
from .ir.plan import Plan, Strategy
from .ir.precision import precision_change
from .lowering import check_transfers, layout_of
from .passes.batch_stats import pieces_of, warn_if_batch_split
from .passes.capture import Captures, LossFn
from .passes.sequence_split import check_masks
from .report import dump_dir as _dump_dir
from .runtime import checkpoint
from .runtime.asynchronous import warn_async
from .runtime.devices import check_rank_gpu, launch_device, warn_device_order, world_comm_device
from .runtime.dist import DEFAULT_TIMEOUT_S, ensure_initialized
from .runtime.elastic import LOST_FILE, device_usable, join_attempt, lost_devices, mark_lost
from .runtime.fallback import ReplicatedProgram
from .runtime.flushless import async_program  # 2BW's flushless schedule where it runs
from .runtime.plan_check import PlanCheck
from .runtime.program import OptimizerFactory, Program, structure_capture
from .runtime.protocol import TrainingProgram
from .runtime.reroute import enabled as reroute_enabled
from .runtime.straggler import AdaptiveProgram, AdaptPolicy
from .runtime.weights import ModelWeights, WeightsArg, is_meta
from .solver.asynchronous import delay_of, flushless_problems


def warn_precision_change(model: nn.Module, cluster: Cluster, precision: str) -> None:
    """PrecisionChangeWarning when the precision autopar chose computes differently from the model's dtype."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    change = precision_change(dtype, cluster, precision)
    if change:
        warnings.warn(PrecisionChangeWarning(
            f"autopar chose precision={precision!r} for cluster {cluster.name!r} (autopar.default_precision), so "
            f"the model ({str(dtype).removeprefix('torch.')} parameters) computes differently from its own dtype: "
            f"{change}. Pass precision='fp32' to keep its math."), stacklevel=3)


def priced_optimizer(optimizer: Any) -> str:
    """The optimizer the planner prices for compile's `optimizer`: its name, or AdamW's for a factory."""
    return optimizer if isinstance(optimizer, str) else "adamw"


# ---- compile's phases: connect -> capture -> plan -> build -> wrap (each output the next one's input) -------


@dataclass(frozen=True)
class Job:
    """`connect`'s output: the cluster, this rank's device and the process group's rank and size."""

    cluster: Cluster
    device: torch.device
    rank: int
    world: int


def connect(cluster: Cluster | str | dict | os.PathLike, timeout_s: float) -> Job:
    """Phase 1: the cluster loaded, this rank's device made current (before the group exists: NCCL binds to
    it eagerly) and checked against the cluster file, and the process group joined; PlanError when the
    process count is not the cluster's device count."""
    cluster = Cluster.load(cluster)
    device = launch_device(cluster)
    if device.type == "cuda":  # before any collective: this rank's GPU is the type the cluster file says
        from .cluster import catalog_name_for_gpu

        # CUDA's default order (fastest first) may not be the cluster file's
        warn_device_order([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
        check_rank_gpu(cluster, int(os.environ.get("RANK", "0")), device, torch.cuda.get_device_name(device),
                       catalog_name_for_gpu)
    rank, world = ensure_initialized(timeout_s, device)
    if world != cluster.world_size:
        raise PlanError(
            f"the cluster has {cluster.world_size} devices but {world} process(es) are running: start "
            f"one process per device (`autopar run script.py --cluster ...` or torchrun "
            f"--nproc-per-node {cluster.world_size})."
        )
    return Job(cluster, device, rank, world)


@dataclass
class Captured:
    """`capture_model`'s output: the model's capture at one global batch (made when first asked for: where
    autopar plans, or when a phase prices a given plan), the step's example batch as the user gave it, the batch
    the capture (and the planner) read (a meta model's inputs and target as its weights allow), and the memo of
    the model's captures that every program this compile builds shares (a re-routed, re-planned or reshared
    program captures no size again). A rank that trains a given Plan never captures the global batch unless a
    phase prices it: its program lowers with its first micro-batch capture (`structure_capture`)."""

    model: nn.Module
    loss_fn: LossFn | None
    inputs: tuple
    target: Any
    capture_inputs: tuple
    capture_target: Any
    captures: Captures = field(default_factory=Captures)

    @property
    def graph(self) -> TrainingGraph:
        """The capture at the global batch (CaptureError naming the op and source line when the model cannot
        be captured)."""
        # no per-node source lines: only a dump shows them, and `dump_phase` writes the graph through `analyze`'s
        # own capture (a CaptureError still names the user's line: it comes from the failing frame)
        return self.captures.capture(self.model, self.capture_inputs, self.loss_fn, self.capture_target,
                                     sources=False)

    @property
    def global_graph(self) -> TrainingGraph | None:
        """The capture at the global batch when one was made, else None (a program then lowers with its own)."""
        return self.captures.kept(self.capture_inputs, self.loss_fn, self.capture_target, sources=False)

    def num_layers(self, plan: Plan) -> int:
        """The model's layer count: the capture's where there is one, else the plan's (which the program's
        lowering then checks against its own capture)."""
        graph = self.global_graph
        if graph is None and plan.model.get("num_layers") is not None:
            return int(plan.model["num_layers"])
        return len(self.graph.layers)


def capture_model(model: nn.Module, job: Job, inputs: tuple, example_target: Any, loss_fn: LossFn | None,
                  plan: Any, rerouting: bool) -> Captured:
    """Phase 2: the model captured where a later phase needs it, each capture once. Where autopar plans or
    prices a Strategy (`plan` None or a Strategy) rank 0 captures the global batch and plans from it; with
    `rerouting` (a lost rank's micro-batches may be re-routed) the other ranks make it too while rank 0 plans,
    so that whichever rank prices a re-routed plan after a loss, rank 0's included, has it (a capture at the
    global batch is on a recovery's critical path, not on this one); without, they capture only what their
    programs lower with. A given Plan is priced by nobody: each rank captures only its first micro-batch size,
    which its program lowers with (`structure_capture`). The ranks share their outcomes, so a model that cannot
    be captured raises the same CaptureError (naming the op and source line) on every rank and every rank falls
    back or none does. Every later phase, and every re-plan, reuses the captures."""
    capture_inputs, capture_target = ModelWeights(model).capture_args(inputs, example_target)
    captured = Captured(model, loss_fn, inputs, example_target, capture_inputs, capture_target)
    planned_here = not isinstance(plan, Plan)
    if planned_here and (job.world == 1 or rerouting):
        captured.graph  # noqa: B018  (raises here, before any other phase, when the model cannot be captured)
        return captured
    failed: Exception | None = None
    try:
        if not planned_here:
            structure_capture(captured.captures, model, plan, job.rank, capture_inputs, capture_target, loss_fn)
        elif job.rank == 0:
            captured.graph  # noqa: B018
    except Exception as e:  # sent to the peers, which would otherwise wait for a plan or a collective
        failed = e
    sent = failed if failed is None or isinstance(failed, AutoparError) else AutoparError(
        f"rank {job.rank} failed to capture the model: {failed!r}")
    if job.world == 1:
        outcomes = [sent]
    elif planned_here:  # only rank 0 captured
        outcomes = [sent]
        dist.broadcast_object_list(outcomes, src=0, device=world_comm_device(job.cluster, job.device))
    else:
        outcomes = [None] * job.world
        dist.all_gather_object(outcomes, sent)
    if failed is not None:  # the peers have it now
        raise failed
    peer = next((e for e in outcomes if e is not None), None)
    if peer is not None:
        raise peer
    return captured


@dataclass(frozen=True)
class Planning:
    """What the plan phase is asked: the user's compile arguments it reads."""

    loss_fn: LossFn | None
    optimizer: Any
    kernels: str
    precision: str | None
    time_limit_s: float
    sync: str
    staleness: int | None
    compress: str | None
    profiles: dict | None
    profile: Any = None  # measured blocks (`plan(..., profile=)`)

    @property
    def optimizer_name(self) -> str:
        return priced_optimizer(self.optimizer)


def given_plan(plan: Any) -> Plan | Strategy | None:
    """compile's `plan=` as plan_phase takes it: a Plan's JSON parsed; PlanError, before anything is captured,
    for anything else than None, a Strategy, a Plan or its JSON."""
    if isinstance(plan, (str, bytes)):
        return Plan.from_json(plan)
    if plan is not None and not isinstance(plan, (Strategy, Plan)):
        raise PlanError(f"plan must be None (autopar plans), an autopar.Strategy, a Plan or its JSON; got "
                        f"{type(plan).__name__}.")
    return plan


def plan_phase(model: nn.Module, job: Job, captured: Captured, plan: Plan | Strategy | None, asked: Planning,
               delay: int
               ) -> tuple[Plan, int]:
    """Phase 3: the plan every rank trains, and the update delay it runs with. Rank 0 plans (plan=None) or
    prices a hand-written Strategy as `autopar.estimate` does, and the others take its plan (its error is raised
    on every rank, none is left waiting); a given Plan (`given_plan`) is taken as it is. A planner that chose
    synchronous training where `sync=` allowed asynchrony sets the delay to 0; a given layout trained with
    delayed updates is priced for them (PlanError on every rank when its pending gradients do not fit)."""
    from .api import estimate, price_async
    from .api import plan as make_plan

    strategy = plan if isinstance(plan, Strategy) else None
    planned = plan is None  # autopar plans: with sync= it may choose synchronous training (api.plan)
    rank, world, cluster = job.rank, job.world, job.cluster
    if plan is None or strategy is not None:
        box: list[Any] = [None]
        failed = None
        if rank == 0:
            args = dict(example_inputs=captured.capture_inputs, example_target=captured.capture_target,
                        loss_fn=asked.loss_fn, optimizer=asked.optimizer_name, kernels=asked.kernels,
                        precision=asked.precision, captured=captured.graph,  # priced as the program will run
                        profiles=asked.profiles, profile=asked.profile)
            try:
                made = (estimate(model, cluster, strategy, **args).plan if strategy is not None
                        else make_plan(model, cluster, time_limit_s=asked.time_limit_s, sync=asked.sync,
                                       staleness=asked.staleness, compress=asked.compress, **args))
                box[0] = made.to_json()
            except Exception as e:
                failed = e
                box[0] = e if isinstance(e, AutoparError) else AutoparError(f"rank 0 failed to plan: {e!r}")
        if world > 1:
            dist.broadcast_object_list(box, src=0, device=world_comm_device(cluster, job.device))
        if failed is not None:
            raise failed
        if isinstance(box[0], BaseException):
            raise box[0]
        plan = Plan.from_json(box[0])
        if strategy is not None and plan.predicted.get("fits") is False and rank == 0:
            problems = plan.predicted.get("memory_problems") or ["(no details)"]
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            warnings.warn(f"the strategy passed as plan= does not fit in memory as priced: {problems[0]}{more} "
                          f"autopar trains it anyway, as asked, and it may run out of memory; zero=, "
                          f"recompute=True, offload= or more pipeline stages would make it fit, or plan=None "
                          f"lets autopar plan.", stacklevel=3)
    if asked.precision is not None and plan.precision != asked.precision:
        raise PlanError(f"compile(precision={asked.precision!r}) but the plan computes in {plan.precision!r}: "
                        f"drop precision= to train as the plan says, or plan again with autopar.plan(..., "
                        f"precision={asked.precision!r}).")
    if rank == 0 and planned and asked.precision is None:
        warn_precision_change(model, cluster, plan.precision)
    chose = (plan.predicted.get("async") or {}) if planned and delay else {}
    if chose.get("sync") == "sync":
        if rank == 0:
            warnings.warn(f"sync={asked.sync!r} was allowed but the planner chose synchronous training "
                          f"({chose.get('reason')}); training synchronously. Pass plan=autopar.Strategy(...) "
                          f"to train a layout asynchronously regardless.", stacklevel=3)
        delay = 0
    if delay and not planned:  # a given layout: its pending wave gradients must fit (every rank: PlanError)
        plan = price_async(plan, model, captured.capture_inputs, captured.capture_target, asked.loss_fn,
                           asked.optimizer_name, sync=asked.sync, staleness=asked.staleness, kernels=asked.kernels,
                           captured=captured.graph, profiles=asked.profiles)
    if rank == 0:
        warn_if_batch_split(model, pieces_of(plan), plan.global_batch, "the plan")
        warn_async(asked.sync, delay, plan=plan)  # names the runtime (flushless or not, and why)
    return plan, delay


@dataclass(frozen=True)
class Building:
    """What the build phase is asked: the user's compile arguments the program is built with."""

    loss_fn: LossFn | None
    optimizer: Any
    timeout_s: float
    kernels: str
    weights: WeightsArg
    seed: int
    sync: str
    staleness: int | None
    check_plan: bool


def build_phase(model: nn.Module, job: Job, captured: Captured, plan: Plan, delay: int, asked: Building
                ) -> Program:
    """Phase 4: this rank's program for `plan` (the synchronous Program, or the delayed-update program that
    runs it), its transfers checked under NCCL's rules first, and its memory window open over the build and
    the first steps (runtime/plan_check.py)."""
    program = Program if not delay else functools.partial(async_program(plan, asked.sync), sync=asked.sync,
                                                          staleness=asked.staleness)
    # every rank's transfers as the executors issue them, under NCCL's rules (before any rank trains)
    check_transfers(layout_of(plan, captured.num_layers(plan)),
                    flushless=bool(delay) and not flushless_problems(plan, asked.sync))
    if any(st.cp > 1 for p in plan.pipelines for st in p.stages):
        # a cp plan's attention masks are computed once on the host to check they are causal (setup, not
        # training: before the memory window; at most MASK_CHECK_ELEMENTS each), the program reuses the result
        check_masks(captured.graph)
    check = PlanCheck(plan, job.rank, job.device) if asked.check_plan else None
    if check is not None and delay and job.device.type != "cuda":
        # delayed updates keep gradient reductions in flight across steps, so gloo's threads free tensors while
        # the window's profiler stops: torch's profiler takes memory reports from other threads during its
        # teardown unguarded (pytorch/pytorch#136304, #195636), and a rank died in garbage collection with
        # "free(): invalid next size" (tests/test_flushless.py, measured). Not measured on the CPU; on CUDA
        # the check reads the allocator's counters, no profiler.
        check.figures.not_measured = "asynchronous program on the CPU"
    elif check is not None:
        check.open()
    try:
        prog = program(model, plan, captured.inputs, captured.target, asked.loss_fn, asked.optimizer, job.rank,
                       job.world, timeout_s=asked.timeout_s, kernels=asked.kernels, weights=asked.weights,
                       graph=captured.global_graph, seed=asked.seed, captures=captured.captures)
    except BaseException:
        if check is not None:
            check.abandon()
        raise
    prog.plan_check = check
    if check is not None:  # a program dropped before its window's last step still closes it (and its profiler)
        weakref.finalize(prog, check.close)
    return prog


def dump_phase(prog: Program, plan: Plan, directory: str | os.PathLike | None, model: nn.Module, job: Job,
               captured: Captured, loss_fn: LossFn | None, kernels: str) -> None:
    """With AUTOPAR_DUMP (or `dump_dir=`): this rank's generated program, and on rank 0 the plan and the
    annotated graph priced as the plan runs."""
    d = _dump_dir(directory)
    if d is None:
        return
    prog.dump(str(d))
    if job.rank == 0:
        (d / "plan.json").write_text(plan.to_json())
        from .api import analyze  # graph.txt/json/dot: the annotated graph, priced as the plan runs

        analyze(model, job.cluster, captured.capture_inputs, captured.capture_target, loss_fn, plan.precision, d,
                kernels)


def _with_context_parallel(plan: Any, delay: int, adapt: Any, reroute: bool | None) -> bool | None:
    """`reroute` for the plan: context-parallel plans run synchronous, without re-planning or re-routing (which
    neither price nor rebuild the cp groups); PlanError when those were asked for, re-routing left off when
    it was only the launcher's default."""
    cp = max((st.cp for p in plan.pipelines for st in p.stages), default=1)
    if cp == 1:
        return reroute
    asked = [what for what, on in (("delayed updates (sync=)", bool(delay)), ("adapt=", bool(adapt)),
                                   ("reroute=True", reroute is True)) if on]
    if asked:
        raise PlanError(f"the plan splits sequences (cp={cp}); {', '.join(asked)} is not supported with context "
                        f"parallelism yet: drop it, or use a plan with cp=1 (Strategy(cp=1)).")
    return False


def compile(
    model: nn.Module,
    cluster: Cluster | str | dict | os.PathLike,
    example_inputs: tuple = (),
    example_target: Any = None,
    loss_fn: LossFn | None = None,
    optimizer: str | OptimizerFactory = "adamw",
    plan: Any = None,
    *,
    dump_dir: str | os.PathLike | None = None,
    time_limit_s: float = 60,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    adapt: bool | AdaptPolicy = False,
    kernels: str = "auto",
    precision: str | None = None,
    fallback: bool = True,
    graph_options: dict | None = None,
    weights: WeightsArg = None,
    sync: str = "sync",
    staleness: int | None = None,
    reroute: bool | None = None,
    check_plan: bool = True,
    compress: str | None = None,
    seed: int = 0,
    profiles: dict[str, Profile] | None = None,
    profile: Any = None,
    graph_data: str | os.PathLike | None = None,
) -> TrainingProgram:
    """Plan (unless `plan` is given, as a Plan or its JSON) and build this rank's training program.

    Every program it returns implements `autopar.TrainingProgram` (runtime/protocol.py): `plan`, `step`,
    `eval_step`, `state_dict` / `load_state_dict`, `save` / `load` and `report`, whatever the plan and mode.

    `plan` may also be a hand-written `autopar.Strategy`: it is priced as `autopar.estimate` prices it and
    trained exactly as written (a warning names the devices it overflows when it does not fit in memory).

    Every rank calls it with the same arguments. Under torchrun / `autopar run` each process is one device
    of the cluster (rank r = device r); without a launcher it runs as a single process, which the cluster
    must then match (one device). `prog.step(*inputs, target=y)` trains on one global batch.

    A model that cannot be captured (data-dependent control flow, unsupported ops) gets the CaptureError
    naming the op and source line as a warning and, unless `fallback=False`, trains replicated: eager data
    parallelism with speed-proportional batch shares (fallback.py).

    With `adapt=True` (or an AdaptPolicy) the program measures each rank's compute against the plan after a
    few steps and, when a rank straggles, re-plans with that device's measured speed and continues on the
    new plan with the same weights and optimizer state (see straggler.py).

    `precision` ("fp32", "tf32", "bf16" or "fp16"; default `autopar.default_precision(cluster)`) goes to the
    planner as `autopar.plan(..., precision=...)` does; a given plan must say the same. bf16/fp16 plans run
    each stage forward under torch.autocast with fp32 weights, optimizer state and gradient reduction, fp16
    with dynamic loss scaling (runtime/precision.py).

    `graph_data` (graph workloads): a directory written by `autopar.graphs.partition(x, edge_index, y, plan,
    out_dir)`; each rank reads only its own part of the graph (its nodes' features, labels and in-edges, its
    halo's ids and owners), trains with `prog.step(target=None)` (no graph argument) and measures its memory
    against the plan. `plan` may be left out (the directory's plan is used); example inputs are not given.
    Layout and guarantees: docs/workloads.md, "Graphs bigger than one device".

    A model built on the meta device trains without ever being allocated whole: each rank allocates only its
    stages' parameters (its tensor-parallel shards) and reads only those from `weights` (a .safetensors file,
    a Hugging Face directory of safetensors shards, or a `Program.save` checkpoint directory); names or shapes
    that do not match raise a PlanError. Without `weights` a meta model gets a deterministic per-module init
    that `autopar.materialize(model, seed=0)` reproduces in one process. A non-meta model with `weights`
    trains from them. See autopar/runtime/weights.py.

    `sync` ("sync", default: synchronous training) may ask for delayed updates: "2bw" (PipeDream-2BW, each
    gradient one update stale) or "wsp" (HetPipe wave-synchronous, a pipeline at most `staleness` waves
    ahead of the slowest). They change the update rule to W[c+1] = W[c] - opt(grad L_c(W[c-D])), warned
    about (AsyncUpdateWarning); the program is an AsyncProgram (runtime/asynchronous.py).

    `reroute` (None: on when the process was launched by `autopar run` without --max-restarts, which sets
    AUTOPAR_REROUTE=1; True/False: on/off) makes a synchronous multi-rank program survive a lost rank without
    a restart (runtime/reroute.py): it keeps one copy of each rank's state before every step, priced by the
    cost model into `prog.plan.predicted["reroute"]` (solver/reroute_memory.py, shown by explain()); when
    that copy does not fit, re-routing is off for the job, said on rank 0's stderr, and a lost rank stops it
    (restart from the last checkpoint). Re-routing is gloo-only: on NCCL or under torchrun's agent
    reroute=True raises PlanError and None leaves it off (`runtime.reroute.backend_refusal`).

    `check_plan` (default on): each rank measures its peak memory over building the program and its first 3
    steps (CUDA: the allocator's counters; CPU: the profiler's allocation events) and warns with
    `autopar.PlanDriftWarning` when it exceeds the plan's prediction by more than 15 % or the device's
    capacity; `prog.report()` (every rank) gathers and prints predicted vs measured peaks and step times
    (runtime/plan_check.py).

    `compress` ("bf16" / "fp16"; default None: never) lets the planner round the activations and gradients
    sent between pipeline stages on slow links to that dtype (`autopar.plan(..., compress=)`); a given plan's
    `Stage.compress` is trained as written.

    `seed` (default 0) keys the random ops of the captured model (dropout, bernoulli, rand...): each draws
    from a counter-based stream keyed by (seed, step, the op, the sample's index in the global batch, the
    element), so every plan draws the same masks for a sample and trains like the one-device program
    `compile(model, "1x1xcpu", ..., seed=seed)` (passes/randomness.py; torch's generator does not enter).

    `profile` (measured blocks: a `BlockProfile` or the path `autopar profile --out` wrote) goes to the planner as
    `autopar.plan(..., profile=...)` does. `profiles` (device type name -> `autopar.cost_models.compute.Profile`)
    goes to the planner as
    `autopar.plan(..., profiles=...)` does: those types are priced with these compute profiles instead of the
    saved ones. A re-plan around stragglers (`adapt=`) passes the slowed types' scaled profiles the same way.
    """
    from .solver.pricing.plan import check_compress

    check_seconds("time_limit_s", time_limit_s)
    check_seconds("timeout_s", timeout_s)
    check_compress(compress)
    delay = delay_of(sync, staleness)  # a bad mode or staleness fails before any collective
    if delay and adapt:
        raise PlanError(f"sync={sync!r} with adapt=: re-planning around stragglers is for synchronous programs; "
                        f"pass adapt=False (delayed updates already let fast replicas run ahead) or sync='sync'.")
    job = connect(cluster, timeout_s)
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    from .graphs.planner import graph_kind

    if graph_kind(model, inputs) is not None or getattr(plan, "graph", None) or graph_data is not None:
        if delay:
            raise PlanError(f"sync={sync!r}: delayed updates are not supported for graph workloads; use sync='sync'.")
        # GNNs: partitioned full-graph or sampled data-parallel program (graphs/); TGN: temporal data parallel
        from .graphs.entry import compile_graph

        return compile_graph(model, job.cluster, inputs, example_target, loss_fn, optimizer, plan, job.rank,
                             job.world, timeout_s, graph_options, precision, profiles, graph_data, check_plan)
    plan = given_plan(plan)
    try:
        captured = capture_model(model, job, inputs, example_target, loss_fn, plan,
                                 rerouting=reroute_enabled() if reroute is None else reroute)
    except CaptureError as e:
        # the error names the op and source line; with fallback the model still trains, replicated (not a
        # meta model: replicas would need it whole)
        if not fallback or is_meta(model) or delay:  # delayed updates run only on captured programs
            raise
        batch = next(x.shape[0] for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0)
        if job.rank == 0:
            warn_if_batch_split(model, job.world, batch, "replicated data parallelism")
        return ReplicatedProgram(model, job.cluster, batch, loss_fn, optimizer, job.rank, job.world, e, timeout_s)
    planning = Planning(loss_fn, optimizer, kernels, precision, time_limit_s, sync, staleness, compress, profiles,
                        profile)
    building = Building(loss_fn, optimizer, timeout_s, kernels, weights, seed, sync, staleness, check_plan)
    plan, delay = plan_phase(model, job, captured, plan, planning, delay)
    reroute = _with_context_parallel(plan, delay, adapt, reroute)
    prog = build_phase(model, job, captured, plan, delay, building)
    dump_phase(prog, plan, dump_dir, model, job, captured, loss_fn, kernels)
    # a lost rank's micro-batches re-routed to its peers, a slow rank's shed to them (runtime/reroute.py)
    rebuilder = _Rebuilder(captured, optimizer, timeout_s, kernels, weights, seed=seed)
    prog = rebuilder.wrap(prog, reroute)
    if not adapt:
        return prog

    def replan(slowed: Cluster, scaled: dict) -> Any:
        """A re-plan around stragglers: the same capture planned on the cluster with the slow devices' own
        types (`scaled`: their compute profiles), built and wrapped as the first program was (synchronous,
        this compile's options; no second capture)."""
        again = Job(slowed, job.device, job.rank, job.world)
        new_plan, _ = plan_phase(model, again, captured, None, replace(planning, sync="sync", staleness=None,
                                                                        compress=None, profiles=scaled), 0)
        new = build_phase(model, again, captured, new_plan, 0, replace(building, sync="sync", staleness=None))
        dump_phase(new, new_plan, dump_dir, model, again, captured, loss_fn, kernels)
        return rebuilder.wrap(new, reroute)

    policy = adapt if isinstance(adapt, AdaptPolicy) else AdaptPolicy()
    return AdaptiveProgram(prog, replan, job.cluster, policy,
                           reshare=lambda p: rebuilder.wrap(rebuilder.build(p, job.rank, job.world), reroute),
                           profiles=dict(profiles or {}))


@dataclass
class _Rebuilder:
    """Builds and prices Programs for rewritten plans of one compile (a lost rank's plan, shed batch shares):
    the runtime's re-routing and shedding call back into it, since the runtime cannot price plans itself."""

    captured: Captured
    optimizer: Any
    timeout_s: float
    kernels: str
    weights: WeightsArg
    cost_models: dict = field(default_factory=dict)
    seed: int = 0

    def build(self, plan: Any, rank: int, world: int) -> Program:
        c = self.captured
        return Program(c.model, plan, c.inputs, c.target, c.loss_fn, self.optimizer, rank, world,
                       timeout_s=self.timeout_s, kernels=self.kernels, weights=self.weights, graph=c.global_graph,
                       seed=self.seed, captures=c.captures)

    def cost_model(self, plan: Any) -> Any:
        """The planner's cost model for `plan`'s cluster (one per cluster: a loss prices and copies on one),
        from the global batch's capture (made here on a rank that had none)."""
        from .api import cost_model

        key = (json.dumps(plan.cluster, sort_keys=True), plan.precision, plan.memory_reserve)
        if key not in self.cost_models:
            c = self.captured
            self.cost_models[key] = cost_model(c.model, plan.cluster, c.capture_inputs, c.capture_target, c.loss_fn,
                                               priced_optimizer(self.optimizer), plan.precision, plan.memory_reserve,
                                               self.kernels, captured=c.graph)
        return self.cost_models[key]

    def price(self, plan: Any) -> Any:
        from .solver.pricing.pricing import price

        out = price(self.cost_model(plan), plan).plan
        out.model = dict(plan.model)
        return out

    def price_copy(self, plan: Any) -> dict:
        """Re-routing's pre-step state copy per device, and whether it fits (solver/reroute_memory.py)."""
        from .solver.reroute_memory import reroute_memory

        return reroute_memory(self.cost_model(plan), plan).block()

    def wrap(self, prog: Any, on: bool | None = None) -> Any:
        from .runtime.reroute import wrap

        return wrap(prog, self.build, self.price, self.price_copy, on)


# ---- elastic training --------------------------------------------------------------------------------------


@dataclass
class StepInfo:
    """What an `on_step` callback sees after each step (and its checkpoint)."""

    program: Any
    step: int  # steps done
    device: int  # this worker's device index in the full cluster
    rank: int  # its rank in this attempt's process group
    attempt: int  # TORCHELASTIC_RESTART_COUNT
    checkpoint_dir: Path


@dataclass
class TrainResult:
    program: Any  # the Program of the last attempt
    devices: list[int]  # cluster devices this attempt ran on (rank r = devices[r])
    attempt: int
    resumed_from: int | None  # step of the checkpoint this attempt started from (None: from scratch)
    losses: dict[int, float] = field(default_factory=dict)  # step number -> loss, this attempt's steps
    # wall-clock (time.time()) milestones of this attempt: start, joined (process group), planned (program
    # compiled), loaded (checkpoint read), first_step, done
    times: dict[str, float] = field(default_factory=dict)


def train(build: Callable[[], Any], cluster: Cluster | str | dict | os.PathLike, steps: int,
          checkpoint_dir: str | os.PathLike, *, every: int = 1, optimizer: Any = "adamw",
          batch: Callable[[int], tuple[tuple, Any]] | None = None,
          on_step: Callable[[StepInfo], None] | None = None, keep: int | None = 2, time_limit_s: float = 30,
          timeout_s: float = DEFAULT_TIMEOUT_S) -> TrainResult | None:
    """Train `steps` steps on `cluster`, checkpointing every `every` steps to `checkpoint_dir`, resuming
    from the newest checkpoint there on the devices that remain (runtime/elastic.py's docstring).

    `build()` returns the model case: an object with `model`, `example_inputs`, `example_target` and
    `loss_fn` (like `autopar.models.ModelCase`) or that 4-tuple; it must build the same initial weights
    every time. `batch(step)` gives (inputs, target) for step `step` (0-based; default: the example batch).
    Call it from a script launched by `autopar run --max-restarts K` (or torchrun), without initializing
    torch.distributed yourself. Returns None in a worker whose device is recorded as lost (exit 0 then).
    """
    times = {"start": time.time()}
    root = Path(checkpoint_dir)
    base = Cluster.load(cluster)
    device = int(os.environ.get("RANK", "0"))
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if every < 1 or steps < 0:
        raise PlanError(f"train(): every must be >= 1 and steps >= 0, got every={every}, steps={steps}.")
    if launched > base.world_size:
        raise PlanError(f"{launched} workers were started for a cluster of {base.world_size} devices; start "
                        f"at most one per device.")
    if not device_usable():
        mark_lost(root, device, f"failed the device check at attempt {attempt}")
        raise AutoparError(f"device {device} failed its health check; recorded it as lost in "
                           f"{root / LOST_FILE} so that the next restart runs without it.")
    lost = set(lost_devices(root))
    survivors = [d for d in range(launched) if d not in lost]
    if device in lost:
        print(f"autopar: device {device} is recorded as lost in {root / LOST_FILE}; this worker stands down "
              f"(attempt {attempt}).", file=sys.stderr)
        return None
    rank, world = survivors.index(device), len(survivors)
    sub = base if survivors == list(range(base.world_size)) else \
        base.subset(survivors, name=f"{base.name}[{','.join(map(str, survivors))}]")
    join_attempt(rank, world, launched, attempt, timeout_s, launch_device(base))
    times["joined"] = time.time()
    case = build()
    model, inputs, target, loss_fn = (case if isinstance(case, tuple) else
                                      (case.model, case.example_inputs, case.example_target, case.loss_fn))
    prog = compile(model, sub, inputs, target, loss_fn, optimizer, time_limit_s=time_limit_s,
                           timeout_s=timeout_s)
    times["planned"] = time.time()
    found = checkpoint.latest(root)
    if found is not None:
        prog.load(found[1])
    times["loaded"] = time.time()
    if rank == 0:
        what = f"resuming from step {found[0]}" if found else "starting from scratch"
        print(f"autopar: attempt {attempt} on devices {survivors} of {base.world_size}, {what}.",
              file=sys.stderr)
    result = TrainResult(prog, survivors, attempt, found[0] if found else None, times=times)
    while prog.step_count < steps:
        xs, y = batch(prog.step_count) if batch is not None else (inputs, target)
        xs = tuple(xs) if isinstance(xs, (tuple, list)) else (xs,)
        loss = prog.step(*xs, target=y)
        result.losses[prog.step_count] = loss
        times.setdefault("first_step", time.time())
        if prog.step_count % every == 0 or prog.step_count == steps:
            prog.save(checkpoint.step_dir(root, prog.step_count))
            if rank == 0 and keep:
                checkpoint.prune(root, keep)
        if on_step is not None:
            on_step(StepInfo(prog, prog.step_count, device, rank, attempt, root))
    times["done"] = time.time()
    return result
