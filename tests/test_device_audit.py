"""The device audit (runtime/audit.py): every rank of a plan built and stepped in this process over torch's fake
process group, the meta device standing in for each accelerator rank, with every tensor handed to a collective
or transfer checked to be on its rank's device. The models and their example batches stay on the CPU, so these
pass only because the program moves parameters, buffers, inputs, targets, captured device constants and
messages to the rank's device (items 2, 6 and 14 of the GPU-readiness issue). On a mixed cluster (a `cpu` device
beside an accelerator) every group or pair including the cpu rank communicates with CPU tensors, the accelerator
rank staging its own through the host, and the audit fails where the ranks of one collective or the ends of one
transfer use different device types (item 6: one collective, two backends, a hang under "cpu:gloo,cuda:nccl")."""

from __future__ import annotations

import pytest

import autopar
from autopar.cluster import Cluster
from autopar.errors import PlanError
from autopar.runtime.audit import audit_devices
from autopar.runtime.devices import CommDevices
from autopar.runtime.program import Program

from .runtime_cases import build, plan_for

CASES = {  # layout -> (model case, plan spec, cluster)
    "dp": ("mlp", {"dp": 2}, "1x2xA100-80GB"),
    "pp_1f1b": ("gpt", {"pp": 2, "m": 2}, "1x2xA100-80GB"),
    "tp": ("gpt", {"tp": 2}, "1x2xA100-80GB"),
    "mixed_cpu_gpu": ("gpt", {"pp": 2, "m": 2}, "1x1xA100-80GB+1x1xcpu"),
    # uneven shares: the cpu replica takes fewer samples (bucketed gradient all-reduce, the loss riding in it)
    "mixed_dp": ("mlp", {"dp": 2, "batch_split": [12, 4]}, "1x1xA100-80GB+1x1xcpu"),
    "mixed_dp_zero1": ("mlp", {"dp": 2, "zero": 1, "batch_split": [12, 4]}, "1x1xA100-80GB+1x1xcpu"),
    "mixed_dp_zero3": ("gpt", {"dp": 2, "zero": 3}, "1x1xA100-80GB+1x1xcpu"),
}
MIXED = sorted(k for k in CASES if k.startswith("mixed"))


_DONE: dict = {}


def audit(layout: str, cached: bool = True):
    """The audit of one layout (each run once per session unless `cached` is False)."""
    if cached and layout in _DONE:
        return _DONE[layout]
    name, spec, cluster = CASES[layout]
    case = build(name)
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    plan = plan_for(g, 2, spec)
    plan.cluster = Cluster.load(cluster).to_dict()
    report = audit_devices(case.model, plan, case.example_inputs, case.example_target, case.loss_fn)
    if cached:
        _DONE[layout] = report
    return report


@pytest.mark.parametrize("layout", sorted(CASES))
def test_every_tensor_handed_to_communication_is_on_its_ranks_device(layout: str) -> None:
    report = audit(layout)
    assert report.ok, report.text()
    assert report.calls, "the audit saw no communication"
    want = {0: "meta", 1: "cpu" if layout in MIXED else "meta"}  # a cpu device's rank stays on the CPU
    assert report.devices == want
    for c in report.calls:  # on a mixed cluster every group and pair includes the cpu rank: all on the host
        assert c.device.split(":")[0] == ("cpu" if layout in MIXED else want[c.rank]), c.describe()
    if layout == "tp":  # item 14: the mesh follows the rank's device, not torch.cuda.is_available()
        assert report.meshes == {0: "meta", 1: "meta"}


