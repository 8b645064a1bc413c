"""Host memory is a resource: cluster files give it per node (defaults per device type), offloading plans
respect it, estimates report a host that overflows, and a model that fits nowhere gets an InfeasibleError
naming the bytes needed, never a plan.

Expected host bytes are written out from what runtime/zero.py keeps on the host: with the optimizer
offloaded an fp32 copy of each owned parameter (4 B), an fp32 copy of its gradient (4 B) and AdamW's two
fp32 moments (8 B); with parameters offloaded a copy of each parameter (fp32 here: 4 B).
"""

from __future__ import annotations

import functools
import os

import pytest

import autopar
from autopar import Cluster, ClusterError, InfeasibleError, Strategy
from autopar.api import cost_model
from autopar.cluster import GiB
from autopar.models import gpt, gpt_config
from autopar.report import fmt_bytes
from autopar.solver.pricing.pricing import price_strategy
from autopar.solver.search.search import search

ADAMW_HOST = 4 + 4 + 8  # fp32 master + fp32 gradient copy + exp_avg + exp_avg_sq, per owned parameter
SMALL = dict(batch=2, seq=16, vocab=128, hidden=256, layers=2, heads=4)


def _error(x) -> str:
    with pytest.raises(ClusterError) as ei:
        Cluster.load(x)
    return str(ei.value)


@functools.cache
def _small():
    return gpt(device="meta", **SMALL)


def _params(case) -> int:
    return sum(p.numel() for p in case.model.parameters())


def _cm(cluster: dict | str):
    c = _small()
    return cost_model(c.model, cluster, c.example_inputs, c.example_target, c.loss_fn, precision="fp32")


# ---- cluster files ------------------------------------------------------------------------------------


def test_host_memory_from_a_cluster_file_round_trips(tmp_path) -> None:
    path = tmp_path / "lab.yaml"
    path.write_text("nodes:\n  - device: A100-80GB\n    devices_per_node: 8\n    count: 2\n"
                    "    host_memory_GiB: 512\n  - device: T4\n    devices_per_node: 4\n")
    c = Cluster.load(str(path))
    assert [n.host_memory for n in c.nodes] == [512 * GiB, 512 * GiB, 192 * GiB]  # T4: g4dn.12xlarge
    d = c.to_dict()
    assert [g["host_memory_GiB"] for g in d["nodes"]] == [512, 192]
    assert Cluster.load(d) == c
    assert c.subset([8, 16, 17]).nodes[0].host_memory == 512 * GiB  # a subset keeps its machines' RAM
    assert Cluster.load({"nodes": [{"device": "T4", "host_memory_GiB": 0}]}).nodes[0].host_memory == 0


def test_host_memory_defaults_per_device_type() -> None:
    def host(s: str) -> list[float]:
        return [n.host_memory / GiB for n in Cluster.load(s).nodes]

    assert host("1x2xT4") == [96]  # 48 GiB per T4
    assert host("2x8xA100-80GB+1x8xV100-16GB") == [2048, 2048, 512]  # DGX A100 640GB: 2 TiB; DGX-1: 512 GiB
    assert host("1x8xH100-SXM") == [2048]  # DGX H100
    assert host("1x2xRTX-4090") == [128]  # consumer box
    # a Jetson shares one memory with its CPU: the host is that pool
    assert host("2x1xJetson-AGX-Orin") == [32, 32]
    # the cpu device is this machine: its RAM, measured
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert Cluster.load("1x4xcpu").nodes[0].host_memory == ram
    # a custom device based on a catalog one takes its share; one based on nothing a generic GPU server's
    based = {"device": {"name": "big", "based_on": "H100-SXM", "memory_GiB": 120}, "devices_per_node": 2}
    assert Cluster.load({"nodes": [based]}).nodes[0].host_memory == 512 * GiB
    custom = {"name": "x", "tflops_fp32": 10, "memory_GiB": 8, "memory_bandwidth_GBps": 100}
    assert Cluster.load({"nodes": [{"device": custom}]}).nodes[0].host_memory == 64 * GiB


@pytest.mark.parametrize("value, says", [(-1, "non-negative"), ("lots", "must be a number"),
                                         (True, "must be a number"), (float("nan"), "finite")])
def test_bad_host_memory_names_the_key(value, says) -> None:
    msg = _error({"nodes": [{"device": "T4"}, {"device": "T4", "host_memory_GiB": value}]})
    assert "nodes[1].host_memory_GiB" in msg and says in msg


