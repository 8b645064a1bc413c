"""How a plan is shown: `Plan.explain()`'s table of stages x device groups and `Plan.timeline()`'s trace, and the
entry points of `Plan.report()` (html_report.py: a page to open in a browser) and `Plan.plot()` (plot.py: a
picture, with matplotlib).

All read only what a `Plan` carries (its stages' predictions, the embedded cluster and model summary), so a
plan read back from JSON shows the same. The plan itself, and how its step is simulated, are plan.py and
plan_simulate.py; `Plan.explain()`, `timeline()`, `report()` and `plot()` are thin methods over this module
(the one view module the plan imports: tests/test_layers.py `UPWARD`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..ir.precision import compute_description
from ..report import fmt_bytes, fmt_count, fmt_time, render_table
from .layout import layer_label, ranges, recompute_label

if TYPE_CHECKING:
    from ..ir.plan import Pipeline, Plan


def _pipeline_key(p: Pipeline) -> tuple:
    """What makes two replicas look the same in the table: everything but their devices."""
    return (p.batch_share, p.microbatch_size, p.num_microbatches,
            tuple((tuple(s.layers), len(s.devices), s.cp, s.zero, repr(s.recompute), tuple(s.offload), s.compress,
                   tuple(sorted(s.predicted.items()))) for s in p.stages))


MAX_PROBLEM_LINES = 8  # the rest are in predicted["memory_problems"]


def _does_not_fit(problems: list[str]) -> list[str]:
    shown = problems[:MAX_PROBLEM_LINES]
    more = [f"  ... and {len(problems) - len(shown)} more (predicted['memory_problems'])"] \
        if len(problems) > len(shown) else []
    return ([f"DOES NOT FIT in memory ({len(problems)} problem(s)); the predictions below are for a run that "
             f"would fail:"] + [f"  {p}" for p in shown] + more)


def _idle_tail(pr: dict[str, Any]) -> str:
    """The idle time that is not pipeline bubble: the end-of-step gradient sync and optimizer step after the
    last backward (nothing left to overlap them with) and waiting for slower data-parallel replicas."""
    text = f", gradient sync not overlapped {100 * pr.get('exposed_sync_fraction', 0.0):.1f}%"
    wait = pr.get("replica_wait_fraction", 0.0)
    return text + (f", waiting for slower replicas {100 * wait:.1f}%" if wait >= 5e-4 else "")


def _async_line(a: dict[str, Any] | None) -> list[str]:
    """`predicted["async"]` (autopar.plan(..., sync="2bw" | "wsp"), runtime/asynchronous.py) in one line."""
    if not a:
        return []
    sync_ms = f"{a['sync_step_time_s'] * 1e3:.4g} ms/step synchronous"
    if a["sync"] == "sync":
        why = a.get("reason") or "predicted no faster"
        return [f"asynchrony (sync={a['asked']!r} allowed): not chosen ({why}); {sync_ms}"]
    pending = a.get("pending_gradient_bytes") or {}
    memory = (f"; memory: its {a['staleness']} pending wave gradient(s) add up to {fmt_bytes(max(pending.values()))} "
              f"per device, in the peak memory below" if pending else "")
    return [f"asynchrony (predicted): sync={a['sync']!r}, staleness {a['staleness']} (each gradient computed on "
            f"weights {a['staleness']} update(s) old): {a['step_time_s'] * 1e3:.4g} ms/step against {sync_ms}, "
            f"x{a['speedup']:.3g}" + memory]


def _cp_line(pred: dict[str, Any] | None) -> list[str]:
    """`predicted["cp"]` (context parallelism, solver/pricing/context.py) in one line: the degree and attention chosen
    and what the exchange costs (per attention call, per ring step against the block computation it hides behind,
    exposed per training step), or why cp was not chosen."""
    if not pred:
        return []
    cp = pred.get("chosen", 1)
    if cp == 1:
        # (only where cp > 1 was considered: every attention model's plan says why not in predicted["cp"])
        return [f"context parallelism: cp=1, {pred['reason']}"] + _travel_line(pred.get("travel")) \
            if pred.get("considered") else []
    line = f"context parallelism: cp={cp}, {pred.get('attention', 'ring')} attention"
    ex = pred.get("exchange")
    if ex:
        line += (f", {ex['tokens_per_rank']} tokens of each sequence per rank; per attention call each rank sends "
                 f"{fmt_bytes(ex['bytes_per_call']['forward'])} forward, {fmt_bytes(ex['bytes_per_call']['backward'])} "
                 f"backward")
        ring = ex.get("ring_step")
        if ring:
            f, b = ring["forward"], ring["backward"]
            line += (f"; per ring step ({ring['steps']} per call each way, then the dK/dV sent home) "
                     f"{fmt_bytes(f['bytes'])} in "
                     f"{fmt_time(f['transfer_s'])} beside a {fmt_time(f['block_compute_s'])} forward block, "
                     f"{fmt_bytes(b['bytes'])} in {fmt_time(b['transfer_s'])} beside a "
                     f"{fmt_time(b['block_compute_s'])} backward block")
        line += (f"; {fmt_bytes(ex['bytes_per_step'])} sent and {fmt_time(ex['exposed_s_per_step'])} exposed per "
                 f"step and device (predicted)")
    if pred.get("reason"):
        line += f"; {pred['reason']}"
    return [line] + _travel_line(pred.get("travel"))


def _travel_line(travel: dict[str, Any] | None) -> list[str]:
    """`predicted["cp"]["travel"]`: the weights-travel and activations-travel layouts over every device, priced."""
    if not travel:
        return []

    def one(what: str, t: dict[str, Any]) -> str:
        if "error" in t:
            return f"{what} travel ({t['plan']}): cannot run ({t['error']})"
        fits = "" if t["fits"] else ", does not fit"
        return (f"{what} travel ({t['plan']}): {fmt_time(t['step_time_s'])}/step, {fmt_time(t['comm_s'])} "
                f"communication{fits}")
    parts = [one(w.capitalize() if i == 0 else w, travel[w]) for i, w in enumerate(("weights", "activations"))
             if w in travel]
    return ["  " + "; ".join(parts) + " (predicted)"]


def _cost_and_idle(pr: dict[str, Any], names: dict[int, str]) -> list[str]:
    """The predicted price of the plan (cluster files with `price_per_hour`) and the devices it leaves out."""
    out = []
    if pr.get("cost_per_hour") is not None:
        out.append(f"cost (predicted): {pr['cost_per_hour']:.4g} per hour for the devices used, "
                   f"{pr['cost_per_sample']:.4g} per sample")
    # devices of one type left out for one reason share a line ('devices 0-1,4 (RTX-3090) left out: ...')
    groups: dict[tuple[str, str], list[int]] = {}
    for d, why in sorted((pr.get("idle_devices") or {}).items(), key=lambda kv: int(kv[0])):
        groups.setdefault((names.get(int(d), "?"), why), []).append(int(d))
    for (name, why), ds in sorted(groups.items(), key=lambda kv: kv[1][0]):
        which = f"device {ds[0]}" if len(ds) == 1 else f"devices {ranges(ds)}"
        out.append(f"{which} ({name}) left out: {why}")
    return out


def _has_tf32(plan: Plan, device_type: str) -> bool:
    """Whether `device_type` of the plan's cluster has TF32 tensor cores (a TF32 peak above its fp32 one)."""
    from ..cluster import Cluster

    spec = Cluster.load(plan.cluster).spec(device_type)
    return spec.kind != "cpu" and spec.peak_flops["tf32"] > spec.peak_flops["fp32"]


