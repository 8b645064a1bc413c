"""Communication cost model, gloo regime: hand-computed alpha-beta cases on small clusters.

The clusters are gloo stand-ins (devices of kind "cpu" carrying the catalog's GPU link figures: gloo
prices the link figures as given); the NCCL regime of GPU groups is tested in tests/test_comm_nccl.py.
Catalog figures used below: A100 NVLink3 300 GB/s, 2 us; V100 NVLink2 150 GB/s, 2 us;
default network 25 GB/s, 5 us per device.
"""

from __future__ import annotations

import math

import pytest
import sympy

from autopar import Cluster, PlanError
from autopar.cluster import parse_shorthand
from autopar.cost_models.comm import KINDS, collective_time, group_bandwidth, p2p_time

GB = 1e9
NV, NV_LAT = 300e9, 2e-6  # A100 intra-node
NET, NET_LAT = 25e9, 5e-6  # default network


def gloo(x: str | dict) -> Cluster:
    """The cluster `x` (shorthand or dict) with every device a gloo stand-in of its catalog type."""
    d = parse_shorthand(x) if isinstance(x, str) else dict(x)
    d["nodes"] = [{**g, "device": {"based_on": g["device"], "kind": "cpu"}} for g in d["nodes"]]
    return Cluster.load(d)


@pytest.fixture(scope="module")
def node4() -> Cluster:
    return gloo("1x4xA100-80GB")


@pytest.fixture(scope="module")
def two4() -> Cluster:
    return gloo("2x4xA100-80GB")


@pytest.fixture(scope="module")
def mixed() -> Cluster:
    # A network faster than V100 NVLink, so the slowest link on a ring is an intra-node one.
    return gloo({"nodes": [{"device": "V100-32GB", "devices_per_node": 2},
                                   {"device": "A100-80GB", "devices_per_node": 2}],
                         "network": {"bandwidth_GBps": 200, "latency_us": 1}})


# ---- one node --------------------------------------------------------------------------------


def test_ring_all_reduce_one_node(node4):
    # 2(p-1) a + 2(p-1)/p n/B = 6 * 2 us + 1.5 * 1e9 / 300e9
    expected = 12e-6 + 1.5 * GB / NV
    assert expected == pytest.approx(0.005012)
    got = collective_time("all_reduce", GB, [0, 1, 2, 3], node4, "ring")
    assert isinstance(got, float)
    assert got == pytest.approx(expected)


def test_tree_all_reduce_and_auto_one_node(node4):
    # 2 ceil(log2 4) a + 2 n/B = 4 * 2 us + 2e9 / 300e9
    tree = collective_time("all_reduce", GB, range(4), node4, "tree")
    assert tree == pytest.approx(8e-6 + 2 * GB / NV)
    assert collective_time("all_reduce", GB, range(4), node4) == pytest.approx(12e-6 + 1.5 * GB / NV)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_gather_scatter_one_node(node4, kind):
    # (p-1) a + (p-1)/p n/B = 3 * 2 us + 0.75 * 1e9 / 300e9
    assert collective_time(kind, GB, range(4), node4, "ring") == pytest.approx(6e-6 + 0.0025)
    assert collective_time(kind, GB, range(4), node4) == pytest.approx(6e-6 + 0.0025)


def test_broadcast_one_node(node4):
    ring = collective_time("broadcast", GB, range(4), node4, "ring")
    tree = collective_time("broadcast", GB, range(4), node4, "tree")
    assert ring == pytest.approx(3 * 2e-6 + GB / NV)
    assert tree == pytest.approx(2 * 2e-6 + GB / NV)
    assert collective_time("broadcast", GB, range(4), node4) == pytest.approx(tree)


def test_all_to_all_one_node(node4):
    # (p-1) a + (p-1)/p n/B
    assert collective_time("all_to_all", GB, range(4), node4) == pytest.approx(6e-6 + 0.75 * GB / NV)


def test_zero_bytes_costs_latency_only(node4):
    assert collective_time("all_reduce", 0, range(4), node4) == pytest.approx(4 * 2e-6)  # tree


# ---- across nodes ----------------------------------------------------------------------------


def test_all_to_all_two_nodes(two4):
    # Each rank: 4 peers off-node (4/8 of n over 25 GB/s), 3 on-node (3/8 of n over 300 GB/s).
    expected = 4 * 5e-6 + 3 * 2e-6 + max(0.5 * GB / NET, 3 / 8 * GB / NV)
    assert expected == pytest.approx(26e-6 + 0.02)
    assert collective_time("all_to_all", GB, range(8), two4) == pytest.approx(expected)


