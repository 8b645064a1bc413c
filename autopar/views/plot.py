"""`Plan.plot()`: the device map and the simulated timeline of a plan as one picture (matplotlib), for papers and
issues.

Top: the device map, a row per device of the cluster (grouped by node) with the layers of the coarse chain each
runs, coloured by pipeline, and the idle devices greyed with why. Bottom: one simulated step as a Gantt chart, a
row per device group (compute stream; sends and gradient sync drawn thinner under it), from `Plan.simulate()`,
the simulator `timeline()` uses. Everything comes from layout.py, as the HTML report's figures do.

matplotlib is an optional extra (`pip install autopar[plot]`); without it `plot` raises a PlanError saying so.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import PlanError
from ..report import fmt_time
from .html_report import KIND_COLOURS, PIPELINE_COLOURS
from .layout import device_roles, gantt, ranges

if TYPE_CHECKING:
    from ..ir.plan import Plan

FORMATS = (".png", ".svg", ".pdf")


def plot_plan(plan: Plan, path: str | os.PathLike) -> Path:
    """Draw `plan` (module docstring) to `path`; the format follows its suffix (.png, .svg or .pdf)."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise PlanError(f"plan.plot({str(path)!r}): the picture's format comes from the file name; use one ending "
                        f"in {', '.join(FORMATS)}.")
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise PlanError("plan.plot() draws with matplotlib, which is not installed: pip install 'autopar[plot]' "
                        "(or pip install matplotlib); plan.report('plan.html') needs nothing extra.") from None
    roles = device_roles(plan)
    groups = gantt(plan)
    step = max((g.step_time for g in groups), default=0.0)
    total = max(int(plan.model.get("num_layers", 0) or 0), 1)
    rank_rows = sum(len(g.devices) for g in groups)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 1.2 + 0.32 * (len(roles) + rank_rows) + 1.2),
                                      gridspec_kw={"height_ratios": [max(len(roles), 1), max(rank_rows, 1)]})
    # device map: which layers each device runs
    labels = []
    for y, role in enumerate(roles):
        labels.append(f"node {role.node} · dev {role.device} · {role.type}")
        if role.idle_why is not None:
            top.barh(y, total, color="#eceff3", edgecolor="#cbd2d9", hatch="//", height=0.7)
            top.text(total / 2, y, "idle: " + role.idle_why, ha="center", va="center", fontsize=7, color="#616e7c",
                     clip_on=True)
            continue
        for s in role.stages:
            colour = PIPELINE_COLOURS[s.pipeline % len(PIPELINE_COLOURS)]
            start, end = s.layers
            top.barh(y, end - start, left=start, color=colour, edgecolor="white", height=0.7)
            text = f"p{s.pipeline} s{s.stage}" + (f" tp{s.tp}" if s.tp > 1 else "")
            top.text((start + end) / 2, y, text, ha="center", va="center", fontsize=7, color="white")
    top.set_yticks(range(len(roles)), labels, fontsize=7)
    top.invert_yaxis()
    top.set_xlim(0, total)
    layer_names = plan.model.get("layer_names") or []
    if len(layer_names) == total <= 24:  # name the layers where they fit
        top.set_xticks([i + 0.5 for i in range(total)], layer_names, fontsize=7)
    top.set_xlabel("layers of the coarse chain", fontsize=8)
    top.set_title(f"{plan.model.get('name', '?')} on {plan.cluster.get('name', '?')}: "
                  f"{plan.world_size} of {len(roles)} devices, {plan.schedule}, "
                  f"predicted {fmt_time(plan.predicted.get('step_time_s', step))}/step", fontsize=9)
    # timeline: one simulated step per device group
    names = plan.device_names()
    ylabels = []
    y = 0
    for g in groups:
        for r, devs in enumerate(g.devices):
            who = ("p" + ranges(g.pipelines)) if len(g.pipelines) > 1 else f"p{g.pipelines[0]}"
            ylabels.append(f"{who} r{r} · dev {ranges(devs)} · {names.get(devs[0], '?')}")
            for b in g.bars:
                if b.rank != r or b.stream == "recv":
                    continue
                main = b.stream == "compute"
                bottom.barh(y + (0 if main else 0.32), (b.end - b.start) * 1e3, left=b.start * 1e3,
                            height=0.55 if main else 0.2, color=KIND_COLOURS[b.kind], edgecolor="white",
                            linewidth=0.3)
            y += 1
    bottom.axvline(step * 1e3, color="#1f2933", linestyle="--", linewidth=0.8)
    bottom.set_yticks(range(len(ylabels)), ylabels, fontsize=7)
    bottom.invert_yaxis()
    bottom.set_xlim(0, step * 1e3 * 1.01 if step > 0 else 1)
    bottom.set_xlabel("ms of one simulated step", fontsize=8)
    bottom.tick_params(axis="x", labelsize=7)
    fig.legend(handles=[Patch(color=c, label=k) for k, c in KIND_COLOURS.items() if k != "recv"], fontsize=7,
               ncol=6, loc="lower center", frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


__all__ = ["FORMATS", "plot_plan"]
