"""Training-state memory: parameters, gradients and optimizer state per parameter.

What the runtime keeps (runtime/precision.py). fp32/tf32 training: 4-byte weights and 4-byte gradients.
Mixed precision ("bf16"/"fp16") runs the forward under torch.autocast: the parameters stay fp32 and are
the master weights themselves, their gradients arrive and are reduced in fp32, so the state is the same
4 + 4 bytes (not 2 + 2 + a 4-byte master copy as in Micikevicius et al.'s scheme, which the runtime does
not use). Optimizer state on top: SGD with momentum 4 bytes per parameter (plain SGD 0), Adam/AdamW 8
(exp_avg, exp_avg_sq in fp32); AdamW therefore costs 16 bytes per parameter in every precision.

Besides the state, autocast makes a 2-byte copy of each weight a matmul / linear / convolution uses, once
per stage forward, and the op keeps it for its backward: `cast_copy` = 2 bytes per such parameter per
micro-batch in flight (0 in fp32/tf32); it is not part of `total`. Activations in mixed precision are
priced at 2 bytes per element (precision.py ELEMENT_BYTES): autocast's matmul outputs are bf16/fp16,
but ops on its fp32 list (softmax, log-softmax, cross-entropy, norms on CUDA) and type promotion (a
residual add of an fp32 stream) keep some activations in fp32, so the 2-byte figure is a lower bound
there; stage transfers do travel in 2 bytes (runtime/precision.py).

Two corrections to those 2 bytes and two transients (`activation_corrections`, per layer of the graph):

* ops torch.autocast runs in float32 (`AUTOCAST_FP32_OPS`, PyTorch AMP docs, "CUDA Ops that can autocast
  to float32": softmax, log_softmax, cross_entropy, nll_loss, ...) keep what they save themselves (their own
  output, e.g. the softmax probabilities of an unfused attention, or the log-probabilities cross-entropy
  keeps: the b x s x vocab tensor of a language model, the largest one it saves) in 4 bytes, not 2;
* the backward of such an op materialises two fp32 buffers the size of its input (the gradient it receives
  and the one it returns; for cross-entropy: d/d log-probs and d/d logits) while its saved tensor is
  still alive: a transient `2 x 4 x numel` in every precision, on top of the activations in flight (added
  to `StageMemory.work` through `StageBase.bwd_transient`). For a GPT's loss this is 8 bytes per logit,
  so the log-probabilities' 4 plus 8 = 12 bytes per logit at the loss's backward. Where the op runs fused
  (codegen/fusion_rules.py: it saves its input and recomputes, e.g. the fused cross-entropy keeps the
  logits), nothing of its own is kept and its backward returns one fp32 buffer: `1 x 4 x numel`;
* the backward of any op holds the gradient of its output (its size, in the activations' precision) beside
  the saved tensors, the largest such gradient in the layer (a GPT block's MLP: b x s x 4h at the
  activation): measured 2.06 MiB at the peak of a one-block pipeline stage at 2K tokens, hidden 64
  (bench/long_context.py), where the block's 2 MiB gradient is the largest; the larger of the two counts.

One more transient, on CPUs only (`backward_workspace`, per layer, per device kind): a convolution's backward
on an x86 CPU writes its weight gradient into a buffer in oneDNN's blocked layout before PyTorch copies it
into the dense gradient, each group's channels padded to the vector block (16 fp32 on AVX-512, 8 on AVX2):
256 times the weights for a depthwise convolution on a channels-last input (ConvNeXt's 7 x 7 convolutions:
256 x C x 49 x 4 bytes), with PyTorch's channels-last copies beside it. Its bytes depend on the layer's
shapes, strides (which the capture records, so a channels-last input is known) and the host's vector ISA,
not on the batch: annotate fills `OpNode.bwd_workspace` (formula, sources and what is not priced:
cost_models/conv_workspace.py), and it is added to `StageMemory.work` per device, not per sample, through
`StageBase.bwd_workspace`. In mixed precision the CPU runs other (bf16) kernels whose buffers are not
modelled: 0 there. CUDA (cuDNN's workspace) is not priced: not known here.

Device memory outside the tensors (`runtime_reserve_bytes`, CUDA devices only: catalog boards of kind
"gpu"; CPU ranks and the unified-memory edge boards are not charged, nor a custom device with a name of its
own, e.g. a scaled-down test device or a board described by its usable memory): what every training
process holds on its GPU before the first tensor, subtracted from the usable capacity (`CostModel.usable`),
not counted in the predicted peak (which stays comparable to the allocator's `max_memory_allocated`):

* CUDA context (driver state, loaded kernels): `CUDA_CONTEXT_BYTES` = 400 MiB with lazy module loading
  (the default since PyTorch 1.13 / CUDA 11.7): pytorch/pytorch PR #86509 measured 287 MB (context plus a
  6 MB tensor) lazy vs 667 MB eager; ptrblck in pytorch/pytorch#109888 "around 400MB if CUDA >= 11.7 is
  used and lazy module loading enabled", and in #107667 ">1000MB" before CUDA 11.7, when all kernels
  were loaded eagerly (a 2020-era stack such as AMP's DeepSpeed runs pays that larger figure);
* cuBLAS workspace: `CUBLAS_WORKSPACE_BYTES` = 8,519,680 bytes per handle and stream (PyTorch's default
  `:4096:2:16:8` config, 4096 KiB x 2 + 16 KiB x 8; the fixed 8519680-byte block reported on
  discuss.pytorch.org "unexpected memory allocation in torch.cuda.memory_snapshot()");
* NCCL buffers (multi-device runs), per communicator the process creates: `NCCL_COMMUNICATOR_BYTES`
  = `NCCL_BUFFSIZE` (4 MiB, NCCL's default: "the size of the buffer used by NCCL when communicating data
  between pairs of GPUs", docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-buffsize) per
  protocol (`NCCL_PROTOCOLS`: LL, LL128, Simple; NCCL sizes LL's and LL128's buffers near the same figure)
  for each of a channel's two ring connections (send and receive: S. Jeaugey, NVIDIA/nccl #864 and #986)
  over `NCCL_CHANNELS` = 8 channels, an estimate: the channel count is NCCL's topology search's
  (NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS; many more on NVSwitch boards, fewer over PCIe or Ethernet),
  so 192 MiB a communicator is a middle figure, not a bound (measured 544-688 MB for one process group on
  4x A100 with NVLink, NVIDIA/nccl#964). A process creates one communicator per process group it joins.
  Pipeline transfers go through `batch_isend_irecv` on the world group, which NCCL runs on the world's
  communicator (batched point-to-point ops use the group's communicator, single ones a 2-rank one per
  pair: pytorch/pytorch#160342), but NCCL still connects each point-to-point peer with buffers of its own
  (lazily, on first use), so each peer is counted as one more buffer set of the same size;
  lowering.communicator_sets counts them for a plan as the runtime makes them: the world, the
  tensor-parallel and data-parallel groups, the pipeline neighbours. Not measured on a GPU yet.
The caching allocator's fragmentation is not modelled separately: `memory_reserve` (default 10%) is the
margin for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..catalog import CATALOG
from ..errors import PlanError
from ..ir.graph import TrainingGraph
from .conv_workspace import CPU_KIND

# bytes one ZeRO / gradient-sync collective packs into a flat buffer at a time (runtime/zero.py's buckets):
# the transient on top of the training state while gradients are reduced and updated values broadcast
SYNC_BUCKET_BYTES = 64 << 20

OPTIMIZER_STATE_BYTES = {"sgd": 0, "sgd_momentum": 4, "momentum": 4, "adam": 8, "adamw": 8, "adagrad": 4,
                         "rmsprop": 4}
# fp32 buffers of one parameter's size that torch's single-tensor optimizer step holds at once, for the
# parameter it updates: the path torch takes for CPU tensors (`torch.optim.optimizer._default_to_fused_or_foreach`
# picks foreach / fused kernels for CUDA-like devices only), so the step of an offloaded optimizer, which runs
# over host copies (runtime/zero.py). Adam/AdamW: `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`
# (the root and the quotient; the moments update in place); Adagrad `state_sum.sqrt().add_(eps)` and RMSprop
# `square_avg.sqrt()` one; SGD (no weight decay, no Nesterov) updates in place (torch 2.x, default arguments)
OPTIMIZER_STEP_BUFFERS = {"sgd": 0, "sgd_momentum": 0, "momentum": 0, "adam": 2, "adamw": 2, "adagrad": 1,
                          "rmsprop": 1}
# fp32 buffers of *every* parameter it updates that torch's foreach optimizer step (its default on CUDA)
# holds at once, one list op over the whole group: Adam/AdamW `exp_avg_sq_sqrt = torch._foreach_sqrt(...)`
# (then divided and added to in place), Adagrad `std = torch._foreach_sqrt(state_sums)`, RMSprop
# `avg = torch._foreach_sqrt(square_avgs)`; SGD's momentum buffers update in place (torch 2.x
# `_multi_tensor_*`, default arguments; read from the code, not measured: no GPU here)
FOREACH_STEP_BUFFERS = {"sgd": 0, "sgd_momentum": 0, "momentum": 0, "adam": 1, "adamw": 1, "adagrad": 1,
                        "rmsprop": 1}


def optimizer_step_bytes(optimizer: str, kind: str, owned: float, largest: float) -> float:
    """Bytes the optimizer step allocates on top of the state while it updates `owned` parameter elements
    on a device of `kind` (the largest tensor `largest` elements): one tensor at a time on the CPU (torch's
    single-tensor path there), every tensor at once elsewhere (foreach)."""
    if kind == CPU_KIND:
        return OPTIMIZER_STEP_BUFFERS.get(optimizer, 0) * 4.0 * min(largest, owned)
    return FOREACH_STEP_BUFFERS.get(optimizer, 0) * 4.0 * owned


# what a CUDA training process holds on its GPU besides tensors (module docstring, sources there)
CUDA_CONTEXT_BYTES = 400 << 20
CUBLAS_WORKSPACE_BYTES = 8_519_680
NCCL_BUFFSIZE = 4 << 20
NCCL_PROTOCOLS = 3
NCCL_CHANNELS = 8
NCCL_COMMUNICATOR_BYTES = NCCL_BUFFSIZE * NCCL_PROTOCOLS * 2 * NCCL_CHANNELS  # 2: a channel's send + receive
RUNTIME_RESERVE_KINDS = ("gpu",)

# aten ops torch.autocast runs in float32 on CUDA whose saved tensors are large enough to matter (PyTorch AMP
# docs, "CUDA Ops that can autocast to float32"): their own saved outputs and internals stay 4-byte
AUTOCAST_FP32_OPS = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "cross_entropy_loss",
                               "nll_loss", "nll_loss_nd", "nll_loss2d"})
FP32_BYTES = 4
# aten ops torch.autocast runs in the lower precision (PyTorch AMP docs, "CUDA Ops that can autocast to
# float16"; the CPU bf16 list has the same matmul and convolution ops): the only ones that make the 2-byte copy
# of a weight they read (`cast_copy`). An embedding lookup is on neither list: its table stays fp32 and is
# never copied (checked with torch.autocast("cpu", torch.bfloat16): the output is float32 and no 2-byte copy
# of the table is saved), nor are a norm's weights (fp32 list) or weights other ops read.
AUTOCAST_LOWP_OPS = frozenset({
    "linear", "matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "addr", "mv", "chain_matmul",
    "multi_dot", "einsum", "prelu", "conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "cudnn_convolution", "_scaled_mm",
})


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each kind of training state."""

    weights: int
    grads: int
    optimizer: int  # optimizer moments (the fp32 weights are the master weights in mixed precision)
    cast_copy: int = 0  # autocast's low-precision weight copy, per parameter and micro-batch in flight

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


