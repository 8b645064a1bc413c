"""Context parallelism (issue 27): each rank of a cp group trains on 1/cp of every sequence's tokens, and the
program equals one process (fp32, losses and every parameter after 3 AdamW steps), alone and composed with
data, tensor and pipeline parallelism, ZeRO, recompute and Ulysses attention; what cannot be split is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autopar.errors import PlanError
from autopar.runtime.launch import spawn_local

from .runtime_cases import (
    STEPS,
    assert_ranks_match_reference,
    compile_case,
    reference_eval,
    run_eval_cases,
    work_of,
)

SEQ = 16
GPT = {"layers": 2, "batch": 4, "seq": SEQ}
CASES_4 = [
    ("gpt", GPT, {"cp": 4}),
    ("gpt", GPT, {"cp": 2, "dp": 2, "m": 2}),
    ("gpt", GPT, {"cp": 2, "tp": 2}),
    ("gpt", {**GPT, "layers": 3}, {"cp": 2, "pp": 2, "m": 2, "layer_split": [1, 2]}),
    ("gpt", GPT, {"cp": 2, "dp": 2, "zero": 3}),
    # weights travel (TawPipe's idea): every rank keeps its tokens' activations, each layer's weights come to it
    ("gpt", GPT, {"cp": 4, "zero": 3}),
    ("gpt", GPT, {"cp": 2, "dp": 2, "recompute": True}),
    ("gpt", GPT, {"cp": 4, "cp_attention": "ulysses"}),
    ("llama", GPT, {"cp": 2, "dp": 2}),
    # Hugging Face models build a causal mask from the positions and pass it to SDPA: it runs as is_causal
    ("hf_llama", GPT, {"cp": 2, "dp": 2}),
    ("hf_gpt2", GPT, {"cp": 4}),
]


def run_cp_cases(rank: int, world: int, cases: list) -> list:
    """As runtime_cases.run_cases (losses, final state, work), plus the token positions this rank ran on and the
    shapes of the values its stages send and receive."""
    out = []
    for name, kwargs, spec in cases:
        case, prog = compile_case(name, kwargs, spec, rank, world)
        losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(STEPS)]
        seen = sorted({tuple(m.shape) for st in prog._stages.values() for m in st.value_meta.values()})
        # parameter bytes the rank keeps between steps (ZeRO-3: its own only), read before state_dict gathers
        held = sum(p.untyped_storage().nbytes() for p in prog.params.values())
        whole = sum(p.numel() * p.element_size() for p in prog.params.values())
        out.append((losses, prog.state_dict()["model"], work_of(prog), prog.cp.positions.tolist(), seen,
                    (held, whole)))
    return out


@pytest.fixture(scope="module")
def results_4() -> list:
    return spawn_local(run_cp_cases, 4, CASES_4, timeout_s=300)


@pytest.mark.parametrize("index", range(len(CASES_4)), ids=[str(c[2]) for c in CASES_4])
def test_cp_equals_one_process(results_4: list, index: int) -> None:
    name, kwargs, spec = CASES_4[index]
    per_rank = [[r[index][:3]] for r in results_4]
    assert_ranks_match_reference(per_rank, 0, name, kwargs, who=f"{spec} ")
    # the work was split: the cp ranks of a group hold disjoint token positions that tile the sequence
    cp = spec["cp"]
    positions = [tuple(r[index][3]) for r in results_4]
    assert all(len(p) == SEQ // cp for p in positions)
    groups = {frozenset(p) for p in positions}
    assert len(groups) == cp
    assert sorted(t for g in groups for t in g) == list(range(SEQ))
    # activations crossing stage boundaries carry the local tokens only
    for r in results_4:
        for shape in r[index][4]:
            assert SEQ not in shape[1:2], shape
    # ZeRO-3 over the cp (and dp) ranks: between steps a rank keeps only the weights it owns; the others travel
    if spec.get("zero") == 3:
        kept = [r[index][5] for r in results_4]
        assert all(held < whole / 2 for held, whole in kept), kept


def _refused(rank: int, world: int, name: str, kwargs: dict, spec: dict, unfused: bool = False) -> str:
    import autopar
    from autopar import models
    from autopar.runtime.program import Program

    from .runtime_cases import build, optimizer, plan_for

    case = build(name, **kwargs)
    if unfused:
        for block in case.model.blocks:
            block.attn = models.MatmulAttention(kwargs.get("hidden", 64), kwargs.get("heads", 4))
    try:
        g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
        Program(case.model, plan_for(g, world, spec), case.example_inputs, case.example_target, case.loss_fn,
                optimizer, rank, world, timeout_s=60, graph=g)
    except PlanError as e:
        return str(e)
    return "no error"


def test_cp_refuses_what_it_cannot_split() -> None:
    """An unfused attention (a mask built from the sequence), dropout, and a sequence not divisible by 2 * cp
    are refused with the reason and the fix, on every rank (no hang)."""
    msgs = spawn_local(_refused, 2, "gpt", GPT, {"cp": 2}, True, timeout_s=120)
    assert all("mixes tokens" in m and "scaled_dot_product_attention" in m for m in msgs), msgs
    msgs = spawn_local(_refused, 2, "gpt", {**GPT, "dropout": 0.1}, {"cp": 2}, timeout_s=120)
    assert all("random ops" in m and "dropout" in m for m in msgs), msgs
    msgs = spawn_local(_refused, 2, "gpt", {**GPT, "seq": 6}, {"cp": 2}, timeout_s=120)
    assert all("divisible by 4" in m for m in msgs), msgs


def test_cp_eval_step_returns_the_whole_output() -> None:
    """eval_step under cp (with dp) gives every rank the model's full output, tokens back in sequence order."""
    case = ("gpt", GPT, {"cp": 2, "dp": 2})
    before, losses, after = reference_eval(case[0], case[1])
    for b, ls, a, _ in (r[0] for r in spawn_local(run_eval_cases, 4, [case], timeout_s=120)):
        torch.testing.assert_close(b, before, rtol=1e-5, atol=1e-6)
        assert ls == pytest.approx(losses, rel=1e-4, abs=1e-5)
        torch.testing.assert_close(a, after, rtol=1e-4, atol=1e-5)


