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
# A step's host syncs on a rank: the one loss read at its end (Program.step's float), whatever the micro-batch
# count; and an expert-parallel dispatch reads its split sizes on the host once (its all-to-all takes them
# there): moe_gpt's 2 MoE blocks dispatch in each micro-batch's forward and backward.
DISPATCH_SITE = "autopar/runtime/expert_parallel.py"
DISPATCHES = {"ep": 4, "ep-m2": 8}


def _split(syncs: list) -> tuple[list, list]:
    """(the expert dispatches' syncs, the others)."""
    dispatch = [s for s in syncs if s[1].startswith(DISPATCH_SITE)]
    return dispatch, [s for s in syncs if not s[1].startswith(DISPATCH_SITE)]


def _recording(original: Any, calls: list) -> Any:  # noqa: ANN401
    """Work.wait with its arguments recorded (then the real wait: gloo without a timeout uses the group's)."""
    def wait(work: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        calls.append((args, kwargs))
        return original(work)
    return wait


def run_sync_cases(rank: int, world: int, cases: list) -> list:
    """Worker: per case, step 1 plain, step 2 inside `host_syncs`, step 3 with the backend reported as
    NCCL and every Work.wait recorded; then the losses and the full state for the reference check."""
    out = []
    for _, name, kwargs, spec in cases:
        case, prog = compile_case(name, kwargs, spec, rank, world)
        def step(prog: Any = prog, case: Any = case) -> float:  # noqa: ANN401
            return prog.step(*case.example_inputs, target=case.example_target)

        losses = [step()]
        with host_syncs() as found:
            losses.append(step())
        waits: list = []
        original, backend = dist.Work.wait, dist.get_backend
        dist.Work.wait = _recording(original, waits)
        dist.get_backend = lambda group=None: "nccl"
        try:
            losses.append(step())
        finally:
            dist.Work.wait, dist.get_backend = original, backend
        sd = prog.state_dict()
        devices = {t.device.type for t in sd["model"].values()} | {
            v.device.type for st in sd["optimizer"].values() for v in st.values() if isinstance(v, torch.Tensor)}
        out.append((losses, sd["model"], [(s.what, s.site) for s in found], waits, devices))
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
        dispatch, other = _split(syncs)
        assert len(other) <= 1, f"{cid} rank {rank}: {syncs}"
        assert len(dispatch) == DISPATCHES.get(cid, 0), f"{cid} rank {rank}: one host read per dispatch: {syncs}"
        assert len({s[1] for s in dispatch}) <= 1, dispatch
        assert waits, f"{cid} rank {rank}: no collective or transfer waited for"
        timed = [w for w in waits if w != ((), {})]
        assert not timed, f"{cid} rank {rank}: waits blocking the host under NCCL: {timed}"
        assert devices == {"cpu"}


def test_syncs_do_not_grow_with_micro_batches(results: list) -> None:
    ids = [c[0] for c in CASES]
    for few, many in [("dp", "dp-m2"), ("pp-1f1b-m2", "pp-1f1b-m4"), ("ep", "ep-m2"),
                      ("zero1-offload-optimizer", "zero1-offload-optimizer-m2")]:
        for rank, per_rank in enumerate(results):
            a, b = (_split(per_rank[ids.index(c)][2])[1] for c in (few, many))
            assert len(a) == len(b) == 1, f"rank {rank}: {few} {a} vs {many} {b}"


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


# ---- straggler timing ---------------------------------------------------------------------------------


class FakeEvent:
    """A CUDA timing event stand-in: `record` stamps a fake stream clock, `synchronize` is counted."""

    clock = 0.0
    made: list[FakeEvent] = []
    syncs = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None
        FakeEvent.made.append(self)

    def record(self) -> None:
        FakeEvent.clock += 2.5  # ms of stream time between consecutive records
        self.at = FakeEvent.clock

    def synchronize(self) -> None:
        FakeEvent.syncs += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.at - self.at  # type: ignore[operator]


def test_stage_timer_on_cuda_records_events_and_reads_them_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from autopar.runtime.straggler import StageTimer

    FakeEvent.made, FakeEvent.syncs, FakeEvent.clock = [], 0, 0.0
    timer = StageTimer(0, device="cuda", event=FakeEvent)

    def forbidden(*a: Any) -> None:  # noqa: ANN401
        raise AssertionError("host timing or a device sync inside a step")

    monkeypatch.setattr(time, "perf_counter", forbidden)
    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    for _ in range(2):  # two steps of three compute sections
        for _ in range(3):
            with timer.compute():
                pass
        timer.end_step()
    assert len(FakeEvent.made) == 12 and all(e.at is not None for e in FakeEvent.made)
    assert FakeEvent.syncs == 0
    assert list(timer.steps) == pytest.approx([3 * 2.5e-3] * 2)  # each section 2.5 ms of stream time
    assert FakeEvent.syncs == 1  # one wait, when the report reads the steps
    assert list(timer.steps) == pytest.approx([3 * 2.5e-3] * 2) and FakeEvent.syncs == 1


def test_stage_timer_on_cpu_uses_the_host_clock() -> None:
    from autopar.runtime.straggler import StageTimer

    timer = StageTimer(0, device="cpu", event=FakeEvent)
    FakeEvent.made = []
    with timer.compute():
        sum(range(1000))
    timer.end_step()
    assert not FakeEvent.made and len(timer.steps) == 1 and timer.steps[0] > 0


# ---- state_dict -----------------------------------------------------------------------------------------


def test_state_dict_gathers_host_tensors_over_a_cpu_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under NCCL alone, `state_dict` gathers over a gloo group it makes, and every tensor it hands to the
    object gather has been moved to the host (`.cpu()`, marked here) first."""
    case, prog = compile_case("gpt", {"layers": 2, "batch": 4}, {"zero": 0}, 0, 1)
    prog.step(*case.example_inputs, target=case.example_target)
    expected = prog.state_dict()
    original_cpu = torch.Tensor.cpu

    def marked_cpu(t: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:  # noqa: ANN401
        out = original_cpu(t, *a, **k).clone()
        out.moved_to_host = True
        return out

    gathered, made = [], []

    def all_gather_object(parts: list, obj: Any, group: Any = None) -> None:  # noqa: ANN401
        gathered.append((obj, group))
        parts[:] = [obj] * len(parts)

    gloo = object()

    def new_group(ranks: list, backend: str | None = None) -> object:
        made.append((ranks, backend))
        return gloo

    monkeypatch.setattr(torch.Tensor, "cpu", marked_cpu)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    prog.world_size = 2  # as one of two ranks holding the same replica
    sd = prog.state_dict()
    (obj, group), = gathered
    assert group is gloo and made == [([0, 1], "gloo")]
    tensors = [*obj["params"].values(), *obj["buffers"].values(),
               *(v for st in obj["optimizer"].values() for v in st.values() if isinstance(v, torch.Tensor))]
    assert tensors and all(getattr(t, "moved_to_host", False) for t in tensors)
    assert sd.keys() == expected.keys() and sd["step"] == expected["step"]
    for k, v in expected["model"].items():
        assert sd["model"][k].device.type == "cpu"
        torch.testing.assert_close(sd["model"][k], v, rtol=0, atol=0)
    prog.state_dict()
    assert len(made) == 1  # the group is made once
