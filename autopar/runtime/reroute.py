"""Training through a lost rank without a restart (ReCycle-style re-routing), and the plan rewrites it shares
with straggler shedding (straggler.py).

Failure semantics
-----------------
**Detected.** A rank that dies (its process is killed, its host is gone) while the others train. Its peers
fail a transfer or collective on it (gloo reports the closed connection at once; otherwise `dist.wait`
times out after `timeout_s`) and the heartbeats of elastic.py name it (`peer_lost`: no heartbeat for
LOST_AFTER_S). Every rank meets the dead one in each step (the loss all-reduce spans the world), so every
survivor detects the loss in the same step: the first to detect it announces it in the store, which wakes
the survivors blocked in a collective with another survivor (`dist.watch_aborts`; leaving a gloo group
does not close its connections). The survivors then agree on who is lost through the job's rendezvous
store (each publishes its diagnosis and the step it was in; the union is taken).

**Re-routed.** When at least one pipeline (data-parallel replica) lost no rank, the survivors go on
without a restart: every pipeline that lost a rank is dropped and its batch share is given to the
surviving pipelines, which hold every layer (each pipeline tiles the whole model), in proportion to their
shares (`without`). The surviving ranks of a dropped pipeline stay in the job as idle ranks (they take
part in the loss all-reduce and `state_dict`). Tensor-parallel plans are re-routed the same way when
dp >= 2: every replica of a stage holds the same layers with its own tensor-parallel group's shards, so a
surviving pipeline keeps its groups whole (a lost rank's tp peers are idle ranks of its dropped pipeline).
gloo groups cannot shrink, so the survivors destroy the process group and form a fresh one of world =
survivors through the same store under a new prefix (`dist.regroup`), ranks renumbered in order (each rank
keeps its position in its tp group); the rebuilt Program makes its tp groups, data-parallel groups and
device meshes from that world. The new plan is re-priced (rank 0 prices it with the planner's cost model
when compile gave a pricer, else its pipelines are re-simulated from the old stage times) and shown on rank
0's stderr, the Program is rebuilt for it and takes over the pre-step state (below), and the failed step
is run again, on the same global batch. Later steps run on the new plan.
`autopar run` (without --max-restarts) starts each worker as its own process sharing one store hosted by
the launcher (launch.launch_workers), so that the survivors keep running when one dies (torchrun's agent
would stop the whole group), and records a death the survivors absorbed, so the job still exits 0.
Only on gloo, outside torchrun's agent (`backend_refusal`): an NCCL group with a dead member cannot be
destroyed and re-formed (its communicators would have to be aborted, or the kernels queued on the dead
peer block the stream), so there `compile(reroute=True)` is a PlanError and the default leaves re-routing
off, said once on rank 0; a lost rank then stops the job for a checkpoint restart (--max-restarts).
Re-routing is on when `compile(reroute=True)`, or with reroute=None (the default) when the process was
launched with AUTOPAR_REROUTE=1 (`enabled`: the runtime reading its own launch environment; `autopar run`
without --max-restarts sets it). What is priced for it reaches the program from the cost model (below),
never through the environment.

**Priced.** The pre-step copy (below) is one copy of what the rank keeps between steps, as it keeps it:
its parameters (tensor-parallel shards stay shards), the optimizer state of the parameters it updates, its
buffers, and the loss scaler, held from before the step to its end. `compile` hands `wrap` a pricer
(`price_copy`, solver/reroute_memory.py on the plan's cost model: N(w + o) + buffers per device) and the
program records its result as `plan.predicted["reroute"]`: "copy_bytes", "host_copy_bytes" and
"peak_memory_bytes" (the step's predicted peak + the copy) per device, "fits", "memory_problems" (or
{"on": False, "why"} when a loss would not be re-routed); `explain()` shows it. When the copy does not fit
on some device, re-routing is off for the job, rank 0 says so on stderr naming the device and bytes, no
copy is taken (no silent out-of-memory), and a lost rank stops the job with that reason: restart from the
last checkpoint. The plan after a loss is priced again (its shares changed), for the next loss.

**Falls back to restart.** When no pipeline survives whole (a pipeline-only job, a single-replica
tensor-parallel job, or every replica lost a rank), when the dead rank's state exists nowhere else
(ZeRO-1/2/3 partitions optimizer state, and gradients or parameters, across the replicas: the message says
to plan with zero=0 for a job that survives a lost rank, or restart from the checkpoint; expert parallelism
and graph programs are not re-routed either), when the pre-step copy is priced not to fit, when the store
is gone (it lives in rank 0's process unless a launcher hosts it), or when the survivors were not all in
the same step, the PeerLostError is raised as before, saying why it was not re-routed: restart from the
last checkpoint (`autopar.compiler.train` under `autopar run --max-restarts K`, elastic.py).

**Guaranteed equal.** No step is lost and none is applied twice: before every step each rank keeps a copy
of its state (`Snapshot`, taken locally: no collective, shards as shards; priced above), and a failed step
is redone on the new plan from that copy (`Snapshot.restore`: a rank of a surviving pipeline loads its own
copy shard for shard), so an optimizer that stepped before the failure showed (a stage whose own
all-reduce finished) is rolled back. The redone step sees the same global batch and weights each
micro-batch by size over it, so its update is the uninterrupted step's: equal up to floating-point
summation order (different micro-batch grouping), as every plan of autopar equals single-device training
(tests/test_reroute.py at tp 1, tests/test_reroute_tp.py a dp=2 x tp=2 job against the same job
uninterrupted, shard for shard). Only timing differs: detection (about LOST_AFTER_S plus the time until
the failing collective), rebuilding the program, and the smaller cluster's speed.

**Shedding.** A rank that is measured slower than the plan (straggler.py) gets the same rewrite without a
loss: `reshare` gives every pipeline a batch share proportional to its measured speed (same global batch,
micro-batch size kept) and the program is rebuilt with the full state carried over (`state_dict`), without
re-planning the cluster; large slowdowns still re-plan (AdaptPolicy.shed_below).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..errors import PlanError
from ..ir.plan import Plan
from ..solver.reshare import lost_pipelines, proportional, simulated, unsupported, with_shares, without
from .dist import REGROUP_BACKENDS_WHY, PeerLostError, announce_abort, regroup, root_store, watch_aborts
from .elastic import LOST_AFTER_S, stop_heartbeat
from .protocol import Wrapping

ENV = "AUTOPAR_REROUTE"  # "1": compile wraps synchronous programs in a ReroutingProgram (autopar run sets it)
ABSORBED = "autopar/absorbed"  # key prefix in the launcher's store: launched ranks whose loss was re-routed
Rebuild = Callable[[Plan, int, int], Any]  # (plan, rank, world) -> Program
Price = Callable[[Plan], Plan]
# (priced plan) -> its predicted["reroute"] block: the pre-step copy per device and whether it fits
# (solver/reroute_memory.py, through compile's callback: the runtime does not import the planner)
PriceCopy = Callable[[Plan], dict]


# ---- the state a failed step is redone from -----------------------------------------------------------------


def _local_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of this rank's storage of `t` (a DTensor's local shard)."""
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _like(target: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (a shard copied by `_local_copy`) laid out as `target` is (a DTensor on the new mesh)."""
    if isinstance(target, DTensor):
        return DTensor.from_local(local.clone().to(target.to_local().device), target.device_mesh, target.placements,
                                  run_check=False, shape=target.shape, stride=target.stride())
    return local.clone().to(target.device)


@dataclass
class Snapshot:
    """One rank's state before a step, as the rank holds it: its parameters (tensor-parallel shards stay
    shards, no collective), the optimizer state of those it updates, buffers and the loss scaler, under
    canonical parameter names. `sharded` names the parameters whose copy is a tensor-parallel shard."""

    step: int
    params: dict[str, torch.Tensor]
    optimizer: dict[str, dict]
    buffers: dict[str, torch.Tensor]
    scaler: Any
    sharded: set[str] = field(default_factory=set)

    @staticmethod
    def of(prog: Any) -> Snapshot:
        z, opt = prog.zero, prog.optimizer
        params, state = {}, {}
        for n, p in prog.params.items():
            st = z.state[n]
            params[n] = _local_copy(st.host if st.released else p)
            held = opt.state.get(z.opt_param(n), {}) if opt is not None and st.owned else {}
            state[n] = {k: _local_copy(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in held.items()}
        return Snapshot(prog.step_count, params, state, {n: b.detach().clone() for n, b in prog.buffers.items()},
                        copy.deepcopy(prog.amp.scaler), {n for n, p in prog.params.items() if isinstance(p, DTensor)})

    def restore(self, new: Any) -> None:
        """Load this copy into `new`, the program rebuilt for the plan after a loss (a collective: every
        survivor calls it). A rank of a surviving pipeline keeps its stages at the same tensor-parallel
        position, so it loads its own copy shard for shard; otherwise (no rewrite of `without` does this)
        the survivors' copies are merged into full state, which tensor-parallel shards cannot be."""
        mine = set(new.params) <= set(self.params) and set(new.buffers) <= set(self.buffers) and all(
            tuple(new.zero.state[n].host.shape if new.zero.state[n].released else
                  (p.to_local() if isinstance(p, DTensor) else p).shape) == tuple(self.params[n].shape)
            for n, p in new.params.items())
        flags = torch.tensor([0.0 if mine else 1.0, 1.0 if self.sharded else 0.0])  # any rank: merge, shards
        if new.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        merge, shards = (bool(f) for f in flags.tolist())
        if merge and shards:
            raise PeerLostError("the plan after the loss moves tensor-parallel shards between ranks, so the "
                                "survivors' pre-step copies cannot be carried over: restart from the last "
                                "checkpoint (`autopar run --max-restarts K` with autopar.compiler.train).")
        if not merge:
            self._load_own(new)
        else:
            new.load_state_dict(self._merged(new))
        new.amp.scaler = self.scaler

    def _load_own(self, new: Any) -> None:
        z = new.zero
        with torch.no_grad():
            for n, p in new.params.items():
                st = z.state[n]
                if not st.released:
                    (p.to_local() if isinstance(p, DTensor) else p).copy_(self.params[n])
                if st.host is not None:
                    st.host.copy_(self.params[n])
                held = self.optimizer.get(n) or {}
                if new.optimizer is not None and st.owned and held:
                    target = z.opt_param(n)
                    new.optimizer.state[target] = {k: v.clone() if isinstance(v, torch.Tensor) and v.dim() == 0
                                                   else _like(target, v) if isinstance(v, torch.Tensor) else v
                                                   for k, v in held.items()}
            for n, b in new.buffers.items():
                b.copy_(self.buffers[n])
        new.step_count = self.step

    def _merged(self, new: Any) -> dict:
        parts: list[Any] = [None] * new.world_size
        dist.all_gather_object(parts, (self.params, self.optimizer, self.buffers))
        params, opt, buffers = {}, {}, {}
        for p, o, b in parts:
            params.update(p)
            opt.update(o)
            buffers.update(b)
        return {"model": {**buffers, **params}, "optimizer": opt, "step": self.step}


