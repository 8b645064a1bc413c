"""Generated Triton kernels (through the interpreter on CPU) match eager PyTorch, forward and backward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import autopar
from autopar import models
from autopar.codegen import triton_gen
from autopar.codegen.fusion import find_regions, fused_bytes
from autopar.codegen.kernels import FusedRegion, apply_kernels
from autopar.codegen.split import split_stages
from autopar.errors import PlanError

pytest.importorskip("triton")
# fp32: outputs agree to rounding; gradients reduced over rows (weights, biases) sum rounding differences
OUT_TOL = {"rtol": 1e-5, "atol": 1e-6}
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-5}


def assert_no_fallback(report) -> None:
    """Every fused region really ran its kernels (a kernel error would otherwise fall back to torch)."""
    notes = [f"{r.name}: {n}" for r in report.regions for n in r.notes]
    assert not notes, notes


def assert_match(got: tuple[list, list], ref: tuple[list, list]) -> None:
    for a, b in zip(got[0], ref[0], strict=True):
        torch.testing.assert_close(a, b, **OUT_TOL)
    for a, b in zip(got[1], ref[1], strict=True):
        torch.testing.assert_close(a, b, **GRAD_TOL)


class _Fn(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.fn(*xs)


def capture(fn, *xs: torch.Tensor) -> fx.GraphModule:
    """The export training IR of fn (the op set of autopar's stage programs)."""
    return torch.export.export(_Fn(fn), xs, strict=False).graph_module


def grads_of(gm: fx.GraphModule, xs: list[torch.Tensor], seed: int = 0) -> tuple[list, list]:
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in xs]
    torch.manual_seed(seed)
    outs = gm(*xs)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    gen = torch.Generator().manual_seed(1)
    ups = [torch.randn(o.shape, generator=gen) for o in outs]
    diff = [x for x in xs if x.requires_grad]
    grads = torch.autograd.grad(outs, diff, ups, allow_unused=True)
    grads = [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, diff, strict=True)]
    return [o.detach() for o in outs], grads


def check(fn, shapes: list, kinds: set[str], ints: dict | None = None) -> list:
    torch.manual_seed(0)
    xs = [torch.randn(s) for s in shapes]
    for i, (high, shape) in (ints or {}).items():
        xs[i] = torch.randint(0, high, shape)
    gm = capture(fn, *xs)
    fused, report = apply_kernels(gm, "triton")
    assert {r.kind for r in report.fused} >= kinds, report.text()
    assert_match(grads_of(fused, xs), grads_of(gm, xs))
    assert_no_fallback(report)
    return report.regions


