"""autopar: auto-parallelizing compiler for PyTorch training on heterogeneous clusters."""

# `autopar.plan` is the function: importing .api loads the submodule autopar.plan first, and binding the
# function afterwards shadows it (the submodule stays reachable as `from autopar.plan import ...`).
from .api import analyze, estimate, plan
from .cluster import Cluster, DeviceSpec, Link
from .compiler import compile  # noqa: A004 (autopar.compile, as users spell it)
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
from .ir.plan import Estimate, Plan, Strategy
from .ir.precision import default_precision
from .passes.batch_stats import BatchStatisticsWarning
from .passes.capture import capture
from .runtime.asynchronous import AsyncUpdateWarning
from .runtime.protocol import TrainingProgram
from .runtime.weights import materialize

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
