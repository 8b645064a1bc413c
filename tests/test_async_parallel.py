"""Delayed updates with tensor parallelism and ZeRO-1 (runtime/asynchronous.py): on gloo ranks, every rank's
losses (step()'s return, the global loss) and final parameters equal the single-process replay of the rule
W[c+1] = W[c] - opt(grad L_c(W[max(0, c-D)])) (tests/test_async.py `delayed_reference`), and the work was
split: tensor-parallel ranks hold shards, ZeRO-1 keeps each parameter's optimizer state on one replica."""

from __future__ import annotations

import math

import pytest
import torch

from autopar.runtime.launch import spawn_local
from autopar.runtime.memtrace import tensor_bytes
from autopar.solver.asynchronous import delay_of
from tests.runtime_cases import assert_matches_reference, assert_work_split, build, work_of
from tests.test_async import WAVES, _compile, delayed_reference

# (model, kwargs, plan spec for tests.runtime_cases.plan_for, sync, staleness)
CASES_2 = [
    ("gpt", {}, {"tp": 2}, "2bw", None),  # one tensor-parallel stage: single-copy DTensor gradients
    ("gpt", {}, {"dp": 2, "m": 2, "zero": 1}, "wsp", 2),  # ZeRO-1: owners step and broadcast at the update
]
CASES_4 = [
    ("gpt", {}, {"dp": 2, "tp": 2, "zero": 1}, "wsp", 1),  # replicas of a tp stage (full-gradient reduction)
]


def run_parallel_cases(rank: int, world: int, cases: list) -> list:
    """Worker body: per case, the global losses step() returned, the final full state (flushed), what this
    rank was given (`work_of`) and the bytes of optimizer state it holds."""
    out = []
    for name, kwargs, spec, sync, staleness in cases:
        case, prog = _compile(name, kwargs, spec, sync, staleness, rank, world)
        losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(WAVES)]
        opt = prog.optimizer
        opt_bytes = tensor_bytes(v for st in (opt.state.values() if opt else ()) for v in st.values()
                                 if isinstance(v, torch.Tensor) and v.dim() > 0)
        work = work_of(prog)
        out.append((losses, prog.state_dict()["model"], work, opt_bytes, prog.in_flight))
    return out


@pytest.fixture(scope="module")
def results_2() -> list:
    return spawn_local(run_parallel_cases, 2, CASES_2, timeout_s=300)


@pytest.fixture(scope="module")
def results_4() -> list:
    return spawn_local(run_parallel_cases, 4, CASES_4, timeout_s=400)


def _check(results: list, cases: list, index: int) -> None:
    name, kwargs, spec, sync, staleness = cases[index]
    ref_losses, ref_params = delayed_reference(build(name, **kwargs), delay_of(sync, staleness))
    for rank, per_rank in enumerate(results):
        losses, params, _, _, in_flight = per_rank[index]
        assert in_flight == 0, "state_dict() flushed every pending update"
        assert_matches_reference(losses, params, ref_losses, ref_params, f"{name} {spec} {sync} rank {rank}")
    full = build(name, **kwargs).model.state_dict()
    assert_work_split([r[index][2] for r in results], spec, build(name, **kwargs).example_inputs[0].shape[0], full)
    if spec.get("zero"):  # AdamW's two fp32 moments of every parameter held, once over the replicas
        tp = spec.get("tp", 1)  # Megatron rank order: the replicas of tensor-parallel index i are ranks i, i + tp..
        for i in range(tp):
            ranks = results[i::tp]
            state = 8 * sum(math.prod(shape) for shape in ranks[0][index][2]["params"].values())
            held = [r[index][3] for r in ranks]
            assert sum(held) == state and all(0 < h < state for h in held), (i, held, state)


@pytest.mark.parametrize("index", range(len(CASES_2)))
def test_two_ranks_match_the_replayed_rule(results_2: list, index: int) -> None:
    _check(results_2, CASES_2, index)


@pytest.mark.parametrize("index", range(len(CASES_4)))
def test_four_ranks_match_the_replayed_rule(results_4: list, index: int) -> None:
    _check(results_4, CASES_4, index)
