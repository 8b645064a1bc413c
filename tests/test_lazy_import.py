"""`import autopar` loads the public names on first use: a launcher, a CLI command or a rank that only trains
pays for what it calls, not for the planner, the capture and every runtime mode."""

from __future__ import annotations

import subprocess
import sys

import autopar

PUBLIC = sorted(autopar.__all__)


def _fresh(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


def test_importing_autopar_or_its_cli_loads_neither_torch_nor_the_planner() -> None:
    loaded = _fresh("import sys, autopar, autopar.cli; print(sorted(m for m in ('torch', 'autopar.api', "
                    "'autopar.compiler', 'autopar.solver', 'ortools') if m in sys.modules))")
    assert loaded == "[]"


def test_every_public_name_resolves_and_is_listed() -> None:
    out = _fresh("import sys, autopar; from autopar import *; "
                 "print(all(getattr(autopar, n) is globals()[n] for n in autopar.__all__), "
                 "set(autopar.__all__) <= set(dir(autopar)), callable(autopar.compile), "
                 "autopar.plan.__module__, 'torch.distributed.checkpoint' in sys.modules)")
    assert out == "True True True autopar.api False"  # checkpoints' library: imported on first save or load
    assert autopar.Strategy(dp=2).dp == 2 and autopar.compile.__module__ == "autopar.compiler"


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        autopar.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("autopar.no_such_name did not raise")
