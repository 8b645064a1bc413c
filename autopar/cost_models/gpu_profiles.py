"""Default compute profiles of catalog GPUs, from kernel-level evidence (not from end-to-end training rows).

What PyTorch runs for each training precision (eager, cuBLAS / cuDNN / SDPA), and so which peak each op
kind is priced against (`kind_peak`); "Ampere+" = compute capability >= 8.0 (the catalog's bf16 entry):
- "bf16" / "fp16" (mixed precision): GEMMs, convolutions and attention on the 16-bit tensor cores;
  pointwise math (GELU, softmax's exp) at the fp32 CUDA-core rate, because PyTorch's elementwise
  kernels compute half/bfloat16 data in fp32 (`at::opmath_type`).
- "tf32": fp32 storage with `torch.backends.cuda.matmul.allow_tf32 = True` (on in NGC containers,
  `TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`): GEMMs and convolutions on the TF32 tensor cores of Ampere+,
  on the fp32 CUDA cores before (Volta and Turing have no TF32: their catalog tf32 peak is the fp32 one).
- "fp32": fp32 storage, PyTorch's defaults: GEMMs on the fp32 CUDA cores (`allow_tf32` False since
  PyTorch 1.12), convolutions on TF32 tensor cores on Ampere+ (`torch.backends.cudnn.allow_tf32` is
  True by default; PyTorch "TF32 on Ampere" notes).
- attention with fp32 storage (both fp32 readings): FlashAttention takes only fp16/bf16, so SDPA runs the
  memory-efficient (xFormers/CUTLASS) kernel, which on sm80+ multiplies fp32 with three TF32 tensor-core
  products (`cutlass::arch::OpMultiplyAddFastF32` in its `DefaultGemmType<Sm80, float>`): a third of the
  TF32 peak; before Ampere it uses SIMT fp32 (the CUDA-core peak).

GEMM curve: eff = eff_max * F / (F + half) (compute.py), F the GEMM's FLOPs. `half` is one wave of
128x128 output tiles with K = 512 on every SM (sms * 2 * 128 * 128 * 512 FLOPs): a GEMM smaller than
one wave leaves SMs idle (wave quantisation, NVIDIA "Matrix Multiplication Background" user guide), so
it is the size at which half of eff_max is plausible (estimate; the guide's A100 m=n=k curves reach
about half of their plateau near 1024^3, 2.1 GFLOP, where this gives 54%). Skinny GEMMs are bounded by
the roofline's byte term. Memory-bound kernels: a STREAM-like fraction of the datasheet bandwidth times
each kind's share of it (compute.KIND_BW_SHARE).

Every figure below carries its source; "estimate" marks an engineering estimate (a reasoned figure,
not a measurement). `autopar calibrate` on a CUDA GPU measures these curves and its profile replaces
these defaults (compute.load_profile).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..catalog import DeviceSpec

_MAMF = ("Stas Bekman, ml-engineering, 'Maximum Achievable Matmul FLOPS' table (mamf-finder.py, torch.mm "
         "bf16 best shape)")
_STREAM_HBM = ("estimate: STREAM/BabelStream-like copies reach ~88-92% of HBM2/HBM2e/HBM3 datasheet "
               "bandwidth (Deakin et al., BabelStream, 2018, for V100)")
_STREAM_GDDR = "estimate: GDDR6/GDDR6X copy kernels reach ~80-88% of datasheet bandwidth"
_SGEMM = ("estimate: cuBLAS SGEMM on datacenter Volta/Ampere SMs (one FP32 datapath per lane) runs ~90% "
          "of the fp32 peak on large squares")
_SGEMM_GA10X = ("estimate: GA10x/AD10x count two FP32 datapaths per SM partition, one shared with INT32 "
                "(GA102 whitepaper); SGEMM reaches ~65% of that doubled peak")
_TF32 = ("estimate: TF32 mma moves 4-byte operands (twice fp16's bytes per FLOP through shared memory); "
         "large TF32 GEMMs run a little below the 16-bit fraction")
_FA2_A100 = ("FlashAttention-2 (Dao, 2023): fwd+bwd 50-70% of A100 peak, fwd up to 73%; 0.55 for "
             "head dim 64-128 training")
_FA2_H100 = "FlashAttention-3 (Shah et al., 2024): FlashAttention-2 reaches ~35% of H100 peak"
MEMEFF_SOURCE = ("estimate: the memory-efficient (CUTLASS) SDPA kernel, which PyTorch runs where FlashAttention "
           "cannot (pre-Ampere, fp32), at ~35-45% of the peak it multiplies on")
_POWER = ("estimate: 70-72 W board power holds sustained tensor/GEMM clocks well under the boost clock "
          "the peak assumes (T4: 1590 MHz boost, L4: 2040 MHz; NVIDIA datasheets)")

# name -> facts. sms: streaming multiprocessors (NVIDIA architecture whitepapers / datasheets).
# g16, tf32, fp32: large-GEMM fraction of the peak of that precision; stream: memory-bound fraction;
# attn16: SDPA fraction of the 16-bit peak; clock: sustained-clock factor on power-capped boards.
GPU_FACTS: dict[str, dict] = {
    "A100-40GB": dict(sms=108, g16=(0.86, _MAMF + ": A100 SXM 267.9 TFLOP/s = 85.9%"), tf32=(0.75, _TF32),
                      fp32=(0.9, _SGEMM), stream=(0.88, _STREAM_HBM), attn16=(0.55, _FA2_A100)),
    "A100-80GB": dict(sms=108, g16=(0.86, _MAMF + ": A100 SXM 267.9 TFLOP/s = 85.9%"), tf32=(0.75, _TF32),
                      fp32=(0.9, _SGEMM), stream=(0.9, _STREAM_HBM), attn16=(0.55, _FA2_A100)),
    "H100-SXM": dict(sms=132, g16=(0.80, _MAMF + ": H100 SXM 792.1 TFLOP/s = 80.1%"), tf32=(0.7, _TF32),
                     fp32=(0.85, _SGEMM), stream=(0.9, _STREAM_HBM), attn16=(0.35, _FA2_H100)),
    "H200": dict(sms=132, g16=(0.80, _MAMF + ": H100 SXM (same GH100 chip and clocks)"), tf32=(0.7, _TF32),
                 fp32=(0.85, _SGEMM), stream=(0.9, _STREAM_HBM), attn16=(0.35, _FA2_H100)),
    "V100-16GB": dict(sms=80, g16=(0.75, "estimate: cuBLAS HGEMM on V100 ~90-100 of 125 TFLOP/s"),
                      fp32=(0.9, _SGEMM), stream=(0.88, _STREAM_HBM), attn16=(0.35, MEMEFF_SOURCE)),
    "V100-32GB": dict(sms=80, g16=(0.75, "estimate: cuBLAS HGEMM on V100 ~90-100 of 125 TFLOP/s"),
                      fp32=(0.9, _SGEMM), stream=(0.88, _STREAM_HBM), attn16=(0.35, MEMEFF_SOURCE)),
    "T4": dict(sms=40, g16=(0.75, "estimate: as V100 at full clock"), fp32=(0.9, _SGEMM),
               stream=(0.8, _STREAM_GDDR), attn16=(0.35, MEMEFF_SOURCE), clock=(0.65, _POWER)),
    "RTX-2080Ti": dict(sms=68, g16=(0.8, "estimate: fp32-accumulate HMMA runs at half rate, which cuBLAS "
                                          "nearly saturates"), fp32=(0.9, _SGEMM),
                       stream=(0.85, _STREAM_GDDR), attn16=(0.35, MEMEFF_SOURCE)),
    "TITAN-RTX": dict(sms=72, g16=(0.7, "estimate: full-rate fp32-accumulate HMMA, 280 W"), fp32=(0.9, _SGEMM),
                      stream=(0.85, _STREAM_GDDR), attn16=(0.35, MEMEFF_SOURCE)),
    "RTX-3090": dict(sms=82, g16=(0.8, "estimate: fp32-accumulate HMMA at half rate (GA102 whitepaper)"),
                     tf32=(0.75, _TF32), fp32=(0.65, _SGEMM_GA10X), stream=(0.85, _STREAM_GDDR),
                     attn16=(0.5, "estimate: FlashAttention-2 on sm86, a little under its A100 fraction")),
    "A10G": dict(sms=80, g16=(0.75, "estimate: GA102 at 150 W"), tf32=(0.7, _TF32), fp32=(0.65, _SGEMM_GA10X),
                 stream=(0.85, _STREAM_GDDR),
                 attn16=(0.5, "estimate: FlashAttention-2 on sm86, a little under its A100 fraction")),
    "A10": dict(sms=72, g16=(0.75, "estimate: GA102 at 150 W"), tf32=(0.7, _TF32), fp32=(0.65, _SGEMM_GA10X),
                stream=(0.85, _STREAM_GDDR),
                attn16=(0.5, "estimate: FlashAttention-2 on sm86, a little under its A100 fraction")),
    "L4": dict(sms=58, g16=(0.75, "estimate: AD104 at full clock"), tf32=(0.7, _TF32), fp32=(0.65, _SGEMM_GA10X),
               stream=(0.8, _STREAM_GDDR), attn16=(0.5, "estimate: FlashAttention-2 on sm89"),
               clock=(0.7, _POWER)),
}


def has_tf32(spec: DeviceSpec) -> bool:
    """Whether the device has TF32 tensor cores: compute capability >= 8.0, which the catalog marks by a
    bf16 peak (catalog.py: bf16 and TF32 both arrived with Ampere)."""
    return "bf16" in spec.peak_flops and spec.kind != "cpu"


def kind_peak(spec: DeviceSpec, kind: str, dtype: str) -> float:
    """The FLOP/s peak an op of `kind` runs against under training precision `dtype` (module docstring)."""
    if spec.kind == "cpu":
        return spec.flops(dtype)
    sixteen = dtype in ("bf16", "fp16")
    if kind in ("elementwise", "softmax"):
        return spec.flops("fp32")  # opmath: half/bfloat16 pointwise math runs in fp32
    if kind == "matmul":
        return spec.flops(dtype)
    if kind == "conv":
        return spec.flops(dtype) if sixteen else spec.flops("tf32" if has_tf32(spec) else "fp32")
    if kind == "attention":
        if sixteen:
            return spec.flops(dtype)
        return spec.flops("tf32") / 3 if has_tf32(spec) else spec.flops("fp32")
    return spec.flops(dtype)


def gemm_half(sms: int) -> float:
    return sms * 2.0 * 128 * 128 * 512  # one wave of 128x128 tiles, K = 512 (module docstring)


__all__ = ["GPU_FACTS", "MEMEFF_SOURCE", "gemm_half", "has_tf32", "kind_peak"]
