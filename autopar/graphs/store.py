"""Partition-local graph data: one directory, one safetensors file per rank, written once for a plan.

`write_parts(x, edge_index, y, plan, out_dir)` (`autopar.graphs.partition`) cuts the graph as the plan's
partition does (its partitioner's order cut into `plan.graph["shares"]`, partitioners.py) and writes:

    out_dir/meta.json            format, the plan (JSON) and its partition fingerprint, world size, graph sizes,
                                 the global labelled count, per rank: nodes, halo, in-edges, rows sent, file, bytes
    out_dir/rank{r}.safetensors  rank r's part (metadata: format, rank, world, fingerprint):
        x            (n_r, F)  the features' dtype  features of the owned nodes, in local row order
        y            (n_r,)    int64  labels of the owned nodes (-100: unlabelled)
        owned        (n_r,)    int64  GLOBAL ids of the owned nodes = local rows 0..n_r-1
        halo         (h_r,)    int64  GLOBAL ids of the halo nodes = local rows n_r..n_r+h_r-1, grouped by owner
        halo_owner   (h_r,)    int64  the rank owning each halo node
        edge_index   (2, E_r)  int64  LOCAL rows: every in-edge of an owned node (row 0 sources in [0, n_r+h_r),
                                      row 1 destinations in [0, n_r)), in the input's edge order
        degree       (n_r+h_r,) int64 GLOBAL in-degree (self-loops excluded) of every local row (GCN's norm)
        send_index   (s_r,)    int64  LOCAL owned rows other ranks need, grouped by destination rank
        send_counts  (world,)  int64  rows sent to each rank;  recv_counts (world,) int64: halo rows from each

A rank opens meta.json and its own file only (`open_part`); nothing of another rank's part, nor the whole
graph, is ever in its memory. The writer streams: the edge list is in memory once with a few per-edge index
arrays (owner of each destination, one sort by it); each rank's features are gathered from `x` (which may be
memory-mapped, e.g. a safetensors file opened with safe_open, or a numpy memmap) while its file is written,
one rank at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import PlanError
from ..ir.plan import Plan
from .data import IGNORE, in_degree
from .halo import Partition
from .partitioners import owners, partition_order

FORMAT = "autopar-graph-parts/1"
META = "meta.json"
TENSORS = ("x", "y", "owned", "halo", "halo_owner", "edge_index", "degree", "send_index", "send_counts",
           "recv_counts")


def part_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def fingerprint(graph: dict) -> str:
    """What a directory's parts depend on in the plan: the graph's sizes, the shares and the partitioner."""
    keys = ("num_nodes", "num_edges", "features", "shares", "partitioner", "partition_seed", "metis")
    blob = json.dumps({k: graph.get(k) for k in keys}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _plan(plan: Any) -> Plan:
    plan = Plan.from_json(plan) if isinstance(plan, (str, bytes)) else plan
    if not isinstance(plan, Plan) or not plan.graph or plan.graph.get("mode") != "partition":
        raise PlanError("partition-local graph data is written for a partition-mode graph plan: plan it with "
                        "autopar.plan(model, cluster, (x, edge_index), y, loss_fn) (graph_options mode "
                        "'partition', the default).")
    return plan


def write_parts(x: torch.Tensor, edge_index: torch.Tensor, y: torch.Tensor, plan: Any,
                out_dir: str | os.PathLike) -> Path:
    """Write every rank's part of the graph for `plan` into `out_dir` (layout in the module docstring)."""
    from .data import check_graph_inputs

    plan = _plan(plan)
    g = plan.graph
    check_graph_inputs(x, edge_index)
    n, e = int(x.shape[0]), int(edge_index.shape[1])
    if g.get("num_nodes") not in (None, n) or g.get("num_edges") not in (None, e):
        raise PlanError(f"the plan was made for a graph of {g.get('num_nodes')} nodes and {g.get('num_edges')} "
                        f"edges, this one has {n} and {e}: plan again for this graph.")
    if y.shape[0] != n:
        raise PlanError(f"y has {y.shape[0]} labels for {n} nodes: one label per node (-100: unlabelled).")
    shares = [int(s) for s in g["shares"]]
    world = len(shares)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    edge_index = edge_index.long()
    order = partition_order(edge_index, n, g)
    bounds = [0]
    for s in shares:
        bounds.append(bounds[-1] + s)
    position = torch.empty(n, dtype=torch.long)
    position[order] = torch.arange(n)
    owner = owners(order, shares)
    src, dst = edge_index[0], edge_index[1]
    dst_owner = owner[dst]
    by_rank = torch.argsort(dst_owner, stable=True)  # each rank's in-edges, in the input's order
    starts = [0] + torch.cumsum(torch.bincount(dst_owner, minlength=world), 0).tolist()
    del dst_owner
    halos = []  # positions in `order` of each rank's halo, sorted (so grouped by owner)
    for q in range(world):
        s = torch.unique(position[src[by_rank[starts[q]:starts[q + 1]]]])
        halos.append(s[(s < bounds[q]) | (s >= bounds[q + 1])])
    degree = in_degree(edge_index, n, exclude_self_loops=True)
    labelled = int((y != IGNORE).sum())
    fp = fingerprint(g)
    local_of = torch.full((n,), -1, dtype=torch.long)
    ranks = []
    for r in range(world):
        lo, hi = bounds[r], bounds[r + 1]
        owned, halo_pos = order[lo:hi], halos[r]
        halo = order[halo_pos]
        local_of[owned] = torch.arange(hi - lo)
        local_of[halo] = torch.arange(hi - lo, hi - lo + halo.numel())
        mine = by_rank[starts[r]:starts[r + 1]]
        edges = torch.stack([local_of[src[mine]], local_of[dst[mine]]])
        local_of[owned] = -1
        local_of[halo] = -1
        send, send_counts, recv_counts = [], [], []
        for q in range(world):
            h = halos[q]
            from_me = h[(h >= lo) & (h < hi)] if q != r else h[:0]
            send.append(from_me - lo)
            send_counts.append(from_me.numel())
            recv_counts.append(int(((halo_pos >= bounds[q]) & (halo_pos < bounds[q + 1])).sum()) if q != r else 0)
        tensors = {"x": x[owned].contiguous(), "y": y[owned].long().contiguous(), "owned": owned.contiguous(),
                   "halo": halo.contiguous(),
                   "halo_owner": torch.bucketize(halo_pos, torch.tensor(bounds[1:-1]), right=True),
                   "edge_index": edges.contiguous(), "degree": degree[torch.cat([owned, halo])],
                   "send_index": torch.cat(send), "send_counts": torch.tensor(send_counts, dtype=torch.long),
                   "recv_counts": torch.tensor(recv_counts, dtype=torch.long)}
        path = out / part_file(r)
        save_file(tensors, str(path), metadata={"format": FORMAT, "rank": str(r), "world": str(world),
                                                 "fingerprint": fp})
        ranks.append({"file": path.name, "nodes": hi - lo, "halo": halo.numel(), "edges": int(mine.numel()),
                      "send": int(sum(send_counts)), "bytes": sum(t.numel() * t.element_size()
                                                               for t in tensors.values())})
        del tensors
    meta = {"format": FORMAT, "fingerprint": fp, "world": world, "num_nodes": n, "num_edges": e,
            "features": int(x.shape[1]) if x.dim() > 1 else 1, "dtype": str(x.dtype).replace("torch.", ""),
            "labelled": labelled, "shares": shares, "partitioner": g.get("partitioner", "locality"),
            "ranks": ranks, "plan": plan.to_json()}
    (out / META).write_text(json.dumps(meta, indent=1))
    return out


