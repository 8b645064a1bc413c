"""Random (often broken) cluster descriptions: a valid cluster or a clear ClusterError, nothing else."""

from __future__ import annotations

import math

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar
from autopar.catalog import CATALOG
from autopar.errors import AutoparError, ClusterError

NAMES = sorted(CATALOG) + ["cpu", "A100", "a100-80gb", "Z9000", "", "T4x"]
NUMBERS = st.one_of(st.integers(-5, 300), st.floats(allow_nan=True, allow_infinity=True, width=32),
                    st.text(max_size=4), st.none(), st.booleans())
LINK = st.one_of(st.none(), st.text(max_size=3),
                 st.fixed_dictionaries({}, optional={"bandwidth_GBps": NUMBERS, "latency_us": NUMBERS,
                                                     "bandwith_GBps": NUMBERS}))
DEVICE = st.one_of(st.sampled_from(NAMES), st.fixed_dictionaries(
    {"name": st.sampled_from(["chip", "A100-80GB", ""])},
    optional={"tflops_fp32": NUMBERS, "tflops_bf16": NUMBERS, "memory_GiB": NUMBERS,
              "memory_bandwidth_GBps": NUMBERS, "based_on": st.sampled_from(NAMES)}))
GROUP = st.one_of(st.text(max_size=3), st.fixed_dictionaries(
    {}, optional={"device": DEVICE, "devices_per_node": NUMBERS, "count": NUMBERS, "intra_node": LINK}))
CLUSTER = st.fixed_dictionaries({}, optional={"name": st.text(max_size=5),
                                              "nodes": st.one_of(st.lists(GROUP, max_size=3), NUMBERS),
                                              "network": LINK})


def _load_valid_or_fail_clearly(source: object, error: type[Exception] = ClusterError) -> None:
    """Loading `source` gives a valid cluster, or `error` with a message (no traceback in it)."""
    try:
        c = autopar.Cluster.load(source)
    except error as e:
        msg = str(e)
        assert msg and "Traceback" not in msg
        return
    _check_valid(c)


def _check_valid(c: autopar.Cluster) -> None:
    assert c.world_size >= 1
    assert [d.index for d in c.devices] == list(range(c.world_size))
    for d in c.devices:
        assert d.spec.memory > 0 and d.spec.memory_bandwidth > 0
        assert all(v > 0 and math.isfinite(v) for v in d.spec.peak_flops.values())
    for node in c.nodes:
        assert node.intra_node.bandwidth > 0 and node.intra_node.latency >= 0
    assert c.network.bandwidth > 0
    assert autopar.Cluster.load(c.to_dict()).devices == c.devices


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(CLUSTER)
def test_random_cluster_dicts_load_or_fail_clearly(d: dict) -> None:
    _load_valid_or_fail_clearly(d)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=40))
def test_random_shorthand_strings(s: str) -> None:
    _load_valid_or_fail_clearly(s, AutoparError)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(CLUSTER, st.integers(0, 60))
def test_random_cluster_files_even_truncated(tmp_path_factory, d: dict, cut: int) -> None:
    path = tmp_path_factory.mktemp("c") / "cluster.yaml"
    text = yaml.safe_dump(d)
    path.write_text(text[: len(text) - cut] if cut < len(text) else text)
    _load_valid_or_fail_clearly(path)
