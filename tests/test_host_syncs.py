"""Ready for NCCL: waits that leave the host free, no host-device sync per micro-batch inside a step, and
the sync detector (runtime/sync_audit.py) that checks it on CPU."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist

from autopar.runtime import dist as rdist
from autopar.runtime.launch import spawn_local
from autopar.runtime.sync_audit import HostSyncError, host_syncs

from .runtime_cases import STEPS, assert_matches_reference, compile_case, reference

GPT = ("gpt", {"layers": 2, "batch": 4})
MOE = ("moe_gpt", {"layers": 2, "batch": 4})
# (case id, model, model kwargs, strategy); pairs that differ only in the micro-batch count "m"
CASES = [
    ("dp", *GPT, {"dp": 2}),
    ("dp-m2", *GPT, {"dp": 2, "m": 2}),
    ("pp-1f1b-m2", *GPT, {"pp": 2, "m": 2}),
    ("pp-1f1b-m4", *GPT, {"pp": 2, "m": 4}),
    ("ep", *MOE, {"dp": 2, "ep": 2}),
    ("ep-m2", *MOE, {"dp": 2, "ep": 2, "m": 2}),
    ("zero1-offload-optimizer", *GPT, {"dp": 2, "zero": 1, "offload": ("optimizer",)}),
    ("zero1-offload-optimizer-m2", *GPT, {"dp": 2, "zero": 1, "offload": ("optimizer",), "m": 2}),
]
# syncs a step may make on a rank, whatever its micro-batch count: the step's one loss read
# (Program.step's float) and one per expert dispatch (the all-to-all's split sizes, forward and backward)
MAX_SYNCS = {"dp": 1, "pp": 1, "ep": 1, "zero1": 1}


class _Recorder:
    """Work.wait with its arguments recorded (then the real wait: gloo without a timeout uses the group's)."""

    def __init__(self, original: Any) -> None:  # noqa: ANN401
        self.original, self.calls = original, []

    def __call__(self, work: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        self.calls.append((args, kwargs))
        return self.original(work)


def run_sync_cases(rank: int, world: int, cases: list) -> list:
    """Worker: per case, step 1 plain, step 2 inside `host_syncs`, step 3 with the backend reported as
    NCCL and every Work.wait recorded; then the losses and the full state for the reference check."""
    out = []
    for _, name, kwargs, spec in cases:
        case, prog = compile_case(name, kwargs, spec, rank, world)
        step = lambda: prog.step(*case.example_inputs, target=case.example_target)  # noqa: E731
        losses = [step()]
        with host_syncs() as found:
            losses.append(step())
        recorder, backend = _Recorder(dist.Work.wait), dist.get_backend
        dist.Work.wait = recorder
        dist.get_backend = lambda group=None: "nccl"
        try:
            losses.append(step())
        finally:
            dist.Work.wait, dist.get_backend = recorder.original, backend
        sd = prog.state_dict()
        devices = {t.device.type for t in sd["model"].values()} | {
            v.device.type for st in sd["optimizer"].values() for v in st.values() if isinstance(v, torch.Tensor)}
        out.append((losses, sd["model"], [(s.what, s.site) for s in found], recorder.calls, devices))
    return out


@pytest.fixture(scope="module")
def results() -> list:
    return spawn_local(run_sync_cases, 2, CASES, timeout_s=300)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_step_matches_reference_with_few_host_syncs(results: list, index: int) -> None:
    """Losses and parameters equal one process's; the host syncs of a step are at most the loss read,
    whatever the micro-batch count; under NCCL no wait inside the step blocks the host; state_dict is on
    the CPU."""
    cid, name, kwargs, _ = CASES[index]
    ref_losses, ref_params = reference(name, kwargs)
    assert len(ref_losses) == STEPS
    for rank, per_rank in enumerate(results):
        losses, params, syncs, waits, devices = per_rank[index]
        assert_matches_reference(losses, params, ref_losses, ref_params, f"{cid} rank {rank}")
        assert len(syncs) <= MAX_SYNCS[cid.split("-")[0]], f"{cid} rank {rank}: {syncs}"
        assert waits, f"{cid} rank {rank}: no collective or transfer waited for"
        timed = [w for w in waits if w != ((), {})]
        assert not timed, f"{cid} rank {rank}: waits blocking the host under NCCL: {timed}"
        assert devices == {"cpu"}


def test_syncs_do_not_grow_with_micro_batches(results: list) -> None:
    ids = [c[0] for c in CASES]
    for few, many in [("dp", "dp-m2"), ("pp-1f1b-m2", "pp-1f1b-m4"), ("ep", "ep-m2"),
                      ("zero1-offload-optimizer", "zero1-offload-optimizer-m2")]:
        for rank, per_rank in enumerate(results):
            a, b = per_rank[ids.index(few)][2], per_rank[ids.index(many)][2]
            assert len(a) == len(b), f"rank {rank}: {few} {a} vs {many} {b}"


# ---- wait ---------------------------------------------------------------------------------------------


class FakeWork:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    def wait(self, *args: Any) -> bool:  # noqa: ANN401
        self.calls.append(args)
        if self.fail:
            raise RuntimeError("NCCL communicator was aborted\nmore")
        return True


def _backend(monkeypatch: pytest.MonkeyPatch, per_group: dict) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: per_group[group])


def test_wait_on_nccl_is_a_stream_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    nccl, gloo = object(), object()
    _backend(monkeypatch, {nccl: "nccl", gloo: "gloo", None: "cpu:gloo,cuda:nccl"})
    work = FakeWork()
    rdist.wait(work, "x", 1, 5.0, group=nccl)
    assert work.calls == [()]  # no timeout: the stream waits, not the host
    work = FakeWork()
    rdist.wait(work, "x", 1, 5.0, group=gloo)
    assert work.calls == [(datetime.timedelta(seconds=5.0),)]
    for device, expected in [("cuda", ()), ("cpu", (datetime.timedelta(seconds=5.0),))]:
        work = FakeWork()
        rdist.wait(work, "x", 1, 5.0, device=device)  # the default group: the backend of the tensors' device
        assert work.calls == [expected]
    with pytest.raises(rdist.PeerLostError, match="rank 3 is lost"):
        rdist.wait(FakeWork(fail=True), "receiving x", 3, 5.0, group=nccl)


# ---- the detector -------------------------------------------------------------------------------------


def test_detector_ignores_other_code_and_restores_torch() -> None:
    before = {n: vars(torch.Tensor).get(n) for n in ("item", "__float__", "tolist", "nonzero", "__getitem__")}
    x = torch.arange(6.0)
    with host_syncs() as found:
        float(x[0])  # the test's own call: not autopar's
        rdist.unpack(rdist.pack([x]), [((6,), torch.float32)])  # autopar's, and free of syncs
    assert list(found) == []
    assert {n: vars(torch.Tensor).get(n) for n in before} == before


def test_detector_records_autopar_sites_or_raises() -> None:
    t = torch.tensor([1.0, 2.0, 0.0])
    with host_syncs() as found:
        _autopar_probe(t)
    assert [s.what for s in found] == ["Tensor.tolist", "Tensor.nonzero", "Tensor.__getitem__", "Tensor.__float__"]
    assert [s.site for s in found] == [f"autopar/runtime/sync_audit_probe.py:{i}" for i in (2, 3, 4, 5)]
    assert found.sites()["autopar/runtime/sync_audit_probe.py:2"] == 1
    with pytest.raises(HostSyncError, match=r"Tensor\.tolist at autopar/runtime/sync_audit_probe\.py:2"), \
            host_syncs(raise_on_sync=True):
        _autopar_probe(t)


def _autopar_probe(t: torch.Tensor) -> None:
    """Run `t.tolist()`, `t.nonzero()`, `t[t > 0]`, `float(t[0])` from a code object whose file is inside
    autopar, as autopar's own calls would be."""
    from pathlib import Path

    import autopar

    code = "def probe(t):\n    t.tolist()\n    t.nonzero()\n    t[t > 0]\n    float(t[0])\n"
    path = str(Path(autopar.__file__).parent / "runtime" / "sync_audit_probe.py")
    scope: dict = {}
    exec(compile(code, path, "exec"), scope)  # noqa: S102
    scope["probe"](t)