# ---- the program that survives a lost rank ------------------------------------------------------------------


@dataclass
class RerouteEvent:
    """One loss absorbed: which launched ranks, in which step, how long it took, the plan after it."""

    lost: list[int]  # launched ranks (RANK at start)
    step: int  # the step that failed and was redone (1-based)
    t_failed: float  # time.time() the failure reached this rank
    t_rebuilt: float  # new process group, plan and program ready
    t_resumed: float = 0.0  # the redone step finished
    plan: str = ""  # the re-priced plan's explain()
    predicted_samples_per_s: float | None = None


@dataclass
class ReroutingProgram(Wrapping):
    """A Program that keeps training through a lost rank (see the module docstring); otherwise it behaves
    like the Program it wraps (`program`), to which it forwards the rest of the protocol (protocol.py).
    `rebuild(plan, rank, world)` builds a Program for a plan; `price(plan)` re-prices one (optional);
    `price_copy(plan)` prices the pre-step copy (optional; `wrap`), recorded as `plan.predicted["reroute"]`:
    {"on": False, "why"} when a loss would not be re-routed, else solver/reroute_memory.py's block
    ("copy_bytes", "peak_memory_bytes" per device, "fits", "memory_problems"); a copy that does not fit turns
    re-routing off (`why_not`)."""

    program: Any
    rebuild: Rebuild
    price: Price | None = None
    devices: list[int] = field(default_factory=list)  # current rank -> launched rank
    events: list[RerouteEvent] = field(default_factory=list)
    price_copy: PriceCopy | None = None

    def __post_init__(self) -> None:
        if not self.devices:
            self.devices = list(range(self.program.world_size))
        predicted = self.program.plan.predicted
        predicted.pop("reroute", None)  # priced here, for this job (a plan read back may carry an old block)
        self.why_not = self._why_not(self.program.plan, self.program.world_size)
        if self.why_not is not None:
            predicted["reroute"] = {"on": False, "why": self.why_not}
        elif self.price_copy is not None and "peak_memory_bytes" in predicted:  # a priced plan
            box: list[Any] = [None]
            if self.program.rank == 0:
                box[0] = _copy_block(self.price_copy, self.program.plan)
            dist.broadcast_object_list(box, src=0)
            self.program.plan.predicted["reroute"] = box[0]
            self.why_not = self._why_not(self.program.plan, self.program.world_size)
            if self.why_not is not None and self.program.rank == 0:
                print(f"autopar: re-routing around a lost rank is off for this job: {self.why_not}. A lost rank "
                      f"stops it: restart from the last checkpoint (`autopar run --max-restarts K` with "
                      f"autopar.compiler.train).", file=sys.stderr, flush=True)
        if self.why_not is None:
            watch_aborts(root_store(), f"autopar/reroute/{len(self.events)}/abort")
            peaks = (predicted.get("reroute") or {}).get("peak_memory_bytes") or {}
            check = getattr(self.program, "plan_check", None)
            if check is not None and str(self.program.rank) in peaks:  # each step's copy is in the window
                check.predict(peaks[str(self.program.rank)], "re-routing's pre-step copy")

    @staticmethod
    def _why_not(plan: Plan, world: int) -> str | None:
        """Why a loss under `plan` is not re-routed (None: it is): `unsupported`, or a pre-step copy priced
        not to fit (`predicted["reroute"]`)."""
        if world == 1:
            return "one process"
        why = unsupported(plan)
        block = plan.predicted.get("reroute") or {}
        if why is None and block.get("fits") is False:
            problems = block.get("memory_problems") or ["(no details)"]
            why = (f"the copy of each rank's state it keeps before every step does not fit in memory: "
                   f"{' '.join(problems)} Free memory (recompute=True, more pipeline stages, offload=) for a job "
                   f"that survives a lost rank")
        return why

    def step(self, *inputs: Any, target: Any = None) -> float:
        snap = Snapshot.of(self.program) if self.why_not is None else None
        try:
            loss = self.program.step(*inputs, target=target)
        except PeerLostError as e:
            lost = getattr(e, "lost_ranks", None)
            if not lost:
                raise
            if snap is None:
                raise PeerLostError(f"{e} Not re-routed: {self.why_not}.") from e
            self._reroute(sorted(lost), snap, e)
            loss = self.step(*inputs, target=target)
            if self.events and not self.events[-1].t_resumed:
                self.events[-1].t_resumed = time.time()
        return loss

    def _reroute(self, lost: list[int], snap: Snapshot, cause: PeerLostError) -> None:
        t_failed = time.time()
        old = self.program
        store = root_store()
        gen = len(self.events)
        check = getattr(old, "plan_check", None)
        if check is not None:  # it would go on to measure the failed step and the re-route, which no plan prices
            check.abandon(f"a rank was lost in step {snap.step + 1}, within the window")
        announce_abort(lost)  # wakes the survivors blocked in a collective with this rank (dist.wait)
        dist.destroy_process_group()
        # survivors may still detect the loss at different times (one blocked where nothing wakes it times
        # out), at worst timeout_s + LOST_AFTER_S apart down a chain of ranks: wait that long
        join_s = old.world_size * (old.timeout_s + LOST_AFTER_S)
        lost = agree(store, f"autopar/reroute/{gen}", old.rank, old.world_size, lost, snap.step, join_s)
        plan, why = without(old.plan, set(lost))
        if plan is None:
            raise PeerLostError(f"{cause} Not re-routed: {why}.") from cause
        survivors = [r for r in range(old.world_size) if r not in lost]
        rank, world = survivors.index(old.rank), len(survivors)
        stop_heartbeat()  # it may be inside a call on the old group's store
        regroup(store, f"autopar/reroute/{gen}/pg", rank, world, join_s)  # transfers keep their timeout_s
        plan = self._priced(plan, old.plan, rank)
        new = self.rebuild(plan, rank, world)
        snap.restore(new)
        gone = [self.devices[r] for r in lost]
        self.devices = [self.devices[r] for r in survivors]
        with contextlib.suppress(Exception):
            for d in gone:
                store.set(f"{ABSORBED}/{d}", json.dumps({"step": snap.step + 1, "by": self.devices}))
        event = RerouteEvent(gone, snap.step + 1, t_failed, time.time(), plan=plan.explain(),
                             predicted_samples_per_s=plan.predicted.get("samples_per_s"))
        self.events.append(event)
        if rank == 0:
            print(f"autopar: rank(s) {gone} lost in step {event.step}; their micro-batches go to the pipelines "
                  f"that hold the same layers, no restart (step {event.step} is redone on the new plan from "
                  f"the state before it). Plan after the loss:\n{event.plan}", file=sys.stderr, flush=True)
        self.program = new
        self.why_not = self._why_not(plan, world)
        watch_aborts(root_store() if self.why_not is None else None, f"autopar/reroute/{gen + 1}/abort")

    def _priced(self, plan: Plan, old: Plan, rank: int) -> Plan:
        """Rank 0 prices the new plan and every rank takes its copy (pricing need not be bit-identical)."""
        box: list[Any] = [None]
        if rank == 0:
            try:
                priced = self.price(plan) if self.price is not None else simulated(plan, old)
            except Exception as e:  # a plan that runs but cannot be priced still runs
                print(f"autopar: could not price the plan after the loss ({e!r}); re-simulating it.",
                      file=sys.stderr)
                priced = simulated(plan, old)
            if self.price_copy is not None and "peak_memory_bytes" in priced.predicted and unsupported(priced) is None:
                priced.predicted["reroute"] = _copy_block(self.price_copy, priced)  # the next loss's copy
            box[0] = priced.to_json()
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        return Plan.from_json(box[0])

