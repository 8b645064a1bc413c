"""A model torch.export cannot capture: it branches on a tensor value."""

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


def build() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return Branchy(), torch.randn(12, 8), torch.randint(0, 4, (12,))


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


def refuse(rank: int, world: int, cluster: str) -> str:
    """compile(..., fallback=False) on every rank: the CaptureError each rank raises."""
    from autopar.compiler import compile
    from autopar.errors import CaptureError

    model, x, y = build()
    try:
        compile(model, cluster, example_inputs=(x,), example_target=y, loss_fn=nn.functional.cross_entropy,
                fallback=False)
    except CaptureError as e:
        return str(e)
    return "compiled"
