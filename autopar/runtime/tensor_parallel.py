"""Tensor parallelism inside a stage, lowered onto DTensor.

A stage program is the captured aten graph with its global shapes. Running it with parameters that are
DTensors keeps those global semantics while each rank holds and computes only its shard: DTensor's
sharding propagation inserts the collectives (the all-reduce after a row-parallel linear, the slice
before a head-parallel attention). The plan decides placements: which weights are sharded on which
dimension (column- or row-parallel) and which activations to re-layout (attention heads). An op that
DTensor has no sharding rule for runs replicated on every rank of the group, and the dump says so.
"""

from __future__ import annotations

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
from ..graph import TrainingGraph
from .vocab_parallel import vocab_parallel_embedding, vocab_parallel_loss

aten = torch.ops.aten
_ELEMENTWISE_FOLLOW = {
    "aten.gelu.default",
    "aten.relu.default",
    "aten.silu.default",
    "aten.dropout.default",
    "aten.mul.Tensor",
    "aten.tanh.default",
    "aten.add.Tensor",
    "aten.pow.Tensor_Scalar",
    "aten.sigmoid.default",
    "aten.clone.default",
    "aten.contiguous.default",
}
_VIEWS = {
    "aten.view.default",
    "aten.reshape.default",
    "aten.transpose.int",
    "aten.permute.default",
    "aten._unsafe_view.default",
    "aten.contiguous.default",
    "aten.clone.default",
    "aten.flatten.using_ints",
}


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


def _weight_of(graph: TrainingGraph, node_name: str) -> tuple[str, int] | None:
    """(parameter placeholder, index of its output-feature dim) for a linear-like node with a weight param."""
    n = graph.nodes[node_name]
    if n.target == "aten.linear.default" and len(n.args) >= 2 and n.args[1] in graph.params:
        return n.args[1], 0  # weight (out, in)
    if n.target in ("aten.addmm.default", "aten.mm.default"):
        w = n.args[-1]
        if w in graph.params and len(graph.params[w].meta.shape) == 2:
            return w, 1  # Conv1D-style weight (in, out) used as mat2
    return None


def _users(graph: TrainingGraph, names: list[str]) -> dict[str, list[str]]:
    users: dict[str, list[str]] = {}
    for name in names:
        for a in graph.nodes[name].args:
            users.setdefault(a, []).append(name)
    return users


def _next_linear(graph: TrainingGraph, users: dict[str, list[str]], start: str, through: set[str]) -> str | None:
    """The first linear-like node reading `start`'s value through ops in `through`."""
    frontier, seen = [start], set()
    while frontier:
        cur = frontier.pop()
        for u in users.get(cur, []):
            if u in seen:
                continue
            seen.add(u)
            if _weight_of(graph, u) and graph.nodes[u].args[
                0 if graph.nodes[u].target != "aten.addmm.default" else 1
            ] in ({cur} | seen | {start}):
                return u
            if graph.nodes[u].target in through:
                frontier.append(u)
    return None


def attention_projection(graph: TrainingGraph, attention: str, names: list[str]) -> tuple[str, Shard] | None:
    """(weight placeholder, its row-parallel placement) of the linear projecting attention node `attention`'s
    output (through views, within `names`): attention runs head-parallel when that weight is so placed."""
    proj = _next_linear(graph, _users(graph, names), attention, _VIEWS)
    if proj is None:
        return None
    w, out_dim = _weight_of(graph, proj)
    return w, Shard(1 - out_dim)


def megatron_spec(graph: TrainingGraph, layers: tuple[int, int]) -> TPSpec:
    """Megatron-style placements derived from the graph: an MLP's first linear column-parallel and its
    second row-parallel; attention head-parallel with its output projection row-parallel. Fused QKV
    projections stay replicated (their output is split by a view DTensor cannot shard evenly)."""
    spec = TPSpec()
    names = [n for layer in graph.layers[layers[0] : layers[1]] for n in layer.nodes]
    users = _users(graph, names)

    def bias_of(node_name: str) -> str | None:
        n = graph.nodes[node_name]
        if n.target == "aten.linear.default" and len(n.args) == 3 and n.args[2] in graph.params:
            return n.args[2]
        if n.target == "aten.addmm.default" and n.args[0] in graph.params:
            return n.args[0]
        return None

    def next_linear(start: str, through: set[str]) -> str | None:
        return _next_linear(graph, users, start, through)

    row_done: set[str] = set()
    for name in names:
        n = graph.nodes[name]
        if n.target == "aten.scaled_dot_product_attention.default":
            for qkv in n.args[:3]:
                if qkv in graph.nodes:
                    spec.relayout[qkv] = Shard(1)
            proj = next_linear(name, _VIEWS)
            if proj:
                w, out_dim = _weight_of(graph, proj)
                spec.params[graph.canonical(w)] = Shard(1 - out_dim)
                row_done.add(proj)
    for name in names:
        if name in row_done or not _weight_of(graph, name):
            continue
        second = next_linear(name, _ELEMENTWISE_FOLLOW | _VIEWS)
        if second is None or second in row_done or len(users.get(name, [])) != 1:
            continue
        w1, d1 = _weight_of(graph, name)
        w2, d2 = _weight_of(graph, second)
        if graph.canonical(w1) in spec.params or graph.canonical(w2) in spec.params:
            continue
        spec.params[graph.canonical(w1)] = Shard(d1)
        b1 = bias_of(name)
        if b1:
            spec.params[graph.canonical(b1)] = Shard(0)
        spec.params[graph.canonical(w2)] = Shard(1 - d2)
        row_done.update({name, second})
    _vocab_parallel(graph, names, spec, row_done, graph.canonical, bias_of)
    return spec


