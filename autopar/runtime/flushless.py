"""PipeDream-2BW's flushless cross-wave 1F1B for `sync="2bw"` (Narayanan et al. 2021, "Memory-Efficient
Pipeline-Parallel DNN Training"): the same update rule as `AsyncProgram` (asynchronous.py, D = 1:
W[c+1] = W[c] - opt(G_c), G_c = grad L_c(W[max(0, c-1)])), so the same losses and parameters, but the
pipeline does not drain between waves.

Each rank runs its stage's part of `schedule_waves.waves_1f1b(p, m, k, delay=1, flush=False)`: one
continuous 1F1B over the waves, micro-batches of wave c + 1 entering stage 0 while wave c's backwards are
still in flight. `step()` (one wave's inputs per call, as `AsyncProgram.step`) runs the rank's actions of
that call (`schedule_waves.step_cuts`): the backwards of wave c that stage s < p - 1 has not reached yet
run in the next call, between wave c + 1's forwards. The last stage finishes every wave within its call,
so `step()` returns the wave's global loss, as AsyncProgram's does. A wave's gradient sum is launched after
the rank's last backward of the wave (ALLREDUCE) and applied (UPDATE: wait, optimizer step) just before the
rank's first forward of wave c + 2; `flush()` (and `state_dict`, `save`, `load_state_dict`) first runs
the deferred backwards (the drain), then applies every pending update; `eval_step` drains (updates stay
pending, as AsyncProgram keeps them).

Weight versions. Every micro-batch's forward and backward of wave c use the same version: the stage
programs take parameters as inputs, and wave c's forwards get leaf tensors made at the wave's first forward
from the newest version then (W[c-1]; `_version_leaf`: the same storage, a version counter of its own);
its backwards accumulate the wave's gradient into those leaves. The optimizer keeps stepping `params`
(always the newest version) in place: an update copies the newest version into the stage's spare buffer,
points the parameter (a DTensor's local shard) at it and steps it there, so the version the in-flight wave
reads is never written. Under ZeRO-1 the owner steps that buffer and broadcasts into the other replicas'
(zero.ZeroRuntime.step writes through `.data`, i.e. into the newest version). Memory (priced where this
runs: `solver.async_memory.async_memory(..., flushless=True)`, which the planner's and `compile`'s checks
use): two weight versions per stage while waves overlap (2BW's double buffering;
`schedule_waves.peak_versions`): one more copy of the stage's parameters (its local shards under tensor
parallelism) than the flushed AsyncProgram holds (`solver.flushless_memory.flushless_version_bytes`).
Activations: p - s micro-batches in flight on stage s, flushed 1F1B's min(m, p - s) when m >= p - s
(`solver.flushless_memory.flushless_inflight`).

Runs (`flushless_problems`; otherwise `async_program` picks AsyncProgram, and compile's AsyncUpdateWarning
names the runtime and why): sync="2bw", the "1f1b" schedule, every pipeline >= 2 stages, ZeRO 0 or 1, any
tensor-parallel degree, no offload, no experts, no fp16; any data-parallel degree and uneven batch shares
and splits (tests/test_flushless.py: equal to AsyncProgram and to the single-process replay).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from ..errors import PlanError
from ..ir.schedule_nccl import TRANSFER_KINDS, batch_transfers
from ..ir.schedule_waves import WaveAction, call_of_wave, wave_calls
from ..passes.randomness import Draws, draws, remembering
from ..solver.asynchronous import flushless_problems
from .asynchronous import AsyncProgram, Wave
from .dist import wait
from .elastic import naming_lost_ranks
from .program import PendingRecv
from .zero import local_tensor

DELAY = 1  # 2BW's delay


def async_program(plan: Any, sync: str) -> type[AsyncProgram]:
    """The program class that trains `plan` with `sync`: FlushlessProgram where it runs, else AsyncProgram."""
    return FlushlessProgram if not flushless_problems(plan, sync) else AsyncProgram


def _version_leaf(p: torch.Tensor) -> torch.Tensor:
    """A leaf on `p`'s current storage with a version counter of its own (through `.data`), so the update's
    in-place writes into the newest version (another storage) never look like a change to this one; a
    DTensor's is a DTensor of the same layout on its local shard's storage."""
    if isinstance(p, DTensor):
        t = DTensor.from_local(local_tensor(p).data, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                               stride=p.stride())
    else:
        t = p.data
    return t.detach().requires_grad_(True)


@dataclass
class _Flight:
    """What the rank's schedule keeps between calls: received inputs, outputs awaiting their backward,
    received output gradients, each wave's weight leaves and loss, the sends not yet waited for."""

    recv_in: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[tuple[int, int], Any] = field(default_factory=dict)
    grads_out: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    leaves: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    loss: dict[int, Any] = field(default_factory=dict)  # wave -> float64 device tensor
    sends: list[tuple[Any, int, list[torch.Tensor]]] = field(default_factory=list)


