"""Node orders that partitions are cut from, and how good a partition is.

A partition of the graph over ranks is contiguous ranges of a node order (partition.py): rank r owns the
`shares[r]` nodes after the first `sum(shares[:r])` of the order. Three partitioners give that order:

* `locality`: `data.locality_order`, a BFS (Cuthill-McKee-like) order; contiguous ranges have few boundary
  nodes on meshes and chains, many on clustered or random graphs;
* `metis`: METIS (`pymetis`) partitioning of the undirected simple graph (edges symmetrised, duplicates and
  self-loops dropped; recursive bisection up to 8 parts, k-way above, as pymetis chooses) minimising the edge
  cut: every node weighs its compute (a + b x in-degree, from the cost model's seconds per row and per
  in-edge), each part's target fraction of the total is the rank's planned share (from its speed, capped by
  its memory: `balanced_shares`); a part whose memory (bytes per row and per in-edge) overflows its rank gets a
  smaller target and METIS runs again (graphs/cost.py, `GraphCostModel._metis`). The order lists part 0's
  nodes, then part 1's (each by id), and the shares are the parts' sizes;
* `random`: a seeded random permutation (the baseline every partitioner should beat).

`partition_quality` reports, for an order cut by shares, the edge cut as METIS counts it (undirected simple
edges whose ends lie on different ranks), the directed edges that cross ranks, and the halo of every rank
(distinct remote sources of its owned nodes' in-edges: the rows it receives before every message-passing layer)
with their sum, the halo volume. Every rank computes the same order from the same inputs (METIS is
deterministic for a given seed), so nothing but the plan is exchanged.

Why memory is not a second METIS constraint: pymetis (2025.2) passes ncon = 1 to METIS whatever the weights
(inducer/pymetis issue #45; multi-constraint support is an open pull request, #62), so the memory balance is
kept by re-targeting instead.
"""

from __future__ import annotations

import torch

from ..errors import PlanError
from .data import in_degree, locality_order

PARTITIONERS = ("locality", "metis", "random")
METIS_UFACTOR = 30  # allowed imbalance per constraint: 1 + ufactor / 1000
WEIGHT_SCALE = 100  # integer METIS weight of a node with no in-edge