CASES = {
    "elementwise": (lambda x, y, z, s: (x * torch.sigmoid(x) + torch.tanh(y) * 2 - torch.exp(-x.abs())
                                        / (1 + z * z) + torch.rsqrt(x * x + 1) * s - torch.relu(x).pow(2)
                                        + torch.where(x > y, x, z)),
                    [(4, 8, 48), (8, 48), (48,), ()], {"elementwise"}),
    "bias_gelu": (lambda x, w, b: F.gelu(F.linear(x, w, b)), [(4, 8, 24), (40, 24), (40,)], {"bias_act"}),
    "bias_gelu_tanh": (lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh") * 1.5,
                       [(32, 24), (40, 24), (40,)], {"bias_act"}),
    "bias_silu": (lambda x, w, b: F.silu(F.linear(x, w, b)) - torch.sin(x.sum(-1, keepdim=True)),
                  [(32, 24), (40, 24), (40,)], {"bias_act"}),
    "residual_layer_norm": (lambda x, y, w, b: F.layer_norm(x + F.dropout(y, 0.0) * 0.5, (48,), w, b),
                            [(4, 8, 48), (4, 8, 48), (48,), (48,)], {"residual_norm"}),
    "residual_rms_norm": (lambda x, y, w: F.rms_norm(x + y, (48,), w, 1e-6), [(4, 8, 48), (8, 48), (48,)],
                          {"residual_norm"}),
    "softmax": (lambda x, m: (x * 0.125 + m).softmax(-1) * x, [(2, 4, 16, 16), (16, 16)], {"softmax"}),
    "log_softmax": (lambda x: F.log_softmax(x * 2.0, dim=-1), [(24, 40)], {"softmax"}),
    "row_reductions": (lambda x: (x - x.mean(-1, keepdim=True)) * x.amax(-1, keepdim=True)
                       + x.sum(-1, keepdim=True),
                       [(24, 40)], {"elementwise"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_region_kind_matches_eager(name: str) -> None:
    fn, shapes, kinds = CASES[name]
    check(fn, shapes, kinds)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_matches_eager(reduction: str) -> None:
    def fn(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        t = torch.where(t == 3, -100, t)  # some rows are ignored
        return F.cross_entropy(x.float(), t, reduction=reduction) * 1.0
    check(fn, [(40, 37), (40,)], {"cross_entropy"}, ints={1: (37, (40,))})


def test_a_drawing_dropout_is_left_to_torch() -> None:
    """Dropout that draws is not fused: it runs as autopar's keyed draw (passes/randomness.py), whose masks do
    not depend on the plan; the region around it still fuses, and pricing follows the same rule."""
    gm = capture(lambda x: F.gelu(F.dropout(x * 2, 0.25, True)) + x, torch.randn(64, 40))
    fused, report = apply_kernels(gm, "triton")
    assert all("dropout" not in op for r in report.fused for op in r.ops), report.text()
    assert report.fused, report.text()  # the elementwise ops on either side still fuse
    x = torch.randn(64, 40)
    torch.manual_seed(5)
    (y,) = fused(x)
    torch.manual_seed(5)
    torch.testing.assert_close(y, F.gelu(F.dropout(x * 2, 0.25, True)) + x)  # torch's own dropout ran


def test_op_without_kernel_stays_in_torch() -> None:
    regions = check(lambda x: torch.atan(x * 2 + 1) * 3 + x, [(16, 24)], {"elementwise"})
    atan = [r for r in regions if "aten.atan.default" in r.ops]
    assert len(atan) == 1 and not atan[0].fused and "no kernel rule" in atan[0].reason
    assert sum(r.fused for r in regions) == 2  # the chains before and after atan are kernels


def _gpt_stages(n_stages: int) -> tuple[models.ModelCase, list]:
    case = models.gpt(hidden=64)
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    bounds = [(0, 2), (2, len(g.layers))] if n_stages == 2 else [(0, len(g.layers))]
    return case, split_stages(g, bounds)


def _stage_args(case: models.ModelCase, st, recv: list[torch.Tensor]) -> list[torch.Tensor]:
    named = {**dict(case.model.named_parameters()), **dict(case.model.named_buffers())}
    user = list(case.example_inputs) + [case.example_target]
    return [named[p].detach().clone() for p in st.params + st.buffers] + [user[i] for i in st.inputs] + recv


def test_gpt_stage_graphs_match_unfused(tmp_path: Path) -> None:
    case, stages = _gpt_stages(2)
    recv: list[torch.Tensor] = []
    for st in stages:
        args = _stage_args(case, st, recv)
        fused, report = apply_kernels(st.gm, "triton", tmp_path / f"stage{st.index}", example_inputs=args)
        assert report.fused
        ref = grads_of(st.gm, args)
        assert_match(grads_of(fused, args), ref)
        assert_no_fallback(report)
        recv = [o.detach() for o in ref[0]] if not st.is_last else []
    kinds = {r.kind for r in report.fused}
    assert {"residual_norm", "bias_act", "cross_entropy"} <= kinds
    text = (tmp_path / "stage1" / "regions.txt").read_text()
    assert "FUSED" in text and "not fused" in text and "no bias" in text
    for r in report.fused:
        src = (tmp_path / "stage1" / r.kernel).read_text()
        assert "def fwd(" in src and "def bwd(" in src
    hashes = {(tmp_path / "stage1" / r.kernel).read_text().split("kernel hash ")[1][:16]
              for r in report.fused if r.kind == "bias_act"}
    assert len(hashes) == 1  # identical blocks share one cached kernel


def test_whole_gpt_loss_and_grads_match_and_auto_is_torch_on_cpu() -> None:
    case, (st,) = _gpt_stages(1)
    args = _stage_args(case, st, [])
    ref = grads_of(st.gm, args)
    for mode in ("triton", "auto"):
        fused, report = apply_kernels(st.gm, mode)
        assert_match(grads_of(fused, args), ref)
        assert_no_fallback(report)
    regions = [m for m in fused.modules() if isinstance(m, FusedRegion)]
    assert regions and not any(m._compiled for m in regions)  # "auto" on CPU never launched a kernel


def test_modes_and_errors() -> None:
    gm = capture(lambda x: torch.tanh(x) * 2 + 1, torch.randn(8, 8))
    with pytest.raises(PlanError, match="'auto', 'triton', 'torch'"):
        apply_kernels(gm, "cuda")
    same, report = apply_kernels(gm, "torch")
    assert same is gm and not report.fused and "mode 'torch'" in report.regions[0].reason


def test_fused_bytes_prices_one_read_and_one_write_per_region() -> None:
    gm = capture(lambda x, y: torch.relu((x + y) * 2), torch.randn(64), torch.randn(64))
    (region,) = [r for r in find_regions(gm) if r.fused]
    e = 64 * 4
    assert fused_bytes(region) == (7 * e, 3 * e)  # add: 2 reads + 1 write, mul and relu: 1 + 1 each
    assert fused_bytes(region, {region.inputs[0].name: 0}) == (6 * e, 2 * e)  # sizes fill in / override


def test_generated_source_comes_from_the_op_table() -> None:
    gm = capture(lambda x: torch.sigmoid(x) * torch.erf(x), torch.randn(8, 8))
    (region,) = [r for r in find_regions(gm) if r.fused]
    src = triton_gen.generate(region.program)
    assert "tl.sigmoid(v0)" in src and "tl.erf(v0)" in src
    assert "1.1283791670955126 * tl.exp(-v0 * v0)" in src  # d erf / dx, from the prim's vjp rule


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_kernel_failing_on_first_use_falls_back_to_torch_loudly(monkeypatch: pytest.MonkeyPatch, which: str,
                                                                 tmp_path: Path) -> None:
    """mode "auto" (as on CUDA tensors): a KernelFallbackWarning naming the region, its ops and the error,
    a note in the report and its regions.txt; the region then stays in torch."""
    from autopar.codegen import kernels

    def broken(*args, **kwargs):
        raise RuntimeError("simulated Triton compile error")

    monkeypatch.setattr(kernels, f"run_{which}", broken)
    monkeypatch.setattr(FusedRegion, "runs_kernels", lambda self, xs: True)  # CPU tensors take the CUDA path
    xs = [torch.randn(16, 40), torch.randn(40)]
    gm = capture(lambda x, w: F.layer_norm(x * 2, (40,), w), *xs)
    fused, report = apply_kernels(gm, "auto")
    named = r"region \w+ \(\w*norm: .*layer_norm.*\): .*failed on first use.*simulated Triton compile error"
    with pytest.warns(autopar.KernelFallbackWarning, match=named):
        got = grads_of(fused, xs)
    assert_match(got, grads_of(gm, xs))
    assert f"{which} kernel failed on first use" in report.fused[0].notes[0]
    kernels.write_kernels(report, tmp_path)
    assert "simulated Triton compile error" in (tmp_path / "regions.txt").read_text()
    assert_match(grads_of(fused, xs), grads_of(gm, xs))  # and stays in torch afterwards


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_kernel_failing_with_triton_forced_is_an_error(monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    from autopar.codegen import kernels

    def broken(*args, **kwargs):
        raise RuntimeError("simulated Triton compile error")

    monkeypatch.setattr(kernels, f"run_{which}", broken)
    xs = [torch.randn(16, 40), torch.randn(40)]
    gm = capture(lambda x, w: F.layer_norm(x * 2, (40,), w), *xs)
    fused, _ = apply_kernels(gm, "triton")
    with pytest.raises(autopar.KernelError, match=f"{which} kernel failed on first use.*simulated Triton"):
        grads_of(fused, xs)
