"""Tensor parallelism inside a stage, lowered onto DTensor.

A stage program is the captured aten graph with its global shapes. Running it with parameters that are
DTensors keeps those global semantics while each rank holds and computes only its shard: DTensor's
sharding propagation inserts the collectives (the all-reduce after a row-parallel linear, the slice
before a head-parallel attention). The plan decides placements: which weights are sharded on which
dimension (column- or row-parallel) and which activations to re-layout (attention heads). An op that
DTensor has no sharding rule for runs replicated on every rank of the group, and the dump says so.
"""

from __future__ import annotations

import contextlib
import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication

from ..errors import PlanError
from ..ir.graph import TrainingGraph
from ..passes.randomness import block_of, keyed_attention
from ..passes.tp_patterns import (
    LINEAR_ARGS,
    attention_cores,
    attention_projection,
    megatron_placements,
    users,
    weight_of,
)
from .vocab_parallel import vocab_parallel_embedding, vocab_parallel_loss

aten = torch.ops.aten


@dataclass
class TPSpec:
    """Placements for one stage: parameter name -> placement, node name -> re-layout of its output."""

    params: dict[str, Placement] = field(default_factory=dict)
    relayout: dict[str, Placement] = field(default_factory=dict)

    def describe(self) -> list[str]:
        lines = [
            f"#   param {k}: {v}" for k, v in sorted(self.params.items()) if not isinstance(v, Replicate)
        ]
        lines += [f"#   relayout {k} -> {v}" for k, v in sorted(self.relayout.items())]
        return lines


def megatron_spec(graph: TrainingGraph, layers: tuple[int, int]) -> TPSpec:
    """Megatron-style placements derived from the graph (`tp_patterns.megatron_placements`): an MLP's first
    linear column-parallel and its second row-parallel; attention head-parallel with its output projection
    row-parallel; the LM head and vocabulary-sized embeddings vocab-parallel."""
    found = megatron_placements(graph, layers)
    return TPSpec({k: Shard(d) for k, d in found.params.items()}, {k: Shard(d) for k, d in found.relayout.items()})


def parse_placement(text: str) -> Placement:
    """A `Stage.sharding` value ("replicate" or "shard(d)") as a DTensor placement."""
    m = re.fullmatch(r"shard\((\d+)\)", text)
    if text != "replicate" and m is None:
        raise PlanError(f"sharding placement {text!r} is not one of 'replicate', 'shard(d)' (d a dim index).")
    return Replicate() if m is None else Shard(int(m.group(1)))


def sharding_spec(graph: TrainingGraph, layers: tuple[int, int], sharding: Mapping[str, str]) -> TPSpec:
    """Placements of a plan's `Stage.sharding` (the intra-op ILP's choice, solver/intra_op/pricing.py).

    Every layer holding a parameter named there runs as the ILP priced it: parameters take the given
    placements, DTensor propagates them; attention is head-parallel exactly when the linear projecting its
    output is row-parallel, a row-parallel linear's partial sums are all-reduced right away, and values
    read outside the layer leave it replicated. Other layers (the ones around the blocks) keep
    `megatron_spec`'s placements.
    """
    spec = megatron_spec(graph, layers)
    chosen = {k: parse_placement(v) for k, v in sharding.items()}
    params = {graph.canonical(p): p for p in graph.params}
    for name, placement in chosen.items():
        if name not in params:
            raise PlanError(f"the plan's sharding names parameter {name!r}, which the model does not have; "
                            f"plan again for this model.")
        rank = len(graph.params[params[name]].meta.shape)
        if isinstance(placement, Shard) and placement.dim >= rank:
            raise PlanError(f"sharding {sharding[name]!r} of parameter {name!r} needs a dim < {rank}.")
    covered = [layer for layer in graph.layers[layers[0] : layers[1]]
               if any(graph.canonical(p) in chosen for p in layer.params)]
    readers = users(graph, list(graph.nodes))
    for layer in covered:
        for p in layer.params:
            spec.params.pop(graph.canonical(p), None)
        for n in layer.nodes:
            spec.relayout.pop(n, None)
    spec.params.update(chosen)
    for layer in covered:
        inside = set(layer.nodes)
        for n in layer.nodes:
            node = graph.nodes[n]
            weight = weight_of(graph, n)
            if weight and spec.params.get(graph.canonical(weight[0])) == Shard(1 - weight[1]):
                spec.relayout[n] = Replicate()
            if node.outputs and any(u not in inside for u in readers.get(n, [])):
                spec.relayout[n] = Replicate()
        for core in attention_cores(graph, layer.nodes):  # (re-laying out its inputs wins over the above)
            proj = attention_projection(graph, core.output, layer.nodes)
            if proj and spec.params.get(graph.canonical(proj[0])) == Shard(proj[1]):
                spec.relayout.update((a, Shard(d)) for a, d in core.inputs)
    return spec


