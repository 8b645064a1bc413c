"""Execution plans: what runs where, as plain data the runtime executes and the planner predicts.

A `Plan` is a list of `Pipeline`s (data-parallel replicas). Pipeline i takes `batch_share` samples of
every global batch (shares are integers summing to the global batch; replicas of different device types
get uneven shares, and gradients are weighted by share so the step equals single-device training) and
cuts them into `num_microbatches` micro-batches as evenly as possible, larger ones first (like
`torch.tensor_split`), so `microbatch_size` is the largest. Its `stages` tile the coarse layer chain of the
captured graph: stage j runs layers [start, end) on `devices` (the tensor-parallel group, tp =
len(devices)). With the interleaved schedule a pipeline has `chunks` stages per device group: stage j
runs on the device group of stage j % (len(stages) // chunks). Pipelines may differ in tensor-parallel
degree (fast devices at tp 2 beside slow ones at tp 1), and a plan may leave devices of its cluster out
(they hold nothing and get no batch; `predicted["idle_devices"]` says why).

`Stage.recompute`: True (every repeated block of the stage is recomputed in the backward, one block at a
time), False (none), or an integer k: the stage's FIRST k blocks are recomputed (`recompute_count`). The
first k, not the last: under 1F1B (and GPipe) a micro-batch's backward runs the stage's blocks last to
first, so the blocks kept whole are freed before the recomputed ones are rebuilt; one recomputed block's
activations (the recompute workspace) then coexist with only the block inputs of that micro-batch, not
with its full activations, which is the lower peak of the two orders.

Every stage carries its predicted per-micro-batch times, so a plan read back from JSON can still be
explained and simulated (`timeline`) without the model.

This module holds the plan as data (`Stage`, `Pipeline`, `Plan`, `layerwise_stages`), how a plan's step is
simulated from those times (`stage_times`, `simulate_pipeline`) and the hand-written configurations
`autopar.estimate` prices (`Strategy`, `plan_from_strategy`, `Estimate`). One part lives beside it and is
re-exported here: plan_simulate.py, the simulation of one step from per-stage times (`simulate_stages`,
`simulated_step_time`, `cached_schedule`, `wgrad_times`: the planner's hot path, which knows no `Plan`).
How a plan is shown (`explain`, `timeline_trace`, `report`, `plot`) is views/, above this module.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..checks import check_number
from ..errors import PlanError
from ..report import dump_dir
from .plan_simulate import cached_schedule, simulate_stages, simulate_times, simulated_step_time, wgrad_times
from .schedule import SCHEDULES
from .simulate import SimResult

OFFLOAD_KINDS = ("optimizer", "activations", "params")
CP_ATTENTION = ("ring", "ulysses")


def recompute_count(recompute: bool | int, blocks: int, where: str = "Stage.recompute") -> int:
    """How many of a stage's `blocks` repeated blocks `recompute` (True, False or k) recomputes; its first
    that many (module docstring). PlanError when it is not a bool or an integer in [0, blocks]."""
    if isinstance(recompute, bool):
        return blocks if recompute else 0
    if not isinstance(recompute, int) or not 0 <= recompute <= blocks:
        raise PlanError(f"{where} = {recompute!r}: give True (all blocks), False (none) or the number of the "
                        f"stage's first blocks to recompute, an integer in [0, {blocks}] (the stage holds "
                        f"{blocks} repeated block(s)).")
    return recompute


def even_split(total: int, parts: int) -> list[int]:
    """`total` in `parts` parts as even as possible, larger ones first (like torch.tensor_split)."""
    q, r = divmod(total, parts)
    return [q + 1 if i < r else q for i in range(parts)]


@dataclass
class Stage:
    """Layers [layers[0], layers[1]) of the coarse chain on one tensor-parallel device group."""

    layers: list[int]
    devices: list[int]
    zero: int = 0
    recompute: bool | int = False  # True / False: all / none of its blocks; k: its first k blocks
    offload: list[str] = field(default_factory=list)
    # dtype ("bf16" | "fp16") that activations sent to the next stage and gradients sent back are cast to
    # on the wire (cast back to the compute dtype on arrival); None sends them uncompressed
    compress: str | None = None
    # tensor-parallel placements the intra-op ILP chose for the stage's repeated blocks (predicted
    # tp_source "ilp"): model parameter name -> "replicate" | "shard(d)"; None runs Megatron's placements
    sharding: dict[str, str] | None = None
    # context parallelism: `devices` is cp tensor-parallel groups of tp devices each (tp fastest); cp rank c
    # runs devices[c * tp:(c + 1) * tp] on its zigzag share of every sequence's tokens (runtime/
    # ring_attention.py), attention exchanging keys and values around the group by `cp_attention`
    # ("ring" | "ulysses"). Every stage of a pipeline has the same cp.
    cp: int = 1
    cp_attention: str = "ring"
    # fwd_s/bwd_s: one full micro-batch; fwd_small_s/bwd_small_s: one of microbatch_size - 1 samples;
    # send_s: activation transfer to the next stage; sync_s: end-of-step gradient sync and optimizer step;
    # compute_s, comm_s, bubble_s (pipeline bubble, see Plan.predicted): per step. Seconds throughout.
    predicted: dict[str, float] = field(default_factory=dict)

    @property
    def tp(self) -> int:
        return len(self.devices) // max(self.cp, 1)

    def cp_groups(self) -> list[list[int]]:
        """The stage's tensor-parallel groups, one per cp rank (one group without context parallelism)."""
        tp = self.tp
        return [list(self.devices[c * tp:(c + 1) * tp]) for c in range(self.cp)]


