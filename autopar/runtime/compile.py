"""`autopar.compile`: plan (or take a plan), lower it to this rank's program, return it ready to train."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checks import check_seconds
from ..cluster import Cluster
from ..errors import AutoparError, CaptureError, PlanError
from ..passes.batch_stats import pieces_of, warn_if_batch_split
from ..passes.capture import LossFn, capture
from ..report import dump_dir as _dump_dir
from .dist import DEFAULT_TIMEOUT_S, ensure_initialized
from .fallback import ReplicatedProgram
from .layout import Layout, PipelineLayout, StageLayout, make_layout
from .program import OptimizerFactory, Program
from .straggler import AdaptiveProgram, AdaptPolicy
from .weights import ModelWeights, WeightsArg, is_meta


def layout_from_plan(plan: Any, num_layers: int) -> Layout:
    """The rank-level layout of a Plan (pipelines in order take consecutive slices of the batch)."""
    if plan.model.get("num_layers") not in (None, num_layers):
        raise PlanError(
            f"the plan was made for a model with {plan.model['num_layers']} layers in its chain, but "
            f"this model has {num_layers}: plan again for this model."
        )
    pipelines, offset = [], 0
    for i, p in enumerate(plan.pipelines):
        stages = tuple(
            StageLayout(
                (int(s.layers[0]), int(s.layers[1])), tuple(s.devices), s.zero, s.recompute, tuple(s.offload),
                getattr(s, "compress", None),
                None if getattr(s, "sharding", None) is None else tuple(sorted(s.sharding.items())),
            )
            for s in p.stages
        )
        pipelines.append(
            PipelineLayout(i, stages, offset, p.batch_share, p.num_microbatches, plan.schedule, plan.chunks)
        )
        offset += p.batch_share
    world = Cluster.load(plan.cluster).world_size
    ep = int((getattr(plan, "experts", None) or {}).get("degree", 1))
    return make_layout(pipelines, world, plan.global_batch, num_layers, ep)


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
) -> Program | AdaptiveProgram | ReplicatedProgram:
    """Plan (unless `plan` is given, as a Plan or its JSON) and build this rank's training program.

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

    A model built on the meta device trains without ever being allocated whole: each rank allocates only its
    stages' parameters (its tensor-parallel shards) and reads only those from `weights` (a .safetensors file,
    a Hugging Face directory of safetensors shards, or a `Program.save` checkpoint directory); names or shapes
    that do not match raise a PlanError. Without `weights` a meta model gets a deterministic per-module init
    that `autopar.materialize(model, seed=0)` reproduces in one process. A non-meta model with `weights`
    trains from them. See autopar/runtime/weights.py.
    """
    from ..api import estimate
    from ..api import plan as make_plan
    from ..plan import Plan, Strategy

    check_seconds("time_limit_s", time_limit_s)
    check_seconds("timeout_s", timeout_s)
    rank, world = ensure_initialized(timeout_s)
    cluster = Cluster.load(cluster)
    if world != cluster.world_size:
        raise PlanError(
            f"the cluster has {cluster.world_size} devices but {world} process(es) are running: start "
            f"one process per device (`autopar run script.py --cluster ...` or torchrun "
            f"--nproc-per-node {cluster.world_size})."
        )
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    from ..graphs.planner import graph_kind

    if graph_kind(model, inputs) is not None or getattr(plan, "graph", None):
        # GNNs: partitioned full-graph or sampled data-parallel program (graphs/); TGN: temporal data parallel
        from ..graphs.entry import compile_graph

        return compile_graph(model, cluster, inputs, example_target, loss_fn, optimizer, plan, rank, world,
                             timeout_s, graph_options, precision)
    meta = is_meta(model)
    capture_inputs, capture_target = ModelWeights(model).capture_args(inputs, example_target)
    try:
        graph = capture(model, capture_inputs, loss_fn, capture_target)  # the program reuses it
    except CaptureError as e:
        # the error names the op and source line; with fallback the model still trains, replicated (not a
        # meta model: replicas would need it whole)
        if not fallback or meta:
            raise
        batch = next(x.shape[0] for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0)
        if rank == 0:
            warn_if_batch_split(model, world, batch, "replicated data parallelism")
        return ReplicatedProgram(model, cluster, batch, loss_fn, optimizer, rank, world, e, timeout_s)
    strategy = plan if isinstance(plan, Strategy) else None
    if plan is None or strategy is not None:
        # one rank plans (or prices the hand-written strategy, as autopar.estimate does) and the others take
        # its plan, so every rank runs the same one; its error is raised on every rank, none is left waiting
        box: list[Any] = [None]
        failed = None
        if rank == 0:
            args = dict(example_inputs=capture_inputs, example_target=capture_target, loss_fn=loss_fn,
                        optimizer=optimizer if isinstance(optimizer, str) else "adamw",
                        kernels=kernels, precision=precision)  # priced as the program will run
            try:
                made = (estimate(model, cluster, strategy, **args).plan if strategy is not None
                        else make_plan(model, cluster, time_limit_s=time_limit_s, **args))
                box[0] = made.to_json()
            except Exception as e:
                failed = e
                box[0] = e if isinstance(e, AutoparError) else AutoparError(f"rank 0 failed to plan: {e!r}")
        if world > 1:
            dist.broadcast_object_list(box, src=0)
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
                          f"lets autopar plan.", stacklevel=2)
    elif isinstance(plan, (str, bytes)):
        plan = Plan.from_json(plan)
    elif not isinstance(plan, Plan):
        raise PlanError(f"plan must be None (autopar plans), an autopar.Strategy, a Plan or its JSON; got "
                        f"{type(plan).__name__}.")
    if precision is not None and plan.precision != precision:
        raise PlanError(f"compile(precision={precision!r}) but the plan computes in {plan.precision!r}: drop "
                        f"precision= to train as the plan says, or plan again with autopar.plan(..., "
                        f"precision={precision!r}).")
    if rank == 0:
        warn_if_batch_split(model, pieces_of(plan), plan.global_batch, "the plan")
    prog = Program(
        model,
        None,
        inputs,
        example_target,
        loss_fn,
        optimizer,
        rank,
        world,
        plan=plan,
        timeout_s=timeout_s,
        layout_fn=lambda n_layers: layout_from_plan(plan, n_layers),
        kernels=kernels,
        weights=weights,
        graph=graph,
    )
    d = _dump_dir(dump_dir)
    if d is not None:
        prog.dump(str(d))
        if rank == 0:
            (d / "plan.json").write_text(plan.to_json())
            from ..api import analyze  # graph.txt/json/dot: the annotated graph, priced as the plan runs

            analyze(model, cluster, capture_inputs, capture_target, loss_fn, plan.precision, d, kernels)
    if adapt:
        rebuild = lambda c: compile(
            model,
            c,
            inputs,
            example_target,
            loss_fn,
            optimizer,
            dump_dir=dump_dir,
            time_limit_s=time_limit_s,
            timeout_s=timeout_s,
            kernels=kernels,
            precision=precision,
            weights=weights,
        )
        policy = adapt if isinstance(adapt, AdaptPolicy) else AdaptPolicy()
        return AdaptiveProgram(prog, rebuild, cluster, policy)
    return prog
