"""Models bigger than one process: a meta-built model compiled with `weights=` (runtime/weights.py).

One spawn of 4 gloo processes compiles a meta-built transformers LlamaForCausalLM (GQA, tied embeddings) four
times through `autopar.compile`: from a .safetensors file (tp=2 x pp=2), from a Hugging Face sharded directory
(dp=2 x pp=2), from the DCP checkpoint the first program saved (tp=2 x dp=2), and without weights (tp=2 x
pp=2). Training matches one process on the same weights (rtol 1e-4, atol 1e-5), and every rank allocates
only its stages' parameters (its tensor-parallel shards), read as just those slices: measured by the profiler's
allocation events over `compile` and by counting the bytes read from the weight files at `open`.
"""

from __future__ import annotations

import contextlib
import gc
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import autopar
from autopar import models
from autopar.errors import PlanError
from autopar.runtime.launch import spawn_local
from autopar.runtime.memtrace import track_memory
from autopar.runtime.program import Program

from .runtime_cases import STEPS, assert_matches_reference, optimizer, plan_for

CLUSTER = "1x4xA100-80GB"  # planned for 4 devices, run on 4 gloo processes
BATCH, SEQ, VOCAB = 4, 16, 256
STRATEGIES = {"file": autopar.Strategy(tp=2, pp=2, microbatch_size=2),
              "hf_dir": autopar.Strategy(dp=2, pp=2, microbatch_size=1),
              "dcp": autopar.Strategy(tp=2, dp=2),
              "init": autopar.Strategy(tp=2, pp=2, microbatch_size=2)}


def llama(device: str = "cpu", layers: int = 2, seed: int = 0) -> torch.nn.Module:
    """A tiny LlamaForCausalLM: grouped-query attention (4 heads, 2 kv heads), tied embeddings, rotary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         use_cache=False, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    with models.building(device, seed):
        model = LlamaForCausalLM(config)
    return model.train()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def reference(model: torch.nn.Module, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training of `model` on the example batch."""
    ids, target = batch()
    return models.train_reference(models.ModelCase(model, (ids,), models.lm_loss, target, "llama"), optimizer,
                                  steps)


def plan_json(strategy: autopar.Strategy) -> str:
    """The plan of a hand-written strategy, made on the meta model (the planner needs shapes only)."""
    ids, target = (t.to("meta") for t in batch())
    return autopar.estimate(llama("meta"), CLUSTER, strategy, (ids,), target, models.lm_loss,
                            precision="fp32").plan.to_json()


