"""Batch normalization under a split batch: autopar warns, naming the modules, and says how to keep the
math; with one replica and one micro-batch it trains exactly like one process (passes/batch_stats.py)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import autopar
from autopar import Strategy
from autopar.passes.batch_stats import BatchStatisticsWarning, batch_statistics_modules
from autopar.runtime.launch import spawn_local

from .runtime_cases import STEPS, assert_matches_reference, optimizer


def bn_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    # convolutions without bias, as usual before batch norm: a bias there gets an exactly-zero gradient, whose
    # rounding noise Adam would turn into lr-sized steps
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    x = torch.randn(8, 3, 8, 8)
    y = torch.randint(0, 4, (8,))
    return model, x, y


def _reference() -> tuple[list[float], dict]:
    model, x, y = bn_case()
    opt = optimizer(list(model.parameters()))
    losses = []
    for _ in range(STEPS):
        loss = nn.functional.cross_entropy(model(x), y)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(strategy: Strategy, cluster: str) -> tuple[list[float], dict, list[str]]:
    model, x, y = bn_case()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prog = autopar.compile(model, cluster, (x,), y, nn.functional.cross_entropy, optimizer, plan=strategy,
                               timeout_s=60)
    losses = [prog.step(x, target=y) for _ in range(STEPS)]
    said = [str(w.message) for w in caught if issubclass(w.category, BatchStatisticsWarning)]
    return losses, prog.state_dict()["model"], said


def run_dp2(rank: int, world: int) -> tuple:
    return _train(Strategy(dp=2), "1x2xcpu")


def run_whole_batch(rank: int, world: int) -> tuple:
    return _train(Strategy(dp=1, pp=1, microbatch_size=8), "1x1xcpu")


def test_batch_norm_modules_are_found() -> None:
    model, _, _ = bn_case()
    assert batch_statistics_modules(model) == ["1", "4"]
    model.eval()
    assert batch_statistics_modules(model) == []  # running statistics: per-sample math


def test_data_parallel_batch_norm_warns_and_the_math_differs() -> None:
    results = spawn_local(run_dp2, 2, timeout_s=180)
    ref_losses, _ = _reference()
    said = results[0][2]
    assert len(said) == 1 and "1 (BatchNorm2d), 4 (BatchNorm2d)" in said[0], said
    assert "2 pieces" in said[0] and "GroupNorm" in said[0], said
    assert "microbatch_size=8" in said[0]
    assert results[1][2] == []  # one warning per job, from rank 0
    # the warning is not a false alarm: the per-replica statistics change the losses
    assert abs(results[0][0][1] - ref_losses[1]) > 1e-6


def test_whole_batch_plan_is_exact_and_silent() -> None:
    results = spawn_local(run_whole_batch, 1, timeout_s=120)
    losses, params, said = results[0]
    assert said == []
    ref_losses, ref_params = _reference()
    assert_matches_reference(losses, {k: v for k, v in params.items() if k in ref_params}, ref_losses,
                             ref_params, "dp=1 batch norm")


def test_micro_batches_alone_also_warn() -> None:
    results = spawn_local(_micro, 1, timeout_s=120)
    assert results[0] and "2 pieces" in results[0][0]


def _micro(rank: int, world: int) -> list[str]:
    return _train(Strategy(dp=1, pp=1, microbatch_size=4), "1x1xcpu")[2]
