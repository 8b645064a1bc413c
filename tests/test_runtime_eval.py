"""`Program.eval_step` returns the model's full output on every rank: equal to the eager model's output
with the same parameters, before training and after 3 steps (compared with the reference's training)."""

from __future__ import annotations

import pytest
import torch

from autopar.runtime.launch import spawn_local

from .runtime_cases import assert_work_split, build, reference_eval, run_eval_cases

RTOL, ATOL = 1e-4, 1e-5

CASES_4 = [
    ("gpt", {"layers": 4, "batch": 8}, {"dp": 4, "batch_split": [4, 2, 1, 1], "m": 2}),  # DP, uneven shares
    ("gpt", {"layers": 4, "batch": 8}, {"pp": 4, "m": 4, "schedule": "1f1b"}),
    ("hf_gpt2", {"layers": 2, "batch": 4}, {"tp": 2, "dp": 2}),
    ("gpt", {"layers": 4, "batch": 8}, {"pp": 2, "dp": 2, "m": 2, "schedule": "interleaved_1f1b", "chunks": 2}),
    # DP x TP x PP: replica 0 runs the whole model tensor-parallel on ranks 0-1, replica 1 is a 2-stage
    # 1F1B pipeline on ranks 2-3 with a smaller batch share
    ("gpt", {"layers": 4, "batch": 8}, {"pipelines": [{"batch": 5, "m": 2, "stages": [(4, (0, 1))]},
                                                      {"batch": 3, "m": 3, "stages": [(1, (2,)), (3, (3,))]}]}),
]


@pytest.fixture(scope="module")
def results_4() -> list:
    pytest.importorskip("transformers")
    return spawn_local(run_eval_cases, 4, CASES_4, timeout_s=240)


@pytest.mark.parametrize("index", range(len(CASES_4)), ids=[f"{c[0]}-{c[2]}" for c in CASES_4])
def test_eval_output_matches_eager_model(results_4: list, index: int) -> None:
    name, kwargs, _ = CASES_4[index]
    ref_before, ref_losses, ref_after = reference_eval(name, kwargs)
    assert not torch.allclose(ref_before, ref_after, rtol=RTOL, atol=ATOL)  # training changed the output
    for rank, (before, losses, after, _) in enumerate(r[index] for r in results_4):
        torch.testing.assert_close(before, ref_before, rtol=RTOL, atol=ATOL, msg=f"rank {rank} before training")
        assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL), f"rank {rank} losses"
        torch.testing.assert_close(after, ref_after, rtol=RTOL, atol=ATOL, msg=f"rank {rank} after 3 steps")


def fallback_eval(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    from torch import nn

    from autopar.compiler import compile

    from .fallback_model import build

    model, x, y = build()
    with pytest.warns(UserWarning, match="replicated"):
        prog = compile(model, "1x1xA100-80GB+1x1xT4", example_inputs=(x,), example_target=y,
                       loss_fn=nn.functional.cross_entropy, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert prog.shares[0] != prog.shares[1]  # uneven replicas
    before = prog.eval_step(x)
    for _ in range(3):
        prog.step(x, target=y)
    return before, prog.eval_step(x)


@pytest.mark.parametrize("index", range(len(CASES_4)), ids=[f"{c[0]}-{c[2]}" for c in CASES_4])
def test_eval_cases_split_the_work(results_4: list, index: int) -> None:
    name, kwargs, spec = CASES_4[index]
    full = build(name, **kwargs).model.state_dict()
    assert_work_split([r[index][3] for r in results_4], spec, kwargs["batch"], full)


def test_replicated_fallback_eval_matches_eager_model() -> None:
    from torch import nn

    from .fallback_model import build

    results = spawn_local(fallback_eval, 2, timeout_s=120)
    model, x, y = build()
    with torch.no_grad():
        ref_before = model(x)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        ref_after = model(x)
    for rank, (before, after) in enumerate(results):
        torch.testing.assert_close(before, ref_before, rtol=RTOL, atol=ATOL, msg=f"rank {rank} before training")
        torch.testing.assert_close(after, ref_after, rtol=RTOL, atol=ATOL, msg=f"rank {rank} after 3 steps")


def test_eval_step_errors_name_the_problem() -> None:
    from torch import nn

    from autopar.errors import PlanError

    from .runtime_cases import compile_case

    case, prog = compile_case("mlp", {"batch": 8}, {}, 0, 1)
    torch.testing.assert_close(prog.eval_step(*case.example_inputs), case.model(*case.example_inputs),
                               rtol=RTOL, atol=ATOL)
    with pytest.raises(PlanError, match="global batch of 8 samples"):
        prog.eval_step(case.example_inputs[0][:4])

    class SelfLoss(nn.Module):  # returns its own loss: there is no separate model output to evaluate
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).square().mean()

    import autopar
    from autopar.runtime.program import Program

    from .runtime_cases import plan_for

    x = torch.randn(4, 4)
    model = SelfLoss()
    g = autopar.capture(model, (x,))
    prog = Program(model, plan_for(g, 1, {}), (x,), None, None,
                   "sgd", 0, 1, graph=g)
    with pytest.raises(PlanError, match="computes its own loss"):
        prog.eval_step(x)
