"""Where `autopar.plan` and `autopar.compile` hand graph workloads over (see planner.graph_kind)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..cluster import Cluster
from ..errors import AutoparError, PlanError
from ..ir.plan import Plan
from ..passes.capture import LossFn
from ..report import dump_dir as _dump_dir
from ..runtime.program import OptimizerFactory
from .planner import graph_kind, plan_graph
from .program import GraphProgram, TemporalProgram
from .temporal_pipeline import plan_temporal_pipeline
from .temporal_program import TemporalPipelineProgram


def plan_workload(model: nn.Module, cluster: Cluster | str | dict, example_inputs: tuple, example_target: Any,
                  optimizer: object, precision: str | None, *, memory_reserve: float = 0.1,
                  options: dict | None = None, profiles: dict | None = None) -> Plan:
    """The plan of a graph workload (node-level GNN or temporal GNN); `profiles` as in `autopar.plan`."""
    kind = graph_kind(model, example_inputs)
    if kind == "temporal":
        # mode 'temporal_dp' (exact, tgn.plan_temporal) or, opted in, 'temporal_pipeline' (staleness)
        result = plan_temporal_pipeline(model, cluster, tuple(example_inputs), optimizer,  # type: ignore[arg-type]
                                        precision, options=options, memory_reserve=memory_reserve,
                                        profiles=profiles)
    else:
        result = plan_graph(model, cluster, tuple(example_inputs), example_target, optimizer, precision,
                            memory_reserve=memory_reserve, options=options, profiles=profiles)
    d = _dump_dir()
    if d is not None:
        (d / "plan.json").write_text(result.to_json())
        (d / "plan.txt").write_text(result.explain() + "\n")
    return result


def compile_graph(model: nn.Module, cluster: Cluster, inputs: tuple, example_target: Any, loss_fn: LossFn | None,
                  optimizer: str | OptimizerFactory, plan: Any, rank: int, world: int, timeout_s: float,
                  options: dict | None = None, precision: str | None = None, profiles: dict | None = None,
                  graph_data: str | os.PathLike | None = None, check_plan: bool = True
                  ) -> GraphProgram | TemporalProgram | TemporalPipelineProgram:
    """This rank's graph program; rank 0 plans (unless `plan` is given; with `profiles` as `autopar.plan` takes
    them) and broadcasts the plan (or the planning error, raised on every rank). The program computes in the
    plan's precision.

    `graph_data`: a directory written by `autopar.graphs.partition(x, edge_index, y, plan, out_dir)`
    (store.py). The plan is the directory's (or the given one, which must be it), nothing is planned, and this
    rank reads only its own part; with `check_plan` its peak memory over reading it and the first steps is
    measured against the plan (runtime/plan_check.py, PlanDriftWarning on drift), as for a layer_pipeline plan,
    whose ranks each hold one stage."""
    if graph_data is not None:
        return _compile_local(model, cluster, inputs, example_target, loss_fn, optimizer, plan, rank, world,
                              timeout_s, precision, graph_data, check_plan)
    if plan is None:
        box: list[Any] = [None]
        if rank == 0:
            try:
                box[0] = plan_workload(model, cluster, inputs, example_target,
                                       optimizer if isinstance(optimizer, str) else "adamw", precision,
                                       options=options, profiles=profiles).to_json()
            except Exception as e:  # raised on every rank: none is left waiting for the plan
                if world == 1:
                    raise
                box[0] = e if isinstance(e, AutoparError) else AutoparError(f"rank 0 failed to plan: {e!r}")
        if world > 1:
            dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], BaseException):
            raise box[0]
        plan = Plan.from_json(box[0])
    elif isinstance(plan, (str, bytes)):
        plan = Plan.from_json(plan)
    if not plan.graph:
        raise PlanError("this is a graph workload but the plan has no `graph` section: plan it with autopar.plan "
                        "on the graph model and its (x, edge_index) inputs.")
    if precision is not None and plan.precision != precision:
        raise PlanError(f"compile(precision={precision!r}) but the plan computes in {plan.precision!r}: drop "
                        f"precision= to train as the plan says, or plan again with precision={precision!r}.")
    if plan.graph["mode"] == "temporal_dp":
        return TemporalProgram(model, plan, optimizer, rank, world, timeout_s)  # type: ignore[arg-type]
    if plan.graph["mode"] == "temporal_pipeline":
        return TemporalPipelineProgram(model, plan, optimizer, rank, world, timeout_s)  # type: ignore[arg-type]
    if plan.graph["mode"] == "layer_pipeline" and check_plan:
        # each rank holds a different part of the model: its peak over building its stage and the first steps is
        # measured against the plan (runtime/plan_check.py: PlanDriftWarning on drift; `prog.report()`)
        from ..runtime.plan_check import PlanCheck

        device = next((p.device for p in model.parameters()), None) or torch.device("cpu")
        check = PlanCheck(plan, rank, device).open()
        try:
            return GraphProgram(model, plan, loss_fn, optimizer, rank, world, timeout_s, plan_check=check)
        except BaseException:
            check.abandon()
            raise
    return GraphProgram(model, plan, loss_fn, optimizer, rank, world, timeout_s)


def _compile_local(model: nn.Module, cluster: Cluster, inputs: tuple, example_target: Any, loss_fn: LossFn | None,
                   optimizer: str | OptimizerFactory, plan: Any, rank: int, world: int, timeout_s: float,
                   precision: str | None, graph_data: str | os.PathLike, check_plan: bool) -> GraphProgram:
    from ..runtime.plan_check import PlanCheck
    from .store import open_part, plan_of

    if inputs or example_target is not None:
        raise PlanError("compile(..., graph_data=dir) reads each rank's part from the directory: leave "
                        "example_inputs and example_target out (no rank holds the whole graph).")
    written = plan_of(graph_data)
    if plan is None:
        plan = written
    elif isinstance(plan, (str, bytes)):
        plan = Plan.from_json(plan)
    if not plan.graph or plan.graph.get("mode") != "partition":
        raise PlanError("graph_data= trains a partition-mode graph plan; this plan has none.")
    if len(plan.graph["shares"]) != world or cluster.world_size != world:
        raise PlanError(f"the plan of {graph_data} splits the graph over {len(plan.graph['shares'])} ranks but "
                        f"{world} run: launch {len(plan.graph['shares'])} ranks, or plan and write the parts for "
                        f"this cluster.")
    if precision is not None and plan.precision != precision:
        raise PlanError(f"compile(precision={precision!r}) but the plan computes in {plan.precision!r}: drop "
                        f"precision= to train as the plan says, or plan again with precision={precision!r}.")
    device = next((p.device for p in model.parameters()), None) or torch.device("cpu")
    check = PlanCheck(plan, rank, device).open() if check_plan else None
    try:
        data = open_part(graph_data, plan, rank, world)
        return GraphProgram(model, plan, loss_fn, optimizer, rank, world, timeout_s, data=data, plan_check=check)
    except BaseException:
        if check is not None:
            check.abandon()
        raise


__all__ = ["compile_graph", "graph_kind", "plan_workload"]