def parse_placement(text: str) -> Placement:
    """A `Stage.sharding` value ("replicate" or "shard(d)") as a DTensor placement."""
    m = re.fullmatch(r"shard\((\d+)\)", text)
    if text != "replicate" and m is None:
        raise PlanError(f"sharding placement {text!r} is not one of 'replicate', 'shard(d)' (d a dim index).")
    return Replicate() if m is None else Shard(int(m.group(1)))


def sharding_spec(graph: TrainingGraph, layers: tuple[int, int], sharding: Mapping[str, str]) -> TPSpec:
    """Placements of a plan's `Stage.sharding` (the intra-op ILP's choice, solver/intra_op_pricing.py).

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
    users = _users(graph, list(graph.nodes))
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
            if node.target == "aten.scaled_dot_product_attention.default":
                proj = attention_projection(graph, n, layer.nodes)
                if proj and spec.params.get(graph.canonical(proj[0])) == proj[1]:
                    spec.relayout.update((a, Shard(1)) for a in node.args[:3] if a in graph.nodes)
            weight = _weight_of(graph, n)
            if weight and spec.params.get(graph.canonical(weight[0])) == Shard(1 - weight[1]):
                spec.relayout[n] = Replicate()
            if node.outputs and any(u not in inside for u in users.get(n, [])):
                spec.relayout[n] = Replicate()
    return spec


_TO_LOSS = _VIEWS | {"aten.to.dtype", "aten._to_copy.default", "aten.alias.default", "aten.slice.Tensor",
                     "aten._assert_tensor_metadata.default"}


def _loss_heads(graph: TrainingGraph) -> list[str]:
    """Linear-like nodes whose output reaches a cross-entropy through views and casts only (LM heads)."""
    users = _users(graph, list(graph.nodes))
    heads = []
    for start in graph.nodes:
        if not _weight_of(graph, start):
            continue
        frontier, seen = [start], {start}
        while frontier:
            for u in users.get(frontier.pop(), []):
                if u in seen:
                    continue
                seen.add(u)
                node = graph.nodes[u]
                if node.target == "aten.cross_entropy_loss.default" and node.args[0] in seen:
                    heads.append(start)
                elif node.target in _TO_LOSS:
                    frontier.append(u)
    return heads


def _vocab_parallel(graph: TrainingGraph, names: list[str], spec: TPSpec, done: set[str], canonical: Any,
                    bias_of: Any) -> None:
    """The LM head (a linear feeding a cross-entropy) column-parallel along the vocabulary, and embedding
    tables with as many rows as a head has classes `Shard(0)` (see vocab_parallel.py); position and other
    small tables stay replicated. A tied head and embedding get the same placement; a parameter already
    placed otherwise is left alone."""
    heads = _loss_heads(graph)
    vocab = {graph.params[_weight_of(graph, h)[0]].meta.shape[_weight_of(graph, h)[1]] for h in heads}
    mine = set(names)
    for name in names:
        n = graph.nodes[name]
        if n.target == "aten.embedding.default" and n.args and n.args[0] in graph.params \
                and graph.params[n.args[0]].meta.shape[0] in vocab:
            spec.params.setdefault(canonical(n.args[0]), Shard(0))
    for name in heads:
        if name not in mine or name in done:
            continue
        w, out_dim = _weight_of(graph, name)
        if spec.params.setdefault(canonical(w), Shard(out_dim)) != Shard(out_dim):
            continue
        bias = bias_of(name)
        if bias:
            spec.params.setdefault(canonical(bias), Shard(0))


def _sdpa_math(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    # The math formulation decomposes into ops DTensor can shard over heads; the fused CPU kernel has no rule.
    # Like the public op, turn a boolean mask (True = attend) into an additive one first.
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            attn_mask.logical_not(), float("-inf")
        )
    return aten._scaled_dot_product_attention_math.default(
        q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )[0]


# Shards and their gradients can have other strides than the captured global tensors: reshape where the
# capture said view (same values, copies only when a view is impossible).
_SUBSTITUTE = {
    aten.scaled_dot_product_attention.default: _sdpa_math,
    aten.view.default: aten.reshape.default,
    aten._unsafe_view.default: aten.reshape.default,
}


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


class _TPInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, mesh: DeviceMesh, spec: TPSpec, replicated: set[str]) -> None:
        super().__init__(gm)
        self.mesh, self.spec, self.replicated = mesh, spec, replicated

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        target = _SUBSTITUTE.get(n.target, n.target)
        if n.target is aten._assert_tensor_metadata.default and isinstance(args[0], DTensor):
            return None  # a capture-time check; gathering a sharded tensor just to assert it would cost
        if n.name in self.replicated:
            out = self._replicated(target, args, kwargs)
        elif n.target in _VOCAB_PARALLEL and (vp := _VOCAB_PARALLEL[n.target](self.mesh, args, kwargs)) is not None:
            out = vp
        else:
            try:
                out = target(*args, **kwargs)
            except (NotImplementedError, RuntimeError, AssertionError) as e:
                if "DTensor" not in repr(e) and "sharding" not in str(e).lower() and "shard" not in str(e):
                    raise
                self.replicated.add(n.name)
                out = self._replicated(target, args, kwargs)
        placement = self.spec.relayout.get(n.name)
        if placement is not None and isinstance(out, DTensor):
            out = out.redistribute(self.mesh, [placement])
        if isinstance(out, DTensor) and out.requires_grad:
            # redistributed gradients can come back with strides a later view cannot take
            out.register_hook(lambda g: g.contiguous())
        return out

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
