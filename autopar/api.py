"""Public entry points: analyze, plan, estimate (and, as it lands, compile)."""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable
from typing import Any

from torch import nn

from .checks import check_memory_reserve, check_number, check_seconds
from .cluster import Cluster
from .cost_models.compute import Profile, check_profiles
from .cost_models.measured_blocks import BlockProfile, load_block_profile
from .errors import InfeasibleError, PlanError
from .ir.graph import TrainingGraph
from .ir.plan import Estimate, Plan, Strategy
from .ir.precision import resolve_precision
from .passes.annotate import annotate
from .passes.capture import LossFn, capture
from .report import dump_dir as _dump_dir
from .report import dump_graph
from .solver.async_memory import async_memory
from .solver.asynchronous import choose_async, delay_of, force_async
from .solver.pricing.plan import check_compress
from .solver.pricing.pricing import CostModel, price, price_plan, price_strategy
from .solver.search.objective import check_objective, score
from .solver.search.search import WORK_LIMIT, search


def analyze(model: nn.Module, cluster: Cluster | str | dict | os.PathLike, example_inputs: tuple = (),
            example_target: Any = None, loss_fn: LossFn | None = None, precision: str = "fp32",
            dump_dir: str | os.PathLike | None = None, kernels: str = "auto", *,
            profiles: dict[str, Profile] | None = None) -> TrainingGraph:
    """Capture `model` on one global batch and cost every node on every device type of `cluster`.

    Returns the annotated TrainingGraph; `graph.table()` prints it. With AUTOPAR_DUMP=<dir> (or
    `dump_dir=`) also writes graph.txt, graph.json and graph.dot there. `kernels` is the kernels mode the
    times are priced for (fused regions on the device types it fuses; recorded as `graph.kernels`).
    `profiles`: as in `plan`.
    """
    cluster = Cluster.load(cluster)
    precision = resolve_precision(cluster, precision)
    graph = annotate(capture(model, example_inputs, loss_fn, example_target), cluster, precision=precision,
                     kernels=kernels, profiles=check_profiles(profiles, cluster))
    dump_graph(graph, dump_dir)
    return graph


def cost_model(model: nn.Module, cluster: Cluster | str | dict | os.PathLike, example_inputs: tuple = (),
               example_target: Any = None, loss_fn: LossFn | None = None, optimizer: object = "adamw",
               precision: str | None = None, memory_reserve: float = 0.1, kernels: str = "auto", *,
               captured: TrainingGraph | None = None, compress: str | None = None,
               profiles: dict[str, Profile] | None = None,
               profile: BlockProfile | str | os.PathLike | None = None, sources: bool = True) -> CostModel:
    """Capture and annotate `model` and wrap it in the planner's cost model (what plan/estimate use).
    `captured`: the model's capture at this batch when the caller has it (`autopar.compile` passes its own,
    so a model is captured once per compile). `compress`: the wire dtype stage sends may be rounded to
    (`plan`'s), None for never. `profiles`, `profile`: as in `plan`. `sources`: as in `capture` (False: the
    graph's nodes keep no user source line, which only its JSON shows; `plan` and `estimate` price without)."""
    check_memory_reserve(memory_reserve)
    cluster = Cluster.load(cluster)
    precision = resolve_precision(cluster, precision)
    inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if captured is None:
        captured = capture(model, tuple(inputs), loss_fn, example_target, sources=sources)
    profiles = check_profiles(profiles, cluster)
    graph = annotate(captured, cluster, precision=precision, kernels=kernels, profiles=profiles)
    return CostModel(graph, cluster, precision, optimizer, memory_reserve, compress=compress, profiles=profiles,
                     block_profile=load_block_profile(profile))


