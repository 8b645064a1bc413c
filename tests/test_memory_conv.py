"""The CPU convolution backward's weight-gradient transient (cost_models/conv_workspace.py), priced against what
torch.profiler measures on this host, and carried from the captured strides to the cost model.

On x86, PyTorch runs a CPU convolution's backward through oneDNN, which writes the weight gradient into a
buffer in its blocked layout (each group's channels padded to 16 on AVX-512, 8 on AVX2) before PyTorch
copies it into the dense gradient: 256 times the weights for a depthwise convolution on a channels-last input
(ConvNeXt's). The transient measured is the peak of live bytes inside one `aten::convolution_backward` less
the gradients it returns. One thread, as ranks run (runtime/launch.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import autopar
from autopar.cluster import Cluster
from autopar.cost_models.conv_workspace import (
    CPU_KIND,
    ConvGeometry,
    local_isa,
    onednn_weight_grad_bytes,
    weight_grad_transient,
)
from autopar.passes.annotate import annotate
from autopar.solver.pricing.model import Option
from autopar.solver.pricing.pricing import CostModel, settled_work
from autopar.solver.pricing.stage_memory import stage_memory

ISA = local_isa()
pytestmark = pytest.mark.skipif(ISA is None, reason="no oneDNN on an x86 CPU here: the buffer does not exist")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def conv_backward(c: ConvGeometry, batch: int = 4, input_grad: bool = True) -> tuple[int, list[int]]:
    """Run one convolution backward as autograd does; return (peak live bytes it allocated less the gradients
    it returns, the sizes of the blocks it allocated outside any aten op of its own: ideep's and oneDNN's)."""
    torch.manual_seed(0)
    x = torch.randn(batch, c.in_channels, *c.input_hw)
    if c.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(c.out_channels, c.in_channels // c.groups, *c.kernel)
    y = torch.nn.functional.conv2d(x, w, None, c.stride, c.padding, c.dilation, c.groups)
    gy = torch.randn_like(y)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        grads = torch.ops.aten.convolution_backward(
            gy, x, w, [c.out_channels] if c.bias else None, list(c.stride), list(c.padding), list(c.dilation),
            False, [0, 0], c.groups, [input_grad, True, c.bias])
    events, direct, stack = [], [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and str(node.extra_fields.device) == "cpu":
            events.append((node.start_time_ns, int(node.extra_fields.alloc_size)))
            if node.extra_fields.alloc_size > 0 and node.parent is not None \
                    and node.parent.name == "aten::convolution_backward":
                direct.append(int(node.extra_fields.alloc_size))
        stack.extend(node.children)
    live = peak = 0
    for _, nbytes in sorted(events):
        live += nbytes
        peak = max(peak, live)
    returned = sum(g.untyped_storage().nbytes() for g in grads if g is not None)
    return peak - returned, direct


def geometry(cin: int, cout: int, k: int, groups: int, stride: int, hw: int, channels_last: bool,
             bias: bool = True) -> ConvGeometry:
    pad = k // 2 if stride == 1 else 0
    # the weights are created contiguous: channels-last-contiguous too with one input channel per group
    return ConvGeometry(cin, cout, groups, (k, k), (hw, hw), (stride, stride), (pad, pad), (1, 1), bias,
                        channels_last, weight_channels_last=cin // groups == 1)


# depthwise 7 x 7 (ConvNeXt's), two and three channel counts; depthwise 3 x 3 (oneDNN's depthwise kernel);
# grouped; ConvNeXt's downsampling (16 -> 32, 2 x 2 / 2) and stem (3 -> 16, 4 x 4 / 4); ungrouped, padded
CHANNELS_LAST = [(16, 16, 7, 16, 1, 8), (32, 32, 7, 32, 1, 8), (24, 24, 7, 24, 1, 16), (24, 24, 3, 24, 1, 8),
                 (16, 16, 7, 4, 1, 8), (16, 32, 2, 1, 2, 8), (3, 16, 4, 1, 4, 32), (20, 36, 3, 1, 1, 8)]


@pytest.mark.parametrize("shape", CHANNELS_LAST, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bias", [True, False])
def test_channels_last_transient_is_priced_to_the_byte(shape: tuple, bias: bool) -> None:
    c = geometry(*shape, channels_last=True, bias=bias)
    # grouped: the whole backward (the backward-data half's temporaries are gone by the time the weight
    # gradient's buffer exists); ungrouped: the weight gradient alone, as the brgemm backward-data kernels'
    # scratchpad (~37 KB here) is not priced (conv_workspace.py)
    measured, _ = conv_backward(c, input_grad=c.groups > 1)
    assert weight_grad_transient(c, ISA) == measured, (c, ISA)


def test_depthwise_channels_last_holds_256_times_its_weights() -> None:
    c = geometry(16, 16, 7, 16, 1, 8, channels_last=True, bias=False)
    block = {"avx512_core": 16, "avx2": 8}[ISA]
    assert onednn_weight_grad_bytes(c, ISA) == (block * block * 16 * 49 * 4, 0)
    # independent of the batch and of the image size
    assert conv_backward(c, batch=1)[0] == conv_backward(geometry(16, 16, 7, 16, 1, 32, True, False), 8)[0]


# plain (NCHW) inputs: oneDNN's buffer is priced exactly (the dense layout for gemm, Goihw16g for the depthwise
# kernel, Ohwi16o for a first convolution, blocked for ungrouped ones); the gemm path's im2col scratchpad and the
# reorders of the input and its gradient into blocked layouts are not (conv_workspace.py): a lower bound
PLAIN = [(16, 16, 7, 16, 1, 8), (32, 32, 7, 32, 1, 16), (16, 16, 3, 16, 1, 8), (3, 16, 4, 1, 4, 32),
         (20, 36, 3, 1, 1, 8)]


@pytest.mark.parametrize("shape", PLAIN, ids=lambda s: "x".join(map(str, s)))
def test_plain_input_buffer_is_the_one_onednn_allocates(shape: tuple) -> None:
    c = geometry(*shape, channels_last=False, bias=False)
    measured, direct = conv_backward(c, input_grad=c.groups > 1)
    buffer, scratch = onednn_weight_grad_bytes(c, ISA)
    assert scratch == 0 and buffer in direct, (buffer, direct)
    assert 0 < weight_grad_transient(c, ISA) <= measured


class Block(nn.Module):
    """ConvNeXt's pattern: a depthwise convolution, a channels-last MLP between two permutes, a residual add.
    The add's output (the next block's input) takes the layout of its first operand where the two differ
    (TensorIterator), here the permuted MLP output's: channels-last (in ConvNeXt both operands are)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.mlp = nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.dw(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2) + x


