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
gradient reduction and optimizer step run in the background (the next wave does not wait for them).
What differs from the papers: every pipeline's wave c sees exactly W[c - D], the oldest version the bound
allows, never a fresher mixture (HetPipe's workers also apply their own pushes locally and may see other
pipelines' newer updates, which makes a run depend on timing); so a run is deterministic and a
single-process replay of the rule above reproduces it (tests/test_async.py). 2BW's flushless cross-step
1F1B schedule (micro-batches of wave c + 1 entering stage 0 before wave c drains) is runtime/flushless.py's
(`compile` picks it where it runs, `runtime_of`; its warning names the runtime); here each wave runs the
plan's flushed schedule; the delay removes the wait for the gradient sync and optimizer step. Every rank
waits for the wave's global loss at its end (`step()` below), so a fast replica starts wave c + 1 only once
the slowest has finished wave c's compute: the bound D is the rule's, not extra run-ahead.

Memory (priced: solver/async_memory.py, checked by the planner and by `compile(plan=..., sync=...)`):
beyond a synchronous step, a rank keeps D pending wave gradients while a wave computes (waves c - D ..
c - 1): flat copies of the full gradients of its parameters with several holders (replicas, tied weights;
a tensor-parallel shard's is gathered to the full tensor for the reduction) and its own gradients of
single-copy parameters. A wave's reduction packs its buckets in place of the accumulated gradients, one
bucket at a time, and the update unpacks them one at a time, so after the schedule one bucket more is live
(tp > 1: the applied wave's whole flat copy, which the sharded gradients may view). No weight version is
kept besides the parameters themselves; where the flushless schedule runs (sync="2bw", `runs_flushless`)
the pricer is told so and adds its second weight version and p - s in-flight micro-batches per stage.
`autopar.plan(sync=...)` chooses a mode only where its peak fits every device, and the chosen plan's
`predicted["peak_memory_bytes"]` includes it (`predicted["async"]` has the pending and second-version bytes
per device, the runtime and the synchronous figure); a forced mode that does not fit is a PlanError naming
each device and its bytes.

`step()` returns the wave's global mean loss on every rank, as `Program.step` does (also kept in
`losses[c]`): the one scalar all-reduce, on a group of its own, is waited for at the end of every wave (so
ranks meet once per wave; the gradient reduction and optimizer step stay in the background). `flush()`
applies every pending update (parameters become W[c] for c waves done) and starts the delay again from
there, as a resumed run would; `state_dict()` and `save()` flush first.

Supported: any tensor-parallel degree (DTensor stages; their gradients are gathered, reduced over the
replicas and re-sharded at the update), ZeRO 0 and ZeRO-1 (each parameter's optimizer state on its owner
replica, which steps it at the update and broadcasts the new value; the rule is unchanged), any number of
pipeline stages and data-parallel replicas, uneven batch shares and splits, fp32/tf32/bf16
(tests/test_async.py, tests/test_async_parallel.py). Refused with a PlanError naming the option and what to
use instead: ZeRO-2/3 (use zero=1), CPU offload, expert parallelism, and fp16 loss scaling (a wave's
gradient would be unscaled and inf-checked D updates after the scale it was computed with, and a skipped
step would have to skip a delayed update; use bf16, which needs no loss scale).
"""

from __future__ import annotations

import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PlanError
from ..solver.asynchronous import delay_of, flushless_problems, plan_problems, refusal
from .dist import on_comm_device, wait
from .elastic import naming_lost_ranks
from .program import Program

RULE = "W[c+1] = W[c] - opt(grad L_c(W[max(0, c-D)]))"


class AsyncUpdateWarning(UserWarning):
    """Asynchronous training was asked for: the update rule is not synchronous SGD's (module docstring)."""


def warn_async(sync: str, delay: int, stacklevel: int = 3, plan: Any = None) -> None:
    """The project rule: asynchrony changes the math, so it is never silent; with `plan`, the warning also
    says which runtime trains it (and, for sync="2bw", why not the flushless schedule when it does not)."""
    if delay == 0:
        return
    runs = ""
    if plan is not None:
        why = flushless_problems(plan, sync) if sync == "2bw" else []
        runs = (" It runs on FlushlessProgram (2BW's flushless cross-wave 1F1B, runtime/flushless.py)."
                if sync == "2bw" and not why else
                f" It runs on AsyncProgram (each wave the plan's flushed {plan.schedule} schedule)"
                + (f"; the flushless 2BW schedule does not run {', '.join(why)} in this version." if why else "."))
    warnings.warn(f"sync={sync!r} trains asynchronously with staleness D={delay}: the update rule is {RULE} "
                  f"(every gradient is computed on weights {delay} update(s) old), not synchronous "
                  f"training's W[c+1] = W[c] - opt(grad L_c(W[c])); losses and weights differ from "
                  f"synchronous training. See autopar/runtime/asynchronous.py.{runs}", AsyncUpdateWarning,
                  stacklevel=stacklevel)


@dataclass
class Wave:
    """One wave's gradient in flight: its reduce buckets (zero.iter_reduces), the gradients of parameters
    with a single copy. AsyncProgram and flushless.FlushlessProgram queue and apply them."""

    index: int
    reduces: list[tuple]
    single: dict[str, torch.Tensor | None]


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
        self._pending: deque[Wave] = deque()
        self.losses: dict[int, float] = {}  # wave -> global mean loss (what step() returned)
        self.applied = 0  # updates applied since the last flush
        # the loss all-reduce has a group of its own, so that waiting for it never waits for the wave's
        # gradient buckets (in flight on the parameters' groups)
        self._loss_group = dist.new_group(list(range(self.world_size))) if self.world_size > 1 else None

    # ---- what is supported ----------------------------------------------------------------------
    def _bucketed_sync(self) -> None:
        return None  # gradients are reduced per wave, in the background (below), never during the backward

    def _check_supported(self) -> None:
        """`plan_problems`, with the ZeRO levels in effect (a stage's ZeRO level with one copy of its
        parameters is no partitioning: level 0)."""
        problems = [p for p in plan_problems(self.plan) if not p.startswith("ZeRO")]
        zero = sorted({st.level for st in self.zero.state.values()} - {0, 1})
        if zero:
            problems.append(f"ZeRO level {zero[-1]}")
        if problems:
            raise PlanError(refusal(self.sync, problems))

    # ---- one wave -------------------------------------------------------------------------------
    def step(self, *inputs: Any, target: Any = None) -> float:
        """Wave c = step_count: apply the updates of waves <= c - D - 1, run the wave on the resulting
        version W[c - D], launch its gradient reduction; returns the wave's global mean loss, as
        `Program.step` does, on every rank (also kept in `losses[c]`)."""
        if self._has_target and target is None:
            raise PlanError("this program was compiled with a loss_fn: pass target= to step().")
        if self.plan_check is not None:
            self.plan_check.step_started()
        c = self.step_count
        with naming_lost_ranks(self.rank, f"asynchronous wave {c + 1}"):
            while self._pending and self._pending[0].index <= c - self.delay - 1:
                self._apply(self._pending.popleft())
            local = self._run(self.lowered.actions, inputs, target) if self.position is not None else 0.0
            self._pending.append(self._launch(c))
            self.losses[c] = self._global_loss(c, local)
        self.timer.end_step()
        self.step_count += 1
        self._step_checked()
        return self.losses[c]

    def _launch(self, c: int) -> Wave:
        """Start summing wave c's gradients over their holders: one flat copy per bucket, in flight in the
        background; each bucket's gradients are dropped as soon as it is packed (the next wave accumulates
        afresh), so the wave's pending gradient replaces its accumulated one (priced:
        solver/async_memory.py). Gradients of single-copy parameters are kept as they are."""
        reduces: list[tuple] = []
        single: dict[str, torch.Tensor | None] = {}
        if self.position is None:
            return Wave(c, reduces, single)
        multi = [n for n in sorted(self.params) if len(self.zero.state[n].reps) > 1]
        for pending in self.zero.iter_reduces(multi):
            reduces.append(pending)
            for n in pending[3]:  # the bucket's names
                self.params[n].grad = None
        for n, p in self.params.items():
            if len(self.zero.state[n].reps) == 1:
                single[n] = p.grad
            p.grad = None
        return Wave(c, reduces, single)

    def _global_loss(self, c: int, local: float | torch.Tensor) -> float:
        """The wave's global mean loss: every rank's weighted share summed (as `Program.step` sums it, over
        every rank, tensor-parallel ranks but the first contributing 0). `local`: a float64 device tensor (or
        0.0); the final `float` is the wave's one host-device sync."""
        loss = torch.zeros(1, dtype=torch.float64, device=self.device)
        loss += local
        if self._loss_group is not None:
            work = on_comm_device(dist.all_reduce, self.comm.world, loss, group=self._loss_group, async_op=True)
            wait(work, f"loss all-reduce of wave {c + 1}",
                 "in its group", self.timeout_s, self._loss_group, loss.device)
        return float(loss)

    def _apply(self, wave: Wave) -> None:
        """Sum the wave's gradients (wait for its reduces, one bucket at a time, each flat copy freed as it
        is unpacked), step the optimizer: W[k+1] = W[k] - opt(G_k). Under ZeRO-1 only the owners step and
        broadcast the updated values (zero.ZeroRuntime.step)."""
        while wave.reduces:
            self.zero.finish_reduce(wave.reduces.pop(0))
        for n, g in wave.single.items():
            self.params[n].grad = g
        wave.single.clear()
        if self.position is not None:
            self.zero.step(self.optimizer)
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


__all__ = ["AsyncProgram", "AsyncUpdateWarning", "RULE", "Wave", "warn_async"]
