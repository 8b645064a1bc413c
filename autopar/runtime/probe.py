"""`autopar probe`: measure the links of the machines at hand and write them into a cluster file.

Launched like `autopar run` (one process per device of the cluster file; gloo processes on a machine
without GPUs, NCCL on GPUs). Every rank runs `main()`; groups are timed one at a time, the others wait:

* inside each node with two or more devices: all_reduce over the node's devices;
* between each pair of nodes: all_reduce between the first device of each;
* per measured pair, send/recv ping-pong of the same sizes, and the first transfer (connection setup).

An all_reduce of ``n`` bytes over ``p`` ranks is a ring of ``2(p-1)`` steps, so from the median time of an
8-byte one (``t_small``) and of a large one (``t_large``, ``--max-mib``) the link's measured ring step is

    latency   = t_small / (2(p-1))
    bandwidth = 2(p-1)/p n / (t_large - 2(p-1) latency)      (nccl-tests' busbw)

Rank 0 writes the cluster file given by ``--out`` (YAML, or JSON for a .json name): the input cluster with
each node group's ``intra_node`` and the ``network`` replaced by the slowest measured figures
(``measured: true``), a ``links`` entry per node pair when there are three or more nodes, and the raw
timings under ``probe`` (ignored when the file is loaded).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..cluster import Cluster
from ..errors import AutoparError
from .devices import comm_device
from .dist import ensure_initialized

SMALL_BYTES = 8


def _device() -> torch.device:
    return comm_device()  # the CUDA device under NCCL (alone or "cpu:gloo,cuda:nccl"), else the CPU


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_all_reduce(nbytes: int, group: Any, device: torch.device, iters: int) -> float:
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    times = []
    for i in range(iters + 2):  # two warm-up rounds
        _sync(device)
        start = time.perf_counter()
        dist.all_reduce(x, group=group)
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_ping_pong(nbytes: int, me: int, peer: int, device: torch.device, iters: int) -> tuple[float, float]:
    """(first one-way transfer s, median one-way transfer s) between `me` and `peer` (global ranks)."""
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    times = []
    for _ in range(iters + 1):
        _sync(device)
        start = time.perf_counter()
        if me < peer:
            dist.send(x, peer)
            dist.recv(x, peer)
        else:
            dist.recv(x, peer)
            dist.send(x, peer)
        _sync(device)
        times.append((time.perf_counter() - start) / 2)
    return times[0], statistics.median(times[1:])


def _link_figures(p: int, n_large: int, t_small: float, t_large: float) -> dict[str, float]:
    steps = 2 * (p - 1)
    # a noisy run can time the small all_reduce no faster than the large one: the latency then takes at most
    # half of the large one's time, so the figures still reproduce it
    latency = min(t_small, t_large / 2) / steps
    transfer = t_large - steps * latency
    return {"bandwidth_GBps": steps / p * n_large / transfer / 1e9, "latency_us": latency * 1e6}


def measure(cluster: Cluster, rank: int, max_bytes: int, iters: int) -> list[dict[str, Any]]:
    """Time every node's devices and every node pair, one group at a time; every rank returns the records
    of the groups it led (first member)."""
    device = _device()
    groups: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []  # (what, nodes, ranks)
    for node in cluster.nodes:
        if len(node.devices) > 1:
            groups.append(("intra_node", (node.index, node.index), node.devices))
    for a in cluster.nodes:
        for b in cluster.nodes[a.index + 1:]:
            groups.append(("network", (a.index, b.index), (a.devices[0], b.devices[0])))
    handles = [dist.new_group(list(ranks)) for _, _, ranks in groups]  # same order on every rank
    records = []
    for (what, nodes, ranks), handle in zip(groups, handles, strict=True):
        dist.barrier()
        if rank not in ranks:
            continue
        p = len(ranks)
        t_small = _time_all_reduce(SMALL_BYTES, handle, device, iters)
        t_large = _time_all_reduce(max_bytes, handle, device, iters)
        rec: dict[str, Any] = {"what": what, "nodes": list(nodes), "ranks": list(ranks),
                               "all_reduce_s": {str(SMALL_BYTES): t_small, str(max_bytes): t_large},
                               **_link_figures(p, max_bytes, t_small, t_large)}
        if rank in ranks[:2]:
            peer = ranks[1] if rank == ranks[0] else ranks[0]
            first, small = _time_ping_pong(SMALL_BYTES, rank, peer, device, iters)
            _, large = _time_ping_pong(max_bytes, rank, peer, device, iters)
            rec["p2p"] = {"first_transfer_us": first * 1e6, "latency_us": small * 1e6,
                          "bandwidth_GBps": max_bytes / max(large - small, 1e-12) / 1e9}
        if rank == ranks[0]:
            records.append(rec)
    dist.barrier()
    return records


def _slowest(records: list[dict[str, Any]]) -> dict[str, float]:
    return {"bandwidth_GBps": min(r["bandwidth_GBps"] for r in records),
            "latency_us": max(r["latency_us"] for r in records)}


def cluster_with_measurements(cluster: Cluster, records: list[dict[str, Any]], backend: str) -> dict:
    """The cluster file (as a dict) with the measured figures written in (module docstring)."""
    out = copy.deepcopy(cluster.source) if cluster.source else cluster.to_dict()
    for g, group in enumerate(out["nodes"]):
        recs = [r for r in records if r["what"] == "intra_node" and cluster.nodes[r["nodes"][0]].group == g]
        if recs:
            kind = cluster.nodes[recs[0]["nodes"][0]].intra_node.kind
            group["intra_node"] = {**_slowest(recs), "kind": kind, "measured": True}
    net = [r for r in records if r["what"] == "network"]
    if net:
        out["network"] = {**_slowest(net), "kind": cluster.network.kind, "measured": True}
        if len(cluster.nodes) > 2:
            out["links"] = [{"nodes": r["nodes"], "bandwidth_GBps": r["bandwidth_GBps"],
                             "latency_us": r["latency_us"], "kind": cluster.network.kind} for r in net]
    out["probe"] = {"backend": backend, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "records": records}
    return out


def write_cluster_file(data: dict, path: str) -> None:
    p = Path(path)
    if p.suffix.lower() == ".json":
        p.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
        return
    import yaml

    p.write_text(yaml.safe_dump(data, sort_keys=False))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m autopar.runtime.probe")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-mib", type=float, default=None, help="large message size (default 64 GPU, 4 CPU)")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args(argv)
    spec = os.environ.get("AUTOPAR_CLUSTER")
    if not spec:
        raise AutoparError("autopar probe runs under `autopar probe --cluster C --out FILE` (AUTOPAR_CLUSTER "
                           "is not set).")
    cluster = Cluster.load(spec)
    rank, world = ensure_initialized()
    if world != cluster.world_size:
        raise AutoparError(f"autopar probe: {world} processes for a cluster of {cluster.world_size} devices; "
                           f"start one process per device (no --nproc).")
    backend = dist.get_backend()
    mib = args.max_mib if args.max_mib is not None else (64.0 if "nccl" in backend else 4.0)
    records = measure(cluster, rank, int(mib * 2**20), args.iters)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, records)
    if rank == 0:
        everything = [r for recs in gathered for r in recs]
        write_cluster_file(cluster_with_measurements(cluster, everything, backend), args.out)
        print(f"autopar probe: measured {len(everything)} link(s) with {backend}; wrote {args.out}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
