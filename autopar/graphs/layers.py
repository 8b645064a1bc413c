"""Per-layer adapters that run a model's message-passing layers on a rank's local piece of the graph.

The model runs unchanged on a subset of node rows; every message-passing layer gets forward hooks (installed
only while a distributed step runs, so parameter names and the model itself stay as written):

* before it runs, its node input (the rows this rank computes) is extended with the rows it also reads
  (`LocalGraph.extend`: the halo exchange of graph partitioning, or nothing for sampled mini-batches, whose
  rows already hold every needed node) and its edge argument is replaced by the rank's local edges;
* after it runs, only the rows of its targets are kept.

Output row v of a supported layer depends only on v's in-edges and their sources, so the kept rows equal
the full-graph layer's rows. Per layer type:

* torch_geometric `GCNConv`: its symmetric normalisation needs degrees of source nodes whose in-edges are
  elsewhere, so the adapter passes edge weights computed from the global degrees (`LocalGraph.degree`) and
  runs the layer with `normalize=False` for the call; self-loops as `add_remaining_self_loops` adds them.
* `SAGEConv`, `GATConv` and other `MessagePassing` layers called as `layer(x, edge_index, ...)`: local
  edges; GAT's per-destination softmax and self-loops only involve the destination's in-edges.
* autopar's own `models.GraphConv(x, src, dst, inv_degree)`: local src/dst, inverse in-degree recomputed
  from the local edges (complete for every target row).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import PlanError
from ..models import GraphConv


def _pyg_message_passing() -> type | None:
    try:
        from torch_geometric.nn.conv import MessagePassing
    except ImportError:  # torch_geometric is optional
        return None
    return MessagePassing


def message_passing_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's message-passing layers (outermost ones), in registration order."""
    mp = _pyg_message_passing()
    kinds = (GraphConv,) if mp is None else (GraphConv, mp)
    found: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if isinstance(m, kinds) and not any(name.startswith(f + ".") for f, _ in found):
            found.append((name, m))
    return found


def layer_kind(m: nn.Module) -> str:
    """'gcn' | 'sage' | 'gat' | 'graphconv' | 'mp' (another torch_geometric MessagePassing)."""
    if isinstance(m, GraphConv):
        return "graphconv"
    name = type(m).__name__
    return {"GCNConv": "gcn", "SAGEConv": "sage", "GATConv": "gat", "GATv2Conv": "gat"}.get(name, "mp")


@dataclass
class LocalGraph:
    """What the message-passing layers of one forward see on this rank.

    `edges[i]` is the local (2, E_i) edge_index of the i-th message-passing call (one entry: all calls),
    `inputs[i]` the node rows it is called with, `targets[i]` the rows it keeps, `degree` the global in-degree
    (self-loops excluded) of every local row
    (GCN normalisation), `extend(h)` turns a layer input of target rows into the rows the edges index.
    """

    edges: list[torch.Tensor]
    inputs: list[int]
    targets: list[int]
    degree: torch.Tensor
    extend: Callable[[torch.Tensor], torch.Tensor]
    calls: int = 0
    _active: dict[int, list[int]] = field(default_factory=dict)

    def layer(self, i: int) -> tuple[torch.Tensor, int, int]:
        if len(self.edges) == 1:
            return self.edges[0], self.inputs[0], self.targets[0]
        if i >= len(self.edges):
            raise PlanError(f"the model called message-passing layers {i + 1} times in one forward, but the "
                            f"sampled mini-batch has {len(self.edges)} layers: each message-passing layer must "
                            f"run once per forward.")
        return self.edges[i], self.inputs[i], self.targets[i]