def optimizer_name(optimizer: object) -> str:
    """Normalize an optimizer given as a name, a torch.optim class/instance, or a factory lambda."""
    if isinstance(optimizer, str):
        name = optimizer.lower()
    else:
        name = getattr(optimizer, "__name__", type(optimizer).__name__).lower()
        if name == "<lambda>" or callable(optimizer) and name in ("function", "partial"):
            return "adamw"  # a factory we cannot inspect without parameters: price the common case
    if name not in OPTIMIZER_STATE_BYTES:
        raise PlanError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_STATE_BYTES)}.")
    return name


def state_bytes_per_param(optimizer: object = "adamw", precision: str = "fp32") -> StateBytes:
    """Bytes per parameter the runtime keeps for `optimizer` in `precision` (module docstring)."""
    opt = OPTIMIZER_STATE_BYTES[optimizer_name(optimizer)]
    return StateBytes(weights=4, grads=4, optimizer=opt, cast_copy=2 if precision in ("bf16", "fp16") else 0)


def training_state_bytes(graph: TrainingGraph, optimizer: object = "adamw", precision: str = "fp32") -> dict:
    """Bytes of weights, gradients and optimizer state for the whole model on one device, unsharded.

    Matches torch.optim exactly in fp32: Adam/AdamW also keep a 4-byte `step` tensor per parameter tensor.
    """
    per = state_bytes_per_param(optimizer, precision)
    counted = [p for p in graph.params.values() if p.counts]
    numel = sum(p.meta.numel for p in counted)
    step_bytes = 4 * len(counted) if optimizer_name(optimizer) in ("adam", "adamw") else 0
    return {"weights": per.weights * numel, "grads": per.grads * numel,
            "optimizer": per.optimizer * numel + step_bytes}


