"""What asynchronous training (runtime/asynchronous.py) holds beyond a synchronous step, priced per device.

With updates D waves late, a rank keeps every wave's summed gradient from the end of the wave until its
update is applied, D waves later: while wave c computes, the gradients of waves c - D .. c - 1 are pending
(the runtime's `Wave`s), on top of what `stage_memory` prices for a synchronous step (weights, the gradient
being accumulated, optimizer state, activations). One wave's pending gradient of a stage, per device, as the
runtime keeps it (g bytes per element, the gradients' dtype: the fp32 masters' under mixed precision):

    parameters with several holders (data-parallel replicas; a weight tied across stages): the flat copies
        the reduction packs (runtime/zero.py `iter_reduces`), of the full tensor: a tensor-parallel shard's
        gradient is gathered before it is reduced, so each rank of a tp group keeps P_multi g, not / t
    parameters with one holder: this rank's own gradient tensors (N_single g, shards under tp), kept as
        they are

So peak = static + D x pending + max(activation term, sync), with the `sync` term (`StageMemory.sync`, what
is live after the schedule, when the activations are gone) at least: with tp = 1 one flat bucket
(<= SYNC_BUCKET_BYTES) of the multi-holder gradients, as the runtime packs a wave's buckets replacing
the gradients one bucket at a time and unpacks them at the update one at a time; with tp > 1 the applied
wave's whole flat copy (P_multi g), which the sharded gradients may view until the optimizer step. The
runtime never uses DDP-style gradient buckets in these modes, so that term is never zeroed as for
`bucketed_gradients` plans. ZeRO-1 changes neither term: the reduction is an all-reduce of full flat copies
on every holder (only the owner keeps its gradient after the update's unpacking). Weight versions: none are
kept by the flushed program (every pipeline computes on the one version it holds); the optimizer state is
the synchronous one.

`flushless=True` (the caller's decision: the plan runs 2BW's flushless schedule, runtime/flushless.py; the
solver does not import the runtime) prices that schedule as it runs (solver/flushless_memory.py): each
device's static term gains its second weight version (`flushless_version_bytes`, `versions` below) and
stage s of p keeps `flushless_inflight(p, m)[s]` = p - s micro-batches' activations in flight, which exceeds
flushed 1F1B's min(m, p - s) when m < p - s. The pending gradients are unchanged (D = 1: one wave's sum
pending while the next accumulates; the schedule applies it before the wave after that starts).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..cost_models.memory import SYNC_BUCKET_BYTES
from ..ir.plan import Plan
from ..report import fmt_bytes
from .extra_memory import ExtraMemory, stage_base
from .flushless_memory import flushless_inflight, flushless_version_bytes
from .pricing.plan import rank_peak
from .pricing.stage_memory import StageMemory

if TYPE_CHECKING:
    from .pricing.pricing import CostModel


@dataclass
class AsyncMemory(ExtraMemory):
    """Per device (plan device index): `pending` = bytes of the D pending wave gradients, `versions` = bytes
    of the flushless schedule's second weight version (empty when `flushless` is False), and (ExtraMemory)
    `peak` = the predicted peak with them, `problems` = devices whose peak exceeds what they may fill."""

    delay: int
    flushless: bool = False
    pending: dict[int, int] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)

    def figures(self) -> dict[str, Any]:
        """The entries `predicted["async"]` carries (JSON-safe)."""
        return {"pending_gradient_bytes": dict(self.pending), "second_version_bytes": dict(self.versions),
                "peak_memory_bytes": dict(self.peak), "fits": self.fits, "memory_problems": list(self.problems)}


def _multi_holder_shared(cm: CostModel, plan: Plan) -> list[set[int]]:
    """Per pipeline: the indices into `cm.shared` of the tied parameters held by more than one device group
    of it (every parameter has several holders when there are several pipelines)."""
    out = []
    for pipe in plan.pipelines:
        groups: dict[int, set[tuple[int, ...]]] = {}
        for st in pipe.stages:
            a, e = st.layers
            for k, (_, owner, users) in enumerate(cm.shared):
                if a <= owner < e or any(a <= u < e for u in users):
                    groups.setdefault(k, set()).add(tuple(st.devices))
        out.append({k for k, g in groups.items() if len(g) > 1})
    return out


def async_memory(cm: CostModel, plan: Plan, delay: int, mode: str = "asynchronous training",
                 flushless: bool = False) -> AsyncMemory:
    """The per-device peak of `plan` trained with updates `delay` waves late (module docstring); `mode`
    names the mode in the problems (e.g. "sync='wsp'"); `flushless`: the plan runs the flushless 2BW
    schedule (its second weight version and in-flight activations priced)."""
    from .pricing.pricing import stage_option  # pricing imports this package's modules at import time

    g = cm.state.grads
    devices = cm.cluster.devices
    out = AsyncMemory(delay, flushless)
    versions = flushless_version_bytes(cm, plan) if flushless else {}
    dp_groups = [tuple(p.stages[j].devices[0] for p in plan.pipelines if j < len(p.stages))
                 for j in range(max(len(p.stages) for p in plan.pipelines))]
    tied = _multi_holder_shared(cm, plan)
    comms = cm.communicators(plan)
    for i, pipe in enumerate(plan.pipelines):
        ranks = len(pipe.stages) // plan.chunks
        inflight = (dict(enumerate(flushless_inflight(ranks, pipe.num_microbatches))) if flushless
                    else cm.peak_inflight(plan.schedule, ranks, pipe.num_microbatches, plan.chunks))
        mems: list[StageMemory] = []
        waves: list[float] = []
        for j, st in enumerate(pipe.stages):
            a, e = st.layers
            tp = len(st.devices)
            base, local = stage_base(cm, pipe, st)  # local: this rank's gradient elements
            mem = cm.stage_memory(base, stage_option(st, cm), tp, len(dp_groups[j]), False)
            multi = float(base.params) if len(plan.pipelines) > 1 else float(sum(
                n for k, (n, owner, users) in enumerate(cm.shared)
                if k in tied[i] and (a <= owner < e or any(a <= u < e for u in users))))
            single = 0.0 if multi >= base.params else max(0.0, local - multi / tp)
            wave = g * (multi + single)
            after = g * multi if tp > 1 else min(SYNC_BUCKET_BYTES, g * multi)
            mems.append(replace(mem, static=mem.static + delay * wave, sync=max(mem.sync, after)))
            waves.append(wave)
        for r in range(ranks):
            pending = delay * sum(waves[r::ranks])
            for d in pipe.stages[r].devices:
                need = rank_peak(mems[r::ranks], inflight[r]) + versions.get(d, 0)
                out.pending[d] = round(pending)
                if flushless:
                    out.versions[d] = versions[d]
                second = (f" and the flushless schedule's second weight version ({fmt_bytes(versions[d])}, "
                          f"{inflight[r]} micro-batch(es) in flight)" if flushless else "")
                out.check(cm, d, need,
                          f"device {d} ({devices[d].spec.name}, pipeline {i} stage {r}) needs {fmt_bytes(need)} with "
                          f"{mode}'s {delay} pending wave gradient(s) ({fmt_bytes(pending)}: each wave's summed "
                          f"gradients are kept until its update is applied {delay} wave(s) later){second}", share=True,
                          communicators=comms.get(d))
    out.pending, out.peak = dict(sorted(out.pending.items())), dict(sorted(out.peak.items()))
    out.versions = dict(sorted(out.versions.items()))
    return out


__all__ = ["AsyncMemory", "async_memory"]
