"""The device audit: every rank of a plan, run in one CPU process, checked for tensors on the wrong device.

`audit_devices(model, plan, example_inputs, example_target, loss_fn)` builds each rank's `Program` in turn over
torch's fake process-group backend ("cpu:fake,meta:fake": collectives and transfers complete at once, on any
device, without peers) with the meta device standing in for the rank's accelerator (a `cpu` device's rank
keeps the CPU), runs `steps` training steps, and records every tensor handed to a collective or transfer.
A TorchDispatchMode sees them all, whoever calls them (torch.distributed's collectives and p2p, batched
p2p, object collectives and the functional collectives DTensor runs): the c10d and _c10d_functional ops.
A tensor that is not on the device the mixed-world rule gives its group (devices.CommDevices: the rank's
device, or the CPU for a group or pair that includes a rank computing on the CPU) is a finding, named with its
op, device, shape and the autopar line that handed it over. Staging an accelerator rank's tensor through the
host reads a meta tensor: the audit hands the collective zeros of its shape (values are not its concern).
The model and inputs may stay on the CPU: the audit passes only if the program itself moves parameters,
buffers, inputs, targets and messages to the rank's device.

Reading a meta tensor's value on the host (`float(loss)`, `.item()`) cannot run on meta: the audit returns 0
for it and lists the site in `report.host_reads` (not a device finding; a host-sync audit judges those).
Collectives are also listed per rank in `report.calls`, with the device type each rank used and the group's
ranks. `report.backend_mismatches` (a failure): the n-th collective of one group handed tensors of different
device types by its ranks, or a send whose tensor's device type differs from its matching receive's (the n-th
send from a to b is matched with b's n-th receive from a) -- either hangs under "cpu:gloo,cuda:nccl", where
torch picks the backend by the tensors' device.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import AutoparError
from .devices import CommDevices, computes_on_cpu

_PACKAGE = str(Path(__file__).resolve().parents[1])
_HERE = str(Path(__file__).resolve())
COMM_NAMESPACES = ("c10d", "_c10d_functional")
_HOST_READS = {"_local_scalar_dense"}
_STAGING = str(Path(__file__).resolve().with_name("dist.py"))


@dataclass
class CommCall:
    """One tensor handed to a collective or transfer."""

    rank: int
    op: str
    device: str
    shape: tuple[int, ...]
    dtype: str
    site: str
    index: int  # this rank's n-th communication op
    ranks: tuple[int, ...] = ()  # the group's global ranks (() when unknown)
    peer: int | None = None  # a transfer's other end (global rank)
    expected: str = ""  # the device type the mixed-world rule gives this group or pair

    def describe(self) -> str:
        return (f"rank {self.rank}: {self.op} got a {self.dtype}{list(self.shape)} tensor on {self.device} at "
                f"{self.site}")


@dataclass
class DeviceReport:
    """What `audit_devices` found: `wrong` (tensors not on their rank's device), `calls` (every tensor handed
    to communication), `host_reads` (sites that read a device value on the host), per rank `devices`."""

    devices: dict[int, str] = field(default_factory=dict)
    calls: list[CommCall] = field(default_factory=list)
    wrong: list[CommCall] = field(default_factory=list)
    host_reads: list[tuple[int, str]] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    backend_mismatches: list[str] = field(default_factory=list)
    meshes: dict[int, str] = field(default_factory=dict)  # rank -> its tensor-parallel DeviceMesh's device type

    @property
    def ok(self) -> bool:
        return not self.wrong and not self.errors and not self.wrong_meshes and not self.backend_mismatches

    @property
    def wrong_meshes(self) -> list[int]:
        """Ranks whose DeviceMesh is not of their device's type (DTensor then places shards elsewhere)."""
        return [r for r, t in self.meshes.items() if t != self.devices[r].split(":")[0]]

    def text(self) -> str:
        lines = [f"device audit of {len(self.devices)} rank(s): {len(self.calls)} tensors handed to communication, "
                 f"{len(self.wrong)} on the wrong device"]
        lines += ["  " + c.describe() + f" (the rank computes on {self.devices[c.rank]}; its group {list(c.ranks)} "
                  f"communicates on {c.expected})" for c in self.wrong]
        lines += [f"  rank {r} failed: {e}" for r, e in self.errors.items()]
        lines += [f"  rank {r}: its DeviceMesh is {self.meshes[r]!r} but the rank computes on {self.devices[r]}"
                  for r in self.wrong_meshes]
        if self.host_reads:
            sites = sorted({s for _, s in self.host_reads})
            lines.append(f"  host reads of device values (not device findings): {', '.join(sites)}")
        lines += ["  " + m for m in self.backend_mismatches]
        return "\n".join(lines)

    def check(self) -> None:
        """Raise an AutoparError listing the findings unless the audit passed."""
        if not self.ok:
            raise AutoparError(self.text() + "\nMove these tensors to their group's comm device "
                               "(runtime/devices.py: CommDevices, dist.on_comm_device).")


