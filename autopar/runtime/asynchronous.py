"""Asynchronous training with a stated update rule: delayed (stale) gradient updates.

Synchronous training (``sync="sync"``, every other program) computes step c's gradient on the weights of
step c and applies it before step c + 1: ``W[c+1] = W[c] - opt(grad L_c(W[c]))``.

The asynchronous modes apply every step's (wave's) gradient late, by a fixed delay D, and compute it on
the version D updates old. With ``opt`` the user's optimizer (its state advancing once per wave, as in
synchronous training), ``L_c`` the global-batch mean loss of wave c and ``G_c`` its gradient summed over
every replica and stage copy (exactly what synchronous training sums):

    G_c      = grad L_c(W[max(0, c - D)])        (every pipeline of wave c computes on that one version)
    W[c+1]   = W[c] - opt(G_c)                   (applied before wave c + D + 1 starts)

* ``sync="2bw"`` (PipeDream-2BW, Narayanan et al. 2021, eq. W(t+1) = W(t) - nu grad f(W(t-1))): D = 1.
  Each micro-batch's forward and backward see the same version (the whole wave runs on W[c-1]); the update
  of wave c - 1 (its gradient sync and optimizer step) is applied while wave c is computed on the previous
  version, so it is off the critical path.
* ``sync="wsp"`` (HetPipe's wave synchronous parallelism, Park et al. 2020), ``staleness=D`` (>= 1,
  default 1): each pipeline pushes its accumulated wave gradient (an asynchronous all-reduce) at the end
  of every wave and starts wave c as soon as the updates of waves <= c - D - 1 are in, i.e. when the
  slowest pipeline has finished wave c - D - 1: a pipeline runs at most D waves ahead of the slowest.
  D = 1 is the 2BW rule.

What differs from synchronous training: the gradient is D updates stale (the loss of wave c, which
`losses[c]` records, is measured on W[max(0, c - D)]); the first D + 1 waves all run on W[0]; the step's
reduction, optimizer and loss collective run in the background (the next wave does not wait for them).
What differs from the papers: every pipeline's wave c sees exactly W[c - D], the oldest version the bound
allows, never a fresher mixture (HetPipe's workers also apply their own pushes locally and may see other
pipelines' newer updates, which makes a run depend on timing); so a run is deterministic and a
single-process replay of the rule above reproduces it (tests/test_async.py). 2BW's flushless cross-step
1F1B schedule (micro-batches of wave c + 1 entering stage 0 before wave c drains) is not run: each wave
still runs the plan's flushed schedule; the delay removes the wait for the gradient sync and optimizer step
and lets fast replicas run ahead of slow ones within the bound.

Memory: D pending wave gradients per rank (flat buffers of its replicated parameters, the gradients of
its single-copy ones), which the planner's memory model does not price.

`step()` returns the mean loss over this rank's pipeline's share of the wave (the global loss is known
only when the wave's collective completes: `losses`, filled as waves complete). `flush()` applies every
pending update (parameters become W[c] for c waves done) and starts the delay again from there, as a
resumed run would; `state_dict()` and `save()` flush first.

Supported (refused otherwise with a PlanError): ZeRO 0 without offload, tensor-parallel degree 1, no
expert parallelism, fp32/tf32/bf16 (not fp16's loss scaling); any number of pipeline stages and
data-parallel replicas, uneven batch shares and splits included.
"""

from __future__ import annotations

import copy
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PlanError
from .dist import wait
from .elastic import naming_lost_ranks
from .program import Program

SYNC_MODES = ("sync", "2bw", "wsp")
RULE = "W[c+1] = W[c] - opt(grad L_c(W[max(0, c-D)]))"


class AsyncUpdateWarning(UserWarning):
    """Asynchronous training was asked for: the update rule is not synchronous SGD's (module docstring)."""


def delay_of(sync: str, staleness: int | None) -> int:
    """The update delay D of a sync mode (0: synchronous); PlanError on a bad mode or staleness."""
    if sync not in SYNC_MODES:
        raise PlanError(f"sync={sync!r}: choose one of {', '.join(map(repr, SYNC_MODES))} ('sync' trains "
                        f"synchronously; '2bw' and 'wsp' apply delayed updates, autopar/runtime/asynchronous.py).")
    if staleness is not None and (isinstance(staleness, bool) or not isinstance(staleness, int)):
        raise PlanError(f"staleness={staleness!r}: give a whole number of waves (>= 1), or None.")
    if sync == "sync":
        if staleness not in (None, 0):
            raise PlanError(f"staleness={staleness} with sync='sync': synchronous training has no staleness; "
                            f"pass sync='wsp' to train with a delay of {staleness} waves.")
        return 0
    if sync == "2bw":
        if staleness not in (None, 1):
            raise PlanError(f"sync='2bw' applies updates exactly one step late (staleness 1), got "
                            f"staleness={staleness}; use sync='wsp', staleness={staleness} for a longer delay.")
        return 1
    d = 1 if staleness is None else staleness
    if d < 1:
        raise PlanError(f"sync='wsp' needs staleness >= 1 (waves a pipeline may run ahead), got {d}; "
                        f"staleness 0 is synchronous training: sync='sync'.")
    return d


