"""Host and framework overhead: what the Python/C++ host spends per kernel, module call, autograd node,
micro-batch and optimizer step, priced apart from the kernels' device time.

Terms (seconds; one `HostOverhead` per device kind and software stack, kept in a profile's
`meta["framework"]` with the source of every figure):

    kernel_s         per kernel launch, forward or backward: Python/C++ dispatch plus the launch
                     (`Profile.overhead_s`, charged by `ComputeModel.op_time` with each kernel)
    view_s           per captured op that launches no kernel (views: view, permute, transpose, ...):
                     argument parsing, dispatcher, a new TensorImpl and autograd view metadata
    module_s         per nn.Module call (forward; again when a block is recomputed)
    autograd_node_s  per autograd node the backward pass runs (one per captured op that requires grad,
                     plus one AccumulateGrad per trainable parameter tensor), beyond its kernels
    microbatch_s     per micro-batch per stage, forward and again backward: the schedule's Python
                     step, the batch split, p2p send/recv setup, one backward() call (its GraphTask and
                     engine-thread hand-off)
    step_s           per optimizer step: zero_grad, the loss-scale / grad-norm checks and their
                     host syncs, the fused (foreach) AdamW launches
    step_tensor_s    per parameter tensor per optimizer step (per-tensor Python work: state lookup,
                     grouping lists for the foreach kernels)

Pricing (solver/pricing/model.py, `floored`): a stage's host time per micro-batch forward = kernel_s per
kernel it launches + sum over its layers of view_s * views + module_s * module calls + microbatch_s; backward
= kernel_s per kernel + autograd_node_s * autograd nodes + microbatch_s; a recomputed forward pays its host
time again. Its device time is its kernels' (op_time less the per-kernel overhead op_time charges).
On a device that runs asynchronously to its host (kinds in HOST_BOUND_KINDS: a GPU, an edge board's GPU) the
host issues kernels ahead of the device, so a stage's time is the larger of the two: the device never runs
faster than the host can issue (the host-bound floor of small kernels and small micro-batches), and host
time hides behind long kernels. On a CPU the same thread issues and computes: the two add. The sync adds
step_s + step_tensor_s * tensors (the optimizer step's host work, synchronous with it).

Counting (from the captured graph, `layer_counts`): module calls are the entries into a module path in
the op order (a module called twice counts twice), skipping indexed containers (`blocks` of
`blocks.0`: a ModuleList is not called) and counting the root model once; getitem nodes (tuple
indexing) cost nothing. Autograd nodes: one per captured op that requires grad (two for aten.linear,
whose t and addmm autograd records apart) and one AccumulateGrad per trainable parameter tensor.

Defaults: eager PyTorch on CUDA (a server CPU core issuing), CPU (uncalibrated), and edge boards (ARM
cores: 2.5x the CUDA figures, the ratio of their per-kernel overheads, 15 us vs 6 us). `autopar
calibrate` measures the host figures on the device at hand (calibrate.py, `measure_framework`).
`autopar calibrate --host` measures the host path of eager PyTorch on this host's CPU (tiny tensors, so
every figure is Python, dispatcher, autograd and allocator time: the path a GPU eager run takes) and saves
it as `host-path.json` beside the profiles; GPUs without figures measured on themselves then price their
host from it, each kernel adding the CUDA launch (LAUNCH_S, cited). Edge boards keep their defaults: their
host is the board's ARM cores, not this one.

Validation target, not a fitted constant: on a single 8-GPU A100 node Megatron-LM runs (hidden
1024-2048, micro-batch 1-8) show ~1.8 ms per layer per micro-batch of host time beyond 6 us per kernel
(issue 12). `layer_host_seconds` of a GPT block at these defaults is far below that
(tests/test_overhead.py prints it): Megatron's layers add Python autograd Functions, fused-kernel
wrappers and NCCL launches this graph does not have, so the figure is reported, not matched.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from .op_names import base_name

if TYPE_CHECKING:
    from ..ir.graph import TrainingGraph
    from .compute import ComputeModel

_CUDA_SOURCES = {
    "kernel_s": "eager PyTorch per-op launch + dispatch 5-10 us (CUDA launch alone a few us: NVIDIA "
                "'Getting Started with CUDA Graphs', 2019); 6 us",
    "view_s": "estimate: a Python-level view op (no kernel) costs ~1/3 of a launching op's host time",
    "module_s": "estimate: nn.Module.__call__ (hook checks, Python frames) ~3-5 us on a server core",
    "autograd_node_s": "estimate: autograd engine bookkeeping per node (ready queue, input buffers, "
                       "grad accumulation) ~2-4 us beyond the node's kernel launches",
    "microbatch_s": "estimate: schedule step + p2p isend/irecv setup (NCCL via torch.distributed, tens of "
                    "us each) + one backward() call's setup: ~100 us per direction",
    "step_s": "estimate: zero_grad, grad-norm/inf checks with their host syncs, ~10 foreach AdamW "
              "launches: ~300 us",
    "step_tensor_s": "estimate: per-tensor Python work of torch.optim (state dict lookup, foreach "
                     "grouping): ~2 us",
}


@dataclass(frozen=True)
class HostOverhead:
    """Host seconds per framework event of one device kind and software stack (module docstring)."""

    stack: str
    kernel_s: float
    view_s: float
    module_s: float
    autograd_node_s: float
    microbatch_s: float
    step_s: float
    step_tensor_s: float
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def to_meta(self) -> dict:
        """JSON form kept in a profile's meta["framework"]: every figure with its source."""
        out: dict[str, Any] = {"stack": self.stack}
        for f in fields(self):
            if f.name not in ("stack", "sources"):
                out[f.name] = {"value": getattr(self, f.name), "source": self.sources.get(f.name, "")}
        return out

    @staticmethod
    def from_meta(d: dict, fallback: HostOverhead) -> HostOverhead:
        """Read meta["framework"]; figures it lacks come from `fallback` (with its sources)."""
        vals: dict[str, Any] = {"stack": str(d.get("stack", fallback.stack))}
        sources = dict(fallback.sources)
        for f in fields(HostOverhead):
            if f.name in ("stack", "sources"):
                continue
            item = d.get(f.name)
            if isinstance(item, dict) and "value" in item:
                vals[f.name] = float(item["value"])
                sources[f.name] = str(item.get("source", ""))
            elif isinstance(item, (int, float)):
                vals[f.name] = float(item)
            else:
                vals[f.name] = getattr(fallback, f.name)
        return HostOverhead(**vals, sources=sources)

    def scaled(self, factor: float, stack: str, why: str) -> HostOverhead:
        vals = {f.name: getattr(self, f.name) * factor for f in fields(self) if f.name not in ("stack", "sources")}
        return HostOverhead(stack=stack, **vals, sources={k: f"{v}; x{factor:g} ({why})"
                                                          for k, v in self.sources.items()})


