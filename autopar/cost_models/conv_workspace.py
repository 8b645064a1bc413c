"""The buffer a convolution's backward allocates for its weight gradient on an x86 CPU (PyTorch's oneDNN path).

What runs. PyTorch computes a CPU convolution's weight gradient with oneDNN (aten/src/ATen/native/mkldnn/
Conv.cpp, `mkldnn_convolution_backward_weights`): it hands ideep an empty tensor, ideep allocates it through
PyTorch's CPU allocator (the profiler shows it parented to `aten::convolution_backward`) in the layout the
oneDNN backward-weights primitive picked, the primitive writes the gradient there, and PyTorch copies it into
the dense gradient (`mkldnn_to_dense`) before the buffer is freed. So each call holds, next to the input
gradient it computed first and the dense weight gradient, a transient of that layout's bytes, independent of
the batch and of the image size. oneDNN's JIT kernels keep weights in blocked layouts whose blocks are one
vector of fp32 (`block`: 16 on AVX-512, 8 on AVX2) in each of a group's output and input channels, padded up
to whole blocks. A depthwise convolution (one input and one output channel per group) served by the generic
kernel (gOIhw16i16o) therefore holds 16 x 16 = 256 times its weights: 256 x C x kh x kw x 4 bytes (784 KiB
at C = 16 with a 7 x 7 kernel; 36.75 MiB for ConvNeXt-T's C = 768). Around the primitive, PyTorch's
channels-last path adds weight-sized copies (`weight_grad_transient`). On top, when the gradient has a bias whose
per-group output channels are not a whole number of blocks, the primitive books a padded bias in its
scratchpad (g x round_up(oc/g, block) x 4 bytes plus oneDNN's 128-byte scratchpad alignment per entry,
src/common/memory_tracking.hpp), which ideep also allocates per call.

Which primitive (oneDNN 3.x, x64, f32 backward-weights: the first of these that accepts the problem):

1. `jit_uni_dw` (AVX-512, then AVX2; src/cpu/x64/jit_uni_dw_conv_kernel_utils.cpp): depthwise, kernel width
   <= 3, no dilation, stride_w <= kw, paddings within half the kernel, ih >= kh + (-t_pad mod stride_h),
   paddings above 1 multiples of the stride. Layout Goihw{block}g: round_up(g, block) x kh x kw.
2. `jit_avx512_common` (AVX-512; src/cpu/x64/jit_avx512_common_conv_kernel.cpp): kernel width <= 14,
   l_pad, r_pad < the (dilated) kernel width and <= 28, t_pad, b_pad <= half its height. A first
   convolution (groups 1, fewer than 16 input channels) takes channels-last input, or plain input with 1-3
   channels: Ohwi16o, round_up(oc, 16) x ic x kh x kw. Any other takes channels-last input, or (channels
   padded to 16 with groups 1, whole blocks per group otherwise) blocked input: gOIhw16i16o,
   g x round_up(oc/g, 16) x round_up(ic/g, 16) x kh x kw.
3. `jit_avx2`: the same with 8-wide blocks; its first-convolution layout (Ohwi8o) for 3 input channels only.
   Its rules are those of oneDNN 2.x's source (jit_avx2_conv_kernel_f32.cpp: kernel width < 14, no
   dilation, paddings below the kernel) and checked on 3.12 with ONEDNN_MAX_CPU_ISA=AVX2 (depthwise,
   grouped, ungrouped, first convolutions, both memory formats).
4. `gemm`: the dense layout, the weights' own bytes (its im2col scratchpad is not priced, below).

The memory format decides what the primitive sees: PyTorch runs the convolution channels-last
(`mkldnn_conv_use_channels_last`) when the input's or the weight's strides are channels-last-like
(`suggest_memory_format`, mirrored by `strides_like_channels_last`), and then gives oneDNN channels-last
tensors; otherwise it lets the primitive pick (ideep's format `any`: blocked nChw16c, or plain for a first
convolution and for gemm). The captured graph records every tensor's strides (the exported program's fake
tensors propagate them as eager does; passes/annotate.py reads them), which is how ConvNeXt's depthwise
convolutions are known to run channels-last: the residual add after each block's permuted LayerNorm / MLP
makes the next block's input channels-last.

Where it exists: the "cpu" device kind, i.e. this host (cost_models/host.py `cpu_spec`): an x86 CPU with
oneDNN available and enabled in torch, fp32 tensors, 2-D convolutions that are not transposed. `local_isa`
reads the CPU's vector extensions (cpuinfo, through torch) capped by oneDNN's own ONEDNN_MAX_CPU_ISA
(DNNL_MAX_CPU_ISA), which oneDNN reads when it starts. On CUDA the convolution runs cuDNN, whose workspace
is another thing and not known here: nothing is priced there, nor on edge boards or ARM CPUs (oneDNN with
ACL).

Not priced (measured with torch.profiler on an AVX-512 host, 1 thread): the scratchpads of other primitives
and of the backward-data half, a few KB to ~37 KB for the brgemm backward-data kernels, and the gemm path's
im2col buffers, which grow with the output's spatial size (25 KB at 8 x 8, 213 KB at 32 x 32 for a 16-channel
7 x 7 depthwise convolution on a plain input); on a plain (NCHW) input, the reorders of the input and of its
output gradient into the blocked layout a JIT kernel picks (activation-sized); channels-last, the copies
PyTorch makes of an input or output gradient that arrives in another layout (`.contiguous(channels_last)`,
activation-sized; none in ConvNeXt, whose gradients come back through the permutes channels-last); the
weights' reorder into the backward-data layout (weight-sized, freed before the weight gradient's buffer); and,
when a
process runs more threads than the convolution has groups, the per-thread reduction copies the JIT kernels may
book (up to threads / groups - 1 more buffers): ranks run one thread each (runtime/launch.py, torchrun's
default). Mixed precision (bf16 / fp16 autocast on a CPU) runs other oneDNN kernels, with fp32 accumulation
buffers (a 16-channel 7 x 7 depthwise convolution in bf16: 0.9 + 0.4 MB): not priced either
(`cost_models.memory.backward_workspace` returns 0 there). PyTorch's routing (`use_mkldnn`) sends a few small
convolutions to its native kernels, depending on the micro-batch and the thread count (1 x 1 unstrided kernels
with fewer than 16 samples on one thread; ungrouped kernels up to 3 wide on one sample of at most 20480
elements); neither is known when the graph is annotated, so those are priced as oneDNN runs them: at most
their padded weights too many.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

CPU_KIND = "cpu"  # the device kind these buffers exist on (`DeviceSpec.kind`)
FP32_BYTES = 4
SCRATCHPAD_ALIGN = 128  # oneDNN's scratchpad alignment, added to every entry (memory_tracking.hpp)
MAX_UR_W = 28  # jit_avx512_common_conv_bwd_weights_kernel_f32::max_ur_w
BLOCK = {"avx512_core": 16, "avx2": 8}


@dataclass(frozen=True)
class ConvGeometry:
    """A 2-D convolution as its backward sees it (torch's conventions: dilation 1 = none)."""

    in_channels: int
    out_channels: int
    groups: int
    kernel: tuple[int, int]  # kh, kw
    input_hw: tuple[int, int]  # ih, iw
    stride: tuple[int, int]
    padding: tuple[int, int]  # top, left (torch pads symmetrically)
    dilation: tuple[int, int]
    bias: bool  # its gradient is computed
    channels_last: bool  # PyTorch runs it channels-last (`strides_like_channels_last` of input or weight)
    weight_channels_last: bool = False  # the weight is channels-last-contiguous (`contiguous_channels_last`)

    @property
    def output_hw(self) -> tuple[int, int]:
        return tuple(  # type: ignore[return-value]
            (i + 2 * p - d * (k - 1) - 1) // s + 1
            for i, p, d, k, s in zip(self.input_hw, self.padding, self.dilation, self.kernel, self.stride,
                                     strict=True))

    @property
    def weight_bytes(self) -> int:
        return self.out_channels * (self.in_channels // self.groups) * self.kernel[0] * self.kernel[1] * FP32_BYTES


def strides_like_channels_last(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether a 4-D tensor's strides are channels-last-like: c10's `is_channels_last_strides_2d` (what
    `suggest_memory_format` returns ChannelsLast for), as torch._prims_common mirrors it."""
    if len(shape) != 4 or len(strides) != 4 or strides[1] == 0:
        return False
    low = 0
    for d in (1, 3, 2, 0):
        if shape[d] == 0 or strides[d] < low or (d == 0 and low == strides[1]):
            return False
        low = strides[d] * (shape[d] if strides[d] > 1 else 1)
    return True


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def contiguous_channels_last(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """`Tensor.is_contiguous(memory_format=torch.channels_last)` of a 4-D tensor (c10's
    `compute_channels_last_contiguous_2d`: dimensions of size 1 take any stride)."""
    if len(shape) != 4:
        return False
    expected = 1
    for d in (1, 3, 2, 0):
        if shape[d] != 1:
            if strides[d] != expected:
                return False
            expected *= shape[d]
    return True


def local_isa() -> str | None:
    """The vector ISA oneDNN's convolutions use on this host ("avx512_core", "avx2"), or None where the
    buffers modelled here do not apply (not x86, no oneDNN, oneDNN disabled, or capped below AVX2)."""
    import torch

    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return None
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return None
    avx512 = bool(getattr(torch.cpu, "_is_avx512_supported", lambda: False)())
    avx2 = avx512 or bool(getattr(torch.cpu, "_is_avx2_supported", lambda: False)())
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    if cap != "ALL" and not cap.startswith(("AVX512", "AVX10", "AMX")):
        avx512 = False
        avx2 = avx2 and cap.startswith("AVX2")
    return "avx512_core" if avx512 else "avx2" if avx2 else None


def _up(x: int, b: int) -> int:
    return -(-x // b) * b


def _pads(c: ConvGeometry) -> tuple[int, int, int, int, int, int]:
    """(t, b, l, r pads, dilated kernel height, width) as oneDNN derives them."""
    (kh, kw), (ih, iw), (sh, sw), (oh, ow) = c.kernel, c.input_hw, c.stride, c.output_hw
    ekh, ekw = (kh - 1) * c.dilation[0] + 1, (kw - 1) * c.dilation[1] + 1
    t, left = c.padding
    b = max(0, (oh - 1) * sh + ekh - ih - t)
    r = max(0, (ow - 1) * sw + ekw - iw - left)
    return t, b, left, r, ekh, ekw


def _depthwise_ok(c: ConvGeometry) -> bool:
    """jit_uni_dw's backward-weights applicability (module docstring, 1)."""
    kh, kw = c.kernel
    if not (c.groups > 1 and c.in_channels == c.groups and c.out_channels == c.groups):
        return False
    if c.dilation != (1, 1) or kw > 3 or c.stride[1] > kw:
        return False
    t, b, left, r, _, _ = _pads(c)
    sh = c.stride[0]
    return (t <= kh // 2 and b <= kh // 2 and left <= kw // 2 and r <= kw // 2
            and c.input_hw[0] >= kh + (-t) % sh
            and (t <= 1 or t % sh == 0) and (b <= 1 or b % sh == 0))


def _layout_avx512(c: ConvGeometry) -> tuple[int, int] | None:
    """(weight-gradient elements, padded output channels per group) of jit_avx512_common, or None."""
    (kh, kw), (ih, iw), (_, ow) = c.kernel, c.input_hw, c.output_hw
    g, oc, ic = c.groups, c.out_channels // c.groups, c.in_channels // c.groups
    t, b, left, r, ekh, ekw = _pads(c)
    dh, dw = c.dilation[0] - 1, c.dilation[1] - 1
    if (dh and c.stride[0] != 1) or (dh and ekh > ih):
        return None
    if not (left < ekw and r < ekw and t <= ekh // 2 and b <= ekh // 2 and left <= MAX_UR_W and r <= MAX_UR_W):
        return None
    hw_transp = (not c.channels_last and 14 <= kw < 20 and ow == 1 and kw == iw and c.stride == (1, 1)
                 and (dh, dw) == (0, 0) and (t, b, left, r) == (0, 0, 0, 0))
    if kw > 14 and not hw_transp:
        return None
    if ic < 16 and g == 1:  # a first convolution: Ohwi16o
        if not c.channels_last and ic not in (1, 2, 3):
            return None
        return _up(oc, 16) * ic * kh * kw, _up(oc, 16)
    if not c.channels_last and g > 1 and (oc % 16 or ic % 16):  # blocked input: whole blocks per group
        return None
    return g * _up(oc, 16) * _up(ic, 16) * kh * kw, _up(oc, 16)


def _layout_avx2(c: ConvGeometry) -> tuple[int, int] | None:
    """(weight-gradient elements, padded output channels per group) of jit_avx2, or None."""
    (kh, kw), (ih, _) = c.kernel, c.input_hw
    g, oc, ic = c.groups, c.out_channels // c.groups, c.in_channels // c.groups
    t, b, left, r, ekh, ekw = _pads(c)
    if c.dilation != (1, 1) or kw >= 14 or kh > ih or not (t < ekh and b < ekh and left < ekw and r < ekw):
        return None
    if ic == 3 and g == 1:  # "flat": Ohwi8o
        return _up(oc, 8) * ic * kh * kw, _up(oc, 8)
    if not c.channels_last and g > 1 and (oc % 8 or ic % 8):
        return None
    return g * _up(oc, 8) * _up(ic, 8) * kh * kw, _up(oc, 8)


def onednn_weight_grad_bytes(c: ConvGeometry, isa: str) -> tuple[int, int]:
    """(bytes of the weight gradient in the layout oneDNN's backward-weights primitive picks under `isa`,
    bytes of its padded-bias scratchpad): module docstring, 1-4."""
    if _depthwise_ok(c):
        return _up(c.groups, BLOCK[isa]) * c.kernel[0] * c.kernel[1] * FP32_BYTES, 0
    found, block = (_layout_avx512(c), 16) if isa == "avx512_core" else (None, 16)
    if found is None:
        found, block = _layout_avx2(c), 8
    if found is None:  # gemm: the dense layout
        return c.weight_bytes, 0
    elems, oc_padded = found
    padded_bias = c.bias and (c.out_channels // c.groups) % block != 0
    return elems * FP32_BYTES, c.groups * oc_padded * FP32_BYTES + SCRATCHPAD_ALIGN if padded_bias else 0


def weight_grad_transient(c: ConvGeometry, isa: str | None) -> int:
    """Bytes a CPU convolution's backward holds at once for its weight (and bias) gradient beyond the
    gradients it returns, under `isa` (`local_isa`; None: 0). What PyTorch's Conv.cpp does around the
    primitive (module docstring): ideep's buffer in oneDNN's layout (`onednn_weight_grad_bytes`) and its dense
    bias gradient (oc x 4) live until the call returns, the padded-bias scratchpad while the primitive runs;
    channels-last, PyTorch also copies the weight to channels-last unless it is channels-last-contiguous
    already (`weight.contiguous(channels_last)`, alive for the whole call) and converts the dense gradient
    with `.to(channels_last)`, whose contiguous source (weight-sized) lives next to the copy it returns unless
    its strides already read as channels-last."""
    if isa not in BLOCK:
        return 0
    buffer, scratch = onednn_weight_grad_bytes(c, isa)
    bias = c.out_channels * FP32_BYTES if c.bias else 0
    if not c.channels_last:
        return buffer + bias + scratch
    kh, kw = c.kernel
    shape = (c.out_channels, c.in_channels // c.groups, kh, kw)
    weight_copy = 0 if c.weight_channels_last else c.weight_bytes
    dense = 0 if strides_like_channels_last(shape, contiguous_strides(shape)) else c.weight_bytes
    return weight_copy + buffer + bias + max(scratch, dense)
