"""Per-node deterministic neighbour sampling for mini-batch (sampled) data-parallel GNN training.

Every step t defines one sampled graph G_t: each node keeps at most `fanout` of its in-edges (self-loops
dropped), those whose hash score h(seed, t, edge id) is smallest. A node's sample depends only on (seed, t,
its own in-edges), never on which seeds share its mini-batch, so a seed's L-layer computation on G_t is the
same whether one process handles all seeds or ranks split them: sampled data parallelism with gradient
all-reduce then equals single-process training of `model(x, sampled_graph(...))` on the same seeds.

A mini-batch is the usual layered subgraph: N_L = seeds, N_{l-1} = N_l + the sampled in-neighbours of N_l
(N_l stays a prefix of N_{l-1}), so one local numbering (positions in N_0) serves every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .data import IGNORE

_P = 2_147_483_629  # a prime below 2**31: products of two residues fit in int64


def edge_scores(edge_ids: torch.Tensor, step: int, seed: int) -> torch.Tensor:
    """A pseudo-random int64 score in [0, P) per edge id, a pure function of (seed, step, id)."""
    h = (edge_ids * 1_103_515_245 + (step * 2_654_435_761 + seed * 97_531 + 12_345) % _P) % _P
    for mult, add in ((1_664_525, 1_013_904_223), (22_695_477, 1), (1_103_515_245, 12_345)):
        h = (h * mult + add) % _P
        h = (h ^ (h >> 13)) % _P
    return h


class InEdges:
    """The graph's in-edge lists (CSR by destination, self-loops dropped), built once per graph."""

    def __init__(self, edge_index: torch.Tensor, num_nodes: int) -> None:
        ids = torch.arange(edge_index.shape[1])
        keep = edge_index[0] != edge_index[1]
        src, dst, ids = edge_index[0][keep].long(), edge_index[1][keep].long(), ids[keep]
        order = torch.argsort(dst, stable=True)
        self.src, self.dst, self.ids = src[order], dst[order], ids[order]
        self.degree = torch.bincount(dst, minlength=num_nodes)
        self.indptr = torch.zeros(num_nodes + 1, dtype=torch.long)
        self.indptr[1:] = torch.cumsum(self.degree, 0)
        self.num_nodes = num_nodes

    def sample(self, nodes: torch.Tensor, fanout: int, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(src, dst) global ids of the sampled in-edges of `nodes` in G_step, grouped by destination."""
        counts = self.degree[nodes]
        total = int(counts.sum())
        offsets = torch.arange(total) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        pos = torch.repeat_interleave(self.indptr[nodes], counts) + offsets
        group = torch.repeat_interleave(torch.arange(nodes.numel()), counts)
        if fanout > 0:
            order = torch.argsort(group * _P + edge_scores(self.ids[pos], step, seed))
            pos, group = pos[order], group[order]
            starts = torch.cumsum(counts, 0) - counts
            keep = torch.arange(total) - starts[group] < fanout
            pos = pos[keep]
        return self.src[pos], self.dst[pos]

    def sampled_degree(self, nodes: torch.Tensor, fanout: int) -> torch.Tensor:
        """In-degree of `nodes` in any sampled graph G_t (self-loops excluded)."""
        return self.degree[nodes].clamp(max=fanout) if fanout > 0 else self.degree[nodes]


def sampled_graph(edge_index: torch.Tensor, num_nodes: int, fanout: int, step: int, seed: int = 0) -> torch.Tensor:
    """The whole sampled graph G_step as an edge_index (the single-process reference of sampled training)."""
    src, dst = InEdges(edge_index, num_nodes).sample(torch.arange(num_nodes), fanout, step, seed)
    return torch.stack([src, dst])


def seeds_for_step(labelled: torch.Tensor, batch_size: int, step: int, seed: int = 0) -> torch.Tensor:
    """The global mini-batch of step `step`: epochs walk a seeded permutation of the labelled node ids."""
    n = labelled.numel()
    per_epoch = max(1, n // batch_size)
    epoch, k = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return labelled[perm[k * batch_size:(k + 1) * batch_size]]


def labelled_nodes(target: torch.Tensor) -> torch.Tensor:
    """Ids of nodes with a label (integer targets: not IGNORE; float targets: all)."""
    if target.dtype.is_floating_point:
        return torch.arange(target.shape[0])
    return (target != IGNORE).nonzero().flatten()


@dataclass
class MiniBatch:
    nodes: torch.Tensor  # global ids of N_0 (targets of every layer are prefixes)
    sizes: list[int]  # |N_0|, |N_1|, ..., |N_L| (= number of seeds)
    edges: list[torch.Tensor]  # per message-passing layer (input order), local (2, E_l) edge_index
    degree: torch.Tensor  # in-degree in G_t of every node of N_0 (for GCN's normalisation)


def build_minibatch(graph: InEdges, seeds: torch.Tensor, layers: int, fanout: int, step: int,
                    seed: int) -> MiniBatch:
    """The layered subgraph that computes the L-layer outputs of `seeds` on G_step."""
    nodes, sizes = seeds, [seeds.numel()]
    global_edges: list[tuple[torch.Tensor, torch.Tensor]] = []
    local = torch.full((graph.num_nodes,), -1, dtype=torch.long)
    local[nodes] = torch.arange(nodes.numel())
    for _ in range(layers):
        # every node of the current level is a target of the next layer down (N_l is a prefix of N_{l-1})
        src, dst = graph.sample(nodes, fanout, step, seed)
        new = src[local[src] < 0]
        if new.numel():
            uniq, inverse = torch.unique(new, return_inverse=True)
            first_pos = torch.full((uniq.numel(),), new.numel(), dtype=torch.long).scatter_reduce(
                0, inverse, torch.arange(new.numel()), "amin")
            first = uniq[torch.argsort(first_pos)]  # first-appearance order: a deterministic numbering
            local[first] = torch.arange(nodes.numel(), nodes.numel() + first.numel())
            nodes = torch.cat([nodes, first])
        global_edges.append((src, dst))
        sizes.append(nodes.numel())
    sizes.reverse()
    edges = [torch.stack([local[s], local[d]]) for s, d in reversed(global_edges)]
    return MiniBatch(nodes, sizes, edges, graph.sampled_degree(nodes, fanout))


__all__ = ["InEdges", "MiniBatch", "build_minibatch", "edge_scores", "labelled_nodes", "sampled_graph",
           "seeds_for_step"]