LAUNCH_S = 3e-6
LAUNCH_SOURCE = ("cudaLaunchKernel's host side, 3 us: back-to-back launches of a 2.9 us kernel take 3.8 us "
                 "each, and 3.4 us under a CUDA graph (NVIDIA, 'Getting Started with CUDA Graphs', 2019), so "
                 "the launch path is below ~4 us")
HOST_BOUND_KINDS = ("gpu", "edge")  # devices whose kernels run asynchronously to the host that issues them
HOST_PATH_FILE = "host-path.json"


def host_bound(kind: str) -> bool:
    """Whether a device kind runs its kernels asynchronously to its host (its stage time is the larger of
    device and host time) rather than on the host's own thread (the two add)."""
    return kind in HOST_BOUND_KINDS


CUDA_EAGER = HostOverhead("cuda-eager", kernel_s=6e-6, view_s=2e-6, module_s=4e-6, autograd_node_s=3e-6,
                          microbatch_s=100e-6, step_s=300e-6, step_tensor_s=2e-6, sources=_CUDA_SOURCES)
CPU_EAGER = HostOverhead("cpu-eager", kernel_s=3e-6, view_s=1.5e-6, module_s=3e-6, autograd_node_s=2e-6,
                         microbatch_s=30e-6, step_s=50e-6, step_tensor_s=20e-6, sources={
                             k: "estimate for an uncalibrated CPU (run `autopar calibrate`); "
                                + ("for-loop AdamW on CPU: ~5 ops per tensor" if k == "step_tensor_s" else
                                   "no launch, no device sync")
                             for k in _CUDA_SOURCES})


def default_host(kind: str) -> HostOverhead:
    """Default figures for a device kind ('gpu', 'edge', 'cpu')."""
    if kind == "cpu":
        return CPU_EAGER
    if kind == "edge":
        return CUDA_EAGER.scaled(2.5, "cuda-eager-arm", "ARM host cores; 15 us vs 6 us per kernel")
    return CUDA_EAGER


