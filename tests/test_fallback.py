"""Models that cannot be captured name the line and still train, replicated, exactly like one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.compiler import compile
from autopar.errors import CaptureError
from autopar.runtime.launch import spawn_local

from .fallback_model import Picky, broken_capture, build, given_plan, refuse, train


def _reference() -> tuple[list[float], dict]:
    model, x, y = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(x), y)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses, model.state_dict()


def test_uncapturable_model_trains_replicated_on_mixed_devices() -> None:
    results = spawn_local(train, 2, "1x1xA100-80GB+1x1xT4", timeout_s=120)
    ref_losses, ref_params = _reference()
    for losses, params, shares in results:
        assert shares[0] > shares[1] and sum(shares) == 12  # the faster device takes more samples
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        for k, v in ref_params.items():
            torch.testing.assert_close(params[k], v, rtol=1e-4, atol=1e-5)


def test_fallback_can_be_refused() -> None:
    model, x, y = build()
    with pytest.raises(CaptureError, match="if h.mean"):
        compile(model, "1x1xcpu", example_inputs=(x,), example_target=y, loss_fn=nn.functional.cross_entropy,
                fallback=False)


@pytest.mark.parametrize("given", [False, True], ids=["planned", "given-plan"])
def test_every_rank_raises_the_capture_error_when_fallback_is_refused(given: bool) -> None:
    """Every rank raises the same error instead of waiting for a plan or a peer that never comes: where autopar
    plans, rank 0 captures the global batch and sends the others its outcome; with a given plan each captures
    only its micro-batch size and the ranks share their outcomes (compiler.capture_model)."""
    messages = spawn_local(refuse, 2, "1x2xcpu", given_plan(2) if given else None, timeout_s=60)
    assert all("if h.mean" in m for m in messages), messages
    assert messages[0] == messages[1]


def test_a_capture_that_fails_on_one_rank_only_fails_on_every_rank() -> None:
    """Ranks of a given plan capture their own micro-batch sizes (11 and 1 samples here): the rank whose size
    can be captured is sent its peer's CaptureError and raises it too, instead of building a program whose
    collectives its peer never joins."""
    messages = spawn_local(refuse, 2, "1x2xcpu", given_plan(2, [11, 1]), Picky, timeout_s=60)
    assert all("no batch of one sample" in m for m in messages), messages


def test_a_failure_of_rank_0s_capture_reaches_every_rank() -> None:
    """Where autopar plans only rank 0 captures the global batch: any error it meets there (here a ValueError,
    a stand-in for a bug past torch.export) reaches the other ranks, named, instead of leaving them waiting for
    a plan until the timeout."""
    messages = spawn_local(broken_capture, 2, timeout_s=60)
    assert messages[0] == "ValueError: boom", messages
    assert messages[1] == "AutoparError: rank 0 failed to capture the model: ValueError('boom')", messages