@dataclass
class Pipeline:
    batch_share: int
    microbatch_size: int
    num_microbatches: int
    stages: list[Stage]

    def microbatch_sizes(self) -> list[int]:
        """Sizes of the micro-batches, larger ones first."""
        return even_split(self.batch_share, self.num_microbatches)

    def device_groups(self) -> list[list[int]]:
        """The distinct device groups (pipeline ranks), in stage order."""
        seen: list[list[int]] = []
        for s in self.stages:
            if s.devices not in seen:
                seen.append(s.devices)
        return seen


@dataclass
class Plan:
    global_batch: int
    precision: str
    optimizer: str
    schedule: str  # "gpipe" | "1f1b" | "interleaved_1f1b" | "zb_h1"
    chunks: int  # stages per device group (1 unless interleaved)
    cluster: dict  # Cluster.to_dict()
    model: dict  # name, num_layers (coarse chain), params, layer_names
    pipelines: list[Pipeline]
    # step_time_s, samples_per_s, tflops_per_device, mfu, peak_memory_bytes, memory_capacity_bytes and
    # host_overlap_bytes (device index -> bytes: what a rank computing the device on the CPU holds beyond its
    # peak, its host share being in the same allocator; solver/pricing/plan.py `rank_shared`); fits and
    # memory_problems (why not); the step's idle time per device, as fractions of it averaged over devices:
    # bubble_fraction (the pipeline bubble: waiting for other
    # stages while the pipeline computes), exposed_sync_fraction (its gradient sync and optimizer step
    # after the last backward), replica_wait_fraction (waiting for slower replicas)
    predicted: dict[str, Any] = field(default_factory=dict)
    memory_reserve: float = 0.1
    # expert parallelism (MoE): None, or a dict describing how experts are spread (see solver/pricing/experts.py)
    experts: dict[str, Any] | None = None
    # graph workloads (GNN): None, or a dict with the mode ("partition" | "sampled_dp") and node shares
    graph: dict[str, Any] | None = None

    # ---- serialization --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @staticmethod
    def from_dict(d: dict) -> Plan:
        try:
            pipelines = [Pipeline(p["batch_share"], p["microbatch_size"], p["num_microbatches"],
                                  [Stage(**s) for s in p["stages"]]) for p in d["pipelines"]]
            predicted = dict(d.get("predicted", {}))
            for key in ("peak_memory_bytes", "memory_capacity_bytes", "host_overlap_bytes", "idle_devices",
                        "peak_memory_parts_bytes"):
                if key in predicted:  # JSON object keys are strings; device indices are ints
                    predicted[key] = {int(k): v for k, v in predicted[key].items()}
            return Plan(d["global_batch"], d["precision"], d["optimizer"], d["schedule"], d["chunks"],
                        d["cluster"], d["model"], pipelines, predicted, d.get("memory_reserve", 0.1),
                        d.get("experts"), d.get("graph"))
        except (KeyError, TypeError) as e:
            raise PlanError(f"not a valid autopar plan: {e!r} (expected the output of Plan.to_json()).") \
                from None

    @staticmethod
    def from_json(s: str | bytes) -> Plan:
        return Plan.from_dict(json.loads(s))

    # ---- views ----------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return sum(len(g) for p in self.pipelines for g in p.device_groups())

    def device_names(self) -> dict[int, str]:
        """Device index -> device type name, from the embedded cluster description."""
        names: dict[int, str] = {}
        for group in self.cluster["nodes"]:
            dev = group["device"]
            name = dev["name"] if isinstance(dev, dict) else str(dev)
            for _ in range(group.get("count", 1) * group.get("devices_per_node", 1)):
                names[len(names)] = name
        return names

    def explain(self) -> str:
        """A table of stages x device groups with the predicted time and memory of each (views/plan.py)."""
        from ..views.plan import explain  # the view above the plan: one of tests/test_layers.py's two upward imports

        return explain(self)

    def simulate(self) -> list[SimResult]:
        """Re-simulate every pipeline from the stage times stored in the plan (replicas with equal times
        share one result)."""
        sims: dict[tuple, SimResult] = {}
        out = []
        for p in self.pipelines:
            key = (p.batch_share, p.num_microbatches, tuple(stage_times(s) for s in p.stages))
            if key not in sims:
                sims[key] = simulate_pipeline(self, p)
            out.append(sims[key])
        return out

    def timeline(self, path: str | Path | None = None) -> dict:
        """A Chrome/Perfetto trace (open in ui.perfetto.dev) of one simulated step of every pipeline.

        Written to `path` when given, and to timeline.json in the dump directory when AUTOPAR_DUMP is
        set. Process ids are the first device of each device group; returns the trace dict.
        """
        from ..views.plan import timeline_trace  # as explain()

        trace = timeline_trace(self)
        text = json.dumps(trace)
        if path is not None:
            Path(path).write_text(text)
        d = dump_dir()
        if d is not None:
            (d / "timeline.json").write_text(text)
        return trace

    def report(self, path: str | Path | None = None, measured: Any = None) -> str:
        """One self-contained HTML page (no network) of the plan: the device map per node, memory per device
        against its capacity, the simulated step as a Gantt chart per device group, the devices left idle and
        why, `explain()`'s text and, with `measured=prog.report()`, measured next to predicted (views/
        html_report.py). Written to `path` when given; returns the page."""
        from ..views.plan import report  # as explain()

        return report(self, path, measured)

    def plot(self, path: str | Path) -> Path:
        """The device map and the simulated timeline as a picture (PNG, SVG or PDF by `path`'s suffix), for papers
        and issues; needs matplotlib (`pip install autopar[plot]`; views/plot.py). Returns the path."""
        from ..views.plan import plot  # as explain()

        return plot(self, path)


