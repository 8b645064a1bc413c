"""Human-readable tables and debug dumps (AUTOPAR_DUMP=<dir>) of annotated graphs."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .ir.graph import TrainingGraph


def fmt_count(x: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def fmt_bytes(x: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}B"


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3f}s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f}ms"
    return f"{s * 1e6:.1f}us"


def render_table(rows: list[list[str]], right: set[int] | None = None) -> str:
    right = right or set()
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(r: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )

    out = [line(rows[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows[1:]]
    return "\n".join(x.rstrip() for x in out)


def graph_table(g: TrainingGraph, max_rows: int | None = None) -> str:
    """Per node: op, output shape, FLOPs, bytes, fwd/bwd time per device type, saved bytes; totals last."""
    types = g.device_types
    head = ["node", "layer", "op", "output shape", "FLOPs fwd", "FLOPs bwd", "bytes fwd", "saved"]
    for t in types:
        head += [f"fwd {t}", f"bwd {t}"]
    rows = [head]
    nodes = list(g.nodes.values())
    shown = nodes if max_rows is None or len(nodes) <= max_rows else nodes[:max_rows]
    for n in shown:
        shape = "x".join(str(s) for s in n.outputs[0].shape) if n.outputs else "-"
        saved = n.saved_internal_bytes + sum(g.nodes[r].out_bytes for r in n.saved if r == n.name)
        row = [
            n.name,
            str(n.layer),
            n.target.removeprefix("aten."),
            shape or "scalar",
            fmt_count(n.flops_fwd),
            fmt_count(n.flops_bwd),
            fmt_bytes(n.bytes_fwd),
            fmt_bytes(saved),
        ]
        for t in types:
            row += [fmt_time(n.time_fwd.get(t, 0.0)), fmt_time(n.time_bwd.get(t, 0.0))]
        rows.append(row)
    if len(shown) < len(nodes):
        rows.append([f"... {len(nodes) - len(shown)} more nodes"] + [""] * (len(head) - 1))
    total = [
        "TOTAL",
        "",
        f"{len(nodes)} ops",
        f"{fmt_count(g.num_params())} params",
        fmt_count(g.total("flops_fwd")),
        fmt_count(g.total("flops_bwd")),
        fmt_bytes(g.total("bytes_fwd")),
        fmt_bytes(g.saved_activation_bytes()),
    ]
    for t in types:
        total += [
            fmt_time(sum(n.time_fwd.get(t, 0.0) for n in nodes)),
            fmt_time(sum(n.time_bwd.get(t, 0.0) for n in nodes)),
        ]
    rows.append(total)
    return render_table(rows, right=set(range(4, len(head))))


def layer_table(g: TrainingGraph) -> str:
    """The coarse chain: one row per layer with its totals."""
    types = g.device_types
    head = ["layer", "kind", "ops", "params", "FLOPs fwd", "saved act", "boundary"]
    head += [f"fwd+bwd {t}" for t in types]
    rows = [head]
    for layer in g.layers:
        rows.append(
            [
                layer.name,
                layer.kind,
                str(len(layer.nodes)),
                fmt_bytes(layer.param_bytes),
                fmt_count(layer.flops_fwd),
                fmt_bytes(layer.saved_bytes),
                fmt_bytes(layer.boundary_bytes),
            ]
            + [fmt_time(layer.time_fwd.get(t, 0) + layer.time_bwd.get(t, 0)) for t in types]
        )
    groups = g.repeated_groups()
    note = f"\nrepeated blocks: {', '.join(f'{len(x)}x {g.layers[x[0]].name}..' for x in groups) or 'none'}"
    return render_table(rows, right=set(range(2, len(head)))) + note


def to_dot(g: TrainingGraph) -> str:
    lines = ["digraph autopar {", "  rankdir=TB; node [shape=box, fontsize=9];"]
    for layer in g.layers:
        lines.append(f'  subgraph "cluster_{layer.index}" {{ label="{layer.name}";')
        for name in layer.nodes:
            n = g.nodes[name]
            shape = "x".join(str(s) for s in n.outputs[0].shape) if n.outputs else ""
            lines.append(
                f'    "{name}" [label="{name}\\n{n.target.removeprefix("aten.")}\\n{shape}'
                f'\\n{fmt_count(n.flops_fwd)} FLOP"];'
            )
        lines.append("  }")
    for n in g.nodes.values():
        for a in n.args:
            if a in g.nodes:
                lines.append(f'  "{a}" -> "{n.name}";')
    lines.append("}")
    return "\n".join(lines)


def dump_dir(explicit: str | os.PathLike | None = None) -> Path | None:
    """The dump directory: `explicit`, else $AUTOPAR_DUMP, else None (no dumps)."""
    d = explicit if explicit is not None else os.environ.get("AUTOPAR_DUMP")
    if not d:
        return None
    path = Path(d)
    path.mkdir(parents=True, exist_ok=True)
    return path


def dump_graph(g: TrainingGraph, directory: str | os.PathLike | None = None) -> Path | None:
    """Write graph.txt, graph.json, graph.dot (and graph.svg when Graphviz is installed)."""
    d = dump_dir(directory)
    if d is None:
        return None
    (d / "graph.txt").write_text(g.table() + "\n\n" + layer_table(g) + "\n")
    (d / "graph.json").write_text(g.to_json())
    (d / "graph.dot").write_text(to_dot(g))
    if shutil.which("dot"):
        subprocess.run(
            ["dot", "-Tsvg", str(d / "graph.dot"), "-o", str(d / "graph.svg")],
            check=False,
            timeout=120,
            capture_output=True,
        )
    return d
