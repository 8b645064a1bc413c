"""What PipeDream-2BW's flushless schedule (runtime/flushless.py) holds beyond the flushed asynchronous
program (runtime/asynchronous.py, priced by solver/async_memory.py).

* A second weight version per stage (2BW's double buffering, Narayanan et al. 2021, section 3.1): while
  wave c's backwards still run on W[c-1], the update of wave c - 1 writes W[c] into a second buffer, so each
  device holds one more copy of its stage's parameters, N w bytes (N its parameter elements, w the weight
  bytes: 4, the fp32 masters under every precision the mode runs, cost_models/memory.py `state_bytes`),
  from the first update on (`schedule_waves.peak_versions` == 2). The optimizer state and the pending wave
  gradients are async_memory's (one wave pending, D = 1).
* Activations: stage s of p keeps at most p - s micro-batches in flight, as flushed 1F1B does when
  m >= p - s; with fewer micro-batches per wave (m < p - s) the next wave's micro-batches join them and
  the count is p - s, not m (`flushless_inflight`).

The caller decides whether the flushless schedule is what runs (solver/asynchronous.py
`flushless_problems`, through its `runs_flushless`) and passes `async_memory(..., flushless=True)`, which
adds `flushless_version_bytes` to each device's peak and uses `flushless_inflight` for the in-flight
count (measured within 15%: tests/test_async_memory.py, bench/memory.py). ZeRO-1 keeps both versions on
every replica (each holds the stage's full weights); under tensor parallelism each rank's versions are its
local shards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..ir.plan import Plan
from ..ir.schedule_waves import waves_1f1b
from .extra_memory import stage_base

if TYPE_CHECKING:
    from .pricing.pricing import CostModel


def second_version_bytes(params_per_device: dict[int, float], weight_bytes: int, runs: bool = True
                         ) -> dict[int, int]:
    """Per device, the bytes of its second weight version: its stage's parameter elements x `weight_bytes`
    (0 everywhere when the flushless schedule does not run: `runs` False)."""
    return {d: round(n * weight_bytes) if runs else 0 for d, n in params_per_device.items()}


def flushless_inflight(num_stages: int, num_microbatches: int) -> list[int]:
    """Per stage, the most micro-batches whose activations are alive at once in the steady flushless
    schedule (from the generated schedule of 3 waves: the continuous 1F1B's cap p - s)."""
    ws = waves_1f1b(num_stages, num_microbatches, 3, 1)
    out = []
    for s in range(num_stages):
        live = peak = 0
        for a in ws.actions[s]:
            live += 1 if a.kind == "F" else -1 if a.kind == "B" else 0
            peak = max(peak, live)
        out.append(peak)
    return out


def flushless_version_bytes(cm: CostModel, plan: Plan) -> dict[int, int]:
    """`second_version_bytes` of every device of `plan` (its stage's parameters, as async_memory reads them:
    `cm.base(...).params`, and tensor-parallel shards / t with the stage's extra replicated elements)."""
    elements: dict[int, float] = {}
    for pipe in plan.pipelines:
        for st in pipe.stages:
            _, n = stage_base(cm, pipe, st)
            for d in st.devices:
                elements[d] = elements.get(d, 0.0) + n
    return second_version_bytes(dict(sorted(elements.items())), cm.state.weights)


__all__ = ["flushless_inflight", "flushless_version_bytes", "second_version_bytes"]