def runtime_reserve_bytes(kind: str, communicators: int, name: str | None = None) -> int:
    """Device bytes a training process holds outside its tensors on a device of `kind` (module docstring):
    CUDA context + cuBLAS workspace + the buffers of its `communicators` NCCL communicators; 0 on CPU and
    edge devices, and on a custom device (`name` given and not in the catalog)."""
    if kind not in RUNTIME_RESERVE_KINDS or (name is not None and name not in CATALOG):
        return 0
    return CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + communicators * NCCL_COMMUNICATOR_BYTES


def _op(target: str) -> str:
    parts = target.split(".")
    return parts[1] if len(parts) > 2 else parts[-1]


def autocast_cast_params(graph: TrainingGraph) -> dict[str, tuple[int, frozenset[int]]]:
    """Parameters autocast makes a low-precision copy of: placeholder (tied duplicates resolved to the
    parameter they share) -> (elements, the layers whose ops on `AUTOCAST_LOWP_OPS` read it, directly or
    through views, e.g. a transpose). A stage copies each such weight once per forward, whichever of its
    layers read it; embedding tables (read by `embedding` only) and norm weights are absent."""
    out: dict[str, tuple[int, set[int]]] = {}

    def root(name: str) -> str:
        seen = 0
        while name in graph.nodes and graph.nodes[name].is_view and graph.nodes[name].args and seen < 64:
            name, seen = graph.nodes[name].args[0], seen + 1
        return name

    for node in graph.nodes.values():
        if node.layer < 0 or _op(node.target) not in AUTOCAST_LOWP_OPS:
            continue
        for a in node.args:
            info = graph.params.get(root(a)) if isinstance(a, str) else None
            if info is None or info.is_buffer:
                continue
            key = info.tied_to or info.node
            base = graph.params.get(key, info)
            if base.is_buffer:
                continue
            out.setdefault(key, (base.meta.numel, set()))[1].add(node.layer)
    return {k: (n, frozenset(us)) for k, (n, us) in out.items()}