def warn_async(sync: str, delay: int, stacklevel: int = 3) -> None:
    """The project rule: asynchrony changes the math, so it is never silent."""
    if delay == 0:
        return
    warnings.warn(f"sync={sync!r} trains asynchronously with staleness D={delay}: the update rule is {RULE} "
                  f"(every gradient is computed on weights {delay} update(s) old), not synchronous "
                  f"training's W[c+1] = W[c] - opt(grad L_c(W[c])); losses and weights differ from "
                  f"synchronous training. See autopar/runtime/asynchronous.py.", AsyncUpdateWarning,
                  stacklevel=stacklevel)


@dataclass
class _Wave:
    """One wave's gradient in flight: its reduce buckets (zero.launch_reduces), the gradients of parameters
    with a single copy, and its loss all-reduce."""

    index: int
    reduces: list[tuple]
    single: dict[str, torch.Tensor | None]
    loss: torch.Tensor
    loss_work: Any = None


class AsyncProgram(Program):
    """A Program training with delayed updates (module docstring): `Program`'s constructor arguments plus
    `sync` ("2bw" or "wsp") and `staleness`. Collective like Program."""

    def __init__(self, *args: Any, sync: str = "wsp", staleness: int | None = None, **kwargs: Any) -> None:
        self.delay = delay_of(sync, staleness)
        if self.delay == 0:
            raise PlanError("AsyncProgram needs sync='2bw' or 'wsp'; sync='sync' is the plain Program.")
        self.sync = sync
        super().__init__(*args, **kwargs)
        self._check_supported()
        self._pending: deque[_Wave] = deque()
        self.losses: dict[int, float] = {}  # wave -> global mean loss, as waves complete
        self.applied = 0  # updates applied since the last flush

    # ---- what is supported ----------------------------------------------------------------------
    def _bucketed_sync(self) -> None:
        return None  # gradients are reduced per wave, in the background (below), never during the backward

    def _check_supported(self) -> None:
        """`plan_problems`, with the ZeRO levels in effect (a stage's ZeRO level with one copy of its
        parameters is no partitioning: level 0)."""
        problems = [p for p in plan_problems(self.plan) if not p.startswith("ZeRO")]
        zero = sorted({st.level for st in self.zero.state.values()} - {0})
        if zero:
            problems.append(f"ZeRO level {zero[-1]}")
        if problems:
            raise PlanError(_refusal(self.sync, problems))

    # ---- one wave -------------------------------------------------------------------------------
    def step(self, *inputs: Any, target: Any = None) -> float:
        """Wave c = step_count: apply the updates of waves <= c - D - 1, run the wave on the resulting
        version W[c - D], launch its gradient reduction and loss all-reduce; returns this pipeline's mean
        loss over its batch share (the global loss lands in `losses[c]`)."""
        if self._has_target and target is None:
            raise PlanError("this program was compiled with a loss_fn: pass target= to step().")
        c = self.step_count
        with naming_lost_ranks(self.rank, f"asynchronous wave {c + 1}"):
            while self._pending and self._pending[0].index <= c - self.delay - 1:
                self._apply(self._pending.popleft())
            local = 0.0
            reduces: list[tuple] = []
            single: dict[str, torch.Tensor | None] = {}
            if self.position is not None:
                local = self._run(self.lowered.actions, inputs, target)
                multi = [n for n in sorted(self.params) if len(self.zero.state[n].reps) > 1]
                reduces = self.zero.launch_reduces(multi)  # flat copies: the wave's gradients travel
                for n, p in self.params.items():
                    if len(self.zero.state[n].reps) == 1:
                        single[n] = p.grad
                    p.grad = None  # the next wave accumulates afresh
            loss = torch.tensor([local], dtype=torch.float64, device=self.device)
            work = dist.all_reduce(loss, async_op=True) if self.world_size > 1 else None
            self._pending.append(_Wave(c, reduces, single, loss, work))
        self.timer.end_step()
        self.step_count += 1
        share = self.pipeline.batch_size / self.layout.global_batch if self.position is not None else 0.0
        is_last = self.position is not None and len(self.pipeline.stages) - 1 in self.position.stages
        return local / share if share and is_last else float("nan")

    def _apply(self, wave: _Wave) -> None:
        """Sum the wave's gradients (wait for its reduces), step the optimizer: W[k+1] = W[k] - opt(G_k)."""
        for pending in wave.reduces:
            self.zero.finish_reduce(pending)
        for n, g in wave.single.items():
            self.params[n].grad = g
        if self.position is not None:
            self.zero.step(self.optimizer)
        if wave.loss_work is not None:
            wait(wave.loss_work, f"loss all-reduce of wave {wave.index + 1}", "in its group", self.timeout_s)
        self.losses[wave.index] = float(wave.loss)
        self.applied += 1

    def flush(self) -> None:
        """Apply every pending update (collective): parameters become W[c] for the c waves done; the next
        wave starts a new delayed sequence from them (its first D + 1 waves run on this version)."""
        with naming_lost_ranks(self.rank, "flushing asynchronous updates"):
            while self._pending:
                self._apply(self._pending.popleft())

    @property
    def in_flight(self) -> int:
        """Waves whose update is not applied yet (at most D + 1 right after a step)."""
        return len(self._pending)

    # ---- state: drained first --------------------------------------------------------------------
    def state_dict(self) -> dict:
        self.flush()
        return super().state_dict()

    def save(self, path: str) -> None:
        self.flush()
        super().save(path)

    def load_state_dict(self, sd: dict) -> None:
        self.flush()
        super().load_state_dict(sd)