def _gcn_weights(m: nn.Module, edges: torch.Tensor, rows_in: int, targets: int, degree: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(edge_index, edge_weight) of GCNConv's normalisation on the local edges, from global degrees."""
    if getattr(m, "flow", "source_to_target") != "source_to_target" or getattr(m, "cached", False):
        raise PlanError("GCNConv with flow='target_to_source' or cached=True cannot be partitioned; use the "
                        "defaults (flow='source_to_target', cached=False).")
    edges = edges[:, edges[0] != edges[1]]
    w = torch.ones(edges.shape[1], dtype=dtype, device=edges.device)
    deg = degree[:rows_in].to(dtype)
    if m.add_self_loops:
        fill = 2.0 if m.improved else 1.0
        loops = torch.arange(targets, device=edges.device).repeat(2, 1)
        edges = torch.cat([edges, loops], dim=1)
        w = torch.cat([w, torch.full((targets,), fill, dtype=dtype, device=edges.device)])
        deg = deg + fill
    dis = deg.pow(-0.5)
    dis = dis.masked_fill(dis == float("inf"), 0.0)
    return edges, dis[edges[0]] * w * dis[edges[1]]


def _pre(m: nn.Module, kind: str, ctx: LocalGraph, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    i = ctx.calls
    ctx.calls += 1
    edges, rows, targets = ctx.layer(i)
    ctx._active.setdefault(id(m), []).append(targets)
    args, kwargs = list(args), dict(kwargs)
    x = args[0] if args else kwargs.pop("x")
    if not isinstance(x, torch.Tensor):
        raise PlanError(f"{type(m).__name__} got a {type(x).__name__} as node input; distributed graph training "
                        f"supports layers called as layer(x, edge_index, ...) with one tensor x.")
    if x.shape[0] != rows:
        raise PlanError(f"{type(m).__name__} got {x.shape[0]} node rows where this rank computes {rows}: "
                        f"layers between message-passing layers must be node-wise (one output row per node).")
    x = ctx.extend(x)
    rest = args[1:]
    if kind == "graphconv":
        deg = torch.zeros(x.shape[0], 1, dtype=x.dtype, device=x.device).index_add(
            0, edges[1], torch.ones(edges.shape[1], 1, dtype=x.dtype, device=x.device))
        return (x, edges[0], edges[1], 1.0 / deg.clamp(min=1.0)), {}
    if rest:
        rest = rest[1:]
    else:
        kwargs.pop("edge_index", None)
    if kind == "gcn":
        if (rest and rest[0] is not None) or kwargs.get("edge_weight") is not None:
            raise PlanError("GCNConv with user edge weights is not supported by distributed graph training.")
        kwargs.pop("edge_weight", None)
        rest = ()
        edges, weight = _gcn_weights(m, edges, x.shape[0], targets, ctx.degree, x.dtype)
        kwargs["edge_weight"] = weight
        m._autopar_normalize = m.normalize
        m.normalize = False
    return (x, edges, *rest), kwargs


def _post(m: nn.Module, ctx: LocalGraph, out: Any) -> Any:
    targets = ctx._active[id(m)].pop()
    if hasattr(m, "_autopar_normalize"):
        m.normalize = m._autopar_normalize
        del m._autopar_normalize
    if isinstance(out, tuple):
        return (out[0][:targets], *out[1:])
    return out[:targets]


@contextmanager
def local_layers(model: nn.Module, ctx: LocalGraph) -> Iterator[None]:
    """Run `model`'s message-passing layers on the local graph `ctx` inside this block."""
    handles = []
    layers = message_passing_layers(model)
    if not layers:
        raise PlanError(f"{type(model).__name__} has no message-passing layer (torch_geometric MessagePassing "
                        f"or autopar.models.GraphConv); graph partitioning has nothing to distribute.")
    try:
        for _, m in layers:
            kind = layer_kind(m)
            handles.append(m.register_forward_pre_hook(
                lambda mod, a, kw, kind=kind: _pre(mod, kind, ctx, a, kw), with_kwargs=True))
            handles.append(m.register_forward_hook(lambda mod, a, out: _post(mod, ctx, out)))
        yield
    finally:
        for h in handles:
            h.remove()
        for _, m in layers:
            if hasattr(m, "_autopar_normalize"):
                m.normalize = m._autopar_normalize
                del m._autopar_normalize


__all__ = ["LocalGraph", "layer_kind", "local_layers", "message_passing_layers"]