def agree(store: Any, prefix: str, rank: int, world: int, lost: list[int], step: int, timeout_s: float
          ) -> list[int]:
    """The lost ranks every survivor re-routes around: each publishes its diagnosis and the number of steps it
    completed, waits for the others it believes alive (one that does not come within `timeout_s` is lost
    too; survivors that then disagree on the world fail to form the new group, with an error) and takes the
    union. Survivors in different steps cannot redo one step together: PeerLostError."""
    store.set(f"{prefix}/alive/{rank}", json.dumps({"lost": lost, "step": step}))
    seen: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    for r in range(world):
        if r in lost:
            continue
        key = f"{prefix}/alive/{r}"
        while not store.check([key]) and time.monotonic() < deadline:
            time.sleep(0.02)
        if store.check([key]):
            seen[r] = json.loads(store.get(key))
    union = set(lost) | {r for r in range(world) if r not in lost and r not in seen}
    for d in seen.values():
        union |= set(d["lost"])
    steps = {d["step"] for r, d in seen.items() if r not in union}
    if len(steps) > 1:
        raise PeerLostError(f"ranks {sorted(union)} are lost but the survivors were in different steps "
                            f"({sorted(steps)}), so no step can be redone on all of them: restart from the last "
                            f"checkpoint (`autopar run --max-restarts K` with autopar.compiler.train).")
    return sorted(union)


