"""ZeRO stages 1-3 and CPU offload for the per-rank program.

Peers. A parameter is held by one or more tensor-parallel groups (`Program.holders`: data-parallel
replicas, and stages sharing a tied weight). Its peers are those groups; each group is represented by
its first rank, exactly like the ZeRO-0 gradient all-reduce. Full (unsharded) tensors travel between
representatives and are broadcast and re-sharded inside each group, so ZeRO also works with tensor
parallelism, even when the holding groups have different tensor-parallel degrees: within the owning
group each rank owns its own shard, so the partition is across data-parallel peers at the same
tensor-parallel index.

Ownership. Each parameter with ZeRO level >= 1 and more than one holder gets one owning group,
chosen greedily (largest parameters first, to the holder with the fewest owned elements so far;
deterministic, identical on every rank). Its level is the highest `zero` of the stages holding it
(a tied weight on stages with different levels gets the strongest partitioning any of them asked
for, which never uses more memory than any of those stages planned for). With a single holder there is
nothing to partition across and ZeRO changes nothing for that parameter (as the planner assumes).

What each level does, per parameter:

* ZeRO-1: gradients are all-reduced as in ZeRO-0; only the owner holds optimizer state (the local
  optimizer is built over owned parameters only) and updates; then the owner broadcasts the updated
  value to its peers. Non-owners drop their gradient after the all-reduce.
* ZeRO-2: gradients are reduced to the owner (`dist.reduce`, not all-reduce); non-owners drop theirs.
* ZeRO-3: additionally non-owners hold no copy outside the layer in use (the storage is freed, the
  parameter keeps its shape: `untyped_storage().resize_(0)`).

Granularity. Where the holders of a parameter run identical schedules (lowering.py's docstring,
`layerwise_params`: same stage and layer range in every pipeline holding it, same micro-batch count,
tensor-parallel degree 1, read by one layer), ZeRO-3 gathers it right before its layer's forward and
backward and frees it after, and ZeRO-2/3 reduce its gradient to the owner as soon as its layer's
backward is done, per micro-batch (asynchronous: one layer's reduction is in flight while the backward
goes on); the next layer's ZeRO-3 gather is prefetched; offloaded parameters are
streamed per layer. That is the granularity the planner prices. Elsewhere (holders whose schedules
differ: uneven batch splits with different micro-batch counts, tied weights spanning first and last
stages, tensor-parallel stages) per-layer collectives inside the schedules could deadlock, so the
whole-step path runs: every ZeRO-3 parameter is gathered at the start of `step()`, stays resident
through all micro-batches, and gradients are reduced once after the schedule; the planner prices that
path for those stages (peak parameter and gradient memory that of ZeRO-1).

Communication is per bucket (the parameters sharing a peer set and owner, cut at BUCKET_BYTES): one
reduce or all-reduce and one broadcast from the owner, blocking, in one sorted order on every rank.
That moves the same bytes as the reduce-scatter / all-gather of flat shards that DeepSpeed uses, but
each owner sends its parameters itself instead of the traffic being spread over a ring, and with
tensor parallelism the owner group first gathers the full tensor and receivers re-shard it.

Offload (per rank, the union over its stages holding a parameter):

* "optimizer": the optimizer is built over fp32 CPU copies of the owned parameters; gradients are
  copied to CPU before `optimizer.step()` and the updated values copied back. With tensor
  parallelism the CPU copies are the local shards as plain tensors, so the optimizer must be
  elementwise (Adam, AdamW, SGD are).
* "params": a CPU copy is kept and the device storage freed; streamed parameters (zero_layers.py:
  read by one layer, ZeRO level <= 2, with the optimizer offloaded or not owned) come back one layer at a
  time and their gradients are accumulated on the host; others are moved back at the start of the step.
* "activations": the stage's forward runs under `torch.autograd.graph.save_on_cpu`.
With CUDA, host copies are pinned and device-to-host copies are issued without blocking
(`non_blocking=True`, `host_copy`): the host waits once per step, right before the CPU optimizer reads
the gradients (`step`); host-to-device copies from pinned memory are stream-ordered too, and a streamed
parameter's gradient is accumulated on the device into a copy of its host sum (the host never adds a
gradient whose copy may still be in flight). On a CPU-only machine the copies are plain CPU to CPU
copies: the code paths run, nothing is saved.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..cost_models.memory import SYNC_BUCKET_BYTES
from ..lowering import assign_owners
from .devices import CommDevices
from .dist import Groups, on_comm_device, release, wait
from .tensor_parallel import TPStage

BUCKET_BYTES = SYNC_BUCKET_BYTES  # bounds the flat copy one collective makes (priced: `StageMemory.sync`)
Group = tuple[int, ...]


def offload_activations(enabled: bool) -> contextlib.AbstractContextManager:
    """Context for a stage's forward: saved activations go to (pinned, with CUDA) CPU memory."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())


