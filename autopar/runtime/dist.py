"""torch.distributed plumbing: process-group setup with timeouts, groups, p2p that names a lost peer."""

from __future__ import annotations

import atexit
import datetime
import json
import math
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import AutoparError
from .devices import init_process_group, set_local_device

DEFAULT_TIMEOUT_S = float(os.environ.get("AUTOPAR_TIMEOUT_S", "120"))


class PeerLostError(AutoparError, RuntimeError):
    """A collective or transfer did not complete in time: a rank died or hangs."""


def ensure_initialized(timeout_s: float = DEFAULT_TIMEOUT_S, device: torch.device | None = None) -> tuple[int, int]:
    """Join the process group torchrun / `autopar run` set up (gloo on CPU; gloo for CPU tensors and NCCL for
    CUDA ones where CUDA exists), on `device`, this rank's device (None: cuda:LOCAL_RANK where CUDA exists;
    see devices.py). The CUDA device is set and passed as `device_id` before the group is created, so NCCL
    communicators are made here, not inside the first step. A process group the user created is kept, with
    this rank's CUDA device made current.

    Without a launcher environment this is a single process (rank 0 of 1).
    """
    if dist.is_available() and dist.is_initialized():
        set_local_device(device)
        return dist.get_rank(), dist.get_world_size()
    if (
        "WORLD_SIZE" not in os.environ
        or int(os.environ["WORLD_SIZE"]) == 1
        and "MASTER_ADDR" not in os.environ
    ):
        return 0, 1
    init_process_group(timeout_s, device)
    return dist.get_rank(), dist.get_world_size()


class Groups:
    """Process groups for rank sets, created collectively in a deterministic order on every rank."""

    def __init__(self, rank_sets: Iterable[tuple[int, ...]], world_size: int) -> None:
        self.world_size = world_size
        self._groups: dict[tuple[int, ...], object] = {}
        if world_size == 1:
            return
        for ranks in sorted(set(tuple(sorted(r)) for r in rank_sets)):
            if len(ranks) > 1 and len(ranks) < world_size:
                self._groups[ranks] = dist.new_group(list(ranks))

    def get(self, ranks: tuple[int, ...]) -> object | None:
        ranks = tuple(sorted(ranks))
        if len(ranks) == self.world_size:
            return dist.group.WORLD
        return self._groups[ranks]


# (store, key) where a survivor of a lost rank announces that it re-routes around it (reroute.py); while set,
# `wait` polls collectives for completion and gives up as soon as the key appears, so that a rank blocked in
# one with a survivor (which no closed connection wakes: leaving a gloo group does not close its sockets)
# joins the others at once instead of after timeout_s. Transfers are not polled (gloo runs them inside
# wait()); a pipeline's ranks meet the dead one directly. Only on gloo: on NCCL `wait` does not block the host
# (`stream_ordered`).
_abort_watch: tuple[dist.Store, str] | None = None


def watch_aborts(store: dist.Store | None, key: str = "") -> None:
    """Make `wait` give up when `key` appears in `store` (None: stop watching)."""
    global _abort_watch
    _abort_watch = (store, key) if store is not None and dist.get_backend() == "gloo" else None


def announce_abort(lost: list[int]) -> None:
    """Tell the ranks blocked in `wait` that `lost` are lost and the survivors re-route around them."""
    if _abort_watch is not None:
        _abort_watch[0].set(_abort_watch[1], json.dumps(lost))


def _poll(work: dist.Work, what: str, timeout_s: float) -> None:
    try:
        work.get_future()
    except RuntimeError:  # gloo send/recv run inside wait() (no future): they cannot be polled
        return
    store, key = _abort_watch  # type: ignore[misc]
    start = time.monotonic()
    nap, checked = 2e-5, start
    while not work.is_completed():
        now = time.monotonic()
        if now - start > timeout_s:
            _abandon(work, start + timeout_s)
            raise PeerLostError(f"{what} timed out after {timeout_s:.0f} s.")
        if now - checked > 0.02:
            checked = now
            try:
                announced = store.check([key])
            except RuntimeError:  # the store's host (a peer that finished its job first) has left: nothing more
                return  # can be announced there; `wait` waits for the work itself, its timeout still applies
            if announced:
                err = PeerLostError(f"{what} abandoned: the survivors of a lost rank re-route around it.")
                err.lost_ranks = json.loads(store.get(key))  # type: ignore[attr-defined]
                _abandon(work, start + timeout_s)
                raise err
        time.sleep(nap)
        nap = min(2 * nap, 1e-3)


