"""The README's main job and the launcher: `autopar demo` and `autopar run` through torchrun."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_demo_trains_and_matches_single_process() -> None:
    out = subprocess.run([sys.executable, "-m", "autopar.cli", "demo", "--steps", "3"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "pipeline" in out.stdout and "stage" in out.stdout  # the plan was printed
    assert "matches single-process training: yes" in out.stdout
    assert "loss falling: yes" in out.stdout


def test_run_launches_one_process_per_device(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, sys, torch
        import autopar
        from autopar import models
        from autopar.compiler import compile
        case = models.mlp(batch=8, seed=0)
        prog = compile(case.model, os.environ["AUTOPAR_CLUSTER"], example_inputs=case.example_inputs,
                       example_target=case.example_target, loss_fn=case.loss_fn,
                       optimizer=lambda p: torch.optim.SGD(p, lr=0.1), time_limit_s=10)
        losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(3)]
        ref = models.mlp(batch=8, seed=0)
        opt = torch.optim.SGD(ref.model.parameters(), lr=0.1)
        for want in losses:
            loss = models.loss_of(ref)
            assert abs(loss.item() - want) < 1e-5, (loss.item(), want)
            loss.backward(); opt.step(); opt.zero_grad()
        print(f"rank {prog.rank} of {prog.world_size} ok", flush=True)
    """))
    out = subprocess.run([sys.executable, "-m", "autopar.cli", "run", "--cluster", "1x2xcpu", str(script)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 0 of 2 ok" in out.stdout and "rank 1 of 2 ok" in out.stdout


def test_run_without_script_is_a_clear_error() -> None:
    out = subprocess.run([sys.executable, "-m", "autopar.cli", "run", "--cluster", "1x2xcpu"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "needs a script" in out.stderr
