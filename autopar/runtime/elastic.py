"""Surviving lost devices: naming the lost rank, and restarting on the devices that remain.

Detection (automatic, in every multi-rank Program). Each process runs a heartbeat thread that bumps a
counter in the job's rendezvous store every HEARTBEAT_S. When a transfer or collective fails or times
out (`dist.wait` raises PeerLostError, or gloo reports a closed connection), the rank reads every
counter twice, LOST_AFTER_S apart: ranks whose counter did not move are dead, and the PeerLostError
names them. A rank that stops because of such a failure leaves a notice in the store, so that ranks
failing after it exited are not taken for dead ones (they report the ranks its notice names). A rank
that is alive but stuck still beats, so the error then says that no rank died (a hang). Ranks waiting
on the dead one fail at once; the others fail when their peers exit, or after timeout_s.

Re-routing without a restart (reroute.py): under `autopar run` without --max-restarts the workers are
separate processes around a store the launcher hosts, and when a data-parallel peer holds every layer of
the lost rank the survivors re-form the process group among themselves and carry on, redoing the failed
step; otherwise the PeerLostError says why it was not re-routed, and the restart below applies.

Recovery by restart (`autopar.compiler.train`, called by a user script under `autopar run --max-restarts K`,
i.e. torchrun's elastic agent). When a worker exits with an error the agent stops the others and starts the worker
group again, up to K times; `train` then re-plans, loads the newest complete checkpoint (resharding it
to the new plan) and continues from its step. Which devices the new attempt runs on:

* torchrun sets WORLD_SIZE. With one agent per node and `--nnodes=MIN:MAX` (what `autopar run` passes
  with --max-restarts), a node that is gone does not rejoin the rendezvous, so WORLD_SIZE shrinks and
  `train` plans for the first WORLD_SIZE devices of the cluster (`Cluster.subset`). A node that joins
  later makes the agents restart with a larger WORLD_SIZE: the job grows back.
* One agent always restarts all of its `--nproc-per-node` workers, so a device lost inside a node (and
  on a single machine, any device) is left out through a record: `mark_lost(checkpoint_dir, d)` adds
  device d to <checkpoint_dir>/lost_devices.json. `train` records its own device when that fails a
  health check at start (and exits with an error, so that the next attempt runs without it); an
  operator, or a test emulating a failure, can record one too. On the next attempt the worker of a lost
  device returns None at once (the script should exit 0: torchrun counts that worker as done) and the
  others form a smaller process group (ranks renumbered in device order) and re-plan. `unmark_lost`
  (a repaired device) brings it back at the next restart.

The smaller group meets at the launcher's MASTER_ADDR:MASTER_PORT. With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
(`autopar run` sets it when restarts are on) its rank 0 hosts that store afresh each attempt; with
torchrun's shared store, which keeps the previous attempt's keys (pytorch#135712), `train` scopes its keys
by attempt.

Not automatic: judging a device broken when it crashed its worker but passes the health check (it gets
the restart and, if it crashes again, uses up the restarts); taking in devices that become available on
a running single-node job (only at the next restart); hyperparameters and LR schedules, which come from
the optimizer factory (the restored step counter lets a schedule keyed on it resume). On a heterogeneous
multi-node cluster the "first WORLD_SIZE devices" rule assumes the surviving nodes are the first ones of
the cluster file (torchrun does not say which node left); `autopar run` refuses --max-restarts on clusters whose nodes
differ, since torchrun's elastic rendezvous orders nodes as they arrive (rank r would not be device r).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import fcntl
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PlanError
from .devices import gloo_forced, init_process_group
from .dist import PeerLostError, drain_abandoned, ensure_initialized

HEARTBEAT_S = 0.2
LOST_AFTER_S = 1.0  # a rank whose counter does not move for this long is dead (5 missed beats)
LOST_FILE = "lost_devices.json"
_COMM_WORDS = ("connection closed", "connection reset", "broken pipe", "gloo", "nccl", "timed out",
               "peer", "socket")


# ---- heartbeats and lost-rank diagnosis ----------------------------------------------------------------


class _Heartbeat:
    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"autopar-heartbeat-{rank}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        key = _key(self.rank)
        while not self.stop.is_set():
            try:
                self.store.add(key, 1)
            except Exception:  # the store is gone: the job is ending, nothing left to report to
                return
            self.stop.wait(HEARTBEAT_S)


_beat: _Heartbeat | None = None
_beat_group: object | None = None


@atexit.register
def stop_heartbeat() -> None:
    """Stop and join the heartbeat thread. At exit this must happen before the interpreter finalizes: a
    daemon thread caught inside the store's C++ call then aborts the process (std::terminate)."""
    if _beat is not None:
        _beat.stop.set()
        _beat.thread.join(timeout=30)  # a loaded host can hold a store call for seconds