def plan(model: nn.Module, cluster: Cluster | str | dict | os.PathLike, example_inputs: tuple = (),
         example_target: Any = None, loss_fn: LossFn | None = None, optimizer: object = "adamw",
         time_limit_s: float = 60, precision: str | None = None, *, memory_reserve: float = 0.1,
         progress: Callable[[int, int, float | None], None] | None = None, kernels: str = "auto",
         graph_options: dict | None = None, captured: TrainingGraph | None = None, sync: str = "sync",
         staleness: int | None = None, objective: str = "time", budget_per_hour: float | None = None,
         compress: str | None = None, profiles: dict[str, Profile] | None = None,
         profile: BlockProfile | str | os.PathLike | None = None, work_limit: int | None = WORK_LIMIT) -> Plan:
    """The fastest plan the cost model finds for training `model` on `cluster`.

    `example_inputs` (and `example_target`) are one global batch; meta tensors are fine. Every device's
    predicted peak memory stays under (1 - memory_reserve) of its capacity. The search solves at most
    `work_limit` configurations (None: no limit) and returns the best so far with a warning when it stops
    there: the same inputs give the same plan on any machine. `time_limit_s` (capture included) only guards
    the wall-clock time: where it stops the search first, the warning says the plan depends on the machine's
    load. Raises InfeasibleError when nothing fits.
    `progress(done, total, best_step_time)` is called as configurations are evaluated, with a fourth argument,
    the least lower bound of the configurations left (the bound gap is best / bound - 1), when it takes one. With
    AUTOPAR_DUMP=<dir>, writes plan.json, plan.txt, timeline.json and the annotated graph (graph.txt/json/dot)
    there. `kernels` is the mode the
    program will run with (`autopar.compile(kernels=...)`): compute is priced with fused regions on the
    device types that mode fuses, and the plan records it in `plan.model["kernels"]`.

    Graph workloads (an integer (2, E) edge_index input and message-passing layers, or a temporal GNN) get
    the graph planner (autopar/graphs): partitioned full-graph training by default (or the same full-graph
    training with the layers split into stages over the ranks, "mode": "layer_pipeline", on request or where
    partition does not fit), sampled mini-batch data
    parallelism (a different estimator) only with `graph_options={"mode": "sampled_dp", ...}` (batch_size,
    fanout, seed; see graphs.planner.plan_graph), or with "mode": "sampled_pipeline" on a cluster with cpu
    devices beside accelerators (the same sampled training; the cpu ranks sample and gather, the accelerators
    train); `plan.graph` set. `captured`: as in `cost_model`.

    `sync="2bw"` or `"wsp"` (with `staleness`) allows asynchronous training (runtime/asynchronous.py): the
    plan is searched as for synchronous training and `predicted["async"]` holds the predicted step time with
    delayed updates against the synchronous one; its "sync" is the mode chosen (the asynchronous one only
    when predicted faster). The default "sync" never chooses asynchrony.

    `objective`: "time" (the fastest plan) or "cost" (the lowest cost per sample, from the cluster file's
    `price_per_hour`); `budget_per_hour`: the most the devices the plan uses may cost per hour. Both need
    every device priced (PlanError otherwise) and are passed to the search (solver/search/objective.py `score`);
    InfeasibleError when the plan returned costs more than the budget. A plan that leaves devices out says
    why in `predicted["idle_devices"]`.

    `compress="bf16"` (or "fp16") allows activations and gradients sent between pipeline stages to be rounded
    to that dtype on the wire; the planner then compresses the slow links (<= 10 Gb/s) of fp32/tf32 plans where
    it shortens the predicted step. The default None never does: the sends keep the plan's dtypes, so the
    math is the plan's.

    `profiles`: compute profiles by device type name (`autopar.cost_models.compute.Profile`, e.g.
    `Profile.load(path)` of what `autopar calibrate` wrote), priced instead of the saved ones for those types;
    the other types keep theirs. PlanError for a type the cluster does not have.

    `profile`: measured blocks (`autopar profile ... --out profile.json`, or
    `autopar.cost_models.measured_blocks.BlockProfile`, e.g. `BlockProfile.from_amp_csv`): the layers, device
    types and tensor-parallel degrees it has are priced from its measured forward, backward and recompute seconds
    (host time included), the rest from the analytic model; `explain()` says which. PlanError when it was
    measured on another model.
    """
    from .graphs.planner import graph_kind

    check_seconds("time_limit_s", time_limit_s)
    check_number("work_limit", work_limit, integer=True, low=1, optional=True,
                 hint="the most configurations the search solves, or None for no limit")
    check_memory_reserve(memory_reserve)
    delay_of(sync, staleness)
    check_compress(compress)
    check_objective(objective, budget_per_hour, Cluster.load(cluster))
    if graph_kind(model, example_inputs) is not None:
        from .graphs.entry import plan_workload

        precision = resolve_precision(Cluster.load(cluster), precision)
        return plan_workload(model, cluster, example_inputs, example_target, optimizer, precision,
                             memory_reserve=memory_reserve, options=graph_options, profiles=profiles)
    start = time.perf_counter()
    cm = cost_model(model, cluster, example_inputs, example_target, loss_fn, optimizer, precision,
                    memory_reserve, kernels, captured=captured, compress=compress, profiles=profiles,
                    profile=profile, sources=_dump_dir() is not None)  # the dump's graph.json shows them
    remaining = max(1.0, time_limit_s - (time.perf_counter() - start))
    result = search(cm, time_limit_s=remaining, progress=progress, objective=objective,
                    budget_per_hour=budget_per_hour, work_limit=work_limit)
    if score(result.predicted, cm.cluster, objective, budget_per_hour) == math.inf:
        step = float(result.predicted.get("step_time_s", math.inf))
        if result.predicted.get("fits") is False or not math.isfinite(step):
            # the search's best when it stopped is not a plan that runs (bench/peers.py: Sailor's 48 GPUs at 120 s)
            raise InfeasibleError(
                f"planning stopped (time_limit_s={time_limit_s:g}) with no plan that fits the devices' memory and "
                f"runs (its best so far: step {step:.4g} s, fits: {result.predicted.get('fits')}): raise "
                f"time_limit_s, or plan with fewer devices (a sub-cluster of the fastest types).")
        raise InfeasibleError(f"the plan found costs {result.predicted.get('cost_per_hour', 0.0):.4g} per hour, over "
                              f"budget_per_hour={budget_per_hour}: raise the budget or use fewer or cheaper devices.")
    result.model.update(kernels=kernels, fused_device_types=cm.graph.fused_types)
    if sync != "sync":  # the user allows asynchrony: priced against the synchronous plan
        def reprice(p: Plan) -> Plan | None:
            priced = price(cm, p)
            return priced.plan if priced.fits else None

        result = choose_async(result, sync, staleness, reprice, functools.partial(async_memory, cm))
    d = _dump_dir()
    if d is not None:
        (d / "plan.json").write_text(result.to_json())
        (d / "plan.txt").write_text(result.explain() + "\n")
        result.timeline()
        result.report(d / "plan.html")
        dump_graph(cm.graph, d)
    return result


