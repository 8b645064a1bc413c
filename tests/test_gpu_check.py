"""bench/gpu_check.py without a GPU: argument parsing, the guarded runner and its budget, the JSON report,
the capped-device cluster, and the whole section pipeline on the CPU with tiny shapes (--cpu)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from autopar import models
from autopar.cluster import Cluster, GiB

from . import bench_scripts


@pytest.fixture(scope="module")
def gpu_check():
    return bench_scripts.load("gpu_check")  # by path, as `python bench/gpu_check.py` would run it


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_parse_args(gpu_check):
    a = gpu_check.parse_args([])
    assert a.out is None and a.budget_s == 270 and not a.cpu  # main picks gpu_check(_cpu).json by the mode
    assert a.precision == "fp32" and a.skip == [] and a.cap_gib is None
    a = gpu_check.parse_args(["--dry-run", "--skip", "kernels,calibrate", "--cap-gib", "6", "--steps", "2"])
    assert a.cpu and a.skip == ["kernels", "calibrate"] and a.cap_gib == 6.0 and a.steps == 2
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--skip", "kernel"])  # a typo is refused, not silently ignored


def test_deadline(gpu_check):
    clock = Clock()
    d = gpu_check.Deadline(10, clock)
    clock.t = 4.0
    assert d.elapsed() == 4.0 and d.left() == 6.0 and not d.expired()
    clock.t = 10.0
    assert d.expired()


def test_runner_guards_sections_and_stops_at_the_budget(gpu_check, tmp_path):
    clock = Clock()
    ctx = gpu_check.Context(gpu_check.parse_args(["--cpu", "--skip", "kernels"]), gpu_check.Deadline(100, clock),
                            True, tmp_path)

    def ok(ctx):
        clock.t += 60
        return {"headline": "fine"}

    def broken(ctx):
        raise ValueError("broken\nsecond line")

    def not_here(ctx):
        raise gpu_check.Skip("not here")

    def oom(ctx):
        clock.t += 50
        return {"finding": "out of memory", "headline": "ran"}

    def never(ctx):
        raise AssertionError("must not start")

    written = []
    sections = [("env", ok), ("nccl_program", broken), ("kernels", never), ("calibrate", not_here),
                ("gpt_1gpu", oom), ("gpt_capped", never)]
    results = gpu_check.run_sections(sections, ctx, after_each=lambda r: written.append(len(r)))
    assert [(r["section"], r["status"]) for r in results] == [
        ("env", "ok"), ("nccl_program", "failed"), ("kernels", "skipped"), ("calibrate", "skipped"),
        ("gpt_1gpu", "finding"), ("gpt_capped", "skipped")]
    assert results[1]["error"] == "ValueError: broken" and "Traceback" in results[1]["traceback"]
    assert results[2]["reason"] == "--skip" and results[3]["reason"] == "not here"
    assert results[5]["reason"] == "budget of 100 s used up"
    assert written == [1, 2, 3, 4, 5, 6]  # the report is rewritten after every section
    assert gpu_check.exit_code(results) == 1  # a failed section fails the run ...
    assert gpu_check.exit_code([results[0], results[3], results[4]]) == 0  # ... a finding or a skip does not

    path = gpu_check.write_report(results, tmp_path / "sub" / "r.json", {"mode": "test"})
    d = json.loads(path.read_text())
    assert d["meta"] == {"mode": "test"} and [r["section"] for r in d["rows"]] == [s for s, _ in sections]
    assert d["summary"]["failed"] == ["nccl_program"] and d["summary"]["finding"] == ["gpt_1gpu"]
    assert d["summary"]["exit_code"] == 1 and not list(path.parent.glob("*.tmp"))
    text = gpu_check.report_text(results)
    assert "ValueError: broken" in text and "budget of 100 s used up" in text and "fine" in text


def test_capped_cluster_keeps_the_device_but_its_memory(gpu_check):
    capped = Cluster.load(gpu_check.capped_cluster({"nodes": [{"device": "H200"}]}, 6 * GiB))
    spec, h200 = capped.devices[0].spec, Cluster.load("1x1xH200").devices[0].spec
    assert spec.name == "H200"  # so the calibrated H200 profile prices it
    assert spec.memory == 6 * GiB and h200.memory > 100 * GiB
    assert spec.peak_flops == h200.peak_flops and spec.memory_bandwidth == h200.memory_bandwidth
    custom = {"name": "NVIDIA X", "based_on": "A100-80GB", "memory_GiB": 79.0}
    spec = Cluster.load(gpu_check.capped_cluster({"nodes": [{"device": custom}]}, 8 * GiB)).devices[0].spec
    assert spec.name == "NVIDIA X" and spec.memory == 8 * GiB


def test_release_storage_frees_the_models_copy(gpu_check):
    case = models.gpt(batch=2, seq=8, vocab=32, hidden=16, layers=1, heads=2, tie_embeddings=True)
    unique = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in case.model.parameters()}
    assert gpu_check.release_storage(case.model) == sum(unique.values())  # the tied weight once
    assert all(p.untyped_storage().nbytes() == 0 for p in case.model.parameters())


class FakeKernelBench:
    """bench/fused_kernels.py's interface with fixed figures: the kernel section's summary without a GPU."""

    def __init__(self, ran: str) -> None:
        self.ran = ran

    def cases(self) -> dict:
        return {"elementwise": None, "softmax": None}

    def check(self, kind: str, case: object, device: str, timed: bool, inductor: bool) -> dict:
        assert device == "cuda" and timed and not inductor
        return {"kind": kind, "regions": kind, "kernels_ran": self.ran if kind == "softmax" else "yes",
                "max_rel_err": 1e-7 if kind == "softmax" else 3e-7, "eager_ms": 2.0, "kernel_ms": 0.5 if
                kind == "softmax" else 2.0, "speedup_vs_eager": 4.0 if kind == "softmax" else 1.0}


def test_kernel_section_summarises_and_fails_on_a_fallback(gpu_check, tmp_path, monkeypatch):
    ctx = gpu_check.Context(gpu_check.parse_args([]), gpu_check.Deadline(300), False, tmp_path)
    monkeypatch.setattr(gpu_check, "_load_kernel_bench", lambda: FakeKernelBench("yes"))
    f = gpu_check.section_kernels(ctx)
    assert f["max_rel_err"] == 3e-7 and f["geomean_speedup_vs_eager"] == pytest.approx(2.0)
    assert not f["fell_back_to_torch"] and [r["kind"] for r in f["rows"]] == ["elementwise", "softmax"]
    monkeypatch.setattr(gpu_check, "_load_kernel_bench", lambda: FakeKernelBench("no: forward kernel failed"))
    with pytest.raises(AssertionError, match=r"fell back: \['softmax'\]"):
        gpu_check.section_kernels(ctx)


def test_cpu_pipeline_runs_every_section(gpu_check, tmp_path):
    out = tmp_path / "gpu_check.json"
    before = os.environ.get("AUTOPAR_PROFILE_DIR")
    rc = gpu_check.main(["--cpu", "--out", str(out), "--steps", "2", "--budget-s", "300"])
    assert os.environ.get("AUTOPAR_PROFILE_DIR") == before  # the run's own profile dir is not left behind
    assert (tmp_path / "gpu_check_files" / "profiles").is_dir()
    d = json.loads(out.read_text())
    rows = {r["section"]: r for r in d["rows"]}
    assert list(rows) == list(gpu_check.SECTIONS)
    assert all(r["status"] in ("ok", "finding", "failed", "skipped") and r["seconds"] >= 0 for r in rows.values())
    assert rc == 0 and not d["summary"]["failed"], {k: r.get("error") for k, r in rows.items()}
    assert rows["env"]["figures"]["mode"] == "cpu"
    assert rows["kernels"]["status"] == "skipped" and rows["kernels"]["reason"].startswith("no CUDA")
    assert rows["calibrate"]["status"] == "skipped"

    prog = rows["nccl_program"]["figures"]
    assert prog["backend"] == "gloo" and prog["match"] and prog["loss_falling"]
    assert prog["auto"]["max_loss_diff"] <= 1e-5 and len(prog["auto"]["losses"]) == gpu_check.SMALL_STEPS

    ready = rows["nccl_ready"]["figures"]  # a CPU-built model on the rank's device, equal to eager
    assert rows["nccl_ready"]["status"] == "ok" and ready["backend"] == "gloo"
    assert ready["params_on_device"] and ready["loss_match"] and ready["params_match"]
    assert ready["state_dict_devices"] == ["cpu"] and len(ready["syncs_per_step"]) == gpu_check.SMALL_STEPS
    assert max(ready["syncs_per_step"]) <= 1 and ready["wait"]["wait_blocked_host"] is False

    for name in ("gpt_1gpu", "gpt_capped"):
        f = rows[name]["figures"]
        assert rows[name]["status"] == "ok"
        assert f["predicted_step_s"] > 0 and f["measured_step_s"] > 0 and f["predicted_peak_GiB"] > 0
        assert all(math.isfinite(x) for x in f["losses"]) and f["losses"][-1] < f["losses"][0]
        assert f["freed_model_copy_GiB"] > 0 and Path(f["plan_file"]).is_file()
    capped = rows["gpt_capped"]["figures"]
    # the cap is below the training state, so the plan must move state off the device
    assert capped["cap_GiB"] < capped["training_state_GiB"] and capped["offload"]
    assert capped["predicted_peak_GiB"] <= capped["cap_GiB"]
    # the CPU stand-in's allocator holds the offloaded optimizer's host copies too: its plan check adds the
    # plan's host overlap to the device peak (it measured 2.23x the device peak alone)
    assert capped["plan_drift"] == [] and 0.85 <= capped["plan_check"]["ratio"] <= 1.15, capped
