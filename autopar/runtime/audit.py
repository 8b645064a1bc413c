"""The device audit: every rank of a plan, run in one CPU process, checked for tensors on the wrong device.

`audit_devices(model, plan, example_inputs, example_target, loss_fn)` builds each rank's `Program` in turn over
torch's fake process-group backend ("cpu:fake,meta:fake": collectives and transfers complete at once, on any
device, without peers) with the meta device standing in for the rank's accelerator (a `cpu` device's rank
keeps the CPU), runs `steps` training steps, and records every tensor handed to a collective or transfer.
A TorchDispatchMode sees them all, whoever calls them (torch.distributed's collectives and p2p, batched
p2p, object collectives and the functional collectives DTensor runs): the c10d and _c10d_functional ops.
A tensor that is not on the rank's device is a finding, named with its op, device, shape and the autopar
line that handed it over. The model and inputs may stay on the CPU: the audit passes only if the program
itself moves parameters, buffers, inputs, targets and messages to the rank's device.

Reading a meta tensor's value on the host (`float(loss)`, `.item()`) cannot run on meta: the audit returns 0
for it and lists the site in `report.host_reads` (not a device finding; a host-sync audit judges those).
Collectives are also listed per rank in `report.calls`, with the device type each rank used
(`report.backend_mismatches`: the same collective of a group handed to different backends on different
ranks, which hangs under "cpu:gloo,cuda:nccl" where a group mixes `cpu` and accelerator ranks).
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
from .devices import computes_on_cpu

_PACKAGE = str(Path(__file__).resolve().parents[1])
_HERE = str(Path(__file__).resolve())
COMM_NAMESPACES = ("c10d", "_c10d_functional")
_HOST_READS = {"_local_scalar_dense"}


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
        return not self.wrong and not self.errors and not self.wrong_meshes

    @property
    def wrong_meshes(self) -> list[int]:
        """Ranks whose DeviceMesh is not of their device's type (DTensor then places shards elsewhere)."""
        return [r for r, t in self.meshes.items() if t != self.devices[r].split(":")[0]]

    def text(self) -> str:
        lines = [f"device audit of {len(self.devices)} rank(s): {len(self.calls)} tensors handed to communication, "
                 f"{len(self.wrong)} on the wrong device"]
        lines += ["  " + c.describe() + f" (the rank computes on {self.devices[c.rank]})" for c in self.wrong]
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
            raise AutoparError(self.text() + "\nMove these tensors to the rank's device (runtime/devices.py).")


def _site() -> str:
    """The innermost autopar line (outside this module) on the stack, else the innermost caller's."""
    frames = traceback.extract_stack()[:-2]
    for f in reversed(frames):
        if f.filename.startswith(_PACKAGE) and f.filename != _HERE:
            return f"{Path(f.filename).relative_to(Path(_PACKAGE).parent)}:{f.lineno} ({f.name})"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} ({f.name})"


class _Recorder(TorchDispatchMode):
    def __init__(self, rank: int, device: torch.device, report: DeviceReport) -> None:
        super().__init__()
        self.rank, self.device, self.report, self.count = rank, device, report, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in COMM_NAMESPACES:
            site = _site()
            for t in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    call = CommCall(self.rank, str(func.overloadpacket.__name__), str(t.device), tuple(t.shape),
                                    str(t.dtype).removeprefix("torch."), site, self.count)
                    self.report.calls.append(call)
                    if t.device.type != self.device.type:
                        self.report.wrong.append(call)
            self.count += 1
        elif func.overloadpacket.__name__ in _HOST_READS and args and args[0].device.type == "meta":
            self.report.host_reads.append((self.rank, _site()))
            t = args[0]
            return False if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0)
        return func(*args, **kwargs)


def audit_devices(model: nn.Module, plan: Any, example_inputs: tuple, example_target: Any = None,
                  loss_fn: Any = None, steps: int = 1, optimizer: Any = "sgd", ranks: list[int] | None = None,
                  kernels: str = "torch") -> DeviceReport:
    """Build and step every rank's Program of `plan` (or `ranks`) in this process over the fake process group,
    accelerator ranks on the meta device, and report every tensor handed to communication that is not on its
    rank's device (module docstring). Needs no process group of its own (one must not exist)."""
    from ..cluster import Cluster
    from ..passes.capture import capture

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
    graph = capture(model, inputs, loss_fn, example_target)
    report = DeviceReport()
    with _meta_mesh_host(world):
        for rank in ranks if ranks is not None else range(world):
            _audit_rank(model, plan, inputs, example_target, loss_fn, steps, optimizer, kernels, graph, cluster,
                        world, rank, report, FakeStore)
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
                optimizer: Any, kernels: str, graph: Any, cluster: Any, world: int, rank: int, report: DeviceReport,
                fake_store: Any) -> None:
    from .elastic import stop_heartbeat
    from .program import Program

    device = torch.device("cpu") if computes_on_cpu(cluster.devices[rank].spec) else torch.device("meta")
    report.devices[rank] = str(device)
    dist.init_process_group("cpu:fake,meta:fake", store=fake_store(), rank=rank, world_size=world)
    try:
        with _Recorder(rank, device, report):
            prog = Program(model, plan, inputs, example_target, loss_fn, optimizer, rank, world,
                           kernels=kernels, graph=graph, device=device)
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
    """Collectives at the same site whose ranks used different device types (so different backends)."""
    by_site: dict[tuple[str, str], set[tuple[int, str]]] = {}
    for c in report.calls:
        by_site.setdefault((c.op, c.site), set()).add((c.rank, c.device.split(":")[0]))
    out = []
    for (op, site), used in sorted(by_site.items()):
        kinds = {k for _, k in used}
        if len(kinds) > 1 and op not in ("send", "recv_", "recv_any_source_"):
            ranks = {k: sorted(r for r, kk in used if kk == k) for k in sorted(kinds)}
            out.append(f"{op} at {site}: device types differ across ranks {ranks} (one collective, two backends)")
    return out


__all__ = ["CommCall", "DeviceReport", "audit_devices"]
