"""Generated graph data (nothing is downloaded): random graphs of a chosen size and degree, node features
and labels, and a locality-improving node order for partitioning."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import PlanError

IGNORE = -100  # label of unlabelled nodes (F.cross_entropy's default ignore_index)


@dataclass
class GraphData:
    x: torch.Tensor  # (N, F) float node features
    edge_index: torch.Tensor  # (2, E) int64, row 0 = source, row 1 = destination (messages flow src -> dst)
    y: torch.Tensor  # (N,) int64 class labels, IGNORE for unlabelled nodes

    @property
    def num_nodes(self) -> int:
        return self.x.shape[0]


def random_graph(nodes: int, avg_degree: float, features: int = 16, classes: int = 4, *, seed: int = 0,
                 power_law: bool = False, labelled: float = 1.0) -> GraphData:
    """A random directed graph with `nodes` nodes and about `nodes * avg_degree` edges, without self-loops.

    Edges are uniform (Erdos-Renyi-like) or, with `power_law`, destinations follow a Zipf-like law (a few
    hubs with large in-degree, like social graphs). Features are Gaussian; labels depend on the features
    and on the mean feature of in-neighbours, so a GNN can learn them. A fraction `labelled` of the nodes
    carries a label; the rest are IGNORE.
    """
    if nodes < 2 or avg_degree <= 0:
        raise PlanError(f"random_graph needs nodes >= 2 and avg_degree > 0, got {nodes}, {avg_degree}.")
    g = torch.Generator().manual_seed(seed)
    edges = int(round(nodes * avg_degree))
    src = torch.randint(0, nodes, (edges,), generator=g)
    if power_law:
        weights = 1.0 / torch.arange(1, nodes + 1, dtype=torch.float64) ** 0.8
        dst = torch.randperm(nodes, generator=g)[torch.multinomial(weights, edges, True, generator=g)]
    else:
        dst = torch.randint(0, nodes, (edges,), generator=g)
    keep = src != dst
    return _with_labels(torch.stack([src[keep], dst[keep]]), nodes, features, classes, g, labelled)


def clustered_graph(nodes: int, blocks: int, avg_degree: float, features: int = 16, classes: int = 4, *,
                    inside: float = 0.95, seed: int = 0, labelled: float = 1.0) -> GraphData:
    """A stochastic-block-model-like directed graph: nodes fall into `blocks` communities at random (ids carry
    no hint of them); each of about `nodes * avg_degree` edges has a uniform source and, with probability
    `inside`, a destination in the source's community, else anywhere. Features and labels as `random_graph`'s.
    What a min-cut partitioner (METIS) splits with few cut edges and a node order without the communities
    does not."""
    if nodes < 2 or blocks < 1 or avg_degree <= 0 or not 0.0 <= inside <= 1.0:
        raise PlanError(f"clustered_graph needs nodes >= 2, blocks >= 1, avg_degree > 0 and 0 <= inside <= 1, "
                        f"got {nodes}, {blocks}, {avg_degree}, {inside}.")
    g = torch.Generator().manual_seed(seed)
    block = torch.randperm(nodes, generator=g) % blocks
    members = torch.argsort(block, stable=True)
    start = torch.cumsum(torch.bincount(block, minlength=blocks), 0) - torch.bincount(block, minlength=blocks)
    size = torch.bincount(block, minlength=blocks)
    edges = int(round(nodes * avg_degree))
    src = torch.randint(0, nodes, (edges,), generator=g)
    pick = (torch.rand(edges, generator=g, dtype=torch.float64) * size[block[src]]).long()
    dst = torch.where(torch.rand(edges, generator=g) < inside, members[start[block[src]] + pick],
                      torch.randint(0, nodes, (edges,), generator=g))
    keep = src != dst
    return _with_labels(torch.stack([src[keep], dst[keep]]), nodes, features, classes, g, labelled)


def _with_labels(edge_index: torch.Tensor, nodes: int, features: int, classes: int, g: torch.Generator,
                 labelled: float) -> GraphData:
    """Gaussian features and labels from them and the in-neighbours' mean (a fraction `labelled` kept)."""
    x = torch.randn(nodes, features, generator=g)
    proj = torch.randn(features, classes, generator=g)
    deg = torch.zeros(nodes).index_add_(0, edge_index[1], torch.ones(edge_index.shape[1])).clamp(min=1)
    neigh = torch.zeros_like(x).index_add_(0, edge_index[1], x[edge_index[0]]) / deg[:, None]
    y = ((x + neigh) @ proj).argmax(dim=1)
    if labelled < 1.0:
        y[torch.rand(nodes, generator=g) >= labelled] = IGNORE
    return GraphData(x, edge_index, y)


