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
part in the loss all-reduce and `state_dict`). gloo groups cannot shrink, so the survivors destroy the
process group and form a fresh one of world = survivors through the same store under a new prefix
(`dist.regroup`), ranks renumbered in order; the new plan is re-priced (rank 0 prices it with the
planner's cost model when compile gave a pricer, else its pipelines are re-simulated from the old stage
times) and shown on rank 0's stderr, the Program is rebuilt for it and takes over the pre-step state
(below), and the failed step is run again, on the same global batch. Later steps run on the new plan.
`autopar run` (without --max-restarts) starts each worker as its own process sharing one store hosted by
the launcher (launch.launch_workers), so that the survivors keep running when one dies (torchrun's agent
would stop the whole group), and records a death the survivors absorbed, so the job still exits 0.

**Falls back to restart.** When no pipeline survives whole (a pipeline-only job, or every replica lost a
rank), when the dead rank's state exists nowhere else (ZeRO-1/2/3 partitions optimizer state or
parameters across the replicas; tensor parallelism, expert parallelism and graph programs are not
re-routed either), when the store is gone (it lives in rank 0's process unless a launcher hosts it), or
when the survivors were not all in the same step, the PeerLostError is raised as before, saying why it was
not re-routed: restart from the last checkpoint (`autopar.compiler.train` under `autopar run
--max-restarts K`, elastic.py).

**Guaranteed equal.** No step is lost and none is applied twice: before every step each rank keeps a copy
of its parameters, optimizer state, buffers and loss scaler (one extra copy of the rank's state in memory;
not priced by the planner), and a failed step is redone on the new plan from that copy, so an optimizer
that stepped before the failure showed (a stage whose own all-reduce finished) is rolled back. The
redone step sees the same global batch and weights each micro-batch by size over it, so its update is the
uninterrupted step's: equal up to floating-point summation order (different micro-batch grouping), as
every plan of autopar equals single-device training. Only timing differs: detection (about LOST_AFTER_S
plus the time until the failing collective), rebuilding the program, and the smaller cluster's speed.

**Shedding.** A rank that is measured slower than the plan (straggler.py) gets the same rewrite without a
loss: `reshare` gives every pipeline a batch share proportional to its measured speed (same global batch,
micro-batch size kept) and the program is rebuilt with the full state carried over (`state_dict`), without
re-planning the cluster; large slowdowns still re-plan (AdaptPolicy.shed_below).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from ..cluster import Cluster
from ..errors import PlanError
from ..plan import Pipeline, Plan, even_split
from .dist import PeerLostError, announce_abort, regroup, root_store, watch_aborts
from .elastic import LOST_AFTER_S, stop_heartbeat

ENV = "AUTOPAR_REROUTE"  # "1": compile wraps synchronous programs in a ReroutingProgram (autopar run sets it)
ABSORBED = "autopar/absorbed"  # key prefix in the launcher's store: launched ranks whose loss was re-routed
Rebuild = Callable[[Plan, int, int], Any]  # (plan, rank, world) -> Program
Price = Callable[[Plan], Plan]


# ---- plan rewrites ------------------------------------------------------------------------------------------


def proportional(total: int, weights: list[float]) -> list[int]:
    """`total` split in proportion to `weights` (largest remainders, ties to the first), every part >= 1."""
    if not weights or total < len(weights) or any(w <= 0 for w in weights):
        raise PlanError(f"cannot split {total} samples over {len(weights)} pipelines with weights {weights}: "
                        f"every pipeline needs at least one sample and a positive weight.")
    exact = [total * w / sum(weights) for w in weights]
    parts = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (parts[i] - exact[i], i))
    for i in order[:total - sum(parts)]:
        parts[i] += 1
    for i in range(len(parts)):
        if parts[i] == 0:  # a pipeline kept in the plan runs at least one sample
            parts[i] += 1
            parts[max(range(len(parts)), key=lambda j: (parts[j], -j))] -= 1
    return parts