def _sdpa_math(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    # The math formulation decomposes into ops DTensor can shard whatever the layouts; it holds the seq x seq
    # scores per head, so it is only the fallback where the fused kernel cannot run shard by shard.
    # Like the public op, turn a boolean mask (True = attend) into an additive one first.
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            attn_mask.logical_not(), float("-inf")
        )
    return aten._scaled_dot_product_attention_math.default(
        q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )[0]


def shard_local_layout(q: Any, k: Any, v: Any, attn_mask: Any) -> Placement | None:
    """The one placement q, k and v share when attention can run on each rank's local shards alone:
    replicated, or sharded evenly over the batch (dim 0) or the heads (dim 1) with a mask that broadcasts
    over that dim; None otherwise."""
    if not all(isinstance(t, DTensor) and t.ndim == 4 for t in (q, k, v)):
        return None
    placements = {t.placements for t in (q, k, v)}
    if len(placements) != 1 or q.device_mesh.ndim != 1:
        return None
    (p,) = placements.pop()
    if isinstance(p, Replicate):
        return p
    if not isinstance(p, Shard) or p.dim not in (0, 1) or any(t.shape[p.dim] % q.device_mesh.size() for t in (q, k, v)):
        return None  # (grouped-query k and v: each rank's query heads read its own k/v heads when both divide)
    if attn_mask is not None:
        if isinstance(attn_mask, DTensor) and not all(isinstance(m, Replicate) for m in attn_mask.placements):
            return None
        at = p.dim - (4 - attn_mask.ndim)  # masks broadcast from the right
        if at >= 0 and attn_mask.shape[at] != 1:
            return None
    return p