def write_hf_dir(root: Path, sd: dict[str, torch.Tensor]) -> Path:
    """A Hugging Face style directory: two shards and model.safetensors.index.json (the tied weight stored under
    both of its names, in different shards)."""
    d = root / "hf"
    d.mkdir()
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: sd[k].clone() for k in keys}, str(d / file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


def _facts(prog: Any) -> dict[str, Any]:
    """What this rank holds and made: parameter names, local shapes, bytes created and read."""
    local = lambda t: getattr(t, "_local_tensor", t)
    params = sum(local(p).numel() * local(p).element_size() for p in prog.params.values())
    buffers = sum(b.numel() * b.element_size() for b in prog.buffers.values())
    w = prog._weights
    return {"stages": list(prog.position.stages), "params": sorted(prog.params),
            "local_shapes": {k: tuple(local(p).shape) for k, p in prog.params.items()},
            "param_bytes": params, "held_bytes": params + buffers, "created_bytes": w.created_bytes,
            "read_bytes": w.source.read_bytes if w.source is not None else 0,
            "buffers": {k: b.clone() for k, b in prog.buffers.items()}}


class _CountedFile:
    """A file whose reads are counted (bytes returned by read / readinto)."""

    def __init__(self, f: Any, counter: list[int]) -> None:
        self._f, self._counter = f, counter

    def read(self, *a: Any) -> bytes:
        data = self._f.read(*a)
        self._counter[0] += len(data)
        return data

    def readinto(self, b: Any) -> int:
        n = self._f.readinto(b)
        self._counter[0] += n or 0
        return n

    def __enter__(self) -> _CountedFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


@contextlib.contextmanager
def counted_reads(root: str) -> Any:
    """Bytes read from files under `root` inside the block, counted at `open` (not by the loader)."""
    import builtins
    import io

    real_open, counter = builtins.open, [0]

    def counting_open(file: Any, mode: str = "r", *a: Any, **kw: Any) -> Any:
        f = real_open(file, mode, *a, **kw)
        return _CountedFile(f, counter) if "r" in mode and str(file).startswith(root) else f

    builtins.open = io.open = counting_open  # pathlib opens through io.open (DCP's reader)
    try:
        yield counter
    finally:
        builtins.open = io.open = real_open


def worker(rank: int, world: int, root: str, plans: dict[str, str]) -> dict[str, Any]:
    ids, target = batch()
    out: dict[str, Any] = {}

    def train(key: str, weights: Any, steps: int = STEPS) -> Any:
        gc.collect()
        with track_memory() as trace, counted_reads(root) as reads:
            prog = autopar.compile(llama("meta"), CLUSTER, (ids,), target, models.lm_loss, optimizer,
                                   plan=plans[key], timeout_s=60, weights=weights)
        facts = _facts(prog)
        facts.update(compile_peak=trace.peak_bytes, compile_live=trace.final_bytes, file_reads=reads[0])
        facts["initial"] = prog.state_dict()["model"]
        facts["losses"] = [prog.step(ids, target=target) for _ in range(steps)]
        facts["final"] = prog.state_dict()["model"]
        out[key] = facts
        return prog

    prog = train("file", str(Path(root) / "model.safetensors"))
    prog.save(str(Path(root) / "ckpt"))
    train("hf_dir", str(Path(root) / "hf"), steps=1)
    train("dcp", str(Path(root) / "ckpt"), steps=0)
    train("init", None)
    out["root"] = root
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("weights")
    sd = llama().state_dict()
    # the tied weight under its second name only: the file's names need not be the ones the program keeps
    save_file({k: v.contiguous() for k, v in sd.items() if k != "model.embed_tokens.weight"},
              str(root / "model.safetensors"))
    write_hf_dir(root, sd)
    plans = {k: plan_json(s) for k, s in STRATEGIES.items()}
    return spawn_local(worker, 4, str(root), plans, timeout_s=300), sd


def test_meta_llama_from_safetensors_trains_like_one_process(runs: tuple) -> None:
    results, _ = runs
    ref_losses, ref_final = reference(llama())
    inv_freq = llama().model.rotary_emb.inv_freq
    for rank, res in enumerate(results):
        r = res["file"]
        assert_matches_reference(r["losses"], r["final"], ref_losses, ref_final, f"rank {rank}")
        # the first stage computes the rotary tables (the non-persistent buffer is in no weights file)
        assert ("model.rotary_emb.inv_freq" in r["buffers"]) == (r["stages"] == [0]), f"rank {rank}"
        if r["stages"] == [0]:
            torch.testing.assert_close(r["buffers"]["model.rotary_emb.inv_freq"], inv_freq, rtol=0, atol=0)


def test_each_rank_allocates_and_reads_only_its_share(runs: tuple) -> None:
    results, sd = runs
    full_bytes = sum(t.numel() * t.element_size() for k, t in sd.items() if k != "lm_head.weight")
    by_stage: dict[int, set[str]] = {}
    for rank, res in enumerate(results):
        r = res["file"]
        (stage,) = r["stages"]
        by_stage.setdefault(stage, set()).update(r["params"])
        other = "model.layers.1." if stage == 0 else "model.layers.0."
        assert not any(n.startswith(other) for n in r["params"]), f"rank {rank} holds the other stage's layer"
        # tensor parallel: a sharded parameter's local part is half of it (only that shard made)
        sharded = {k: s for k, s in r["local_shapes"].items() if s != sd[k].shape}
        assert sharded, f"rank {rank}: nothing tensor-parallel"
        assert all(2 * torch.Size(s).numel() == sd[k].numel() for k, s in sharded.items()), f"rank {rank}"
        assert_allocates_and_reads_its_share(r, f"rank {rank}")
        whole = sum(sd[k].numel() * sd[k].element_size() for k in r["params"])  # its parameters unsharded
        assert r["param_bytes"] < whole < 0.6 * full_bytes, f"rank {rank}: {r['param_bytes']}, {whole}, {full_bytes}"
    # the two stages together hold the whole model; the tied embedding on both (first and last stage)
    assert by_stage[0] | by_stage[1] == {k for k in sd if k != "lm_head.weight"}
    assert "model.embed_tokens.weight" in by_stage[0] & by_stage[1]


SLACK = 16 * 1024  # capture-time scalars and index tensors, file headers: a few KiB (a tensor-parallel half: 8-32)


def assert_allocates_and_reads_its_share(r: dict, who: str, reads: bool = True, overhead: int = 0,
                                         transient: int = 0) -> None:
    """Measured, not counted by the loader: compile's peak of live allocations (torch.profiler memory events)
    is what the rank keeps, and the bytes read from the weight files (counted at `open`) are its parameters'
    (the rotary buffer is computed, not read), plus the format's `overhead`; `transient`: a tensor made whole
    before it is sharded."""
    figures = {k: r[k] for k in ("held_bytes", "param_bytes", "compile_live", "compile_peak", "file_reads")}
    assert r["held_bytes"] <= r["compile_live"] <= r["compile_peak"] <= r["held_bytes"] + transient + SLACK, \
        (who, figures)
    if reads:
        assert r["param_bytes"] <= r["file_reads"] <= r["param_bytes"] + overhead + SLACK, (who, figures)
    else:
        assert r["file_reads"] == 0, (who, figures)


def assert_same_state(got: dict, want: dict, who: str) -> None:
    """The same entries, bit for bit."""
    assert got.keys() == want.keys(), who
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=f"{who} {k}")


