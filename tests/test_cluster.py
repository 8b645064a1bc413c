"""Cluster descriptions: files, dicts, shorthand, the catalog, the local machine, and error messages.

Datasheet figures below are written out from ../shared/reference/devices.md (dense, no sparsity):
A100 312 bf16 TFLOP/s, 19.5 fp32, 1555 GB/s (40GB) / 2039 GB/s (80GB), NVLink3 300 GB/s each way;
V100 125 / 15.7, 900 GB/s, NVLink2 150 GB/s each way; T4 65 / 8.1, 320 GB/s;
H100 SXM 989 / 67, 3350 GB/s, NVLink4 450 GB/s each way. Default network 25 GB/s, 5 us.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

from autopar import Cluster, ClusterError, DeviceSpec, Link
from autopar.catalog import CATALOG
from autopar.cluster import GiB, catalog_name_for_gpu, catalog_table, device_spec, parse_shorthand

GB = 1e9
TF = 1e12

LAB_YAML = """\
name: lab                      # optional
nodes:                         # a list of node groups
  - device: A100-80GB          # a catalog name, or a mapping that defines a custom device
    devices_per_node: 8
    count: 2                   # identical nodes in this group (default 1)
    intra_node: {bandwidth_GBps: 300, latency_us: 2}   # per-device, one direction; default from the catalog
  - device: V100-16GB
    devices_per_node: 4
