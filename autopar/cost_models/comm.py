"""Communication cost model: alpha-beta closed forms for collectives and point-to-point transfers.

Units: bytes in, seconds out. A link's bandwidth ``B`` is bytes/s in one direction per device and
its latency ``a`` (alpha) is seconds per message (``autopar.cluster.Link``). ``p`` is the group size.

Flat algorithms run over the ring of the group in the given order, closing back to the first
member; ``(B, a)`` is that ring's bottleneck: the smallest bandwidth and the largest latency over
its consecutive pairs (``group_bandwidth``). Within one node that is the node's link; across
nodes it is usually the network, unless an intra-node link on the ring is slower.

    ring all_reduce       2(p-1) a + 2 (p-1)/p n/B                  (reduce-scatter + all-gather)
    ring all_gather       (p-1) a + (p-1)/p n/B                     n = full gathered output
    ring reduce_scatter   (p-1) a + (p-1)/p n/B                     n = full input
    ring broadcast        (p-1) a + n/B                             pipelined chain, n = tensor size
    tree all_reduce       2 ceil(log2 p) a + 2 n/B                  NCCL double binary tree
    tree broadcast        ceil(log2 p) a + n/B                      pipelined double binary tree
    p2p                   a + n/B                                   over cluster.link(src, dst)

all_to_all (n = bytes each rank sends, its own chunk included) is a direct pairwise exchange. A
rank on a node holding c of the p members sends (p-c)/p n over its network share and (c-1)/p n
over its node's link; both run at once, while the p-1 messages each pay their link's latency:

    all_to_all            max over nodes of  (p-c) a_net + (c-1) a_node
                                             + max((p-c)/p n/B_net, (c-1)/p n/B_node)

which is (p-1) a + (p-1)/p n/B inside one node.

Hierarchical (group spans more than one node and every node holds more than one member; m nodes,
k members per node) composes a node-local phase with k concurrent inter-node rings, one per local
rank, each member moving its 1/k shard over its own share of the network:

    all_reduce      = RS_node(n) + ring_all_reduce_net(n/k over m) + AG_node(n)
    all_gather      = ring_all_gather_net(n/k over m) + AG_node(n)
    reduce_scatter  = RS_node(n) + ring_reduce_scatter_net(n/k over m)

where RS_node/AG_node are the ring forms above over each node's link and the node phases take
the slowest node. With uneven nodes, k is the smallest count: the shards of the smallest node are
the largest, so its network ring is the one that finishes last.

algorithm="auto" takes the fastest applicable algorithm. ``nbytes`` may be a sympy expression:
the formulas only do arithmetic on it, and choices that depend on its value (auto, slowest node)
become ``sympy.Min``/``sympy.Max``. Assumed: no contention with other traffic, no compute cost
for reductions, full-duplex links, and the network figure is already the per-device NIC share.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from typing import Any

from ..cluster import Cluster, Link
from ..errors import PlanError, close_matches

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")
ALGORITHMS = ("auto", "ring", "tree", "hierarchical")
# all_to_all and p2p have a single model (direct exchange), so they only take "auto".
_APPLICABLE: dict[str, tuple[str, ...]] = {
    "all_reduce": ("ring", "tree", "hierarchical"),
    "all_gather": ("ring", "hierarchical"),
    "reduce_scatter": ("ring", "hierarchical"),
    "broadcast": ("ring", "tree"),
    "all_to_all": (),
    "p2p": (),
}

Bytes = Any  # float, or a sympy expression


def collective_time(kind: str, nbytes: Bytes, group: Sequence[int], cluster: Cluster,
                    algorithm: str = "auto") -> Bytes:
    """Seconds one collective takes over ``group`` (global device indices) of ``cluster``.

    ``nbytes`` means, by ``kind``: all_reduce and broadcast, the tensor size on each rank;
    all_gather, the full gathered output; reduce_scatter, the full input; all_to_all, the total
    bytes each rank sends, its own chunk included; p2p (``group == [src, dst]``), the message size.
    ``algorithm`` is "auto" (the fastest applicable), "ring", "tree" or "hierarchical". A group of
    one device costs 0. Returns a float, or a sympy expression when ``nbytes`` is one.
    """
    if kind not in KINDS:
        raise PlanError(f"unknown collective kind {kind!r}.{close_matches(str(kind), KINDS)} "
                        f"Valid kinds: {', '.join(KINDS)}.")
    if algorithm not in ALGORITHMS:
        hint = close_matches(str(algorithm), ALGORITHMS)
        raise PlanError(f"unknown communication algorithm {algorithm!r}.{hint} "
                        f"Valid algorithms: {', '.join(ALGORITHMS)}.")
    if algorithm != "auto" and algorithm not in _APPLICABLE[kind]:
        valid = ", ".join(repr(a) for a in ("auto", *_APPLICABLE[kind]))
        raise PlanError(f"algorithm {algorithm!r} does not apply to {kind}; use one of {valid}.")
    n, numeric = _check_bytes(nbytes)
    g = _check_group(group, cluster)
    if kind == "p2p":
        if len(g) > 2:
            raise PlanError(f"a p2p group is [src, dst], got {len(g)} devices: {list(g)}.")
        return 0.0 if len(g) == 1 else _p2p(n, g[0], g[1], cluster)
    if len(set(g)) != len(g):
        raise PlanError(f"group {list(g)} names a device more than once; "
                        f"a {kind} group holds distinct devices.")
    p = len(g)
    if p == 1:
        return 0.0
    nodes = _per_node(g, cluster)
    if kind == "all_to_all":
        return _all_to_all(n, p, nodes, cluster.network, numeric)

    hier_ok = len(nodes) > 1 and all(c > 1 for _, c in nodes)
    if algorithm == "hierarchical" and not hier_ok:
        counts = [c for _, c in nodes]
        raise PlanError(f"hierarchical {kind} needs a group spanning more than one node with more than one "
                        f"member on each; group {list(g)} has {counts} member(s) on {len(nodes)} node(s). "
                        f"Use 'ring', 'auto' or another algorithm.")
    if algorithm == "auto":
        algs = [a for a in _APPLICABLE[kind] if a != "hierarchical" or hier_ok]
    else:
        algs = [algorithm]
    bw, lat = _ring_link(g, cluster)
    times = []
    for alg in algs:
        if alg == "hierarchical":
            times.append(_hierarchical(kind, n, nodes, cluster.network, numeric))
        elif alg == "ring":
            times.append(_ring(kind, n, p, bw, lat))
        else:
            times.append(_tree(kind, n, p, bw, lat))
    return _min(times, numeric)


def p2p_time(nbytes: Bytes, src: int, dst: int, cluster: Cluster) -> Bytes:
    """Seconds to send ``nbytes`` from device ``src`` to ``dst``: latency + nbytes / bandwidth."""
    n, _ = _check_bytes(nbytes)
    s, d = _check_group([src, dst], cluster)
    return _p2p(n, s, d, cluster)


def group_bandwidth(group: Sequence[int], cluster: Cluster) -> tuple[float, float]:
    """(bottleneck bandwidth in bytes/s, max latency in s) of the ring over ``group`` in index order.

    The ring closes from the last member back to the first. A single device has no links:
    (inf, 0.0).
    """
    return _ring_link(_check_group(group, cluster), cluster)


# ---- formulas -----------------------------------------------------------------------------


def _ring(kind: str, n: Bytes, p: int, bw: float, lat: float) -> Bytes:
    if kind == "all_reduce":
        return 2 * (p - 1) * lat + 2 * (p - 1) / p * n / bw
    if kind == "broadcast":
        return (p - 1) * lat + n / bw
    return (p - 1) * lat + (p - 1) / p * n / bw  # all_gather, reduce_scatter


def _tree(kind: str, n: Bytes, p: int, bw: float, lat: float) -> Bytes:
    depth = (p - 1).bit_length()  # ceil(log2 p), exact for ints
    if kind == "all_reduce":
        return 2 * depth * lat + 2 * n / bw
    return depth * lat + n / bw  # broadcast


def _hierarchical(kind: str, n: Bytes, nodes: list[tuple[Link, int]], net: Link, numeric: bool) -> Bytes:
    m = len(nodes)
    k = min(c for _, c in nodes)  # uneven nodes: the smallest node holds the largest shards
    # Intra-node reduce-scatter and all-gather of the full n cost the same; the slowest node sets the pace.
    node_phase = _max([_ring("all_gather", n, c, link.bandwidth, link.latency) for link, c in nodes], numeric)
    shard = n / k
    if kind == "all_reduce":
        return 2 * node_phase + _ring("all_reduce", shard, m, net.bandwidth, net.latency)
    return node_phase + _ring(kind, shard, m, net.bandwidth, net.latency)


def _all_to_all(n: Bytes, p: int, nodes: list[tuple[Link, int]], net: Link, numeric: bool) -> Bytes:
    per_node = []
    for link, c in nodes:
        latency = (p - c) * net.latency + (c - 1) * link.latency
        # Both parts are proportional to n >= 0, so their max is n times the larger coefficient.
        seconds_per_byte = max((p - c) / (p * net.bandwidth), (c - 1) / (p * link.bandwidth))
        per_node.append(latency + seconds_per_byte * n)
    return _max(per_node, numeric)


def _p2p(n: Bytes, src: int, dst: int, cluster: Cluster) -> Bytes:
    if src == dst:
        return 0.0
    link = cluster.link(src, dst)
    return link.latency + n / link.bandwidth


# ---- helpers ------------------------------------------------------------------------------


def _ring_link(g: tuple[int, ...], cluster: Cluster) -> tuple[float, float]:
    bw, lat = math.inf, 0.0
    if len(g) < 2:
        return bw, lat
    for i, j in zip(g, g[1:] + g[:1], strict=True):
        link = cluster.link(i, j)
        bw = min(bw, link.bandwidth)
        lat = max(lat, link.latency)
    return bw, lat


def _per_node(g: tuple[int, ...], cluster: Cluster) -> list[tuple[Link, int]]:
    counts: dict[int, int] = {}
    for i in g:
        node = cluster.devices[i].node
        counts[node] = counts.get(node, 0) + 1
    return [(cluster.nodes[node].intra_node, c) for node, c in counts.items()]


def _min(xs: list[Bytes], numeric: bool) -> Bytes:
    if len(xs) == 1:
        return xs[0]
    if numeric:
        return min(xs)
    import sympy

    return sympy.Min(*xs)


def _max(xs: list[Bytes], numeric: bool) -> Bytes:
    if len(xs) == 1:
        return xs[0]
    if numeric:
        return max(xs)
    import sympy

    return sympy.Max(*xs)


def _check_bytes(nbytes: Any) -> tuple[Bytes, bool]:
    """(nbytes as float or sympy expression, whether it is a number)."""
    if isinstance(nbytes, bool):
        raise PlanError(f"nbytes must be a number of bytes, got {nbytes!r}.")
    if isinstance(nbytes, numbers.Real) or getattr(nbytes, "is_number", False):
        x = float(nbytes)
        if not math.isfinite(x) or x < 0:
            raise PlanError(f"nbytes must be a finite, non-negative number of bytes, got {nbytes!r}.")
        return x, True
    if hasattr(nbytes, "free_symbols"):  # a sympy expression
        if nbytes.is_negative:
            raise PlanError(f"nbytes must be non-negative, got {nbytes!r}.")
        return nbytes, False
    raise PlanError(f"nbytes must be a number of bytes or a sympy expression, got {type(nbytes).__name__}.")


def _check_group(group: Sequence[int], cluster: Cluster) -> tuple[int, ...]:
    try:
        g = tuple(operator.index(i) for i in group)
    except TypeError:
        raise PlanError(f"a group is a list of integer device indices, got {group!r}.") from None
    if not g:
        raise PlanError("the communication group is empty; give at least one device index.")
    bad = [i for i in g if not 0 <= i < cluster.world_size]
    if bad:
        raise PlanError(f"device index(es) {bad} out of range: cluster {cluster.name!r} has devices "
                        f"0..{cluster.world_size - 1}.")
    return g


__all__ = ["ALGORITHMS", "KINDS", "collective_time", "group_bandwidth", "p2p_time"]