def test_hf_sharded_directory_with_index(runs: tuple) -> None:
    results, sd = runs
    ref_losses, ref_final = reference(llama(), steps=1)
    for rank, res in enumerate(results):
        r = res["hf_dir"]
        assert_same_state(r["initial"], sd, f"rank {rank}")
        assert_allocates_and_reads_its_share(r, f"rank {rank}")
        assert_matches_reference(r["losses"], r["final"], ref_losses, ref_final, f"rank {rank}")


def test_dcp_checkpoint_loads_into_a_fresh_meta_model(runs: tuple) -> None:
    results, _ = runs
    ckpt = Path(results[0]["root"]) / "ckpt"
    # DCP reads its metadata once and stores each tensor as torch.save bytes (a few KiB of framing each)
    overhead = (ckpt / ".metadata").stat().st_size + 8 * 1024 * len(results[0]["dcp"]["params"])
    saved = results[0]["file"]["final"]  # the state prog.save wrote (after STEPS steps, tp=2 x pp=2)
    for rank, res in enumerate(results):
        r = res["dcp"]  # reloaded under tp=2 x dp=2
        assert_same_state(r["initial"], saved, f"rank {rank}")
        # sharded entries read as DTensors: only this rank's slices
        # DCP deserializes a stored piece before copying it into its destination: one piece at a time
        largest = max(torch.Size(s).numel() * 4 for s in r["local_shapes"].values())
        assert_allocates_and_reads_its_share(r, f"rank {rank}", overhead=overhead, transient=largest)
        assert any(s != saved[k].shape for k, s in r["local_shapes"].items()), f"rank {rank}: nothing sharded"


def test_meta_model_without_weights_matches_materialize(runs: tuple) -> None:
    results, sd = runs
    model = autopar.materialize(llama("meta"), seed=0)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, llama().model.rotary_emb.inv_freq, rtol=0, atol=0)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    ref_losses, ref_final = reference(model)
    for rank, res in enumerate(results):
        r = res["init"]
        assert_same_state(r["initial"], initial, f"rank {rank}")
        # the init makes a module's tensors whole (their values do not depend on the plan), then shards them
        largest = max(sd[k].numel() * sd[k].element_size() for k in r["params"])
        assert_allocates_and_reads_its_share(r, f"rank {rank}", reads=False, transient=largest)
        assert_matches_reference(r["losses"], r["final"], ref_losses, ref_final, f"rank {rank}")


