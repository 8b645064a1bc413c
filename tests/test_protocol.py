"""Every program `autopar.compile` returns implements one protocol (issue #23, part 4; runtime/protocol.py): `plan`,
`step`, `eval_step`, `state_dict` / `load_state_dict`, `save` / `load`, `report`, and the wrappers forward it
explicitly (no `__getattr__`). Each kind is built the way a user gets it and exercised on its numbers: the eval
output is the model's, a checkpoint restores the state it saved and loads into the plain model, the report
holds the measured steps."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autopar
from autopar import models
from autopar.graphs.tgn import event_batch, tgn_case
from autopar.runtime.checkpoint import load_into_model
from autopar.runtime.launch import spawn_local
from autopar.runtime.plan_check import RunReport
from autopar.runtime.protocol import TrainingProgram

from . import fallback_model

ADAM = lambda p: torch.optim.AdamW(p, lr=1e-2, eps=1e-6)  # noqa: E731
STEPS = 2


def _gpt(**kw: Any) -> tuple[Any, tuple, tuple, Any]:
    case = models.gpt(seed=0, layers=2, batch=4)
    prog = autopar.compile(case.model, "1x1xcpu", case.example_inputs, case.example_target, case.loss_fn, ADAM,
                           **kw)
    return prog, (case.example_inputs, case.example_target), case.example_inputs, case.model


def _replicated() -> tuple[Any, tuple, tuple, Any]:
    model, x, y = fallback_model.build()
    prog = autopar.compile(model, "1x1xcpu", (x,), y, nn.functional.cross_entropy, ADAM)
    return prog, ((x,), y), (x,), model


def _gnn() -> tuple[Any, tuple, tuple, Any]:
    case = models.gnn(seed=0)
    prog = autopar.compile(case.model, "1x1xcpu", case.example_inputs, case.example_target, case.loss_fn, ADAM)
    return prog, (case.example_inputs, case.example_target), case.example_inputs, case.model


def _tgn() -> tuple[Any, tuple, tuple, Any]:
    case, events = tgn_case(batch_size=50)
    prog = autopar.compile(case.model, "1x1xcpu", case.example_inputs, optimizer=ADAM)
    return prog, (event_batch(events, 50, 1), None), event_batch(events, 50, 2), case.model


KINDS = {
    "Program": lambda: _gpt(),
    "AsyncProgram": lambda: _gpt(sync="wsp", staleness=1, plan=autopar.Strategy()),
    "AdaptiveProgram": lambda: _gpt(adapt=True),
    "ReplicatedProgram": _replicated,
    "GraphProgram": _gnn,
    "TemporalProgram": _tgn,
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_program_kind_implements_the_protocol(kind: str, tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's and asynchrony's warnings are tested where they belong
        prog, (step_inputs, target), eval_inputs, model = KINDS[kind]()
        assert type(prog).__name__ == kind
        assert isinstance(prog, TrainingProgram)
        assert not hasattr(type(prog), "__getattr__")
        assert (prog.plan is None) == (kind == "ReplicatedProgram")
        losses = [prog.step(*step_inputs, target=target) for _ in range(STEPS)]
        assert all(isinstance(v, float) for v in losses)
        assert prog.step_count == STEPS

        # eval_step: the model's output under the trained state, no update
        state = prog.state_dict()
        fresh = copy.deepcopy(model)  # the user's model object, its buffers shaped as the program's
        fresh.load_state_dict(state["model"])
        with torch.no_grad():
            expected = fresh(*eval_inputs)
        got = prog.eval_step(*eval_inputs)
        got = got.logits if hasattr(got, "logits") else got
        expected = expected.logits if hasattr(expected, "logits") else expected
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        after = prog.state_dict()
        for k, v in state["model"].items():
            torch.testing.assert_close(after["model"][k], v, rtol=0, atol=0, msg=f"eval_step changed {k}")

        # save / load: a later state is rolled back to the saved one, optimizer state included (the step after
        # the load is the step after the save, to the bit); the checkpoint loads into the plain model
        prog.save(str(tmp_path / "ckpt"))
        first = prog.step(*step_inputs, target=target)
        moved = prog.state_dict()
        assert any(not torch.equal(moved["model"][k], v) for k, v in state["model"].items())
        prog.load(str(tmp_path / "ckpt"))
        back = prog.state_dict()
        assert back["step"] == state["step"] == STEPS
        for k, v in state["model"].items():
            torch.testing.assert_close(back["model"][k], v, rtol=0, atol=0, msg=k)
        assert prog.step(*step_inputs, target=target) == first
        again = prog.state_dict()
        for k, v in moved["model"].items():
            torch.testing.assert_close(again["model"][k], v, rtol=0, atol=0, msg=f"after the load: {k}")
        plain = copy.deepcopy(fresh)
        for p in plain.parameters():
            p.data.zero_()
        assert load_into_model(plain, tmp_path / "ckpt") == STEPS
        for k, v in plain.state_dict().items():
            torch.testing.assert_close(v, state["model"][k], rtol=0, atol=0, msg=k)

        report = prog.report()
        assert isinstance(report, RunReport) and len(report.ranks) == 1
        assert len(report.ranks[0].step_seconds) >= STEPS and "rank" in str(report)


def _partitioned_eval(rank: int, world: int) -> dict[str, Any]:
    case = models.gnn(seed=0)
    prog = autopar.compile(case.model, f"1x{world}xcpu", case.example_inputs, case.example_target, case.loss_fn,
                           ADAM, graph_options={"mode": "partition"})
    prog.step(*case.example_inputs, target=case.example_target)
    return {"eval": prog.eval_step(*case.example_inputs), "model": prog.state_dict()["model"],
            "owned": prog.part.owned.numel(), "kind": type(prog).__name__}


def test_a_partitioned_graph_program_evaluates_every_node_split_across_ranks() -> None:
    """Each rank computes its own nodes (halo exchange), the rows are gathered in node order: the full output."""
    results = spawn_local(_partitioned_eval, 2, timeout_s=120)
    case = models.gnn(seed=0)
    case.model.load_state_dict(results[0]["model"])
    with torch.no_grad():
        expected = case.model(*case.example_inputs)
    n = case.example_inputs[0].shape[0]
    assert [r["kind"] for r in results] == ["GraphProgram"] * 2
    assert sum(r["owned"] for r in results) == n and all(0 < r["owned"] < n for r in results)  # split
    for r in results:
        torch.testing.assert_close(r["eval"], expected, rtol=1e-5, atol=1e-6)


def _rerouting(rank: int, world: int) -> dict[str, Any]:
    case = models.gpt(seed=0, layers=2, batch=4)
    prog = autopar.compile(case.model, f"1x{world}xcpu", case.example_inputs, case.example_target, case.loss_fn,
                           ADAM, plan=autopar.Strategy(dp=world), reroute=True)
    losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(STEPS)]
    return {"kind": type(prog).__name__, "protocol": isinstance(prog, TrainingProgram), "losses": losses,
            "step_count": prog.step_count,
            "eval": prog.eval_step(*case.example_inputs).detach(), "state": prog.state_dict()["model"],
            "report_ranks": len(prog.report().ranks), "plan": prog.plan.to_json()}


def test_the_rerouting_wrapper_forwards_the_protocol() -> None:
    results = spawn_local(_rerouting, 2, timeout_s=120)
    case = models.gpt(seed=0, layers=2, batch=4)
    case.model.load_state_dict(results[0]["state"])
    with torch.no_grad():
        expected = case.model(*case.example_inputs)
    for r in results:
        assert r["kind"] == "ReroutingProgram" and r["protocol"] and r["report_ranks"] == 2
        assert r["step_count"] == STEPS
        torch.testing.assert_close(r["eval"], expected, rtol=1e-5, atol=1e-6)
    assert results[0]["losses"] == results[1]["losses"] and results[0]["plan"] == results[1]["plan"]
