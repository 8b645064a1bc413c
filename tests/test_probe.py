"""`autopar probe` on 2 local gloo processes: the written cluster file loads, its measured figures are
positive, and the comm model prices with them as measured (alpha-beta, nothing derated)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from autopar import Cluster
from autopar.cost_models.comm import collective_time, p2p_time


def _probe(tmp_path, cluster: dict, name: str) -> tuple[Cluster, dict]:
    src, out = tmp_path / f"{name}.yaml", tmp_path / f"{name}_measured.yaml"
    src.write_text(yaml.safe_dump(cluster))
    proc = subprocess.run([sys.executable, "-m", "autopar.cli", "probe", "--cluster", str(src), "--out", str(out),
                           "--max-mib", "1", "--iters", "3"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Cluster.load(out), yaml.safe_load(out.read_text())


@pytest.mark.parametrize("layout", ["one_node", "two_nodes"])
def test_probe_writes_measured_links_the_model_uses(tmp_path, layout):
    per, count = (2, 1) if layout == "one_node" else (1, 2)
    c, raw = _probe(tmp_path, {"name": "lab", "nodes": [{"device": "cpu", "devices_per_node": per, "count": count}]},
                    layout)
    assert c.world_size == 2 and c.name == "lab"
    link = c.link(0, 1)
    assert link.measured and link.bandwidth > 0 and link.latency > 0
    if layout == "one_node":
        assert c.nodes[0].intra_node == link and not c.network.measured
    else:
        assert c.network == link and c.devices[1].node == 1
    (rec,) = raw["probe"]["records"]
    assert rec["ranks"] == [0, 1] and rec["p2p"]["latency_us"] > 0 and rec["p2p"]["bandwidth_GBps"] > 0
    # The fit reproduces the timed all_reduces: 8 bytes is 2 ring steps of the measured latency (capped at
    # half the large all_reduce's time when noise made the small one no faster)
    t_small, t_large = rec["all_reduce_s"]["8"], rec["all_reduce_s"][str(2**20)]
    assert 2 * link.latency == pytest.approx(min(t_small, t_large / 2), rel=1e-6)
    assert collective_time("all_reduce", 2**20, [0, 1], c, "ring") == pytest.approx(t_large, rel=1e-6)
    # gloo prices p2p on the measured figures as given: latency + n / bandwidth
    n = 4 * 2**20
    assert p2p_time(n, 0, 1, c) == pytest.approx(link.latency + n / link.bandwidth)
    assert Cluster.load(c.to_dict()) == c  # measured links round-trip
