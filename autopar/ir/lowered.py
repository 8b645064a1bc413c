"""The lowered view of a plan: what each rank executes, as data (`lowering.lower` derives it, the runtime
executes it). The layout says who does what: each pipeline (a data-parallel replica) with its stages' layer
ranges, tensor-parallel groups, ZeRO level, recompute, offload and compression, its batch slice, micro-batches and
schedule, and each rank's position in it. `RankProgram` is one rank's share: its parameters and their holders,
ZeRO levels and owners, its per-layer memory actions, process groups, and its action list and steps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import PlanError
from .plan import even_split
from .schedule import MEMORY_OF, Action, Schedule

COMPRESS_DTYPES: dict[str | None, torch.dtype | None] = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}
Group = tuple[int, ...]


# ---- the layout: who does what ---------------------------------------------------------------------------

@dataclass(frozen=True)
class StageLayout:
    layers: tuple[int, int]
    ranks: tuple[int, ...]  # the stage's tensor-parallel group
    zero: int = 0
    recompute: bool | int = False  # all / none of the stage's blocks, or its first k (`plan.recompute_count`)
    offload: tuple[str, ...] = ()
    # "bf16" | "fp16": floating activations this stage sends to the next one, and the gradients sent back
    # to it, travel in that dtype (see runtime/dist.py, `wire_dtype`); None sends them exactly
    compress: str | None = None
    # (parameter name, "replicate" | "shard(d)") pairs: the intra-op ILP's placements (`plan.Stage.sharding`);
    # None runs Megatron's placements
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
    # context parallelism: (c, cp) for cp rank c of a plan pipeline whose stages have cp > 1. The lowering
    # makes one PipelineLayout per cp rank, each on its tensor-parallel groups, all taking the same samples;
    # this one computes on zigzag share c of every sequence's tokens (runtime/context_parallel.py)
    seq_part: tuple[int, int] = (0, 1)
    origin: int = -1  # the index of the plan's pipeline this one lowers (-1: `index`)

    @property
    def plan_index(self) -> int:
        """The index of this pipeline in `Plan.pipelines` (cp siblings share one)."""
        return self.index if self.origin < 0 else self.origin

    @property
    def num_groups(self) -> int:
        return len(self.stages) // self.chunks

    @property
    def microbatch_sizes(self) -> list[int]:
        """Sizes of the micro-batches, as even as possible (larger ones first, like torch.tensor_split)."""
        return even_split(self.batch_size, self.num_microbatches)

    def bounds(self) -> list[tuple[int, int]]:
        return [s.layers for s in self.stages]

    def source(self, stage: int, tp_index: int) -> int:
        """The rank of `stage` that the rank at tensor-parallel index `tp_index` of an adjacent stage receives
        from: the same index, modulo `stage`'s degree when the two differ (a tp per device type in one
        pipeline). Every rank of a tensor-parallel group holds the whole activation and input gradient at a
        stage boundary, so any one of them can send it."""
        ranks = self.stages[stage].ranks
        return ranks[tp_index % len(ranks)]

    def targets(self, stage: int, tp_index: int, degree: int) -> tuple[int, ...]:
        """The ranks of `stage` that the rank at `tp_index` of an adjacent stage of `degree` ranks sends to:
        those whose `source` it is (the same index when the degrees are equal; none for a tp rank beyond a
        smaller next group; several into a larger one)."""
        return tuple(r for i, r in enumerate(self.stages[stage].ranks) if i % degree == tp_index)

    def peers(self, action: Any, tp_index: int) -> tuple[int, ...]:
        """The ranks a transfer action (schedule.Action or schedule_waves.WaveAction) of the rank at `tp_index`
        of its stage's group sends to or receives from: one source for a RECV, the `targets` of a SEND."""
        s, kind = action.stage, action.kind
        other = s + 1 if kind in ("SEND_F", "RECV_B") else s - 1
        if kind.startswith("RECV"):
            return (self.source(other, tp_index),)
        return self.targets(other, tp_index, len(self.stages[s].ranks))


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

    def cp_siblings(self, pipeline: int) -> tuple[PipelineLayout, ...]:
        """The pipelines of `pipeline`'s context-parallel group in cp order (itself alone without cp)."""
        p = self.pipelines[pipeline]
        if p.seq_part[1] == 1:
            return (p,)
        return tuple(sorted((q for q in self.pipelines if q.batch_offset == p.batch_offset
                             and q.seq_part[1] == p.seq_part[1]), key=lambda q: q.seq_part[0]))

    def cp_groups(self) -> list[Group]:
        """Every context-parallel group of ranks: per cp pipeline group, stage and tensor-parallel index,
        the rank of each cp sibling (ring order)."""
        out: set[Group] = set()
        for p in self.pipelines:
            if p.seq_part[1] > 1 and p.seq_part[0] == 0:
                sib = self.cp_siblings(p.index)
                for s, st in enumerate(p.stages):
                    for t in range(len(st.ranks)):
                        out.add(tuple(q.stages[s].ranks[t] for q in sib))
        return sorted(out)



