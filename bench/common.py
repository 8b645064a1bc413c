"""Shared helpers for bench scripts: a table printer and a JSON writer under bench/results/."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

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