def absorbed(store: Any, ranks: list[int]) -> dict[int, dict]:
    """Of `ranks` (launched ranks), those whose loss the survivors re-routed, with the step (launcher side)."""
    out = {}
    for r in ranks:
        with contextlib.suppress(Exception):
            if store.check([f"{ABSORBED}/{r}"]):
                out[r] = json.loads(store.get(f"{ABSORBED}/{r}"))
    return out


def _copy_block(price_copy: PriceCopy, plan: Plan) -> dict:
    """`price_copy(plan)`, or a block saying it could not be priced (re-routing then stays on, unpriced)."""
    try:
        return price_copy(plan)
    except Exception as e:  # noqa: BLE001 - a copy that cannot be priced does not stop training
        return {"on": True, "fits": None, "error": f"could not price the pre-step copy: {e!r}"}


def enabled() -> bool:
    """Whether this process was launched to survive a lost rank: AUTOPAR_REROUTE=1, which `autopar run`
    (without --max-restarts) sets for its workers (launch.launch_workers). The runtime reads its own launch
    environment here; what the planner prices comes to it as `compile(reroute=...)`, never through it."""
    return os.environ.get(ENV, "0") not in ("", "0")


def backend_refusal(backend: str | None, torchrun_agent: bool) -> str | None:
    """Why re-routing cannot work for a job on process-group `backend` (None: not initialized) started under
    torchrun's agent or not; None when it can."""
    if backend is not None and backend != "gloo":
        return f"the process group runs on {backend}, and re-routing is gloo-only: {REGROUP_BACKENDS_WHY}"
    if torchrun_agent:
        return ("the job runs under torchrun's elastic agent, which stops every worker when one dies, so the "
                "survivors never get to re-route (`autopar run` without --max-restarts starts workers without an "
                "agent)")
    return None