_DRAIN_S = 0.05


def shutdown() -> None:
    """Leave the process group cleanly: the heartbeat thread stops before the group (and its store) is
    destroyed, since it may be inside a store call."""
    stop_heartbeat()
    drain_abandoned()
    if dist.is_available() and dist.is_initialized():
        # A gloo worker thread frees a finished collective's tensors itself and takes the GIL to do so; one still
        # waiting for it when the interpreter finalizes aborts the process ("terminate called without an active
        # exception", pytorch#190489; 1 exit in 15 after DTensor collectives here). Releasing the GIL for a moment
        # lets it finish first (0 in 60).
        time.sleep(_DRAIN_S)
        dist.destroy_process_group()


def _prefix() -> str:
    # torchrun's store outlives a restart: keep one attempt's keys apart from the previous one's
    return f"autopar/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _key(rank: int) -> str:
    return f"{_prefix()}/heartbeat/{rank}"


def start_heartbeat() -> None:
    """Start (once per process group) this rank's heartbeat thread; a no-op without a process group."""
    global _beat, _beat_group
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    group = dist.group.WORLD
    if _beat is not None and _beat_group is group and _beat.thread.is_alive():
        return
    stop_heartbeat()
    store = dist.distributed_c10d._get_default_store()
    _beat, _beat_group = _Heartbeat(store, dist.get_rank(), dist.get_world_size()), group


def lost_ranks() -> list[int] | None:
    """Ranks that died: their heartbeat stopped (watched for LOST_AFTER_S) and they left no notice of
    stopping on a failure themselves. When every silent rank left one, the ranks their notices name.
    None when the store itself is unreachable."""
    beat = _beat
    if beat is None:
        return None
    keys = [_key(r) for r in range(beat.world)]
    try:
        before = [beat.store.add(k, 0) for k in keys]
        time.sleep(LOST_AFTER_S)
        after = [beat.store.add(k, 0) for k in keys]
        silent = [r for r in range(beat.world) if r != beat.rank and after[r] == before[r]]
        notices = {r: json.loads(beat.store.get(_notice(r))) for r in silent
                   if beat.store.check([_notice(r)])}
    except Exception:
        return None
    dead = [r for r in silent if r not in notices]
    if dead or not notices:
        return dead
    return sorted({r for named in notices.values() for r in named} - {beat.rank})


def _notice(rank: int) -> str:
    return f"{_prefix()}/stopped/{rank}"


def _leave_notice(lost: list[int]) -> None:
    """Tell the ranks still diagnosing that this one stops because of `lost`, not because it died."""
    beat = _beat
    if beat is None:
        return
    with contextlib.suppress(Exception):
        beat.store.set(_notice(beat.rank), json.dumps(lost))