def gpu_host_from_path(framework: dict) -> HostOverhead:
    """The host figures of eager PyTorch on CUDA from this host's measured host path (`framework`, the
    meta["framework"] form): views, module calls and autograd nodes as measured; each kernel the measured
    per-kernel cost plus the CUDA launch (LAUNCH_S); the micro-batch setup and the optimizer step keep the
    CUDA defaults (their host work is CUDA's: NCCL p2p setup, foreach kernels, not the CPU's)."""
    measured = HostOverhead.from_meta(framework, CUDA_EAGER)
    vals = {f.name: getattr(measured, f.name) for f in fields(HostOverhead) if f.name not in ("stack", "sources")}
    sources = dict(measured.sources)
    vals["kernel_s"] = measured.kernel_s + LAUNCH_S
    sources["kernel_s"] = f"{measured.sources.get('kernel_s', '')}; plus the launch: {LAUNCH_SOURCE}"
    for name in ("microbatch_s", "step_s", "step_tensor_s"):
        vals[name] = getattr(CUDA_EAGER, name)
        sources[name] = CUDA_EAGER.sources[name]
    return HostOverhead(stack="cuda-eager (this host's measured host path)", **vals, sources=sources)


def host_overhead(model: ComputeModel) -> HostOverhead:
    """A compute model's host figures: its profile's meta["framework"] over the kind's defaults, with the
    per-kernel figure the model charges (`ComputeModel.overhead`). A GPU whose profile has no figures
    measured on it takes them from this host's measured host path when there is one (`gpu_host_from_path`,
    its own per-kernel figure)."""
    base = default_host(model.spec.kind)
    meta = model.profile.meta.get("framework")
    if model.spec.kind == "gpu" and model.host_path is not None and not (model.calibrated and isinstance(meta, dict)):
        return gpu_host_from_path(model.host_path["framework"])
    host = HostOverhead.from_meta(meta, base) if isinstance(meta, dict) else base
    if host.kernel_s != model.overhead:
        vals = {f.name: getattr(host, f.name) for f in fields(host) if f.name != "sources"}
        vals["kernel_s"] = model.overhead
        host = HostOverhead(**vals, sources={**host.sources, "kernel_s": "the profile's overhead_s"})
    return host


# ---- counting -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostCounts:
    """Host events of one layer per micro-batch (per optimizer step for `param_tensors`)."""

    views: int = 0
    modules: int = 0
    autograd_nodes: int = 0
    param_tensors: int = 0
    kernels_fwd: int = 0  # kernels the layer's forward launches (annotate's; views launch none)
    kernels_bwd: int = 0


def _is_getitem(target: str) -> bool:
    return "getitem" in str(target)


def _call_prefixes(path: str) -> list[str]:
    """The module paths whose call a node inside `path` is part of (indexed containers skipped)."""
    if not path:
        return []
    parts = path.split(".")
    out = []
    for i in range(1, len(parts) + 1):
        if i < len(parts) and parts[i].isdigit():
            continue  # `blocks` of `blocks.0`: a ModuleList/indexed container, not called itself
        out.append(".".join(parts[:i]))
    return out


def layer_counts(graph: TrainingGraph) -> list[HostCounts]:
    """Per layer of `graph`: its Python-level views, module calls, autograd nodes and parameter tensors."""
    views = [0] * len(graph.layers)
    modules = [0] * len(graph.layers)
    nodes = [0] * len(graph.layers)
    tensors = [0] * len(graph.layers)
    kf = [0] * len(graph.layers)
    kb = [0] * len(graph.layers)
    active: set[str] = set()
    first = True
    for layer in graph.layers:
        for name in layer.nodes:
            node = graph.nodes[name]
            i = layer.index
            if _is_getitem(node.target):
                continue
            if first:  # the root model's own call
                modules[i] += 1
                first = False
            now = set(_call_prefixes(node.module))
            modules[i] += len(now - active)
            active = now
            views[i] += int(node.is_view)
            kf[i] += sum(k.kind != "view" for k in node.kernels_fwd)
            kb[i] += sum(k.kind != "view" for k in node.kernels_bwd)
            # aten.linear is CompositeImplicitAutograd: autograd records its t and addmm, two nodes
            nodes[i] += (2 if base_name(node.target) == "linear" else 1) if node.requires_grad else 0
    for info in graph.params.values():
        if info.counts and 0 <= info.layer < len(graph.layers):
            tensors[info.layer] += 1
            nodes[info.layer] += 1  # its AccumulateGrad node
    return [HostCounts(*c) for c in zip(views, modules, nodes, tensors, kf, kb, strict=True)]


