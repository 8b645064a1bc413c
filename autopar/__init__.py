"""autopar: auto-parallelizing compiler for PyTorch training on heterogeneous clusters."""

from .api import analyze
from .cluster import Cluster, DeviceSpec, Link
from .errors import AutoparError, CaptureError, ClusterError, InfeasibleError, PlanError
from .passes.capture import capture

__all__ = [
    "analyze",
    "capture",
    "Cluster",
    "DeviceSpec",
    "Link",
    "AutoparError",
    "CaptureError",
    "ClusterError",
    "InfeasibleError",
    "PlanError",
]
__version__ = "0.1.0"
