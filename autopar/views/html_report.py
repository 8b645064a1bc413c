"""`Plan.report()`: a plan as one self-contained HTML page to open in a browser (inline CSS and SVG, no script,
nothing fetched from the network).

Sections, each read from the plan (layout.py) or, for the last, from the measured report:

* summary: model, cluster, predicted step time, samples/s, MFU, bubble, whether it fits;
* device map: every device of the cluster, node by node, with the pipeline, stage, layers, tensor-parallel group
  and batch share the plan gives it (idle devices greyed, with why), and per pipeline a strip of the layer chain
  cut into its stages;
* memory: per device its predicted peak against its capacity (the plan's reserve marked), split into parameters,
  gradients, optimizer state, activations and buffers where the plan itemizes them (`layout.MEMORY_PARTS`);
* timeline: the simulated step (`Plan.simulate()`, the simulator `timeline()` uses) as a Gantt chart, a row per
  device group and stream;
* idle devices and why (`predicted["idle_devices"]`);
* measured next to predicted, given `measured=prog.report()` (runtime/plan_check.py `RunReport`);
* `explain()`'s text, the same plan as the terminal shows it.

Every figure is also an attribute of its element (`data-*`, exact values: bytes as integers, seconds as Python's
`repr`), which tests/test_report_views.py reads back against the plan.
"""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING, Any

from ..report import fmt_bytes, fmt_count, fmt_time
from .layout import (
    PART_ORDER,
    DeviceMemory,
    DeviceRole,
    GanttGroup,
    device_memory,
    device_roles,
    gantt,
    measured_ranks,
    ranges,
)

if TYPE_CHECKING:
    from ..ir.plan import Plan

PIPELINE_COLOURS = ("#2a9d8f", "#8e6bbf", "#d1495b", "#3d5a80", "#c9a227", "#6a994e", "#bc6c25", "#5e548e",
                    "#00798c", "#9e2a2b")
KIND_COLOURS = {"forward": "#4e79a7", "backward": "#f28e2b", "weight-grad": "#e15759", "send": "#76b7b2",
                "recv": "#a0cbe8", "sync": "#59a14f", "memory": "#b07aa1"}
PART_COLOURS = {"parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer state": "#59a14f",
                "activations": "#e15759", "buffers": "#76b7b2"}
OTHER_COLOUR = "#bab0ac"

