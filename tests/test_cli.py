"""The `autopar` command line: `devices` and `analyze`, in-process and as a subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.catalog import CATALOG
from autopar.cli import build_parser, load_target, main

REPO = Path(__file__).resolve().parents[1]


def _table_names(out: str) -> list[str]:
    """First column of the `devices` table, without the header and rule lines."""
    return [line.split()[0] for line in out.strip().splitlines()[2:]]


def test_devices_lists_catalog(capsys):
    assert main(["devices"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert _table_names(out) == list(CATALOG) + ["cpu"]
    header = out.splitlines()[0]
    assert header.split()[:2] == ["device", "fp32"] and "mem GB/s" in header
    a100 = next(line for line in out.splitlines() if line.startswith("A100-80GB "))
    # fp32, tf32, fp16, bf16 TFLOP/s, memory GiB, memory GB/s
    assert a100.split()[1:7] == ["19.5", "156", "312", "312", "80", "2039"] and "NVLink3 300 GB/s" in a100
    v100 = next(line for line in out.splitlines() if line.startswith("V100-16GB "))
    assert v100.split()[3:7] == ["125", "-", "16", "900"]  # fp16 peak, no bf16


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO, env=env)


def test_devices_as_module_subprocess():
    r = _run([sys.executable, "-m", "autopar.cli", "devices"])
    assert r.returncode == 0, r.stderr
    assert _table_names(r.stdout) == list(CATALOG) + ["cpu"]


@pytest.mark.skipif(shutil.which("autopar") is None, reason="console script `autopar` is not on PATH")
def test_devices_console_script():
    r = _run([shutil.which("autopar"), "devices"])
    if r.returncode != 0 and "not found" in r.stderr:  # e.g. a pyenv shim for another interpreter
        pytest.skip(f"`autopar` on PATH does not run here: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr
    assert set(_table_names(r.stdout)) == set(CATALOG) | {"cpu"}


def test_analyze_missing_module_exits_2(capsys):
    assert main(["analyze", "nonexistent_mod:fn", "--cluster", "1x1xcpu"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("autopar: error: cannot import module 'nonexistent_mod'")
    assert "Run from the directory that holds it" in err


@pytest.mark.parametrize("target, message", [
    ("autopar.models:no_such_builder", "module 'autopar.models' has no function 'no_such_builder'"),
    ("autopar.models", "expected MODULE:FUNCTION"),
])
def test_analyze_bad_target_exits_2(capsys, target, message):
    assert main(["analyze", target, "--cluster", "1x1xcpu"]) == 2
    assert message in capsys.readouterr().err


def test_analyze_bad_cluster_exits_2(capsys):
    assert main(["analyze", "autopar.models:mlp", "--cluster", "1x2xA100-80"]) == 2
    err = capsys.readouterr().err
    assert "unknown device type 'A100-80'" in err and "Did you mean 'A100-80GB'" in err


def test_analyze_mlp_prints_cost_table(capsys, tmp_path):
    assert main(["analyze", "autopar.models:mlp", "--cluster", "1x2xA100-80GB"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    total = [line for line in lines if line.startswith("TOTAL")]
    assert len(total) == 1
    assert "A100-80GB" in lines[0]  # per-device time columns named by device type
    # The default mlp(): 64 -> 128 x3 -> 10 with biases = 59,146 parameters, 4 linear layers + 1 output.
    assert "59.15K params" in total[0]
    assert sum(line.startswith("linear") for line in lines) == 5
    assert "repeated blocks: 3x" in out


def test_analyze_accepts_a_cluster_file(capsys, tmp_path):
    cluster = tmp_path / "c.yaml"
    cluster.write_text("nodes:\n  - device: T4\n    devices_per_node: 2\n")
    assert main(["analyze", "autopar.models:mlp", "--cluster", str(cluster), "--max-rows", "3"]) == 0
    out = capsys.readouterr().out
    assert "T4" in out.splitlines()[0]
    assert any(line.startswith("TOTAL") for line in out.splitlines())


def test_load_target_accepts_model_case_and_tuples(tmp_path, monkeypatch):
    model, inputs, loss_fn, target = load_target("autopar.models:mlp")
    assert inputs[0].shape == (16, 64) and target.shape == (16,) and callable(loss_fn)
    assert sum(p.numel() for p in model.parameters()) == 59146
    (tmp_path / "my_targets.py").write_text(
        "import torch\n\n"
        "def pair():\n    return torch.nn.Linear(3, 2), torch.zeros(4, 3)\n\n"
        "def bad():\n    return 5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model, inputs, loss_fn, target = load_target("my_targets:pair")
    assert isinstance(inputs, tuple) and inputs[0].shape == (4, 3) and loss_fn is None and target is None
    with pytest.raises(Exception, match=r"must return \(model, example_inputs\).*got int"):
        load_target("my_targets:bad")


def test_parser_requires_a_command_and_cluster():
    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args([])
    assert ei.value.code == 2
    with pytest.raises(SystemExit) as ei:
        main(["analyze", "autopar.models:mlp"])
    assert ei.value.code == 2
    args = build_parser().parse_args(["analyze", "m:f", "--cluster", "1x1xcpu"])
    assert (args.precision, args.max_rows, args.dump) == ("fp32", 200, None)
