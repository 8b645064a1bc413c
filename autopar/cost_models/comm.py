"""Communication cost model: collectives and point-to-point transfers, as the library that runs them does.

Units: bytes in, seconds out. A link's bandwidth ``B`` is bytes/s in one direction per device and its
latency ``a`` seconds per message (``autopar.cluster.Link``). ``p`` is the group size, ``m`` its node count.

Two regimes, by the devices of the group:

* **GPUs: NCCL** (``cost_models/nccl.py``): NCCL's tuning model. all_reduce takes the cheaper of ring and
  tree over the protocols LL / LL128 / Simple, as NCCL's tuner does; all_gather, reduce_scatter and
  broadcast run rings. Datasheet link figures are derated to what NCCL achieves on their kind (NVLink,
  PCIe, InfiniBand, TCP Ethernet; ``nccl.LINK_EFFICIENCY``, each with its source); measured links
  (``Link.measured``, from ``autopar probe``) are taken as they are. A ring spanning nodes runs one
  channel per member through its own NIC share (NCCL's multi-NIC rings), so its network bandwidth on a
  node holding c members is ``min(c B_net, NIC_node / concurrent)``.
* **CPUs and edge boards: gloo**, alpha-beta closed forms on the link figures as given:

    ring all_reduce       2(p-1) a + 2 (p-1)/p n/B                  (reduce-scatter + all-gather)
    ring all_gather       (p-1) a + (p-1)/p n/B                     n = full gathered output
    ring reduce_scatter   (p-1) a + (p-1)/p n/B                     n = full input
    ring broadcast        (p-1) a + n/B                             pipelined chain, n = tensor size
    tree all_reduce       2 ceil(log2 p) a + 2 n/B                  double binary tree
    tree broadcast        ceil(log2 p) a + n/B                      pipelined double binary tree
    p2p                   a + n/B                                   over cluster.link(src, dst)

  Flat algorithms run over the ring of the group in the given order, closing back to the first member;
  ``(B, a)`` is that ring's bottleneck (``group_bandwidth``).

all_to_all (n = bytes each rank sends, its own chunk included) is a direct pairwise exchange in both
regimes. A rank on a node holding c of the p members sends (p-c)/p n over its network share and
(c-1)/p n over its node's link; both run at once, while the p-1 messages each pay their link's latency:

    all_to_all            max over nodes of  (p-c) a_net + (c-1) a_node
                                             + max((p-c)/p n/B_net, (c-1)/p n/B_node)

(for NCCL, a is one send's latency and B the achieved bandwidth, ``nccl.p2p_time``).

Hierarchical (group spans more than one node and every node holds more than one member; k members per
node) composes a node-local phase with k concurrent inter-node rings, one per local rank, each member
moving its 1/k shard over its own share of the network:

    all_reduce      = RS_node(n) + all_reduce_net(n/k over m) + AG_node(n)
    all_gather      = all_gather_net(n/k over m) + AG_node(n)
    reduce_scatter  = RS_node(n) + reduce_scatter_net(n/k over m)

With uneven nodes, k is the smallest count. gloo's "auto" may take it; NCCL does not run it (its rings
already use every NIC), so for GPUs it is priced only when asked for.

NIC sharing: node i's NICs carry ``cluster.nic_bandwidth(i)`` in all (a node group's ``nic_GBps``; default
one network share per device). ``concurrent`` says how many groups of this shape run the collective at
the same time (e.g. the data-parallel groups of a tensor-parallel stage, one per tp rank); every stream
that leaves a node gets ``min(B_net, NIC_node / streams on that node)``. Two groups crossing a node's one
NIC get half of it each.

algorithm="auto" takes the fastest applicable algorithm. ``nbytes`` may be a sympy expression: the
formulas only do arithmetic on it, and choices that depend on its value become ``sympy.Min``/``sympy.Max``
(NCCL's size-dependent tree correction and ring plateau are then left out). Assumed: no contention with
other traffic than ``concurrent`` groups, no compute cost for reductions, full-duplex links.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from typing import Any

from ..cluster import Cluster, Link
from ..errors import PlanError, close_matches
from . import nccl as nccl_model

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
# What NCCL's tuner chooses among for GPUs (NCCL 2.8: tree for all_reduce only).
_NCCL_AUTO = {"all_reduce": ("ring", "tree"), "all_gather": ("ring",), "reduce_scatter": ("ring",),
              "broadcast": ("ring",)}

Bytes = Any  # float, or a sympy expression


def collective_time(kind: str, nbytes: Bytes, group: Sequence[int], cluster: Cluster,
                    algorithm: str = "auto", *, concurrent: int = 1) -> Bytes:
    """Seconds one collective takes over ``group`` (global device indices) of ``cluster``.

    ``nbytes`` means, by ``kind``: all_reduce and broadcast, the tensor size on each rank;
    all_gather, the full gathered output; reduce_scatter, the full input; all_to_all, the total
    bytes each rank sends, its own chunk included; p2p (``group == [src, dst]``), the message size.
    ``algorithm`` is "auto" (the fastest applicable; NCCL's choice on GPUs), "ring", "tree" or
    "hierarchical". ``concurrent``: groups of this shape running it at the same time, sharing each node's
    NICs (module docstring). A group of one device costs 0. Returns a float, or a sympy expression when
    ``nbytes`` is one.
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
    _check_concurrent(concurrent)
    if kind == "p2p":
        if len(g) > 2:
            raise PlanError(f"a p2p group is [src, dst], got {len(g)} devices: {list(g)}.")
        return 0.0 if len(g) == 1 else _p2p(n, g[0], g[1], cluster, concurrent, numeric)
    if len(set(g)) != len(g):
        raise PlanError(f"group {list(g)} names a device more than once; "
                        f"a {kind} group holds distinct devices.")
    p = len(g)
    if p == 1:
        return 0.0
    nodes = _per_node(g, cluster)
    nccl = _is_nccl(g, cluster)
    if kind == "all_to_all":
        return _all_to_all(n, p, nodes, g, cluster, concurrent, nccl, numeric)

    hier_ok = len(nodes) > 1 and all(c > 1 for _, _, c in nodes)
    if algorithm == "hierarchical" and not hier_ok:
        counts = [c for _, _, c in nodes]
        raise PlanError(f"hierarchical {kind} needs a group spanning more than one node with more than one "
                        f"member on each; group {list(g)} has {counts} member(s) on {len(nodes)} node(s). "
                        f"Use 'ring', 'auto' or another algorithm.")
    if algorithm != "auto":
        algs: tuple[str, ...] = (algorithm,)
    elif nccl:
        algs = _NCCL_AUTO[kind]
    else:
        algs = tuple(a for a in _APPLICABLE[kind] if a != "hierarchical" or hier_ok)
    times = []
    for alg in algs:
        if alg == "hierarchical":
            times.append(_hierarchical(kind, n, nodes, g, cluster, concurrent, nccl, numeric))
        elif nccl:
            times.append(_nccl_flat(alg, kind, n, g, nodes, cluster, concurrent, numeric))
        else:
            bw, lat = _ring_link(g, cluster, concurrent)
            times.append(_ring(kind, n, p, bw, lat) if alg == "ring" else _tree(kind, n, p, bw, lat))
    return _min(times, numeric)


def p2p_time(nbytes: Bytes, src: int, dst: int, cluster: Cluster, *, concurrent: int = 1) -> Bytes:
    """Seconds to send ``nbytes`` from device ``src`` to ``dst``: gloo, latency + nbytes / bandwidth;
    GPUs, one NCCL send (``nccl.p2p_time``). ``concurrent`` transfers leave the node's NICs at once."""
    n, numeric = _check_bytes(nbytes)
    s, d = _check_group([src, dst], cluster)
    _check_concurrent(concurrent)
    return _p2p(n, s, d, cluster, concurrent, numeric)


def group_bandwidth(group: Sequence[int], cluster: Cluster) -> tuple[float, float]:
    """(bottleneck bandwidth in bytes/s, max latency in s) of the ring over ``group`` in index order, on the
    cluster's link figures as given (datasheet or measured; no NIC sharing, no NCCL derating).

    The ring closes from the last member back to the first. A single device has no links:
    (inf, 0.0).
    """
    return _ring_link(_check_group(group, cluster), cluster, 0)


def achieved_busbw(kind: str, nbytes: float, group: Sequence[int], cluster: Cluster,
                   algorithm: str = "auto", *, concurrent: int = 1) -> float:
    """The bus bandwidth (bytes/s, nccl-tests' definition) the model predicts for a collective: the
    figure to set beside `all_reduce_perf`'s busbw column."""
    t = float(collective_time(kind, nbytes, group, cluster, algorithm, concurrent=concurrent))
    return nccl_model.busbw_of(kind, float(nbytes), len(group), t)


# ---- gloo formulas ---------------------------------------------------------------------------


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


# ---- NCCL -------------------------------------------------------------------------------------


def _nccl_flat(alg: str, kind: str, n: Bytes, g: tuple[int, ...], nodes: list[tuple[int, Link, int]],
               cluster: Cluster, concurrent: int, numeric: bool) -> Bytes:
    """NCCL's ring or tree over the whole group, the cheapest protocol."""
    intra, inter = _nccl_paths(g, nodes, cluster, concurrent)
    fn = nccl_model.ring_time if alg == "ring" else nccl_model.tree_time
    options = fn(kind, n, len(g), len(nodes), intra, inter, numeric)
    return _min([t for t, _ in options], numeric)


def _nccl_paths(g: tuple[int, ...], nodes: list[tuple[int, Link, int]], cluster: Cluster, concurrent: int
                ) -> tuple[nccl_model.Path, nccl_model.Path | None]:
    """(intra-node path, network path or None) of a group's ring. A ring crossing nodes runs a channel per
    member through its NIC share: min over nodes of min(c B_net, NIC / concurrent)."""
    ring = list(zip(g, g[1:] + g[:1], strict=True))
    crossing = [cluster.link(a, b) for a, b in ring if not cluster.same_node(a, b)]
    inside = [cluster.link(a, b) for a, b in ring if cluster.same_node(a, b)]
    inter = None
    if crossing:
        slow = _bottleneck(crossing)
        share = min(min(c * slow.bandwidth, cluster.nic_bandwidth(node) / concurrent) for node, _, c in nodes)
        inter = nccl_model.path(slow, network=True, bandwidth=share)
    intra = nccl_model.path(_bottleneck(inside), network=False) if inside else inter
    assert intra is not None
    return intra, inter


def _bottleneck(links: list[Link]) -> Link:
    """The slowest link's kind and flags, the smallest bandwidth and the largest latency of `links`."""
    slow = min(links, key=lambda x: x.bandwidth)
    return Link(slow.bandwidth, max(x.latency for x in links), slow.kind, all(x.measured for x in links))


# ---- both regimes -----------------------------------------------------------------------------


def _hierarchical(kind: str, n: Bytes, nodes: list[tuple[int, Link, int]], g: tuple[int, ...],
                  cluster: Cluster, concurrent: int, nccl: bool, numeric: bool) -> Bytes:
    m = len(nodes)
    k = min(c for _, _, c in nodes)  # uneven nodes: the smallest node holds the largest shards
    net = _bottleneck([cluster.link(a, b) for a, b in zip(g, g[1:] + g[:1], strict=True)
                       if not cluster.same_node(a, b)])
    # k concurrent inter-node rings (one per local rank), each stream on its NIC share
    share = min(min(net.bandwidth, cluster.nic_bandwidth(node) / (concurrent * k)) for node, _, _ in nodes)
    shard = n / k
    if nccl:
        # Intra-node reduce-scatter and all-gather of the full n cost the same; the slowest node sets the pace.
        node_phase = _max([_min([t for t, _ in nccl_model.ring_time(
            "all_gather", n, c, 1, nccl_model.path(link, network=False), None, numeric)], numeric)
            for _, link, c in nodes], numeric)
        path = nccl_model.path(net, network=True, bandwidth=share)
        net_kind = "all_reduce" if kind == "all_reduce" else kind
        net_phase = _min([t for t, _ in nccl_model.ring_time(net_kind, shard, m, m, path, path, numeric)],
                         numeric)
    else:
        node_phase = _max([_ring("all_gather", n, c, link.bandwidth, link.latency) for _, link, c in nodes],
                          numeric)
        net_phase = _ring(kind, shard, m, share, net.latency)
    return (2 if kind == "all_reduce" else 1) * node_phase + net_phase


def _all_to_all(n: Bytes, p: int, nodes: list[tuple[int, Link, int]], g: tuple[int, ...], cluster: Cluster,
                concurrent: int, nccl: bool, numeric: bool) -> Bytes:
    net = cluster.network
    if cluster.pair_links:  # measured node pairs: the slowest pair the exchange crosses
        net_links = [cluster.link(a, b) for a in g for b in g if not cluster.same_node(a, b)]
        net = _bottleneck(net_links) if net_links else net
    per_node = []
    for node, link, c in nodes:
        # every member of the node sends its network part at once: c streams per group on the node's NICs
        share = min(net.bandwidth, cluster.nic_bandwidth(node) / (concurrent * c))
        if nccl:
            options = []
            for proto in ("LL", "Simple"):
                a_net, b_net = _nccl_send(net, True, share, proto)
                a_node, b_node = _nccl_send(link, False, link.bandwidth, proto)
                options.append((a_net, b_net, a_node, b_node))
        else:
            options = [(net.latency, share, link.latency, link.bandwidth)]
        times = []
        for a_net, b_net, a_node, b_node in options:
            latency = (p - c) * a_net + (c - 1) * a_node
            # Both parts are proportional to n >= 0, so their max is n times the larger coefficient.
            seconds_per_byte = max((p - c) / (p * b_net), (c - 1) / (p * b_node))
            times.append(latency + seconds_per_byte * n)
        per_node.append(_min(times, numeric))
    return _max(per_node, numeric)


def _nccl_send(link: Link, network: bool, bandwidth: float, proto: str) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of one NCCL send over a link with `proto` (nccl.p2p_time's terms)."""
    path = nccl_model.path(link, network=network, bandwidth=bandwidth)
    if path.measured:
        return path.extra_latency, path.busbw
    lat = nccl_model.BASE_LAT_US["ring"][proto] * 1e-6 + path.step_latency("ring", proto)
    return lat, path.busbw / (3.0 if proto == "LL" else 1.0)


def _p2p(n: Bytes, src: int, dst: int, cluster: Cluster, concurrent: int, numeric: bool) -> Bytes:
    if src == dst:
        return 0.0
    link = cluster.link(src, dst)
    network = not cluster.same_node(src, dst)
    bw = min(link.bandwidth, cluster.nic_bandwidth(cluster.devices[src].node) / concurrent,
             cluster.nic_bandwidth(cluster.devices[dst].node) / concurrent) if network else link.bandwidth
    if not _is_nccl((src, dst), cluster):
        return link.latency + n / bw
    path = nccl_model.path(link, network=network, bandwidth=bw)
    return _min([t for t, _ in nccl_model.p2p_time(n, path)], numeric)


# ---- helpers ------------------------------------------------------------------------------


def _ring_link(g: tuple[int, ...], cluster: Cluster, concurrent: int) -> tuple[float, float]:
    """(bottleneck bandwidth, max latency) over the ring's edges; with `concurrent` > 0, an edge that leaves
    a node gets at most that node's NIC bandwidth / concurrent (one gloo ring stream per node per group)."""
    bw, lat = math.inf, 0.0
    if len(g) < 2:
        return bw, lat
    for i, j in zip(g, g[1:] + g[:1], strict=True):
        link = cluster.link(i, j)
        b = link.bandwidth
        if concurrent and not cluster.same_node(i, j):
            b = min(b, cluster.nic_bandwidth(cluster.devices[i].node) / concurrent)
        bw = min(bw, b)
        lat = max(lat, link.latency)
    return bw, lat


def _per_node(g: tuple[int, ...], cluster: Cluster) -> list[tuple[int, Link, int]]:
    """(node index, its intra-node link, members of g on it) per node, in order of first appearance."""
    counts: dict[int, int] = {}
    for i in g:
        node = cluster.devices[i].node
        counts[node] = counts.get(node, 0) + 1
    return [(node, cluster.link(cluster.nodes[node].devices[0], cluster.nodes[node].devices[-1]), c)
            for node, c in counts.items()]


def _is_nccl(g: Sequence[int], cluster: Cluster) -> bool:
    """Whether the group communicates through NCCL: every member is a GPU (CPUs and edge boards: gloo)."""
    return all(cluster.devices[i].spec.kind == "gpu" for i in g)


def _check_concurrent(concurrent: Any) -> None:
    if isinstance(concurrent, bool) or not isinstance(concurrent, int) or concurrent < 1:
        raise PlanError(f"concurrent must be a positive integer (the groups running this collective at once), "
                        f"got {concurrent!r}.")


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


__all__ = ["ALGORITHMS", "KINDS", "achieved_busbw", "collective_time", "group_bandwidth", "p2p_time"]