CSS = """
:root { --ink: #1f2933; --muted: #616e7c; --line: #e4e7eb; --bg: #f7f8fa; --card: #fff; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--ink);
       background: var(--bg); }
header { background: #1f2933; color: #fff; padding: 22px 32px 18px; }
header h1 { margin: 0 0 4px; font-size: 22px; font-weight: 600; }
header .sub { color: #cbd2d9; }
main { max-width: 1180px; margin: 0 auto; padding: 8px 32px 48px; }
section { background: var(--card); border: 1px solid var(--line); border-radius: 8px; padding: 16px 20px 18px;
          margin: 18px 0; }
h2 { font-size: 16px; margin: 0 0 12px; }
.note { color: var(--muted); font-size: 12.5px; margin: 8px 0 0; }
.cards { display: flex; flex-wrap: wrap; gap: 10px; margin-top: 14px; }
.stat { background: #323f4b; border-radius: 6px; padding: 8px 14px; min-width: 120px; }
.stat b { display: block; font-size: 18px; }
.stat span { color: #cbd2d9; font-size: 12px; }
.stat.bad { background: #ab091e; }
.stat.good { background: #0e7c66; }
.problems { background: #ffe3e3; border: 1px solid #ff9b9b; border-radius: 6px; padding: 8px 14px; }
.nodes { display: flex; flex-wrap: wrap; gap: 14px; }
.node { border: 1px dashed #9aa5b1; border-radius: 8px; padding: 8px 10px 10px; }
.node > .title { font-size: 12px; color: var(--muted); margin-bottom: 6px; }
.devs { display: flex; flex-wrap: wrap; gap: 8px; }
.dev { width: 196px; border-radius: 6px; padding: 7px 9px; background: #fff; border: 1px solid var(--line);
       border-left: 6px solid var(--c); font-size: 12.5px; }
.dev .name { font-weight: 600; }
.dev .what { color: var(--muted); }
.dev.idle { border-left-color: #cbd2d9; background: repeating-linear-gradient(45deg, #f5f7fa, #f5f7fa 6px,
            #eceff3 6px, #eceff3 12px); color: var(--muted); }
.strips { margin-top: 16px; }
.strip { display: flex; align-items: center; gap: 10px; margin: 4px 0; }
.strip .lbl { width: 120px; font-size: 12px; color: var(--muted); text-align: right; }
.strip .chain { flex: 1; display: flex; height: 24px; border-radius: 4px; overflow: hidden; }
.seg { color: #fff; font-size: 11.5px; padding: 4px 6px; white-space: nowrap; overflow: hidden;
       text-overflow: ellipsis; border-right: 2px solid #fff; }
.mem { display: grid; grid-template-columns: 170px 1fr 230px; gap: 6px 12px; align-items: center; }
.mem .lbl { font-size: 12.5px; text-align: right; }
.mem .fig { font-size: 12.5px; font-variant-numeric: tabular-nums; }
.track { position: relative; height: 18px; background: #eef1f4; border-radius: 3px; overflow: hidden; }
.fill { position: absolute; top: 0; bottom: 0; left: 0; display: flex; min-width: 2px; }
.fill > div { height: 100%; }
.reserve { position: absolute; top: 0; bottom: 0; border-left: 2px dashed #7b8794; }
.measured { position: absolute; top: -2px; bottom: -2px; width: 3px; background: #1f2933; }
.legend { display: flex; flex-wrap: wrap; gap: 14px; font-size: 12px; color: var(--muted); margin-top: 10px; }
.legend i { display: inline-block; width: 11px; height: 11px; border-radius: 2px; margin-right: 5px;
            vertical-align: -1px; }
svg text { font: 11px system-ui, sans-serif; fill: #3e4c59; }
table { border-collapse: collapse; font-size: 12.5px; font-variant-numeric: tabular-nums; }
th, td { padding: 4px 10px; border-bottom: 1px solid var(--line); text-align: left; }
th { color: var(--muted); font-weight: 600; }
td.num { text-align: right; }
pre { background: #1f2933; color: #e4e7eb; padding: 12px 14px; border-radius: 6px; overflow-x: auto;
      font-size: 12px; line-height: 1.35; }
ul.idle-list { margin: 0; padding-left: 18px; }
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _attrs(**kv: Any) -> str:
    return "".join(f' data-{k.replace("_", "-")}="{_e(v)}"' for k, v in kv.items())


def _summary(plan: Plan) -> str:
    pr = plan.predicted
    names = plan.device_names()
    stats = []
    if "step_time_s" in pr:
        stats += [("step (predicted)", fmt_time(pr["step_time_s"]), "step-time", repr(pr["step_time_s"])),
                  ("samples/s", f"{pr['samples_per_s']:.4g}", "samples-per-s", repr(pr["samples_per_s"])),
                  ("MFU", f"{100 * pr['mfu']:.1f}%", "mfu", repr(pr["mfu"])),
                  ("pipeline bubble", f"{100 * pr.get('bubble_fraction', 0.0):.1f}%", "bubble",
                   repr(pr.get("bubble_fraction", 0.0)))]
    stats.append(("devices used", f"{plan.world_size} of {len(names)}", "devices-used", plan.world_size))
    cards = "".join(f'<div class="stat" data-stat="{key}" data-value="{_e(raw)}"><b>{_e(text)}</b>'
                    f'<span>{_e(label)}</span></div>' for label, text, key, raw in stats)
    fits = pr.get("fits")
    if fits is not None:
        cards += (f'<div class="stat {"good" if fits else "bad"}" data-stat="fits" data-value="{fits}">'
                  f'<b>{"fits" if fits else "DOES NOT FIT"}</b><span>in memory (predicted)</span></div>')
    sched = plan.schedule + (f" x{plan.chunks} chunks" if plan.chunks > 1 else "")
    return (f'<header><h1>autopar plan: {_e(plan.model.get("name", "?"))} on {_e(plan.cluster.get("name", "?"))}'
            f'</h1><div class="sub">{_e(fmt_count(plan.model.get("params", 0)))} parameters, '
            f'{_e(plan.model.get("num_layers", "?"))} layers in the coarse chain; global batch {plan.global_batch}, '
            f'{_e(plan.precision)}, optimizer {_e(plan.optimizer)}, schedule {_e(sched)}, '
            f'{len(plan.pipelines)} data-parallel pipeline(s)</div><div class="cards">{cards}</div></header>')


def _problems(plan: Plan) -> str:
    probs = plan.predicted.get("memory_problems") or []
    if plan.predicted.get("fits") is not False or not probs:
        return ""
    items = "".join(f"<li>{_e(p)}</li>" for p in probs)
    return (f'<section class="problems" id="problems"><h2>Does not fit in memory</h2><ul>{items}</ul>'
            f'<p class="note">The figures below are for a run that would fail.</p></section>')


def _device_card(role: DeviceRole) -> str:
    head = f'<div class="name">device {role.device} · {_e(role.type)}</div>'
    if role.idle_why is not None:
        return (f'<div class="dev idle"{_attrs(device=role.device, idle="1")} title="{_e(role.idle_why)}">{head}'
                f'<div class="what">idle: {_e(role.idle_why)}</div></div>')
    colour = PIPELINE_COLOURS[role.stages[0].pipeline % len(PIPELINE_COLOURS)]
    lines = []
    for s in role.stages:
        opts = [f"tp {s.tp} ({ranges(s.tp_group)})" if s.tp > 1 else "",
                f"cp {s.cp}: 1/{s.cp} of every sequence's tokens" if s.cp > 1 else ""]
        opts += [f"ZeRO-{s.zero}" if s.zero else "", f"recompute {s.recompute}" if s.recompute != "no" else "",
                 "offload " + "+".join(s.offload) if s.offload else "", f"sends {s.compress}" if s.compress else ""]
        extra = ", ".join(o for o in opts if o)
        lines.append(f'<div class="stage"{_attrs(pipeline=s.pipeline, stage=s.stage, layers=f"{s.layers[0]}-{s.layers[1]}", tp=s.tp)}>'  # noqa: E501
                     f'pipeline {s.pipeline} · stage {s.stage}<div class="what">layers {_e(s.label)}'
                     f'{"<br>" + _e(extra) if extra else ""}</div></div>')
    count, size = role.microbatches
    batch = (f'<div class="what" data-batch="{role.batch_share}">batch {role.batch_share} = {count} x {size}'
             f'{"" if count * size == role.batch_share else " (last smaller)"}</div>')
    return (f'<div class="dev" style="--c:{colour}"{_attrs(device=role.device, idle="0")}>{head}'
            + "".join(lines) + batch + "</div>")


def _device_map(plan: Plan, roles: list[DeviceRole]) -> str:
    by_node: dict[int, list[DeviceRole]] = {}
    for r in roles:
        by_node.setdefault(r.node, []).append(r)
    nodes = "".join(
        f'<div class="node" data-node="{n}"><div class="title">node {n} · '
        f'{_e(", ".join(dict.fromkeys(r.type for r in rs)))}</div><div class="devs">'
        + "".join(_device_card(r) for r in rs) + "</div></div>" for n, rs in sorted(by_node.items()))
    total = max(int(plan.model.get("num_layers", 0) or 0), 1)
    strips = []
    for i, pipe in enumerate(plan.pipelines):
        colour = PIPELINE_COLOURS[i % len(PIPELINE_COLOURS)]
        segs = []
        for j, s in enumerate(pipe.stages):
            width = 100 * (s.layers[1] - s.layers[0]) / total
            shade = "" if j % 2 == 0 else "filter: brightness(0.82);"
            label = f"s{j}: layers {s.layers[0]}-{s.layers[1] - 1} on {ranges(s.devices)}"
            segs.append(f'<div class="seg" style="width:{width:.4f}%;background:{colour};{shade}" title="{_e(label)}"'
                        f'{_attrs(pipeline=i, stage=j, layers=f"{s.layers[0]}-{s.layers[1]}")}>{_e(label)}</div>')
        strips.append(f'<div class="strip"><div class="lbl">pipeline {i} · batch {pipe.batch_share}</div>'
                      f'<div class="chain">{"".join(segs)}</div></div>')
    return (f'<section id="device-map"><h2>Device map</h2><div class="nodes">{nodes}</div>'
            f'<div class="strips">{"".join(strips)}</div><p class="note">Each card is a device of the cluster, '
            f'grouped by node; colour = pipeline (data-parallel replica). The strips cut each pipeline\'s layer '
            f'chain into its stages.</p></section>')


def _memory(plan: Plan, mems: list[DeviceMemory], measured: dict[int, Any]) -> str:
    names = plan.device_names()
    rows = []
    used_parts: list[str] = []
    for m in mems:
        cap = m.capacity or 1
        segs = []
        if m.parts:
            for part, b in m.parts.items():
                if part not in used_parts:
                    used_parts.append(part)
                segs.append(f'<div class="part" style="width:{100 * b / max(m.peak, 1):.4f}%;background:'
                            f'{PART_COLOURS.get(part, OTHER_COLOUR)}" title="{_e(part)}: {fmt_bytes(b)}"'
                            f'{_attrs(part=part, bytes=b)}></div>')
            rest = m.peak - sum(m.parts.values())
            if rest > 0:
                segs.append(f'<div class="part" style="width:{100 * rest / max(m.peak, 1):.4f}%;background:'
                            f'{OTHER_COLOUR}" title="other: {fmt_bytes(rest)}"{_attrs(part="other", bytes=rest)}>'
                            f'</div>')
        else:
            segs.append(f'<div style="width:100%;background:#4e79a7" title="peak {fmt_bytes(m.peak)}"></div>')
        marker = ""
        got = measured.get(m.device)
        if got is not None and got.measured_peak_bytes is not None:
            marker = (f'<div class="measured" style="left:{min(100.0, 100 * got.measured_peak_bytes / cap):.4f}%" '
                      f'title="measured {fmt_bytes(got.measured_peak_bytes)}"'
                      f'{_attrs(measured_bytes=got.measured_peak_bytes)}></div>')
        share = f" ({100 * m.peak / m.capacity:.0f}%)" if m.capacity else ""
        rows.append(
            f'<div class="lbl">device {m.device} · {_e(names.get(m.device, "?"))}</div>'
            f'<div class="track membar"{_attrs(device=m.device, peak=m.peak, capacity=m.capacity, usable=m.usable)}>'
            f'<div class="fill" style="width:{min(100.0, 100 * m.peak / cap):.4f}%">{"".join(segs)}</div>'
            f'<div class="reserve" style="left:{100 * m.usable / cap:.4f}%" title="usable: capacity less the '
            f'{100 * plan.memory_reserve:.0f}% reserve"></div>{marker}</div>'
            f'<div class="fig">{fmt_bytes(m.peak)} / {fmt_bytes(m.capacity)}{share}</div>')
    legend = "".join(f'<span><i style="background:{PART_COLOURS.get(p, OTHER_COLOUR)}"></i>{_e(p)}</span>'
                     for p in used_parts + (["other"] if used_parts else []))
    why = ("" if used_parts else
           f"This plan does not itemize its peaks (no predicted[\"peak_memory_parts_bytes\"]): the bars show the "
           f"whole peak ({', '.join(PART_ORDER)} together).")
    legend += ('<span><i style="background:none;border-left:2px dashed #7b8794;border-radius:0"></i>usable '
               f'(capacity less the {100 * plan.memory_reserve:.0f}% reserve)</span>')
    if measured:
        legend += '<span><i style="background:#1f2933;width:3px"></i>measured peak</span>'
    return (f'<section id="memory"><h2>Memory per device (predicted peak / capacity)</h2><div class="mem">'
            f'{"".join(rows)}</div><div class="legend">{legend}</div><p class="note">Bars are to scale against '
            f'each device\'s capacity. {_e(why)}</p></section>')


def _ticks(span: float) -> list[float]:
    if span <= 0:
        return [0.0]
    raw = span / 6
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    n = int(span / step + 1e-9)
    return [k * step for k in range(n + 1)]


def _timeline(plan: Plan, groups: list[GanttGroup], step: float) -> str:
    names = plan.device_names()
    label_w, width, pad = 250, 1100, 10
    plot_w = width - label_w - pad
    rows: list[str] = []
    y = 24
    heights = {"compute": 22, "comm": 12, "recv": 12}
    scale = plot_w / step if step > 0 else 0.0
    for g in groups:
        who = "pipelines " + ranges(g.pipelines) if len(g.pipelines) > 1 else f"pipeline {g.pipelines[0]}"
        rows.append(f'<text x="4" y="{y + 11}" style="font-weight:600">{_e(who)}</text>')
        y += 16
        for r, devs in enumerate(g.devices):
            streams = [s for s in ("compute", "comm", "recv") if any(b.rank == r and b.stream == s for b in g.bars)]
            dtype = names.get(devs[0], "?")
            first = True
            for s in streams:
                h = heights[s]
                if first:
                    rows.append(f'<text x="12" y="{y + 15}">rank {r} · device {_e(ranges(devs))} · {_e(dtype)}</text>')
                    first = False
                rows.append(f'<text x="{label_w - 6}" y="{y + h - 2}" text-anchor="end" style="fill:#9aa5b1;'
                            f'font-size:9.5px">{s}</text>')
                rows.append(f'<rect x="{label_w}" y="{y}" width="{plot_w}" height="{h}" fill="#f5f7fa"/>')
                for b in g.bars:
                    if b.rank != r or b.stream != s:
                        continue
                    x = label_w + b.start * scale
                    w = max((b.end - b.start) * scale, 0.6)
                    rows.append(
                        f'<rect class="ev" x="{x:.2f}" y="{y}" width="{w:.2f}" height="{h}" '
                        f'fill="{KIND_COLOURS[b.kind]}" stroke="#fff" stroke-width="0.5"'
                        f'{_attrs(pipeline=g.pipelines[0], rank=r, stream=s, name=b.name, start=repr(b.start), end=repr(b.end))}>'  # noqa: E501
                        f'<title>{_e(b.name)} on devices {_e(ranges(devs))}: {fmt_time(b.start)} to {fmt_time(b.end)} '
                        f'({fmt_time(b.end - b.start)})</title></rect>')
                y += h + 3
            y += 6
        y += 4
    for d, why in sorted((plan.predicted.get("idle_devices") or {}).items(), key=lambda kv: int(kv[0])):
        rows.append(f'<text x="12" y="{y + 12}" style="fill:#9aa5b1">dev {int(d)} ({_e(names.get(int(d), "?"))}): '
                    f'idle</text><rect class="idle-row" x="{label_w}" y="{y}" width="{plot_w}" height="16" '
                    f'fill="#eceff3"{_attrs(device=int(d))}><title>{_e(why)}</title></rect>')
        y += 20
    axis = []
    for t in _ticks(step):
        x = label_w + t * scale
        axis.append(f'<line x1="{x:.2f}" x2="{x:.2f}" y1="18" y2="{y}" stroke="#e4e7eb"/>'
                    f'<text x="{x:.2f}" y="12" text-anchor="middle">{fmt_time(t)}</text>')
    end = label_w + step * scale
    axis.append(f'<line class="step-end" x1="{end:.2f}" x2="{end:.2f}" y1="18" y2="{y}" stroke="#1f2933" '
                f'stroke-dasharray="4 3"{_attrs(step=repr(step))}/>')
    svg = (f'<svg class="gantt" viewBox="0 0 {width} {y + 4}" width="100%" role="img" '
           f'aria-label="simulated step">{"".join(axis)}{"".join(rows)}</svg>')
    legend = "".join(f'<span><i style="background:{c}"></i>{k}</span>' for k, c in KIND_COLOURS.items())
    return (f'<section id="timeline"><h2>Simulated step (predicted {fmt_time(step)})</h2>{svg}'
            f'<div class="legend">{legend}</div><p class="note">One step of every pipeline as the simulator behind '
            f'<code>plan.timeline()</code> runs it (pipelines with the same timings drawn once); hover a bar for '
            f'its action and times. F/B/W: forward, backward, weight gradients of stage s for micro-batch mb.'
            f'</p></section>')


def _idle(plan: Plan, roles: list[DeviceRole]) -> str:
    idle = [r for r in roles if r.idle_why is not None]
    if not idle:
        body = '<p class="note" data-idle-count="0">Every device of the cluster has work in this plan.</p>'
    else:
        body = ('<ul class="idle-list">' + "".join(
            f'<li class="idle"{_attrs(device=r.device)}>device {r.device} ({_e(r.type)}): {_e(r.idle_why)}</li>'
            for r in idle) + "</ul>")
    return f'<section id="idle"><h2>Idle devices</h2>{body}</section>'


def _measured(plan: Plan, ranks: list[Any]) -> str:
    head = ("<tr><th>rank</th><th>device</th><th>predicted peak</th><th>measured peak</th><th>measured/predicted"
            "</th><th>predicted step</th><th>measured step</th></tr>")
    body = []
    for r in ranks:
        m, p = r.measured_peak_bytes, r.predicted_peak_bytes
        step = r.measured_step_s
        body.append(
            f'<tr class="measured-rank"{_attrs(rank=r.rank, predicted_peak=p, measured_peak=m if m is not None else "", predicted_step=repr(r.predicted_step_s), measured_step=repr(step) if step is not None else "")}>'  # noqa: E501
            f"<td>{r.rank}</td><td>{_e(r.device)}</td><td class=num>{fmt_bytes(p)}</td>"
            f"<td class=num>{fmt_bytes(m) if m is not None else 'n/a (' + _e(r.not_measured) + ')'}</td>"
            f"<td class=num>{f'{m / p:.2f}' if m is not None and p else ''}</td>"
            f"<td class=num>{fmt_time(r.predicted_step_s)}</td>"
            f"<td class=num>{fmt_time(step) if step is not None else 'n/a'}</td></tr>")
    stages = []
    for r in ranks:
        for t in getattr(r, "stage_times", []):
            pc, mc = t.predicted_compute_s, t.measured_compute_s
            stages.append(f'<tr class="measured-stage"{_attrs(rank=r.rank, stage=t.stage)}><td>{r.rank}</td>'
                          f"<td>{_e(t.stage)}</td><td class=num>{fmt_time(pc) if pc is not None else 'n/a'}</td>"
                          f"<td class=num>{fmt_time(mc) if mc is not None else 'n/a'}</td>"
                          f"<td class=num>{f'{mc / pc:.2f}' if pc and mc is not None else ''}</td></tr>")
    stage_table = ("<h2 style='margin-top:16px'>Compute per stage (forward + backward per step)</h2><table><tr>"
                   "<th>rank</th><th>stage</th><th>predicted</th><th>measured</th><th>measured/predicted</th></tr>"
                   + "".join(stages) + "</table>") if stages else ""
    return (f'<section id="measured"><h2>Measured next to predicted</h2><table>{head}{"".join(body)}</table>'
            f'{stage_table}<p class="note">From the program\'s report (<code>prog.report()</code>): peak of live '
            f'tensor bytes over compile and the first steps, at the allocator; step: median wall time.</p>'
            f'</section>')


def render(plan: Plan, measured: Any = None) -> str:
    """The report page of `plan` (module docstring); `measured`: a program's `report()`, or None."""
    ranks = measured_ranks(measured) if measured is not None else []
    roles = device_roles(plan)
    groups = gantt(plan)
    step = max((g.step_time for g in groups), default=0.0)
    parts = [_problems(plan), _device_map(plan, roles), _memory(plan, device_memory(plan), {r.rank: r for r in ranks}),
             _timeline(plan, groups, step), _idle(plan, roles)]
    if ranks:
        parts.append(_measured(plan, ranks))
    parts.append(f'<section id="text"><h2>The plan as text (<code>plan.explain()</code>)</h2>'
                 f'<pre>{_e(plan.explain())}</pre></section>')
    title = f"autopar plan: {plan.model.get('name', '?')} on {plan.cluster.get('name', '?')}"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
            f'content="width=device-width, initial-scale=1"><title>{_e(title)}</title><style>{CSS}</style></head>'
            f'<body>{_summary(plan)}<main>{"".join(parts)}</main></body></html>\n')


__all__ = ["render"]