# Collectives `_poll` gave up on, each with the time by which gloo's own timeout ends it. Such a collective
# stays in its group's worker thread until that timeout or until its peer's process exits; one that ends
# while this interpreter exits runs torch's exit-time teardown concurrently (a profiler callback on a
# destroyed kineto, seen as SIGSEGV in 4 of 15 runs of the tp re-route test; pytorch#190489's GIL abort
# likewise), so the process waits for them before it finalizes (`drain_abandoned`, at exit and in
# elastic.shutdown).
_abandoned: list[tuple[dist.Work, float]] = []
_ABANDONED_SLACK_S = 2.0  # a collective's timeout counts from when its worker thread starts it


def _abandon(work: dist.Work, ends_by: float) -> None:
    if not _abandoned:
        atexit.register(drain_abandoned)
    _abandoned.append((work, ends_by + _ABANDONED_SLACK_S))


def drain_abandoned() -> None:
    """Wait until every collective a re-route abandoned has ended (it fails when its peer leaves or gloo's
    timeout passes), at most until that timeout, so that none ends during the interpreter's exit."""
    while _abandoned:
        work, ends_by = _abandoned.pop()
        while not work.is_completed() and time.monotonic() < ends_by:
            time.sleep(0.01)


# Backends whose Work.wait() makes the current stream wait for the operation instead of the host thread.
STREAM_ORDERED_BACKENDS = frozenset({"nccl", "xccl"})


def backend_of(group: object | None = None, device: torch.device | str | None = None) -> str:
    """The backend that runs `group`'s (the default group when None) work on tensors of `device`: a
    multi-device group ("cpu:gloo,cuda:nccl") runs each tensor on its device's backend; `device` None means
    the accelerator's when there is one. "" without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return ""
    backend = str(dist.get_backend(group))
    if ":" in backend:
        kind = torch.device(device).type if device is not None else \
            ("cuda" if torch.cuda.is_available() else "cpu")
        per_device = dict(pair.split(":", 1) for pair in backend.split(","))
        backend = per_device.get(kind, "")
    return backend


def stream_ordered(group: object | None = None, device: torch.device | str | None = None) -> bool:
    """Whether a Work of `group` on tensors of `device` (`backend_of`) completes on the device stream:
    NCCL's does."""
    return backend_of(group, device) in STREAM_ORDERED_BACKENDS


def wait(work: dist.Work, what: str, peer: int | str, timeout_s: float = DEFAULT_TIMEOUT_S,
         group: object | None = None, device: torch.device | str | None = None) -> None:
    """Complete a transfer or collective of `group` (default: the default group) on tensors of `device`,
    turning a timeout or a broken connection into a named error.

    On a stream-ordered backend (NCCL, `stream_ordered`) this does not block the host: the current stream
    waits for the operation, so later kernels see its result and the host runs ahead. Host code that needs
    the value itself reads it (`.item()`, `.cpu()`), which synchronizes then: that read is the explicit
    host sync. On gloo the host waits, at most `timeout_s`. A `StagedWork` (host copies) is waited on the host."""
    if isinstance(work, StagedWork):
        device = work.device
    if stream_ordered(group, device):
        # torch 2.13, Work.wait's docstring (torch/csrc/distributed/c10d/init.cpp): "calling wait() is the
        # same as calling synchronize(): letting the current stream block on the completion of the NCCL
        # work. However, if timeout is set, it will block the CPU thread until the NCCL work is completed or
        # timed out." Hangs are still caught: the group's timeout (timeout_s, init_process_group) is enforced
        # by ProcessGroupNCCL's watchdog, which aborts the communicator and fails the process.
        try:
            work.wait()
        except RuntimeError as e:
            raise PeerLostError(
                f"{what} failed: rank {peer} is lost or stopped responding ({_first_line(e)}). "
                f"Check that process; every rank must run the same script."
            ) from e
        return
    if _abort_watch is not None:
        _poll(work, what, timeout_s)
    try:
        ok = work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise PeerLostError(
            f"{what} failed: rank {peer} is lost or stopped responding ({_first_line(e)}). "
            f"Check that process; every rank must run the same script."
        ) from e
    if ok is False:
        raise PeerLostError(f"{what} timed out after {timeout_s:.0f} s waiting for rank {peer}.")