def test_deterministic_init_is_each_modules_own() -> None:
    a = autopar.materialize(llama("meta"), seed=0)
    b = autopar.materialize(llama("meta"), seed=0)
    c = autopar.materialize(llama("meta"), seed=1)
    for (k, x), y, z in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True):
        assert torch.equal(x, y), k
        if k.endswith("norm.weight"):  # Hugging Face's _init_weights: RMSNorm weights are ones
            assert torch.equal(x, torch.ones_like(x)) and torch.equal(z, x), k
        else:  # normal(0, initializer_range=0.02), another draw under another seed
            assert abs(x.std().item() - 0.02) < 0.004 and not torch.equal(x, z), k
    # each module's values depend on its name and the seed only, not on the other modules
    deeper = autopar.materialize(llama("meta", layers=3), seed=0)
    assert torch.equal(deeper.model.layers[1].mlp.up_proj.weight, a.model.layers[1].mlp.up_proj.weight)


class _NoInit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w).sum()


def _program(model: torch.nn.Module, weights: Any) -> Program:
    ids, target = batch()
    inputs = (ids.to("meta") if model.lm_head.weight.is_meta else ids,)
    g = autopar.capture(model, inputs, models.lm_loss, target.to(inputs[0].device))
    return Program(model, plan_for(g, 1, {}), (ids,), target, models.lm_loss, optimizer, 0, 1, weights=weights)


def test_mismatched_weights_name_the_entries(tmp_path: Path) -> None:
    sd = {k: v.contiguous() for k, v in llama().state_dict().items() if k != "lm_head.weight"}
    cases = {
        "missing": ({k: v for k, v in sd.items() if k != "model.norm.weight"},
                    "1 missing (e.g. ['model.norm.weight'])"),
        "unexpected": ({**sd, "model.extra.bias": torch.zeros(3)}, "1 unexpected (e.g. ['model.extra.bias'])"),
        "shape": ({**sd, "model.norm.weight": torch.ones(65)},
                  "'model.norm.weight': stored [65] vs model [64]"),
    }
    for what, (tensors, message) in cases.items():
        path = tmp_path / f"{what}.safetensors"
        save_file(tensors, str(path))
        with pytest.raises(PlanError, match=r"do not match the model") as e:
            _program(llama("meta"), str(path))
        assert message in str(e.value), what
        with pytest.raises(PlanError, match=r"do not match the model"):
            autopar.materialize(llama("meta"), weights=str(path))
    with pytest.raises(PlanError, match=r"does not exist: pass a \.safetensors file"):
        _program(llama("meta"), str(tmp_path / "nowhere"))
    # no init sets this parameter: a clear error, never silent values
    with torch.device("meta"):
        bare = _NoInit()
    with pytest.raises(PlanError, match=r"cannot make a tensor 'w' of the meta model"):
        autopar.materialize(bare)


def test_non_meta_model_trains_from_weights(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in llama().state_dict().items() if k != "lm_head.weight"}, str(path))
    prog = _program(llama(seed=7), str(path))  # other values in the model: the file's win
    ref_losses, ref_final = reference(llama())
    losses = [prog.step(batch()[0], target=batch()[1]) for _ in range(STEPS)]
    assert_matches_reference(losses, prog.state_dict()["model"], ref_losses, ref_final, "one process")


def test_directory_with_one_model_safetensors(tmp_path: Path) -> None:
    """A Hugging Face directory without an index; bf16 weights are cast to the model's dtype."""
    sd = llama().state_dict()
    save_file({k: v.to(torch.bfloat16) for k, v in sd.items() if k != "lm_head.weight"},
              str(tmp_path / "model.safetensors"))
    model = autopar.materialize(llama("meta"), weights=str(tmp_path))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32, k
        torch.testing.assert_close(v, sd[k].to(torch.bfloat16).float(), rtol=0, atol=0, msg=k)
