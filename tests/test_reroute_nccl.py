"""Re-routing around a lost rank is gloo-only: on NCCL (or under torchrun's agent) it is refused with a reason
instead of destroying a group whose communicators still wait on the dead peer (which would hang).

CPU only: the backend name is mocked; nothing here starts a process group.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from autopar.errors import AutoparError, PlanError
from autopar.runtime import dist as adist
from autopar.runtime import reroute


def _fake_program(rank: int = 0) -> Any:
    return SimpleNamespace(world_size=4, rank=rank, plan=SimpleNamespace(predicted={}))


def _on_backend(monkeypatch: pytest.MonkeyPatch, module: Any, backend: str) -> None:
    monkeypatch.setattr(module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(module.dist, "get_backend", lambda *a: backend)


def test_reroute_true_on_nccl_is_a_plan_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    _on_backend(monkeypatch, reroute, "nccl")
    with pytest.raises(PlanError, match=r"nccl.*gloo-only.*abort.*--max-restarts"):
        reroute.wrap(_fake_program(), rebuild=lambda *a: None, on=True)


def test_reroute_default_on_nccl_is_off_and_said_once(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv(reroute.ENV, "1")  # launched by `autopar run` without --max-restarts
    _on_backend(monkeypatch, reroute, "nccl")
    prog = _fake_program()
    assert reroute.wrap(prog, rebuild=lambda *a: None) is prog
    assert prog.plan.predicted["reroute"]["on"] is False
    assert "nccl" in prog.plan.predicted["reroute"]["why"]
    assert reroute.wrap(prog, rebuild=lambda *a: None) is prog  # a re-wrap (shedding) says nothing again
    err = capsys.readouterr().err
    assert err.count("re-routing around a lost rank is off") == 1 and "--max-restarts" in err
    other = _fake_program(rank=1)
    reroute.wrap(other, rebuild=lambda *a: None)
    assert capsys.readouterr().err == ""  # only rank 0 says it


def test_reroute_under_torchrun_agent_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _on_backend(monkeypatch, reroute, "gloo")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    with pytest.raises(PlanError, match="torchrun's elastic agent"):
        reroute.wrap(_fake_program(), rebuild=lambda *a: None, on=True)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert reroute.backend_refusal("gloo", False) is None


def test_regroup_refuses_nccl_before_destroying_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    _on_backend(monkeypatch, adist, "nccl")
    calls: list[str] = []
    monkeypatch.setattr(adist.dist, "destroy_process_group", lambda *a: calls.append("destroy"))
    monkeypatch.setattr(adist.dist, "init_process_group", lambda *a, **k: calls.append("init"))
    with pytest.raises(AutoparError, match=r"nccl.*--max-restarts"):
        adist.regroup(object(), "p", 0, 2, 1.0)
    assert calls == []
