"""Rough edges of the generated kernels and the dumps (issue 13, items 9 and 10).

Generated kernels write contiguous outputs; the graph around a region expects the layouts its torch ops
give (a `view` after a transpose only works on a permuted layout), so every region kind is run here on
non-contiguous inputs with outputs read through layout-dependent views, on stage programs (export IR) and
through `torch.compile(backend="autopar")` (the AOT forward and backward graphs), and on a grouped-query
attention Llama.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.backend import graphs

from .test_kernels import CASES, _Fn, assert_match, assert_no_fallback, capture, grads_of

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


def _swap(shape: tuple) -> tuple:
    return (shape[1], shape[0], *shape[2:]) if len(shape) >= 2 else shape


def _strided(fn):
    """fn on transposed views of its inputs; each output read back transposed and flattened, by a `view`
    where its eager layout allows one (as transformers' attention does after its transpose)."""
    def flat(o: torch.Tensor) -> torch.Tensor:
        t = o.transpose(0, 1)
        return t.view(-1) if t.is_contiguous() else t.reshape(-1)

    def g(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = fn(*[x.transpose(0, 1) if x.dim() >= 2 else x for x in xs])
        return tuple(flat(o) if o.dim() >= 2 else o for o in (outs if isinstance(outs, tuple) else (outs,)))
    return g


def _ce(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(h, torch.where(t == 3, -100, t))


def _with_input(fn):
    """fn's output and the region's first op, an elementwise value the region also writes out."""
    def g(x: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x * 2.0 + 1.0
        return h, fn(h, *rest)
    return g


def _residual(norm):
    def g(x: torch.Tensor, y: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + y
        return h, norm(h, *weights)
    return g


# every region kind, written so that one of its outputs has a permuted layout for transposed inputs
STRIDED = {
    "elementwise": CASES["elementwise"],
    "row_reductions": CASES["row_reductions"],
    "bias_act": (lambda x, w, b, z: z * F.gelu(F.linear(x, w, b)), [(4, 8, 24), (40, 24), (40,), (4, 8, 40)],
                 {"bias_act"}),
    "residual_rms_norm": (_residual(lambda h, w: F.rms_norm(h, (48,), w, 1e-6)),
                          [(4, 8, 48), (4, 8, 48), (48,)], {"residual_norm"}),
    "residual_layer_norm": (_residual(lambda h, w, b: F.layer_norm(h, (48,), w, b)),
                            [(4, 8, 48), (4, 8, 48), (48,), (48,)], {"residual_norm"}),
    "norm": (_with_input(lambda h, w: F.layer_norm(h, (48,), w)), [(4, 8, 48), (48,)], {"norm"}),
    "softmax": (_with_input(lambda h, m: (h * 0.125 + m).softmax(-1)), [(2, 4, 16, 16), (16, 16)], {"softmax"}),
    "log_softmax": (_with_input(lambda h: F.log_softmax(h, dim=-1)), [(24, 40)], {"softmax"}),
    "cross_entropy": (_with_input(_ce), [(40, 37), (40,)], {"cross_entropy"}),
}
INTS = {"cross_entropy": {1: (37, (40,))}}


def _inputs(name: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    _, shapes, _ = STRIDED[name]
    xs = [torch.randn(_swap(tuple(s))) for s in shapes]
    for i, (high, shape) in INTS.get(name, {}).items():
        xs[i] = torch.randint(0, high, shape)
    return xs


def _has_permuted_output(fn, xs: list[torch.Tensor]) -> bool:
    outs = fn(*[x.transpose(0, 1) if x.dim() >= 2 else x for x in xs])
    return any(not o.is_contiguous() for o in (outs if isinstance(outs, tuple) else (outs,)))


@pytest.mark.parametrize("name", list(STRIDED))
def test_region_kinds_on_non_contiguous_inputs_and_outputs_in_stage_programs(name: str) -> None:
    from autopar.codegen.kernels import apply_kernels

    fn, _, kinds = STRIDED[name]
    xs = _inputs(name)
    gm = capture(_strided(fn), *xs)
    fused, report = apply_kernels(gm, "triton")
    assert {r.kind for r in report.fused} >= kinds, report.text()
    assert_match(grads_of(fused, xs), grads_of(gm, xs))
    assert_no_fallback(report)


@pytest.mark.parametrize("name", list(STRIDED))
def test_region_kinds_on_non_contiguous_inputs_and_outputs_through_the_backend(name: str, tmp_path: Path) -> None:
    fn = STRIDED[name][0]
    xs = _inputs(name)
    eager = _Fn(_strided(fn))
    compiled = torch.compile(eager, backend="autopar", options={"kernels": "triton", "dump_dir": tmp_path})
    assert_match(grads_of(compiled, xs), grads_of(eager, xs))
    (record,) = graphs(tmp_path)
    assert record.kernels["forward"].fused and record.kernels["backward"].fused  # (AOT splits linear: mm, add)
    for report in record.kernels.values():
        assert_no_fallback(report)


def test_the_cases_exercise_permuted_outputs() -> None:
    """Every case has an output with a permuted layout (what the kernels must reproduce)."""
    flat = [n for n in STRIDED if not _has_permuted_output(STRIDED[n][0], _inputs(n))]
    assert not flat


def test_grouped_query_attention_llama_trains_with_triton_kernels(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    model = transformers.LlamaForCausalLM(cfg)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 256, (2, 8))
    compiled = torch.compile(model, backend="autopar", options={"kernels": "triton", "dump_dir": tmp_path})

    def train(m: nn.Module) -> list[float]:
        opt = torch.optim.SGD((model if m is compiled else ref).parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            loss = F.cross_entropy(m(input_ids=ids).logits.flatten(0, 1), ids.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    got, want = train(compiled), train(ref)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert want[-1] < want[0]
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    records = graphs(tmp_path)
    assert records and all(r.kernels for r in records)
    fused = [r for rec in records for rep in rec.kernels.values() for r in rep.fused]
    assert {"norm", "residual_norm", "elementwise"} <= {r.kind for r in fused}
    assert any("transpose" in i for r in fused for i in r.inputs)  # rotary embedding on transposed q/k
    for rec in records:
        for rep in rec.kernels.values():
            assert_no_fallback(rep)


def test_fused_bytes_price_the_layout_copies_around_a_kernel() -> None:
    from autopar.codegen.fusion import find_regions, fused_bytes

    gm = capture(lambda x: (x.t() * 2 + 1).t().reshape(-1), torch.randn(16, 8))
    (region,) = [r for r in find_regions(gm) if r.fused]
    e = 16 * 8 * 4
    # the kernel reads its input and writes its output once; the transposed input is copied contiguous
    # before it and the output copied into torch's permuted layout after it: a write and a read each
    assert fused_bytes(region) == (4 * e, 6 * e)
    contiguous = capture(lambda x: (x * 2 + 1).reshape(-1), torch.randn(16, 8))
    (plain,) = [r for r in find_regions(contiguous) if r.fused]
    assert fused_bytes(plain) == (4 * e, 2 * e)


# ---------------------------------------------------------------------------------------------- dumps
def test_plan_dump_writes_the_annotated_graph(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import json

    import autopar
    from autopar import models
    from autopar.ir.graph import TrainingGraph

    monkeypatch.setenv("AUTOPAR_DUMP", str(tmp_path))
    c = models.mlp(batch=8)
    autopar.plan(c.model, "1x2xcpu", c.example_inputs, c.example_target, c.loss_fn, time_limit_s=20)
    assert {"plan.json", "plan.txt", "graph.txt", "graph.json", "graph.dot"} <= {p.name for p in tmp_path.iterdir()}
    dumped = TrainingGraph.from_dict(json.loads((tmp_path / "graph.json").read_text()))
    want = autopar.analyze(c.model, "1x2xcpu", c.example_inputs, c.example_target, c.loss_fn)
    assert list(dumped.nodes) == list(want.nodes) and len(dumped.layers) == len(want.layers)
    # annotated: FLOPs and times per device type, as the planner priced them
    assert sum(n.flops_fwd for n in dumped.nodes.values()) == sum(n.flops_fwd for n in want.nodes.values()) > 0
    assert {k for n in dumped.nodes.values() for k in n.time_fwd} == {"cpu"}
    assert "digraph" in (tmp_path / "graph.dot").read_text()


@pytest.mark.parametrize("recompute", [False, True], ids=["whole-stage", "layer-by-layer"])
def test_compile_dump_holds_every_kernel_file_its_programs_name(tmp_path: Path, recompute: bool) -> None:
    import re

    import autopar
    from autopar import models
    from autopar.ir.plan import Strategy

    c = models.gpt(hidden=64, layers=2, batch=4)
    autopar.compile(c.model, "1x1xcpu", c.example_inputs, c.example_target, c.loss_fn,
                    plan=Strategy(recompute=True) if recompute else None, dump_dir=tmp_path, kernels="auto")
    text = (tmp_path / "rank0.py").read_text()
    named = re.findall(r"[\w/]*kernel_\w+\.py", text)
    assert named and len(named) == text.count("FUSED")  # one file per fused region
    assert len(set(named)) == len(named)  # layer programs' regions share names: each has its own directory
    for name in named:
        src = (tmp_path / name).read_text()
        assert "def fwd(" in src and "def bwd(" in src
    assert {"graph.txt", "graph.json", "graph.dot", "plan.json"} <= {p.name for p in tmp_path.iterdir()}
    assert ("layer program 1" in text) == recompute  # recompute per block: the stage runs layer by layer


def test_unknown_device_in_a_cluster_file_names_the_file_and_the_node_group(tmp_path: Path) -> None:
    from autopar.cluster import Cluster
    from autopar.errors import ClusterError

    path = tmp_path / "mixed.yaml"
    path.write_text("nodes:\n  - device: A100-80GB\n  - device: H100-SXMX\n    devices_per_node: 2\n")
    with pytest.raises(ClusterError) as e:
        Cluster.load(path)
    msg = str(e.value)
    assert str(path) in msg and "nodes[1].device" in msg and "'H100-SXMX'" in msg and "'H100-SXM'" in msg
    path.write_text("nodes:\n  - device: {based_on: H1000, memory_GiB: 10}\n")
    with pytest.raises(ClusterError, match=r"nodes\[0\]\.device\.based_on: unknown device type 'H1000'") as e:
        Cluster.load(path)
    assert str(path) in str(e.value)
