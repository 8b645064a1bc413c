"""Loading a bench/ script into a test (bench/ is not a package): by path, under the name bench_<name>, with
sys.path exactly as it was afterwards. A bench script puts bench/ on sys.path to import bench/common.py; a
module there named like an installed package would shadow it in this process and in every process it spawns
after (bench/kernels.py did Hugging Face's `kernels`, which transformers imports: `cd bench && python
planner.py` failed at its BERT case; it is bench/fused_kernels.py now, and tests/test_bench_names.py keeps
bench/'s names clear of installed packages)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve annotations through sys.modules
    saved = list(sys.path)
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module
