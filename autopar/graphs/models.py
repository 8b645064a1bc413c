"""GNN model cases for node classification on generated graphs: GCN, GraphSAGE and GAT built from
torch_geometric layers, and autopar's own message-passing `models.GNN` (GraphConv)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..models import GNN, ModelCase, building
from .data import random_graph


class PyGNet(nn.Module):
    """conv -> relu -> ... -> conv -> relu -> linear head; every conv is a torch_geometric layer."""

    def __init__(self, conv: str, features: int, hidden: int, layers: int, classes: int, heads: int = 2):
        super().__init__()
        import torch_geometric.nn as pyg

        def make(d_in: int) -> nn.Module:
            if conv == "gcn":
                return pyg.GCNConv(d_in, hidden)
            if conv == "sage":
                return pyg.SAGEConv(d_in, hidden, aggr="mean")
            if conv == "gat":
                return pyg.GATConv(d_in, hidden // heads, heads=heads)
            raise ValueError(f"unknown conv {conv!r}; choose gcn, sage or gat")

        self.convs = nn.ModuleList(make(features if i == 0 else hidden) for i in range(layers))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x, edge_index):  # noqa: ANN001, ANN201 (torch_geometric style)
        for conv in self.convs:
            x = F.relu(conv(x, edge_index))
        return self.head(x)


def _case(name: str, make: Callable[[], nn.Module], nodes: int, avg_degree: float, features: int, classes: int,
          seed: int, power_law: bool, labelled: float, device: str | torch.device) -> ModelCase:
    with building(device, seed):
        model = make()
    g = random_graph(nodes, avg_degree, features, classes, seed=seed, power_law=power_law, labelled=labelled)
    x, edge_index, y = (t.to(device) for t in (g.x, g.edge_index, g.y))
    return ModelCase(model, (x, edge_index), F.cross_entropy, y, name)


def pyg_case(conv: str, nodes: int = 200, avg_degree: float = 4.0, features: int = 16, hidden: int = 32,
             layers: int = 2, classes: int = 4, *, seed: int = 0, power_law: bool = False,
             labelled: float = 1.0, device: str | torch.device = "cpu") -> ModelCase:
    """A torch_geometric GNN (`conv` in gcn, sage, gat) on a generated graph."""
    return _case(conv, lambda: PyGNet(conv, features, hidden, layers, classes), nodes, avg_degree, features,
                 classes, seed, power_law, labelled, device)


def graphconv_case(nodes: int = 200, avg_degree: float = 4.0, features: int = 16, hidden: int = 32,
                   layers: int = 2, classes: int = 4, *, seed: int = 0, power_law: bool = False,
                   labelled: float = 1.0, device: str | torch.device = "cpu") -> ModelCase:
    """autopar's own message-passing GNN (models.GNN of GraphConv layers) on a generated graph."""
    return _case("graphconv", lambda: GNN(features, hidden, layers, classes), nodes, avg_degree, features,
                 classes, seed, power_law, labelled, device)


GRAPH_CASES: dict[str, Callable[..., ModelCase]] = {
    "gcn": lambda **kw: pyg_case("gcn", **kw),
    "sage": lambda **kw: pyg_case("sage", **kw),
    "gat": lambda **kw: pyg_case("gat", **kw),
    "graphconv": graphconv_case,
}

__all__ = ["GRAPH_CASES", "PyGNet", "graphconv_case", "pyg_case"]
