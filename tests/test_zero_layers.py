"""ZeRO-2/3 per layer and recompute per block (layered.py, zero_layers.py): as priced, and exact.

One spawn of 2 gloo processes (dp=2) runs every case. Each case trains 3 steps against one process and
records, at every layer hook, the bytes of non-owned parameters resident on the device and of non-owned
gradients held, so the tests can check the granularity the planner prices: one layer at a time.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autopar.lowering import layerwise_params
from autopar.runtime.launch import spawn_local
from autopar.runtime.layered import layer_calls
from autopar.runtime.zero_layers import LayerwiseMemory

from .runtime_cases import STEPS, assert_matches_reference, compile_case, reference

GPT = ("gpt", {"layers": 4, "batch": 8})
CASES: dict[str, tuple[str, dict, dict]] = {
    "zero3": (*GPT, {"dp": 2, "m": 2, "zero": 3}),
    "zero2": (*GPT, {"dp": 2, "m": 2, "zero": 2}),
    "zero3-recompute-gpipe": (*GPT, {"dp": 2, "m": 2, "zero": 3, "recompute": True, "schedule": "gpipe"}),
    "recompute-pp": (*GPT, {"pp": 2, "m": 2, "recompute": True}),
    "recompute-tp": (*GPT, {"tp": 2, "recompute": True}),  # per block through the DTensor interpreter
    "offload-params": (*GPT, {"dp": 2, "m": 2, "offload": ("optimizer", "activations", "params")}),
    "zero2-offload-params": (*GPT, {"dp": 2, "m": 2, "zero": 2, "offload": ("optimizer", "activations", "params")}),
    # uneven shares with different micro-batch counts: holders' schedules differ, so ZeRO stays whole-step
    "zero3-uneven": (*GPT, {"dp": 2, "m": 4, "batch_split": [6, 2], "zero": 3}),
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _watch(prog: Any, trace: list[tuple[int, int]], streamed: bool = False) -> None:
    """Record (resident parameter bytes, held gradient bytes) of the non-owned parameters (or, with
    `streamed`, of the streamed ones) at every layer hook."""
    hooks: LayerwiseMemory | None = prog.layers
    if hooks is None:
        return
    others = [n for n, st in prog.zero.state.items() if (st.streamed if streamed else not st.owned)]

    def sample() -> None:
        ps = [prog.params[n] for n in others]
        trace.append((sum(p.untyped_storage().nbytes() for p in ps),
                      sum(_nbytes(p.grad) for p in ps if p.grad is not None)))

    for name in ("before_forward", "after_forward", "before_backward", "_finish"):
        real = getattr(hooks, name)

        def wrapped(layer: int, real: Any = real) -> None:
            sample()
            real(layer)
            sample()

        setattr(hooks, name, wrapped)


def run_layer_cases(rank: int, world: int) -> dict:
    out: dict[str, Any] = {}
    for cid, (name, kwargs, spec) in CASES.items():
        case, prog = compile_case(name, kwargs, spec, rank, world)
        trace: list[tuple[int, int]] = []
        device_trace: list[tuple[int, int]] = []
        _watch(prog, trace)
        _watch(prog, device_trace, streamed=True)
        losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(STEPS)]
        by_layer: dict[int, int] = {}
        for n, st in prog.zero.state.items():
            if not st.owned and n in prog.zero.layer_reduced:
                layer = prog.layers.layer_of[n]
                by_layer[layer] = by_layer.get(layer, 0) + _nbytes(prog.params[n])
        checkpointed = [[(c.layer, c.checkpointed) for c in layer_calls(st.gm)] for st in prog._stages.values()]
        streamed = [n for n, st in prog.zero.state.items() if st.streamed]
        per_layer: dict[int, int] = {}
        for n in streamed:
            per_layer[prog.layers.layer_of[n]] = per_layer.get(prog.layers.layer_of[n], 0) + _nbytes(prog.params[n])
        out[cid] = {"streamed": sorted(streamed), "largest_streamed": max(per_layer.values(), default=0),
                    "device_trace": device_trace, "losses": losses, "model": prog.state_dict()["model"], "trace": trace,
                    "layerwise": sorted(prog.zero.layer_reduced), "owned": sorted(n for n, st in prog.zero.state.items()
                                                                              if st.owned),
                    "params": sorted(prog.params), "largest_layer": max(by_layer.values(), default=0),
                    "calls": checkpointed, "kinds": [layer.kind for layer in prog.graph.layers]}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn_local(run_layer_cases, 2, timeout_s=240)


@pytest.mark.parametrize("cid", list(CASES))
def test_training_matches_single_process(results: list[dict], cid: str) -> None:
    name, kwargs, _ = CASES[cid]
    ref = reference(name, kwargs)
    for rank, r in enumerate(results):
        assert_matches_reference(r[cid]["losses"], r[cid]["model"], *ref, f"{cid} rank {rank}")


@pytest.mark.parametrize("cid", ["zero3", "zero2", "zero3-recompute-gpipe"])
def test_block_parameters_are_handled_per_layer(results: list[dict], cid: str) -> None:
    for r in results:
        blocks = [n for n in r[cid]["params"] if n.startswith("blocks.")]
        assert blocks and set(blocks) <= set(r[cid]["layerwise"])
    # the work is split: the two ranks own disjoint parameter sets that together are all of them
    a, b = (set(r[cid]["owned"]) for r in results)
    assert a and b and not a & b and a | b == set(results[0][cid]["params"])


@pytest.mark.parametrize("cid", ["zero3", "zero3-recompute-gpipe"])
def test_zero3_holds_one_gathered_layer_at_a_time(results: list[dict], cid: str) -> None:
    for r in results:
        trace, largest = r[cid]["trace"], r[cid]["largest_layer"]
        assert set(r[cid]["layerwise"]) == set(r[cid]["params"])  # no parameter of this GPT is whole-step
        resident = max(p for p, _ in trace)
        assert 0 < resident <= largest, (resident, largest)


@pytest.mark.parametrize("cid", ["zero3", "zero2"])
def test_non_owned_gradients_live_one_layer(results: list[dict], cid: str) -> None:
    for r in results:
        trace, largest = r[cid]["trace"], r[cid]["largest_layer"]
        held = max(g for _, g in trace)
        assert 0 < held <= largest, (held, largest)


@pytest.mark.parametrize("cid", ["recompute-pp", "recompute-tp"])
def test_recompute_is_per_block(results: list[dict], cid: str) -> None:
    for r in results:
        kinds = r[cid]["kinds"]
        for calls in r[cid]["calls"]:
            assert calls, "a recomputed stage runs layer by layer"
            assert all(flag == (kinds[layer] == "block") for layer, flag in calls)


def test_uneven_schedules_keep_whole_step_zero(results: list[dict]) -> None:
    for r in results:
        assert r["zero3-uneven"]["layerwise"] == []


def test_layerwise_selection_needs_identical_holders() -> None:
    import autopar
    from autopar import models

    from .runtime_cases import layout_for

    case = models.CASES["gpt"](seed=0, layers=4, batch=8, tie_embeddings=True)
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    names = {g.canonical(p) for p, info in g.params.items() if not info.is_buffer}
    levels = dict.fromkeys(names, 3)
    even = layout_for(g, 4, {"dp": 2, "pp": 2, "m": 2})
    picked = layerwise_params(g, even, levels)
    assert picked and "wte.weight" not in picked  # the tied embedding is read by two layers
    assert all(n.startswith("blocks.") or n.startswith(("ln_f", "wpe")) for n in picked)
    uneven = layout_for(g, 4, {"dp": 2, "pp": 2, "m": 4, "batch_split": [6, 2]})
    assert layerwise_params(g, uneven, levels) == {}
    assert layerwise_params(g, even, dict.fromkeys(names, 1)) == {}
    assert layerwise_params(g, even, levels, offloaded=set(picked)) == {}


@pytest.mark.parametrize("cid", ["offload-params", "zero2-offload-params"])
def test_offloaded_parameters_stream_one_layer_at_a_time(results: list[dict], cid: str) -> None:
    for r in results:
        assert set(r[cid]["streamed"]) == set(r[cid]["params"])
        on_device = max(p for p, _ in r[cid]["device_trace"])
        assert 0 < on_device <= r[cid]["largest_streamed"], (on_device, r[cid]["largest_streamed"])
