"""Who does what: the rank-level view of a plan that the runtime executes.

A layout is a list of pipelines (data-parallel replicas). Pipeline i takes samples
[offset, offset + batch) of every global batch, cut into micro-batches, and runs its stages on groups of
ranks (one tensor-parallel group per stage). Replicas may differ in device type, layer split and batch
share; gradients are weighted by share, so training equals single-device training.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import PlanError
from ..plan import even_split  # noqa: F401  (re-exported: the runtime's callers import it from here)

COMPRESS_DTYPES: dict[str | None, torch.dtype | None] = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class StageLayout:
    layers: tuple[int, int]
    ranks: tuple[int, ...]  # the stage's tensor-parallel group
    zero: int = 0
    recompute: bool = False
    offload: tuple[str, ...] = ()
    # "bf16" | "fp16": floating activations this stage sends to the next one, and the gradients sent back
    # to it, travel in that dtype (see dist.py, `wire_dtype`); None sends them exactly
    compress: str | None = None
    # (parameter name, "replicate" | "shard(d)") pairs: the intra-op ILP's placements (`plan.Stage.sharding`,
    # `tensor_parallel.sharding_spec`); None runs `megatron_spec`
    sharding: tuple[tuple[str, str], ...] | None = None


@dataclass(frozen=True)
class PipelineLayout:
    """A data-parallel replica. With `chunks` > 1 (interleaved 1F1B), stage s runs on device group
    s % (len(stages) // chunks), so each group holds `chunks` stages."""

    index: int
    stages: tuple[StageLayout, ...]
    batch_offset: int
    batch_size: int
    num_microbatches: int
    schedule: str = "1f1b"
    chunks: int = 1

    @property
    def num_groups(self) -> int:
        return len(self.stages) // self.chunks

    @property
    def microbatch_sizes(self) -> list[int]:
        """Sizes of the micro-batches, as even as possible (larger ones first, like torch.tensor_split)."""
        return even_split(self.batch_size, self.num_microbatches)

    def bounds(self) -> list[tuple[int, int]]:
        return [s.layers for s in self.stages]


@dataclass(frozen=True)
class Position:
    pipeline: int
    group: int  # pipeline rank (device group) index within the pipeline
    tp_index: int
    stages: tuple[int, ...]  # the stages this rank runs (several with interleaving)


@dataclass(frozen=True)
class Layout:
    pipelines: tuple[PipelineLayout, ...]
    world_size: int
    global_batch: int
    positions: dict[int, Position] = field(default_factory=dict, compare=False)
    ep: int = 1  # expert-parallel degree: consecutive replicas share their experts (expert_parallel.py)

    def position(self, rank: int) -> Position | None:
        return self.positions.get(rank)


def make_layout(
    pipelines: list[PipelineLayout], world_size: int, global_batch: int, num_layers: int, ep: int = 1
) -> Layout:
    """Check a layout for consistency and index rank positions."""
    positions: dict[int, Position] = {}
    covered = 0
    for p in sorted(pipelines, key=lambda p: p.batch_offset):
        if p.batch_offset != covered:
            raise PlanError(
                f"pipeline {p.index} takes samples from {p.batch_offset}, expected {covered}: batch "
                f"shares must tile the global batch."
            )
        covered += p.batch_size
        if p.num_microbatches < 1 or p.num_microbatches > p.batch_size:
            raise PlanError(
                f"pipeline {p.index}: {p.num_microbatches} micro-batches for {p.batch_size} samples."
            )
        if p.stages[0].layers[0] != 0 or p.stages[-1].layers[1] != num_layers:
            raise PlanError(f"pipeline {p.index} must cover layers [0, {num_layers}), got {p.bounds()}.")
        if p.chunks < 1 or len(p.stages) % p.chunks:
            raise PlanError(
                f"pipeline {p.index}: {len(p.stages)} stages cannot be {p.chunks} chunks per group."
            )
        for s, st in enumerate(p.stages):
            if st.compress not in COMPRESS_DTYPES:
                raise PlanError(
                    f"pipeline {p.index} stage {s}: compress={st.compress!r}; choose one of "
                    f"{sorted(k for k in COMPRESS_DTYPES if k)} or None (uncompressed)."
                )
            if s and st.layers[0] != p.stages[s - 1].layers[1]:
                raise PlanError(
                    f"pipeline {p.index}: stage {s} starts at layer {st.layers[0]}, expected "
                    f"{p.stages[s - 1].layers[1]}."
                )
            group = s % p.num_groups
            if st.ranks != p.stages[group].ranks:
                raise PlanError(
                    f"pipeline {p.index}: stage {s} must run on the devices of stage {group} "
                    f"({list(p.stages[group].ranks)}) with {p.chunks} chunks per device group."
                )
            for k, r in enumerate(st.ranks):
                if not 0 <= r < world_size:
                    raise PlanError(
                        f"rank {r} in pipeline {p.index} stage {s} is outside the world of "
                        f"{world_size} ranks."
                    )
                if r in positions and s < p.num_groups:
                    raise PlanError(
                        f"rank {r} is used twice (pipeline {p.index} stage {s} and {positions[r]})."
                    )
                old = positions.get(r)
                positions[r] = Position(p.index, group, k, (old.stages if old else ()) + (s,))
    if covered != global_batch:
        raise PlanError(f"pipelines take {covered} samples but the global batch has {global_batch}.")
    return Layout(tuple(pipelines), world_size, global_batch, positions, ep)


def megatron_layout(
    dp: int,
    tp: int,
    pp: int,
    global_batch: int,
    num_layers: int,
    num_blocks: int,
    num_microbatches: int,
    schedule: str = "1f1b",
    layer_split: list[int] | None = None,
    batch_split: list[int] | None = None,
    first_block: int = 1,
    zero: int = 0,
    recompute: bool = False,
    chunks: int = 1,
) -> Layout:
    """Megatron's rank order: tensor-parallel fastest, then data-parallel, then pipeline stage.

    `layer_split` counts repeated blocks per stage (pre layers go to the first stage, post to the last);
    with `chunks` > 1 (interleaved 1F1B) there are pp * chunks stages, stage s on device group s % pp.
    """
    n_stages = pp * chunks
    split = layer_split or even_split(num_blocks, n_stages)
    if len(split) != n_stages or sum(split) != num_blocks or min(split) < 0:
        raise PlanError(f"layer_split {split} must have {n_stages} entries summing to {num_blocks} blocks.")
    shares = batch_split or even_split(global_batch, dp)
    if len(shares) != dp or sum(shares) != global_batch:
        raise PlanError(
            f"batch_split {shares} must have {dp} entries summing to the global batch {global_batch}."
        )
    edges = [0]
    for k, n in enumerate(split):
        edges.append((first_block if k == 0 else edges[-1]) + n)
    edges[-1] = num_layers
    pipelines = []
    offset = 0
    for d in range(dp):
        stages = tuple(
            StageLayout(
                (edges[s], edges[s + 1]),
                tuple((s % pp) * dp * tp + d * tp + t for t in range(tp)),
                zero=zero,
                recompute=recompute,
            )
            for s in range(n_stages)
        )
        pipelines.append(
            PipelineLayout(d, stages, offset, shares[d], min(num_microbatches, shares[d]), schedule, chunks)
        )
        offset += shares[d]
    return make_layout(pipelines, dp * tp * pp, global_batch, num_layers)

