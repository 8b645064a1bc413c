"""The device audit (runtime/audit.py): every rank of a plan built and stepped in this process over torch's fake
process group, the meta device standing in for each accelerator rank, with every tensor handed to a collective
or transfer checked to be on its rank's device. The models and their example batches stay on the CPU, so these
pass only because the program moves parameters, buffers, inputs, targets, captured device constants and
messages to the rank's device (items 2, 6 and 14 of the GPU-readiness issue)."""

from __future__ import annotations

import pytest

import autopar
from autopar.cluster import Cluster
from autopar.runtime.audit import audit_devices
from autopar.runtime.program import Program

from .runtime_cases import build, plan_for

CASES = {  # layout -> (model case, plan spec, cluster)
    "dp": ("mlp", {"dp": 2}, "1x2xA100-80GB"),
    "pp_1f1b": ("gpt", {"pp": 2, "m": 2}, "1x2xA100-80GB"),
    "tp": ("gpt", {"tp": 2}, "1x2xA100-80GB"),
    "mixed_cpu_gpu": ("gpt", {"pp": 2, "m": 2}, "1x1xA100-80GB+1x1xcpu"),
}


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
    want = {0: "meta", 1: "cpu" if layout == "mixed_cpu_gpu" else "meta"}  # a cpu device's rank stays on the CPU
    assert report.devices == want
    for c in report.calls:
        assert c.device.split(":")[0] == want[c.rank], c.describe()
    if layout == "tp":  # item 14: the mesh follows the rank's device, not torch.cuda.is_available()
        assert report.meshes == {0: "meta", 1: "meta"}


def test_a_mixed_cluster_names_collectives_that_span_both_backends() -> None:
    """A world collective between a cpu rank (gloo) and an accelerator rank (NCCL) is listed: under
    "cpu:gloo,cuda:nccl" the two ranks would hand it to different backends."""
    report = audit("mixed_cpu_gpu")
    assert any("allreduce_" in m for m in report.backend_mismatches), report.text()
    assert not audit("pp_1f1b").backend_mismatches


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