def _site() -> str:
    """The innermost autopar line (outside this module and dist.py's wrappers and host staging) on the stack,
    else the innermost caller's."""
    frames = traceback.extract_stack()[:-2]
    for f in reversed(frames):
        if f.filename.startswith(_PACKAGE) and f.filename not in (_HERE, _STAGING):
            return f"{Path(f.filename).relative_to(Path(_PACKAGE).parent)}:{f.lineno} ({f.name})"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} ({f.name})"


class _Recorder(TorchDispatchMode):
    def __init__(self, rank: int, device: torch.device, report: DeviceReport, comm: CommDevices) -> None:
        super().__init__()
        self.rank, self.device, self.report, self.comm, self.count = rank, device, report, comm, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func.namespace in COMM_NAMESPACES:
            site = _site()
            ranks, peer = _group_and_peer(name, args, self.rank)
            expected = self.comm.of((self.rank, peer) if peer is not None else (ranks or None)).type
            for t in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    call = CommCall(self.rank, str(name), str(t.device), tuple(t.shape),
                                    str(t.dtype).removeprefix("torch."), site, self.count, ranks, peer, expected)
                    self.report.calls.append(call)
                    if t.device.type != expected:
                        self.report.wrong.append(call)
            self.count += 1
        elif name in _HOST_READS and args and args[0].device.type == "meta":
            self.report.host_reads.append((self.rank, _site()))
            t = args[0]
            return False if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0)
        elif name == "_to_copy" and args and args[0].device.type == "meta" and \
                torch.device(kwargs.get("device") or "meta").type == "cpu" and _staging():
            t = args[0]
            return torch.zeros(t.shape, dtype=kwargs.get("dtype") or t.dtype, device="cpu")
        return func(*args, **kwargs)


_P2P = ("send", "recv_")


def _staging() -> bool:
    """Whether the running copy is dist.py's host staging (`on_comm_device`, `batch_p2p`), the one host copy of
    a meta tensor the audit stands in for."""
    return any(f.filename == _STAGING for f in traceback.extract_stack(limit=12))


def _group_and_peer(op: str, args: tuple, rank: int) -> tuple[tuple[int, ...], int | None]:
    """The global ranks of a c10d op's process group (its ScriptObject argument, or a functional collective's
    group name), and a send's or receive's peer as a global rank."""
    ranks: tuple[int, ...] = ()
    for a in args:
        try:
            if isinstance(a, torch.ScriptObject):
                pg = torch._C._distributed_c10d.ProcessGroup.unbox(a)
            elif isinstance(a, str):
                pg = dist.distributed_c10d._resolve_process_group(a)
            else:
                continue
            ranks = tuple(dist.get_process_group_ranks(pg))
            break
        except (RuntimeError, ValueError, KeyError, TypeError):
            continue
    peer = None
    if op in _P2P and len(args) > 2 and isinstance(args[2], int):
        peer = ranks[args[2]] if ranks and args[2] < len(ranks) else args[2]
    return ranks, peer


def audit_devices(model: nn.Module, plan: Any, example_inputs: tuple, example_target: Any = None,
                  loss_fn: Any = None, steps: int = 1, optimizer: Any = "sgd", ranks: list[int] | None = None,
                  kernels: str = "torch") -> DeviceReport:
    """Build and step every rank's Program of `plan` (or `ranks`) in this process over the fake process group,
    accelerator ranks on the meta device, and report every tensor handed to communication that is not on its
    rank's device (module docstring). Needs no process group of its own (one must not exist)."""
    from ..cluster import Cluster
    from ..passes.capture import Captures

    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:  # pragma: no cover - torch builds without the test helpers
        raise AutoparError(f"the device audit needs torch's fake process group ({e}).") from None
    if dist.is_initialized():
        raise AutoparError("audit_devices runs every rank in this process on a fake process group: call it "
                           "before (or without) torch.distributed.init_process_group.")
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    cluster = Cluster.load(plan.cluster)
    world = cluster.world_size
    captures = Captures()  # every rank's program takes its micro-batch captures from the first that made them
    graph = captures.capture(model, inputs, loss_fn, example_target)
    report = DeviceReport()
    with _meta_mesh_host(world):
        for rank in ranks if ranks is not None else range(world):
            _audit_rank(model, plan, inputs, example_target, loss_fn, steps, optimizer, kernels, graph, captures,
                        cluster, world, rank, report, FakeStore)
    report.backend_mismatches = _mismatches(report)
    return report