def activation_corrections(graph: TrainingGraph, precision: str
                           ) -> tuple[list[float], list[float], list[float]]:
    """Per layer of an annotated graph, per global batch (module docstring): bytes to add to
    `Layer.saved_bytes` because ops autocast runs in fp32 keep their saved tensors in 4 bytes (0 outside
    bf16/fp16), the backward transient: the larger of those ops' (two fp32 buffers of their input's
    size) and any op's output gradient, the largest one in the layer, and that largest output gradient
    alone (what a parameter's new gradient, accumulated into its `.grad`, is computed beside)."""
    extra, transient = [0.0] * len(graph.layers), [0.0] * len(graph.layers)
    out_grad = [0.0] * len(graph.layers)
    scale = 0.5 if precision in ("bf16", "fp16") else 1.0  # annotate's bytes per element / 4
    for node in graph.nodes.values():
        if node.layer < 0 or _op(node.target) not in AUTOCAST_FP32_OPS:
            continue
        floats = [t for t in node.outputs if t.dtype.startswith("float")]
        own = sum(t.nbytes for t in floats) if node.name in node.saved else 0
        # captured in fp32 (TensorMeta bytes); annotate halved what the node saves in mixed precision
        extra[node.layer] += (own + node.saved_internal_bytes / scale) * (1 - scale)
        inp = graph.nodes.get(node.args[0]) if node.args else None
        numel = max([t.numel for t in floats] + ([t.numel for t in inp.outputs[:1]] if inp else []))
        buffers = 2 if own or node.saved_internal_bytes else 1  # fused: it keeps its input and recomputes
        transient[node.layer] = max(transient[node.layer], buffers * FP32_BYTES * numel)
    for node in graph.nodes.values():
        # any op's backward: the gradient of its output, in its precision, beside the saved tensors (a GPT
        # block's MLP: the b x s x 4h gradient at the activation), the largest one in the layer
        if node.layer >= 0 and node.requires_grad:
            grad = sum(t.nbytes for t in node.outputs if t.dtype.startswith("float")) * scale
            transient[node.layer] = max(transient[node.layer], grad)
            out_grad[node.layer] = max(out_grad[node.layer], grad)
    return extra, transient, out_grad


def backward_workspace(graph: TrainingGraph, precision: str, kind: str) -> list[float]:
    """Per layer of an annotated graph: the largest `OpNode.bwd_workspace` of its nodes on a device of `kind`,
    bytes per device whatever the batch (module docstring); the ops' backwards run one at a time. fp32/tf32
    only: the buffers priced are those of the fp32 kernels (cost_models/conv_workspace.py)."""
    out = [0.0] * len(graph.layers)
    if precision not in ("fp32", "tf32"):
        return out
    for node in graph.nodes.values():
        if node.layer >= 0 and node.bwd_workspace.get(kind):
            out[node.layer] = max(out[node.layer], float(node.bwd_workspace[kind]))
    return out