class _Cumsum(torch.nn.Module):
    """Token embeddings averaged over the prefix (a cumsum along the sequence), then a causal attention."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 8)
        self.head = torch.nn.Linear(8, 32)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx).cumsum(1)
        return self.head(x)


class _Pooled(torch.nn.Module):
    """A sequence classifier: mean over tokens, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 8)
        self.head = torch.nn.Linear(8, 32)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx).mean(1, keepdim=True)).expand(-1, idx.shape[1], -1)


def _roles(model: torch.nn.Module, idx: torch.Tensor, cp: int = 2, loss=None):  # noqa: ANN001, ANN202
    import autopar
    from autopar.codegen.split import model_outputs
    from autopar.passes.sequence_split import sequence_roles
    from autopar.runtime.ring_attention import zigzag_positions

    loss = loss or (lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()))
    full = autopar.capture(model, (idx,), loss, idx)
    part = idx[:, zigzag_positions(idx.shape[1], cp, 0)]
    local = autopar.capture(model, (part,), loss, part)
    return sequence_roles(full, local, idx.shape[1], part.shape[1], cp, model_outputs(local.gm))


def test_sequence_roles_find_what_crosses_tokens() -> None:
    """The check behind every refusal, in process: SDPA and the position arange are found in GPT and HF Llama
    (whose causal mask runs as is_causal); a cumsum along the sequence, a pooled head, an unfused attention and a
    sliding-window mask are refused, naming the op."""
    from autopar import models

    case = models.gpt(layers=1, batch=2, seq=16)
    roles = _roles(case.model, case.example_inputs[0])
    assert roles.positions == ["arange"] and len(roles.attentions) == 1 and not roles.causal_masks
    hf = models.CASES["hf_llama"](layers=1, batch=2, seq=16, seed=0)
    roles = _roles(hf.model, hf.example_inputs[0], loss=hf.loss_fn)
    assert len(roles.attentions) == 1 and roles.causal_masks == roles.attentions
    idx = torch.randint(0, 32, (2, 16))
    with pytest.raises(PlanError, match=r"cumsum.*works along the sequence"):
        _roles(_Cumsum(), idx)
    with pytest.raises(PlanError, match=r"mean.*works along the sequence"):
        _roles(_Pooled(), idx)
    unfused = models.gpt(layers=1, batch=2, seq=16)
    unfused.model.blocks[0].attn = models.MatmulAttention(64, 4)
    with pytest.raises(PlanError, match="mixes tokens"):
        _roles(unfused.model, unfused.example_inputs[0])
    from autopar.passes import sequence_split

    limit, sequence_split.MASK_CHECK_ELEMENTS = sequence_split.MASK_CHECK_ELEMENTS, 2 * 16 * 16 - 1
    try:  # a mask too large to compute on the host is refused, not assumed causal
        with pytest.raises(PlanError, match="too large to check"):
            _roles(hf.model, hf.example_inputs[0], loss=hf.loss_fn)
    finally:
        sequence_split.MASK_CHECK_ELEMENTS = limit
    # T5's relative-position bias is a learned mask: not causal by construction, refused without computing it
    import autopar
    from autopar.passes.sequence_split import ATTENTION, causal_mask_problem

    t5 = models.CASES["hf_t5"](layers=1, batch=2, seq=16, seed=0)
    g = autopar.capture(t5.model, t5.example_inputs, t5.loss_fn, t5.example_target)
    why = {causal_mask_problem(g, k, 16) for k, n in g.nodes.items() if n.target == ATTENTION and len(n.args) > 3}
    assert any(w and "parameters or buffers" in w for w in why), why
    sliding = models.CASES["hf_mistral"](layers=1, batch=2, seq=16, seed=0)
    with pytest.raises(PlanError, match="not the causal one"):
        _roles(sliding.model, sliding.example_inputs[0], loss=sliding.loss_fn)


