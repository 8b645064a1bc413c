"""Shared helpers for bench scripts: a table printer and a JSON writer under bench/results/."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from autopar.report import render_table

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(name: str, rows: list[dict], summary: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    meta = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}
    path.write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    table = [columns] + [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    print(render_table(table, right=set(range(1, len(columns)))))


def _fmt(x: object) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def samples_per_s(build: Any, cluster: Any, plans: dict[str, str], steps: int, batch: int) -> dict[str, float]:
    """On this rank: for each plan (JSON), compile a fresh `build()` case under it and time `steps` training
    steps after one warm-up; samples/s from the median step. Call from every rank of a process group."""
    import autopar

    out = {}
    for name, plan in plans.items():
        case = build()
        prog = autopar.compile(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn,
                               plan=plan, timeout_s=120)
        times = []
        for _ in range(steps + 1):
            t = time.perf_counter()
            prog.step(*case.example_inputs, target=case.example_target)
            times.append(time.perf_counter() - t)
        out[name] = batch / statistics.median(times[1:])  # the first step warms up
    return out