def read_meta(data_dir: str | os.PathLike) -> dict:
    path = Path(data_dir) / META
    if not path.is_file():
        raise PlanError(f"{path} does not exist: graph_data= is a directory written by "
                        f"autopar.graphs.partition(x, edge_index, y, plan, out_dir).")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise PlanError(f"{path} is format {meta.get('format')!r}, this autopar reads {FORMAT!r}: write the parts "
                        f"again with autopar.graphs.partition.")
    return meta


def plan_of(data_dir: str | os.PathLike) -> Plan:
    """The plan a directory was written for."""
    return Plan.from_json(read_meta(data_dir)["plan"])


@dataclass
class LocalPart:
    """What one rank reads of partition-local graph data: its `Partition` and its owned rows' data."""

    part: Partition
    x: torch.Tensor  # (n_r, F) owned features
    y: torch.Tensor  # (n_r,) owned labels
    halo_owner: torch.Tensor
    labelled: int  # labelled nodes of the whole graph (the loss's global count)
    meta: dict


def open_part(data_dir: str | os.PathLike, plan: Plan, rank: int, world: int) -> LocalPart:
    """Rank `rank`'s part: reads `meta.json` and `rank{rank}.safetensors`, nothing else. Clear errors for a
    directory written for another plan or world size, or a missing or foreign part file."""
    meta = read_meta(data_dir)
    where = Path(data_dir)
    if meta["world"] != world:
        raise PlanError(f"{where} holds parts for {meta['world']} ranks but {world} ranks run: write the parts for "
                        f"this plan with autopar.graphs.partition(x, edge_index, y, plan, out_dir).")
    mine = fingerprint(plan.graph or {})
    if meta["fingerprint"] != mine:
        raise PlanError(f"{where} was written for another plan (its partition: {meta['shares']} nodes by "
                        f"{meta['partitioner']}; this plan's: {plan.graph.get('shares')} by "
                        f"{plan.graph.get('partitioner', 'locality')}): compile with the plan it was written for "
                        f"(leave plan= out to use it) or write the parts again for this plan.")
    path = where / part_file(rank)
    if not path.is_file():
        raise PlanError(f"rank {rank}'s part {path} is missing: copy it from where autopar.graphs.partition wrote "
                        f"the parts, or write them again.")
    with safe_open(str(path), "pt") as f:
        md = f.metadata() or {}
        if md.get("fingerprint") != mine or md.get("rank") != str(rank) or md.get("world") != str(world):
            raise PlanError(f"{path} is rank {md.get('rank')} of {md.get('world')} for partition "
                            f"{md.get('fingerprint')}, not rank {rank} of {world} for this plan's "
                            f"({mine}): write the parts again.")
        missing = [k for k in TENSORS if k not in f.keys()]
        if missing:
            raise PlanError(f"{path} lacks {missing}: write the parts again with autopar.graphs.partition.")
        t = {k: f.get_tensor(k) for k in TENSORS}
    part = Partition(t["owned"], t["halo"], t["edge_index"], t["degree"], t["send_index"],
                     t["send_counts"].tolist(), t["recv_counts"].tolist(), [r["halo"] for r in meta["ranks"]],
                     [r["edges"] for r in meta["ranks"]])
    return LocalPart(part, t["x"], t["y"], t["halo_owner"], int(meta["labelled"]), meta)


__all__ = ["FORMAT", "LocalPart", "META", "TENSORS", "fingerprint", "open_part", "part_file", "plan_of",
           "read_meta", "write_parts"]
