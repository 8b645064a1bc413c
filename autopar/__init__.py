"""autopar: auto-parallelizing compiler for PyTorch training on heterogeneous clusters."""

from .cluster import Cluster, DeviceSpec, Link
from .errors import AutoparError, CaptureError, ClusterError, InfeasibleError, PlanError

__all__ = ["Cluster", "DeviceSpec", "Link", "AutoparError", "CaptureError", "ClusterError", "InfeasibleError",
           "PlanError"]
__version__ = "0.1.0"
