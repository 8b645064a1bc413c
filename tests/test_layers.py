"""Layers only call down (issue #23, part 1): no import circle between autopar's files, and no import from a lower
layer to a higher one, in the layer order docs/architecture.md draws.

Every import of an autopar module counts, at module top or inside a function; imports under `if TYPE_CHECKING:`
do not (they never run). `from x import name` counts as an import of the module `x.name` where that is a module
of the package, else of `x`. Each file of autopar/ belongs to exactly one layer of `LAYERS` (the most specific
pattern that matches it wins); a file no layer names fails the test, so a new file is placed on purpose. Within a
layer any file may import any other, as long as no circle forms.

`UPWARD` names the imports allowed to run up the layers, each with its reason; the circle check leaves them out
(each closes a circle by design: the lower module imports the higher one inside one thin method). At most two.
Run this file as a script to print every violation.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autopar"

# Bottom to top. A module's layer is that of the longest pattern matching its dotted name (without "autopar.").
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("errors", "checks", "report", "catalog", "host_memory", "cluster_files", "cluster_links",
              "collector")),
    ("ir", ("ir", "ir.*")),
    ("zoo", ("model_case", "models", "hf_models", "graphs.data", "graphs.sampling", "graphs.halo",
             "graphs.partitioners", "graphs.store", "graphs.layers", "graphs.models", "graphs.layer_pipeline")),
    ("hardware", ("cluster", "cost_models", "cost_models.*")),
    ("passes", ("passes", "passes.*", "codegen", "codegen.*")),
    ("lowering", ("lowering",)),
    ("solver", ("solver", "solver.*", "graphs.cost", "graphs.planner", "graphs.tgn",
                "graphs.temporal_pipeline")),
    ("runtime", ("runtime", "runtime.*", "graphs.program", "graphs.pipeline", "graphs.temporal_program",
                 "graphs.layer_program", "graphs.exchange")),
    ("views", ("views", "views.*")),
    ("api", ("", "api", "compiler", "backend", "backend_dist", "graphs", "graphs.entry")),
    ("tools", ("cli", "demo")),
]

UPWARD: dict[tuple[str, str], str] = {
    ("ir.plan", "views.plan"): "Plan.explain(), timeline(), report() and plot() are thin methods over the views (issue "
                            "#23 part 2 keeps them on the plan; report() and plot() reach html_report.py and plot.py "
                            "through views/plan.py); the import is inside those methods",
    ("ir.plan", "lowering"): "Plan.simulate() prices the lowered action list with its memory actions "
                          "(lowering.priced_schedule), so a plan read back from JSON simulates as it runs; the "
                          "import is inside simulate_pipeline",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name if name in modules else None


def imports(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported autopar module: first line}, module names without the "autopar." prefix."""
    out: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _type_checking_nodes(tree)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found: dict[str, int] = {}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name == "autopar" or a.name.startswith("autopar.")]
                targets = [t.removeprefix("autopar").lstrip(".") for t in targets]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".") if package else []
                    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                    source = ".".join(base + ([node.module] if node.module else []))
                elif node.module == "autopar" or (node.module or "").startswith("autopar."):
                    source = node.module.removeprefix("autopar").lstrip(".")
                else:
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}" if source else alias.name
                    targets.append(sub if sub in modules else source)
            for target in targets:
                resolved = _resolve(target, modules) if target else ""
                if resolved is not None and resolved != module:
                    found.setdefault(resolved, node.lineno)
        out[module] = found
    return out


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (pattern length, layer index)
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if module == pattern or (pattern and fnmatch.fnmatchcase(module, pattern)):
                if best is None or len(pattern) > best[0]:
                    best = (len(pattern), index)
    return None if best is None else best[1]


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, {})))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def problems() -> list[str]:
    modules = _modules()
    graph = imports(modules)
    out = [f"autopar/{modules[m].relative_to(PACKAGE)} is in no layer of tests/test_layers.py LAYERS: add it to "
           f"the layer it belongs to (and to docs/architecture.md)" for m in modules if layer_of(m) is None]
    for (low_module, high_module), _ in UPWARD.items():
        if high_module not in graph.get(low_module, {}):
            out.append(f"UPWARD names {low_module} -> {high_module}, which no longer imports: remove the entry")
    for module in sorted(graph):
        for target, line in sorted(graph[module].items()):
            a, b = layer_of(module), layer_of(target)
            if a is not None and b is not None and b > a and (module, target) not in UPWARD:
                out.append(f"autopar/{modules[module].relative_to(PACKAGE)}:{line} imports {target or 'autopar'} "
                           f"({LAYERS[b][0]} layer) from the {LAYERS[a][0]} layer below it")
    down = {m: {t: line for t, line in ts.items() if (m, t) not in UPWARD} for m, ts in graph.items()}
    for component in cycles(down):
        edges = [f"{m} -> {t} (line {down[m][t]})" for m in component for t in sorted(down[m]) if t in component]
        out.append(f"import circle of {len(component)} files: " + "; ".join(edges))
    return out