def symmetric_csr(edge_index: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(xadj, adjncy) of the undirected simple graph of `edge_index` (both directions of every pair, no
    self-loops, no duplicates; neighbours sorted by id): METIS's input."""
    src, dst = edge_index[0].long(), edge_index[1].long()
    keep = src != dst
    src, dst = src[keep], dst[keep]
    a, b = torch.cat([src, dst]), torch.cat([dst, src])
    key = torch.unique(a * num_nodes + b)  # sorted: by a, then b
    a, b = key // num_nodes, key % num_nodes
    xadj = torch.zeros(num_nodes + 1, dtype=torch.long)
    xadj[1:] = torch.cumsum(torch.bincount(a, minlength=num_nodes), 0)
    return xadj, b


def node_weights(edge_index: torch.Tensor, num_nodes: int, coeffs: list[float]) -> torch.Tensor:
    """(N,) int64 METIS weights: node v weighs max(1, round(a + b x in-degree(v))) for coeffs = [a, b]."""
    a, b = coeffs
    deg = in_degree(edge_index, num_nodes, exclude_self_loops=True).double()
    return (a + b * deg).round().clamp(min=1).long()


def metis_parts(edge_index: torch.Tensor, num_nodes: int, targets: list[float],
                weights: torch.Tensor | None = None, seed: int = 0,
                ufactor: int = METIS_UFACTOR) -> tuple[torch.Tensor, int]:
    """(part of every node, METIS's edge cut): `pymetis.part_graph` on the undirected simple graph into
    len(targets) parts, part p aiming at fraction targets[p] of the node weights (`weights`: (N,) int64, None =
    one per node), with METIS seed `seed` and imbalance `ufactor`. Parts with a zero target get no node (METIS
    runs on the others)."""
    try:
        import pymetis
    except ImportError as e:
        raise PlanError("the METIS partitioner needs pymetis: pip install pymetis (an autopar dependency).") from e
    if len(targets) < 1 or min(targets) < 0 or sum(targets) <= 0:
        raise PlanError(f"METIS part targets must be non-negative with a positive sum, got {targets}.")
    active = [p for p, t in enumerate(targets) if t > 0]
    part = torch.zeros(num_nodes, dtype=torch.long)
    if len(active) == 1:
        part[:] = active[0]
        return part, 0
    total = sum(targets[p] for p in active)
    tp = [targets[p] / total for p in active]
    tp[-1] = 1.0 - sum(tp[:-1])  # pymetis checks the sum
    xadj, adjncy = symmetric_csr(edge_index, num_nodes)
    opts = pymetis.Options()
    opts.seed = seed
    opts.ufactor = ufactor
    cut, parts = pymetis.part_graph(len(active), pymetis.CSRAdjacency(xadj.tolist(), adjncy.tolist()),
                                    vweights=None if weights is None else weights.tolist(), tpwgts=tp, options=opts)
    part[:] = torch.tensor(active, dtype=torch.long)[torch.tensor(list(parts), dtype=torch.long)]
    return part, int(cut)


def order_of_parts(part: torch.Tensor, nparts: int) -> tuple[torch.Tensor, list[int]]:
    """(order, shares): the nodes of part 0 by id, then part 1's, ...; shares = the parts' sizes."""
    return torch.argsort(part, stable=True), torch.bincount(part, minlength=nparts).tolist()


def random_order(num_nodes: int, seed: int = 0) -> torch.Tensor:
    return torch.randperm(num_nodes, generator=torch.Generator().manual_seed(seed))


def partition_order(edge_index: torch.Tensor, num_nodes: int, graph: dict) -> torch.Tensor:
    """The node order a plan's partition cuts into `graph["shares"]`: `graph["partitioner"]` (default
    locality) recomputed from the plan's recorded inputs, the same on every rank and in the planner."""
    name = graph.get("partitioner", "locality")
    if name == "locality":
        return locality_order(edge_index, num_nodes)
    if name == "random":
        return random_order(num_nodes, int(graph.get("partition_seed", 0)))
    if name == "metis":
        m = graph.get("metis") or {}
        if "targets" not in m:
            raise PlanError("the plan's graph section names the METIS partitioner without its inputs "
                            "(graph['metis']['targets']); plan again.")
        weights = node_weights(edge_index, num_nodes, m["weights"]) if m.get("weights") else None
        part, _ = metis_parts(edge_index, num_nodes, m["targets"], weights, int(m.get("seed", 0)),
                              int(m.get("ufactor", METIS_UFACTOR)))
        return order_of_parts(part, len(m["targets"]))[0]
    raise PlanError(f"unknown graph partitioner {name!r}; partitioners are {PARTITIONERS}.")


def owners(order: torch.Tensor, shares: list[int]) -> torch.Tensor:
    """(N,) int64 rank owning each node when `order` is cut into `shares`."""
    owner = torch.empty(order.numel(), dtype=torch.long)
    owner[order] = torch.repeat_interleave(torch.arange(len(shares)), torch.tensor(shares, dtype=torch.long))
    return owner


def partition_quality(edge_index: torch.Tensor, num_nodes: int, order: torch.Tensor, shares: list[int], *,
                      cut: bool = True) -> dict:
    """How `order` cut into `shares` splits the graph: `edge_cut` (METIS's count: undirected simple edges across
    ranks; left out with cut=False), `cut_edges` (directed edges across ranks), per rank its `halo` (distinct
    remote sources of its nodes' in-edges: rows it receives before every message-passing layer), `send` (its
    nodes that are other ranks' halo, counted once per receiving rank: rows it sends) and `edges` (in-edges of
    its nodes), and `halo_volume` = sum of the halos."""
    if sum(shares) != num_nodes or min(shares) < 0:
        raise PlanError(f"shares {shares} must be non-negative and sum to the graph's {num_nodes} nodes.")
    owner = owners(order, shares)
    src, dst = edge_index[0].long(), edge_index[1].long()
    world = len(shares)
    crossing = owner[src] != owner[dst]
    pairs = torch.unique(src[crossing] * world + owner[dst[crossing]])  # (halo node, receiving rank)
    halo = torch.bincount(pairs % world, minlength=world).tolist()
    send = torch.bincount(owner[pairs // world], minlength=world).tolist()
    out = {"cut_edges": int(crossing.sum()), "halo": halo, "halo_volume": sum(halo), "send": send,
           "edges": torch.bincount(owner[dst], minlength=world).tolist()}
    if cut:
        xadj, adjncy = symmetric_csr(edge_index, num_nodes)
        a = torch.repeat_interleave(torch.arange(num_nodes), xadj[1:] - xadj[:-1])
        out["edge_cut"] = int((owner[a] != owner[adjncy]).sum()) // 2
    return out


__all__ = ["METIS_UFACTOR", "PARTITIONERS", "metis_parts", "node_weights", "order_of_parts", "owners",
           "partition_order", "partition_quality", "random_order", "symmetric_csr"]