def test_host_memory_typo_in_a_file_is_named(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("nodes:\n  - device: T4\n    host_memory_gib: 64\n")
    msg = _error(str(path))
    assert str(path) in msg and "'host_memory_gib'" in msg and "did you mean 'host_memory_GiB'" in msg


# ---- pricing ------------------------------------------------------------------------------------------


def test_estimate_counts_what_each_offload_keeps_on_the_host() -> None:
    P = _params(_small())
    cm = _cm("1x2xA100-80GB")
    opt = price_strategy(cm, Strategy(offload=("optimizer",), dp=2, zero=1))  # each owns half the parameters
    assert opt.fits and opt.predicted["host_memory_bytes"] == [P * ADAMW_HOST]
    par = price_strategy(cm, Strategy(tp=2, offload=("params",)))
    assert par.predicted["host_memory_bytes"][0] > 0
    # ZeRO-1: each keeps a copy of every parameter, and the half it does not own streams its fp32
    # gradients to the host (runtime/zero_layers.py)
    z1 = price_strategy(cm, Strategy(dp=2, zero=1, offload=("params",)))
    assert z1.predicted["host_memory_bytes"] == [2 * (P * 4 + P // 2 * 4)]
    one = _cm("1x1xA100-80GB")
    assert price_strategy(one, Strategy(offload=("params",))).predicted["host_memory_bytes"] == [P * 4]
    # both: the optimizer's fp32 copy is the parameter's host copy
    both = price_strategy(one, Strategy(offload=("optimizer", "params")))
    assert both.predicted["host_memory_bytes"] == [P * ADAMW_HOST]
    act = price_strategy(one, Strategy(offload=("activations",)))
    assert act.predicted["host_memory_bytes"][0] > 0
    assert price_strategy(one, Strategy()).predicted["host_memory_bytes"] == [0]


def test_estimate_over_the_host_limit_does_not_fit_and_says_why() -> None:
    P = _params(_small())
    host_gib = P * ADAMW_HOST / 2 / GiB  # half of what the offloaded optimizer keeps
    cluster = {"nodes": [{"device": "A100-80GB", "devices_per_node": 2, "host_memory_GiB": host_gib}]}
    c = _small()
    est = autopar.estimate(c.model, cluster, Strategy(dp=2, zero=1, offload=("optimizer",)), c.example_inputs,
                           c.example_target, c.loss_fn, precision="fp32")
    assert not est.fits
    (problem,) = est.memory_problems
    assert "node 0" in problem and "host memory" in problem and fmt_bytes(P * ADAMW_HOST) in problem
    assert "host_memory_GiB" in problem  # what would fix it
    assert "DOES NOT FIT" in est.explain()
    assert autopar.estimate(c.model, cluster, Strategy(dp=2), c.example_inputs, c.example_target, c.loss_fn,
                            precision="fp32").fits


def test_unified_memory_offload_stays_in_the_device() -> None:
    """On a Jetson the host is the device's own memory: offloading the optimizer frees nothing there
    (its peak grows by the host copies), while on a GPU server it shrinks the device's peak."""
    P = _params(_small())
    for cluster, grows in (("1x1xJetson-AGX-Orin", True), ("1x1xA100-80GB", False)):
        cm = _cm(cluster)
        plain = price_strategy(cm, Strategy()).predicted["peak_memory_bytes"][0]
        off = price_strategy(cm, Strategy(offload=("optimizer",))).predicted["peak_memory_bytes"][0]
        assert (off > plain) == grows
        if grows:  # optimizer state (8 B) leaves the device's share and 16 B come back as host copies; the
            # device's foreach AdamW step buffer (4 B per parameter, after the schedule) leaves too where it,
            # not the activations, set the peak
            assert P * (ADAMW_HOST - 8 - 4) - 2 <= off - plain <= P * (ADAMW_HOST - 8) + 2


# ---- search -------------------------------------------------------------------------------------------


def _offload_only_device() -> tuple[dict, int]:
    """A custom device on which the small GPT fits only with its optimizer offloaded: usable memory =
    parameters x 12 B + the after-state term (no offload needs 16 B per parameter, offloading the optimizer 8;
    the term is the larger of the activations and the device's foreach AdamW step buffer, 4 B per parameter)."""
    P = _params(_small())
    roomy = price_strategy(_cm("1x1xA100-80GB"), Strategy()).predicted["peak_memory_bytes"][0]
    acts = roomy - P * 16
    # recompute and micro-batching cannot save the 4 B per parameter: without offload the state and the step
    # buffer alone (20 B) exceed 12 B + acts while acts < 8 B per parameter
    assert P * 4 <= acts < P * 8
    gib = (P * 12 + acts) / 0.9 / GiB
    return {"name": "snug", "based_on": "A100-80GB", "memory_GiB": gib}, P


def test_search_offloads_when_the_host_has_room() -> None:
    device, P = _offload_only_device()
    plan = search(_cm({"nodes": [{"device": device}]}), time_limit_s=20)
    (stage,) = plan.pipelines[0].stages
    assert "optimizer" in stage.offload
    used, cap = plan.predicted["host_memory_bytes"][0], plan.predicted["host_capacity_bytes"][0]
    assert used >= P * ADAMW_HOST and used <= 0.9 * cap


def test_search_raises_when_the_offload_needs_more_host_than_there_is() -> None:
    device, P = _offload_only_device()
    host_gib = P * 8 / GiB  # room for half of what the offloaded optimizer keeps
    with pytest.raises(InfeasibleError) as info:
        search(_cm({"nodes": [{"device": device, "host_memory_GiB": host_gib}]}), time_limit_s=20)
    msg = str(info.value)
    assert "Host memory is what does not fit" in msg
    assert f"keep {fmt_bytes(P * ADAMW_HOST)} in host memory" in msg  # the bytes the host would need
    assert "host_memory_GiB" in msg and "node 0" in msg
    with pytest.raises(InfeasibleError) as info:  # no host memory at all
        search(_cm({"nodes": [{"device": device, "host_memory_GiB": 0}]}), time_limit_s=20)
    assert "host memory" in str(info.value) and "node 0" in str(info.value)


def test_gpt3_175b_on_two_t4_is_infeasible_not_a_plan() -> None:
    """Issue 13: the 175B shape on one 2xT4 node (96 GiB of host memory) used to get a plan offloading
    ~2.5 TiB of training state to a host nothing modelled."""
    case = gpt(**gpt_config("gpt3-175b"), batch=8, device="meta")
    P = _params(case)
    with pytest.raises(InfeasibleError) as info:
        autopar.plan(case.model, "1x2xT4", case.example_inputs, case.example_target, case.loss_fn,
                     time_limit_s=20, precision="fp16")
    msg = str(info.value)
    assert f"{P:,} parameters" in msg and fmt_bytes(P * 16) in msg  # the training state, 16 B per parameter
    assert "96.00GiB of host memory" in msg and "node 0" in msg and "host_memory_GiB" in msg