def test_layers_only_call_down() -> None:
    assert len(UPWARD) <= 2, "issue #23: at most two imports may run up the layers"
    found = problems()
    assert not found, "\n".join(found)


def test_the_check_sees_a_circle_and_a_function_level_import(tmp_path: Path) -> None:
    (tmp_path / "lower.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                       "    from .upper import Hidden\n\n\ndef f():\n"
                                       "    from .upper import g\n\n    return g\n")
    (tmp_path / "upper.py").write_text("from autopar.lower import f\nimport os\n")
    (tmp_path / "alone.py").write_text("from .lower import TYPE_CHECKING\n")
    modules = {name: tmp_path / f"{name}.py" for name in ("lower", "upper", "alone")}
    graph = imports(modules)
    assert graph == {"lower": {"upper": 8}, "upper": {"lower": 1}, "alone": {"lower": 1}}
    assert cycles(graph) == [["lower", "upper"]]
    assert layer_of("ir.plan") < layer_of("solver.search") < layer_of("runtime.program") < layer_of("compiler")
    assert layer_of("graphs.program") == layer_of("runtime.program") > layer_of("graphs.planner")
    assert layer_of("graphs") == layer_of("api") and layer_of("no_such_module") is None


def _doc_patterns(cell: str) -> set[str]:
    """The LAYERS patterns a row of the docs' table names: `x/y.py` is "x.y", `x/` is "x" and "x.*"
    (`__init__.py` is the package itself); other code spans (function names) name no file."""
    out: set[str] = set()
    for token in re.findall(r"`([^`]+)`", cell):
        if token.endswith("/"):
            out |= {token[:-1].replace("/", "."), token[:-1].replace("/", ".") + ".*"}
        elif token.endswith(".py"):
            out.add(token.removesuffix(".py").removesuffix("__init__").rstrip("/").replace("/", "."))
    return out


def test_docs_draw_the_same_layers() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    positions = [doc.find(f"| {name} |") for name, _ in LAYERS]
    assert all(p >= 0 for p in positions), "docs/architecture.md's layer table lacks a layer of LAYERS"
    assert positions == sorted(positions, reverse=True), \
        "docs/architecture.md draws the layers top first, in the reverse order of LAYERS"
    for (name, patterns), at in zip(LAYERS, positions, strict=True):
        files = doc[at:].split("\n", 1)[0].split("|")[2]
        assert _doc_patterns(files) == set(patterns), (
            f"docs/architecture.md's row {name!r} names {sorted(_doc_patterns(files))}, LAYERS {sorted(patterns)}")


if __name__ == "__main__":
    found = problems()
    print("\n".join(found) or "layers: no circle, no upward import beyond UPWARD")
    sys.exit(1 if found else 0)