def with_shares(plan: Plan, shares: dict[int, int], devices: list[int] | None = None) -> Plan:
    """A copy of `plan` keeping the pipelines in `shares` (pipeline index -> its new batch share), each cut
    into micro-batches of at most its old micro-batch size. With `devices` (the devices that remain, in the
    order of their new indices) the plan is renumbered onto them and its cluster cut to them. Predictions
    are cleared: price the result (`ReroutingProgram` does)."""
    if sum(shares.values()) != plan.global_batch:
        raise PlanError(f"batch shares {shares} do not sum to the global batch {plan.global_batch}.")
    index = {d: i for i, d in enumerate(devices)} if devices is not None else None
    pipes = []
    for i in sorted(shares):
        p, share = plan.pipelines[i], shares[i]
        groups = len(p.stages) // plan.chunks
        m = max(1, math.ceil(share / max(1, p.microbatch_size)))
        if plan.chunks > 1:  # interleaved schedules run whole rounds of micro-batches
            m = math.ceil(m / groups) * groups
            if m > share:
                raise PlanError(f"pipeline {i} would get {share} samples, fewer than its {groups} stage groups "
                                f"need under {plan.schedule}.")
        stages = [replace(st, devices=[index[d] for d in st.devices] if index else list(st.devices),
                          predicted={}) for st in p.stages]
        pipes.append(Pipeline(share, max(even_split(share, m)), m, stages))
    cluster = plan.cluster if devices is None else \
        Cluster.load(plan.cluster).subset(devices, name=f"{plan.cluster.get('name', 'cluster')}"
                                                         f"[{','.join(map(str, devices))}]").to_dict()
    return replace(plan, pipelines=pipes, cluster=cluster, predicted={})


def lost_pipelines(plan: Plan, lost: set[int]) -> list[int]:
    return [i for i, p in enumerate(plan.pipelines) if any(d in lost for st in p.stages for d in st.devices)]


def unsupported(plan: Plan) -> str | None:
    """Why a rank lost under `plan` cannot be re-routed (its state would be lost), or None."""
    if plan.experts:
        return "expert parallelism spreads the experts' state over the replicas"
    if plan.graph:
        return "graph programs are not re-routed"
    for p in plan.pipelines:
        for st in p.stages:
            if st.zero > 0:
                return (f"ZeRO-{st.zero} partitions the optimizer state{' and gradients' if st.zero > 1 else ''}"
                        f"{' and parameters' if st.zero > 2 else ''} across the replicas, so a lost rank's "
                        f"shard exists nowhere else")
            if len(st.devices) > 1:
                return "tensor-parallel stages are not re-routed (a lost rank's shards live on its group only)"
    return None


def without(plan: Plan, lost: set[int]) -> tuple[Plan | None, str]:
    """The plan on the devices that remain when `lost` devices are gone: every pipeline that lost a device is
    dropped and its batch share spread over the surviving pipelines in proportion to their shares; devices
    renumbered in order. (None, why) when no pipeline survives whole or the state cannot be carried over."""
    why = unsupported(plan)
    if why:
        return None, why
    dropped = set(lost_pipelines(plan, lost))
    keep = [i for i in range(len(plan.pipelines)) if i not in dropped]
    if not keep:
        return None, (f"no data-parallel peer holds the lost rank's layers (every one of the plan's "
                      f"{len(plan.pipelines)} pipeline(s) lost a device)")
    shares = proportional(plan.global_batch, [float(plan.pipelines[i].batch_share) for i in keep])
    world = Cluster.load(plan.cluster).world_size
    return with_shares(plan, dict(zip(keep, shares, strict=True)),
                       [d for d in range(world) if d not in lost]), ""


def simulated(plan: Plan, old: Plan) -> Plan:
    """`plan` with its stage times taken from `old` (same stages, same micro-batch size: same per-micro-batch
    times) and its step re-simulated; the fallback pricing when no cost model is at hand."""
    by_layers = {tuple(st.layers): st.predicted for p in old.pipelines for st in p.stages}
    for p in plan.pipelines:
        for st in p.stages:
            st.predicted = dict(by_layers.get(tuple(st.layers), {}))
    if not all(st.predicted for p in plan.pipelines for st in p.stages):
        return plan
    step = max(r.step_time for r in plan.simulate())
    plan.predicted = {"step_time_s": step, "samples_per_s": plan.global_batch / step,
                      "priced": "re-simulated from the previous plan's stage times"}
    return plan


