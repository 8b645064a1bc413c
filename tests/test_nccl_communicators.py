"""The NCCL buffer reserve counts the communicators a process creates: one per process group it joins (the
world, its tensor-parallel group, its data-parallel replicas) and one per pipeline peer it sends to or
receives from (torch.distributed's point-to-point communicators are 2-rank ones, keyed by the pair).

The count comes from the lowering (`lowering.plan_communicators`), the same groups and peers the runtime
makes (runtime/program.py `Groups`, `_peer`, `_peers`); the planner's search counts a config the same way.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

import autopar
from autopar.api import cost_model
from autopar.cost_models.memory import (
    CUBLAS_WORKSPACE_BYTES,
    CUDA_CONTEXT_BYTES,
    NCCL_BUFFSIZE,
    NCCL_COMMUNICATOR_BYTES,
)
from autopar.lowering import layout_of, plan_communicators
from autopar.runtime.program import Program
from autopar.solver.search.search import config_communicators

from .runtime_cases import build

MIB = 2**20
CLUSTER = "1x4xA100-80GB"


def _estimate(strategy: autopar.Strategy, reserve: float = 0.1) -> autopar.plan.Estimate:
    case = build("gpt", layers=4, batch=4)
    return autopar.estimate(case.model, CLUSTER, strategy, case.example_inputs, case.example_target, case.loss_fn,
                            precision="fp32", memory_reserve=reserve)


def _cm() -> object:
    case = build("gpt", layers=4, batch=4)
    return cost_model(case.model, CLUSTER, case.example_inputs, case.example_target, case.loss_fn,
                      precision="fp32")


def test_two_stages_of_tp2_hold_world_tp_group_and_one_peer() -> None:
    plan = _estimate(autopar.Strategy(tp=2, pp=2, microbatch_size=2)).plan
    cm = _cm()
    sets = plan_communicators(plan, cm.graph)
    stage0 = plan.pipelines[0].stages[0].devices
    r = stage0[0]
    peer = plan.pipelines[0].stages[1].devices[0]
    assert sets[r] == tuple(sorted({(0, 1, 2, 3), tuple(sorted(stage0)), tuple(sorted((r, peer)))}))
    assert cm.communicators(plan) == {0: 3, 1: 3, 2: 3, 3: 3}
    assert NCCL_COMMUNICATOR_BYTES == NCCL_BUFFSIZE * 3 * 2 * 8 == 192 * MIB
    held = CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + 3 * NCCL_COMMUNICATOR_BYTES
    assert cm.runtime_reserve(0, 3) == held
    assert cm.usable(0, 3) == pytest.approx(0.9 * cm.cluster.devices[0].spec.memory - held, abs=1)


@pytest.mark.parametrize("strategy", [dict(tp=2, pp=2, microbatch_size=2), dict(dp=2, pp=2, microbatch_size=2),
                                      dict(pp=4, microbatch_size=1), dict(dp=4), dict(tp=4),
                                      dict(dp=2, pp=2, microbatch_size=1, schedule="interleaved_1f1b")])
def test_counted_peers_are_the_runtimes(strategy: dict) -> None:
    plan = _estimate(autopar.Strategy(**strategy)).plan
    cm = _cm()
    layout = layout_of(plan, len(cm.graph.layers))
    sets = plan_communicators(plan, cm.graph)
    for rank in range(layout.world_size):
        pos = layout.position(rank)
        fake = SimpleNamespace(pipeline=layout.pipelines[pos.pipeline], position=pos)
        peers = set()
        for s in pos.stages:
            for nb in (s - 1, s + 1):
                if 0 <= nb < len(fake.pipeline.stages):
                    peers |= {Program._peer(fake, nb), *Program._peers(fake, nb)}
        pairs = {tuple(sorted((rank, q))) for q in peers - {rank}}
        groups = {g for g in sets[rank] if len(g) > 2 or g not in pairs}
        assert pairs <= set(sets[rank]), f"rank {rank}: the runtime's peers {pairs} are not all counted"
        assert len(sets[rank]) == len(pairs | groups)
    # the search's count of the same config equals the plan's
    pipes = tuple(tuple(tuple(st.ranks) for st in p.stages[: p.num_groups]) for p in layout.pipelines)
    dp = [tuple(p[r][0] for p in pipes) for r in range(len(pipes[0]))]
    assert config_communicators(pipes, dp, plan.chunks, layout.world_size) == cm.communicators(plan)


def test_price_charges_every_communicator() -> None:
    """A plan that fits with one communicator's buffers (or the 256 MiB a process was charged before) but not
    with its three is priced as not fitting, and the problem says how many the reserve counts."""
    strategy = autopar.Strategy(tp=2, pp=2, microbatch_size=2)
    first = _estimate(strategy)
    peak = max(first.predicted["peak_memory_bytes"].values())
    cap = 80 * 2**30
    spare = 400 * MIB  # over one communicator's 192 MiB and the old flat 256 MiB, under three's 576 MiB
    reserve = 1 - (peak + CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + spare) / cap
    est = _estimate(strategy, reserve)
    assert not est.fits
    assert any("3 communicator(s)" in p for p in est.predicted["memory_problems"])


def test_one_cost_model_counts_each_plan_by_its_own_groups() -> None:
    """`CostModel.communicators` memoises by which devices hold which layers: plans over the same layer ranges
    on other devices each get their own count, as from the lowering (here one pipeline of two stages, its
    second stage on device 1, 2 or 3 while the others idle)."""
    cm = _cm()
    base = _estimate(autopar.Strategy(dp=2, pp=2, microbatch_size=2)).plan
    first = base.pipelines[0]
    counts = []
    for device in (1, 2, 3):
        stages = [replace(first.stages[0], devices=[0]), replace(first.stages[1], devices=[device])]
        plan = replace(base, pipelines=[replace(first, batch_share=base.global_batch, stages=stages)])
        expected = {d: len(sets) for d, sets in plan_communicators(plan, cm.graph).items()}
        assert cm.communicators(plan) == expected, device
        counts.append(expected)
    assert counts[0] != counts[1] != counts[2]  # the three plans differ, so a shared count would be wrong