def price_async(plan: Plan, model: nn.Module, example_inputs: tuple = (), example_target: Any = None,
                loss_fn: LossFn | None = None, optimizer: object = "adamw", *, sync: str, staleness: int | None = None,
                kernels: str = "auto", captured: TrainingGraph | None = None,
                profiles: dict[str, Profile] | None = None) -> Plan:
    """`plan` (priced) to be trained with `sync` ("2bw" | "wsp") whatever the planner would choose, as
    `compile(plan=..., sync=...)` trains it: `predicted["async"]` for that mode and `predicted["peak_memory_bytes"]`
    with its pending wave gradients (and, where sync="2bw" runs the flushless schedule, its second weight
    version: solver/async_memory.py); PlanError naming each device that does not fit. `profiles`: as in `plan`."""
    cm = cost_model(model, plan.cluster, example_inputs, example_target, loss_fn, optimizer, plan.precision,
                    plan.memory_reserve, kernels, captured=captured, profiles=profiles, sources=False)
    return force_async(plan, sync, staleness, functools.partial(async_memory, cm))


def estimate(model: nn.Module, cluster: Cluster | str | dict | os.PathLike, strategy: Strategy | Plan,
             example_inputs: tuple = (), example_target: Any = None, loss_fn: LossFn | None = None,
             optimizer: object = None, precision: str | None = None, *,
             memory_reserve: float | None = None, kernels: str = "auto", captured: TrainingGraph | None = None,
             profiles: dict[str, Profile] | None = None,
             profile: BlockProfile | str | os.PathLike | None = None) -> Estimate:
    """Price a hand-written Strategy with the planner's cost model (Megatron rank order), or reprice a Plan
    (`autopar.plan`'s, or `Plan.from_json` of a saved one: its layout, shares and options as they are, its
    devices left out idle) on `cluster`; a Plan is priced at its own precision, optimizer and memory reserve
    unless given others (PlanError when `precision` or `optimizer` differ from the plan's, or the cluster's
    devices do). A Strategy is priced with `optimizer` "adamw" and `memory_reserve` 0.1 unless given.

    A strategy that does not fit is priced anyway: `predicted["fits"]` is False, `predicted["memory_problems"]`
    says which devices overflow by how much, and `explain()` starts with DOES NOT FIT. `captured`: as in
    `cost_model`; `profiles`, `profile`: as in `plan`."""
    if not isinstance(strategy, (Strategy, Plan)):
        raise PlanError(f"strategy must be an autopar.Strategy (e.g. Strategy(dp=2, pp=2)) or a Plan, got "
                        f"{type(strategy).__name__}.")
    if isinstance(strategy, Plan) and strategy.graph is not None:
        raise PlanError("estimate() reprices plans of layer chains; a graph workload's plan (plan.graph set) is "
                        "priced by autopar.plan(..., graph_options=...).")
    own = strategy if isinstance(strategy, Plan) else None  # a Plan's own settings, where none are given
    precision = precision or (own.precision if own else None)
    optimizer = optimizer if optimizer is not None else (own.optimizer if own else "adamw")
    memory_reserve = check_memory_reserve(memory_reserve if memory_reserve is not None
                                          else (own.memory_reserve if own else 0.1))
    cm = cost_model(model, cluster, example_inputs, example_target, loss_fn, optimizer, precision,
                    memory_reserve, kernels, captured=captured, profiles=profiles, profile=profile, sources=False)
    est = price_plan(cm, strategy) if isinstance(strategy, Plan) else price_strategy(cm, strategy)
    est.plan.model.update(kernels=kernels, fused_device_types=cm.graph.fused_types)
    return est
