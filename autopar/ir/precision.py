"""Precisions as data: the names a plan's `precision` takes, the bytes of an element in each, which devices
compute in which, the default for a cluster, and how each is described to the user.

What a precision does on every rank at run time is runtime/precision.py; what it costs is passes/annotate.py
(element bytes) and cost_models/memory.py (autocast copies, master weights). This module is the one list
both read, below either.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import PlanError

ELEMENT_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}  # bytes of a computed activation element
PRECISIONS = tuple(ELEMENT_BYTES)


def check_name(precision: str) -> None:
    """PlanError unless `precision` is one autopar prices and runs."""
    if precision not in ELEMENT_BYTES:
        raise PlanError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}.")


def unsupported(cluster: Any, precision: str) -> list[str]:
    """Device type names of `cluster` that cannot compute in `precision` (bf16 needs bf16 tensor cores:
    a catalog `tflops_bf16` of None, e.g. V100, T4, Turing boards, means none)."""
    check_name(precision)
    if precision != "bf16":
        return []
    return [t for t in cluster.device_types() if "bf16" not in cluster.spec(t).peak_flops]


def check_precision(cluster: Any, precision: str) -> None:
    """PlanError naming the devices of `cluster` that cannot run `precision`, and what they can run."""
    lacking = unsupported(cluster, precision)
    if lacking:
        ranks = [d.index for d in cluster.devices if d.spec.name in lacking]
        raise PlanError(f"precision={precision!r}, but {', '.join(lacking)} (device(s) {ranks} of cluster "
                        f"{cluster.name!r}) have no bf16 tensor cores; use precision='fp16' (mixed precision with "
                        f"loss scaling, which every device of this cluster runs) or 'fp32'.")


def default_precision(cluster: Any) -> str:
    """A precision every device of `cluster` computes in: fp32 on CPU-only clusters; else bf16 mixed precision
    where every device has bf16 (tensor cores: NVIDIA Ampere or later, AMD CDNA2 or later), else fp16 mixed
    precision with loss scaling (a cluster with a V100, T4, Turing board or Jetson Xavier, which have fp16
    tensor cores but no bf16: catalog `tflops_bf16` None). Both mixed precisions keep fp32 master weights,
    optimizer state and gradient reduction (runtime/precision.py)."""
    if all(d.spec.kind == "cpu" for d in cluster.devices):
        return "fp32"
    return "fp16" if unsupported(cluster, "bf16") else "bf16"


def resolve_precision(cluster: Any, precision: str | None) -> str:
    """`precision`, or the cluster's default; PlanError when a device of the cluster cannot run it."""
    precision = precision or default_precision(cluster)
    check_precision(cluster, precision)
    return precision


def precision_change(model_dtype: torch.dtype, cluster: Any, precision: str) -> str | None:
    """What computing in `precision` changes, per device type of `cluster`, for a model whose parameters are
    `model_dtype`; None when nothing does (fp32, tf32 where no device has TF32 tensor cores, a model already
    in a 16-bit dtype)."""
    if model_dtype != torch.float32:
        return None
    changes = {}
    for t in cluster.device_types():
        flops = cluster.spec(t).peak_flops
        if precision in ("bf16", "fp16"):
            scaling = ", dynamic loss scaling" if precision == "fp16" else ""
            changes[t] = (f"{precision} autocast (matmuls, convolutions and attention in {precision}; fp32 weights, "
                          f"optimizer state and gradient reduction{scaling})")
        elif precision == "tf32" and cluster.spec(t).kind != "cpu" and flops["tf32"] > flops["fp32"]:
            changes[t] = "TF32 matmuls and convolutions (inputs rounded to a 10-bit mantissa)"
    return "; ".join(f"{t}: {what}" for t, what in changes.items()) or None


def compute_description(precision: str, device: str = "", tf32: bool | None = None) -> str:
    """What a device computes in under a plan's precision (what runtime/precision.py runs); `tf32`: whether
    the device has TF32 tensor cores (None: unknown, assumed where it is not a CPU)."""
    if precision in ("bf16", "fp16"):
        scaled = ", dynamic loss scaling" if precision == "fp16" else ""
        return f"{precision} autocast, fp32 master weights / optimizer state / gradient reduction{scaled}"
    if precision == "tf32":
        if device == "cpu":
            return "fp32 (no TF32 on CPUs)"
        if tf32 is False:
            return "fp32 (no TF32 tensor cores: matmuls and convolutions in fp32)"
        return "fp32 storage, TF32 matmuls and convolutions"
    return f"{precision} throughout"


__all__ = ["ELEMENT_BYTES", "PRECISIONS", "check_name", "check_precision", "compute_description",
           "default_precision", "precision_change", "resolve_precision", "unsupported"]
