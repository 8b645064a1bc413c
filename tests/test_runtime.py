"""Generated programs on several gloo processes train exactly like one process (fp32, 3 AdamW steps)."""

from __future__ import annotations

import pytest
import torch

from autopar.runtime.launch import spawn_local

from .runtime_cases import reference, run_cases

RTOL, ATOL = 1e-4, 1e-5

# (model, model kwargs, strategy) — all on 4 ranks, one process group for the whole list
CASES_4 = [
    ("gpt", {"layers": 4, "batch": 8}, {"dp": 4}),
    ("gpt", {"layers": 4, "batch": 8}, {"dp": 4, "batch_split": [4, 2, 1, 1], "m": 2}),
    ("gpt", {"layers": 4, "batch": 8}, {"pp": 4, "m": 4, "schedule": "1f1b"}),
    (
        "gpt",
        {"layers": 4, "batch": 8},
        {"pp": 2, "dp": 2, "m": 2, "schedule": "gpipe", "layer_split": [1, 3]},
    ),
    ("gpt", {"layers": 4, "batch": 8, "tie_embeddings": True}, {"pp": 2, "dp": 2, "m": 2, "recompute": True}),
    ("hf_gpt2", {"layers": 2, "batch": 4}, {"pp": 2, "dp": 2, "m": 2}),
    ("hf_llama", {"layers": 3, "batch": 4}, {"pp": 4, "m": 4, "layer_split": [1, 1, 1, 0]}),
    ("cnn", {"batch": 8}, {"pp": 2, "dp": 2, "m": 2, "schedule": "gpipe"}),
    (
        "gpt",
        {"layers": 4, "batch": 8},
        {"pp": 2, "dp": 2, "m": 2, "schedule": "interleaved_1f1b", "chunks": 2},
    ),
    ("gpt", {"layers": 2, "batch": 4}, {"tp": 2, "dp": 2}),
    ("hf_gpt2", {"layers": 2, "batch": 4}, {"tp": 2, "pp": 2, "m": 2}),
    ("hf_llama", {"layers": 2, "batch": 4}, {"tp": 4}),
    # generated Triton kernels (the interpreter on CPU) inside a pipelined, data-parallel program
    ("gpt", {"layers": 2, "batch": 4, "hidden": 32, "seq": 8}, {"pp": 2, "dp": 2, "m": 1, "kernels": "triton"}),
]


@pytest.fixture(scope="module")
def results_4() -> list:
    pytest.importorskip("transformers")
    return spawn_local(run_cases, 4, CASES_4, timeout_s=240)


@pytest.mark.parametrize("index", range(len(CASES_4)), ids=[f"{c[0]}-{c[2]}" for c in CASES_4])
def test_parallel_training_matches_single_process(results_4: list, index: int) -> None:
    name, kwargs, _ = CASES_4[index]
    ref_losses, ref_params = reference(name, kwargs)
    for rank, per_rank in enumerate(results_4):
        losses, params = per_rank[index]
        assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL), f"rank {rank} losses"
        assert params.keys() == ref_params.keys()
        for k, v in ref_params.items():
            torch.testing.assert_close(params[k], v, rtol=RTOL, atol=ATOL, msg=f"rank {rank} param {k}")
    assert ref_losses[-1] < ref_losses[0]  # the run trains: the loss falls