def test_cp_with_bf16_autocast() -> None:
    """cp 2 under a bf16 plan (autocast, fp32 parameters and AdamW) follows one bf16 process. Ring attention
    multiplies bf16 blocks and merges them in fp32 where SDPA rounds its own way, so it is held to the loss's
    bf16 agreement (measured: 2e-5 relative), not to fp32's tolerances; parameters stay within a few AdamW
    steps' noise (lr 1e-3; measured 3.4e-3, as far as the fp32 and bf16 one-process runs are from each other)."""
    from .test_precision import reference_amp, run_precision_cases

    kwargs = {"layers": 2, "batch": 4}
    res = spawn_local(run_precision_cases, 2, [(kwargs, {"cp": 2}, "1x2xA100-80GB", "bf16")], timeout_s=120)
    ref_losses, ref_params, _ = reference_amp(kwargs, "bf16")
    for (losses, params, _, _, policy), in res:
        assert "bf16" in str(policy)
        assert losses == pytest.approx(ref_losses, rel=2e-4)
        for k, v in ref_params.items():
            torch.testing.assert_close(params[k], v, rtol=0, atol=1e-2, msg=k)


def _compile_error(rank: int, world: int, **kwargs: object) -> str:
    import autopar
    from autopar import Strategy, models

    case = models.gpt(layers=1, batch=2, seq=16)
    try:
        autopar.compile(case.model, f"1x{world}xcpu", case.example_inputs, case.example_target, case.loss_fn,
                        plan=Strategy(cp=2), timeout_s=60, **kwargs)
    except PlanError as e:
        return str(e)
    return "no error"


def test_cp_refuses_delayed_updates() -> None:
    """A cp plan with sync='2bw' is refused on every rank before any collective, naming the fix."""
    msgs = spawn_local(_compile_error_2bw, 2, timeout_s=120)
    assert all("cp=2" in m and "delayed updates" in m for m in msgs), msgs


def _compile_error_2bw(rank: int, world: int) -> str:
    return _compile_error(rank, world, sync="2bw")


def _compile_error_meta_target(rank: int, world: int, weights: str) -> str:
    import autopar
    from autopar import Strategy, models

    case = models.gpt(layers=1, batch=2, seq=16)
    meta = models.gpt(layers=1, batch=2, seq=16, device="meta")
    try:
        autopar.compile(meta.model, f"1x{world}xcpu", case.example_inputs, case.example_target.to("meta"),
                        case.loss_fn, plan=Strategy(cp=2), weights=weights, timeout_s=60)
    except PlanError as e:
        return str(e)
    return "no error"