def _reroute_line(block: dict | None) -> list[str]:
    """Re-routing around a lost rank (runtime/reroute.py): off and why, or its pre-step copy per device."""
    if not block:
        return []
    if not block.get("on"):
        return [f"re-routing a lost rank: off ({block.get('why', '?')})"]
    if block.get("fits") is None:
        return [f"re-routing a lost rank: on, pre-step copy not priced ({block.get('error', '?')})"]
    copies = {int(d): b for d, b in block.get("copy_bytes", {}).items()}
    most = max(copies, key=copies.get, default=None)
    head = (f"re-routing a lost rank: on; pre-step copy of each rank's state up to {fmt_bytes(copies[most])} "
            f"(device {most}), " if most is not None else "re-routing a lost rank: on; ")
    if block["fits"]:
        return [head + "fits on top of every device's peak (predicted)"]
    return [head + "DOES NOT FIT, so re-routing is off: " + " ".join(block.get("memory_problems") or [])]


def explain(plan: Plan) -> str:
    pr = plan.predicted
    names = plan.device_names()
    peak = pr.get("peak_memory_bytes", {})
    cap = pr.get("memory_capacity_bytes", {})
    n_dp = len(plan.pipelines)
    sched = plan.schedule + (f" x{plan.chunks} chunks" if plan.chunks > 1 else "")
    wire = plan.precision if plan.precision in ("bf16", "fp16") else "-"  # mixed precision sends 2-byte values
    # a plan that does not fit says so before any figure: its speed is that of a run that would fail
    lines = _does_not_fit(pr.get("memory_problems") or []) if pr.get("fits") is False else []
    lines += [
        f"model {plan.model.get('name', '?')}: {fmt_count(plan.model.get('params', 0))} params, "
        f"{plan.model.get('num_layers', '?')} layers in the coarse chain",
        f"cluster {plan.cluster.get('name', '?')}: {plan.world_size} devices"
        + (f" of its {len(names)} used" if len(names) > plan.world_size else "") + "; "
        f"global batch {plan.global_batch}, {plan.precision}, optimizer {plan.optimizer}, schedule {sched}, "
        f"{n_dp} data-parallel "
        f"pipeline(s)",
        "compute: " + "; ".join(f"{t}: {compute_description(plan.precision, t, _has_tf32(plan, t))}"
                                for t in dict.fromkeys(names.values())),
    ]
    if "step_time_s" in pr:
        lines.append(f"predicted: {fmt_time(pr['step_time_s'])}/step, {pr['samples_per_s']:.4g} samples/s, "
                     f"{pr['tflops_per_device']:.4g} TFLOP/s per device, MFU {100 * pr['mfu']:.1f}%, "
                     f"pipeline bubble {100 * pr.get('bubble_fraction', 0.0):.1f}%"
                     + _idle_tail(pr))
    lines += _cost_and_idle(pr, names) + _async_line(pr.get("async")) + _reroute_line(pr.get("reroute"))
    lines += _cp_line(pr.get("cp"))
    if plan.experts:
        ex = plan.experts
        lines.append(f"experts: ep={ex['degree']}, {ex['experts_per_rank']} of {ex['experts']} experts (top-"
                     f"{ex['top_k']}) per device in groups {ex['groups'] or 'none'}; replicated MoE layers: "
                     f"{', '.join(ex['replicated']) or 'none'}")
    head = ["pipeline", "stage", "layers", "devices", "type", "tp", "dp", "batch", "micro-batches", "ZeRO",
            "recompute", "offload", "send as", "compute", "comm", "bubble", "peak mem / capacity"]
    with_cp = any(s.cp > 1 for p in plan.pipelines for s in p.stages)  # a cp column only where a stage has one
    if with_cp:
        head.insert(6, "cp")
    rows = [head]
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(plan.pipelines):
        groups.setdefault(_pipeline_key(p) if n_dp > 8 else (i,), []).append(i)
    for members in groups.values():
        p = plan.pipelines[members[0]]
        label = ranges(members)
        for j, s in enumerate(p.stages):
            devs = [d for i in members for d in plan.pipelines[i].stages[j].devices]
            mem = max((peak.get(d, 0) for d in devs), default=0)
            capacity = min((cap.get(d, 0) for d in devs), default=0)
            sp = s.predicted
            row = [
                label, str(j), layer_label(plan, *s.layers), ranges(devs), names.get(s.devices[0], "?"),
                str(s.tp), str(n_dp), str(p.batch_share) + (" each" if len(members) > 1 else ""),
                f"{p.num_microbatches} x {p.microbatch_size}", str(s.zero), recompute_label(s.recompute),
                "+".join(s.offload) or "-", s.compress or (wire if j + 1 < len(p.stages) else "-"),
                fmt_time(sp.get("compute_s", 0.0)),
                fmt_time(sp.get("comm_s", 0.0)), fmt_time(sp.get("bubble_s", 0.0)),
                f"{fmt_bytes(mem)} / {fmt_bytes(capacity)}"
                + (f" ({100 * mem / capacity:.0f}%)" if capacity else ""),
            ]
            if with_cp:
                row.insert(6, str(s.cp))
            rows.append(row)
    lines += ["", render_table(rows, right={5, 6, 7, 8, 14, 15, 16} if with_cp else {5, 6, 7, 13, 14, 15})]
    lines.append(f"memory reserve {100 * plan.memory_reserve:.0f}% of each device's capacity; "
                 f"comm = tensor-parallel all-reduces + ZeRO/offload transfers + pipeline sends + "
                 f"gradient sync")
    lines += sorted({f"tp {s.tp}: {s.predicted['tp_reason']}" for p in plan.pipelines for s in p.stages
                     if s.predicted.get("tp_reason")})  # which tensor-parallel price, and why (intra_op.pricing)
    sources = [(i, j, s.predicted["compute_source"]) for i, p in enumerate(plan.pipelines)
               for j, s in enumerate(p.stages) if s.predicted.get("compute_source")]
    if sources:  # measured blocks (`plan(..., profile=)`): which figures were measured, the rest analytic
        lines += [f"compute of pipeline {i} stage {j}: {src}" for i, j, src in sources]
        lines.append("compute of the layers not named here: analytic")
    else:
        lines.append("compute: analytic (no block profile: `autopar profile`, `plan(..., profile=)`)")
    if any(s.compress or (wire != "-" and len(p.stages) > 1) for p in plan.pipelines for s in p.stages):
        lines.append("send as: dtype of the activations sent to the next stage and of the gradients sent back "
                     "(cast back on arrival; bf16 keeps 8 mantissa bits, a relative rounding error <= 2^-9 per "
                     "element and transfer; fp16 2^-11 but overflows above 65504)")
    if plan.graph:
        from .graph_plan import explain_graph  # graph workloads: mode, node shares, halos, both modes

        lines += ["", explain_graph(plan.graph)]
    return "\n".join(lines)