# ---- the state a failed step is redone from -----------------------------------------------------------------


@dataclass
class Snapshot:
    """One rank's state before a step, in `Program.state_dict` form (canonical parameter names)."""

    step: int
    params: dict[str, torch.Tensor]
    optimizer: dict[str, dict]
    buffers: dict[str, torch.Tensor]
    scaler: Any

    @staticmethod
    def of(prog: Any) -> Snapshot:
        z = prog.zero
        return Snapshot(prog.step_count, {n: z.full_param(n) for n in prog.params},
                        {n: z.full_opt_state(n, prog.optimizer) for n in prog.params},
                        {n: b.detach().clone() for n, b in prog.buffers.items()}, copy.deepcopy(prog.amp.scaler))

    def state_for(self, new: Any) -> dict:
        """The full state `new` loads: this rank's own copy when it holds everything `new` keeps (a rank of a
        surviving pipeline keeps its stages), else every survivor's copies merged (a collective)."""
        params, opt, buffers = self.params, self.optimizer, self.buffers
        mine = set(new.params) <= set(params) and set(new.buffers) <= set(buffers)
        flag = torch.tensor([0.0 if mine else 1.0])
        if new.world_size > 1:
            dist.all_reduce(flag)
        if float(flag) > 0:
            parts: list[Any] = [None] * new.world_size
            dist.all_gather_object(parts, (params, opt, buffers))
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
class ReroutingProgram:
    """A Program that keeps training through a lost rank (see the module docstring); otherwise it behaves
    like the Program it wraps (`program`), whose attributes it forwards. `rebuild(plan, rank, world)` builds a
    Program for a plan; `price(plan)` re-prices one (optional)."""

    program: Any
    rebuild: Rebuild
    price: Price | None = None
    devices: list[int] = field(default_factory=list)  # current rank -> launched rank
    events: list[RerouteEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.devices:
            self.devices = list(range(self.program.world_size))
        self.why_not = "one process" if self.program.world_size == 1 else unsupported(self.program.plan)
        if self.why_not is None:
            watch_aborts(root_store(), f"autopar/reroute/{len(self.events)}/abort")

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
        new.load_state_dict(snap.state_for(new))
        new.amp.scaler = snap.scaler
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
        self.why_not = "one process" if world == 1 else unsupported(plan)
        watch_aborts(root_store() if self.why_not is None else None, f"autopar/reroute/{gen + 1}/abort")

    def _priced(self, plan: Plan, old: Plan, rank: int) -> Plan:
        """Rank 0 prices the new plan and every rank takes its copy (pricing need not be bit-identical)."""
        box: list[Any] = [None]
        if rank == 0:
            try:
                box[0] = (self.price(plan) if self.price is not None else simulated(plan, old)).to_json()
            except Exception as e:  # a plan that runs but cannot be priced still runs
                print(f"autopar: could not price the plan after the loss ({e!r}); re-simulating it.",
                      file=sys.stderr)
                box[0] = simulated(plan, old).to_json()
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        return Plan.from_json(box[0])

    def __getattr__(self, name: str) -> Any:
        program = self.__dict__.get("program")
        if program is None:
            raise AttributeError(name)
        return getattr(program, name)


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


def enabled() -> bool:
    return os.environ.get(ENV, "0") not in ("", "0")


def wrap(program: Any, rebuild: Rebuild, price: Price | None = None) -> Any:
    """`program` as a ReroutingProgram when re-routing is on (AUTOPAR_REROUTE=1, which `autopar run` sets)
    and it is a plain synchronous multi-rank Program; otherwise `program` itself."""
    from .program import Program

    if not enabled() or type(program) is not Program or program.world_size == 1:
        return program
    return ReroutingProgram(program, rebuild, price)


__all__ = ["ABSORBED", "ENV", "ReroutingProgram", "RerouteEvent", "Snapshot", "absorbed", "agree", "enabled",
           "lost_pipelines", "proportional", "simulated", "unsupported", "with_shares", "without", "wrap"]