# ---- the planner's hook (autopar.plan(..., sync=...)) --------------------------------------------------


def plan_problems(plan: Any) -> list[str]:
    """What in `plan` delayed updates do not run in this version (empty: AsyncProgram runs it)."""
    stages = [st for p in plan.pipelines for st in p.stages]
    problems = []
    if any(st.tp > 1 for st in stages):
        problems.append("tensor parallelism (tp > 1)")
    if plan.experts:
        problems.append("expert parallelism")
    if any(st.zero > 0 for st in stages):
        problems.append(f"ZeRO level {max(st.zero for st in stages)}")
    if any(st.offload for st in stages):
        problems.append("CPU offload")
    if plan.precision == "fp16":
        problems.append("fp16 loss scaling")
    return problems


def _refusal(sync: str, problems: list[str]) -> str:
    return (f"sync={sync!r} does not support {', '.join(problems)} in this version: delayed updates run with "
            f"ZeRO 0, no offload, tensor-parallel degree 1, no expert parallelism and fp32/tf32/bf16 (any "
            f"pipeline depth and data-parallel replicas). Use such a plan (e.g. autopar.Strategy(dp=2, pp=2, "
            f"zero=0)) or sync='sync'.")


def predicted_wave(plan: Any, delay: int) -> float:
    """The predicted seconds per wave of `plan` with updates `delay` waves late (a prediction from the plan's
    simulated schedule): each pipeline's wave ends at its last forward or backward; the gradient sync and
    optimizer step after it (the simulated tail) overlap the next `delay` waves, so the pipeline's wave takes
    max(compute, tail / delay); the staleness bound keeps every pipeline at the slowest one's pace."""
    waves = []
    for r in plan.simulate():
        compute_end = max((end for _, _, name, _, end in r.events if name[:2] in ("F ", "B ")), default=0.0)
        waves.append(max(compute_end, (r.step_time - compute_end) / delay) if delay else r.step_time)
    return max(waves)


def choose_async(plan: Any, sync: str, staleness: int | None, reprice: Any) -> Any:
    """The plan for a user who allows `sync`: `plan` (the synchronous search's best) or, where delayed updates
    do not run it (ZeRO, offload), the same layout at ZeRO 0 without offload, `reprice(plan)` returning it
    priced (or None when it does not fit); the asynchronous variant is chosen only when predicted faster than
    `plan` synchronously. The chosen plan carries `predicted["async"]` = {"sync": the mode chosen ("sync" when
    not), "asked", "staleness", "step_time_s", "sync_step_time_s" (the synchronous plan's), "speedup",
    "samples_per_s", "reason"}."""
    delay = delay_of(sync, staleness)
    sync_step = plan.predicted["step_time_s"]
    candidate, reason = plan, ""
    problems = plan_problems(plan)
    if problems and not [p for p in problems if not p.startswith(("ZeRO", "CPU offload"))]:
        variant = copy.deepcopy(plan)
        for st in (st for p in variant.pipelines for st in p.stages):
            st.zero, st.offload = 0, []
        candidate = reprice(variant)
        reason = "" if candidate is not None else "the plan at ZeRO 0 without offload does not fit in memory"
    elif problems:
        candidate, reason = None, _refusal(sync, problems)
    step = predicted_wave(candidate, delay) if candidate is not None else sync_step
    if candidate is not None and step >= sync_step:
        reason = "predicted no faster than synchronous training"
    chosen = candidate is not None and step < sync_step
    out = candidate if chosen else plan
    step = step if chosen else sync_step
    out.predicted["async"] = {
        "sync": sync if chosen else "sync", "asked": sync, "staleness": delay if chosen else 0,
        "step_time_s": step, "sync_step_time_s": sync_step, "speedup": sync_step / step,
        "samples_per_s": plan.global_batch / step, "reason": reason,
        "note": "a prediction from the simulated schedule, not a measurement"}
    return out


__all__ = ["AsyncProgram", "AsyncUpdateWarning", "RULE", "SYNC_MODES", "choose_async", "delay_of",
           "plan_problems", "predicted_wave", "warn_async"]
