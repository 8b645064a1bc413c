"""What a layer split is made of and the objective it is scored by: a pipeline's stage positions (`Slot`),
what one device's placed chunks hold (`RankState`), a stage's chosen option (`Choice`), a split (`Split`)
and the surrogate objective (`surrogate`, `priced_surrogate`). Below split.py (the search over splits) and
stage_model.py (the CP-SAT refinement split.py runs), which both build on them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from ..pricing.pricing import CostModel, Option, StageMemory, StageTimes, rank_host, rank_peak, settled_work

Unit = tuple[int, ...]  # a tensor-parallel group


class Slot(NamedTuple):
    """One stage position of a pipeline: where it runs and what memory it may use."""

    dtype: str
    tp_group: Unit
    dp_group: Unit
    inflight: int
    budget: float
    sigs: tuple[int, int]  # CostModel.group_sig of the tp and dp groups
    host_budget: float = math.inf  # host bytes each of its devices may fill (`CostModel.host_budget`)
    unified: bool = False  # its devices' memory is the host's: what they offload counts in `budget` too
    # its ZeRO-2/3 would run per layer (`plan.layerwise_stages`: every replica alike, tp 1); elsewhere the runtime
    # gathers and reduces for the whole step, whose peak is ZeRO-1's at more traffic, so only ZeRO 0-1 are tried
    layerwise: bool = True
    # its data-parallel peers run at other tensor-parallel degrees (a tp per pipeline class): the sync moves
    # whole tensors among the groups' first ranks (`CostModel.stage_times(mixed_tp=True)`)
    mixed_tp: bool = False
    # the pipeline's micro-batches per step, by which a backward meets the gradient accumulation's transient
    # (`pricing.settled_work`); None where that is not known from the position alone (a device's interleaved
    # chunks: counted always, never less than pricing's walk along the schedule)
    microbatches: int | None = None

    def fits(self, need: float, host: float) -> bool:
        """Whether a device of this slot needing `need` bytes, and `host` bytes of host memory, fits."""
        return host <= self.host_budget and need + (host if self.unified else 0.0) <= self.budget


def position_microbatches(microbatches: int, chunks: int) -> int | None:
    """`Slot.microbatches` of a pipeline of `microbatches` per step whose devices hold `chunks` model chunks each."""
    return microbatches if chunks == 1 else None


def rank_fits(mems: list[StageMemory], inflight: int, slot: Slot, microbatches: int | None) -> bool:
    """Whether one device of `slot` holding these stages fits with `inflight` of `microbatches` micro-batches in
    flight (`rank_peak`, `rank_host`)."""
    return slot.fits(rank_peak(mems, inflight, microbatches), rank_host(mems, inflight))


class RankState(NamedTuple):
    """What one device's already placed chunks hold (interleaved schedules), for `rank_peak`."""

    static: float = 0.0  # their static memory
    act: float = 0.0  # the largest in-flight activation term among them
    work: float = 0.0  # the largest recompute workspace among them
    later: int = 0  # chunks of this device still to place after the one being checked
    host: float = 0.0  # their host memory (`StageMemory.host`)
    host_act: float = 0.0  # the largest in-flight host activation term among them
    sync: float = 0.0  # the largest gradient-sync bucket among them (`StageMemory.sync`)

    def need(self, mem: StageMemory, inflight: int, microbatches: int | None) -> float:
        """The device's peak with `mem` added, projecting `later` more chunks of the same static size
        (exactly `rank_peak` for the last chunk)."""
        act = (min(inflight, 1) if mem.offload_act else inflight) * mem.act
        work = settled_work(mem, inflight, microbatches)
        return self.static + (1 + self.later) * mem.static + max(max(self.act, act) + max(self.work, work),
                                                                  self.sync, mem.sync)

    def host_need(self, mem: StageMemory, inflight: int) -> float:
        """The device's host bytes with `mem` added, projected as `need` does (exactly `rank_host`)."""
        return self.host + (1 + self.later) * mem.host + max(self.host_act, inflight * mem.host_act)

    def fits(self, mem: StageMemory, slot: Slot) -> bool:
        return slot.fits(self.need(mem, slot.inflight, slot.microbatches), self.host_need(mem, slot.inflight))

    def add(self, mem: StageMemory, inflight: int, microbatches: int | None) -> RankState:
        act = (min(inflight, 1) if mem.offload_act else inflight) * mem.act
        return RankState(self.static + mem.static, max(self.act, act),
                         max(self.work, settled_work(mem, inflight, microbatches)),
                         max(self.later - 1, 0), self.host + mem.host, max(self.host_act, inflight * mem.host_act),
                         max(self.sync, mem.sync))


NO_CHUNKS = RankState()


class Choice(NamedTuple):
    option: Option
    times: StageTimes
    memory: StageMemory
    out_bytes: float


class Closest(NamedTuple):
    """One stage's option nearest to fitting: its device and host needs, and the budgets they exceed."""

    need: float
    budget: float
    host: float
    host_budget: float
    dtype: str
    device: int  # first device of the stage's tp group
    option: Option
    layers: tuple[int, int]


@dataclass
class Split:
    stages: list[tuple[int, int, Choice]]
    surrogate: float
    # where the stage model decided it: no split of the pipeline class it was solved for has a surrogate below
    # (1 - gap) x this one's (stage_model.py: what is proven); None elsewhere
    gap: float | None = None


def surrogate(times: list[StageTimes], sends: list[float], ranks: int, mult: float) -> float:
    """The inner objective: max over stages j on rank r of
        F_r + max(W_r, v w_j) + max(Q_r + sync_0, send_{j-1} + sync_j),    w_j = mult (fwd_j + bwd_j)
    with F_r, Q_r the forward/backward prefix (sends included) of the stages before rank r's first one,
    W_r the rank's total work (mult = micro-batches). It bounds `pricing.lower_bound` from above (so a
    config's bound also bounds it from below); v w_j keeps interleaved chunks even."""
    chunks = len(times) // ranks
    fwd_pre, bwd_pre, work = [0.0] * ranks, [0.0] * ranks, [0.0] * ranks
    pf = pb = worst = 0.0
    for j, t in enumerate(times):
        r = j % ranks
        if j < ranks:
            fwd_pre[r], bwd_pre[r] = pf, pb
            pf, pb = pf + t.fwd + sends[j], pb + t.bwd + sends[j]
        w = mult * (t.fwd + t.bwd)
        work[r] += w
        tail = max(bwd_pre[r] + times[0].sync, (sends[j - 1] if j else 0.0) + t.sync)
        worst = max(worst, fwd_pre[r] + max(work[r], chunks * w) + tail)
    return worst


def priced_surrogate(cm: CostModel, slots: list[Slot], stages: list[tuple[int, int, Choice]], chunks: int,
                     mult: float) -> float:
    """`surrogate` of a split on `slots`, its sends priced as the plan sends them (`CostModel.stage_send`)."""
    S = len(slots)
    sends = [0.0 if j + 1 == S else cm.stage_send(c.out_bytes, slots[j].tp_group, slots[j + 1].tp_group)
             for j, (_, _, c) in enumerate(stages)]
    return surrogate([c.times for _, _, c in stages], sends, S // chunks, mult)


__all__ = ["NO_CHUNKS", "Choice", "Closest", "RankState", "Slot", "Split", "Unit", "position_microbatches",
           "priced_surrogate", "rank_fits", "surrogate"]