def in_degree(edge_index: torch.Tensor, num_nodes: int, *, exclude_self_loops: bool = False) -> torch.Tensor:
    """(N,) int64 number of edges into each node."""
    dst = edge_index[1]
    if exclude_self_loops:
        dst = dst[edge_index[0] != edge_index[1]]
    return torch.bincount(dst, minlength=num_nodes)


def locality_order(edge_index: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """A permutation (new position -> node id) that puts neighbours near each other: breadth-first search over
    the undirected graph (Cuthill-McKee: each level ordered by its parent's position, then id), starting each
    component at its highest-degree unvisited node; isolated nodes go last. Contiguous ranges of this order
    make partitions with few boundary nodes; deterministic, so every rank computes the same order."""
    src, dst = edge_index[0].long(), edge_index[1].long()
    a, b = torch.cat([src, dst]), torch.cat([dst, src])
    perm = torch.argsort(a * num_nodes + b)
    a, b = a[perm], b[perm]
    indptr = torch.zeros(num_nodes + 1, dtype=torch.long)
    indptr[1:] = torch.cumsum(torch.bincount(a, minlength=num_nodes), 0)
    degree = indptr[1:] - indptr[:-1]
    position = torch.full((num_nodes,), -1, dtype=torch.long)
    filled = 0
    for start in torch.argsort(-degree, stable=True).tolist():
        if degree[start] == 0:
            break
        if position[start] >= 0:
            continue
        position[start] = filled
        frontier = torch.tensor([start])
        filled += 1
        while frontier.numel():
            counts = degree[frontier]
            parent = torch.repeat_interleave(position[frontier], counts)
            starts = torch.cumsum(counts, 0) - counts
            offsets = torch.arange(int(counts.sum())) - torch.repeat_interleave(starts, counts)
            nbr = b[torch.repeat_interleave(indptr[frontier], counts) + offsets]
            new = position[nbr] < 0
            nbr, parent = nbr[new], parent[new]
            key = torch.unique(parent * num_nodes + nbr)  # sorted by (parent position, id)
            nbr = key % num_nodes
            first = torch.ones_like(nbr, dtype=torch.bool)
            order_by_id = torch.argsort(nbr, stable=True)
            sorted_ids = nbr[order_by_id]
            first[order_by_id[1:]] = sorted_ids[1:] != sorted_ids[:-1]  # keep each node under its first parent
            frontier = nbr[first]
            position[frontier] = torch.arange(filled, filled + frontier.numel())
            filled += frontier.numel()
    rest = (position < 0).nonzero().flatten()
    position[rest] = torch.arange(filled, filled + rest.numel())
    return torch.argsort(position)


def check_graph_inputs(x: torch.Tensor, edge_index: torch.Tensor) -> None:
    """Clear errors for malformed graph inputs."""
    if not isinstance(edge_index, torch.Tensor) or edge_index.dim() != 2 or edge_index.shape[0] != 2 \
            or edge_index.dtype not in (torch.int64, torch.int32):
        raise PlanError("edge_index must be an integer tensor of shape (2, E) (row 0 = sources, row 1 = "
                        f"destinations), got {getattr(edge_index, 'shape', type(edge_index))}.")
    if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= x.shape[0]):
        raise PlanError(f"edge_index refers to node ids outside 0..{x.shape[0] - 1} (x has {x.shape[0]} rows).")


__all__ = ["IGNORE", "GraphData", "check_graph_inputs", "clustered_graph", "in_degree", "locality_order",
           "random_graph"]
