"""Sharded DCP checkpoints: written once per entry, reloaded under other plans, world sizes, the plain model.

One spawn of 4 gloo processes trains each case 2 steps under one layout and saves, then loads the checkpoint
under other layouts and trains a third step; a spawn of 2 processes and the plain single-process model load
the same checkpoints. Every continuation must match 3 single-process steps (rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from autopar import models
from autopar.passes.capture import capture
from autopar.runtime import checkpoint
from autopar.runtime.checkpoint import CheckpointError, load_into_model
from autopar.runtime.launch import spawn_local
from autopar.runtime.program import Program

from .runtime_cases import assert_work_split, build, compile_case, optimizer, plan_for, reference, work_of

RTOL, ATOL = 1e-4, 1e-5
SAVED_AT = 2
ALL_OFFLOAD = ("optimizer", "activations", "params")

# id -> (model, kwargs, layout it is saved under, layouts it is reloaded under on 4 ranks, on 2 ranks)
CASES: dict[str, tuple[str, dict, dict, list[dict], dict]] = {
    "dp-pp-zero1": ("gpt", {"layers": 4, "batch": 8}, {"dp": 2, "pp": 2, "m": 2, "zero": 1},
                    [{"pp": 4, "m": 2}, {"dp": 4, "zero": 3, "offload": ("optimizer", "params")}],
                    {"pp": 2, "m": 2}),
    # tensor-parallel shards go to DCP as DTensors; a tied weight is written once
    "tp-zero2-tied": ("gpt", {"layers": 2, "batch": 4, "tie_embeddings": True}, {"tp": 2, "dp": 2, "zero": 2},
                      [{"pp": 2, "dp": 2, "m": 2}, {"tp": 4}], {"dp": 2}),
    # offloaded (CPU) optimizer shards of a tensor-parallel stage
    "tp-zero3-offload": ("gpt", {"layers": 2, "batch": 4},
                         {"tp": 2, "dp": 2, "zero": 3, "offload": ALL_OFFLOAD}, [{"dp": 4, "m": 1}],
                         {"tp": 2}),
}


def save_and_reload(rank: int, world: int, root: str) -> dict[str, Any]:
    """4 ranks: train SAVED_AT steps, save, reload under each other layout and train one more step."""
    out: dict[str, Any] = {}
    for cid, (name, kwargs, spec, reloads, _) in CASES.items():
        case, prog = compile_case(name, kwargs, spec, rank, world)
        losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(SAVED_AT)]
        path = Path(root) / cid
        prog.save(str(path))
        saved = prog.state_dict()
        out[cid] = {"losses": losses, "saved": saved["model"], "reloads": [], "work": work_of(prog)}
        for other in reloads:
            case, new = compile_case(name, kwargs, other, rank, world)
            new.load(str(path))
            again = new.state_dict()
            loss = new.step(*case.example_inputs, target=case.example_target)
            out[cid]["reloads"].append({"step_count": again["step"], "model": again["model"],
                                        "optimizer": again["optimizer"],
                                        "saved_optimizer": saved["optimizer"], "loss": loss,
                                        "final": new.state_dict()["model"], "work": work_of(new)})
    return out


def reload_small(rank: int, world: int, root: str) -> dict[str, Any]:
    """2 ranks: load the 4-rank checkpoints and train one more step."""
    out = {}
    for cid, (name, kwargs, _, _, small) in CASES.items():
        case, prog = compile_case(name, kwargs, small, rank, world)
        prog.load(str(Path(root) / cid))
        loss = prog.step(*case.example_inputs, target=case.example_target)
        out[cid] = {"loss": loss, "final": prog.state_dict()["model"]}
    # a checkpoint of another model fails on every rank (none is left waiting in the collective load)
    _, prog = compile_case("gpt", {"layers": 2, "batch": 4}, {"pp": 2, "m": 2}, rank, world)
    try:
        prog.load(str(Path(root) / "dp-pp-zero1"))
        out["mismatch"] = "loaded"
    except CheckpointError as e:
        out["mismatch"] = str(e)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    root = tmp_path_factory.mktemp("ckpt")
    four = spawn_local(save_and_reload, 4, str(root), timeout_s=240)
    two = spawn_local(reload_small, 2, str(root), timeout_s=120)
    return root, four, two


def _close(got: dict, ref: dict, what: str) -> None:
    assert got.keys() == ref.keys(), what
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, rtol=RTOL, atol=ATOL, msg=f"{what}: {k}")


@pytest.mark.parametrize("cid", list(CASES))
def test_reload_under_other_plans_continues_exactly(saved: tuple, cid: str) -> None:
    _, four, two = saved
    name, kwargs, spec, reloads, _ = CASES[cid]
    ref_losses, ref_final = reference(name, kwargs, steps=SAVED_AT + 1)
    _, ref_saved = reference(name, kwargs, steps=SAVED_AT)
    # the saving plan and every reloading plan split the work as they say (batch slices, layers, shards)
    assert_work_split([res[cid]["work"] for res in four], spec, kwargs["batch"], ref_saved)
    for i, other in enumerate(reloads):
        assert_work_split([res[cid]["reloads"][i]["work"] for res in four], other, kwargs["batch"], ref_saved)
    for rank, res in enumerate(four):
        r = res[cid]
        assert r["losses"] == pytest.approx(ref_losses[:SAVED_AT], rel=RTOL, abs=ATOL)
        _close(r["saved"], ref_saved, f"rank {rank} saved state")
        for i, again in enumerate(r["reloads"]):
            what = f"rank {rank}, reloaded under {reloads[i]}"
            assert again["step_count"] == SAVED_AT
            # the reload restores exactly what was saved: weights and optimizer state, bit for bit
            for k, v in r["saved"].items():
                assert torch.equal(again["model"][k], v), f"{what}: {k}"
            assert again["optimizer"].keys() == again["saved_optimizer"].keys()
            for p, st in again["saved_optimizer"].items():
                for k, v in st.items():
                    assert torch.equal(torch.as_tensor(again["optimizer"][p][k]), torch.as_tensor(v)), \
                        f"{what}: optimizer {p}.{k}"
            assert again["loss"] == pytest.approx(ref_losses[SAVED_AT], rel=RTOL, abs=ATOL), what
            _close(again["final"], ref_final, what)
    for rank, res in enumerate(two):
        what = f"2-rank reload, rank {rank}"
        assert res[cid]["loss"] == pytest.approx(ref_losses[SAVED_AT], rel=RTOL, abs=ATOL), what
        _close(res[cid]["final"], ref_final, what)


@pytest.mark.parametrize("cid", list(CASES))
def test_load_into_plain_model(saved: tuple, cid: str) -> None:
    root, _, _ = saved
    name, kwargs, *_ = CASES[cid]
    ref_losses, ref_final = reference(name, kwargs, steps=SAVED_AT + 1)
    case = build(name, **kwargs)
    opt = optimizer(list(case.model.parameters()))
    assert load_into_model(case.model, root / cid, opt) == SAVED_AT
    loss = models.loss_of(case)
    assert loss.item() == pytest.approx(ref_losses[SAVED_AT], rel=RTOL, abs=ATOL)
    loss.backward()
    opt.step()
    _close({k: v.detach() for k, v in case.model.state_dict().items()}, ref_final, "plain model")


def test_mismatched_checkpoint_fails_on_every_rank(saved: tuple) -> None:
    _, _, two = saved
    for rank, res in enumerate(two):
        assert "different model" in res["mismatch"] or "shape" in res["mismatch"], f"rank {rank}: {res}"


@pytest.mark.parametrize("cid", list(CASES))
def test_every_entry_written_once(saved: tuple, cid: str) -> None:
    """Each entry's chunks tile it exactly once; tensor-parallel shards come from different ranks."""
    root, _, _ = saved
    name, kwargs, spec, *_ = CASES[cid]
    md = FileSystemReader(str(root / cid)).read_metadata()
    case = build(name, **kwargs)
    fqns = {f"model.{k}" for k in case.model.state_dict()}
    model_keys = {k for k in md.state_dict_metadata if k.startswith("model.")}
    assert model_keys <= fqns
    if kwargs.get("tie_embeddings"):
        assert len(model_keys) == len(fqns) - 1  # the tied weight once
    else:
        assert model_keys == fqns
    files_of: dict[str, set[str]] = {}
    for index, info in md.storage_data.items():
        files_of.setdefault(index.fqn, set()).add(info.relative_path)
    sharded = 0
    for key, entry in md.state_dict_metadata.items():
        if not hasattr(entry, "chunks"):
            continue
        covered = sum(int(torch.Size(c.sizes).numel()) for c in entry.chunks)
        assert covered == int(torch.Size(entry.size).numel()), f"{key}: chunks overlap or leave gaps"
        if len(entry.chunks) > 1:
            sharded += 1
            assert len(files_of[key]) == len(entry.chunks), f"{key}: shards should come from different ranks"
    assert (sharded > 0) == ("tp" in spec), "tensor-parallel shards are written as DTensor shards"
    assert any(k.startswith("optim.state.") and k.endswith(".exp_avg") for k in md.state_dict_metadata)