def layerwise_stages(pipelines: list[tuple[int, list[tuple[tuple[int, int], int]]]]) -> set[tuple[int, int]]:
    """The (pipeline, stage) positions whose ZeRO-2/3 runs per layer (runtime/zero_layers.py) rather than
    for the whole step: every pipeline has the same micro-batch count and stage count and holds the same
    layer range in that stage, at tensor-parallel degree 1, so all holders of its parameters run the same
    actions in the same order. `pipelines`: per pipeline, (micro-batch count, [(layer range, tp)] per
    stage). The planner prices exactly this (solver/pricing/pricing.py, `stage_memory(layerwise=)`)."""
    if len(pipelines) < 2:
        return set()
    first_m, first = pipelines[0]
    if any(m != first_m or len(st) != len(first) for m, st in pipelines):
        return set()
    return {(i, j) for j, (layers, tp) in enumerate(first) if tp == 1
            and all(tuple(st[j][0]) == tuple(layers) and st[j][1] == 1 for _, st in pipelines)
            for i in range(len(pipelines))}


def stage_times(stage: Stage) -> tuple[float, ...]:
    """The `simulate_stages` times of a stage, from its predictions (bwd_w_s, when predicted, 7th)."""
    p = stage.predicted
    base = (p["fwd_s"], p.get("fwd_small_s", 0.0), p["bwd_s"], p.get("bwd_small_s", 0.0),
            p.get("send_s", 0.0), p.get("sync_s", 0.0))
    return base + (p["bwd_w_s"],) if "bwd_w_s" in p else base


