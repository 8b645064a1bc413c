"""`autopar diff a.json b.json`: what changed between two plans.

In order: the plan-wide options (schedule, chunks, precision, optimizer, global batch, memory reserve, the
cluster), the predicted figures (step time, samples/s, MFU, bubble, fits), then a row per device with what each
plan runs on it (pipeline, stage, layers, tensor-parallel degree, ZeRO, recompute, offload, send dtype, batch
share and micro-batches; or idle) and its predicted peak memory, only for the devices where something differs.
Everything is read from the two plans (layout.py), as `explain()` reads it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import PlanError
from ..report import fmt_bytes, fmt_time, render_table
from .layout import DeviceRole, device_roles

if TYPE_CHECKING:
    from ..ir.plan import Plan


def load_plan_file(path: str | os.PathLike) -> Plan:
    """The plan saved at `path` (`Plan.to_json()`, `autopar plan --json`); a PlanError naming the file and the
    fix when it is missing, not JSON or not a plan."""
    from ..ir.plan import Plan

    p = Path(path)
    fix = "write one with `autopar plan MODULE:FUNCTION --cluster C --json FILE` or `plan.to_json()`"
    if not p.is_file():
        raise PlanError(f"{str(p)!r}: no such plan file; {fix}.")
    try:
        data = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlanError(f"{str(p)!r} is not a plan: not JSON ({e}); {fix}.") from None
    if not isinstance(data, dict) or "pipelines" not in data:
        what = f"a JSON {type(data).__name__}" + (f" with keys {sorted(data)[:6]}" if isinstance(data, dict) else "")
        raise PlanError(f"{str(p)!r} is not a plan: {what}, no 'pipelines'; {fix}.")
    try:
        return Plan.from_dict(data)
    except PlanError as e:
        raise PlanError(f"{str(p)!r} is not a plan: {e}; {fix}.") from None


def _runs(role: DeviceRole) -> str:
    """What a plan runs on one device, in one cell."""
    if role.idle_why is not None:
        return "idle"
    out = []
    for s in role.stages:
        opts = [f"tp{s.tp}" if s.tp > 1 else "", f"cp{s.cp}" if s.cp > 1 else "", f"zero{s.zero}" if s.zero else "",
                f"recompute {s.recompute}" if s.recompute != "no" else "",
                "offload " + "+".join(s.offload) if s.offload else "", f"send {s.compress}" if s.compress else ""]
        out.append(f"p{s.pipeline} s{s.stage} layers {s.layers[0]}-{s.layers[1] - 1}"
                   + "".join(f" {o}" for o in opts if o))
    count, size = role.microbatches
    return "; ".join(out) + f"; batch {role.batch_share} ({count} x {size})"


def _change(a: float | None, b: float | None, fmt: Any) -> str:
    if a is None and b is None:
        return ""
    if a is None or b is None:
        return f"{fmt(a) if a is not None else '-'} -> {fmt(b) if b is not None else '-'}"
    if a == b:
        return f"{fmt(a)} (same)"
    rel = f" ({100 * (b / a - 1):+.1f}%)" if a else ""
    return f"{fmt(a)} -> {fmt(b)}{rel}"


def diff(a: Plan, b: Plan, names: tuple[str, str] = ("a", "b")) -> str:
    """What changed from plan `a` to plan `b` (module docstring), as text."""
    lines = [f"{names[0]}: {a.model.get('name', '?')} on {a.cluster.get('name', '?')}",
             f"{names[1]}: {b.model.get('name', '?')} on {b.cluster.get('name', '?')}"]
    if a.model.get("name") != b.model.get("name") or a.model.get("num_layers") != b.model.get("num_layers"):
        lines.append(f"note: different models ({a.model.get('name')}, {a.model.get('num_layers')} layers vs "
                     f"{b.model.get('name')}, {b.model.get('num_layers')} layers): layer indices differ in meaning")
    options = []
    for key, get in (("schedule", lambda p: p.schedule), ("chunks", lambda p: p.chunks),
                     ("precision", lambda p: p.precision), ("optimizer", lambda p: p.optimizer),
                     ("global batch", lambda p: p.global_batch), ("memory reserve", lambda p: p.memory_reserve),
                     ("data-parallel pipelines", lambda p: len(p.pipelines)),
                     ("devices used", lambda p: f"{p.world_size} of {len(p.device_names())}"),
                     ("cluster", lambda p: p.cluster.get("name", "?"))):
        va, vb = get(a), get(b)
        if va != vb:
            options.append(f"  {key}: {va} -> {vb}")
    if a.cluster != b.cluster and a.cluster.get("name") == b.cluster.get("name"):
        options.append("  cluster: same name, different description (devices, links or memory)")
    lines += ["options:"] + (options or ["  the same"])
    pa, pb = a.predicted, b.predicted
    lines.append("predicted:")
    lines.append("  step time: " + _change(pa.get("step_time_s"), pb.get("step_time_s"), fmt_time))
    lines.append("  samples/s: " + _change(pa.get("samples_per_s"), pb.get("samples_per_s"), lambda x: f"{x:.4g}"))
    for key, label in (("mfu", "MFU"), ("bubble_fraction", "pipeline bubble")):
        if key in pa or key in pb:
            lines.append(f"  {label}: " + _change(pa.get(key), pb.get(key), lambda x: f"{100 * x:.3g}%"))
    if pa.get("fits") != pb.get("fits"):
        lines.append(f"  fits in memory: {pa.get('fits')} -> {pb.get('fits')}")
    ra = {r.device: r for r in device_roles(a)}
    rb = {r.device: r for r in device_roles(b)}
    peak_a = {int(d): v for d, v in (pa.get("peak_memory_bytes") or {}).items()}
    peak_b = {int(d): v for d, v in (pb.get("peak_memory_bytes") or {}).items()}
    rows = [["device", "type", f"{names[0]} runs", f"{names[1]} runs", "peak memory"]]
    same = 0
    for d in sorted(set(ra) | set(rb)):
        x = _runs(ra[d]) if d in ra else "not in the cluster"
        y = _runs(rb[d]) if d in rb else "not in the cluster"
        mem = _change(peak_a.get(d), peak_b.get(d), fmt_bytes)
        if x == y and peak_a.get(d) == peak_b.get(d):
            same += 1
            continue
        kind = (ra.get(d) or rb[d]).type
        rows.append([str(d), kind, x, "same" if x == y else y, mem])
    if len(rows) > 1:
        lines += ["per device (devices where something changed):", render_table(rows)]
    lines.append(f"{same} device(s) unchanged" if len(rows) > 1 else "per device: nothing changed")
    return "\n".join(lines)


def diff_files(a: str | os.PathLike, b: str | os.PathLike) -> str:
    """`autopar diff a.json b.json`: `diff` of the two plan files, named by their paths."""
    return diff(load_plan_file(a), load_plan_file(b), (str(a), str(b)))


__all__ = ["diff", "diff_files", "load_plan_file"]
