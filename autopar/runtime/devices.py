"""Where a rank computes, and how its process joins the job on that device.

The device rule: rank r computes on the device its plan's cluster gives device r. A `cpu` type (any device
spec of kind "cpu") computes on the CPU; an accelerator type computes on `cuda:LOCAL_RANK` when CUDA is
available, and on the CPU otherwise (the gloo stand-ins of a machine without GPUs). Where the model's
parameters happen to be (built on the CPU, or moved to `cuda:0` on every rank) does not matter: the program
places its share of them, its inputs and its messages on the rank's device (`rank_device`).

Process-group setup (`init_process_group`, shared by `dist.ensure_initialized` and `elastic.join_attempt`):
the CUDA device is set before the group exists and passed as `device_id`, so NCCL communicators are made
eagerly at setup rather than lazily inside step 1 (racing the timeout while other ranks wait); the backend
is "cpu:gloo,cuda:nccl" where CUDA exists, so CPU ranks and CPU tensors go to gloo and CUDA tensors to NCCL.

The mixed-world rule (`group_comm_device`, `CommDevices`): under "cpu:gloo,cuda:nccl" torch picks a
collective's backend by its tensors' device, so every rank of one group (or both ends of one transfer) must hand
it tensors of one device type. A group or pair that includes a rank computing on the CPU therefore communicates
with CPU tensors (gloo), accelerator ranks staging theirs through the host (`dist.on_comm_device`); groups of
accelerator ranks only communicate on the device (NCCL). Tensor-parallel and expert-parallel groups cannot
stage (DTensor and the expert all-to-all run inside the stage's compute), so one spanning both kinds is refused
(`check_one_device_kind`). Pricing: a cluster file gives each node one device type, so a cpu device and a GPU
are always on different nodes and the cost model prices their link as the network between those nodes
(`Cluster.link`); the staging copies (host<->device, usually faster than that network) are not priced
separately, and they are transient: one message or bucket at a time, small beside the stage's memory.

`check_rank_gpu` compares this rank's GPU with the catalog type the cluster file gives its device, before
any collective (`autopar run` checks the GPU count of a node before it starts the workers).
"""

from __future__ import annotations

import datetime
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..errors import AutoparError, PlanError, RendezvousError

MIXED_BACKEND = "cpu:gloo,cuda:nccl"


class DeviceMismatchError(AutoparError, RuntimeError):
    """This machine's GPUs are not the devices the cluster file gives it."""


def computes_on_cpu(spec: Any) -> bool:
    """Whether a cluster device type (a `DeviceSpec`, or a catalog name) computes on the CPU."""
    if isinstance(spec, str):
        return spec == "cpu"
    return getattr(spec, "kind", "") == "cpu" or getattr(spec, "name", "") == "cpu"


