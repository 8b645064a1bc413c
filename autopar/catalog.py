"""Built-in accelerator catalog: datasheet figures (dense, no sparsity).

Sources: ../shared/reference/devices.md where it lists the device, else the vendor datasheet.
Memory is taken as GiB (what the driver reports for "80 GB" parts is ~80 GiB), and is what a process can
allocate: less than the datasheet where ECC takes part of a GDDR board's memory (T4).
Bandwidths are per device and per direction, in GB/s (1e9 bytes/s).

`tflops_fp16` and `tflops_bf16` are the FP16 and BF16 tensor-core peaks with fp32 accumulate (what
mixed-precision training runs). They are equal on every device that has both. BF16 tensor cores need
NVIDIA compute capability 8.0 (Ampere) or later (NVIDIA Transformer Engine support matrix; PyTorch's
`torch.cuda.is_bf16_supported` checks the same): Volta (V100 cc 7.0, Jetson Xavier cc 7.2) and Turing
(T4, RTX 2080 Ti, TITAN RTX, cc 7.5) have FP16 tensor cores only, so their `tflops_bf16` is None and a
bf16 plan on them is refused (`DeviceSpec.flops`). Their FP16 figures:
* V100 SXM2: 125 TFLOP/s "Tensor Performance" (NVIDIA Tesla V100 datasheet; devices.md).
* T4: 65 TFLOP/s "Mixed Precision (FP16/FP32)" (NVIDIA T4 datasheet; devices.md).
* RTX 2080 Ti: 53.8 TFLOP/s FP16 with FP32 accumulate at the reference boost clock (NVIDIA Turing
  architecture whitepaper, appendix table; GeForce boards run FP32 accumulate at half the 107.6 FP16-
  accumulate rate).
* TITAN RTX: 130 TFLOP/s (576 tensor cores x 128 FLOP x 1.77 GHz; NVIDIA's TITAN RTX page says "130
  Tensor TFLOPs", full-rate FP32 accumulate).
* Jetson Xavier NX: 48 Volta tensor cores x 64 FMA x 2 x 1.1 GHz = 6.76 TFLOP/s.
AMD MI250X / MI300X matrix cores run FP16 and BF16 at the same rate (AMD CDNA2 / CDNA3 datasheets).

`DeviceSpec` and `Link` are one entry's figures in SI units, as a cluster (cluster.py) and the cost models
read them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import PlanError

GiB = 1024**3


@dataclass(frozen=True)
class Link:
    """A one-direction link: bandwidth in bytes/s, latency in seconds."""

    bandwidth: float
    latency: float
    kind: str = ""
    measured: bool = False  # achieved figures (autopar probe), not a datasheet's

    @property
    def bandwidth_GBps(self) -> float:
        return self.bandwidth / 1e9

    def to_dict(self) -> dict:
        d = {"bandwidth_GBps": self.bandwidth / 1e9, "latency_us": self.latency * 1e6, "kind": self.kind}
        return {**d, "measured": True} if self.measured else d


@dataclass(frozen=True, eq=True)
class DeviceSpec:
    """Datasheet figures of one device type. FLOP/s and bytes/s are SI units."""

    name: str
    peak_flops: dict[str, float]  # keys: fp32, tf32, bf16, fp16
    memory: int  # bytes
    memory_bandwidth: float  # bytes/s
    intra_node: Link
    host_link: Link
    kind: str = "gpu"  # gpu | cpu | edge

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for a compute dtype ('fp32', 'tf32', 'bf16', 'fp16'). PlanError for bf16 on a device
        without bf16 tensor cores (`tflops_bf16` None: Volta, Turing)."""
        if dtype == "bf16" and "bf16" not in self.peak_flops:
            raise PlanError(f"{self.name} cannot compute in bf16 (no bf16 tensor cores); train in fp16 "
                            f"(precision='fp16', loss-scaled) or fp32 on it.")
        return self.peak_flops.get(dtype, self.peak_flops["fp32"])

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "tflops_fp32": self.peak_flops["fp32"] / 1e12,
            "tflops_tf32": self.peak_flops["tf32"] / 1e12,
            "tflops_fp16": self.peak_flops["fp16"] / 1e12,
            "tflops_bf16": self.peak_flops["bf16"] / 1e12 if "bf16" in self.peak_flops else None,
            "memory_GiB": self.memory / GiB,
            "memory_bandwidth_GBps": self.memory_bandwidth / 1e9,
            "intra_node": self.intra_node.to_dict(),
            "host_link": self.host_link.to_dict(),
            "kind": self.kind,
        }



PCIE3 = {"bandwidth_GBps": 16.0, "latency_us": 5.0, "kind": "PCIe3"}
PCIE4 = {"bandwidth_GBps": 32.0, "latency_us": 5.0, "kind": "PCIe4"}
PCIE5 = {"bandwidth_GBps": 64.0, "latency_us": 5.0, "kind": "PCIe5"}