network: {bandwidth_GBps: 25, latency_us: 5}           # inter-node, per device (NIC share), one direction
"""

LAB_DICT = {
    "name": "lab",
    "nodes": [
        {"device": "A100-80GB", "devices_per_node": 8, "count": 2,
         "intra_node": {"bandwidth_GBps": 300, "latency_us": 2}},
        {"device": "V100-16GB", "devices_per_node": 4},
    ],
    "network": {"bandwidth_GBps": 25, "latency_us": 5},
}

ALL_NAMES = ["H100-SXM", "H200", "A100-40GB", "A100-80GB", "V100-16GB", "V100-32GB", "T4", "A10", "A10G",
             "L4", "L40S", "RTX-3090", "RTX-4090", "RTX-2080Ti", "TITAN-RTX", "MI250X", "MI300X",
             "Jetson-AGX-Orin"]


def _error(x) -> str:
    with pytest.raises(ClusterError) as ei:
        Cluster.load(x)
    return str(ei.value)


def _write(tmp_path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _check_lab(c: Cluster) -> None:
    assert c.name == "lab"
    assert c.world_size == 20
    assert [d.index for d in c.devices] == list(range(20))
    assert [d.node for d in c.devices] == [0] * 8 + [1] * 8 + [2] * 4
    assert [d.local_rank for d in c.devices] == list(range(8)) * 2 + list(range(4))
    assert [n.devices for n in c.nodes] == [tuple(range(8)), tuple(range(8, 16)), tuple(range(16, 20))]
    assert [n.group for n in c.nodes] == [0, 0, 1]
    assert [d.spec.name for d in c.devices] == ["A100-80GB"] * 16 + ["V100-16GB"] * 4
    assert c.device_types() == ["A100-80GB", "V100-16GB"]
    a100, v100 = c.spec("A100-80GB"), c.spec("V100-16GB")
    assert a100.flops("bf16") == 312 * TF and a100.flops("fp32") == 19.5 * TF
    assert a100.memory == 80 * GiB and a100.memory_bandwidth == 2039 * GB
    assert v100.flops("fp16") == 125 * TF and v100.memory == 16 * GiB and v100.memory_bandwidth == 900 * GB
    assert "bf16" not in v100.peak_flops  # Volta: fp16 tensor cores only
    # The group's intra_node override (no kind given) replaces the catalog link; the V100 node keeps NVLink2.
    assert c.nodes[0].intra_node == Link(300 * GB, 2e-6, "") == c.nodes[1].intra_node
    assert c.nodes[2].intra_node == Link(150 * GB, 2e-6, "NVLink2")
    assert c.network == Link(25 * GB, 5e-6, "")
    assert c.link(0, 7) == c.nodes[0].intra_node
    assert c.link(16, 19).bandwidth == 150 * GB
    assert c.link(7, 8) == c.network and c.link(15, 16) == c.network
    assert c.describe() == "lab: 20 devices in 3 nodes (8xA100-80GB, 8xA100-80GB, 4xV100-16GB)"


# ---- loading the schema -----------------------------------------------------------------------


def test_lab_from_yaml_file(tmp_path):
    c = Cluster.load(_write(tmp_path, "lab.yaml", LAB_YAML))
    _check_lab(c)
    assert c == Cluster.load(tmp_path / "lab.yaml")  # a Path works as well as a str


def test_lab_from_json_file(tmp_path):
    _check_lab(Cluster.load(_write(tmp_path, "lab.json", json.dumps(LAB_DICT, indent="\t"))))


def test_lab_from_dict():
    _check_lab(Cluster.load(LAB_DICT))
    assert Cluster.load(Cluster.load(LAB_DICT)) == Cluster.load(LAB_DICT)


def test_exponent_numbers_in_yaml_and_json(tmp_path):
    # PyYAML (YAML 1.1) would read 25e0 and JSON's 2.5e1 as strings; both files must give 25 GB/s.
    y = ("nodes: [{device: T4, devices_per_node: 2, count: 2}]\n"
         "network: {bandwidth_GBps: 25e0, latency_us: 5E0}\n")
    j = json.dumps({"nodes": [{"device": "T4", "devices_per_node": 2, "count": 2}]})[:-1] + \
        ', "network": {"bandwidth_GBps": 2.5e1, "latency_us": 5e0}}'
    for c in (Cluster.load(_write(tmp_path, "e.yaml", y)), Cluster.load(_write(tmp_path, "e.json", j))):
        assert c.network == Link(25 * GB, 5e-6, "")
        assert c.world_size == 4


def test_shorthand_equals_equivalent_dict():
    s = "2x8xA100-80GB+1x4xV100-16GB"
    c = Cluster.load(s)
    assert c == Cluster.load({"name": s, "nodes": [
        {"device": "A100-80GB", "devices_per_node": 8, "count": 2},
        {"device": "V100-16GB", "devices_per_node": 4, "count": 1}]})
    assert c.world_size == 20 and len(c.nodes) == 3
    assert c.nodes[0].intra_node == Link(300 * GB, 2e-6, "NVLink3")  # catalog default, not the lab override
    assert c.network == Link(25 * GB, 5e-6, "")
    assert parse_shorthand(" 1 x 4 x T4 + 2x2xL4 ") == {"name": " 1 x 4 x T4 + 2x2xL4 ", "nodes": [
        {"device": "T4", "devices_per_node": 4, "count": 1},
        {"device": "L4", "devices_per_node": 2, "count": 2}]}


def test_defaults():
    c = Cluster.load({"nodes": [{"device": "V100-32GB", "devices_per_node": 2}]})
    assert c.name == "cluster" and c.world_size == 2 and len(c.nodes) == 1  # count defaults to 1
    assert c.nodes[0].intra_node == Link(150 * GB, 2e-6, "NVLink2")
    assert c.network == Link(25 * GB, 5e-6, "")
    one = Cluster.load({"nodes": [{"device": "T4"}]})  # devices_per_node defaults to 1
    assert one.world_size == 1 and one.nodes[0].intra_node == Link(16 * GB, 5e-6, "PCIe3")
    # Only latency given: bandwidth keeps the default.
    lat = Cluster.load({"nodes": [{"device": "T4"}], "network": {"latency_us": 9}})
    assert lat.network == Link(25 * GB, 9e-6, "")


def test_edge_only_cluster_defaults_to_gigabit_ethernet():
    edge = Cluster.load("4x1xJetson-AGX-Orin")
    assert edge.network == Link(0.125 * GB, 100e-6, "")
    assert edge.devices[0].spec.kind == "edge"
    mixed = Cluster.load("1x1xJetson-AGX-Orin+1x1xT4")
    assert mixed.network == Link(25 * GB, 5e-6, "")


def test_device_names_are_forgiving():
    assert Cluster.load("1x1xa100-80gb").devices[0].spec.name == "A100-80GB"
    assert Cluster.load("1x1xrtx_4090").devices[0].spec.name == "RTX-4090"
    assert Cluster.load("1x1xH100").devices[0].spec.name == "H100-SXM"  # alias
    assert Cluster.load("1x1xA100").devices[0].spec.name == "A100-80GB"  # alias


# ---- to_dict, subset, link -------------------------------------------------------------------------


@pytest.mark.parametrize("src", [LAB_DICT, "2x8xA100-80GB+1x4xV100-16GB", "3x1xJetson-AGX-Orin",
                                 "1x2xMI250X+1x1xT4+1x1xT4"])
def test_to_dict_round_trip(src):
    c = Cluster.load(src)
    d = c.to_dict()
    assert Cluster.load(d) == c
    assert Cluster.load(json.loads(c.to_json())) == c
    assert d["network"]["bandwidth_GBps"] == c.network.bandwidth / GB
    assert sum(g["devices_per_node"] * g["count"] for g in d["nodes"]) == c.world_size


def test_to_dict_round_trip_through_file(tmp_path):
    c = Cluster.load(LAB_DICT)
    assert Cluster.load(_write(tmp_path, "rt.json", c.to_json())) == c
    d = c.to_dict()
    assert [(g["devices_per_node"], g["count"]) for g in d["nodes"]] == [(8, 2), (4, 1)]


def test_to_dict_keeps_identical_groups_apart():
    # Two groups with identical nodes stay two groups, so node.group survives the round trip.
    group = {"device": "T4", "devices_per_node": 2}
    c = Cluster.load({"nodes": [group, dict(group)]})
    assert [n.group for n in c.nodes] == [0, 1]
    assert Cluster.load(c.to_dict()) == c


def test_subset():
    c = Cluster.load(LAB_DICT)
    s = c.subset([6, 7, 8, 17])
    assert s.name == "lab-subset" and s.world_size == 4
    assert [d.spec.name for d in s.devices] == ["A100-80GB"] * 3 + ["V100-16GB"]
    assert [d.node for d in s.devices] == [0, 0, 1, 2]
    assert [d.local_rank for d in s.devices] == [0, 1, 0, 0]
    assert [n.devices for n in s.nodes] == [(0, 1), (2,), (3,)]
    assert s.link(0, 1) == Link(300 * GB, 2e-6, "") and s.link(1, 2) == c.network
    assert s.network == c.network
    assert Cluster.load(s.to_dict()) == s
    assert c.subset(range(16), name="a100s") == Cluster.load({
        "name": "a100s", "nodes": [LAB_DICT["nodes"][0]], "network": LAB_DICT["network"]})
    # Ranks that interleave nodes are a valid cluster but not expressible as a file.
    mixed = c.subset([0, 8, 1])
    assert [d.node for d in mixed.devices] == [0, 1, 0]
    with pytest.raises(ClusterError, match="rank order"):
        mixed.to_dict()


@pytest.mark.parametrize("bad, msg", [([], "at least one"), ([0, 0], "repeat"), ([20], "0..19"),
                                      ([-1], "0..19")])
def test_subset_rejects_bad_indices(bad, msg):
    with pytest.raises(ClusterError, match=msg):
        Cluster.load(LAB_DICT).subset(bad)


def test_link_intra_vs_inter_node():
    c = Cluster.load("2x4xA100-80GB")
    assert c.same_node(0, 3) and not c.same_node(3, 4)
    assert c.link(0, 3) == Link(300 * GB, 2e-6, "NVLink3")
    assert c.link(3, 4) == c.link(4, 3) == Link(25 * GB, 5e-6, "")
    assert c.link(2, 2).bandwidth == 300 * GB
    assert c.link(0, 3).bandwidth_GBps == 300


# ---- custom devices --------------------------------------------------------------------------------


def test_custom_device_mapping():
    dev = {"name": "MyChip", "tflops_fp32": 10, "tflops_tf32": 20, "tflops_bf16": 40, "memory_GiB": 12,
           "memory_bandwidth_GBps": 500, "intra_node": {"bandwidth_GBps": 50, "latency_us": 3, "kind": "XL"},
           "host_link": {"bandwidth_GBps": 8, "latency_us": 4}}
    c = Cluster.load({"nodes": [{"device": dev, "devices_per_node": 2, "count": 2}]})
    s = c.spec("MyChip")
    assert s.peak_flops == {"fp32": 10 * TF, "tf32": 20 * TF, "bf16": 40 * TF, "fp16": 40 * TF}
    assert s.memory == 12 * GiB and s.memory_bandwidth == 500 * GB and s.kind == "gpu"
    assert s.intra_node == Link(50 * GB, 3e-6, "XL") and s.host_link == Link(8 * GB, 4e-6, "")
    assert c.nodes[0].intra_node == s.intra_node and c.link(0, 2) == c.network
    assert Cluster.load(c.to_dict()) == c
    # Optional figures default: tf32/bf16 to fp32, links to PCIe3-like 16 GB/s, 5 us.
    m = device_spec({"name": "Min", "tflops_fp32": 3, "memory_GiB": 4, "memory_bandwidth_GBps": 100})
    assert m.flops("bf16") == m.flops("tf32") == 3 * TF
    assert m.intra_node == m.host_link == Link(16 * GB, 5e-6, "")


def test_custom_device_based_on():
    c = Cluster.load({"nodes": [{"device": {"based_on": "A100-80GB", "name": "A100-slow", "memory_GiB": 40,
                                            "tflops_bf16": 200}, "devices_per_node": 4}]})
    s, base = c.spec("A100-slow"), device_spec("A100-80GB")
    assert s.memory == 40 * GiB and s.flops("bf16") == 200 * TF
    assert s.flops("fp32") == base.flops("fp32") == 19.5 * TF
    assert s.memory_bandwidth == base.memory_bandwidth == 2039 * GB
    assert s.intra_node == base.intra_node == c.nodes[0].intra_node
    assert Cluster.load(c.to_dict()) == c
    # A mapping naming a catalog device without figures overrides only what it gives.
    t4 = device_spec({"name": "T4", "host_link": {"bandwidth_GBps": 12, "latency_us": 6}})
    assert t4.memory_bandwidth == 320 * GB and t4.host_link == Link(12 * GB, 6e-6, "")
    assert device_spec({"based_on": "cpu", "name": "cpu2"}).kind == "cpu"


# ---- the catalog -------------------------------------------------------------------------------------


def test_catalog_has_every_listed_device():
    assert set(ALL_NAMES) <= set(CATALOG)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_every_catalog_device_loads_with_positive_figures(name):
    c = Cluster.load(f"1x2x{name}")
    s = c.devices[0].spec
    assert isinstance(s, DeviceSpec) and s.name == name and c.world_size == 2
    for dtype in ("fp32", "tf32", "fp16") + (("bf16",) if "bf16" in s.peak_flops else ()):
        assert s.flops(dtype) > 0
    # Tensor-core peaks are never below the plain fp32 peak.
    assert s.flops("fp16") >= s.flops("tf32") >= s.flops("fp32")
    assert "bf16" not in s.peak_flops or s.flops("bf16") >= s.flops("tf32")
    assert s.memory >= 8 * GiB and s.memory_bandwidth >= 100 * GB
    for link in (s.intra_node, s.host_link):
        assert link.bandwidth > 0 and link.latency > 0 and link.kind
    assert c.link(0, 1) == s.intra_node
    assert s == device_spec(name)


@pytest.mark.parametrize("name, fp32, bf16, mem_gib, mem_bw, intra_bw", [
    ("A100-40GB", 19.5, 312, 40, 1555, 300),
    ("A100-80GB", 19.5, 312, 80, 2039, 300),
    ("V100-16GB", 15.7, 125, 16, 900, 150),
    ("V100-32GB", 15.7, 125, 32, 900, 150),
    # 16 GB on the datasheet; 15 GiB with ECC on, as T4s ship (test_t4_usable_memory_is_what_ecc_leaves)
    ("T4", 8.1, 65, 15, 320, 16),
    ("H100-SXM", 67, 989, 80, 3350, 450),
    ("A10", 31.2, 125, 24, 600, 32),
    ("L4", 30.3, 121, 24, 300, 32),
    ("RTX-3090", 35.6, 71, 24, 936, 32),
    ("RTX-4090", 82.6, 165, 24, 1008, 32),
    ("MI250X", 47.9, 383, 128, 3200, 200),
])
def test_datasheet_figures(name, fp32, bf16, mem_gib, mem_bw, intra_bw):
    s = device_spec(name)
    assert s.flops("fp32") == pytest.approx(fp32 * TF)
    # the tensor peak: bf16 where the device has it, else (V100, T4) the fp16 peak
    assert s.flops("bf16" if "bf16" in s.peak_flops else "fp16") == pytest.approx(bf16 * TF)
    assert s.flops("fp16") == pytest.approx(bf16 * TF)
    assert s.memory == mem_gib * GiB
    assert s.memory_bandwidth == pytest.approx(mem_bw * GB)
    assert s.intra_node.bandwidth == pytest.approx(intra_bw * GB)


def test_t4_usable_memory_is_what_ecc_leaves() -> None:
    """A T4 ships with ECC on, which takes 6.25% of its 16 GB of GDDR6 (CUDA Best Practices Guide), so the
    catalog offers 15 GiB, not the datasheet's 16 (the driver reports 15079-15110 MiB: the rest is its own
    reservation, which no catalog entry counts)."""
    t4 = device_spec("T4")
    assert t4.memory == 15 * 2**30 == int(16 * 2**30 * (1 - 0.0625))


def test_catalog_table_lists_every_device_with_figures():
    rows = {line.split()[0]: line.split() for line in catalog_table().splitlines()[2:]}
    assert set(rows) == set(CATALOG) | {"cpu"}
    assert rows["A100-80GB"][1:7] == ["19.5", "156", "312", "312", "80", "2039"]
    assert rows["T4"][3:5] == ["65", "-"] and rows["T4"][6] == "320"  # fp16 65, no bf16
    assert rows["cpu"][1] == "measured"


# ---- the local machine ---------------------------------------------------------------------------------


def test_local_is_the_cpu_here():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA GPUs; the CPU case is covered by the fake-GPU tests below")
    c = Cluster.local()
    assert c.name == "local" and c.world_size == 1 and len(c.nodes) == 1
    s = c.devices[0].spec
    assert s.name == "cpu" and s.kind == "cpu"
    assert 1e8 < s.flops("fp32") < 1e15  # measured matmul FLOP/s: between 0.1 GFLOP/s and 1 PFLOP/s
    assert 1e8 < s.memory_bandwidth < 1e13
    assert s.memory > GiB
    assert Cluster.load(c.to_dict()) == c  # measured figures survive the GB/s, TFLOP/s units exactly
    assert Cluster.load("1x1xcpu").devices[0].spec == s


def _fake_gpus(monkeypatch, gpus: list[tuple[str, float]]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: gpus[i][0])
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i=0: types.SimpleNamespace(total_memory=int(gpus[i][1] * GiB)))


@pytest.mark.parametrize("cuda_name, mem_gib, expected", [
    ("NVIDIA A100-SXM4-80GB", 79.3, "A100-80GB"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "A100-40GB"),
    ("NVIDIA A100 80GB PCIe", 79.2, "A100-80GB"),
    ("NVIDIA H100 80GB HBM3", 79.1, "H100-SXM"),
    ("NVIDIA H200", 139.8, "H200"),
    ("Tesla V100-SXM2-16GB", 15.8, "V100-16GB"),
    ("Tesla V100-SXM2-32GB", 31.7, "V100-32GB"),
    ("Tesla T4", 14.6, "T4"),
    ("NVIDIA A10G", 22.0, "A10G"),
    ("NVIDIA A10", 22.0, "A10"),
    ("NVIDIA L4", 22.0, "L4"),
    ("NVIDIA L40S", 44.5, "L40S"),
    ("NVIDIA GeForce RTX 4090", 23.6, "RTX-4090"),
    ("NVIDIA GeForce RTX 3090", 23.7, "RTX-3090"),
    ("NVIDIA GeForce RTX 2080 Ti", 10.7, "RTX-2080Ti"),
    ("NVIDIA TITAN RTX", 23.6, "TITAN-RTX"),
    ("AMD Instinct MI300X", 191.5, "MI300X"),
    ("Orin", 30.0, "Jetson-AGX-Orin"),
])
def test_cuda_names_map_to_catalog(monkeypatch, cuda_name, mem_gib, expected):
    _fake_gpus(monkeypatch, [(cuda_name, mem_gib)])
    assert catalog_name_for_gpu(cuda_name, 0) == expected


def test_unknown_cuda_gpu_becomes_custom_device(monkeypatch):
    _fake_gpus(monkeypatch, [("NVIDIA RTX A6000", 47.5)] * 2)
    entry = catalog_name_for_gpu("NVIDIA RTX A6000", 0)
    assert entry == {"name": "NVIDIA RTX A6000", "based_on": "A100-80GB", "memory_GiB": 47.5}
    c = Cluster.local()
    assert c.world_size == 2 and c.devices[1].spec.name == "NVIDIA RTX A6000"
    assert c.devices[0].spec.memory == int(47.5 * GiB)


def test_local_with_fake_gpus(monkeypatch):
    _fake_gpus(monkeypatch, [("NVIDIA A100-SXM4-80GB", 79.3)] * 4)
    c = Cluster.local()
    assert c.world_size == 4 and len(c.nodes) == 1 and c.device_types() == ["A100-80GB"]
    assert c.link(0, 3) == Link(300 * GB, 2e-6, "NVLink3")


def test_local_mixed_gpus_share_one_node(monkeypatch):
    _fake_gpus(monkeypatch, [("NVIDIA GeForce RTX 4090", 23.6), ("NVIDIA GeForce RTX 4090", 23.6),
                             ("NVIDIA GeForce RTX 3090", 23.7)])
    c = Cluster.local()
    assert c.device_types() == ["RTX-4090", "RTX-3090"]
    assert len(c.nodes) == 1 and [d.node for d in c.devices] == [0, 0, 0] and c.nodes[0].devices == (0, 1, 2)
    assert [d.local_rank for d in c.devices] == [0, 1, 2]
    assert c.link(0, 2) == Link(32 * GB, 5e-6, "PCIe4")  # the slowest in-box link, not the network


# ---- errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("typo, suggestion", [("A100-80", "A100-80GB"), ("V100-16", "V100-16GB"),
                                              ("H100-SMX", "H100-SXM"), ("RTX-4900", "RTX-4090")])
def test_unknown_device_lists_close_matches(typo, suggestion):
    for src in (f"1x8x{typo}", {"nodes": [{"device": typo, "devices_per_node": 8}]}):
        msg = _error(src)
        assert f"unknown device type {typo!r}" in msg
        assert f"Did you mean {suggestion!r}" in msg
        assert "A100-80GB" in msg and "custom device" in msg  # known types and the custom-device fix


def test_unknown_device_in_file_names_the_file(tmp_path):
    path = _write(tmp_path, "c.yaml", "nodes:\n  - device: A100-80\n    devices_per_node: 8\n")
    msg = _error(path)
    assert "Did you mean 'A100-80GB'" in msg


def test_malformed_yaml_reports_line_and_column(tmp_path):
    bad = "nodes:\n  - device: A100-80GB\n    devices_per_node: 8\n   count: 2\n"
    msg = _error(_write(tmp_path, "bad.yaml", bad))
    assert "malformed cluster file" in msg and "bad.yaml" in msg
    assert "line 4, column 4" in msg and "indentation" in msg
    unclosed = "nodes: [{device: T4, devices_per_node: 2}\nnetwork: {bandwidth_GBps: 25}\n"
    assert "line 2" in _error(_write(tmp_path, "unclosed.yaml", unclosed))


def test_malformed_json_reports_line_and_column(tmp_path):
    bad = '{\n  "nodes": [\n    {"device": "T4", "devices_per_node": 2,}\n  ]\n}\n'
    msg = _error(_write(tmp_path, "bad.json", bad))
    assert "malformed cluster file" in msg and "line 3, column 44" in msg


@pytest.mark.parametrize("network, key", [
    ({"bandwidth_GBps": -25, "latency_us": 5}, "network.bandwidth_GBps must be positive, got -25"),
    ({"bandwidth_GBps": 0}, "network.bandwidth_GBps must be positive, got 0"),
    ({"bandwidth_GBps": 25, "latency_us": -1}, "network.latency_us must be non-negative, got -1"),
    ({}, "network.bandwidth_GBps is missing"),
    ({"kind": "IB"}, "network.bandwidth_GBps is missing"),
    ({"bandwidth_GBps": "fast"}, "network.bandwidth_GBps must be a number, got 'fast'"),
    ({"bandwidth_GBps": float("nan")}, "network.bandwidth_GBps must be finite"),
    ({"bandwidth": 25, "latency_us": 5}, "unknown key 'bandwidth'; did you mean 'bandwidth_GBps'"),
    (25, "network must be a mapping like {bandwidth_GBps: 25, latency_us: 5}, got 25"),
])
def test_bad_network_names_the_key(network, key):
    assert key in _error({"nodes": [{"device": "T4"}], "network": network})


def test_bad_intra_node_names_the_key_path(tmp_path):
    text = LAB_YAML.replace("intra_node: {bandwidth_GBps: 300,", "intra_node: {bandwidth_GBps: -300,")
    msg = _error(_write(tmp_path, "neg.yaml", text))
    assert "nodes[0].intra_node.bandwidth_GBps must be positive, got -300" in msg and "neg.yaml" in msg
    msg = _error({"nodes": [LAB_DICT["nodes"][0], {"device": "T4", "intra_node": {}}]})
    assert "nodes[1].intra_node.bandwidth_GBps is missing" in msg


@pytest.mark.parametrize("group, msg", [
    ({"device": "T4", "count": 0}, "nodes[0].count must be a positive integer, got 0"),
    ({"device": "T4", "count": -2}, "nodes[0].count must be a positive integer, got -2"),
    ({"device": "T4", "devices_per_node": 0}, "nodes[0].devices_per_node must be a positive integer, got 0"),
    ({"device": "T4", "devices_per_node": 2.5}, "devices_per_node must be a positive integer, got 2.5"),
    ({"device": "T4", "devices_per_node": "8"}, "devices_per_node must be a positive integer, got '8'"),
    ({"device": "T4", "count": True}, "nodes[0].count must be a positive integer, got True"),
    ({"devices_per_node": 8}, "nodes[0] has no 'device'"),
    ({"device": 5}, "nodes[0].device must be a catalog name like 'A100-80GB' or a mapping"),
    ({"device": "T4", "devices_per_nodes": 8},
     "nodes[0] has unknown key 'devices_per_nodes'; did you mean 'devices_per_node'"),
    ({"device": {"name": "X", "tflops_fp32": 1, "memory_GiB": 8}}, "missing 'memory_bandwidth_GBps'"),
    ({"device": {"name": "A100-80", "tflops_fp32": 1}}, "Did you mean 'A100-80GB'"),
    ({"device": {"name": "X", "tflops_fp32": -1, "memory_GiB": 8, "memory_bandwidth_GBps": 9}},
     "nodes[0].device.tflops_fp32 must be positive, got -1"),
    ({"device": {"based_on": "T4", "memory_GB": 8}}, "unknown key 'memory_GB'; did you mean 'memory_GiB'"),
    ({"device": {"based_on": "A100-80"}}, "Did you mean 'A100-80GB'"),
])
def test_bad_node_group(group, msg):
    assert msg in _error({"nodes": [group]})


@pytest.mark.parametrize("src, msg", [
    ({"nodes": []}, "'nodes' must be a non-empty list"),
    ({"name": "x"}, "'nodes' must be a non-empty list"),
    ({"nodes": "A100-80GB"}, "'nodes' must be a non-empty list"),
    ({"node": [{"device": "T4"}]}, "unknown key 'node'; did you mean 'nodes'"),
    ({"nodes": ["T4"]}, "nodes[0] must be a mapping with 'device' and 'devices_per_node', got 'T4'"),
    ("0x8xA100-80GB", "count must be a positive integer, got 0"),
    ("1x0xT4", "devices_per_node must be a positive integer, got 0"),
    ("2x8", "expected NODESxDEVICESxTYPE groups joined by '+'"),
    ("2x8xA100-80GB+", "cannot read cluster shorthand part ''"),
    (42, "not int"),
    (["1x8xA100-80GB"], "not list"),
    ("no/such/cluster.yaml", "'no/such/cluster.yaml' does not exist"),
])
def test_bad_cluster(src, msg):
    assert msg in _error(src)


def test_bad_file_contents(tmp_path):
    msg = _error(_write(tmp_path, "l.yaml", "- a\n- b\n"))
    assert "must hold a mapping with a 'nodes' list, got list" in msg
    assert "got NoneType" in _error(_write(tmp_path, "empty.yaml", ""))
    assert "got list" in _error(_write(tmp_path, "l.json", "[1, 2]"))
    text = "nodes:\n  - device: T4\n    count: 0\n"
    assert "nodes[0].count must be a positive integer, got 0" in _error(_write(tmp_path, "zero.yaml", text))


def test_extra_keys_are_allowed():
    c = Cluster.load({"name": "x", "notes": "rack 3", "nodes": [
        {"device": "T4", "devices_per_node": 2, "rack": "b7",
         "intra_node": {"bandwidth_GBps": 10, "latency_us": 1, "comment": "bridge"}}]})
    assert c.world_size == 2 and c.nodes[0].intra_node == Link(10 * GB, 1e-6, "")


def test_spec_lookup_error_names_the_types():
    with pytest.raises(ClusterError, match=r"no device of type 'T4'.*\['A100-80GB', 'V100-16GB'\]"):
        Cluster.load(LAB_DICT).spec("T4")


def test_cluster_error_is_a_value_error():
    assert issubclass(ClusterError, ValueError)
