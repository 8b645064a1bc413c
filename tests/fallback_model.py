"""Models torch.export cannot capture: one branches on a tensor value, one refuses a batch of one sample."""

from __future__ import annotations

import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if h.mean() > 0:  # data-dependent control flow
            h = h * 2
        return self.b(h)


class Picky(Branchy):
    """Captured at every batch size but one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            raise ValueError("Picky takes no batch of one sample")
        return self.b(torch.relu(self.a(x)))


def build(model: type = Branchy) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return model(), torch.randn(12, 8), torch.randint(0, 4, (12,))


def train(rank: int, world: int, cluster: str) -> tuple[list[float], dict]:
    import warnings

    from autopar.compiler import compile

    model, x, y = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prog = compile(model, cluster, example_inputs=(x,), example_target=y, loss_fn=nn.functional.cross_entropy,
                       optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert any("if h.mean() > 0" in str(w.message) for w in caught), [str(w.message) for w in caught]
    losses = [prog.step(x, target=y) for _ in range(3)]
    return losses, prog.state_dict()["model"], prog.shares


def refuse(rank: int, world: int, cluster: str, plan: str | None = None, model_type: type = Branchy) -> str:
    """compile(..., fallback=False) on every rank (autopar plans, or `plan`, a Plan's JSON): the CaptureError
    each rank raises."""
    from autopar.compiler import compile
    from autopar.errors import CaptureError

    model, x, y = build(model_type)
    try:
        compile(model, cluster, example_inputs=(x,), example_target=y, loss_fn=nn.functional.cross_entropy,
                fallback=False, plan=plan)
    except CaptureError as e:
        return str(e)
    return "compiled"


def given_plan(world: int, batch_split: list[int] | None = None) -> str:
    """A data-parallel Plan for the model (3 layers in its chain: a stand-in, the model cannot be captured)."""
    from autopar.cluster import Cluster
    from autopar.ir.plan import Strategy, plan_from_strategy

    return plan_from_strategy(Strategy(dp=world, batch_split=batch_split), world_size=world, global_batch=12,
                              num_layers=3, first_block=1, num_blocks=1, precision="fp32", optimizer="sgd",
                              cluster=Cluster.load(f"1x{world}xcpu").to_dict(), model={"num_layers": 3}).to_json()


def broken_capture(rank: int, world: int) -> str:
    """compile where autopar plans, rank 0's capture failing with an error that is not a CaptureError (a
    stand-in for a bug past torch.export): the exception each rank raises, named."""
    from autopar import models
    from autopar.compiler import compile
    from autopar.passes.capture import Captures

    def boom(*args: object, **kwargs: object) -> None:
        raise ValueError("boom")

    real = Captures.capture
    if rank == 0:
        Captures.capture = boom  # this rank process only, and put back: the suite's ranks serve later tests
    case = models.CASES["mlp"](seed=0)
    try:
        compile(case.model, "1x2xcpu", case.example_inputs, case.example_target, case.loss_fn)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        Captures.capture = real
    return "compiled"