def _sdpa_per_shard(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    # Heads (and batch rows) of attention are independent: where q, k and v share a head, batch or replicated
    # layout, each rank runs the fused kernel (the one the planner prices) on its local shards.
    p = shard_local_layout(q, k, v, attn_mask)
    if p is None:
        return _sdpa_math(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    mask = attn_mask.to_local() if isinstance(attn_mask, DTensor) else attn_mask
    out = torch.nn.functional.scaled_dot_product_attention(
        q.to_local(), k.to_local(), v.to_local(), attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
        scale=scale, enable_gqa=enable_gqa,
    )
    return DTensor.from_local(out, q.device_mesh, [p], run_check=False)


def _keyed_attention_per_shard(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                               enable_gqa=False, *, key=0):
    # Attention with dropout (passes/randomness.py) shard by shard, as fused attention above: on DTensors its
    # math formulation fails where it masks (a causal mask is a plain tensor beside DTensor scores: "got mixed
    # torch.Tensor and DTensor"), and per shard its ops run without DTensor's dispatch. The rank draws its
    # block of the whole probabilities' mask.
    p = shard_local_layout(q, k, v, attn_mask)
    if p is None:
        return keyed_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, key=key)
    offsets = block_of(q)[2]
    probs = (*q.shape[:-1], k.shape[-2])
    mask = attn_mask.to_local() if isinstance(attn_mask, DTensor) else attn_mask
    out = keyed_attention(q.to_local(), k.to_local(), v.to_local(), mask, dropout_p, is_causal, scale, enable_gqa,
                          key=key, block=(probs, (*offsets[:2], 0, 0)))
    return DTensor.from_local(out, q.device_mesh, [p], run_check=False)


# The fused kernels scaled_dot_product_attention dispatches to on each device type (forward, backward).
FUSED_ATTENTION: dict[str, tuple[Any, ...]] = {
    "cuda": (
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_backward.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_efficient_attention_backward.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_cudnn_attention_backward.default,
    ),
    "cpu": (
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    ),
}


def dtensor_has_rule(op: Any) -> bool:
    """Whether DTensor's sharding propagation has a strategy registered for aten overload `op`."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    return op in propagator.op_strategy_funcs or op in propagator.op_to_rules


def substitutions(device_type: str) -> dict[Any, Any]:
    """The ops a TP stage on a mesh of `device_type` runs in place of the captured ones.

    Attention with dropout (passes/randomness.py) runs per shard on every device type. Attention without
    keeps the captured op where DTensor shards every fused kernel it can dispatch to there (CUDA in torch
    2.13: flash, memory-efficient and cuDNN attention over heads); elsewhere (the CPU flash kernel has no
    rule) it runs the fused kernel per shard, or the math formulation where layouts differ.
    Shards and their gradients can have other strides than the captured global tensors: reshape where the
    capture said view (same values, copies only when a view is impossible).
    """
    table: dict[Any, Any] = {
        aten.view.default: aten.reshape.default,
        aten._unsafe_view.default: aten.reshape.default,
        keyed_attention: _keyed_attention_per_shard,  # attention with dropout, every device type
    }
    fused = FUSED_ATTENTION.get(device_type)
    if not fused or not all(dtensor_has_rule(op) for op in fused):
        table[aten.scaled_dot_product_attention.default] = _sdpa_per_shard
    return table


_VOCAB_PARALLEL = {
    aten.cross_entropy_loss.default: vocab_parallel_loss,
    aten.embedding.default: vocab_parallel_embedding,
}


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: DTensor rebuilds gradients of `to_local`
    with the forward tensor's strides, which a transposed gradient cannot view."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return g.contiguous()


def full_tensor(x: Any) -> Any:
    """The full value of a DTensor as a plain tensor (differentiable); other values unchanged."""
    return _ContiguousGrad.apply(x.full_tensor()) if isinstance(x, DTensor) else x


def _storage(x: torch.Tensor) -> int:
    return (x._local_tensor if isinstance(x, DTensor) else x).untyped_storage().data_ptr()


@dataclass(frozen=True)
class _Regather:
    payload: Any  # the shard, as the surrounding hooks packed it


def _column_parallel_input(target: Any, args: tuple) -> tuple[tuple, Any]:
    """(args, saved-tensor hooks to run the op under) for a linear-like op whose weight is column-parallel
    (sharded on its output features) reading a sharded activation: the activation is gathered before the op,
    and the op saves the shard, gathered again in the backward (Megatron's sequence parallelism does the
    same). The op saves what the intra-op ILP prices (the shard), and its weight gradient comes out in the
    weight's own placement. Left to DTensor, the op gathered inside, autograd saved the shard as it came, and
    the backward made a Shard(0) gradient for the Shard(1) weight, redistributed every micro-batch (an
    all-to-all, which gloo runs as an all-gather of the whole gradient)."""
    spec = LINEAR_ARGS.get(str(target))
    if spec is None or len(args) <= max(spec[:2]):
        return args, contextlib.nullcontext()
    xi, wi, out_dim = spec
    x, w = args[xi], args[wi]
    if not (isinstance(x, DTensor) and isinstance(w, DTensor) and w.ndim == 2 and x.device_mesh.ndim == 1
            and tuple(w.placements) == (Shard(out_dim),) and any(isinstance(p, Shard) for p in x.placements)):
        return args, contextlib.nullcontext()
    gathered = x.redistribute(x.device_mesh, [Replicate()])
    key = _storage(gathered)
    # hooks around (a recomputed block's checkpoint, activation offload) see the shard in the gather's place
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (lambda t: t, lambda t: t)

    def pack(t: torch.Tensor) -> Any:
        if isinstance(t, DTensor) and _storage(t) == key:
            return _Regather(outer_pack(x.detach()))
        return outer_pack(t)

    def unpack(saved: Any) -> torch.Tensor:
        if isinstance(saved, _Regather):
            shard = outer_unpack(saved.payload)
            return shard.redistribute(shard.device_mesh, [Replicate()])
        return outer_unpack(saved)

    return (*args[:xi], gathered, *args[xi + 1:]), torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class _TPInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, mesh: DeviceMesh, spec: TPSpec, replicated: set[str]) -> None:
        super().__init__(gm)
        self.mesh, self.spec, self.replicated = mesh, spec, replicated
        self.substitute = substitutions(mesh.device_type)

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        target = self.substitute.get(n.target, n.target)
        if n.target is aten._assert_tensor_metadata.default and isinstance(args[0], DTensor):
            return None  # a capture-time check; gathering a sharded tensor just to assert it would cost
        args, saving = _column_parallel_input(n.target, args)
        with saving:
            out = self._call(n, target, args, kwargs)
        placement = self.spec.relayout.get(n.name)
        if placement is not None and isinstance(out, DTensor):
            out = out.redistribute(self.mesh, [placement])
        if isinstance(out, DTensor) and out.requires_grad:
            # redistributed gradients can come back with strides a later view cannot take
            out.register_hook(lambda g: g.contiguous())
        return out

    def _call(self, n: fx.Node, target: Any, args: tuple, kwargs: dict) -> Any:
        if n.name in self.replicated:
            return self._replicated(target, args, kwargs)
        if n.target in _VOCAB_PARALLEL and (vp := _VOCAB_PARALLEL[n.target](self.mesh, args, kwargs)) is not None:
            return vp
        try:
            return target(*args, **kwargs)
        except (NotImplementedError, RuntimeError, AssertionError) as e:
            if "DTensor" not in repr(e) and "sharding" not in str(e).lower() and "shard" not in str(e):
                raise
            self.replicated.add(n.name)
            return self._replicated(target, args, kwargs)

    def _replicated(self, target: Any, args: tuple, kwargs: dict) -> Any:
        args, kwargs = torch.utils._pytree.tree_map(full_tensor, (args, kwargs))
        out = target(*args, **kwargs)
        if target is operator.getitem:
            return out
        wrap = lambda x: (
            DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and x.is_floating_point()
            else x
        )
        return torch.utils._pytree.tree_map(wrap, out)


class TPStage:
    """Runs one stage program over a tensor-parallel group; inputs and outputs are plain full tensors."""

    def __init__(self, mesh: DeviceMesh, spec: TPSpec) -> None:
        self.mesh, self.spec = mesh, spec
        self.replicated: set[str] = set()

    def placement(self, param: str) -> Placement:
        return self.spec.params.get(param, Replicate())

    def shard(self, param: str, full: torch.Tensor) -> DTensor:
        """This rank's shard of a full tensor every rank holds (a local slice, no communication)."""
        return DTensor.from_local(full.detach(), self.mesh, [Replicate()], run_check=False).redistribute(
            self.mesh, [self.placement(param)]
        )

    @staticmethod
    def keep_grad_placement(param: nn.Parameter) -> None:
        """Keep `param`'s gradient laid out as the parameter is. DTensor's backward may produce a weight's
        gradient in another placement than the weight's: a fused QKV projection whose output the interpreter
        gathers gets a Replicate (full-size) gradient for its Shard(1) weight, which `.grad` would then hold
        on every rank (tp x the priced gradient bytes). After each accumulation the gradient is redistributed
        to the parameter's placement: from Replicate that is a local slice, no communication, and the values
        are the same."""
        if not isinstance(param, DTensor):
            return

        def hook(p: torch.Tensor) -> None:
            g = p.grad
            if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
                p.grad = g.redistribute(p.device_mesh, p.placements)

        param.register_post_accumulate_grad_hook(hook)

    def interpret(self, gm: nn.Module, args: tuple) -> Any:
        """Run one layer's program of a layered stage (runtime/layered.py) on DTensor values, as `run` runs a
        whole stage: the same sharding, fallbacks and relayouts per node."""
        return _TPInterpreter(gm, self.mesh, self.spec, self.replicated).run(*args)

    def run(self, gm: fx.GraphModule, param_vals: list[torch.Tensor], other: list[Any]) -> Any:
        wrap = lambda x: (
            DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
        )
        with implicit_replication():
            out = _TPInterpreter(gm, self.mesh, self.spec, self.replicated).run(
                *param_vals, *[wrap(x) for x in other]
            )
        return tuple(full_tensor(x) for x in out) if isinstance(out, tuple) else full_tensor(out)