def test_single_process_program_roundtrip(tmp_path: Path) -> None:
    case, prog = compile_case("gpt", {"layers": 2, "batch": 4}, {}, 0, 1)
    prog.step(*case.example_inputs, target=case.example_target)
    prog.save(str(tmp_path / "c"))
    _, again = compile_case("gpt", {"layers": 2, "batch": 4}, {"pp": 1, "m": 2}, 0, 1)
    again.load(str(tmp_path / "c"))
    assert again.step_count == 1
    a, b = prog.state_dict(), again.state_dict()
    for k, v in a["model"].items():
        assert torch.equal(b["model"][k], v), k
    assert checkpoint.latest(tmp_path) is None  # "c" is not a step_<n> directory


class _WithBuffer(torch.nn.Module):
    """A persistent buffer the forward reads, and a module the forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.unused = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_buffers_and_unused_parameters_are_saved(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x, y = _WithBuffer(), torch.randn(4, 8), torch.randn(4, 8)
    loss_fn = torch.nn.functional.mse_loss
    g = capture(model, (x,), loss_fn, y)
    prog = Program(model, plan_for(g, 1, {}), (x,), y, loss_fn, optimizer, 0, 1, graph=g)
    prog.step(x, target=y)
    prog.save(str(tmp_path / "c"))
    torch.manual_seed(1)
    fresh = _WithBuffer()
    load_into_model(fresh, tmp_path / "c")
    _close({k: v.detach() for k, v in fresh.state_dict().items()}, prog.state_dict()["model"], "plain model")


def test_checkpoint_errors_say_what_is_wrong(tmp_path: Path) -> None:
    case, prog = compile_case("gpt", {"layers": 2, "batch": 4}, {}, 0, 1)
    prog.save(str(tmp_path / "small"))
    with pytest.raises(CheckpointError, match="does not exist"):
        prog.load(str(tmp_path / "nothing"))
    bigger = build("gpt", layers=3, batch=4)
    with pytest.raises(CheckpointError, match="has no entry .* different model"):
        load_into_model(bigger.model, tmp_path / "small")
    smaller = build("gpt", layers=1, batch=4)
    with pytest.raises(CheckpointError, match="does not have .* different model"):
        load_into_model(smaller.model, tmp_path / "small")
    wider = build("gpt", layers=2, batch=4, hidden=32)
    with pytest.raises(CheckpointError, match="shape"):
        load_into_model(wider.model, tmp_path / "small")


def test_latest_and_prune(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        d = checkpoint.step_dir(tmp_path, step)
        d.mkdir()
        if step < 3:
            (d / ".metadata").write_bytes(b"")
    assert checkpoint.latest(tmp_path) == (2, checkpoint.step_dir(tmp_path, 2))  # step 3 never finished
    checkpoint.prune(tmp_path, keep=1)
    assert not checkpoint.step_dir(tmp_path, 1).exists() and checkpoint.step_dir(tmp_path, 2).exists()
