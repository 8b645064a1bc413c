"""What autopar keeps at module level stays bounded in a long-lived process (a notebook, the suite's kept
worker processes): the intra-op answers are a bounded LRU, and an expert-parallel program's op contexts (which
hold its expert modules) go when the program goes."""

from __future__ import annotations

import gc

import pytest

from autopar.ir.lowered import PipelineLayout, StageLayout
from autopar.lowering import make_layout
from autopar.models import moe_gpt
from autopar.runtime import expert_parallel
from autopar.solver.intra_op import ilp


def test_intra_op_answers_are_a_bounded_lru(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ilp, "CACHE", type(ilp.CACHE)())
    monkeypatch.setattr(ilp, "CACHE_ENTRIES", 3)
    computed: list[int] = []

    def answer(k: int) -> int:
        computed.append(k)
        return k * 10

    for k in (1, 2, 3):
        assert ilp.cached((k,), lambda k=k: answer(k)) == k * 10
    assert ilp.cached((1,), lambda: answer(-1)) == 10  # a hit: 1 becomes the most recently used
    ilp.cached((4,), lambda: answer(4))  # evicts 2, the least recently used
    assert list(ilp.CACHE) == [(3,), (1,), (4,)]
    assert computed == [1, 2, 3, 4]


def test_expert_contexts_go_with_their_runtime() -> None:
    case = moe_gpt(layers=2)
    num_layers = 4  # any chain: the runtime reads the replicas and their expert groups, not the layers
    pipes = [PipelineLayout(i, (StageLayout((0, num_layers), (i,)),), 2 * i, 2, 1) for i in range(2)]
    layout = make_layout(pipes, 2, 4, num_layers, ep=2)
    before = set(expert_parallel._CONTEXTS)
    runtime = expert_parallel.ExpertRuntime(case.model, layout, rank=0)
    runtime.bind({})
    added = set(expert_parallel._CONTEXTS) - before
    assert added and added == set(runtime.keys.values())
    del runtime
    gc.collect()
    assert not set(expert_parallel._CONTEXTS) & added