def simulate_pipeline(plan: Plan, pipeline: Pipeline) -> SimResult:
    """Simulate one step of `pipeline` with the stage times stored in `plan`, as the runtime executes it:
    the lowered action list with its per-layer memory actions (`lowering.priced_schedule`), F/B taking the
    rest of their priced time. Equals `simulate_stages` (the planner's memoised path, where the memory
    actions are folded into F/B), because both run on the compute stream and a send waits for them."""
    from ..lowering import priced_schedule

    sched, memory = priced_schedule(plan, pipeline)
    return simulate_times(sched, pipeline.batch_share, pipeline.num_microbatches,
                          [stage_times(s) for s in pipeline.stages],
                          [s.predicted.get("gather_s", 0.0) for s in pipeline.stages],
                          [s.predicted.get("reduce_s", 0.0) for s in pipeline.stages], memory)


@dataclass
class Strategy:
    """A hand-written configuration for `autopar.estimate` (Megatron rank order: tp, then dp, then pp).

    `layer_split` counts repeated blocks per stage (the layers before the first block go on the first
    stage, those after the last on the last stage); `batch_split` gives each replica's samples per step.
    `chunks` (model chunks per device group) only applies to the interleaved schedule (default 2);
    `offload` is a subset of {"optimizer", "activations", "params"} applied to every stage; `compress`
    ("bf16" | "fp16") is the dtype every stage boundary's sends travel in (None: the compute dtype).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatch_size: int | None = None
    schedule: str = "1f1b"
    zero: int = 0
    recompute: bool | int = False  # all / no blocks of every stage, or its first k (all of a smaller stage)
    layer_split: list[int] | tuple[int, ...] | None = None
    batch_split: list[int] | tuple[int, ...] | None = None
    chunks: int | None = None
    offload: tuple[str, ...] = ()
    compress: str | None = None
    ep: int = 1  # expert-parallel degree: consecutive groups of ep replicas share their MoE experts
    cp: int = 1  # context-parallel degree: each sequence's tokens split over cp groups of tp devices
    cp_attention: str = "ring"  # "ring" (keys/values travel around the group) | "ulysses" (all-to-all by heads)

    def check(self) -> None:
        """PlanError naming the field when a count or size is not a number of the right kind (ranges that
        need the model and the cluster to judge are `plan_from_strategy`'s, which calls this)."""
        for name in ("dp", "tp", "pp", "ep", "cp"):
            check_number(f"Strategy.{name}", getattr(self, name), integer=True, low=1)
        if self.cp_attention not in CP_ATTENTION:
            raise PlanError(f"Strategy.cp_attention = {self.cp_attention!r}; choose one of {list(CP_ATTENTION)}.")
        for name in ("microbatch_size", "chunks"):
            check_number(f"Strategy.{name}", getattr(self, name), integer=True, low=1, optional=True)
        check_number("Strategy.zero", self.zero, integer=True)
        if not isinstance(self.recompute, bool):
            check_number("Strategy.recompute", self.recompute, integer=True, low=0,
                         hint="True, False, or the number of each stage's first blocks to recompute")
        for name in ("layer_split", "batch_split"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
                raise PlanError(f"Strategy.{name} must be a list of integers or None, got {value!r}.")
            for i, v in enumerate(value):
                check_number(f"Strategy.{name}[{i}]", v, integer=True)


def plan_from_strategy(strategy: Strategy, *, world_size: int, global_batch: int, num_layers: int,
                       first_block: int, num_blocks: int, **plan_fields: Any) -> Plan:
    """The Plan (without predictions) a Strategy describes; PlanError when it is inconsistent."""
    st = strategy
    st.check()
    if st.dp * st.tp * st.cp * st.pp != world_size:
        raise PlanError(f"dp * tp * cp * pp = {st.dp} * {st.tp} * {st.cp} * {st.pp} = "
                        f"{st.dp * st.tp * st.cp * st.pp}, but the cluster has {world_size} devices; every "
                        f"device must get one tensor-parallel rank of one stage.")
    if st.schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {st.schedule!r}; choose one of {', '.join(SCHEDULES)}.")
    chunks = (st.chunks or 2) if st.schedule == "interleaved_1f1b" else 1
    if st.chunks not in (None, chunks):
        raise PlanError(f"chunks={st.chunks} only applies to the interleaved_1f1b schedule.")
    if not 0 <= st.zero <= 3 or set(st.offload) - set(OFFLOAD_KINDS):
        raise PlanError(f"zero must be 0-3 and offload a subset of {list(OFFLOAD_KINDS)}; "
                        f"got zero={st.zero}, offload={st.offload!r}.")
    if st.batch_split is None:
        if global_batch % st.dp:
            raise PlanError(f"the global batch ({global_batch}) is not divisible by dp={st.dp}; "
                            f"pass batch_split= with {st.dp} per-replica shares summing to {global_batch}.")
        shares = [global_batch // st.dp] * st.dp
    else:
        shares = list(st.batch_split)
        if len(shares) != st.dp or sum(shares) != global_batch or min(shares) < 1:
            raise PlanError(f"batch_split {shares} must have dp={st.dp} positive entries summing to the "
                            f"global batch {global_batch}.")
    stages_per_pipe = st.pp * chunks
    if st.layer_split is None:
        if num_blocks % stages_per_pipe:
            raise PlanError(f"{num_blocks} repeated blocks do not divide into {stages_per_pipe} stages; pass "
                            f"layer_split= with {stages_per_pipe} block counts summing to {num_blocks}.")
        split = [num_blocks // stages_per_pipe] * stages_per_pipe
    else:
        split = list(st.layer_split)
        if len(split) != stages_per_pipe or sum(split) != num_blocks or min(split) < 0:
            raise PlanError(f"layer_split {split} must have {stages_per_pipe} non-negative block counts "
                            f"(pp * chunks) summing to the model's {num_blocks} repeated blocks.")
    edges = [0]
    for k, count in enumerate(split):
        edges.append((first_block if k == 0 else edges[-1]) + count)
    edges[-1] = num_layers
    if any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
        empty = [j for j, (a, b) in enumerate(zip(edges, edges[1:], strict=False)) if b <= a]
        raise PlanError(f"layer_split {split} leaves stage(s) {empty} without layers; only the first and last "
                        f"stages (which hold the layers before/after the blocks) may have 0 blocks. A stage runs "
                        f"at least one layer (an empty one would only relay activations, which a plan cannot "
                        f"express): give every middle stage a block, e.g. move one from a neighbour, or use "
                        f"fewer stages (pp * chunks = {stages_per_pipe}).")
    pipelines = []
    for d, share in enumerate(shares):
        mbs = st.microbatch_size or (1 if st.pp > 1 else share)
        if share % mbs:
            raise PlanError(f"replica {d}'s batch share {share} is not divisible by microbatch_size={mbs}.")
        m = share // mbs
        if chunks > 1 and m % st.pp:
            raise PlanError(f"interleaved_1f1b needs the micro-batch count ({m} for replica {d}) to be a "
                            f"multiple of pp={st.pp}; change microbatch_size or the batch split.")
        width = st.tp * st.cp  # Megatron's order: tp fastest, then cp, then dp, then pp
        stages = [Stage([edges[j], edges[j + 1]],
                        [(j % st.pp) * st.dp * width + d * width + k for k in range(width)],
                        st.zero, st.recompute if isinstance(st.recompute, bool) else min(st.recompute, split[j]),
                        [k for k in OFFLOAD_KINDS if k in st.offload],
                        st.compress if j + 1 < stages_per_pipe else None, cp=st.cp, cp_attention=st.cp_attention)
                  for j in range(stages_per_pipe)]
        pipelines.append(Pipeline(share, mbs, m, stages))
    return Plan(global_batch=global_batch, schedule=st.schedule, chunks=chunks, pipelines=pipelines,
                **plan_fields)


@dataclass
class Estimate:
    """The priced form of a Strategy: its Plan, whose `predicted` also says whether it fits (`fits`) and,
    when not, why (`memory_problems`); `explain()` starts with DOES NOT FIT then."""

    plan: Plan
    fits: bool
    memory_problems: list[str]

    @property
    def predicted(self) -> dict[str, Any]:
        return self.plan.predicted

    def explain(self) -> str:
        return self.plan.explain()


__all__ = ["CP_ATTENTION", "OFFLOAD_KINDS", "Estimate", "Pipeline", "Plan", "Stage", "Strategy", "cached_schedule",
           "even_split", "layerwise_stages", "plan_from_strategy",
           "recompute_count", "simulate_pipeline", "simulate_stages", "simulate_times",
           "simulated_step_time", "stage_times", "wgrad_times"]