@dataclass(frozen=True)
class RankProgram:
    """Everything one rank executes (module docstring). Stage programs are cut from the graph by layer
    range (`layout.pipelines[position.pipeline].stages[s].layers`, codegen/split.py)."""

    rank: int
    layout: Layout
    position: Position | None  # None: an idle rank (takes part in collectives only)
    holders: dict[str, tuple[Group, ...]]  # parameter -> tensor-parallel groups holding a copy
    levels: dict[str, int]  # parameter -> ZeRO level (highest among its holding stages)
    owners: dict[str, Group]
    params: tuple[str, ...]  # the parameters of this rank's stages
    offload: dict[str, frozenset[str]]  # this rank's parameters -> offload kinds of its stages holding them
    layer_reduced: dict[str, int]  # ZeRO-2/3 parameter -> the layer whose REDUCE reduces it
    layer_gathered: dict[str, int]  # ZeRO-3 parameter -> the layer whose GATHER_* / FREE_* bring it in
    streamed: dict[str, int]  # offloaded parameter -> the layer that streams it (GATHER/FREE/REDUCE)
    recompute: dict[int, frozenset[int]]  # stage -> its blocks recomputed one at a time (`recomputed_blocks`)
    groups: tuple[Group, ...]  # process groups: tensor-parallel groups and replica sets of parameters
    schedule: Schedule | None  # this rank's pipeline's schedule, with this rank's memory actions
    actions: tuple[Action, ...] = ()  # this rank's list in it
    # What the executor runs of `actions`, step by step: one compute action, or a batch of transfers issued
    # together (lowering.transfer_steps); memory actions run inside their F / B (zero_layers.py), ALLREDUCE
    # after the schedule, so neither is a step. () for an idle rank. `eval_steps`: the same of `eval_actions`.
    steps: tuple[tuple[Action, ...], ...] = ()
    eval_steps: tuple[tuple[Action, ...], ...] = ()

    @property
    def pipeline(self) -> PipelineLayout:
        assert self.position is not None
        return self.layout.pipelines[self.position.pipeline]

    @property
    def tp_group(self) -> Group:
        """This rank's tensor-parallel group ((rank,) for an idle rank)."""
        if self.position is None:
            return (self.rank,)
        return tuple(self.pipeline.stages[self.position.stages[0]].ranks)

    def steps_of(self, actions: Sequence[Action]) -> tuple[tuple[Action, ...], ...]:
        """The steps of `actions`, which must be `actions` or `eval_actions`."""
        if tuple(actions) == self.actions:
            return self.steps
        if tuple(actions) == self.eval_actions:
            return self.eval_steps
        raise PlanError("the executor was given an action list that is neither the rank's training list nor its "
                        "eval list (RankProgram.actions / eval_actions): its transfers have no batches.")

    @property
    def eval_actions(self) -> tuple[Action, ...]:
        """The forward-only list `eval_step` runs: the F / SEND_F / RECV_F actions in training order (a subset
        of a deadlock-free list whose forwards never wait for a backward, so it cannot deadlock either)."""
        return tuple(a for a in self.actions if a.kind in ("F", "SEND_F", "RECV_F"))

    def layered_stages(self) -> set[int]:
        """This rank's stages that run layer by layer (runtime/layered.py): recompute per block, or memory
        actions."""
        with_memory = {a.stage for a in self.actions if a.kind in MEMORY_OF}
        return {s for s, blocks in self.recompute.items() if blocks} | with_memory