def _nvlink(gbps: float, gen: str) -> dict:
    return {"bandwidth_GBps": gbps, "latency_us": 2.0, "kind": gen}


# name: tflops (fp32, tf32, fp16, bf16; bf16 None without bf16 tensor cores), memory GiB, memory bandwidth
# GB/s, intra-node link, host link, kind
CATALOG: dict[str, dict] = {
    "H100-SXM": dict(tflops_fp32=67.0, tflops_tf32=494.5, tflops_fp16=989.0, tflops_bf16=989.0, memory_GiB=80,
                     memory_bandwidth_GBps=3350, intra_node=_nvlink(450, "NVLink4"), host_link=PCIE5),
    "H200": dict(tflops_fp32=67.0, tflops_tf32=494.5, tflops_fp16=989.0, tflops_bf16=989.0, memory_GiB=141,
                 memory_bandwidth_GBps=4800, intra_node=_nvlink(450, "NVLink4"), host_link=PCIE5),
    "A100-40GB": dict(tflops_fp32=19.5, tflops_tf32=156.0, tflops_fp16=312.0, tflops_bf16=312.0, memory_GiB=40,
                      memory_bandwidth_GBps=1555, intra_node=_nvlink(300, "NVLink3"), host_link=PCIE4),
    "A100-80GB": dict(tflops_fp32=19.5, tflops_tf32=156.0, tflops_fp16=312.0, tflops_bf16=312.0, memory_GiB=80,
                      memory_bandwidth_GBps=2039, intra_node=_nvlink(300, "NVLink3"), host_link=PCIE4),
    "V100-16GB": dict(tflops_fp32=15.7, tflops_tf32=15.7, tflops_fp16=125.0, tflops_bf16=None, memory_GiB=16,
                      memory_bandwidth_GBps=900, intra_node=_nvlink(150, "NVLink2"), host_link=PCIE3),
    "V100-32GB": dict(tflops_fp32=15.7, tflops_tf32=15.7, tflops_fp16=125.0, tflops_bf16=None, memory_GiB=32,
                      memory_bandwidth_GBps=900, intra_node=_nvlink(150, "NVLink2"), host_link=PCIE3),
    # 16 GB of GDDR6 (datasheet, devices.md), but T4 boards ship with ECC enabled (NVIDIA T4 product brief),
    # and on GDDR boards ECC takes 6.25% of the DRAM for the check bits (CUDA C++ Best Practices Guide):
    # 16 x 0.9375 = 15.0 GiB (a T4 with ECC on reports 15079 MiB in nvidia-smi and 15843721216 bytes in
    # deviceQuery: the ~0.25 GiB beyond is the driver's own reservation, which no entry here counts).
    "T4": dict(tflops_fp32=8.1, tflops_tf32=8.1, tflops_fp16=65.0, tflops_bf16=None, memory_GiB=15.0,
               memory_bandwidth_GBps=320, intra_node=PCIE3, host_link=PCIE3),
    "A10": dict(tflops_fp32=31.2, tflops_tf32=62.5, tflops_fp16=125.0, tflops_bf16=125.0, memory_GiB=24,
                memory_bandwidth_GBps=600, intra_node=PCIE4, host_link=PCIE4),
    "A10G": dict(tflops_fp32=31.2, tflops_tf32=35.0, tflops_fp16=70.0, tflops_bf16=70.0, memory_GiB=24,
                 memory_bandwidth_GBps=600, intra_node=PCIE4, host_link=PCIE4),
    "L4": dict(tflops_fp32=30.3, tflops_tf32=60.0, tflops_fp16=121.0, tflops_bf16=121.0, memory_GiB=24,
               memory_bandwidth_GBps=300, intra_node=PCIE4, host_link=PCIE4),
    "L40S": dict(tflops_fp32=91.6, tflops_tf32=183.0, tflops_fp16=362.0, tflops_bf16=362.0, memory_GiB=48,
                 memory_bandwidth_GBps=864, intra_node=PCIE4, host_link=PCIE4),
    "RTX-3090": dict(tflops_fp32=35.6, tflops_tf32=35.6, tflops_fp16=71.0, tflops_bf16=71.0, memory_GiB=24,
                     memory_bandwidth_GBps=936, intra_node=PCIE4, host_link=PCIE4),
    "RTX-4090": dict(tflops_fp32=82.6, tflops_tf32=82.6, tflops_fp16=165.0, tflops_bf16=165.0, memory_GiB=24,
                     memory_bandwidth_GBps=1008, intra_node=PCIE4, host_link=PCIE4),
    "RTX-2080Ti": dict(tflops_fp32=13.4, tflops_tf32=13.4, tflops_fp16=53.8, tflops_bf16=None, memory_GiB=11,
                       memory_bandwidth_GBps=616, intra_node=PCIE3, host_link=PCIE3),
    "TITAN-RTX": dict(tflops_fp32=16.3, tflops_tf32=16.3, tflops_fp16=130.0, tflops_bf16=None, memory_GiB=24,
                      memory_bandwidth_GBps=672, intra_node=PCIE3, host_link=PCIE3),
    "MI250X": dict(tflops_fp32=47.9, tflops_tf32=95.7, tflops_fp16=383.0, tflops_bf16=383.0, memory_GiB=128,
                   memory_bandwidth_GBps=3200, intra_node={"bandwidth_GBps": 200.0, "latency_us": 3.0,
                                                           "kind": "InfinityFabric"}, host_link=PCIE4),
    "MI300X": dict(tflops_fp32=163.4, tflops_tf32=653.7, tflops_fp16=1307.0, tflops_bf16=1307.0, memory_GiB=192,
                   memory_bandwidth_GBps=5300, intra_node={"bandwidth_GBps": 448.0, "latency_us": 3.0,
                                                           "kind": "InfinityFabric"}, host_link=PCIE5),
    # 32 GB of memory (shared with the board's CPU) as on the 32 GB module; the compute figures are the 64 GB
    # module's (2048 cores at 1.3 GHz); the 32 GB module's GPU (1792 cores at 930 MHz) peaks at ~3.3 fp32 and
    # ~26.7 fp16 TFLOP/s.
    "Jetson-AGX-Orin": dict(tflops_fp32=5.3, tflops_tf32=5.3, tflops_fp16=42.5, tflops_bf16=42.5, memory_GiB=32,
                            memory_bandwidth_GBps=204.8, intra_node={"bandwidth_GBps": 100.0,
                                                                     "latency_us": 1.0, "kind": "shared"},
                            host_link={"bandwidth_GBps": 100.0, "latency_us": 1.0, "kind": "unified"},
                            kind="edge"),
    # Jetson Orin NX 16GB module: 1024-core Ampere GPU (8 SMs, 32 tensor cores) at 918 MHz, 16 GB LPDDR5
    # (128-bit, 102.4 GB/s) shared with the CPU; fp32 = 1024 x 2 x 0.918 GHz, tensor fp16 dense = 60 sparse
    # INT8 GPU TOPS / 4.
    "Jetson-Orin-NX-16GB": dict(tflops_fp32=1.88, tflops_tf32=1.88, tflops_fp16=15.0, tflops_bf16=15.0, memory_GiB=16,
                                memory_bandwidth_GBps=102.4, intra_node={"bandwidth_GBps": 50.0,
                                                                         "latency_us": 1.0, "kind": "shared"},
                                host_link={"bandwidth_GBps": 50.0, "latency_us": 1.0, "kind": "unified"},
                                kind="edge"),
    # Jetson Xavier NX 8GB module: 384-core Volta GPU (48 tensor cores) at 1.1 GHz, 8 GB LPDDR4x (59.7 GB/s)
    # shared with the CPU; fp16 tensor cores only (48 x 64 FMA x 2 x 1.1 GHz), no bf16.
    "Jetson-Xavier-NX-8GB": dict(tflops_fp32=0.845, tflops_tf32=0.845, tflops_fp16=6.76, tflops_bf16=None, memory_GiB=8,
                                 memory_bandwidth_GBps=59.7, intra_node={"bandwidth_GBps": 30.0,
                                                                         "latency_us": 1.0, "kind": "shared"},
                                 host_link={"bandwidth_GBps": 30.0, "latency_us": 1.0, "kind": "unified"},
                                 kind="edge"),
}

# Inter-node network defaults (per device, one direction) used when a cluster file gives none.
DEFAULT_NETWORK = {"bandwidth_GBps": 25.0, "latency_us": 5.0}  # InfiniBand HDR, one port per GPU
EDGE_NETWORK = {"bandwidth_GBps": 0.125, "latency_us": 100.0}  # 1 Gb/s Ethernet

# Aliases users commonly type.
ALIASES = {
    "H100": "H100-SXM", "A100": "A100-80GB", "V100": "V100-32GB", "A100-SXM4-80GB": "A100-80GB",
    "A100-SXM4-40GB": "A100-40GB", "RTX3090": "RTX-3090", "RTX4090": "RTX-4090",
    "RTX2080TI": "RTX-2080Ti", "TITANRTX": "TITAN-RTX", "ORIN": "Jetson-AGX-Orin",
    "ORIN-NX": "Jetson-Orin-NX-16GB", "XAVIER-NX": "Jetson-Xavier-NX-8GB",
}
