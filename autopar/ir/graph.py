"""The training graph every pass reads and returns.

`TrainingGraph` holds the fine op graph (one `OpNode` per aten op of the forward + loss, captured by
torch.export) and the coarse chain of `Layer`s (embedding/prologue, each repeated block, head/epilogue)
that pipeline partitioning works on. Annotation passes fill the per-node costs; the graph stays plain
data apart from the fx GraphModule it was captured from.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1, "complex64": 8}


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the 'torch.' prefix

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 4)


@dataclass(frozen=True)
class Kernel:
    """One dispatched aten op that a node runs in forward or backward (what eager PyTorch launches)."""

    op: str
    kind: str
    flops: float  # as torch.utils.flop_counter counts them (0 for elementwise ops)
    nbytes: float
    elems: int = 0  # output elements: elementwise/softmax ops are priced by their per-element work


@dataclass
class OpNode:
    name: str
    target: str  # e.g. "aten.linear.default"
    args: list[str]  # names of tensor-producing nodes it reads (params and inputs included)
    outputs: list[TensorMeta]
    module: str  # owning module path, e.g. "transformer.h.3.attn"
    layer: int = -1  # index into TrainingGraph.layers
    source: str = ""  # "file:line" of the user code that produced it
    requires_grad: bool = False
    is_view: bool = False
    # filled by passes.annotate
    flops_fwd: float = 0.0
    flops_bwd: float = 0.0
    bytes_fwd: float = 0.0
    bytes_bwd: float = 0.0
    saved: list[str] = field(default_factory=list)  # storage roots this node keeps alive for backward
    saved_internal_bytes: int = 0  # saved tensors that are neither inputs nor outputs (masks, stats)
    # device kind -> bytes its backward allocates besides autograd's tensors, once per call and independent of
    # the batch (a CPU convolution's weight gradient in oneDNN's layout: cost_models/conv_workspace.py)
    bwd_workspace: dict[str, int] = field(default_factory=dict)
    kernels_fwd: list[Kernel] = field(default_factory=list)
    kernels_bwd: list[Kernel] = field(default_factory=list)
    time_fwd: dict[str, float] = field(default_factory=dict)  # device type -> seconds
    time_bwd: dict[str, float] = field(default_factory=dict)

    @property
    def out_bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)


@dataclass
class ParamInfo:
    name: str  # fully qualified name in the user's model
    node: str  # placeholder name in the graph
    meta: TensorMeta
    layer: int = -1
    is_buffer: bool = False
    tied_to: str = ""  # placeholder of the parameter this one shares storage with (tied embeddings)

    @property
    def counts(self) -> bool:
        """Whether this is a distinct trainable parameter (not a buffer, not a tied duplicate)."""
        return not self.is_buffer and not self.tied_to


@dataclass
class Layer:
    """One element of the coarse chain: a repeated block, or the prologue/epilogue around them."""

    index: int
    name: str
    kind: str  # "pre" | "block" | "post"
    nodes: list[str]
    params: list[str]
    signature: str = ""  # equal for structurally identical blocks
    # filled by passes.annotate
    flops_fwd: float = 0.0
    flops_bwd: float = 0.0
    param_bytes: int = 0
    saved_bytes: int = 0  # activation bytes this layer keeps for backward, per global batch
    boundary_bytes: int = 0  # bytes of activations flowing out of this layer into later layers
    # of `saved_bytes`, the tensors only later layers save: (the first layer saving it, bytes) each. A pipeline
    # stage ending before that layer does not keep them; the next stage keeps its received copy
    saved_later: tuple[tuple[int, int], ...] = ()
    time_fwd: dict[str, float] = field(default_factory=dict)
    time_bwd: dict[str, float] = field(default_factory=dict)


@dataclass
class TrainingGraph:
    nodes: dict[str, OpNode]
    params: dict[str, ParamInfo]  # by placeholder node name
    inputs: list[str]  # user input placeholders, then the target if any
    layers: list[Layer]
    batch_size: int
    loss_node: str
    model_name: str = "model"
    device_types: list[str] = field(default_factory=list)
    dtype: str = "fp32"  # compute dtype the times were priced for
    kernels: str = "torch"  # kernels mode the times were priced for (passes/annotate.py)
    fused_types: list[str] = field(default_factory=list)  # device types priced with fused regions
    input_meta: dict[str, TensorMeta] = field(default_factory=dict)
    gm: Any = field(default=None, repr=False, compare=False)  # the fx GraphModule (not serialized)
    # SDPA node -> why its mask cannot run as is_causal (None: it can), computed once per capture
    # (passes/sequence_split.causal_mask_problem: the check computes the whole mask; not serialized)
    mask_checks: dict[str, str | None] = field(default_factory=dict, repr=False, compare=False)

    # ---- derived views ------------------------------------------------------------------------
    def repeated_groups(self) -> list[list[int]]:
        """Indices of structurally identical blocks, grouped (only groups of two or more)."""
        groups: dict[str, list[int]] = {}
        for layer in self.layers:
            if layer.kind == "block":
                groups.setdefault(layer.signature, []).append(layer.index)
        return [g for g in groups.values() if len(g) > 1]

    def canonical(self, placeholder: str) -> str:
        """The model's name of parameter placeholder `placeholder` (a tied parameter's original)."""
        info = self.params[placeholder]
        return self.params[info.tied_to].name if info.tied_to else info.name

    def param_bytes(self) -> int:
        return sum(p.meta.nbytes for p in self.params.values() if p.counts)

    def num_params(self) -> int:
        return sum(p.meta.numel for p in self.params.values() if p.counts)

    def total(self, attr: str) -> float:
        return sum(getattr(n, attr) for n in self.nodes.values())

    def saved_activation_bytes(self) -> int:
        """Bytes kept alive for backward over one global batch (unique storages, parameters excluded)."""
        return sum(layer.saved_bytes for layer in self.layers)

    def with_layers(self, layers: list[Layer]) -> TrainingGraph:
        return replace(self, layers=layers)

    # ---- output -------------------------------------------------------------------------------
    def table(self, max_rows: int | None = None) -> str:
        from ..report import graph_table

        return graph_table(self, max_rows=max_rows)

    def to_dict(self) -> dict:
        d = {
            "model_name": self.model_name, "batch_size": self.batch_size, "loss_node": self.loss_node,
            "device_types": self.device_types, "dtype": self.dtype, "inputs": self.inputs,
            "kernels": self.kernels, "fused_types": self.fused_types,
            "input_meta": {k: asdict(v) for k, v in self.input_meta.items()},
            "nodes": [asdict(n) for n in self.nodes.values()],
            "params": [asdict(p) for p in self.params.values()],
            "layers": [asdict(layer) for layer in self.layers],
            "totals": {"params": self.num_params(), "param_bytes": self.param_bytes(),
                       "flops_fwd": self.total("flops_fwd"), "flops_bwd": self.total("flops_bwd"),
                       "saved_activation_bytes": self.saved_activation_bytes()},
        }
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @staticmethod
    def from_dict(d: dict) -> TrainingGraph:
        def tm(x: dict) -> TensorMeta:
            return TensorMeta(tuple(x["shape"]), x["dtype"])

        nodes = {}
        for n in d["nodes"]:
            n = dict(n)
            n["outputs"] = [tm(t) for t in n["outputs"]]
            n["kernels_fwd"] = [Kernel(**k) for k in n["kernels_fwd"]]
            n["kernels_bwd"] = [Kernel(**k) for k in n["kernels_bwd"]]
            nodes[n["name"]] = OpNode(**n)
        params = {}
        for p in d["params"]:
            p = dict(p)
            p["meta"] = tm(p["meta"])
            params[p["node"]] = ParamInfo(**p)
        return TrainingGraph(nodes=nodes, params=params, inputs=list(d["inputs"]),
                             layers=[Layer(**{**x, "saved_later": tuple(map(tuple, x.get("saved_later", ())))})
                                     for x in d["layers"]], batch_size=d["batch_size"],
                             loss_node=d["loss_node"], model_name=d["model_name"],
                             device_types=list(d["device_types"]), dtype=d["dtype"],
                             kernels=d.get("kernels", "torch"), fused_types=list(d.get("fused_types", [])),
                             input_meta={k: tm(v) for k, v in d["input_meta"].items()})