class FlushlessProgram(AsyncProgram):
    """An AsyncProgram (sync="2bw") running the flushless cross-wave 1F1B (module docstring)."""

    def __init__(self, *args: Any, sync: str = "2bw", staleness: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, sync=sync, staleness=staleness, **kwargs)
        problems = flushless_problems(self.plan, sync)
        if problems or self.layers is not None:
            raise PlanError(f"the flushless 2BW schedule does not run {', '.join(problems) or 'per-layer memory'} "
                            f"in this version; train this plan with AsyncProgram (sync='2bw' flushes each wave) "
                            f"or use a 1f1b plan of >= 2 stages at ZeRO 0 or 1.")
        self._base = self.step_count  # the first wave of the current run (since the last drain)
        self._flight = _Flight()
        self._spare: dict[str, torch.Tensor] = {}  # per parameter, the (local) storage of the older version
        if self.position is not None:
            self._templates()

    def _templates(self) -> None:
        """The rank's calls of waves 0, 1 and 2 and the drains after them (`schedule_waves.wave_calls`), each
        as the executor's steps (transfers batched: `schedule_nccl.batch_transfers`)."""
        pipe, s = self.pipeline, self.position.stages[0]
        self._calls, self._drains = wave_calls(len(pipe.stages), len(pipe.microbatch_sizes), s, DELAY)

    def _of_wave(self, templates: list[list[WaveAction]], r: int) -> list[WaveAction]:
        return call_of_wave(templates, r)

    # ---- one wave -------------------------------------------------------------------------------
    def step(self, *inputs: Any, target: Any = None) -> float:
        """Wave c = step_count: this rank's actions of wave c's call (module docstring); returns the wave's
        global mean loss (also kept in `losses[c]`)."""
        if self._has_target and target is None:
            raise PlanError("this program was compiled with a loss_fn: pass target= to step().")
        if self.plan_check is not None:
            self.plan_check.step_started()
        c, r = self.step_count, self.step_count - self._base
        with naming_lost_ranks(self.rank, f"flushless 2BW wave {c + 1}"):
            while self._pending and self._pending[0].index < self._base and self._pending[0].index <= c - 2:
                self._apply(self._pending.popleft())  # updates left pending by a drain (eval_step)
            if self.position is None:
                self._pending.append(self._launch(c))
            else:
                self._execute(self._of_wave(self._calls, r), inputs, target)
            self.losses[c] = self._global_loss(c, self._flight.loss.pop(r, 0.0))
        self.timer.end_step()
        self.step_count += 1
        self._step_checked()
        return self.losses[c]

    def _execute(self, actions: list[WaveAction], inputs: tuple, target: Any) -> None:
        """Run wave actions (relative wave numbers: wave r is wave self._base + r); only the current call's
        wave runs forwards, so `inputs` are its inputs."""
        pipe, fl = self.pipeline, self._flight
        sizes = pipe.microbatch_sizes
        args = tuple(inputs) + ((target,) if self._has_target else ())

        def outgoing(a: WaveAction) -> tuple[list[torch.Tensor], str | None]:
            key = (a.wave, a.microbatch)
            if a.kind == "SEND_F":
                return [o.detach() for o in fl.outputs[key]], pipe.stages[a.stage].compress
            st = self._stages[(a.stage, sizes[a.microbatch])]
            ins = [x for x, n in zip(fl.recv_in.pop(key), st.recv, strict=True) if n in st.grad_values]
            grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in ins]
            return grads, pipe.stages[a.stage - 1].compress

        def incoming(a: WaveAction) -> tuple[Any, list[str], str, bool, str | None]:
            st = self._stages[(a.stage, sizes[a.microbatch])]
            if a.kind == "RECV_F":
                return st, st.recv, "activations", True, pipe.stages[a.stage - 1].compress
            return st, [n for n in st.send if n in st.grad_values], "gradients", False, pipe.stages[a.stage].compress

        for step in batch_transfers(actions):  # what lowering.flushless_steps checks
            if step[0].kind in TRANSFER_KINDS:
                posted, sent = self._post(step, outgoing, incoming)
                fl.sends += sent
                for t, pending in posted.items():
                    (fl.recv_in if t.kind == "RECV_F" else fl.grads_out)[(t.wave, t.microbatch)] = pending
                continue
            a = step[0]
            s, j, r, key = a.stage, a.microbatch, a.wave, (a.wave, a.microbatch)
            st = self._stages[(s, sizes[j])] if j >= 0 else None
            if a.kind == "F":
                if isinstance(fl.recv_in.get(key), PendingRecv):
                    fl.recv_in[key] = fl.recv_in[key].take(self.timeout_s)
                leaves = fl.leaves.get(r)
                if leaves is None:  # the wave's version: the newest one at its first forward
                    leaves = fl.leaves[r] = {n: _version_leaf(p) for n, p in self.params.items()}
                start = pipe.batch_offset + sum(sizes[:j])
                vals = [leaves[n] for n in st.params] + [self.buffers[b] for b in st.buffers] + \
                    [self._slice(args[i], start, sizes[j]) for i in st.inputs] + fl.recv_in.get(key, [])
                n_p = len(st.params)
                run = (lambda *v, gm=st.gm, n_p=n_p: self.tp.run(gm, list(v[:n_p]), list(v[n_p:]))) \
                    if self.tp else st.gm  # tensor parallelism: as Program._run runs a stage
                with self.timer.compute(s), self.amp.forward(), \
                        draws(Draws(self.seed, self._base + r, start, sizes[j])):  # wave r's masks
                    if pipe.stages[s].recompute and s not in self._layered:
                        fl.outputs[key] = torch.utils.checkpoint.checkpoint(remembering(run), *vals,
                                                                            use_reentrant=False)
                    else:
                        fl.outputs[key] = run(*vals)
            elif a.kind == "B":
                self._backward(st, key, sizes[j] / self.layout.global_batch, s)
            elif a.kind == "ALLREDUCE":
                for n, leaf in fl.leaves.pop(r).items():  # the wave's gradient, launched as AsyncProgram does
                    self.params[n].grad = leaf.grad
                self._pending.append(self._launch(self._base + r))
            elif a.kind == "UPDATE":
                if not self._pending or self._pending[0].index != self._base + r:
                    raise PlanError(f"internal: {a} but the oldest pending update is of wave "
                                    f"{self._pending[0].index if self._pending else None}")
                self._apply(self._pending.popleft())
        fl.sends = [x for x in fl.sends if not x[0].is_completed()]

    def _backward(self, st: Any, key: tuple[int, int], weight: float, stage: int) -> None:
        fl = self._flight
        # the received gradient is waited for outside the compute timer (as Program._run does)
        out_grads = None if st.is_last else fl.grads_out.pop(key).take(self.timeout_s)
        with implicit_replication() if self.tp else contextlib.nullcontext(), self.timer.compute(stage):
            if st.is_last:  # the loss is counted once per tensor-parallel group (as Program._run does)
                loss = fl.outputs.pop(key)
                if self.position.tp_index == 0:  # on the device: no host read per micro-batch
                    share = loss.detach().reshape(()).to(torch.float64) * weight
                    fl.loss[key[0]] = fl.loss.get(key[0], 0.0) + share
                outs = [self.amp.scale(loss * weight)]
            else:
                outs = [o for o, n in zip(fl.outputs.pop(key), st.send, strict=True) if n in st.grad_values]
            torch.autograd.backward(outs, out_grads)

    def _apply(self, wave: Wave) -> None:
        """A new version for the update (module docstring: the newest copied into the spare buffer, which no
        wave in flight reads, the parameter pointed at it), then AsyncProgram's update steps it there."""
        with torch.no_grad():
            for n, p in self.params.items():
                local = local_tensor(p)  # the storage: a DTensor's local shard is swapped under it
                free = self._spare.get(n)
                free = torch.empty_like(local.data) if free is None else free
                free.copy_(local.data)
                self._spare[n] = local.data
                local.data = free
        super()._apply(wave)

    # ---- drains -----------------------------------------------------------------------------------
    def _drain(self) -> None:
        """Run the backwards the last call deferred (every launched sum stays pending); the next wave starts
        a new run (its call is wave 0's)."""
        r = self.step_count - 1 - self._base
        if self.position is not None and r >= 0:
            self._execute(self._of_wave(self._drains, r), (), None)
            for work, peer, keep in self._flight.sends:
                wait(work, "send (drain)", peer, self.timeout_s, device=keep[0].device)
            self._flight = _Flight()
        self._spare.clear()  # no wave in flight: the next update allocates the second version again
        self._base = self.step_count

    def flush(self) -> None:
        with naming_lost_ranks(self.rank, "draining the flushless pipeline"):
            self._drain()
        super().flush()
        self._spare.clear()

    def eval_step(self, *inputs: Any) -> Any:
        with naming_lost_ranks(self.rank, "draining the flushless pipeline"):
            self._drain()
        return super().eval_step(*inputs)


__all__ = ["FlushlessProgram", "async_program"]
