"""GNN workloads (issue 6, issue 26 part 6): graph partitioning vs sampled data parallelism for GraphSAGE.

gnn_workloads(): predicted throughput (labelled nodes trained per second) of both modes for GraphSAGE on a
    generated 1M-node, 20M-edge graph on 4 mixed GPUs (2 A100-80GB + 2 V100-32GB on two nodes), from
    the graph cost model (autopar/graphs/cost.py) on meta tensors (nothing materialised; halos from the
    random-graph expectation), and the mode autopar.plan chooses.
gnn_measured(): measured nodes/s of both modes on 2 local gloo processes for a small generated graph, next
    to the cost model's prediction for a 2-CPU cluster.

Issue 26 part 6, measured on 4 local gloo ranks (one thread each) on generated clustered graphs
(data.clustered_graph: a stochastic-block-model-like generator, 10K nodes per community, 95 % of edges
inside one; TEST_FRACTION of the labels held out):
measured_partition(nodes, spec): the full graph, each rank reading only its part. autopar.plan, then
    autopar.graphs.partition writes the parts, every rank gets a directory with meta.json and its own file
    only, and compile(graph_data=) trains on it: epoch time (one full-graph step is one epoch), per-rank
    measured allocator peak (the plan check's window: reading the part and the first 3 steps) against the
    plan, edge cut and halo volume of the plan's partitioner beside the others it priced and pymetis run
    directly (default options, equal parts), and train / test accuracy against one process training the
    whole graph (losses and every parameter compared too).
measured_sampled(nodes): sampled_dp on 4 ranks (every rank holds the graph) against torch_geometric's
    NeighborLoader + the same model in one process (same fanout per layer and batch size; it needs pyg-lib or
    torch-sparse, else the row says so), and accuracy after a few epochs against sampled_dp in one process
    (the same algorithm: the same seeds and per-step samples).
The done-when run: measured_partition on WIDE (GCN on 256 features) at 200K nodes under a per-rank budget
below the graph's features and edges.

Run: cd bench && python wl_gnn.py            (everything: 30-60 minutes on 2 cores, about 10 GB of memory at
                                              2M nodes, the one-process reference 5 GB of it)
     cd bench && python wl_gnn.py --skip-small --sizes 100000 --wide-nodes 100000 --sampled-sizes 100000
                                             (a few minutes)
     --name NAME writes results/NAME.json; --merge keeps the rows of it this run does not measure again.
The committed results/wl_gnn.json came from runs with --merge (the 2M rows measured again after the first
full run was OOM-killed on the shared host), results/wl_gnn_sampled.json from --name wl_gnn_sampled.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import print_table, write_results
from safetensors import safe_open
from torch.nn import functional as F

import autopar
from autopar.errors import PlanDriftWarning
from autopar.graphs import store
from autopar.graphs.cost import GraphCostModel
from autopar.graphs.data import IGNORE, GraphData, clustered_graph
from autopar.graphs.models import GRAPH_CASES, PyGNet
from autopar.graphs.partitioners import order_of_parts, partition_quality, symmetric_csr
from autopar.graphs.planner import graph_stats
from autopar.model_case import building
from autopar.runtime.launch import spawn_local
from autopar.runtime.plan_check import STEPS as CHECK_STEPS

BIG = {"nodes": 1_000_000, "edges": 20_000_000, "features": 128, "hidden": 256, "layers": 2, "classes": 47}
MIXED = "1x2xA100-80GB+1x2xV100-32GB"
SMALL = {"nodes": 8_000, "avg_degree": 10.0, "features": 64, "hidden": 64, "layers": 2}
SMALL_SAMPLED = {"batch_size": 1024, "fanout": 10}


def gnn_workloads(cluster: str = MIXED, batch_per_device: int = 1024, fanout: int = 10) -> list[dict[str, Any]]:
    """One row per mode: predicted samples/s (labelled nodes/s), step time, shares, memory; plus the choice."""
    case = GRAPH_CASES["sage"](seed=0, nodes=64, features=BIG["features"], hidden=BIG["hidden"],
                               layers=BIG["layers"], classes=BIG["classes"])
    x = torch.empty(BIG["nodes"], BIG["features"], device="meta")
    edge_index = torch.empty(2, BIG["edges"], dtype=torch.long, device="meta")
    world = autopar.Cluster.load(cluster).world_size
    options = {"batch_size": batch_per_device * world, "fanout": fanout}
    t0 = time.perf_counter()
    plan = autopar.plan(case.model, cluster, (x, edge_index), None, case.loss_fn, graph_options=options)
    plan_s = time.perf_counter() - t0
    rows = []
    for mode, c in plan.graph["candidates"].items():
        rows.append({
            "workload": f"graphsage {BIG['layers']}x{BIG['hidden']} on 1M nodes / 20M edges, F={BIG['features']}",
            "cluster": cluster, "mode": mode, "chosen": mode == plan.graph["mode"], "fits": c["fits"],
            "predicted_nodes_per_s": c["samples_per_s"], "step_time_s": c["step_time_s"],
            "samples_per_step": c["samples_per_step"], "shares": c["shares"],
            "comm_s": c["comm_s"], "peak_memory_GiB": max(c["peak_memory_bytes"] or [0]) / 2**30,
            "halo": c.get("halo"), "features_on": c.get("features_on"), "plan_s": plan_s,
        })
    return rows


def _measure(rank: int, world: int, mode: str, steps: int) -> dict[str, Any]:
    case = GRAPH_CASES["sage"](seed=0, **SMALL)
    cluster = {"nodes": [{"device": "cpu", "devices_per_node": world}]}
    opts = {"mode": mode, **(SMALL_SAMPLED if mode == "sampled_dp" else {})}
    prog = autopar.compile(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn,
                           graph_options=opts, timeout_s=120)
    prog.step(*case.example_inputs, target=case.example_target)  # warm-up (partitioning, first allocations)
    torch.distributed.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        prog.step(*case.example_inputs, target=case.example_target)
    torch.distributed.barrier()
    return {"seconds": time.perf_counter() - t0, "plan": prog.plan.to_json()}


def gnn_measured(steps: int = 3) -> list[dict[str, Any]]:
    """Measured labelled nodes/s on 2 local gloo processes, partition vs sampled data parallel (< 60 s)."""
    rows = []
    for mode in ("partition", "sampled_dp"):
        out = spawn_local(_measure, 2, mode, steps, timeout_s=120)[0]
        plan = autopar.Plan.from_json(out["plan"])
        per_step = plan.global_batch
        case = GRAPH_CASES["sage"](seed=0, **SMALL)
        stats = graph_stats(*case.example_inputs, case.example_target)
        cm = GraphCostModel(case.model, stats, autopar.Cluster.load(plan.cluster), plan.precision)
        rows.append({
            "workload": f"graphsage on {SMALL['nodes']} nodes, degree {SMALL['avg_degree']:.0f}, 2 gloo ranks",
            "mode": mode, "measured_nodes_per_s": per_step * steps / out["seconds"],
            "predicted_nodes_per_s": plan.predicted["samples_per_s"], "samples_per_step": per_step,
            "step_time_s": out["seconds"] / steps, "shares": plan.graph["shares"],
            "halo": plan.graph.get("halo"), "cost_model_params": cm.params,
        })
    return rows


# ---- issue 26 part 6: measured on 4 gloo ranks, 100K to 2M nodes ---------------------------------------------
WORLD = 4
SWEEP = {"conv": "sage", "features": 16, "hidden": 32, "layers": 2, "classes": 4, "avg_degree": 10.0}
# the done-when graph: its features and edges exceed every rank's budget. A GCN transforms before it propagates
# (messages of width `hidden`), so a rank's activations stay below the wide feature matrix; GraphSAGE's first
# layer gathers F-wide messages per in-edge, E / 4 x F per rank at degree 10: more than the whole N x F.
WIDE = {"conv": "gcn", "features": 256, "hidden": 8, "layers": 2, "classes": 4, "avg_degree": 4.0}
SIZES = (100_000, 500_000, 2_000_000)
NODES_PER_BLOCK = 10_000  # community size of the generated graph
TEST_FRACTION = 0.2  # nodes whose label is held out: accuracy on nodes the training never saw
LR = 1e-2
RANK_GIB = 5.0  # the sweep's per-rank budget: about this host's 24 GiB over 4 ranks
EPOCHS = 6  # full-graph epochs: the first CHECK_STEPS inside the plan check's memory window, the rest timed
SAMPLED = {"batch_size": 1024, "fanout": 10}
SAMPLED_EPOCHS = 2  # sampled epochs compared with one process (where a run of them fits the time)
# threads of the one-process baselines: one, like each rank (spawn_local). Two threads on this shared 2-core
# host ran sampled steps 4-20x slower than one when other sessions loaded it (OpenMP threads waiting on a busy
# core), so the one-process figures would measure the contention, not the algorithm
ONE_PROCESS_THREADS = 1
EVAL_FILE = "eval_labels.pt"  # every owned node's label (held-out ones included), written beside each rank's part


def synthetic_graph(nodes: int, spec: dict, seed: int = 0) -> tuple[GraphData, torch.Tensor]:
    """(graph whose y hides TEST_FRACTION of the labels as IGNORE, every node's label)."""
    g = clustered_graph(nodes, max(8, nodes // NODES_PER_BLOCK), spec["avg_degree"], spec["features"],
                        spec["classes"], seed=seed)
    test = torch.rand(nodes, generator=torch.Generator().manual_seed(seed + 1)) < TEST_FRACTION
    y = g.y.clone()
    y[test] = IGNORE
    return GraphData(g.x, g.edge_index, y), g.y


def gnn_model(spec: dict) -> PyGNet:
    with building("cpu", 0):
        return PyGNet(spec["conv"], spec["features"], spec["hidden"], spec["layers"], spec["classes"])


def adamw(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, eps=1e-6)


def cpu_cluster(rank_bytes: float, world: int = WORLD) -> dict:
    """`world` CPU ranks whose usable memory (90 % of capacity) is `rank_bytes`."""
    return {"nodes": [{"device": {"name": "cpu-rank", "based_on": "cpu", "memory_GiB": rank_bytes / 0.9 / 2**30},
                       "devices_per_node": world}]}


def graph_bytes(g: GraphData) -> int:
    """The graph's features and edges."""
    return g.x.numel() * g.x.element_size() + g.edge_index.numel() * g.edge_index.element_size()


def accuracy(pred: torch.Tensor, y_train: torch.Tensor, y_all: torch.Tensor) -> torch.Tensor:
    """[correct train, train, correct test, test] counts (test: the nodes whose label training never saw)."""
    train = y_train != IGNORE
    hit = pred == y_all
    return torch.tensor([int(hit[train].sum()), int(train.sum()), int(hit[~train].sum()), int((~train).sum())],
                        dtype=torch.float64)


def _acc(counts: torch.Tensor) -> dict[str, float]:
    return {"train_acc": float(counts[0] / counts[1]), "test_acc": float(counts[2] / max(float(counts[3]), 1.0))}


def rank_dirs(parts: Path, world: int) -> list[Path]:
    """One directory per rank with meta.json and that rank's file only (hard links): a rank reading any other
    part would fail on the missing file."""
    dirs = []
    for r in range(world):
        d = parts.parent / f"{parts.name}-rank{r}"
        d.mkdir(exist_ok=True)
        for name in (store.META, store.part_file(r)):
            if not (d / name).exists():
                os.link(parts / name, d / name)
        dirs.append(d)
    return dirs


def partitioner_rows(edge_index: torch.Tensor, n: int, plan: autopar.Plan, nodes_label: str) -> list[dict]:
    """Edge cut and halo volume of every partitioner the plan priced (their shares), and of pymetis run
    directly on the same undirected graph (default options, equal parts)."""
    import numpy as np
    import pymetis

    g = plan.graph
    rows = [{"table": "partitioners", "graph": nodes_label, "partitioner": name, "chosen": name == g["partitioner"],
             "edge_cut": r["edge_cut"], "halo_volume": r["halo_volume"], "cut_edges": r["cut_edges"],
             "shares": r["shares"], "predicted_step_s": r["step_time_s"]} for name, r in g["partitioners"].items()]
    xadj, adjncy = symmetric_csr(edge_index, n)
    t0 = time.perf_counter()
    cut, parts = pymetis.part_graph(WORLD, xadj=xadj.numpy(), adjncy=adjncy.numpy())
    seconds = time.perf_counter() - t0
    order, shares = order_of_parts(torch.as_tensor(np.asarray(parts), dtype=torch.long), WORLD)
    q = partition_quality(edge_index, n, order, shares)
    rows.append({"table": "partitioners", "graph": nodes_label, "partitioner": "pymetis direct", "chosen": False,
                 "edge_cut": int(cut), "halo_volume": q["halo_volume"], "cut_edges": q["cut_edges"],
                 "shares": shares, "metis_s": seconds})
    return rows


def _partition_worker(rank: int, world: int, dirs: list[str], cluster: dict, spec: dict, epochs: int,
                      keep_state: bool) -> dict:
    """Compile from this rank's directory, train `epochs` full-graph steps, measure, evaluate its nodes."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PlanDriftWarning)
        t0 = time.perf_counter()
        prog = autopar.compile(gnn_model(spec), cluster, loss_fn=F.cross_entropy, optimizer=adamw,
                               graph_data=dirs[rank], timeout_s=900)
        compile_s = time.perf_counter() - t0
        losses, seconds = [], []
        for _ in range(epochs):
            t = time.perf_counter()
            losses.append(prog.step())
            seconds.append(time.perf_counter() - t)
        report = prog.report()
    mine = report.ranks[rank]
    pred = prog.eval_step().argmax(dim=1)
    counts = accuracy(pred, prog.y_local, torch.load(Path(dirs[rank]) / EVAL_FILE))
    dist.all_reduce(counts)
    return {"losses": losses, "epoch_s": seconds, "compile_s": compile_s, "counts": counts,
            "measured_peak": mine.measured_peak_bytes, "predicted_peak": mine.predicted_peak_bytes,
            "owned": prog.part.owned.numel(), "halo": prog.part.halo.numel(),
            "drift": [str(w.message) for w in caught if issubclass(w.category, PlanDriftWarning)],
            "state": prog.state_dict()["model"] if keep_state and rank == 0 else None}


def one_process(g: GraphData, y_all: torch.Tensor, spec: dict, epochs: int) -> dict:
    """The same model trained in one process on the whole graph (ONE_PROCESS_THREADS threads)."""
    torch.set_num_threads(ONE_PROCESS_THREADS)
    model = gnn_model(spec)
    opt = adamw(list(model.parameters()))
    losses, seconds = [], []
    for _ in range(epochs):
        t = time.perf_counter()
        loss = F.cross_entropy(model(g.x, g.edge_index), g.y)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
        seconds.append(time.perf_counter() - t)
    with torch.no_grad():
        counts = accuracy(model(g.x, g.edge_index).argmax(dim=1), g.y, y_all)
    return {"losses": losses, "epoch_s": seconds, "counts": counts,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def measured_partition(nodes: int, spec: dict, workdir: Path, *, rank_budget: float | None = None,
                       reference: bool = True, epochs: int = EPOCHS, label: str = "",
                       partial: Any = None) -> list[dict]:
    """Full-graph training from partition-local data on WORLD gloo ranks (module docstring); rows: one
    summary, one per rank, the partitioners. `partial(rows)` gets them before the one-process reference runs
    (which holds the whole graph's activations: the largest memory of the run)."""
    label = label or f"{spec['conv']} {nodes // 1000}K"
    t0 = time.perf_counter()
    g, y_all = synthetic_graph(nodes, spec)
    gen_s = time.perf_counter() - t0
    whole = graph_bytes(g)
    budget = rank_budget if rank_budget is not None else RANK_GIB * 2**30
    cluster = cpu_cluster(budget)
    t0 = time.perf_counter()
    plan = autopar.plan(gnn_model(spec), cluster, (g.x, g.edge_index), g.y, F.cross_entropy, precision="fp32")
    plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    parts = autopar.graphs.partition(g.x, g.edge_index, g.y, plan, workdir / "parts")
    write_s = time.perf_counter() - t0
    meta = store.read_meta(parts)
    dirs = rank_dirs(parts, WORLD)
    for r, d in enumerate(dirs):
        with safe_open(str(d / store.part_file(r)), "pt") as f:
            torch.save(y_all[f.get_tensor("owned")].clone(), d / EVAL_FILE)
    prows = partitioner_rows(g.edge_index, nodes, plan, label)
    t0 = time.perf_counter()
    res = spawn_local(_partition_worker, WORLD, [str(d) for d in dirs], cluster, spec, epochs, reference,
                      timeout_s=1200)
    run_s = time.perf_counter() - t0
    counts = res[0]["counts"]
    timed = [statistics.median(r["epoch_s"][CHECK_STEPS:] or r["epoch_s"]) for r in res]
    pg = plan.graph
    rows = []
    for r, x in enumerate(res):
        rows.append({"table": "partition ranks", "graph": label, "rank": r, "owned": x["owned"], "halo": x["halo"],
                     "part_bytes": meta["ranks"][r]["bytes"], "measured_peak_MiB": x["measured_peak"] / 2**20,
                     "predicted_peak_MiB": x["predicted_peak"] / 2**20,
                     "ratio": x["measured_peak"] / x["predicted_peak"], "budget_MiB": budget / 2**20,
                     "epoch_s": timed[r], "compile_s": x["compile_s"], "drift_warnings": x["drift"]})
    summary = {"table": "partition", "graph": label, "model": f"{spec['conv']} {spec['layers']}x{spec['hidden']}",
               "nodes": nodes, "edges": int(g.edge_index.shape[1]), "features": spec["features"],
               "graph_MiB": whole / 2**20, "rank_budget_MiB": budget / 2**20, "graph_over_budget": whole / budget,
               "partitioner": pg["partitioner"], "shares": pg["shares"], "halo": pg["halo"],
               "epoch_s": max(timed), "predicted_epoch_s": plan.predicted["step_time_s"],
               "ratio_min": min(x["ratio"] for x in rows), "ratio_max": max(x["ratio"] for x in rows),
               "gen_s": gen_s, "plan_s": plan_s, "write_s": write_s, "run_s": run_s, "epochs": epochs,
               **{f"{k}_4ranks": v for k, v in _acc(counts).items()}, "loss_4ranks": res[0]["losses"][-1]}
    if partial is not None:
        partial([{**summary, "reference": "running"}, *rows, *prows])
    if reference:
        ref = one_process(g, y_all, spec, epochs)
        state = res[0]["state"]
        summary.update({f"{k}_1proc": v for k, v in _acc(ref["counts"]).items()})
        summary.update(loss_1proc=ref["losses"][-1],
                       max_loss_diff=max(abs(a - b) for a, b in zip(res[0]["losses"], ref["losses"], strict=True)),
                       max_param_diff=max(float((state[k] - v).abs().max()) for k, v in ref["state"].items()),
                       epoch_s_1proc=statistics.median(ref["epoch_s"][1:]), threads_1proc=torch.get_num_threads())
    else:
        summary["reference"] = "skipped"
    return [summary, *rows, *prows]


def _sampled_worker(rank: int, world: int, graph_path: str, cluster: dict, plan: str, steps: int,
                    evaluate: bool) -> dict:
    """sampled_dp from `plan` on this rank (the whole graph memory-mapped from `graph_path`): step seconds,
    losses, and accuracy of the full-graph forward (as a sampled-trained GNN is evaluated)."""
    d = torch.load(graph_path, mmap=True)
    prog = autopar.compile(gnn_model(SWEEP), cluster, (d["x"], d["edge_index"]), d["y"], F.cross_entropy,
                           optimizer=adamw, plan=plan, timeout_s=900)
    losses, seconds = [], []
    for _ in range(steps):
        t = time.perf_counter()
        losses.append(prog.step(d["x"], d["edge_index"], target=d["y"]))
        seconds.append(time.perf_counter() - t)
    out = {"losses": losses, "step_s": seconds, "counts": None, "state": None}
    if evaluate:
        out["counts"] = accuracy(prog.eval_step(d["x"], d["edge_index"]).argmax(dim=1), d["y"], d["y_all"])
        out["state"] = prog.state_dict()["model"] if rank == 0 else None
    return out


def _sampled_plan(g: GraphData, world: int) -> autopar.Plan:
    """The sampled_dp plan. Planned on meta x and edge_index (the planner prices the partition mode beside
    it, METIS included, which at 2M nodes takes minutes): sizes exact, sampled degree min(fanout, mean)."""
    x = torch.empty(g.x.shape, device="meta")
    ei = torch.empty(g.edge_index.shape, dtype=torch.long, device="meta")
    return autopar.plan(gnn_model(SWEEP), cpu_cluster(RANK_GIB * 2**30, world), (x, ei), g.y, F.cross_entropy,
                        precision="fp32", graph_options={"mode": "sampled_dp", **SAMPLED})


def neighbor_loader(g: GraphData, y_all: torch.Tensor, steps: int, epochs: int) -> dict:
    """torch_geometric's NeighborLoader (same fanout per layer, batch size, seeds = labelled nodes) + the same
    model in one process: seeds/s over `steps` steps (sampling included), and accuracy after `epochs`."""
    try:
        from torch_geometric.data import Data
        from torch_geometric.loader import NeighborLoader

        data = Data(x=g.x, edge_index=g.edge_index, y=g.y)
        seeds = (g.y != IGNORE).nonzero().flatten()
        loader = NeighborLoader(data, num_neighbors=[SAMPLED["fanout"]] * SWEEP["layers"],
                                batch_size=SAMPLED["batch_size"], input_nodes=seeds, shuffle=True, drop_last=True)
        next(iter(loader))
    except ImportError as e:
        return {"error": f"{e}"}
    torch.set_num_threads(ONE_PROCESS_THREADS)
    model = gnn_model(SWEEP)
    opt = adamw(list(model.parameters()))
    seconds, done = [], 0
    torch.manual_seed(0)
    for _ in range(max(epochs, 1)):
        t = time.perf_counter()
        for batch in loader:
            out = model(batch.x, batch.edge_index)[:batch.batch_size]
            loss = F.cross_entropy(out, batch.y[:batch.batch_size])
            loss.backward()
            opt.step()
            opt.zero_grad()
            seconds.append(time.perf_counter() - t)
            t = time.perf_counter()
            done += 1
            if epochs == 0 and done >= steps:
                break
    res = {"step_s": seconds, "nodes_per_s": SAMPLED["batch_size"] / statistics.median(seconds[1:])}
    if epochs:
        with torch.no_grad():
            res["counts"] = accuracy(model(g.x, g.edge_index).argmax(dim=1), g.y, y_all)
    return res


def measured_sampled(nodes: int, workdir: Path, *, epochs: int = SAMPLED_EPOCHS, steps: int = 40) -> list[dict]:
    """sampled_dp on WORLD ranks vs NeighborLoader in one process; with `epochs`, accuracy after that many
    epochs against sampled_dp in one process (else `steps` steps, nodes/s only)."""
    label = f"sage {nodes // 1000}K"
    g, y_all = synthetic_graph(nodes, SWEEP)
    path = workdir / "graph.pt"
    torch.save({"x": g.x, "edge_index": g.edge_index, "y": g.y, "y_all": y_all}, path)
    labelled = int((g.y != IGNORE).sum())
    per_epoch = labelled // SAMPLED["batch_size"]
    n_steps = epochs * per_epoch if epochs else steps
    plan = _sampled_plan(g, WORLD)
    t0 = time.perf_counter()
    res = spawn_local(_sampled_worker, WORLD, str(path), cpu_cluster(RANK_GIB * 2**30), plan.to_json(), n_steps,
                      bool(epochs), timeout_s=1200)
    run_s = time.perf_counter() - t0
    step_s = max(statistics.median(r["step_s"][1:]) for r in res)
    row = {"table": "sampled", "graph": label, "nodes": nodes, "batch_size": SAMPLED["batch_size"],
           "fanout": SAMPLED["fanout"], "steps": n_steps, "epochs": epochs, "shares": plan.graph["shares"],
           "nodes_per_s_4ranks": SAMPLED["batch_size"] / step_s,
           "predicted_nodes_per_s": plan.predicted["samples_per_s"], "run_s": run_s,
           "loss_4ranks": res[0]["losses"][-1]}
    if epochs:
        row.update({f"{k}_4ranks": v for k, v in _acc(res[0]["counts"]).items()})
        one = _sampled_plan(g, 1)
        from autopar.graphs.program import GraphProgram

        torch.set_num_threads(ONE_PROCESS_THREADS)
        prog = GraphProgram(gnn_model(SWEEP), one, F.cross_entropy, adamw, 0, 1)
        losses, seconds = [], []
        for _ in range(n_steps):
            t = time.perf_counter()
            losses.append(prog.step(g.x, g.edge_index, target=g.y))
            seconds.append(time.perf_counter() - t)
        counts = accuracy(prog.eval_step(g.x, g.edge_index).argmax(dim=1), g.y, y_all)
        state = prog.state_dict()["model"]
        row.update({f"{k}_1proc": v for k, v in _acc(counts).items()})
        row.update(loss_1proc=losses[-1], nodes_per_s_1proc=SAMPLED["batch_size"] / statistics.median(seconds[1:]),
                   max_loss_diff=max(abs(a - b) for a, b in zip(res[0]["losses"], losses, strict=True)),
                   max_param_diff=max(float((res[0]["state"][k] - v).abs().max()) for k, v in state.items()))
    nl = neighbor_loader(g, y_all, n_steps, epochs)
    if "error" in nl:
        row["neighbor_loader"] = f"not run: {nl['error']}"
    else:
        row["nodes_per_s_neighbor_loader"] = nl["nodes_per_s"]
        row["autopar_4ranks_over_neighbor_loader"] = row["nodes_per_s_4ranks"] / nl["nodes_per_s"]
        if "counts" in nl:
            row.update({f"{k}_neighbor_loader": v for k, v in _acc(nl["counts"]).items()})
    row["threads_1proc"] = torch.get_num_threads()
    return [row]


PARTITION_COLUMNS = ["graph", "nodes", "edges", "graph_MiB", "rank_budget_MiB", "partitioner", "epoch_s",
                     "predicted_epoch_s", "ratio_min", "ratio_max", "test_acc_4ranks", "test_acc_1proc",
                     "max_loss_diff", "max_param_diff", "epoch_s_1proc", "plan_s", "write_s"]
RANK_COLUMNS = ["graph", "rank", "owned", "halo", "part_bytes", "measured_peak_MiB", "predicted_peak_MiB", "ratio",
                "budget_MiB", "epoch_s"]
CUT_COLUMNS = ["graph", "partitioner", "chosen", "edge_cut", "halo_volume", "cut_edges", "shares"]
SAMPLED_COLUMNS = ["graph", "steps", "nodes_per_s_4ranks", "predicted_nodes_per_s", "nodes_per_s_1proc",
                   "nodes_per_s_neighbor_loader", "test_acc_4ranks", "test_acc_1proc", "test_acc_neighbor_loader",
                   "max_loss_diff", "max_param_diff"]


def print_measured(rows: list[dict]) -> None:
    for table, cols in (("partition", PARTITION_COLUMNS), ("partition ranks", RANK_COLUMNS),
                        ("partitioners", CUT_COLUMNS), ("sampled", SAMPLED_COLUMNS)):
        mine = [r for r in rows if r.get("table") == table]
        if mine:
            print(f"\n{table}:")
            print_table(mine, cols)


def gnn_scale(sizes: tuple[int, ...] = SIZES, wide_nodes: int | None = 200_000,
              sampled_sizes: tuple[int, ...] = (100_000, 2_000_000), reference_up_to: int = 2_000_000,
              save: Any = None) -> list[dict]:
    """Every issue-26 part-6 measurement; `save(rows)` after each (a long run keeps what it measured)."""
    rows: list[dict] = []

    def done(new: list[dict]) -> None:
        rows.extend(new)
        print_measured(new)
        if save is not None:
            save(rows)

    def partial(new: list[dict]) -> None:
        if save is not None:
            save(rows + new)

    for n in sizes:
        with tempfile.TemporaryDirectory() as d:
            done(measured_partition(n, SWEEP, Path(d), reference=n <= reference_up_to, partial=partial))
    if wide_nodes:
        g, _ = synthetic_graph(wide_nodes, WIDE)
        budget = 0.95 * graph_bytes(g)  # the graph's features and edges do not fit one rank
        del g
        with tempfile.TemporaryDirectory() as d:
            done(measured_partition(wide_nodes, WIDE, Path(d), rank_budget=budget, label=f"gcn F=256 "
                                    f"{wide_nodes // 1000}K, budget < graph", partial=partial))
    for n in sampled_sizes:
        with tempfile.TemporaryDirectory() as d:
            done(measured_sampled(n, Path(d), epochs=SAMPLED_EPOCHS if n <= 100_000 else 0))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="full-graph sweep sizes (nodes)")
    ap.add_argument("--wide-nodes", type=int, default=200_000, help="done-when graph size (0: skip)")
    ap.add_argument("--sampled-sizes", default="100000,2000000", help="sampled-mode sizes ('' : skip)")
    ap.add_argument("--reference-up-to", type=int, default=2_000_000, help="largest size compared with one process")
    ap.add_argument("--skip-small", action="store_true", help="skip the predicted 1M rows and the 8K 2-rank run")
    ap.add_argument("--name", default="wl_gnn", help="results file: bench/results/NAME.json")
    ap.add_argument("--merge", action="store_true", help="keep the rows of results/wl_gnn.json this run does not "
                    "measure again (same table and graph)")
    args = ap.parse_args()
    sizes = tuple(int(x) for x in args.sizes.split(",") if x)
    sampled = tuple(int(x) for x in args.sampled_sizes.split(",") if x)
    base: list[dict] = []
    summary: dict[str, Any] = {"host": f"{os.cpu_count()} cores, shared with other sessions: times are indicative"}
    if not args.skip_small:
        predicted = gnn_workloads()
        print_table(predicted, ["mode", "chosen", "fits", "predicted_nodes_per_s", "step_time_s", "comm_s",
                                "peak_memory_GiB", "shares"])
        measured = gnn_measured()
        print_table(measured, ["mode", "measured_nodes_per_s", "predicted_nodes_per_s", "step_time_s", "shares",
                               "halo"])
        summary["chosen_mode_1M"] = next(r["mode"] for r in predicted if r["chosen"])
        base = predicted + measured

    kept: list[dict] = []
    old = Path(__file__).resolve().parent / "results" / f"{args.name}.json"
    if args.merge and old.is_file():
        prev = json.loads(old.read_text())
        kept = [r for r in prev["rows"] if "table" in r]
        if args.skip_small:
            base = [r for r in prev["rows"] if "table" not in r]
            summary = {**prev["summary"], **summary}

    def save(rows: list[dict]) -> None:
        again = {(r["table"], r["graph"]) for r in rows}
        rows = [r for r in kept if (r["table"], r["graph"]) not in again] + rows
        ratios = [r["ratio"] for r in rows if r.get("table") == "partition ranks"]
        if ratios:
            summary["memory_ratio_range"] = [min(ratios), max(ratios)]
            summary["memory_within_15pct"] = all(0.85 <= x <= 1.15 for x in ratios)
        write_results(args.name, base + rows, summary)

    gnn_scale(sizes, args.wide_nodes, sampled, args.reference_up_to, save)
    if not sizes and not args.wide_nodes and not sampled:
        save([])
    print(f"wrote {old}")


if __name__ == "__main__":
    main()
