"""Every bench/ script runs as `cd bench && python NAME.py`, which puts bench/ first on sys.path: a script named like
an installed top-level package or module shadows it for everything the script imports (bench/kernels.py shadowed
Hugging Face's `kernels`, which transformers imports, and `python planner.py` failed at its BERT case)."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def installed_top_level_names() -> set[str]:
    names = set(sys.stdlib_module_names)
    for dist in importlib.metadata.distributions():
        top = dist.read_text("top_level.txt")
        if top:
            names |= {line.strip() for line in top.splitlines() if line.strip()}
        for f in dist.files or []:  # wheels without top_level.txt: their first path component
            part = f.parts[0]
            if part.endswith(".py"):
                names.add(part[:-3])
            elif "." not in part and not part.endswith("-info"):
                names.add(part)
    return names


def test_no_bench_script_shadows_an_installed_package() -> None:
    taken = installed_top_level_names()
    assert "kernels" in taken or "transformers" in taken  # the check sees the environment's packages
    clashes = sorted(p.stem for p in BENCH.glob("*.py") if p.stem in taken)
    assert not clashes, f"bench/ scripts named like installed packages (rename them): {clashes}"
