"""Measured link figures in a cluster file: `measured: true` links, the top-level `links` list (per link kind,
per node pair) and a node group's `nic_GBps`."""

from __future__ import annotations

import pytest

from autopar import Cluster, ClusterError, Link

GB = 1e9

THREE = {"nodes": [{"device": "A100-80GB", "devices_per_node": 2, "count": 3}],
         "network": {"bandwidth_GBps": 25, "latency_us": 5}}


def test_measured_flag_parses_and_round_trips():
    c = Cluster.load({**THREE, "network": {"bandwidth_GBps": 22.5, "latency_us": 9, "measured": True}})
    assert c.network == Link(22.5 * GB, 9e-6, "", True)
    assert c.network.to_dict()["measured"] is True
    assert "measured" not in c.nodes[0].intra_node.to_dict()  # datasheet links keep their old form
    assert Cluster.load(c.to_dict()) == c


def test_links_by_kind_replace_every_link_of_that_kind():
    c = Cluster.load({**THREE, "links": [{"kind": "NVLink3", "bandwidth_GBps": 231, "latency_us": 4}]})
    for node in c.nodes:
        assert node.intra_node == Link(231 * GB, 4e-6, "NVLink3", True)
    assert not c.network.measured


def test_links_by_node_pair():
    c = Cluster.load({**THREE, "links": [{"nodes": [2, 0], "bandwidth_GBps": 11, "latency_us": 30},
                                         {"nodes": [1, 1], "bandwidth_GBps": 99, "latency_us": 7}]})
    pair = Link(11 * GB, 30e-6, "", True)
    assert c.link(0, 4) == pair and c.link(5, 1) == pair  # devices 0-1 on node 0, 4-5 on node 2
    assert c.link(0, 2) == c.network  # nodes 0 and 1: no entry
    assert c.link(2, 3) == Link(99 * GB, 7e-6, "", True)  # node 1's own link
    assert c.link(0, 1) == c.nodes[0].intra_node
    again = Cluster.load(c.to_dict())
    assert again == c and again.link(0, 4) == pair
    # subset re-indexes nodes: old nodes 2 and 0 become 0 and 1
    s = c.subset([4, 5, 0, 1])
    assert s.link(0, 2) == pair and s.link(0, 1) == c.nodes[2].intra_node


def test_nic_bandwidth_default_and_declared():
    c = Cluster.load(THREE)
    assert c.nic_bandwidth(0) == pytest.approx(2 * 25 * GB)  # one network share per device
    d = Cluster.load({"nodes": [{"device": "T4", "devices_per_node": 4, "nic_GBps": 12.5}]})
    assert d.nic_bandwidth(0) == pytest.approx(12.5 * GB)
    assert Cluster.load(d.to_dict()) == d and d.to_dict()["nodes"][0]["nic_GBps"] == pytest.approx(12.5)


@pytest.mark.parametrize("links, message", [
    ({"kind": "NVLink3"}, "links[0].bandwidth_GBps is missing"),
    ([{"bandwidth_GBps": 1}], "either 'kind'"),
    ([{"nodes": [0, 3], "bandwidth_GBps": 1}], "two node indices in 0..2"),
    ([{"nodes": [0], "bandwidth_GBps": 1}], "must be [a, b]"),
    ([{"nodes": [0, 1], "bandwidth_GBps": 1}, {"nodes": [1, 0], "bandwidth_GBps": 2}], "second time"),
    ([{"nodes": [0, 1], "bandwidth_GBps": -1}], "must be positive"),
    ([{"nodes": [0, 1], "bandwidth_GBps": 1, "measured": "yes"}], "measured must be true or false"),
])
def test_bad_links_name_the_entry(links, message):
    links = links if isinstance(links, list) else [links]
    with pytest.raises(ClusterError) as e:
        Cluster.load({**THREE, "links": links})
    assert message in str(e.value)


def test_bad_links_container_and_nic():
    with pytest.raises(ClusterError, match="must be a list"):
        Cluster.load({**THREE, "links": {"kind": "IB"}})
    with pytest.raises(ClusterError, match="nic_GBps must be positive"):
        Cluster.load({"nodes": [{"device": "T4", "nic_GBps": 0}]})