def test_all_to_all_lone_rank_is_the_bottleneck(two4):
    # Group [0, 1, 4], p = 3. Device 4 sends 2/3 of n over the network; devices 0, 1 send 1/3.
    node0 = 1 * 5e-6 + 1 * 2e-6 + GB / 3 / NET
    node1 = 2 * 5e-6 + 2 / 3 * GB / NET
    assert node1 > node0
    assert collective_time("all_to_all", GB, [0, 1, 4], two4) == pytest.approx(10e-6 + 2 * GB / 75e9)


def test_hierarchical_all_reduce_beats_flat_for_large_messages(two4):
    n = GB
    # intra RS and AG: 3 * 2 us + 0.75 * 1e9/300e9 each; inter all-reduce of the 1e9/4 shards over 2 nodes:
    # 2 * 1 * 5 us + 2 * (1/2) * 2.5e8 / 25e9.
    hier = 2 * (6e-6 + 0.0025) + (10e-6 + 0.01)
    ring = 2 * 7 * 5e-6 + 2 * 7 / 8 * n / NET  # bottleneck: the network
    tree = 2 * 3 * 5e-6 + 2 * n / NET
    assert collective_time("all_reduce", n, range(8), two4, "hierarchical") == pytest.approx(hier)
    assert collective_time("all_reduce", n, range(8), two4, "ring") == pytest.approx(ring)
    assert collective_time("all_reduce", n, range(8), two4, "tree") == pytest.approx(tree)
    assert hier < ring < tree
    assert collective_time("all_reduce", n, range(8), two4) == pytest.approx(hier)


def test_hierarchical_wins_on_a_larger_cluster():
    c = gloo("4x8xA100-80GB")
    group = range(32)
    assert (collective_time("all_reduce", GB, group, c, "hierarchical")
            < collective_time("all_reduce", GB, group, c, "ring"))


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_hierarchical_gather_scatter(two4, kind):
    # inter ring over 2 nodes on 1e9/4 shards: 5 us + 0.5 * 2.5e8/25e9; intra ring: 6 us + 0.75 * 1e9/300e9
    hier = (5e-6 + 0.005) + (6e-6 + 0.0025)
    ring = 7 * 5e-6 + 7 / 8 * GB / NET
    assert collective_time(kind, GB, range(8), two4, "hierarchical") == pytest.approx(hier)
    assert collective_time(kind, GB, range(8), two4, "ring") == pytest.approx(ring)
    assert collective_time(kind, GB, range(8), two4) == pytest.approx(hier)


def test_hierarchical_uneven_nodes_use_smallest_count():
    c = gloo({"nodes": [{"device": "A100-80GB", "devices_per_node": 4},
                                {"device": "A100-80GB", "devices_per_node": 2}]})
    # node phase: the 4-GPU node (6 us + 0.75 * 1e9/300e9) is slower than the 2-GPU one;
    # k = 2, so the inter-node all-reduce moves 5e8-byte shards: 2 * 5 us + 2 * (1/2) * 5e8/25e9.
    expected = 2 * (6e-6 + 0.0025) + (10e-6 + 0.02)
    assert collective_time("all_reduce", GB, range(6), c, "hierarchical") == pytest.approx(expected)


def test_latency_dominates_tiny_messages():
    c = gloo("1x8xA100-80GB")
    tiny = collective_time("all_reduce", 8, range(8), c)
    assert tiny == pytest.approx(2 * 3 * 2e-6, rel=1e-4)  # tree: 2 ceil(log2 8) a
    assert tiny < collective_time("all_reduce", 8, range(8), c, "ring")  # ring pays 2 * 7 a = 28 us
    # Large messages flip it: ring moves 2(p-1)/p n instead of 2n.
    assert collective_time("all_reduce", GB, range(8), c) == pytest.approx(28e-6 + 2 * 7 / 8 * GB / NV)


def test_tiny_message_across_nodes(two4):
    # hierarchical latency: 2 * 3 * 2 us + 2 * 1 * 5 us = 22 us, below the tree's 2 * 3 * 5 us
    assert collective_time("all_reduce", 8, range(8), two4) == pytest.approx(22e-6, rel=1e-3)


# ---- point to point and ring bottleneck ------------------------------------------------------


def test_p2p_intra_vs_inter(two4):
    assert p2p_time(GB, 0, 1, two4) == pytest.approx(2e-6 + GB / NV)
    assert p2p_time(GB, 0, 4, two4) == pytest.approx(5e-6 + 0.04)
    assert collective_time("p2p", GB, [0, 4], two4) == pytest.approx(5e-6 + 0.04)
    assert collective_time("p2p", GB, [5, 6], two4) == pytest.approx(2e-6 + GB / NV)