def rank_device(spec: Any, local_rank: int, cuda_available: bool) -> torch.device:
    """The torch.device a rank whose cluster device has type `spec` computes on (the module's rule)."""
    if computes_on_cpu(spec) or not cuda_available:
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def local_rank() -> int:
    """This process's index on its machine, as torchrun / `autopar run` set it (0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def plan_rank_device(plan: Any, rank: int, local: int | None = None, cuda_available: bool | None = None
                     ) -> torch.device:
    """The device rank `rank` of `plan` computes on (`rank_device` of the plan cluster's device `rank`)."""
    from ..cluster import Cluster

    cluster = Cluster.load(plan.cluster)
    spec = cluster.devices[rank].spec if rank < cluster.world_size else None
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    return rank_device(spec, local_rank() if local is None else local, cuda)


def launch_device(cluster: Any, env: dict[str, str] | None = None, cuda_available: bool | None = None
                  ) -> torch.device:
    """This process's device, read before the process group exists: device RANK of `cluster` (the launcher's
    rank r is device r of the cluster file) on cuda:LOCAL_RANK by `rank_device`'s rule."""
    env = os.environ if env is None else env
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    rank = int(env.get("RANK", "0"))
    spec = cluster.devices[rank].spec if rank < cluster.world_size else None
    return rank_device(spec, int(env.get("LOCAL_RANK", "0")), cuda)


def group_comm_device(ranks: Iterable[int], device: torch.device, cluster: Any) -> torch.device:
    """Where a rank computing on `device` puts the tensors it hands a collective of `ranks` (or a transfer
    between the two ranks of a pair) of `cluster`: the CPU when any of them computes on the CPU (gloo is the
    only backend every member can reach), else `device` (module docstring: the mixed-world rule)."""
    if any(computes_on_cpu(cluster.devices[r].spec) for r in ranks):
        return torch.device("cpu")
    return device


def world_comm_device(cluster: Any, device: torch.device) -> torch.device:
    """Where world-group collectives (the plan broadcast, the loss all-reduce) put their tensors:
    `group_comm_device` of every device of `cluster`."""
    return group_comm_device(range(cluster.world_size), device, cluster)


class CommDevices:
    """`group_comm_device` for one rank of one plan, built once per Program: `of(ranks)` is the device its
    tensors for a collective of `ranks` (a transfer's pair) must be on; `world` that of the world group."""

    def __init__(self, cpu_ranks: Iterable[int], device: torch.device, world_size: int) -> None:
        self.cpu_ranks = frozenset(cpu_ranks)
        self.device = torch.device(device)
        self.world_size = world_size

    @classmethod
    def of_cluster(cls, cluster: Any, device: torch.device) -> CommDevices:
        return cls((d.index for d in cluster.devices if computes_on_cpu(d.spec)), device, cluster.world_size)

    @classmethod
    def of_plan(cls, plan: Any, device: torch.device) -> CommDevices:
        from ..cluster import Cluster

        return cls.of_cluster(Cluster.load(plan.cluster), device)

    def of(self, ranks: Iterable[int] | None) -> torch.device:
        """The comm device of a group of `ranks` (None: the world)."""
        ranks = range(self.world_size) if ranks is None else ranks
        return torch.device("cpu") if any(r in self.cpu_ranks for r in ranks) else self.device

    @property
    def world(self) -> torch.device:
        return self.of(None)


def check_one_device_kind(groups: Mapping[str, Iterable[int]], cluster: Any) -> None:
    """PlanError unless every group of `groups` (what it is, e.g. "stage 1's tensor-parallel group" -> its
    ranks) has only `cpu` devices or only accelerators: a DeviceMesh, and the expert all-to-all, communicate
    inside the stage's compute on one backend, which cannot reach both kinds (the mixed-world rule)."""
    for what, ranks in groups.items():
        ranks = list(ranks)
        kinds = {r: cluster.devices[r].spec.name for r in ranks}
        cpu = [r for r in ranks if computes_on_cpu(cluster.devices[r].spec)]
        if cpu and len(cpu) < len(ranks):
            raise PlanError(
                f"{what} spans ranks {ranks} of device types {kinds}: ranks {cpu} compute on the CPU (gloo) and "
                f"the others on accelerators (NCCL), and one group cannot use both backends. Keep tensor and "
                f"expert parallelism within one device kind: lower tp (or ep) in `Strategy(tp=...)` so that each "
                f"group holds devices of one kind, or plan again (`autopar.plan` never groups them so).")


def backend_for(cuda_available: bool, forced: str | None = None) -> str:
    """The process-group backend: gloo without CUDA (or when `forced` is "gloo", `autopar run`'s stand-ins),
    else gloo for CPU tensors and NCCL for CUDA ones, so a `cpu` device in a GPU plan works."""
    if forced:
        return forced
    return MIXED_BACKEND if cuda_available else "gloo"


def gloo_forced() -> bool:
    """Whether this process was launched to run on gloo whatever its devices (`AUTOPAR_BACKEND=gloo`, which
    autopar's launchers set for CPU ranks and tests): the one place that reads the variable."""
    return os.environ.get("AUTOPAR_BACKEND") == "gloo"


def init_process_group(timeout_s: float, device: torch.device | None = None, *, store: dist.Store | None = None,
                       rank: int | None = None, world_size: int | None = None,
                       init: Callable[..., None] | None = None) -> str:
    """Create the default process group on `device` (None: this process's GPU, cuda:LOCAL_RANK, where CUDA
    exists): the CUDA device set first and given as `device_id`. Returns the backend. `init` stands in for
    `dist.init_process_group` in tests."""
    cuda = torch.cuda.is_available()
    forced = "gloo" if gloo_forced() else None
    backend = backend_for(cuda, forced)
    if device is None and cuda and forced is None:
        device = torch.device("cuda", local_rank())
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if store is not None:
        kwargs.update(store=store, rank=rank, world_size=world_size)
    if device is not None and device.type == "cuda" and forced is None:
        torch.cuda.set_device(device)  # before the group: NCCL binds its communicator to the current device
        kwargs["device_id"] = device
    try:
        (init or dist.init_process_group)(backend, **kwargs)
    except RuntimeError as e:  # torch's store errors (DistError) and gloo's connect errors are RuntimeErrors
        text = str(e).lower()
        # a store's wait that ran out, or a connection that timed out; other DistErrors (a port already in use)
        # are no late or unreachable peer, and raising timeout_s would not fix them
        if not isinstance(e, dist.DistStoreError) and "timed out" not in text and "timeout" not in text:
            raise
        raise RendezvousError(
            f"the {backend} process group did not form within timeout_s={timeout_s:g} s: a rank started that much "
            f"later than the others, or cannot reach them (torch: {str(e).strip().splitlines()[0][:200]}). Raise "
            f"timeout_s (compile(..., timeout_s=...)), and check that every rank runs and reaches MASTER_ADDR / "
            f"MASTER_PORT.") from e
    return backend


def set_local_device(device: torch.device | None = None) -> None:
    """For a process group the user created: make this rank's GPU current before anything allocates, so
    that torch.distributed's object collectives and lazily made communicators do not all land on cuda:0."""
    if not torch.cuda.is_available():
        return
    device = device or torch.device("cuda", local_rank())
    if device.type == "cuda":
        torch.cuda.set_device(device)


def comm_device(backend: str | None = None) -> torch.device:
    """Where tensors for world-group object collectives live: this rank's current GPU when the world
    group has NCCL, else the CPU."""
    backend = backend if backend is not None else (dist.get_backend() if dist.is_initialized() else "gloo")
    if "nccl" in str(backend) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_rank_gpu(cluster: Any, rank: int, device: torch.device, cuda_name: str,
                   catalog_name: Callable[[str, int], Any]) -> None:
    """Raise a DeviceMismatchError unless `cuda_name`, the name of this rank's GPU `device`, maps (by
    `catalog_name`, as `Cluster.local()` maps it) to the catalog type the cluster gives device `rank`."""
    from ..catalog import CATALOG

    want = cluster.devices[rank].spec.name
    if device.type != "cuda" or want not in CATALOG:  # a custom type: nothing to compare with
        return
    found = catalog_name(cuda_name, device.index or 0)
    found_name = found if isinstance(found, str) else str(found.get("name", cuda_name))
    if found_name != want:
        raise DeviceMismatchError(
            f"rank {rank} runs on {device} ({cuda_name!r}, catalog type {found_name}) but the cluster file gives "
            f"device {rank} type {want}: start each node's share on the machine holding its devices (autopar run "
            f"--node-rank i on node i), keep CUDA_DEVICE_ORDER=PCI_BUS_ID (autopar run sets it), or correct the "
            f"cluster file.")


def warn_device_order(names: list[str], env: dict[str, str] | None = None) -> None:
    """Warn when CUDA orders several GPUs of different types fastest-first (its default), so that cuda:i
    may not be the i-th device of the cluster file: CUDA_DEVICE_ORDER=PCI_BUS_ID fixes the order."""
    env = os.environ if env is None else env
    if len(set(names)) > 1 and env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        warnings.warn(f"this machine has GPUs of different types ({sorted(set(names))}) and CUDA_DEVICE_ORDER is "
                      f"not PCI_BUS_ID: CUDA numbers them fastest first, which may not be the order of the cluster "
                      f"file. Set CUDA_DEVICE_ORDER=PCI_BUS_ID (autopar run does) before starting the workers.",
                      stacklevel=3)


def move_to(x: Any, device: torch.device) -> Any:
    """`x` (tensors inside lists, tuples and dicts too) on `device`; other values as they are."""
    return torch.utils._pytree.tree_map(
        lambda t: t.to(device, non_blocking=device.type == "cuda")
        if isinstance(t, torch.Tensor) and t.device != device else t, x)


__all__ = ["DeviceMismatchError", "MIXED_BACKEND", "backend_for", "check_rank_gpu", "comm_device", "gloo_forced",
           "CommDevices", "check_one_device_kind", "computes_on_cpu", "group_comm_device",
           "init_process_group", "launch_device", "local_rank", "move_to", "plan_rank_device",
           "rank_device", "set_local_device", "warn_device_order", "world_comm_device"]
