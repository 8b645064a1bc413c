"""Plan-invariant randomness (passes/randomness.py): with dropout on, every plan trains exactly like autopar's
one-device program of the same model and seed: data parallelism with uneven shares, 1F1B and ZB-H1 pipelines,
tensor parallelism, recompute and a mixed plan, on transformers GPT-2 (residual, embedding and attention
dropout) and Llama (attention dropout), losses and every parameter after 3 AdamW steps."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from autopar.passes.randomness import Draws, _uniform_block, draws, keyed_dropout, keyed_randomness, remembering
from autopar.runtime.launch import spawn_local

from .runtime_cases import STEPS, assert_matches_reference, assert_work_split, build, compile_case, run_cases

GPT2 = {"layers": 2, "batch": 8, "dropout": 0.1}
LLAMA = {"layers": 2, "batch": 8, "dropout": 0.1}
CASES = [
    ("hf_gpt2", GPT2, {"dp": 4, "batch_split": [3, 2, 2, 1], "m": 2}),  # uneven shares, micro-batches 2+1, 1+1, 1
    ("hf_gpt2", GPT2, {"pp": 2, "dp": 2, "m": 2, "schedule": "1f1b"}),
    ("hf_gpt2", GPT2, {"pp": 2, "dp": 2, "m": 2, "schedule": "zb_h1"}),
    ("hf_gpt2", GPT2, {"tp": 2, "dp": 2}),
    ("hf_gpt2", GPT2, {"pp": 2, "dp": 2, "m": 4, "recompute": True}),
    ("hf_llama", LLAMA, {"tp": 2, "pp": 2, "m": 2}),
    ("hf_llama", LLAMA, {"pp": 2, "dp": 2, "m": 2, "schedule": "zb_h1", "recompute": True}),
    # mixed: a 2-stage pipeline on ranks 0, 1 with 5 samples beside a tensor-parallel pair with 3
    ("hf_gpt2", GPT2, {"pipelines": [{"batch": 5, "m": 2, "stages": [(1, [0]), (1, [1])]},
                                     {"batch": 3, "m": 1, "stages": [(2, [2, 3])]}]}),
]


def one_device(name: str, kwargs: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    """autopar's one-device program of the case (the same capture and keyed draws, one micro-batch)."""
    case, prog = compile_case(name, kwargs, {}, 0, 1)
    losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(STEPS)]
    return losses, prog.state_dict()["model"]


@pytest.fixture(scope="module")
def results() -> list:
    pytest.importorskip("transformers")
    return spawn_local(run_cases, 4, CASES, timeout_s=300)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_every_plan_with_dropout_trains_like_the_one_device_program(results: list, index: int) -> None:
    name, kwargs, spec = CASES[index]
    ref_losses, ref_params = one_device(name, kwargs)
    for rank, per_rank in enumerate(results):
        losses, params, _ = per_rank[index]
        assert_matches_reference(losses, params, ref_losses, ref_params, f"rank {rank}")
    full = build(name, **kwargs).model.state_dict()
    assert_work_split([r[index][2] for r in results], spec, kwargs["batch"], full)


def test_the_dropout_draws() -> None:
    """The comparisons above compare models that really drop: the one-device losses with dropout are not
    those without it, and two seeds draw different masks."""
    pytest.importorskip("transformers")
    with_drop = one_device("hf_gpt2", GPT2)[0]
    without = one_device("hf_gpt2", {**GPT2, "dropout": 0.0})[0]
    assert all(abs(a - b) > 1e-3 for a, b in zip(with_drop, without, strict=True)), (with_drop, without)


# ---- the stream itself ------------------------------------------------------------------------------------


def test_a_sample_draws_the_same_mask_however_the_batch_is_split() -> None:
    x = torch.ones(8, 6, 10)
    with draws(Draws(seed=3, step=2, first=0, samples=8)):
        whole = keyed_dropout(x, 0.3, True, key=11)
    for cuts in ([0, 5, 8], [0, 1, 4, 8], [0, 2, 3, 7, 8]):
        parts = []
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            with draws(Draws(seed=3, step=2, first=lo, samples=hi - lo)):
                parts.append(keyed_dropout(x[lo:hi], 0.3, True, key=11))
        assert torch.equal(torch.cat(parts), whole), cuts
    # the batch flattened into the leading dimension (batch * seq, hidden) draws the same values
    with draws(Draws(seed=3, step=2, first=0, samples=8)):
        assert torch.equal(keyed_dropout(x.reshape(48, 10), 0.3, True, key=11).reshape(x.shape), whole)
    kept = (whole != 0).float().mean().item()
    assert 0.6 < kept < 0.8  # p = 0.3
    # another step, seed or op draws another mask
    for other in (Draws(3, 3, 0, 8), Draws(4, 2, 0, 8)):
        with draws(other):
            assert not torch.equal(keyed_dropout(x, 0.3, True, key=11), whole)
    with draws(Draws(3, 2, 0, 8)):
        assert not torch.equal(keyed_dropout(x, 0.3, True, key=12), whole)


def test_a_shard_draws_its_slice_of_the_full_tensors_values() -> None:
    """Tensor parallelism: a block at any offset of the global tensor draws the full draw's slice."""
    shape = (4, 6, 10)
    with draws(Draws(0, 1, 2, 4)):
        full = _uniform_block(5, 0, shape, shape, (0, 0, 0), torch.device("cpu"))
        for local, offsets in (((4, 3, 10), (0, 3, 0)), ((4, 6, 5), (0, 0, 5)), ((2, 6, 10), (2, 0, 0))):
            block = _uniform_block(5, 0, shape, local, offsets, torch.device("cpu"))
            want = full[tuple(slice(o, o + n) for o, n in zip(offsets, local, strict=True))]
            assert torch.equal(block, want), offsets
    assert 0.45 < full.mean().item() < 0.55 and full.min() >= 0 and full.max() < 1


