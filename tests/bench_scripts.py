"""Loading a bench/ script into a test (bench/ is not a package): by path, under the name bench_<name>, with
sys.path exactly as it was afterwards. A bench script puts bench/ on sys.path to import bench/common.py; left
there, bench/kernels.py shadows Hugging Face's `kernels` package (which transformers imports when it is
installed) in this process and in every process it spawns after, and every transformers model fails."""

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