@pytest.mark.parametrize("layout", MIXED)
def test_mixed_clusters_fail_the_audit_without_the_rule(layout: str, monkeypatch) -> None:
    """The mutation of item 6 (main before the rule): every rank communicates on its own device. The loss
    all-reduce, gradient buckets, ZeRO collectives and pipeline transfers between the cpu rank and the
    accelerator rank then use two backends: listed, and the audit fails."""
    monkeypatch.setattr(CommDevices, "of", lambda self, ranks: self.device)
    report = audit(layout, cached=False)
    assert report.backend_mismatches and not report.ok, report.text()
    text = "\n".join(report.backend_mismatches)
    assert "_first_world_collective" in text, text
    if layout != "mixed_dp":  # plain dp: the loss rides in the last gradient bucket
        assert "program.py" in text and "(step)" in text, text  # the loss all-reduce
    if layout == "mixed_cpu_gpu":
        assert "transfer 1 from rank 0 to rank 1" in text, text
    if layout.startswith("mixed_dp_zero"):
        assert "zero.py" in text, text
    if layout == "mixed_dp":
        assert "grad_sync.py" in text, text


def test_the_mismatch_check_pairs_sends_with_receives(monkeypatch) -> None:
    """Only the pipeline transfers broken: sends staged to the host, receives left on the device."""
    from autopar.runtime import dist as rdist

    real = rdist.batch_p2p
    monkeypatch.setattr(rdist, "batch_p2p", lambda ops, comms: real(
        ops, [c if is_send else t.device for (is_send, t, _), c in zip(ops, comms, strict=True)]))
    monkeypatch.setattr("autopar.runtime.program.batch_p2p", rdist.batch_p2p)
    report = audit("mixed_cpu_gpu", cached=False)
    assert not report.ok
    assert any(m.startswith("transfer") for m in report.backend_mismatches), report.text()
    assert not any(m.startswith("collective") for m in report.backend_mismatches), report.text()


def test_the_world_collective_comes_before_the_first_transfer() -> None:
    """Item 4 (NCCL: the first collective of the group a batch_isend_irecv uses needs every rank of it): each
    rank's first communication is an all-reduce over the whole world, before any send or receive."""
    for layout in ("pp_1f1b", "mixed_cpu_gpu"):
        report = audit(layout)
        for rank in report.devices:
            calls = sorted((c for c in report.calls if c.rank == rank), key=lambda c: c.index)
            assert calls[0].op == "allreduce_" and calls[0].ranks == (0, 1), calls[0].describe()
            assert "_first_world_collective" in calls[0].site, calls[0].site
            assert any(c.op in ("send", "recv_") for c in calls)


def test_a_tensor_parallel_group_over_both_kinds_is_refused() -> None:
    """tp 2 over an A100 and a cpu device: one DeviceMesh cannot use gloo and NCCL, so compile refuses it,
    naming the stage, its ranks and device types, and the fix."""
    case = build("gpt")
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    plan = plan_for(g, 2, {"tp": 2})
    plan.cluster = Cluster.load("1x1xA100-80GB+1x1xcpu").to_dict()
    with pytest.raises(PlanError, match=r"stage 0 of pipeline 0 .*ranks \[0, 1\].*A100-80GB.*cpu.*Strategy\(tp="):
        Program(case.model, plan, case.example_inputs, case.example_target, case.loss_fn, "sgd", 0, 2, graph=g,
                device="cpu")  # refused before any process group is needed
    report = audit_devices(case.model, plan, case.example_inputs, case.example_target, case.loss_fn)
    assert not report.ok and all("PlanError" in e for e in report.errors.values()), report.text()


def test_the_audit_fails_when_inputs_stay_on_the_cpu(monkeypatch) -> None:
    """The mutation the audit exists for: a step that does not move its inputs and target."""
    monkeypatch.setattr(Program, "to_rank_device", lambda self, inputs, target: (inputs, target))
    report = audit("dp", cached=False)
    assert not report.ok
    assert set(report.errors) | {c.rank for c in report.wrong} == {0, 1}, report.text()
    with pytest.raises(autopar.AutoparError, match="device audit"):
        report.check()


def test_host_reads_of_device_values_are_listed_not_failed() -> None:
    """`float(loss)` in a step cannot run on meta: the audit lists the site (a host-sync audit's concern)."""
    report = audit("pp_1f1b")
    assert any("program.py" in site for _, site in report.host_reads), report.host_reads
