"""autopar: auto-parallelizing compiler for PyTorch training on heterogeneous clusters."""

from typing import TYPE_CHECKING

from .errors import (
    AutoparError,
    CaptureError,
    ClusterError,
    FusedKernelWarning,
    InfeasibleError,
    KernelError,
    KernelFallbackWarning,
    PlanDriftWarning,
    PlanError,
    PlanFallbackWarning,
    PrecisionChangeWarning,
    RandomnessWarning,
    RendezvousError,
    UnpricedOpWarning,
)

# The rest is imported when first used (PEP 562): `import autopar` in a launcher, a CLI command or a worker
# that only trains loads what that process calls, not the planner, the capture and every runtime mode.
_LAZY = {
    "analyze": "api", "estimate": "api", "plan": "api",
    "Cluster": "cluster", "DeviceSpec": "cluster", "Link": "cluster",
    "compile": "compiler",
    "Estimate": "ir.plan", "Plan": "ir.plan", "Strategy": "ir.plan",
    "default_precision": "ir.precision",
    "BatchStatisticsWarning": "passes.batch_stats",
    "capture": "passes.capture",
    "AsyncUpdateWarning": "runtime.asynchronous",
    "TrainingProgram": "runtime.protocol",
    "materialize": "runtime.weights",
}

if TYPE_CHECKING:
    from .api import analyze, estimate, plan
    from .cluster import Cluster, DeviceSpec, Link
    from .compiler import compile  # noqa: A004
    from .ir.plan import Estimate, Plan, Strategy
    from .ir.precision import default_precision
    from .passes.batch_stats import BatchStatisticsWarning
    from .passes.capture import capture
    from .runtime.asynchronous import AsyncUpdateWarning
    from .runtime.protocol import TrainingProgram
    from .runtime.weights import materialize


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once bound, later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "TrainingProgram",
    "analyze",
    "plan",
    "estimate",
    "default_precision",
    "compile",
    "materialize",
    "Plan",
    "Strategy",
    "Estimate",
    "capture",
    "Cluster",
    "DeviceSpec",
    "Link",
    "AutoparError",
    "CaptureError",
    "ClusterError",
    "InfeasibleError",
    "PlanError",
    "KernelError",
    "RendezvousError",
    "KernelFallbackWarning",
    "PlanDriftWarning",
    "PlanFallbackWarning",
    "FusedKernelWarning",
    "RandomnessWarning",
    "PrecisionChangeWarning",
    "UnpricedOpWarning",
    "BatchStatisticsWarning",
    "AsyncUpdateWarning",
]
__version__ = "0.1.0"
