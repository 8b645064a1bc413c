"""torch.compile(model, backend="autopar") trains like eager: one process, graph breaks, memory planning, and
data-parallel on two gloo processes."""

from __future__ import annotations

import copy
import inspect
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar import models
from autopar.backend import graphs
from autopar.runtime.launch import spawn_local

RTOL, ATOL = 1e-4, 1e-5
STEPS = 3
TINY = {"nodes": [{"device": {"based_on": "A100-80GB", "memory_GiB": 1e-5}}]}  # 10 KiB: nothing fits
HUGE = {"nodes": [{"device": "A100-80GB"}]}


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


def train(model: nn.Module, batches: list[tuple], loss_fn, options: dict | None = None, compiled: bool = True,
          optimizer: str = "sgd") -> list[float]:
    fn = torch.compile(model, backend="autopar", options=options) if compiled else model
    opt = (torch.optim.SGD(model.parameters(), lr=0.1) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses = []
    for x, y in batches:
        loss = loss_fn(fn(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def assert_same_training(model: nn.Module, batches: list[tuple], loss_fn, options: dict | None = None,
                         optimizer: str = "sgd") -> list[float]:
    ref = copy.deepcopy(model)
    got = train(model, batches, loss_fn, options, optimizer=optimizer)
    want = train(ref, batches, loss_fn, compiled=False, optimizer=optimizer)
    assert got == pytest.approx(want, rel=RTOL, abs=ATOL)
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=name)
    assert want[-1] < want[0]
    return got


def gpt_batches(batch: int = 4) -> tuple[models.ModelCase, list[tuple]]:
    case = models.gpt(hidden=64, batch=batch)
    return case, [(case.example_inputs[0], case.example_target)] * STEPS


def test_backend_is_registered_by_entry_point_without_importing_autopar() -> None:
    assert "autopar" in entry_points(group="torch_dynamo_backends").names
    script = textwrap.dedent("""
        import sys, torch
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        assert "autopar" not in sys.modules
        torch.compile(m, backend="autopar")(torch.randn(5, 8)).sum().backward()
        print("autopar.backend" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True"


def test_gpt_with_triton_kernels_trains_like_eager(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    case, batches = gpt_batches()
    assert_same_training(case.model, batches, case.loss_fn, {"kernels": "triton", "dump_dir": str(tmp_path)})
    (rec,) = graphs(tmp_path)
    assert rec.kernels["forward"].fused and rec.kernels["backward"].fused
    assert all(not r.notes for rep in rec.kernels.values() for r in rep.regions)  # no runtime fallbacks
    assert {r.kind for r in rec.kernels["forward"].fused} >= {"residual_norm", "bias_act"}
    for which, rep in rec.kernels.items():  # every region listed with its fate; every kernel's source dumped
        text = (tmp_path / "graph_0" / which / "regions.txt").read_text()
        for r in rep.regions:
            assert (f"{r.name}: FUSED" if r.fused else f"{r.name}: not fused") in text
            if r.fused:
                src = (tmp_path / "graph_0" / which / r.kernel).read_text()
                assert "def fwd(" in src and "def bwd(" in src and "tl.store(" in src
            else:
                assert r.reason and r.reason in text


def test_gpt_default_options_adamw_trains_like_eager() -> None:
    case, batches = gpt_batches()
    assert_same_training(case.model, batches, case.loss_fn, optimizer="adamw")


def test_memory_planning_turns_on_recomputation_when_activations_do_not_fit(tmp_path: Path) -> None:
    case, batches = gpt_batches()
    assert_same_training(case.model, batches, case.loss_fn, {"cluster": TINY, "dump_dir": str(tmp_path)})
    (rec,) = graphs(tmp_path)
    assert rec.recompute
    assert "activation recomputation ON" in (tmp_path / "graphs.txt").read_text()
    torch._dynamo.reset()
    case, batches = gpt_batches()
    train(case.model, batches[:1], case.loss_fn, {"cluster": HUGE, "dump_dir": str(tmp_path / "big")})
    (big,) = graphs(tmp_path / "big")
    assert not big.recompute and big.saved_bytes > rec.saved_bytes  # recomputation saved memory


class Breaky(nn.Module):
    """A model dynamo cannot capture whole: a print and a .item() split it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj, self.ln = nn.Linear(32, 64), nn.Linear(64, 32), nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc(x))
        print("mean activation", round(h.abs().mean().item(), 2))
        return self.ln(x + self.proj(h))


def test_graph_breaks_train_correctly_and_are_listed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    assert_same_training(Breaky(), [(x, y)] * STEPS, F.mse_loss, {"dump_dir": str(tmp_path)})
    text = (tmp_path / "graphs.txt").read_text()
    assert "graph break" in text and "graph 1:" in text
    recs = graphs(tmp_path)
    assert len(recs) >= 2 and all(r.ops > 0 for r in recs)
    lines, start = inspect.getsourcelines(Breaky.forward)
    item = start + next(i for i, line in enumerate(lines) if ".item()" in line)
    assert f"-- break: graph 0 stops after test_backend.py:{item}, graph 1 starts at" in text


def test_bad_options_are_named() -> None:
    m = nn.Linear(4, 4)
    with pytest.raises(Exception, match="unknown autopar backend option 'kernel'.*'kernels'"):
        torch.compile(m, backend="autopar", options={"kernel": "triton"})(torch.randn(2, 4))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="'auto', 'triton', 'torch'"):
        torch.compile(m, backend="autopar", options={"kernels": "fast"})(torch.randn(2, 4))


def _slices(batches: list[tuple], rank: int, sizes: list[int]) -> list[tuple]:
    lo = sum(sizes[:rank])
    return [(x[lo:lo + sizes[rank]], y[lo:lo + sizes[rank]]) for x, y in batches]


def _group_cases(rank: int, world: int, dump: str) -> dict[str, tuple]:
    """On every rank, per case: losses, final parameters. Rank 0's weights must win (rank 1 starts elsewhere)."""
    import autopar

    out = {}
    cases = {"planned": ({"cluster": "1x2xcpu"}, [2, 2]),
             "tp": ({"cluster": "1x2xcpu", "strategy": autopar.Strategy(tp=2)}, [2, 2]),
             "uneven": ({}, [3, 1])}
    for name, (options, sizes) in cases.items():
        torch._dynamo.reset()
        case, batches = gpt_batches()
        model = case.model if rank == 0 else models.gpt(hidden=64, seed=1).model
        losses = train(model, _slices(batches, rank, sizes), case.loss_fn,
                       {**options, "dump_dir": f"{dump}/{name}"})
        out[name] = ([x * sizes[rank] / sum(sizes) for x in losses],
                     {k: v.detach().clone() for k, v in model.named_parameters()})
    import warnings

    import autopar.backend_dist as bd

    def fail(*args, **kwargs):
        raise RuntimeError("no plan for this graph (test)")

    torch._dynamo.reset()
    case, batches = gpt_batches()
    model = case.model if rank == 0 else models.gpt(hidden=64, seed=1).model
    planner, bd.make_plan = bd.make_plan, fail
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = train(model, _slices(batches, rank, [2, 2]), case.loss_fn,
                           {"cluster": "1x2xcpu", "dump_dir": f"{dump}/failed"})
    finally:
        bd.make_plan = planner
    out["failed"] = ([x / 2 for x in losses], {k: v.detach().clone() for k, v in model.named_parameters()},
                     [str(w.message) for w in caught if issubclass(w.category, autopar.PlanFallbackWarning)])
    torch._dynamo.reset()
    torch.manual_seed(0)
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    if rank != 0:
        torch.manual_seed(5)
    model = Breaky()
    losses = train(model, _slices([(x, y)] * STEPS, rank, [4, 4]), F.mse_loss,
                   {"dump_dir": f"{dump}/breaky", "strategy": autopar.Strategy(dp=2)})
    out["breaky"] = ([v / 2 for v in losses], {k: v.detach().clone() for k, v in model.named_parameters()})
    return out


def _check_group_run(results: list[dict], name: str, model: nn.Module, want: list[float]) -> None:
    got = [sum(r[name][0][i] for r in results) for i in range(STEPS)]  # slice-weighted mean of rank losses
    assert got == pytest.approx(want, rel=RTOL, abs=ATOL), name
    for rank, r in enumerate(results):
        for pname, p in model.named_parameters():
            torch.testing.assert_close(r[name][1][pname], p.detach(), rtol=RTOL, atol=ATOL,
                                       msg=f"{name}: rank {rank} {pname}")


def test_process_group_plans_and_trains_like_eager(tmp_path: Path) -> None:
    """2 gloo ranks: a planned graph, a forced tensor-parallel plan, uneven slices without a cluster option,
    and graph breaks, each trained 3 steps like eager on the global batch; every rank ran rank 0's plan."""
    from autopar.backend_dist import plan_kind
    from autopar.ir.plan import Plan

    results = spawn_local(_group_cases, 2, str(tmp_path), timeout_s=400)
    case, batches = gpt_batches()
    want = train(case.model, batches, case.loss_fn, compiled=False)
    _check_group_run(results, "failed", case.model, want)  # planning failed: data parallel, same math, and said
    for r in results:
        assert r["failed"][2] and "no plan for this graph (test)" in r["failed"][2][0], r["failed"][2]
        assert "trains data parallel over 2 ranks" in r["failed"][2][0]
    for name in ("planned", "tp", "uneven"):
        _check_group_run(results, name, case.model, want)
        plans = [Plan.from_json((tmp_path / name / f"rank{r}" / "graph_0" / "plan.json").read_text())
                 for r in range(2)]
        assert plans[0].to_json() == plans[1].to_json()  # every rank runs the same plan
        kind = plan_kind(plans[0], 2)
        assert kind == "tp" if name == "tp" else kind in ("dp", "tp")
        text = (tmp_path / name / "rank1" / "graphs.txt").read_text()
        assert "parallel: plan for" in text
        assert ("tensor parallel over 2 ranks, DTensor-sharded" in text) == (kind == "tp")
    assert "strategy dp=1 tp=2 pp=1 forced" in (tmp_path / "tp" / "rank0" / "graphs.txt").read_text()
    assert "batch slices [3, 1]" in (tmp_path / "uneven" / "rank0" / "graphs.txt").read_text()
    torch.manual_seed(0)
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    ref = Breaky()
    want = train(ref, [(x, y)] * STEPS, F.mse_loss, compiled=False)
    _check_group_run(results, "breaky", ref, want)
    text = (tmp_path / "breaky" / "rank0" / "graphs.txt").read_text()
    assert "graph break" in text and "graph 1:" in text and text.count("parallel: plan for") >= 2


def test_group_options_are_checked() -> None:
    import autopar
    from autopar.backend_dist import check_strategy, group_cluster

    with pytest.raises(Exception, match="has 1 devices but the process group has 2 ranks"):
        group_cluster(autopar.Cluster.load("1x1xcpu"), 2)
    assert group_cluster(None, 3).world_size == 3
    with pytest.raises(Exception, match="use autopar.compile for pipelines"):
        check_strategy(autopar.Strategy(pp=2), 2)
    with pytest.raises(Exception, match="the process group has 1 rank"):  # a single process: no group
        torch.compile(nn.Linear(4, 4), backend="autopar", options={"strategy": autopar.Strategy(tp=2)})(
            torch.randn(2, 4))