def _meta_mesh_host(world: int) -> Any:
    """DTensor sizes some redistributions by the devices per host of the mesh's device type, which it reads from
    the type's device module (torch.cuda); the meta type standing in for accelerators has none: all `world`
    stand-ins on one host."""
    from torch.distributed.device_mesh import _mesh_resources

    per_host = type(_mesh_resources).num_devices_per_host
    stand_in = lambda device_type: world if device_type == "meta" else per_host(device_type)
    return mock.patch.object(type(_mesh_resources), "num_devices_per_host", staticmethod(stand_in))


def _audit_rank(model: nn.Module, plan: Any, inputs: tuple, example_target: Any, loss_fn: Any, steps: int,
                optimizer: Any, kernels: str, graph: Any, captures: Any, cluster: Any, world: int, rank: int,
                report: DeviceReport, fake_store: Any) -> None:
    from .elastic import stop_heartbeat
    from .program import Program

    device = torch.device("cpu") if computes_on_cpu(cluster.devices[rank].spec) else torch.device("meta")
    report.devices[rank] = str(device)
    dist.init_process_group("cpu:fake,meta:fake", store=fake_store(), rank=rank, world_size=world)
    try:
        with _Recorder(rank, device, report, CommDevices.of_cluster(cluster, device)):
            prog = Program(model, plan, inputs, example_target, loss_fn, optimizer, rank, world,
                           kernels=kernels, graph=graph, device=device, captures=captures)
            if prog.tp is not None:
                report.meshes[rank] = prog.tp.mesh.device_type
            for _ in range(steps):
                prog.step(*inputs, target=example_target)
    except Exception as e:  # noqa: BLE001 - a rank that cannot run is a finding, the others still run
        report.errors[rank] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''} " \
                              f"at {_error_site(e)}"
    finally:
        stop_heartbeat()
        dist.destroy_process_group()


def _error_site(e: BaseException) -> str:
    for f in reversed(traceback.extract_tb(e.__traceback__)):
        if f.filename.startswith(_PACKAGE) and f.filename != _HERE:
            return f"{Path(f.filename).relative_to(Path(_PACKAGE).parent)}:{f.lineno}"
    return "?"


def _mismatches(report: DeviceReport) -> list[str]:
    """Where the ranks of one collective, or the two ends of one transfer, used different device types (so
    different backends): the n-th collective of a group on each of its ranks is one collective; the n-th send
    from a to b is b's n-th receive from a."""
    kinds: dict[tuple[int, int], set[str]] = {}  # (rank, op index) -> device types of its tensors
    first: dict[tuple[int, int], CommCall] = {}
    for c in report.calls:
        kinds.setdefault((c.rank, c.index), set()).add(c.device.split(":")[0])
        first.setdefault((c.rank, c.index), c)
    seq: dict[tuple, int] = {}
    collectives: dict[tuple, list[tuple[CommCall, set[str]]]] = {}
    transfers: dict[tuple, list[tuple[CommCall, set[str]]]] = {}
    for key in sorted(first):
        c = first[key]
        if c.op in _P2P and c.peer is not None:
            pair = (c.rank, c.peer) if c.op == "send" else (c.peer, c.rank)
            k = (c.op, c.rank, pair)
        elif c.op in _P2P or c.op == "recv_any_source_" or not c.ranks:
            continue
        else:
            k = ("collective", c.rank, c.ranks)
        n = seq[k] = seq.get(k, -1) + 1
        if c.op in _P2P:
            transfers.setdefault((pair, n), []).append((c, kinds[key]))
        else:
            collectives.setdefault((c.ranks, n), []).append((c, kinds[key]))
    out = []
    for (ranks, n), members in sorted(collectives.items()):
        used = {k for _, ks in members for k in ks}
        if len(used) > 1:
            by_rank = {c.rank: sorted(ks) for c, ks in members}
            sites = sorted({f"{c.op} at {c.site}" for c, _ in members})
            out.append(f"collective {n + 1} of group {list(ranks)} ({'; '.join(sites)}): device types differ across "
                       f"its ranks {by_rank} (one collective, two backends)")
    for ((src, dst), n), ends in sorted(transfers.items()):
        used = {k for _, ks in ends for k in ks}
        if len(used) > 1:
            sides = "; ".join(f"rank {c.rank} {c.op} on {sorted(ks)} at {c.site}" for c, ks in ends)
            out.append(f"transfer {n + 1} from rank {src} to rank {dst}: the ends use different device types "
                       f"({sides}; one transfer, two backends)")
    return out


__all__ = ["CommCall", "DeviceReport", "audit_devices"]