class StagedWork:
    """The Work of a collective or transfer run on host copies of device tensors (`on_comm_device`): waiting it
    completes the inner work(s), then copies the host results back into the device tensors. It runs on gloo,
    so `wait` always waits it on the host, with its timeout."""

    device = torch.device("cpu")

    def __init__(self, works: list[Any], back: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.works, self.back = works, back

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        ok = True
        for work in self.works:
            ok = (work.wait() if timeout is None else work.wait(timeout)) is not False and ok
        if ok:
            for device_t, host_t in self.back:
                device_t.copy_(host_t)
            self.back = []
        return ok

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def get_future(self) -> Any:
        if len(self.works) != 1:
            raise RuntimeError("a staged batch has no single future")
        return self.works[0].get_future()


def on_comm_device(fn: Callable[..., Any], comm: torch.device, /, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` (a torch.distributed call with async_op=True) with every tensor argument (inside
    lists too) on `comm`, the group's comm device (devices.CommDevices: the CPU when the group includes a rank
    computing on the CPU). A tensor elsewhere (an accelerator rank's) is copied to `comm` first and the
    returned `StagedWork` copies the results back into it when waited, so the caller's tensors end as if the
    collective had run on them; without such a tensor this is `fn` itself. Numerics are unchanged."""
    back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def stage(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.device == comm:
            return t
        host = t.detach().to(comm)  # blocking: the collective reads the host copy on gloo's threads
        back.append((t, host))
        return host

    args, kwargs = torch.utils._pytree.tree_map(stage, (args, kwargs))
    work = fn(*args, **kwargs)
    if not back:
        return work
    return StagedWork([work] if work is not None else [], back)


def batch_p2p(ops: list[tuple[bool, torch.Tensor, int]], comms: list[torch.device]
              ) -> tuple[list[list[Any]], list[tuple[Any, int | str, list[torch.Tensor]]]]:
    """Post transfers (is_send, tensor, peer) with one `batch_isend_irecv` per comm device (`comms[k]`, op k's:
    its pair's, devices.CommDevices), so NCCL's batch holds device tensors only and gloo's host ones; each
    peer's transfers keep their order (a pair has one comm device). gloo transfers are host-asynchronous, so
    posting the batches one after the other cannot deadlock. A tensor not on its comm device travels through
    a host copy (`on_comm_device`: a receive's is copied back when waited). Returns, per op, the works to
    wait for it, and the (work, peer, buffers) to wait for at the end of the step (sends; every work of a
    coalesced NCCL batch)."""
    per_op: list[list[Any]] = [[] for _ in ops]
    sent: list[tuple[Any, int | str, list[torch.Tensor]]] = []
    for comm in dict.fromkeys(comms):
        idx = [k for k, c in enumerate(comms) if c == comm]
        wires, backs = [], []
        for k in idx:
            is_send, t, _ = ops[k]
            if t.device == comm:
                wires.append(t)
                backs.append(None)
            else:
                wires.append(t.detach().to(comm) if is_send else torch.empty(t.shape, dtype=t.dtype, device=comm))
                backs.append(None if is_send else (t, wires[-1]))
        p2p = [dist.P2POp(dist.isend if ops[k][0] else dist.irecv, w, ops[k][2], tag=0)
               for k, w in zip(idx, wires, strict=True)]
        works = dist.batch_isend_irecv(p2p)
        one_each = len(works) == len(p2p)  # gloo: one work per op; NCCL: one for the coalesced batch
        everyone = ", ".join(str(p) for p in sorted({ops[k][2] for k in idx}))
        for j, k in enumerate(idx):
            mine = [works[j]] if one_each else list(works)
            per_op[k] = [StagedWork(mine, [backs[j]])] if backs[j] is not None else mine
        # a gloo receive's work is waited once, by its receiver (a second wait blocks); a gloo send keeps its
        # own buffer only (the receive buffers go once unpacked), a coalesced NCCL batch every buffer of it
        sent += [(w, ops[idx[j]][2] if one_each else everyone, [wires[j]] if one_each else wires)
                 for j, w in enumerate(works) if not one_each or ops[idx[j]][0]]
    return per_op, sent


def all_reduce(
    t: torch.Tensor, group: object | None, what: str, timeout_s: float = DEFAULT_TIMEOUT_S,
    comm: torch.device | None = None
) -> None:
    """All-reduce `t` over `group` on its comm device `comm` (None: `t`'s own; see `on_comm_device`)."""
    if group is None:
        return
    work = on_comm_device(dist.all_reduce, comm or t.device, t, group=group, async_op=True)
    wait(work, what, "in its group", timeout_s, group, t.device)


def all_to_all(x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group: object | None,
               what: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.Tensor:
    """`all_to_all_single` over `group`: rows `in_splits[i]` of `x` go to rank i of the group, rows
    `out_splits[i]` of the result came from it (None: equal splits)."""
    rows = sum(out_splits) if out_splits is not None else x.shape[0]
    out = x.new_empty((rows, *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group, async_op=True)
    wait(work, what, "in its group", timeout_s, group, x.device)
    return out


def release(t: torch.Tensor) -> None:
    """Free a finished collective's tensor now, on this thread. Dropping the last Python reference is not
    enough: a gloo Work keeps its tensors until gloo's worker thread lets go of the Work, after `wait`
    returns, so the bytes come back later, on a thread torch.profiler does not follow (memtrace then counts
    the tensor live until its address is handed out again: one extra buffer at some ranks' peaks, in some
    runs and not others, more often on a loaded host). Only for tensors nothing else views."""
    t.untyped_storage().resize_(0)


def broadcast(t: torch.Tensor, src: int, what: str, timeout_s: float = DEFAULT_TIMEOUT_S,
              comm: torch.device | None = None) -> None:
    """Broadcast `t` from `src` over the world on its comm device `comm` (None: `t`'s own)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    wait(on_comm_device(dist.broadcast, comm or t.device, t, src=src, async_op=True), what, src, timeout_s,
         device=t.device)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def wire_dtype(dtype: torch.dtype, compress: torch.dtype | None) -> torch.dtype:
    """The dtype a value of `dtype` travels in: `compress` for wider floating values, else unchanged."""
    if compress is not None and dtype.is_floating_point and dtype.itemsize > compress.itemsize:
        return compress
    return dtype


def pack(tensors: list[torch.Tensor], compress: torch.dtype | None = None,
         device: torch.device | None = None) -> torch.Tensor:
    """One flat byte message holding `tensors` in their native dtypes (exact for every dtype, integer ids
    and masks included), floating ones cast to `compress` first when given.

    Compression rounds to nearest: each element gets a relative error of at most the unit roundoff,
    2^-8 for bf16 and 2^-11 for fp16 (fp16 also overflows above 65504 and flushes below ~6e-8, so it suits
    normalized activations). Integer and bool values are never compressed. An empty message is made on
    `device` (the rank's: NCCL takes CUDA tensors only), else the CPU."""
    if not tensors:
        return torch.zeros(0, dtype=torch.uint8, device=device)
    parts = [t.detach().to(wire_dtype(t.dtype, compress)).reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts)


def unpack(flat: torch.Tensor, metas: list[tuple[tuple[int, ...], torch.dtype]],
           compress: torch.dtype | None = None) -> list[torch.Tensor]:
    """Inverse of `pack`: fresh tensors of the given (shape, dtype), cast back from the wire dtype."""
    out, offset = [], 0
    for shape, dtype in metas:
        wire = wire_dtype(dtype, compress)
        n = _wire_bytes(shape, dtype, compress)
        out.append(flat[offset:offset + n].clone().view(wire).view(shape).to(dtype))
        offset += n
    return out


def message_bytes(metas: list[tuple[tuple[int, ...], torch.dtype]], compress: torch.dtype | None = None) -> int:
    return sum(_wire_bytes(shape, dtype, compress) for shape, dtype in metas)


def _wire_bytes(shape: tuple[int, ...], dtype: torch.dtype, compress: torch.dtype | None) -> int:
    return wire_dtype(dtype, compress).itemsize * math.prod(shape)


def root_store() -> dist.Store:
    """The store under the default process group (its innermost non-prefix store): the launcher's TCPStore
    under `autopar run`, rank 0's under a plain env:// rendezvous. It outlives the group."""
    store = dist.distributed_c10d._get_default_store()
    return getattr(store, "_underlying_non_prefix_store", store)


# Why re-forming groups around a dead rank is gloo-only (reroute.py says it when it refuses re-routing).
REGROUP_BACKENDS_WHY = ("an NCCL communicator with a dead member must be aborted, not destroyed, before a new "
                        "group can form, or the kernels queued on it block the GPU stream; and its watchdog "
                        "kills the process at the same timeout as the failing collective")


def regroup(store: dist.Store, prefix: str, rank: int, world: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Replace the process group (and every subgroup) by a fresh one of `world` ranks meeting in `store` under
    `prefix`: how survivors of a lost rank continue, since a gloo or NCCL group cannot drop a member (and
    new_group over the survivors needs the dead one too). Every survivor calls it with the same prefix.

    gloo only: an NCCL group's kernels still queued on the dead peer would block the device's stream after
    destroy (its communicators are not aborted), so on NCCL it raises instead of hanging."""
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    if backend != "gloo":
        raise AutoparError(f"cannot re-form the {backend} process group around a lost rank: only gloo groups "
                           f"can be destroyed with a peer gone ({REGROUP_BACKENDS_WHY}). Restart from the last "
                           f"checkpoint instead (`autopar run --max-restarts K` with autopar.compiler.train).")
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
