"""Memory a training mode holds on top of what a plan's step is priced at, per device: the shape the
asynchronous modes (async_memory.py, with flushless_memory.py's second weight version) and re-routing's
pre-step copy (reroute_memory.py) share.

Each mode adds bytes per device to a stage's figures (`stage_base`: the stage's `CostModel.base` and its
parameter elements per tensor-parallel rank), arrives at a predicted peak per device and checks it against
what the device may fill (`CostModel.usable`, as every memory check of the planner): `ExtraMemory` keeps the
peaks and a problem line per device over it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..ir.plan import Pipeline, Stage
from ..report import fmt_bytes
from .pricing.stage_memory import runtime_note

if TYPE_CHECKING:
    from .pricing.model import StageBase
    from .pricing.pricing import CostModel


@dataclass(kw_only=True)
class ExtraMemory:
    """Per device (plan device index): `peak` = the predicted peak with the mode's extra bytes, `problems` =
    a line for each device whose peak exceeds what it may fill. A mode's own figures are its subclass's
    fields (`AsyncMemory.pending`, `RerouteMemory.copy`, ...)."""

    peak: dict[int, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    def check(self, cm: CostModel, d: int, need: float, what: str, share: bool = False,
              communicators: int | None = None) -> None:
        """Record `need` (bytes, rounded) as device `d`'s peak; when it is over what `d` may fill (with the buffers
        of its `communicators` NCCL communicators, `CostModel.usable`), the problem "`what`, over the <usable>
        it may fill[ (<share>% of <memory>)]." with the runtime's note on the device (`share`: say the
        fraction of the device's memory that is)."""
        self.peak[d] = round(need)
        usable = cm.usable(d, communicators)
        if need > usable:
            of = (f" ({100 * (1 - cm.reserve):.0f}% of {fmt_bytes(cm.cluster.devices[d].spec.memory)})" if share
                  else "")
            self.problems.append(f"{what}, over the {fmt_bytes(usable)} it may fill{of}."
                                 + runtime_note(cm, d, communicators))


def stage_base(cm: CostModel, pipe: Pipeline, st: Stage) -> tuple[StageBase, float]:
    """Stage `st` of pipeline `pipe` as the cost model prices it (`cm.base` on its layers, its first device's
    type, the pipeline's micro-batch size and its tensor-parallel group), and its parameter elements per
    tensor-parallel rank: params / t + the replicated extra (`StageBase.tp_extra`), as stage_memory counts them."""
    a, e = st.layers
    base = cm.base(a, e, cm.cluster.devices[st.devices[0]].spec.name, pipe.microbatch_size, tuple(st.devices))
    return base, base.params / len(st.devices) + base.tp_extra


__all__ = ["ExtraMemory", "stage_base"]
