"""`Captures` (passes/capture.py): a model's captures, each made once. A program built again for the same model
(a re-route's, a re-plan's, a shed share's; every rank's program in a device audit) takes its micro-batch
captures from the memo instead of exporting the model again, and trains exactly as one built from fresh
captures. Exports are counted at torch's entry point (`torch.export.export`), not by the memo."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from autopar.cluster import Cluster
from autopar.passes.capture import Captures, capture
from autopar.runtime.audit import audit_devices
from autopar.runtime.launch import spawn_local
from autopar.runtime.program import Program

from .runtime_cases import STEPS, build, optimizer, plan_for


@pytest.fixture
def exports(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The batch shapes of every `torch.export.export` call, as they happen."""
    calls: list[tuple] = []
    real = torch.export.export

    def counted(mod: Any, args: tuple, *a: Any, **k: Any) -> Any:
        calls.append(tuple(tuple(x.shape) for x in args if isinstance(x, torch.Tensor)))
        return real(mod, args, *a, **k)

    monkeypatch.setattr(torch.export, "export", counted)
    return calls


def test_a_batch_is_captured_once_and_each_shape_on_its_own(exports: list) -> None:
    case = build("gpt", layers=2, batch=4)
    memo = Captures()
    half = tuple(x[:2] for x in case.example_inputs), case.example_target[:2]
    g = memo.capture(case.model, case.example_inputs, case.loss_fn, case.example_target, sources=False)
    assert memo.capture(case.model, case.example_inputs, case.loss_fn, case.example_target, sources=False) is g
    h = memo.capture(case.model, half[0], case.loss_fn, half[1], sources=False)
    assert len(exports) == 2 and len(memo) == 2
    assert (g.batch_size, h.batch_size) == (4, 2)
    # the same batch with source lines is another capture (its nodes name the user's lines)
    assert memo.capture(case.model, case.example_inputs, case.loss_fn, case.example_target) is not g
    fresh = capture(case.model, half[0], case.loss_fn, half[1], sources=False)
    assert [(n.target, [t.shape for t in n.outputs]) for n in h.nodes.values()] == \
        [(n.target, [t.shape for t in n.outputs]) for n in fresh.nodes.values()]


@dataclasses.dataclass
class _Loss:  # compares by value, so it cannot be hashed
    scale: float = 1.0

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.scale * torch.nn.functional.cross_entropy(out.flatten(0, -2), target.flatten())


def test_a_loss_function_that_cannot_be_hashed_is_kept_by_identity(exports: list) -> None:
    case = build("gpt", layers=2, batch=4)
    memo, loss = Captures(), _Loss()
    g = memo.capture(case.model, case.example_inputs, loss, case.example_target, sources=False)
    assert memo.capture(case.model, case.example_inputs, loss, case.example_target, sources=False) is g
    assert memo.capture(case.model, case.example_inputs, _Loss(2.0), case.example_target, sources=False) is not g
    assert len(exports) == 2


def _train(prog: Program, case: Any) -> tuple[list[float], dict]:
    losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(STEPS)]
    return losses, prog.state_dict()["model"]


def test_a_program_built_again_captures_nothing_and_trains_the_same(exports: list) -> None:
    """Micro-batches of 3, 3 and 2 (two sizes besides the global batch): the first program exports the model at
    both micro-batch sizes, the one built again from the same memo exports nothing, and both train the one
    model to the same losses and parameters as a program built without a memo."""
    spec = {"m": 3}
    kwargs = dict(layers=2, batch=8)
    case = build("gpt", **kwargs)
    memo = Captures()
    g = memo.capture(case.model, case.example_inputs, case.loss_fn, case.example_target, sources=False)
    plan = plan_for(g, 1, spec)
    assert sorted(set(plan.pipelines[0].microbatch_sizes())) == [2, 3]
    runs = []
    for shared in (memo, memo, None):
        case = build("gpt", **kwargs)
        before = len(exports)
        prog = Program(case.model, plan, case.example_inputs, case.example_target, case.loss_fn, optimizer, 0, 1,
                       graph=g, captures=shared)
        runs.append((len(exports) - before, _train(prog, case)))
    assert [n for n, _ in runs] == [2, 0, 2]
    first_losses, first = runs[2][1]
    for _, (losses, params) in runs[:2]:
        assert losses == first_losses
        for k, v in first.items():
            assert torch.equal(params[k], v), k


def test_the_device_audit_captures_each_size_once(exports: list) -> None:
    """Four ranks (dp 2 x pp 2, two micro-batches each): the audit exports the model at the global batch and
    at the one micro-batch size, not once per rank."""
    case = build("gpt")
    g = capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    plan = plan_for(g, 4, {"dp": 2, "pp": 2, "m": 2})
    plan.cluster = Cluster.load("1x4xA100-80GB").to_dict()
    before = len(exports)
    report = audit_devices(case.model, plan, case.example_inputs, case.example_target, case.loss_fn)
    assert report.ok, report.text()
    batch = case.example_inputs[0].shape[0]
    assert sorted(shapes[0][0] for shapes in exports[before:]) == [batch // 4, batch]


def compile_counting(rank: int, world: int, plan: str | None, reroute: bool = False) -> list:
    """compile on 2 ranks: the batch sizes this rank's `torch.export.export` calls were made on, then its
    training losses and final parameters. `plan`: a Plan's JSON, or None for a hand-written Strategy (priced on
    rank 0, which sends its plan)."""
    import autopar
    from autopar.compiler import compile

    calls: list[int] = []
    real = torch.export.export

    def counted(mod: Any, args: tuple, *a: Any, **k: Any) -> Any:
        calls.append(next(x.shape[0] for x in args if isinstance(x, torch.Tensor)))
        return real(mod, args, *a, **k)

    torch.export.export = counted
    try:
        case = build("gpt", layers=2, batch=8)
        prog = compile(case.model, "1x2xcpu", case.example_inputs, case.example_target, case.loss_fn, optimizer,
                       plan=plan if plan is not None else autopar.Strategy(dp=2, microbatch_size=2), reroute=reroute)
    finally:
        torch.export.export = real
    return [calls, *_train(prog, case)]


@pytest.mark.parametrize("given", ["strategy", "strategy-rerouted", "plan"])
def test_the_global_batch_is_captured_only_where_it_is_priced(given: str) -> None:
    """dp 2, two micro-batches of 2 per replica. A Strategy: rank 0 captures the global batch (8) and prices
    the plan from it, and each rank captures its micro-batch size (2); with re-routing on, rank 1 captures the
    global batch too (whichever rank prices a re-routed plan after a loss has it). A given Plan: each rank
    captures only its micro-batch size and lowers with that capture. Every rank trains as one process does."""
    from .runtime_cases import assert_matches_reference, reference

    plan = None
    if given == "plan":
        case = build("gpt", layers=2, batch=8)
        plan = plan_for(capture(case.model, case.example_inputs, case.loss_fn, case.example_target), 2,
                        {"dp": 2, "m": 2}).to_json()
    results = spawn_local(compile_counting, 2, plan, given == "strategy-rerouted", timeout_s=120)
    expected = {"strategy": [[2, 8], [2]], "strategy-rerouted": [[2, 8], [2, 8]], "plan": [[2], [2]]}[given]
    assert [sorted(calls) for calls, _, _ in results] == expected
    ref_losses, ref_params = reference("gpt", dict(layers=2, batch=8))
    for rank, (_, losses, params) in enumerate(results):
        assert_matches_reference(losses, params, ref_losses, ref_params, f"rank {rank}")