def test_cp_refuses_a_meta_example_target(tmp_path: Path) -> None:
    """cp checks on the example target that the loss is a mean over tokens: a meta-built model's user who passes a
    meta target too is told to pass one with values, on every rank, before any collective."""
    from safetensors.torch import save_model

    from autopar import models

    weights = str(tmp_path / "gpt.safetensors")
    save_model(models.gpt(layers=1, batch=2, seq=16).model, weights)
    msgs = spawn_local(_compile_error_meta_target, 2, weights, timeout_s=120)
    assert all("cp=2" in m and "meta device" in m and "example_target with values" in m for m in msgs), msgs


def _default_path(rank: int, world: int, kwargs: dict, cluster: dict, name: str = "gpt",
                  weights: str | None = None) -> tuple:
    """`autopar.compile` with no plan; with `weights`, of the model built on the meta device, its values read from
    that .safetensors file (the path of a user whose model does not fit one device)."""
    import autopar

    from .runtime_cases import build, optimizer

    case = build(name, **kwargs)
    model = build(name, **kwargs, device="meta").model if weights else case.model
    prog = autopar.compile(model, cluster, case.example_inputs, case.example_target, case.loss_fn, optimizer,
                           weights=weights, timeout_s=120)
    losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(STEPS)]
    report = prog.report()
    return losses, prog.state_dict()["model"], prog.plan.to_json(), [r.ratio for r in report.ranks]


def test_default_path_trains_a_sequence_one_device_cannot_hold() -> None:
    """The issue's bar: one sample at 8K tokens needs more memory than a device has (each has 0.6 of it); on 4 gloo
    ranks `autopar.compile` plans (cp 4), trains exactly like one process, and every rank's measured peak (at the
    allocator, over compile and the first steps) is within 15 % of the plan's prediction."""
    from autopar.ir.plan import Plan

    from .test_cp_pricing import LONG, short_of_one_sample

    cluster = short_of_one_sample(**LONG)
    kwargs = {k: v for k, v in LONG.items()}
    res = spawn_local(_default_path, 4, kwargs, cluster, timeout_s=600)
    plan = Plan.from_json(res[0][2])
    assert {st.cp for p in plan.pipelines for st in p.stages} == {4}
    assert_ranks_match_reference([[r[:2] + ({},)] for r in res], 0, "gpt", kwargs, who="default path ")
    for rank, (*_, ratios) in enumerate(res):
        assert all(abs(x - 1) <= 0.15 for x in ratios), (rank, ratios)


def test_default_path_on_a_hugging_face_llama(tmp_path: Path) -> None:
    """The same bar for a model autopar did not write, on a user's path: transformers' Llama (its causal mask built
    from the positions runs as is_causal) at 4K tokens, built on the meta device with its values in a .safetensors
    file (`compile(..., weights=)`), devices with 0.6 of one sample's need; compile plans cp 4 (Ulysses: 4
    heads), trains exactly like one process, peaks within 15 % of the plan."""
    from safetensors.torch import save_model

    import autopar
    from autopar import Strategy, models
    from autopar.ir.plan import Plan

    kwargs = dict(layers=2, batch=1, seq=4096)
    weights = str(tmp_path / "llama.safetensors")
    save_model(models.CASES["hf_llama"](**kwargs, seed=0).model, weights)
    meta = models.CASES["hf_llama"](**kwargs, seed=0, device="meta")
    need = autopar.estimate(meta.model, "1x1xcpu", Strategy(), meta.example_inputs, meta.example_target,
                            meta.loss_fn).plan.predicted["peak_memory_bytes"][0]
    cluster = {"nodes": [{"device": {"name": "cpu-small", "based_on": "cpu", "memory_GiB": need * 0.6 / 2**30},
                          "devices_per_node": 4}]}
    res = spawn_local(_default_path, 4, kwargs, cluster, "hf_llama", weights, timeout_s=600)
    plan = Plan.from_json(res[0][2])
    assert {st.cp for p in plan.pipelines for st in p.stages} == {4}
    assert_ranks_match_reference([[r[:2] + ({},)] for r in res], 0, "hf_llama", kwargs, who="hf default path ")
    for rank, (*_, ratios) in enumerate(res):
        assert all(abs(x - 1) <= 0.15 for x in ratios), (rank, ratios)