def test_a_recomputed_forward_draws_its_forwards_mask() -> None:
    w = torch.randn(10, 10, requires_grad=True)
    x = torch.randn(4, 10)
    run = lambda x: keyed_dropout(x @ w, 0.5, True, key=1).sum(0)

    def grad(checkpointed: bool) -> torch.Tensor:
        w.grad = None
        with draws(Draws(0, 0, 0, 4)):
            out = torch.utils.checkpoint.checkpoint(remembering(run), x, use_reentrant=False) if checkpointed \
                else run(x)
        out.square().sum().backward()  # the recomputation runs here, outside `draws`
        return w.grad.clone()

    assert torch.equal(grad(True), grad(False))


def test_the_pass_keys_each_random_op_and_warns_for_others() -> None:
    import torch.fx as fx

    from autopar.errors import RandomnessWarning

    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.dropout(x, 0.2, True) + torch.rand_like(x) + torch.bernoulli(torch.full_like(x, 0.5))

    ep = torch.export.export(M(), (torch.ones(4, 3),), strict=False)
    gm = keyed_randomness(fx.GraphModule(ep.graph_module, ep.graph_module.graph))
    names = [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"]
    assert {"keyed_dropout", "keyed_rand_like", "keyed_bernoulli"} <= set(names), names
    with draws(Draws(0, 0, 0, 4)):
        [a] = gm(torch.ones(4, 3))
    with draws(Draws(0, 0, 0, 4)):
        [b] = gm(torch.ones(4, 3))
    assert torch.equal(a, b)  # keyed: the same call draws the same values

    class N(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.normal(0.0, torch.ones_like(x))

    ep = torch.export.export(N(), (torch.ones(4, 3),), strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keyed_randomness(fx.GraphModule(ep.graph_module, ep.graph_module.graph))
    assert any(issubclass(w.category, RandomnessWarning) and "aten.normal" in str(w.message) for w in caught)


def test_attention_dropout_is_priced_as_the_math_it_runs() -> None:
    """sdpa with dropout_p > 0 runs as scores, softmax, keyed dropout, @ V: annotate prices what it saves (the
    attention probabilities and their mask), not the flash kernel's few bytes."""
    from autopar.passes.annotate import _measure

    shape = (2, 4, 16, 8)
    q = ("T", shape, torch.empty(shape).stride(), torch.float32, True)
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    flash = _measure(sdpa, (q, q, q), ())
    drop = _measure(sdpa, (q, q, q, None, 0.1), ())
    probs = 2 * 4 * 16 * 16  # elements of the attention probabilities
    assert drop.saved_internal_bytes >= flash.saved_internal_bytes + probs * (4 + 1), \
        (drop.saved_internal_bytes, flash.saved_internal_bytes)  # fp32 probabilities and their bool mask


def test_feature_dropout_and_the_factories_are_split_invariant_too() -> None:
    from autopar.passes.randomness import keyed_bernoulli, keyed_feature_dropout, keyed_rand_like

    x = torch.ones(6, 4, 3, 3)
    with draws(Draws(1, 0, 0, 6)):
        whole = [keyed_feature_dropout(x, 0.5, True, 2), keyed_bernoulli(x * 0.5, None, 3),
                 keyed_rand_like(x, 4, normal=True)]
    with draws(Draws(1, 0, 0, 2)):
        head = [keyed_feature_dropout(x[:2], 0.5, True, 2), keyed_bernoulli(x[:2] * 0.5, None, 3),
                keyed_rand_like(x[:2], 4, normal=True)]
    with draws(Draws(1, 0, 2, 4)):
        tail = [keyed_feature_dropout(x[2:], 0.5, True, 2), keyed_bernoulli(x[2:] * 0.5, None, 3),
                keyed_rand_like(x[2:], 4, normal=True)]
    for w, h, t in zip(whole, head, tail, strict=True):
        assert torch.equal(torch.cat([h, t]), w)
    drop = whole[0]
    assert torch.equal(drop.amax((2, 3)), drop.amin((2, 3)))  # one draw per (sample, channel)
    z = whole[2]
    assert abs(z.mean().item()) < 0.3 and 0.7 < z.std().item() < 1.3


def _compiled_with_dropout(rank: int, world: int, cluster: str) -> tuple[list[float], dict, list[str]]:
    """The user's path: autopar.compile with the plan it chooses, the self-check on, seed 7."""
    import autopar
    from autopar import hf_models
    from autopar.errors import PlanDriftWarning

    case = hf_models.hf_gpt2(batch=8, seq=16, layers=2, dropout=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prog = autopar.compile(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn,
                               lambda p: torch.optim.AdamW(p, lr=1e-3, eps=1e-6), precision="fp32", seed=7)
        losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(STEPS)]
    drift = [str(w.message) for w in caught if issubclass(w.category, PlanDriftWarning)]
    return losses, prog.state_dict()["model"], drift


def test_the_compiled_plan_autopar_chooses_trains_like_its_one_device_compile() -> None:
    pytest.importorskip("transformers")
    ref_losses, ref_params, _ = _compiled_with_dropout(0, 1, "1x1xcpu")
    results = spawn_local(_compiled_with_dropout, 2, "1x2xcpu", timeout_s=300)
    for rank, (losses, params, drift) in enumerate(results):
        assert_matches_reference(losses, params, ref_losses, ref_params, f"rank {rank}")
        assert not drift, drift  # the keyed draws stay within the plan's memory
