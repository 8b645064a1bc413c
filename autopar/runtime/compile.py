"""`autopar.compile`: plan (or take a plan), lower it to this rank's program, return it ready to train."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..cluster import Cluster
from ..errors import CaptureError, PlanError
from ..passes.capture import LossFn, capture
from ..report import dump_dir as _dump_dir
from .dist import DEFAULT_TIMEOUT_S, ensure_initialized
from .fallback import ReplicatedProgram
from .layout import Layout, PipelineLayout, StageLayout, make_layout
from .program import OptimizerFactory, Program
from .straggler import AdaptiveProgram, AdaptPolicy


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
    fallback: bool = True,
    graph_options: dict | None = None,
) -> Program | AdaptiveProgram | ReplicatedProgram:
    """Plan (unless `plan` is given, as a Plan or its JSON) and build this rank's training program.

    Every rank calls it with the same arguments. Under torchrun / `autopar run` each process is one device
    of the cluster (rank r = device r); without a launcher it runs as a single process, which the cluster
    must then match (one device). `prog.step(*inputs, target=y)` trains on one global batch.

    A model that cannot be captured (data-dependent control flow, unsupported ops) gets the CaptureError
    naming the op and source line as a warning and, unless `fallback=False`, trains replicated: eager data
    parallelism with speed-proportional batch shares (fallback.py).

    With `adapt=True` (or an AdaptPolicy) the program measures each rank's compute against the plan after a
    few steps and, when a rank straggles, re-plans with that device's measured speed and continues on the
    new plan with the same weights and optimizer state (see straggler.py).
    """
    from ..api import plan as make_plan
    from ..plan import Plan

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
                             timeout_s, graph_options)
    try:
        capture(model, inputs, loss_fn, example_target)
    except CaptureError as e:
        # the error names the op and source line; with fallback the model still trains, replicated
        if not fallback:
            raise
        batch = next(x.shape[0] for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0)
        return ReplicatedProgram(model, cluster, batch, loss_fn, optimizer, rank, world, e, timeout_s)
    if plan is None:
        # one rank plans and the others take its plan, so every rank runs the same one
        box = [None]
        if rank == 0:
            box[0] = make_plan(
                model,
                cluster,
                example_inputs=inputs,
                example_target=example_target,
                loss_fn=loss_fn,
                optimizer=optimizer if isinstance(optimizer, str) else "adamw",
                time_limit_s=time_limit_s,
                kernels=kernels,  # priced as the program will run: fused regions where they fuse
            ).to_json()
        if world > 1:
            dist.broadcast_object_list(box, src=0)
        plan = Plan.from_json(box[0])
    elif isinstance(plan, (str, bytes)):
        plan = Plan.from_json(plan)
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
    )
    d = _dump_dir(dump_dir)
    if d is not None:
        prog.dump(str(d))
        if rank == 0:
            (d / "plan.json").write_text(plan.to_json())
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
        )
        policy = adapt if isinstance(adapt, AdaptPolicy) else AdaptPolicy()
        return AdaptiveProgram(prog, rebuild, cluster, policy)
    return prog
