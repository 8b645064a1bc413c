"""Host (CPU) memory per node: the defaults a cluster file falls back on, and which device kinds share it.

A node's host memory holds what its devices offload (optimizer state, parameter copies, activations;
`solver/pricing/pricing.py`'s docstring). A cluster file gives it per node group as `host_memory_GiB`; without it
a node gets its devices' count times the per-device share below, taken from a typical server (or cloud
instance) built around that device:

    H100-SXM, H200     256 GiB   DGX H100 / DGX H200: 2 TiB for 8 GPUs
    A100-80GB          256 GiB   DGX A100 640 GB: 2 TiB for 8 GPUs
    A100-40GB          128 GiB   DGX A100 320 GB: 1 TiB for 8 GPUs
    V100-16GB/32GB      64 GiB   DGX-1: 512 GiB for 8 GPUs
    T4                  48 GiB   AWS g4dn.12xlarge: 192 GiB for 4 T4
    A10, A10G           48 GiB   AWS g5.12xlarge: 192 GiB for 4 A10G
    L4                  48 GiB   AWS g6.12xlarge: 192 GiB for 4 L4
    L40S                96 GiB   AWS g6e.12xlarge: 384 GiB for 4 L40S
    MI250X             128 GiB   Frontier node: 512 GiB DDR4 for 4 MI250X
    MI300X             256 GiB   8x MI300X platforms: 2 TiB for 8 GPUs
    consumer GPUs       64 GiB   desktop boxes: 64-128 GiB for 1-2 GPUs
    other GPUs          64 GiB   (custom devices not based on a catalog entry)

Unified memory (kinds in UNIFIED_KINDS): a Jetson board's GPU and CPU share one LPDDR pool, and the `cpu`
device is the host itself. There the node's host memory is that pool (the board's memory times its devices;
for `cpu` the machine's RAM, measured), and what a device offloads stays in the same memory: the planner
counts it in the device's own peak as well (offloading cannot make such a device fit).
"""

from __future__ import annotations

import os

GiB = 1024**3

HOST_GiB_PER_DEVICE: dict[str, float] = {
    "H100-SXM": 256, "H200": 256, "A100-80GB": 256, "A100-40GB": 128, "V100-16GB": 64, "V100-32GB": 64,
    "T4": 48, "A10": 48, "A10G": 48, "L4": 48, "L40S": 96, "RTX-3090": 64, "RTX-4090": 64, "RTX-2080Ti": 64,
    "TITAN-RTX": 64, "MI250X": 128, "MI300X": 256,
}
DEFAULT_GPU_HOST_GiB = 64.0  # a GPU type the table does not list
UNIFIED_KINDS = ("edge", "cpu")  # device kinds whose memory is the host's


def total_ram() -> int:
    """Physical memory of this machine in bytes."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows)
        import psutil

        return int(psutil.virtual_memory().total)


def default_host_memory(name: str, kind: str, device_memory: int, devices: int, based_on: str | None = None
                        ) -> int:
    """Default host memory in bytes of a node with `devices` devices of one type (module docstring)."""
    if kind == "cpu":
        return device_memory  # the cpu device's memory is this machine's RAM, measured
    if kind in UNIFIED_KINDS:
        return device_memory * devices
    per = HOST_GiB_PER_DEVICE.get(name, HOST_GiB_PER_DEVICE.get(based_on or "", DEFAULT_GPU_HOST_GiB))
    return int(per * GiB) * devices


__all__ = ["DEFAULT_GPU_HOST_GiB", "HOST_GiB_PER_DEVICE", "UNIFIED_KINDS", "default_host_memory", "total_ram"]