def test_annotate_reads_the_memory_format_from_the_captured_strides() -> None:
    model = nn.Sequential(nn.Conv2d(3, 16, 4, stride=4), Block(16), Block(16))
    x = torch.randn(2, 3, 32, 32)
    g = annotate(autopar.capture(model, (x,), lambda out, t: out.mean(), torch.zeros(1)), None, "fp32")
    convs = [n for n in g.nodes.values() if n.target == "aten.conv2d.default"]
    assert len(convs) == 3
    stem = geometry(3, 16, 4, 1, 4, 32, channels_last=False)
    first = geometry(16, 16, 7, 16, 1, 8, channels_last=False)  # the stem's output is contiguous
    second = geometry(16, 16, 7, 16, 1, 8, channels_last=True)  # the residual add's is channels-last
    want = [{CPU_KIND: weight_grad_transient(c, ISA)} for c in (stem, first, second)]
    assert [n.bwd_workspace for n in convs] == want
    # channels-last pads each group's weights to a block x block tile: 16 x 16 on AVX-512, 8 x 8 on AVX2
    assert convs[2].bwd_workspace[CPU_KIND] > (200 if ISA == "avx512_core" else 50) * convs[1].bwd_workspace[CPU_KIND]


@pytest.mark.parametrize("device", ["cpu", "T4"])
def test_cost_model_prices_it_per_device_on_cpus_only(device: str) -> None:
    model = nn.Sequential(Block(16), Block(16))
    x = torch.randn(2, 16, 8, 8)
    graph = autopar.capture(model, (x,), lambda out, t: out.mean(), torch.zeros(1))
    cluster = Cluster.load(f"1x1x{device}")
    cm = CostModel(annotate(graph, cluster, "fp32"), cluster, "fp32", "adamw", 0.1, intra_op=False)
    want = weight_grad_transient(geometry(16, 16, 7, 16, 1, 8, channels_last=True), ISA) if device == "cpu" else 0
    for n in (1, 2):  # per device, whatever the micro-batch
        base = cm.base(0, cm.L, cluster.devices[0].spec.name, n, (0,))
        assert base.bwd_workspace == want
        # no recompute, fp32, a step of one micro-batch (no gradient accumulation's transient): the work term is
        # the larger of the loss's transient and this buffer
        assert settled_work(stage_memory(cm, base, Option(), 1, 1), 1, 1) == max(base.bwd_transient, want)
        assert want == 0 or want > base.bwd_transient