def layer_host_seconds(counts: HostCounts, host: HostOverhead) -> tuple[float, float]:
    """(forward, backward) host seconds of one layer per micro-batch, kernels' launches excluded."""
    return (counts.views * host.view_s + counts.modules * host.module_s,
            counts.autograd_nodes * host.autograd_node_s)


def step_host_seconds(param_tensors: int, host: HostOverhead) -> float:
    """Host seconds of one optimizer step over `param_tensors` parameter tensors."""
    return host.step_s + param_tensors * host.step_tensor_s


def graph_host_seconds(graph: TrainingGraph, model: ComputeModel, microbatches: int = 1,
                       optimizer_step: bool = False) -> float:
    """Host seconds of one whole-graph training step on one device (`microbatches` forward+backward
    passes, kernels' launches excluded: those are in the kernels' times), plus the optimizer step."""
    host = host_overhead(model)
    counts = layer_counts(graph)
    per_mb = sum(sum(layer_host_seconds(c, host)) for c in counts) + 2 * host.microbatch_s
    step = step_host_seconds(sum(c.param_tensors for c in counts), host) if optimizer_step else 0.0
    return microbatches * per_mb + step



@dataclass(frozen=True)
class StageHost:
    """Host seconds of a pipeline stage: per micro-batch forward / backward, the forward of its blocks
    paid again under recompute, and per optimizer step; kernels' launches apart: `launch_*` at the host's
    per-kernel figure, `charged_*` at the figure op_time already put in the kernels' times."""

    fwd: float
    bwd: float
    recompute: float
    step: float
    launch_fwd: float = 0.0
    launch_bwd: float = 0.0
    launch_recompute: float = 0.0
    charged_fwd: float = 0.0
    charged_bwd: float = 0.0
    charged_recompute: float = 0.0
    bound: bool = False  # the device runs asynchronously to its host (`host_bound`)


def floored(kernels_s: float, host_s: float, launch_s: float, charged_s: float, bound: bool) -> float:
    """Seconds of one pass whose kernels take `kernels_s` (with `charged_s` of per-kernel overhead in it) and
    whose host work is `host_s` plus `launch_s` of launches: the larger of device and host time on a device
    that runs asynchronously to its host, their sum on one whose host thread computes (module docstring)."""
    if not bound:
        return kernels_s + host_s
    return max(kernels_s - charged_s, host_s + launch_s)


def stage_host_seconds(cm: Any, a: int, e: int, dtype: str, measured: tuple[int, ...] = (),
                       stepped: tuple[int, ...] = ()) -> StageHost:
    """`StageHost` of layers [a, e) on device type `dtype` of a `solver.pricing.CostModel` (memoised in it),
    without the layers in `measured` (a block profile's times include their host time) and the parameter tensors
    of those in `stepped` (their measured optimizer step includes its per-tensor work); the micro-batch's setup
    and the step's fixed host work stay (no layer's measurement holds them)."""

    def seconds() -> StageHost:
        counts = cm.memoised(("host_counts",), lambda: layer_counts(cm.graph))
        model = cm.models[dtype]
        host = model.host
        f = b = rc = 0.0
        kf = kb = krc = 0
        for i in range(a, e):
            if i in measured:
                continue
            lf, lb = layer_host_seconds(counts[i], host)
            f, b = f + lf, b + lb
            kf, kb = kf + counts[i].kernels_fwd, kb + counts[i].kernels_bwd
            if cm.is_block[i]:
                rc, krc = rc + lf, krc + counts[i].kernels_fwd
        tensors = sum(counts[i].param_tensors for i in range(a, e) if i not in stepped)
        k, o = host.kernel_s, model.overhead
        return StageHost(f + host.microbatch_s, b + host.microbatch_s, rc, step_host_seconds(tensors, host),
                         kf * k, kb * k, krc * k, kf * o, kb * o, krc * o, host_bound(model.spec.kind))

    return cm.memoised(("host", cm.range_key(a, e), dtype) if not measured else
                       ("host", a, e, dtype, measured, stepped), seconds)


__all__ = ["CPU_EAGER", "CUDA_EAGER", "HOST_BOUND_KINDS", "LAUNCH_S", "HostCounts", "HostOverhead", "StageHost",
           "default_host", "floored", "gpu_host_from_path", "graph_host_seconds", "host_bound", "host_overhead",
           "layer_counts", "layer_host_seconds", "stage_host_seconds",
           "step_host_seconds"]
