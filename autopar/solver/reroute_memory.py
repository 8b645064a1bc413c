"""What re-routing around a lost rank (runtime/reroute.py) holds beyond a step, priced per device.

A job that survives a lost rank redoes the failed step from a copy of each rank's state taken before every
step (`reroute.Snapshot`), so during a step each device holds, besides what `stage_memory` prices, one copy
of what its stages keep between steps, as the rank keeps it (tensor-parallel shards stay shards):

    parameters       N w   (N = the stage's parameters per tensor-parallel rank, `CostModel.base`: params / t
                            + the ILP's replicated extra; w = 4, fp32 weights or masters)
    optimizer state  N o   (o: cost_models/memory.py's OPTIMIZER_STATE_BYTES, 8 for Adam/AdamW's two fp32
                            moments; the 4-byte `step` tensor per parameter tensor is left out, < 0.1% of it)
    buffers          the stage's buffers whole (the runtime does not shard buffers)

on the device, or in host memory for what the stage offloads there (parameters with offload "params", the
optimizer state with "optimizer"): a copy is made where the tensor lives. ZeRO plans are not re-routed
(the runtime takes no copy), so the copy is priced for ZeRO-0 stages; with ZeRO the owned share (N / dp)
would be copied. The copy lives for the whole step (the previous one is freed before the next is taken),
so it adds to the step's peak: `peak = predicted peak + copy`, checked against what the device may fill
(`CostModel.usable`, as for every memory check of the planner); the host part is reported, not checked
against the node's host memory. The planner's search does not add the copy: a plan is chosen as if
re-routing were off and then checked here. The runtime calls this through the
callback compile gives it (the solver does not import the runtime) and records the result as
`plan.predicted["reroute"]`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..ir.plan import Plan
from ..report import fmt_bytes
from .extra_memory import ExtraMemory, stage_base

if TYPE_CHECKING:
    from .pricing.pricing import CostModel


@dataclass
class RerouteMemory(ExtraMemory):
    """Per device (plan device index): `copy` = device bytes of the pre-step copy, `host` = its host bytes,
    and (ExtraMemory) `peak` = the plan's predicted peak with the copy, `problems` = devices where that does
    not fit."""

    copy: dict[int, int] = field(default_factory=dict)
    host: dict[int, int] = field(default_factory=dict)

    def block(self) -> dict[str, Any]:
        """`plan.predicted["reroute"]` (JSON-safe: device indices as strings)."""
        return {"on": True, "copy_bytes": {str(d): b for d, b in self.copy.items()},
                "host_copy_bytes": {str(d): b for d, b in self.host.items()},
                "peak_memory_bytes": {str(d): b for d, b in self.peak.items()}, "fits": self.fits,
                "memory_problems": list(self.problems),
                "note": "a prediction of the cost model: one copy of each rank's parameters, optimizer state and "
                        "buffers, held through every step (solver/reroute_memory.py)"}


def _buffer_bytes(cm: CostModel, a: int, e: int) -> int:
    return sum(p.meta.nbytes for p in cm.graph.params.values() if p.is_buffer and a <= p.layer < e)


def reroute_memory(cm: CostModel, plan: Plan) -> RerouteMemory:
    """The pre-step copy of every device of `plan` (priced: `plan.predicted["peak_memory_bytes"]` present)
    and whether it fits on top of the step's peak (module docstring)."""
    w, o = cm.state.weights, cm.state.optimizer
    devices = cm.cluster.devices
    out = RerouteMemory()
    copy: dict[int, float] = {}
    host: dict[int, float] = {}
    dp = {j: len(plan.pipelines) for j in range(max(len(p.stages) for p in plan.pipelines))}
    for pipe in plan.pipelines:
        for j, st in enumerate(pipe.stages):
            a, e = st.layers
            _, n = stage_base(cm, pipe, st)
            owned = n / dp[j] if st.zero >= 1 and dp[j] > 1 else n
            parts = ((n * w, "params" in st.offload), (owned * o, "optimizer" in st.offload),
                     (float(_buffer_bytes(cm, a, e)), False))
            for d in st.devices:
                for nbytes, on_host in parts:
                    where = host if on_host else copy
                    where[d] = where.get(d, 0.0) + nbytes
    peaks = plan.predicted.get("peak_memory_bytes") or {}
    comms = cm.communicators(plan)
    for d in sorted(set(copy) | set(host)):
        out.copy[d], out.host[d] = math.ceil(copy.get(d, 0.0)), math.ceil(host.get(d, 0.0))
        need = int(peaks.get(d, 0)) + out.copy[d]
        out.check(cm, d, need,
                  f"device {d} ({devices[d].spec.name}): re-routing's pre-step copy of its state "
                  f"({fmt_bytes(out.copy[d])}: parameters, optimizer state and buffers) on top of the step's "
                  f"predicted peak {fmt_bytes(int(peaks.get(d, 0)))} needs {fmt_bytes(need)}",
                  communicators=comms.get(d))
    return out


__all__ = ["RerouteMemory", "reroute_memory"]
