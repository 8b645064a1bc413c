"""Graph partitioning across ranks: node shares and each rank's local subgraph (the halo exchange: exchange.py).

Nodes are put in a locality order (`data.locality_order`) and rank r owns the contiguous range
[bounds[r], bounds[r + 1]) of it. Its local graph holds every in-edge of its owned nodes; the sources it does
not own are its halo. Local rows are [owned (in order); halo (in order)]; since ranges are contiguous and in
rank order, the halo sorted by position is grouped by owner, which is the layout all_to_all_single
delivers. Every rank derives all of this from the full edge_index, so no index lists are exchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InfeasibleError, PlanError
from .data import in_degree, locality_order


def proportional_shares(total: int, weights: list[float], caps: list[float] | None = None) -> list[int]:
    """Integer shares summing to `total`, proportional to `weights` (largest remainders), each at most its
    cap; what a capped rank cannot take is spread over the others in proportion to their weights."""
    n = len(weights)
    caps = [float(total)] * n if caps is None else [float(max(0, min(int(c), total))) for c in caps]
    if sum(caps) < total:
        raise InfeasibleError(f"{total} nodes do not fit: the devices hold at most {[int(c) for c in caps]} "
                              f"(memory-capped); use devices with more memory or sampled mini-batches.")
    weights = [max(0.0, w) for w in weights] if sum(weights) > 0 else [1.0] * n
    shares, free, left = [0.0] * n, [i for i in range(n) if caps[i] > 0], float(total)
    while left > 1e-9 and free:
        wsum = sum(weights[i] for i in free)
        add = {i: left * (weights[i] / wsum if wsum > 0 else 1.0 / len(free)) for i in free}
        over = [i for i in free if shares[i] + add[i] > caps[i]]
        if not over:
            for i in free:
                shares[i] += add[i]
            break
        for i in over:
            left -= caps[i] - shares[i]
            shares[i] = caps[i]
        free = [i for i in free if i not in over]
    ints = [int(s) for s in shares]
    for i in sorted(range(n), key=lambda i: shares[i] - ints[i], reverse=True):
        if sum(ints) == total:
            break
        if ints[i] < caps[i]:
            ints[i] += 1
    return ints


def balanced_shares(total: int, fixed: list[float], marginal: list[float],
                    caps: list[float] | None = None) -> list[int]:
    """Integer shares minimising max_r(fixed_r + share_r marginal_r) (affine per-rank time: a fixed part paid
    whatever the share, e.g. kernel launches, plus seconds per item), each at most its cap."""
    n = len(fixed)
    active = list(range(n))
    while True:
        inv = sum(1.0 / max(marginal[i], 1e-30) for i in active)
        level = (total + sum(fixed[i] / max(marginal[i], 1e-30) for i in active)) / inv
        ideal = [max(0.0, (level - fixed[i]) / max(marginal[i], 1e-30)) if i in active else 0.0 for i in range(n)]
        drop = [i for i in active if level <= fixed[i]]
        if not drop or len(drop) == len(active):
            break
        active = [i for i in active if i not in drop]
    if sum(ideal) <= 0:
        ideal = [1.0] * n
    return proportional_shares(total, ideal, caps)


@dataclass
class Partition:
    """Rank `rank`'s view of a partitioned graph."""

    owned: torch.Tensor  # global ids of owned nodes, in local row order
    halo: torch.Tensor  # global ids of halo nodes, in local row order (after the owned rows)
    edges: torch.Tensor  # (2, E_r) local edge_index: every in-edge of an owned node
    degree: torch.Tensor  # global in-degree (self-loops excluded) of every local row
    send_index: torch.Tensor  # local rows of owned nodes to send, grouped by destination rank
    send_counts: list[int]
    recv_counts: list[int]
    halo_sizes: list[int]  # halo size of every rank (for reports and the cost model)
    edge_counts: list[int]  # local edges of every rank

    @property
    def rows(self) -> int:
        return self.owned.numel() + self.halo.numel()


def partition_graph(edge_index: torch.Tensor, num_nodes: int, shares: list[int], rank: int,
                    order: torch.Tensor | None = None) -> Partition:
    """Split the graph by contiguous ranges of `order` (default: `locality_order`) of sizes `shares`."""
    if sum(shares) != num_nodes or min(shares) < 0:
        raise PlanError(f"node shares {shares} must be non-negative and sum to the graph's {num_nodes} nodes; "
                        f"plan again for this graph.")
    order = locality_order(edge_index, num_nodes) if order is None else order
    position = torch.empty(num_nodes, dtype=torch.long)
    position[order] = torch.arange(num_nodes)
    bounds = [0]
    for s in shares:
        bounds.append(bounds[-1] + s)
    src_pos, dst_pos = position[edge_index[0]], position[edge_index[1]]
    owner = torch.bucketize(dst_pos, torch.tensor(bounds[1:-1]), right=True)
    halos = []
    for q in range(len(shares)):
        mine = owner == q
        s = torch.unique(src_pos[mine])  # sorted
        halos.append(s[(s < bounds[q]) | (s >= bounds[q + 1])])
    lo, hi = bounds[rank], bounds[rank + 1]
    mine = owner == rank
    halo_pos = halos[rank]
    local_of = torch.full((num_nodes,), -1, dtype=torch.long)
    local_of[lo:hi] = torch.arange(hi - lo)
    local_of[halo_pos] = torch.arange(hi - lo, hi - lo + halo_pos.numel())
    edges = torch.stack([local_of[src_pos[mine]], local_of[dst_pos[mine]]])
    send, send_counts, recv_counts = [], [], []
    for q in range(len(shares)):
        h = halos[q]
        from_me = h[(h >= lo) & (h < hi)] if q != rank else h[:0]
        send.append(from_me - lo)
        send_counts.append(from_me.numel())
        recv_counts.append(int(((halo_pos >= bounds[q]) & (halo_pos < bounds[q + 1])).sum()) if q != rank else 0)
    owned, halo = order[lo:hi], order[halo_pos]
    degree = in_degree(edge_index, num_nodes, exclude_self_loops=True)[torch.cat([owned, halo])]
    return Partition(owned, halo, edges, degree, torch.cat(send), send_counts, recv_counts,
                     [h.numel() for h in halos], torch.bincount(owner, minlength=len(shares)).tolist())


__all__ = ["Partition", "balanced_shares", "partition_graph", "proportional_shares"]