def is_comm_failure(e: BaseException) -> bool:
    """A failed transfer or collective (as opposed to an error in the model or the user's code)."""
    if isinstance(e, PeerLostError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(w in text for w in _COMM_WORDS)


def peer_lost(cause: BaseException, rank: int, what: str) -> PeerLostError:
    """The error a rank raises when `what` failed because of another rank: names the dead ranks."""
    lost = lost_ranks()
    _leave_notice(lost or [])
    first = str(cause).strip().splitlines()[0][:300] if str(cause).strip() else type(cause).__name__
    fix = ("Restart from the last checkpoint on the remaining devices: a script using "
           "autopar.compiler.train under `autopar run --max-restarts K` does this automatically.")
    if lost is None:
        msg = (f"rank {rank} stopped during {what}: the job's rendezvous store is unreachable, so rank 0 "
               f"(which hosts it unless torchrun does) or the launcher is lost. {fix} (cause: {first})")
    elif lost:
        names = ", ".join(str(r) for r in lost)
        msg = (f"rank {rank} stopped during {what}: rank{'s' if len(lost) > 1 else ''} {names} "
               f"{'are' if len(lost) > 1 else 'is'} lost (no heartbeat for {LOST_AFTER_S:.1f} s: the process "
               f"died or its host is gone). {fix} (cause: {first})")
    else:
        msg = (f"rank {rank} stopped during {what}: {first}. Every rank is still alive (heartbeats "
               f"continue), so a rank hangs or the network failed; check the slowest rank's log.")
    err = PeerLostError(msg)
    err.lost_ranks = lost or []  # type: ignore[attr-defined]
    return err


@contextlib.contextmanager
def naming_lost_ranks(rank: int, what: str) -> Any:
    """Re-raise communication failures inside the block as a PeerLostError naming the lost ranks."""
    try:
        yield
    except (PeerLostError, RuntimeError) as e:
        if not is_comm_failure(e) or getattr(e, "lost_ranks", None) is not None:
            raise
        raise peer_lost(e, rank, what) from e


# ---- lost-device records -----------------------------------------------------------------------------------


def lost_devices(checkpoint_dir: str | os.PathLike) -> list[int]:
    """Devices recorded as lost under `checkpoint_dir` (see `mark_lost`)."""
    path = Path(checkpoint_dir) / LOST_FILE
    if not path.is_file():
        return []
    return sorted(int(d) for d in json.loads(path.read_text()).get("lost", {}))


def mark_lost(checkpoint_dir: str | os.PathLike, device: int, why: str = "") -> None:
    """Record `device` (cluster index) as lost: later (re)starts of `train` run without it."""
    _update(checkpoint_dir, lambda lost: lost.__setitem__(str(device), {"why": why, "at": time.time()}))


def unmark_lost(checkpoint_dir: str | os.PathLike, device: int) -> None:
    """Take `device` back: the next (re)start of `train` uses it again."""
    _update(checkpoint_dir, lambda lost: lost.pop(str(device), None))


def _update(checkpoint_dir: str | os.PathLike, change: Callable[[dict], Any]) -> None:
    d = Path(checkpoint_dir)
    d.mkdir(parents=True, exist_ok=True)
    with open(d / (LOST_FILE + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two devices may fail at once
        path = d / LOST_FILE
        data = json.loads(path.read_text()) if path.is_file() else {"lost": {}}
        change(data["lost"])
        tmp = path.with_name(f"{LOST_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)


def device_usable() -> bool:
    """A quick health check of this worker's device (always true for CPU / gloo processes)."""
    if not torch.cuda.is_available() or gloo_forced():
        return True
    try:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        x = torch.ones(1024, device=dev)
        ok = float((x * 2).sum()) == 2048.0
        torch.cuda.synchronize(dev)
        return ok
    except RuntimeError:
        return False


def join_attempt(rank: int, world: int, launched: int, attempt: int, timeout_s: float,
                 device: torch.device | None = None) -> None:
    """Join this attempt's process group as `rank` of `world` (fewer than the launcher started when devices
    are recorded lost: the launcher's store still serves the rendezvous), on `device` (this worker's; None:
    cuda:LOCAL_RANK where CUDA exists), as `devices.init_process_group` sets it up."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != world:
            raise PlanError("train() must create the process group itself (it may exclude lost devices); do "
                            "not call torch.distributed.init_process_group before it.")
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        if world != launched:  # env:// rendezvous with the survivors only
            os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
        ensure_initialized(timeout_s, device)
        return
    # torchrun's shared store keeps the previous attempt's keys, so a restarted gloo/NCCL group can read
    # dead workers' addresses (pytorch#135712; `autopar run` sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 to
    # avoid it): scope this attempt's keys
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    scoped = dist.PrefixStore(f"autopar/restart_{attempt}/world_{world}_of_{launched}", store)
    init_process_group(timeout_s, device, store=scoped, rank=rank, world_size=world)


__all__ = ["HEARTBEAT_S", "LOST_AFTER_S", "device_usable", "is_comm_failure", "join_attempt",
           "lost_devices", "lost_ranks", "mark_lost", "naming_lost_ranks", "peer_lost", "start_heartbeat",
           "stop_heartbeat", "unmark_lost"]
