"""torch.compile(model, backend="autopar") trains like eager: one process, graph breaks, memory planning, and
data-parallel on two gloo processes."""

from __future__ import annotations

import copy
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
    assert (tmp_path / "graph_0" / "backward" / "regions.txt").exists()
    assert list((tmp_path / "graph_0" / "forward").glob("kernel_*.py"))


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


def test_bad_options_are_named() -> None:
    m = nn.Linear(4, 4)
    with pytest.raises(Exception, match="unknown autopar backend option 'kernel'.*'kernels'"):
        torch.compile(m, backend="autopar", options={"kernel": "triton"})(torch.randn(2, 4))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="'auto', 'triton', 'torch'"):
        torch.compile(m, backend="autopar", options={"kernels": "fast"})(torch.randn(2, 4))


def _data_parallel(rank: int, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    case, batches = gpt_batches()
    model = case.model if rank == 0 else models.gpt(hidden=64, seed=1).model  # rank 0's weights win
    share = case.example_inputs[0].shape[0] // world
    mine = [(x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]) for x, y in batches]
    losses = train(model, mine, case.loss_fn)
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def test_data_parallel_on_two_processes_matches_one() -> None:
    results = spawn_local(_data_parallel, 2, timeout_s=180)
    case, batches = gpt_batches()
    want = train(case.model, batches, case.loss_fn, compiled=False)
    got = [sum(r[0][i] for r in results) / 2 for i in range(STEPS)]  # equal shares: mean of rank means
    assert got == pytest.approx(want, rel=RTOL, abs=ATOL)
    for rank, (_, params) in enumerate(results):
        for name, p in case.model.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), rtol=RTOL, atol=ATOL,
                                       msg=f"rank {rank} {name}")
