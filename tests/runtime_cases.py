"""Shared by the multi-process runtime tests: build a case, train it in parallel or as a reference."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from autopar import models
from autopar.runtime.layout import Layout, make_layout, megatron_layout
from autopar.runtime.program import Program

STEPS = 3
LR = 1e-3


def build(name: str, **kwargs: Any) -> models.ModelCase:
    return models.CASES[name](seed=0, **kwargs)


def optimizer(params: list) -> torch.optim.Optimizer:
    # eps=1e-6 rather than 1e-8: Adam's normalized update turns fp32 reduction-order noise in entries
    # whose gradient is ~0 into lr-sized differences; a larger eps keeps the comparison about the math.
    return torch.optim.AdamW(params, lr=LR, eps=1e-6)


def reference(name: str, kwargs: dict, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training of the original model: per-step losses and final parameters."""
    return models.train_reference(build(name, **kwargs), optimizer, steps)


def layout_for(case: models.ModelCase, graph_layers: int, blocks: int, world: int, spec: dict) -> Layout:
    batch = case.example_inputs[0].shape[0]
    lay = megatron_layout(spec.get("dp", 1), spec.get("tp", 1), spec.get("pp", 1), batch, graph_layers,
                          blocks, spec.get("m", 1), spec.get("schedule", "1f1b"),
                          layer_split=spec.get("layer_split"), batch_split=spec.get("batch_split"),
                          zero=spec.get("zero", 0),
                          recompute=spec.get("recompute", False), chunks=spec.get("chunks", 1))
    if spec.get("offload"):  # CPU offload kinds for every stage
        pipes = [replace(p, stages=tuple(replace(st, offload=tuple(spec["offload"])) for st in p.stages))
                 for p in lay.pipelines]
        lay = make_layout(pipes, lay.world_size, lay.global_batch, graph_layers)
    return lay


def run_cases(rank: int, world: int, cases: list[tuple[str, dict, dict]]) -> list[tuple[list[float], dict]]:
    """Worker body: train every case on this process group; return losses and the full final state."""
    import autopar

    out = []
    for name, kwargs, spec in cases:
        case = build(name, **kwargs)
        g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
        blocks = sum(1 for layer in g.layers if layer.kind == "block")
        lay = layout_for(case, len(g.layers), blocks, world, spec)
        prog = Program(case.model, lay, case.example_inputs, case.example_target, case.loss_fn, optimizer,
                       rank, world, timeout_s=60, kernels=spec.get("kernels", "auto"))
        losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(STEPS)]
        out.append((losses, prog.state_dict()["model"]))
    return out