def under_torchrun_agent() -> bool:
    """Whether this process is a worker of torchrun's elastic agent (it sets TORCHELASTIC_RUN_ID; `autopar
    run`'s agent-less launcher does not)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def wrap(program: Any, rebuild: Rebuild, price: Price | None = None, price_copy: PriceCopy | None = None,
         on: bool | None = None) -> Any:
    """`program` as a ReroutingProgram when re-routing is on (`on`; None: `enabled()`) and it is a plain
    synchronous multi-rank Program; otherwise `program` itself. With `price_copy` the pre-step copy is priced
    (collective: rank 0 prices it) into `program.plan.predicted["reroute"]`; a copy that does not fit turns
    re-routing off for the job, saying so on rank 0's stderr (a lost rank then stops it with that reason).

    Where re-routing cannot work (`backend_refusal`: NCCL, torchrun's agent) `on=True` raises PlanError and
    `on=None` leaves it off, recorded in `plan.predicted["reroute"]` and said on rank 0's stderr."""
    from .program import Program

    if not (enabled() if on is None else on) or getattr(program, "world_size", 1) == 1:
        return program
    why = backend_refusal(dist.get_backend() if dist.is_initialized() else None, under_torchrun_agent())
    if why is not None:
        if on:
            raise PlanError(f"compile(reroute=True) cannot re-route around a lost rank here: {why}. Pass "
                            f"reroute=False and restart from the last checkpoint instead (`autopar run "
                            f"--max-restarts K` with autopar.compiler.train).")
        block = {"on": False, "why": why}
        if program.plan.predicted.get("reroute") != block:
            program.plan.predicted["reroute"] = block
            if program.rank == 0:
                print(f"autopar: re-routing around a lost rank is off for this job: {why}. A lost rank stops it: "
                      f"restart from the last checkpoint (`autopar run --max-restarts K` with "
                      f"autopar.compiler.train).", file=sys.stderr, flush=True)
        return program
    if type(program) is not Program:
        return program
    return ReroutingProgram(program, rebuild, price, price_copy=price_copy)


__all__ = ["ABSORBED", "ENV", "PriceCopy", "ReroutingProgram", "RerouteEvent", "Snapshot", "absorbed", "agree",
           "backend_refusal", "enabled", "lost_pipelines", "proportional", "simulated", "under_torchrun_agent",
           "unsupported", "with_shares", "without", "wrap"]