def timeline_trace(plan: Plan) -> dict:
    """`Plan.timeline`'s Chrome/Perfetto trace: one simulated step of every pipeline, a process per device group
    (its first device's index), named after the pipeline, rank, devices and device type."""
    events: list[dict] = []
    names = plan.device_names()
    for i, (pipe, sim) in enumerate(zip(plan.pipelines, plan.simulate(), strict=True)):
        groups = pipe.device_groups()
        pid_of = {r: groups[r][0] for r in range(len(groups))}
        for ev in sim.to_chrome_trace()["traceEvents"]:
            ev = dict(ev, pid=pid_of[ev["pid"]])
            if ev.get("name") == "process_name":
                r = next(k for k, v in pid_of.items() if v == ev["pid"])
                ev["args"] = {"name": f"pipeline {i} rank {r}: devices {ranges(groups[r])} "
                                      f"({names.get(groups[r][0], '?')})"}
            events.append(ev)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def report(plan: Plan, path: str | os.PathLike | None, measured: Any = None) -> str:
    """`Plan.report()`: the plan as one self-contained HTML page (html_report.py), written to `path` when given;
    returns the page."""
    from .html_report import render

    page = render(plan, measured)
    if path is not None:
        Path(path).write_text(page, encoding="utf-8")
    return page


def plot(plan: Plan, path: str | os.PathLike) -> Path:
    """`Plan.plot()`: the device map and the simulated timeline as a picture (plot.py, matplotlib)."""
    from .plot import plot_plan

    return plot_plan(plan, path)


__all__ = ["MAX_PROBLEM_LINES", "explain", "plot", "ranges", "recompute_label", "report", "timeline_trace"]