def test_mixed_nodes_ring_uses_slowest_link(mixed):
    # ring 0-1 (V100 150 GB/s, 2 us), 1-2 (network 200 GB/s, 1 us), 2-3 (A100 300 GB/s, 2 us), 3-0 (network)
    assert group_bandwidth([0, 1, 2, 3], mixed) == pytest.approx((150e9, 2e-6))
    ring = 2 * 3 * 2e-6 + 1.5 * GB / 150e9
    assert collective_time("all_reduce", GB, range(4), mixed, "ring") == pytest.approx(ring)
    # node phase paced by the V100 node: 2 us + 0.5 * 1e9/150e9; inter: 2 * 1 us + 2 * (1/2) * 5e8/200e9
    hier = 2 * (2e-6 + 0.5 * GB / 150e9) + (2e-6 + 0.0025)
    assert collective_time("all_reduce", GB, range(4), mixed, "hierarchical") == pytest.approx(hier)


def test_group_bandwidth(node4, two4):
    assert group_bandwidth([2], node4) == (math.inf, 0.0)
    assert group_bandwidth([0, 1, 2, 3], node4) == pytest.approx((NV, NV_LAT))
    assert group_bandwidth(range(8), two4) == pytest.approx((NET, NET_LAT))
    hetero = gloo("1x4xV100-32GB+1x4xA100-80GB")
    assert group_bandwidth([0, 4], hetero) == pytest.approx((NET, NET_LAT))


@pytest.mark.parametrize("kind", KINDS)
def test_single_device_costs_zero(two4, kind):
    assert collective_time(kind, GB, [3], two4) == 0.0


def test_p2p_to_self_is_free(two4):
    assert p2p_time(GB, 2, 2, two4) == 0.0


# ---- symbolic sizes --------------------------------------------------------------------------


def test_symbolic_ring_is_linear(node4):
    n = sympy.Symbol("n", positive=True)
    expr = collective_time("all_reduce", n, range(4), node4, "ring")
    assert n in expr.free_symbols
    assert float(expr.subs(n, GB)) == pytest.approx(12e-6 + 1.5 * GB / NV)


def test_symbolic_auto_is_min_of_candidates(node4, two4):
    n = sympy.Symbol("n", positive=True)
    expr = collective_time("all_reduce", n, range(4), node4)
    assert isinstance(expr, sympy.Min)
    for size in (8.0, 1e6, GB):
        numeric = collective_time("all_reduce", size, range(4), node4)
        assert float(expr.subs(n, size)) == pytest.approx(numeric)
    for kind in ("all_gather", "broadcast", "all_to_all", "p2p"):
        group = [0, 4] if kind == "p2p" else [0, 1, 4]
        sym = collective_time(kind, n, group, two4)
        assert float(sym.subs(n, GB)) == pytest.approx(collective_time(kind, GB, group, two4))


def test_sympy_number_is_numeric(node4):
    got = collective_time("all_reduce", sympy.Integer(10**9), range(4), node4, "ring")
    assert isinstance(got, float)
    assert got == pytest.approx(12e-6 + 1.5 * GB / NV)


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="allreduce"), "all_reduce"),
    (dict(algorithm="butterfly"), "hierarchical"),
    (dict(kind="all_gather", algorithm="tree"), "'ring'"),
    (dict(kind="all_to_all", algorithm="ring"), "'auto'"),
    (dict(nbytes=-1.0), "non-negative"),
    (dict(nbytes=float("nan")), "finite"),
    (dict(nbytes="1GB"), "number"),
    (dict(nbytes=sympy.Symbol("m", negative=True)), "non-negative"),
    (dict(group=[]), "empty"),
    (dict(group=[0, 8]), "out of range"),
    (dict(group=[0, 1, 1]), "more than once"),
    (dict(kind="p2p", group=[0, 1, 2]), r"\[src, dst\]"),
    (dict(algorithm="hierarchical", group=[0, 1, 2, 3]), "more than one node"),
    (dict(algorithm="hierarchical", group=[0, 1, 4]), "more than one"),
])
def test_bad_input(two4, kwargs, match):
    args = dict(kind="all_reduce", nbytes=GB, group=list(range(8)), algorithm="auto") | kwargs
    with pytest.raises(PlanError, match=match):
        collective_time(args["kind"], args["nbytes"], args["group"], two4, args["algorithm"])


def test_auto_skips_inapplicable_hierarchical(two4):
    # [0, 1, 4]: node 1 holds one member, so auto picks between ring and tree.
    ring = collective_time("all_reduce", GB, [0, 1, 4], two4, "ring")
    assert ring == pytest.approx(2 * 2 * 5e-6 + 2 * 2 / 3 * GB / NET)
    assert collective_time("all_reduce", GB, [0, 1, 4], two4) == pytest.approx(ring)


def test_bad_p2p_and_group_bandwidth_input(two4):
    with pytest.raises(PlanError, match="out of range"):
        p2p_time(GB, 0, 99, two4)
    with pytest.raises(PlanError, match="non-negative"):
        p2p_time(-5, 0, 1, two4)
    with pytest.raises(PlanError, match="empty"):
        group_bandwidth([], two4)