def host_copy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh host copy of `t` (cast to `dtype`): from a CUDA tensor into pinned memory without blocking
    the host, so it may be read only after the stream has reached this point (`host_wait`); elsewhere a
    plain copy."""
    cuda = t.device.type == "cuda"
    out = torch.empty(t.shape, dtype=dtype or t.dtype, device="cpu", pin_memory=cuda)
    return out.copy_(t.detach(), non_blocking=cuda)


def host_wait(device: torch.device) -> None:
    """Wait until the copies `host_copy` issued on `device`'s current stream are done (CUDA; nothing else)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The tensor that owns this rank's storage of a parameter (a DTensor's local shard); checkpoint.py and
    flushless.py read and write parameters through it too."""
    return p._local_tensor if isinstance(p, DTensor) else p  # type: ignore[attr-defined]


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class ParamState:
    """How this rank keeps one parameter."""

    level: int  # effective ZeRO level: 0 when the parameter has a single holder
    reps: Group  # first rank of each holding tensor-parallel group
    owner: Group  # the group holding its optimizer state (and its value between steps under ZeRO-3)
    owned: bool  # this rank updates it: always under ZeRO-0, else when its group is the owner
    offload_params: bool
    offload_optimizer: bool
    host: torch.Tensor | None = None  # CPU copy (the optimizer's fp32 master with optimizer offload)
    master: bool = False  # `host` is the optimizer's parameter
    released: bool = False  # device storage currently freed
    # offloaded parameter streamed per layer (zero_layers.py): `host` holds its value between uses and its
    # gradient is accumulated on the host as each layer's backward ends: in the master's `.grad` when `host`
    # is the optimizer's parameter, else in `host_grad`
    streamed: bool = False
    host_grad: torch.Tensor | None = None

    def get_host_grad(self) -> torch.Tensor | None:
        return self.host.grad if self.master else self.host_grad  # type: ignore[union-attr]

    def set_host_grad(self, g: torch.Tensor | None) -> None:
        if self.master:
            self.host.grad = g  # type: ignore[union-attr]
        else:
            self.host_grad = g

    @property
    def keeps_value(self) -> bool:
        """Holds the value between steps (ZeRO-3 non-owners do not)."""
        return self.owned or self.level < 3


class ZeroRuntime:
    """Partitions gradients, optimizer state and parameters of one rank and offloads them to CPU.

    Per step, on every rank of the step's stages: `prepare()` (parameters back on the device, ZeRO-3
    gathers), the pipeline schedule, `sync_gradients()`, `step(optimizer)` (update, owners' broadcasts,
    release). Buffers are not partitioned. Each phase's collectives follow one sorted bucket order that
    every rank shares, so they cannot deadlock across groups.
    """

    def __init__(self, params: dict[str, nn.Parameter], holders: dict[str, tuple[Group, ...]],
                 levels: dict[str, int], sizes: dict[str, int], offload: dict[str, set[str]], rank: int,
                 my_group: Group, groups: Groups, tp: TPStage | None, timeout_s: float,
                 comm: CommDevices | None = None) -> None:
        """`comm`: where each group's tensors go (devices.CommDevices; None: where they are)."""
        self.params, self.rank, self.my_group = params, rank, my_group
        self.groups, self.tp, self.timeout_s = groups, tp, timeout_s
        self.comm = comm
        # zero_layers.py: parameters brought to the device per layer (ZeRO-3 gathers, streamed offload),
        # and those whose gradients are reduced per layer during the backward
        self.layer_resident: set[str] = set()
        self.layer_reduced: set[str] = set()
        owners = assign_owners(holders, levels, sizes)
        self.state: dict[str, ParamState] = {}
        for name in params:
            groups_of = holders[name]
            level = levels.get(name, 0) if len(groups_of) > 1 else 0
            kinds = offload.get(name, set())
            owned = level == 0 or owners[name] == my_group
            self.state[name] = ParamState(level, tuple(g[0] for g in groups_of), owners[name], owned,
                                          "params" in kinds, "optimizer" in kinds)
        with torch.no_grad():
            for name, st in self.state.items():
                if not st.keeps_value or st.offload_params:
                    self._compact(name)
                local = local_tensor(self.params[name])
                if st.owned and st.offload_optimizer:
                    st.host, st.master = nn.Parameter(self._host_copy(local, torch.float32)), True
                elif st.offload_params and st.keeps_value:
                    st.host = self._host_copy(local, None)
        self.release()

    # ---- construction ---------------------------------------------------------------------------
    def _compact(self, name: str) -> None:
        """Give the parameter's local tensor a storage of its own, so that freeing it frees exactly it."""
        p = self.params[name]
        t = local_tensor(p)
        if t.is_contiguous() and t.storage_offset() == 0 and _storage_bytes(t) == _nbytes(t):
            return
        if isinstance(p, DTensor):
            local = t.detach().clone(memory_format=torch.contiguous_format)
            self.params[name] = nn.Parameter(DTensor.from_local(
                local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()))
        else:
            p.data = t.detach().clone(memory_format=torch.contiguous_format)

    @staticmethod
    def _host_copy(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=dtype or t.dtype, device="cpu",
                          pin_memory=torch.cuda.is_available() and t.device.type == "cuda")
        return out.copy_(t.detach())

    def gradient_holders(self) -> list[torch.Tensor]:
        """Every tensor whose `.grad` is one of this rank's gradients before the optimizer step (the device
        parameters, and the host masters of streamed ones): what loss-scale unscaling must see."""
        return list(self.params.values()) + [st.host for st in self.state.values()  # type: ignore[misc]
                                             if st.streamed and st.master]

    def build_optimizer(self, make: Callable[[list[Any]], torch.optim.Optimizer]
                        ) -> torch.optim.Optimizer | None:
        """The user's optimizer over the parameters this rank updates (their CPU copies when offloaded)."""
        owned = [self.opt_param(n) for n, st in self.state.items() if st.owned]
        return make(owned) if owned else None

    def opt_param(self, name: str) -> torch.Tensor:
        st = self.state[name]
        return st.host if st.master else self.params[name]  # type: ignore[return-value]

    # ---- the step ---------------------------------------------------------------------------------
    def prepare(self, whole: bool = False) -> None:
        """Before the schedule: bring offloaded parameters back and gather ZeRO-3 parameters; those gathered
        per layer (`layer_resident`, zero_layers.py) stay freed unless `whole` (eval_step's forward)."""
        names = [n for n in self.state if whole or n not in self.layer_resident]
        for name in names:
            self._restore(name, from_host=True)
        self._broadcast_from_owners([n for n in names if self.state[n].level == 3])

    def stream_in(self, names: list[str]) -> None:
        """Streamed parameters back on the device from their host values."""
        for name in names:
            self._restore(name, from_host=True)

    def _restore(self, name: str, from_host: bool) -> None:
        """A freed parameter's device storage allocated again and, with `from_host`, refilled from its host
        copy. Written through `.data`: autograd may hold the tensor for backward, and a refill is no change."""
        st = self.state[name]
        if not st.released:
            return
        t = local_tensor(self.params[name])
        t.untyped_storage().resize_(_nbytes(t))
        st.released = False
        if from_host and st.host is not None:
            with torch.no_grad():
                t.data.copy_(st.host, non_blocking=st.host.is_pinned())

    def stream_out_grads(self, names: list[str]) -> None:
        """Move streamed parameters' gradients to the host, accumulating over micro-batches."""
        with torch.no_grad():
            for name in names:
                st, p = self.state[name], self.params[name]
                if p.grad is None:
                    continue
                acc = st.get_host_grad()
                if acc is None:
                    st.set_host_grad(host_copy(p.grad, torch.float32))
                elif p.grad.device.type == "cuda":  # the host sum may still be arriving: add on the stream
                    total = acc.to(p.grad.device, non_blocking=acc.is_pinned()) + p.grad.to(torch.float32)
                    acc.copy_(total, non_blocking=acc.is_pinned())
                else:
                    acc += p.grad.to(torch.float32)
                p.grad = None

    def gather(self, names: list[str]) -> list[tuple]:
        """Start bringing ZeRO-3 parameters back with the owners' values (collective over holders);
        `finish_broadcast` each returned piece, in order, before using them: that refills their storage."""
        return self.launch_broadcasts(names)

    def free(self, names: list[str]) -> None:
        """Drop the device storage of these parameters where it is not kept: ZeRO-3 parameters this rank
        does not own, and streamed ones (their value stays on the host)."""
        for name in names:
            st = self.state[name]
            if (st.streamed or not st.keeps_value) and not st.released:
                local_tensor(self.params[name]).untyped_storage().resize_(0)
                st.released = True

    def sync_gradients(self) -> None:
        """Sum each parameter's gradient over its holders: all-reduce under ZeRO-0/1, reduce to the owner
        under ZeRO-2/3, as full gradients among group representatives, then broadcast inside the
        receiving tensor-parallel groups and re-sharded. Gradients a rank does not update are dropped.
        Parameters reduced layer by layer during the backward (`layer_reduced`) are done already."""
        self.reduce_gradients([n for n in sorted(self.params) if n not in self.layer_reduced])

    def reduce_gradients(self, names: list[str]) -> None:
        """Sum these parameters' gradients over their holders now."""
        for pending in self.iter_reduces(names):  # one bucket at a time: one flat buffer alive
            self.finish_reduce(pending)
            del pending  # before the next bucket is packed

    def launch_reduces(self, names: list[str]) -> list[tuple]:
        """`iter_reduces`, every bucket launched now (zero_layers.py: one layer's, in flight while the
        backward goes on)."""
        return list(self.iter_reduces(names))

    def iter_reduces(self, names: list[str]) -> Iterator[tuple]:
        """Start summing these parameters' gradients over their holders, lazily: one asynchronous reduce (to
        the owner, ZeRO-2/3) or all-reduce per bucket, in the sorted bucket order every rank shares; the next
        bucket is packed when the next piece is asked for. A non-owner's gradient is dropped as soon as its
        bucket is packed. `finish_reduce` each piece, in order."""
        buckets: dict[tuple[Group, Group], list[str]] = {}
        for name in names:
            st = self.state[name]
            if len(st.reps) > 1:
                buckets.setdefault((st.reps, st.owner if st.level >= 2 else ()), []).append(name)
        for (reps, dst), bucket in sorted(buckets.items()):
            for chunk in self._chunks(bucket):
                fulls = [self._full_grad(n) for n in chunk]
                flat = torch.cat([g.reshape(-1) for g in fulls])
                shapes = [g.shape for g in fulls]
                del fulls
                self._drop_grads([n for n in chunk if not self.state[n].owned])
                work = None
                if self.rank in reps:
                    group = self.groups.get(reps)
                    comm = self.comm_device(reps, flat)
                    work = on_comm_device(dist.reduce, comm, flat, dst=dst[0], group=group, async_op=True) if dst \
                        else on_comm_device(dist.all_reduce, comm, flat, group=group, async_op=True)
                yield work, reps, dst, chunk, shapes, flat
        self._drop_grads([n for n in names if not self.state[n].owned])

    def _drop_grads(self, names: list[str]) -> None:
        for name in names:
            self.params[name].grad = None
            if self.state[name].streamed:
                self.state[name].set_host_grad(None)

    def finish_reduce(self, pending: tuple) -> None:
        work, reps, dst, names, shapes, flat = pending
        if work is not None:
            what = f"gradient reduce to rank {dst[0]}" if dst else "gradient all-reduce"
            wait(work, f"{what} over ranks {list(reps)}", "in its group", self.timeout_s, self.groups.get(reps),
                 flat.device)
        receives = not dst or dst == self.my_group
        if receives and len(self.my_group) > 1:
            self._group_broadcast(flat, "gradient broadcast in the tensor-parallel group")
        offset = 0
        for n, shape in zip(names, shapes, strict=True):
            size = math.prod(shape)
            full = flat[offset:offset + size].view(shape)
            offset += size
            p, st = self.params[n], self.state[n]
            if not (receives and st.owned):
                continue
            if st.streamed:  # a streamed parameter's gradient lives on the host
                st.set_host_grad(host_copy(full, torch.float32))
            elif self.tp:
                p.grad = self.tp.shard(n, full)
            elif p.grad is not None and p.grad.shape == full.shape:
                p.grad.copy_(full)  # into the gradient's own storage: no second copy of it
            else:
                p.grad = full.clone()
        if not self.tp and not any(self.state[n].streamed for n in names):  # nothing kept a view of it
            release(flat)

    def step(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Optimizer step on owned parameters, owners broadcast the update (ZeRO-1/2), then free what is
        not kept between steps (ZeRO-3 non-owners, offloaded parameters)."""
        with torch.no_grad():
            masters = [(self.params[n], st) for n, st in self.state.items() if st.master]
            for p, st in masters:
                g = p.grad
                if st.streamed:
                    pass  # its gradient is in the master's .grad already
                elif g is not None:
                    if isinstance(g, DTensor):
                        g = g.redistribute(p.device_mesh, p.placements).to_local()
                    st.host.grad = host_copy(g, torch.float32)  # type: ignore[union-attr]
                p.grad = None
            for st in self.state.values():
                if st.streamed and not st.master:
                    st.host_grad = None  # a non-owner's share was reduced to the owner
            if optimizer is not None:
                if masters:  # the CPU optimizer reads gradients copied without blocking: the step's one wait
                    host_wait(local_tensor(masters[0][0]).device)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            for p, st in masters:
                if not st.streamed:  # streamed ones are brought in from the host layer by layer
                    local_tensor(p).copy_(st.host, non_blocking=st.host.is_pinned())  # type: ignore[union-attr]
        self._broadcast_from_owners([n for n, st in self.state.items() if st.level in (1, 2)])
        self.release()

    def release(self) -> None:
        """Free the device storage of parameters not kept there between steps (saving offloaded ones)."""
        with torch.no_grad():
            for name, st in self.state.items():
                if st.released or (st.keeps_value and not st.offload_params):
                    continue
                t = local_tensor(self.params[name])
                if st.host is not None and not st.master:
                    st.host.copy_(t)
                t.untyped_storage().resize_(0)
                st.released = True

    # ---- collectives ---------------------------------------------------------------------------------
    def comm_device(self, ranks: Group, t: torch.Tensor) -> torch.device:
        """Where `t` goes for a collective of `ranks` (the mixed-world rule; `t`'s device without one)."""
        return self.comm.of(ranks) if self.comm is not None else t.device

    def _group_broadcast(self, flat: torch.Tensor, what: str) -> None:
        src = self.my_group[0]
        group = self.groups.get(self.my_group)
        work = on_comm_device(dist.broadcast, self.comm_device(self.my_group, flat), flat, src=src, group=group,
                              async_op=True)
        wait(work, what, src, self.timeout_s, group, flat.device)

    def _broadcast_from_owners(self, names: list[str]) -> None:
        """Every holder of `names` gets the owner's current value. Buckets are processed in one sorted
        order on every rank, so the collectives of different groups cannot wait on each other in a cycle."""
        for pending in self.iter_broadcasts(names):  # one bucket at a time: one flat buffer alive
            self.finish_broadcast(pending)
            del pending  # before the next bucket is packed

    def launch_broadcasts(self, names: list[str]) -> list[tuple]:
        """`iter_broadcasts`, every bucket launched now (zero_layers.py: a prefetched layer)."""
        return list(self.iter_broadcasts(names))

    def iter_broadcasts(self, names: list[str]) -> Iterator[tuple]:
        """Start the owners' broadcasts of `names`, lazily: one per bucket, in the shared sorted order, the
        next launched when the next piece is asked for; complete each with `finish_broadcast`, in order."""
        buckets: dict[tuple[Group, Group, str], list[str]] = {}
        for name in sorted(names):
            st = self.state[name]
            if len(st.reps) > 1:
                buckets.setdefault((st.reps, st.owner, str(self.params[name].dtype)), []).append(name)
        for (reps, owner, _), bucket in sorted(buckets.items()):
            for chunk in self._chunks(bucket):
                ps = [self.params[n] for n in chunk]
                if owner == self.my_group:
                    flat = torch.cat([self._value(n).detach().reshape(-1) for n in chunk])
                else:
                    flat = torch.empty(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=local_tensor(ps[0]).device)
                group = self.groups.get(reps) if self.rank in reps else None
                work = on_comm_device(dist.broadcast, self.comm_device(reps, flat), flat, src=owner[0], group=group,
                                      async_op=True) if group is not None else None
                yield work, owner, chunk, flat, group

    def finish_broadcast(self, pending: tuple) -> None:
        work, owner, names, flat, group = pending
        if work is not None:
            wait(work, f"parameter broadcast from owner rank {owner[0]}", owner[0], self.timeout_s, group, flat.device)
        if owner != self.my_group:
            with torch.no_grad():
                self._unpack_broadcast(names, flat)  # copied into the parameters
        release(flat)

    def _unpack_broadcast(self, names: list[str], flat: torch.Tensor) -> None:
        """Write a received bucket into its parameters (freed ZeRO-3 storage is allocated again first).
        Through `.data`: autograd may hold these tensors for backward, and a refill is not a change."""
        ps = [self.params[n] for n in names]
        for n in names:
            if not self.state[n].streamed:  # a streamed one's value goes to the host copy
                self._restore(n, from_host=False)
        if len(self.my_group) > 1:
            self._group_broadcast(flat, "parameter broadcast in the tensor-parallel group")
        offset = 0
        for n, p in zip(names, ps, strict=True):
            full = flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
            st = self.state[n]
            (st.host if st.streamed else local_tensor(p).data).copy_(self._shard(n, full))  # type: ignore[union-attr]

    def _value(self, name: str) -> torch.Tensor:
        """The parameter's current full value on its device (a streamed one's from the host)."""
        p, st = self.params[name], self.state[name]
        if st.streamed:
            return st.host.to(local_tensor(p).device, p.dtype, non_blocking=st.host.is_pinned())  # type: ignore[union-attr]
        return p.full_tensor() if isinstance(p, DTensor) else p

    def _chunks(self, names: list[str]) -> list[list[str]]:
        """Consecutive runs of at most BUCKET_BYTES (of full tensors; one parameter may exceed it)."""
        out: list[list[str]] = [[]]
        size = 0
        for n in names:
            p = self.params[n]
            nbytes = p.numel() * p.element_size()
            if out[-1] and size + nbytes > BUCKET_BYTES:
                out.append([])
                size = 0
            out[-1].append(n)
            size += nbytes
        return out if out[-1] else []

    def _shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return local_tensor(self.tp.shard(name, full)) if isinstance(self.params[name], DTensor) else full

    def _full_grad(self, name: str) -> torch.Tensor:
        """The full gradient on the parameter's device (a streamed one's comes from the host, a bucket at
        a time)."""
        p, st = self.params[name], self.state[name]
        if st.streamed:
            g = st.get_host_grad()
            g = g if g is not None else torch.zeros(p.shape, dtype=torch.float32)
            return g.to(local_tensor(p).device, p.dtype, non_blocking=g.is_pinned())
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        return g.full_tensor() if isinstance(g, DTensor) else g

    # ---- full state --------------------------------------------------------------------------------------
    def is_source(self, name: str) -> bool:
        """This rank's group supplies the parameter's full state (the owner; the first holder at ZeRO-0)."""
        return self.state[name].owner == self.my_group

    def full_param(self, name: str) -> torch.Tensor:
        """The full value; a collective inside the tensor-parallel group for DTensor parameters."""
        p, st = self.params[name], self.state[name]
        local = st.host if st.released else local_tensor(p)
        if local is None:
            raise RuntimeError(f"rank {self.rank} holds no value of {name} (ZeRO-3 non-owner).")
        return self._full(name, local.detach())

    def full_opt_state(self, name: str, optimizer: torch.optim.Optimizer | None) -> dict:
        if optimizer is None or not self.state[name].owned:
            return {}
        state = optimizer.state.get(self.opt_param(name), {})
        return {k: self._full(name, v) if isinstance(v, torch.Tensor) and v.dim() > 0
                else v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}

    def _full(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            return t.full_tensor()
        p = self.params[name]
        if isinstance(p, DTensor):  # a plain local shard (CPU copy): lay it out like the parameter
            d = DTensor.from_local(t.to(local_tensor(p).device), p.device_mesh, p.placements, run_check=False,
                                   shape=p.shape, stride=p.stride())
            return d.full_tensor()
        return t.clone()

    def load_param(self, name: str, full: torch.Tensor) -> None:
        """Take this rank's part of a full value (on any device: `state_dict` returns host tensors)."""
        st = self.state[name]
        if not st.keeps_value:
            return
        shard = self._shard(name, full.to(local_tensor(self.params[name]).device))
        with torch.no_grad():
            if not st.released:
                local_tensor(self.params[name]).copy_(shard)
            if st.host is not None:
                st.host.copy_(shard)

    def load_opt_state(self, name: str, optimizer: torch.optim.Optimizer | None, state: dict) -> None:
        st = self.state[name]
        if optimizer is None or not st.owned or not state:
            return

        device = local_tensor(self.params[name]).device

        def convert(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            if v.dim() == 0:
                return v.clone()
            if st.master:
                return self._shard(name, v.to(device)).to("cpu", torch.float32, copy=True)
            return self.tp.shard(name, v.to(device)) if self.tp else v.to(device, copy=True)

        optimizer.state[self.opt_param(name)] = {k: convert(v) for k, v in state.items()}

    # ---- introspection ---------------------------------------------------------------------------------
    def describe(self) -> list[str]:
        lines = []
        for name, st in sorted(self.state.items()):
            parts = []
            if st.level:
                here = " (this rank)" if st.owned else ""
                parts.append(f"ZeRO-{st.level}, owned by ranks {list(st.owner)}{here}")
            parts += [f"{kind} offloaded" for kind, on in (("params", st.offload_params),
                                                            ("optimizer", st.offload_optimizer)) if on]
            if parts:
                lines.append(f"#   {name}: {', '.join(parts)}")
        return lines
