"""Item 6 of the GPU-readiness issue: a mixed world (a `cpu` device beside accelerators). Every group or pair
that includes a rank computing on the CPU communicates with CPU tensors (gloo), accelerator ranks staging theirs
through the host (`dist.on_comm_device`, `dist.batch_p2p`); the device audit checks the placement
(tests/test_device_audit.py). Here: the numerics of real 2-rank gloo training of the mixed cluster cases, the
staging path run for real (every comm device mocked to another "device" kind, so every collective and transfer
is staged), and the staging helper itself."""

from __future__ import annotations

import datetime

import pytest
import torch

from autopar.runtime import dist as rdist
from autopar.runtime.devices import CommDevices, check_one_device_kind, group_comm_device
from autopar.runtime.launch import spawn_local

from .runtime_cases import assert_ranks_match_reference, run_cases

MIXED = "1x1xA100-80GB+1x1xcpu"
CASES = [  # (model, kwargs, spec): rank 0 is the A100 (the CPU on this machine), rank 1 the cpu device
    ("gpt", {}, {"pp": 2, "m": 2, "cluster": MIXED}),
    ("mlp", {}, {"dp": 2, "batch_split": [12, 4], "cluster": MIXED}),
    ("mlp", {}, {"dp": 2, "zero": 1, "batch_split": [12, 4], "cluster": MIXED}),
    ("gpt", {}, {"dp": 2, "zero": 3, "cluster": MIXED}),
]
STAGED = [CASES[0], CASES[2], CASES[3]]
ANOTHER_KIND = torch.device("cpu", 0)  # not the ranks' torch.device("cpu"): tensors are copied to it and back


def run_staged(rank: int, world: int, cases: list) -> tuple[list, int]:
    """Worker: `run_cases` with every group's comm device another device than the rank's (the staging path
    of an accelerator rank in a mixed group, on CPU copies); also how many staged works were waited."""
    waited = [0]
    real_wait = rdist.StagedWork.wait

    def counting(self: rdist.StagedWork, timeout: datetime.timedelta | None = None) -> bool:
        waited[0] += 1
        return real_wait(self, timeout)

    real_of = CommDevices.of
    CommDevices.of = lambda self, ranks: ANOTHER_KIND  # type: ignore[method-assign]
    rdist.StagedWork.wait = counting  # type: ignore[method-assign]
    try:  # the process serves later tests (LocalPool): leave the classes as they were
        return run_cases(rank, world, cases), waited[0]
    finally:
        CommDevices.of, rdist.StagedWork.wait = real_of, real_wait  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def results() -> list:
    return spawn_local(run_cases, 2, CASES, timeout_s=400)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_mixed_cluster_training_on_gloo_matches_one_process(results: list, index: int) -> None:
    name, kwargs, spec = CASES[index]
    assert_ranks_match_reference(results, index, name, kwargs, f"{spec}: ")


def test_staged_communication_matches_one_process() -> None:
    """Every collective and transfer through host copies (copy in, communicate, copy back): same numerics."""
    out = spawn_local(run_staged, 2, STAGED, timeout_s=400)
    for index, (name, kwargs, spec) in enumerate(STAGED):
        assert_ranks_match_reference([r for r, _ in out], index, name, kwargs, f"staged {spec}: ")
    assert all(n > 0 for _, n in out), [n for _, n in out]


class FakeWork:
    def __init__(self) -> None:
        self.timeouts: list = []

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.timeouts.append(timeout)
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> None:
        raise RuntimeError("no future")


def test_on_comm_device_stages_through_the_comm_device_and_copies_back() -> None:
    """The collective gets copies on the comm device (here another "device" than the tensors'), the caller's
    tensors are untouched until the work is waited, then hold what the collective left."""
    got: list = []
    work = FakeWork()

    def collective(t: torch.Tensor, parts: list[torch.Tensor], *, async_op: bool) -> FakeWork:
        got.extend([t, *parts])
        t.mul_(2)
        for i, p in enumerate(parts):
            p.fill_(i + 10)
        return work

    t, parts = torch.arange(3.0), [torch.zeros(2), torch.zeros(2)]
    staged = rdist.on_comm_device(collective, ANOTHER_KIND, t, parts, async_op=True)
    assert isinstance(staged, rdist.StagedWork)
    assert [g.data_ptr() for g in got] != [x.data_ptr() for x in (t, *parts)]
    assert all(g.device.type == "cpu" for g in got) and not any(g.data_ptr() == t.data_ptr() for g in got)
    assert t.tolist() == [0.0, 1.0, 2.0] and parts[0].tolist() == [0.0, 0.0]  # not before the wait
    rdist.wait(staged, "test collective", 1, timeout_s=5.0)
    assert work.timeouts == [datetime.timedelta(seconds=5.0)]  # a staged work is waited on the host, timed
    assert t.tolist() == [0.0, 2.0, 4.0] and parts[0].tolist() == [10.0, 10.0] and parts[1].tolist() == [11.0, 11.0]
    # already on the comm device: the op itself, nothing staged
    assert rdist.on_comm_device(collective, t.device, t, [], async_op=True) is work


def test_the_rule() -> None:
    from autopar.cluster import Cluster

    mixed, gpus = Cluster.load("1x2xA100-80GB+1x1xcpu"), Cluster.load("1x2xA100-80GB")
    cuda = torch.device("cuda", 1)
    assert group_comm_device([0, 1], cuda, mixed) == cuda
    assert group_comm_device([1, 2], cuda, mixed) == torch.device("cpu")
    assert CommDevices.of_cluster(mixed, cuda).world == torch.device("cpu")
    assert CommDevices.of_cluster(gpus, cuda).world == cuda
    assert CommDevices.of_cluster(mixed, cuda).of((0, 1)) == cuda
    check_one_device_kind({"stage 0": [0, 1]}, mixed)
    with pytest.raises(Exception, match=r"stage 1 spans ranks \[1, 2\].*ranks \[2\] compute on the CPU"):
        check_one_device_kind({"stage 1": [1, 2]}, mixed)


def test_the_planner_never_groups_cpu_and_accelerators_for_tensor_parallelism() -> None:
    """What compile refuses (`check_one_device_kind`) the planner cannot choose: its tensor-parallel groups are
    consecutive devices of one node (solver/search/configs.py `tp_units`, `mixed_tp_layouts`), and a cluster file gives
    each node one device type, so every group is of one kind, a cpu node's included."""
    from types import SimpleNamespace

    from autopar.cluster import Cluster
    from autopar.runtime.devices import computes_on_cpu
    from autopar.solver.search.configs import mixed_tp_layouts, tp_units

    cluster = Cluster.load("1x2xA100-80GB+1x2xcpu")
    cm = SimpleNamespace(cluster=cluster, B=8, L=6, expert_parallel=SimpleNamespace(degree=1))
    groups = [u for t in (1, 2) for u in tp_units(cm, t)]
    mixed = mixed_tp_layouts(cm)
    assert mixed, "no per-type tensor-parallel layouts to check"
    groups += [u for _, _, pipes in mixed for pipe in pipes for u in pipe]
    for g in groups:
        assert len({computes_on_cpu(cluster.devices[r].spec) for r in g}) == 1, g
