"""Cost model of graph workloads: per-layer closed forms priced with ComputeModel / collective_time.

Units: seconds and bytes; b = activation bytes per element (2 in bf16/fp16, 4 in fp32), N nodes, E edges,
F feature width, P parameters. Per message-passing layer with input width d_in, output width d_out, message
width w (d_out for GCN/GAT, which transform before propagating; d_in for SAGE/GraphConv) and dense FLOPs per
row D (2 in out summed over the layer's linears), on R node rows with E' edges:

    dense   matmul(flops = D R, bytes = b (R d_in + R d_out) + weights)        backward 2x
    sparse  embedding-kind gather + scatter-add(bytes = b (3 E' w + 2 R w))      backward 2x
    gat     + per edge and head: logits, softmax (bytes = 4 b E' heads)

Memory of a message-passing layer reading R rows and keeping T target rows (`Work.act`, kept for the backward;
`Work.transient`, live only inside the layer's forward, so a forward peaks at the saved bytes plus the largest
layer's transient, not their sum):
    sage, graphconv       act b (R d_in + T d_out + R w) (the linear after the aggregation reads it);
                          transient b (E' w + R w), the gathered messages and their scatter-add sum. A gather's
                          and a scatter-add's backward need only the index, so torch frees the messages inside
                          the layer.
    gcn                   act b (R d_in + T d_out) + (16 + b) E'' (the adapter's normalised edge list with a
                          self-loop per target, E'' = E' + T, and its weights, kept for the backward); transient
                          2 b (E'' w + R w) (messages scaled by the edge weights; the linear's output).
    gat, other layers     act b (R (d_in + d_out) + E' w + R d_out) (+ the attention bytes): messages scaled by
                          attention that needs a gradient are kept.

Node-wise layers outside message-passing layers (encoder, head) are dense on their rows.

partition (rank r owns n_r nodes, h_r halo nodes, E_r = in-edges of its nodes, R = n_r + h_r):
    step    = max_r(fwd_r + bwd_r) + sum over layers 2 all_to_all(max_r h_r d_in b') + all_reduce(P g) + optim
              (b' = the features' bytes for a first layer reading x, else b; every rank takes part)
    memory  = P (w + g + o + c) + part_r + sum over layers act + max(exchange_r, max over layers transient)
    part_r  = n_r (F b' + 16) + 16 h_r + 16 E_r + 8 R + 8 s_r   (the rank's part as store.py writes it,
              s_r = rows it sends; b' the features' bytes for a first layer reading x)
    exchange_r = max over layers (s_r + h_r) d_in b (the halo exchange's send and receive buffers, freed once
              the layer's [owned; halo] input is built, before its messages); `graph_bytes` = part_r + exchange_r
    halo    = exact from the graph when its edge_index holds data (contiguous ranges of the partitioner's order),
              else the uniform random-graph expectation (N - n_r)(1 - exp(-E_r / N))
    order   = the locality order, METIS's parts or a random one (partitioners.py), the fastest predicted step
              that fits memory (`_partitioners`), once the shares are balanced on the locality order
    shares  = `balanced_shares`: per-rank time fitted as fixed + n x per-node (launch overheads are paid
              whatever the share), max over ranks minimised, capped by memory; refitted once with the halos
sampled_dp (rank r takes b_r seeds, fanout f, expected sampled in-degree k = mean min(f, deg)):
    levels  n_L = b_r, n_{l-1} = n_l + (N - n_l)(1 - exp(-n_l k / N)), E_l = n_l k
    step    = max_r(sample_r + fwd_r + bwd_r + fetch_r) + all_reduce(P g) + optim; fetch_r = gathering n_0 F b
              feature bytes on the device when the graph and features fit in its memory, else over its host link;
              sample_r = walking the sampled in-edges on the host CPU (`host_cm`: sampling.py runs on CPU tensors)
    memory  = P (w + g + o + c) + [N F b + 16 E if on the device] + sum over layers act + max over layers
              transient (R = n_{l-1}, T = n_l, E' = E_l) + 16 sum E_l
    shares  = seeds by `balanced_shares` (fixed + per-seed time), capped by memory
layer_pipeline (rank s computes layers [a_s, b_s) for all N nodes in C chunks k of n_k nodes, h_k halo rows and
E_k in-edges; layer_pipeline.py):
    task    (l, k): layer_work(rows n_k + h_k -> n_k, E_k) + its segment's linears on n_k rows (+ joining the halo
              rows when h_k > 0); stage 0 also gathers its chunks' feature rows
    step    = `layer_pipeline.simulate` (the runtime's schedule on the task times, p2p(n_k d b) per boundary
              chunk and its gradient) + max_s optimizer(P_s) + all_reduce(one element: the loss)
    memory  = P_s (w + g + o + c) + the chunks' graphs (16 E + 8 sum(n_k + 2 h_k) + 8 N; + 8 N labels last) + tasks
              in order: each forward task adds kept(l, k) (measured per layer kind: `task_bytes_probe`) and its
              joined input, the chunks received (N d_a b) and, before the backward, the gradients of those sent
              (N d_b b); each backward task frees what its forward kept; the peak is the largest (alive + the
              task's measured transient)
    split   = consecutive layer ranges, the slowest stage's compute minimised among the splits that fit (dynamic
              programming); C = the fastest of 1, 2, 4, 8 that fits
P (w + g + o + c): state_bytes_per_param (fp32 weights and gradients, optimizer state; c = autocast's weight copy
in mixed precision). A device left with a zero share gets `idle` reasons from the same prices (`_idle`).
samples/s counts labelled nodes trained per second (all labelled nodes per partition step, the seeds of a
sampled step). The planner prices the modes but only considers the one graph_options asks for, except that
without a mode it also prices layer_pipeline where partition does not fit or is halo-bound (planner.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..cluster import Cluster
from ..cost_models.comm import collective_time
from ..cost_models.compute import ComputeModel, check_profiles
from ..cost_models.memory import optimizer_name, state_bytes_per_param
from ..errors import PlanError
from .data import in_degree, locality_order
from .halo import balanced_shares, proportional_shares
from .layers import layer_kind, message_passing_layers
from .partitioners import (
    METIS_UFACTOR,
    PARTITIONERS,
    WEIGHT_SCALE,
    metis_parts,
    node_weights,
    order_of_parts,
    partition_quality,
    random_order,
)

# layer kinds whose per-edge messages are kept for the backward (GAT's attention-scaled messages; layers not
# modelled, priced so): gcn, sage and graphconv free theirs inside the layer (module docstring)
KEEPS_MESSAGES = ("gat", "mp")


@dataclass(frozen=True)
class LayerShape:
    kind: str  # "dense" | gcn | sage | gat | graphconv | mp
    d_in: int
    d_out: int
    msg: int  # message width
    dense_flops_per_row: float
    heads: int = 1


@dataclass
class GraphStats:
    num_nodes: int
    num_edges: int
    features: int
    labelled: int
    edge_index: torch.Tensor | None = None  # with data: exact halos and sampled degrees
    feature_bytes: int = 4

    @property
    def avg_degree(self) -> float:
        return self.num_edges / max(self.num_nodes, 1)


def _linears(m: nn.Module) -> list[tuple[int, int]]:
    out = []
    for sub in m.modules():
        w = getattr(sub, "weight", None)
        if isinstance(sub, nn.Linear) or (type(sub).__name__ == "Linear" and isinstance(w, torch.Tensor)
                                          and w.dim() == 2):
            out.append((int(w.shape[1]), int(w.shape[0])))
    return out


def model_shapes(model: nn.Module) -> list[LayerShape]:
    """The model's layers in registration order: message-passing layers and node-wise linears between."""
    mp = dict(message_passing_layers(model))
    shapes: list[LayerShape] = []
    for name, m in model.named_modules():
        if any(name.startswith(p + ".") for p in mp):
            continue
        if name in mp:
            lin = _linears(m)
            kind = layer_kind(m)
            d_in = lin[0][0] if lin else 0
            heads = int(getattr(m, "heads", 1))
            d_out = lin[0][1] if lin else 0
            msg = d_out if kind in ("gcn", "gat") else d_in
            shapes.append(LayerShape(kind, d_in, d_out, msg, float(sum(2 * i * o for i, o in lin)), heads))
        elif isinstance(m, nn.Linear):
            shapes.append(LayerShape("dense", m.in_features, m.out_features, 0, 2.0 * m.in_features * m.out_features))
    return shapes


@dataclass
class Work:
    """Per-rank fwd/bwd seconds and saved-activation bytes of one forward over given rows and edges."""

    fwd: float = 0.0
    bwd: float = 0.0
    act: float = 0.0  # bytes kept for the backward
    flops: float = 0.0
    transient: float = 0.0  # bytes live only inside the forward of one layer (the largest layer's)


def layer_work(cm: ComputeModel, s: LayerShape, rows_in: float, rows_out: float, edges: float, b: int,
               kept: float | None = None) -> Work:
    """`kept`: the output rows a message-passing layer keeps (default rows_out; a partition's layer keeps its
    owned rows and the next layer reads them with the halo)."""
    kept = rows_out if kept is None else kept
    w = Work()
    rows = rows_in if s.kind != "dense" else rows_out
    if s.dense_flops_per_row:
        fl = s.dense_flops_per_row * rows
        nbytes = b * rows * (s.d_in + s.d_out) + 4 * s.dense_flops_per_row / 2
        w.fwd += cm.op_time("matmul", fl, nbytes) + cm.op_time("elementwise", rows * s.d_out, 2 * b * rows * s.d_out)
        w.bwd += cm.op_time("matmul", 2 * fl, 2 * nbytes, launches=2)
        # a message-passing layer keeps its output's target rows only (the rows after them are sliced off)
        w.act += b * rows * s.d_in + b * (rows if s.kind in KEEPS_MESSAGES else kept) * s.d_out
        w.flops += 3 * fl
    if s.kind != "dense":
        sparse = b * (3 * edges * s.msg + 2 * rows * s.msg)
        w.fwd += cm.op_time("gather", edges * s.msg, sparse, launches=2)
        w.bwd += 2 * cm.op_time("gather", edges * s.msg, sparse, launches=2)
        if s.kind in KEEPS_MESSAGES:
            w.act += b * (edges * s.msg + rows * s.d_out)
        elif s.kind == "gcn":
            # the adapter's normalised edge list (a self-loop per target row) and its weights (layers.py), kept
            # by the gather, scatter and weighting for the backward; messages x edge weight, its linear's output
            looped = edges + kept
            w.act += (16 + b) * looped
            w.transient = 2 * b * (looped * s.msg + rows * s.msg)
        else:
            w.transient = b * (edges * s.msg + rows * s.msg)
            w.act += b * rows * s.msg  # the aggregation is the input of the linear after it
        if s.kind == "gat":
            extra = 4 * b * edges * s.heads
            w.fwd += cm.op_time("softmax", edges * s.heads * 5, extra, launches=3)
            w.bwd += 2 * cm.op_time("softmax", edges * s.heads * 5, extra, launches=3)
            w.act += extra
        w.flops += 3 * edges * s.msg
    return w


def forward_work(cm: ComputeModel, shapes: list[LayerShape], levels: list[float], edges: list[float],
                 b: int, dense_levels: list[float] | None = None) -> Work:
    """Sum over layers; message-passing layer i reads levels[i] rows, writes levels[i + 1] with edges[i] and
    keeps dense_levels[i + 1] of them; dense layers before message-passing layer i run on dense_levels[i] rows
    (default: levels[i])."""
    dense_levels = levels if dense_levels is None else dense_levels
    total, i = Work(), 0
    for s in shapes:
        if s.kind == "dense":
            lw = layer_work(cm, s, dense_levels[i], dense_levels[i], 0, b)
        else:
            lw = layer_work(cm, s, levels[i], levels[i + 1], edges[i], b, dense_levels[i + 1])
            i += 1
        total.fwd += lw.fwd
        total.bwd += lw.bwd
        total.act += lw.act
        total.flops += lw.flops
        total.transient = max(total.transient, lw.transient)
    return total


@dataclass
class Candidate:
    mode: str
    shares: list[int]
    fits: bool
    step_time_s: float
    samples_per_step: int
    compute_s: list[float]
    comm_s: float
    sync_s: float
    peak_memory_bytes: list[int]
    flops: float
    problems: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_step / self.step_time_s if self.step_time_s > 0 else 0.0

    def summary(self) -> dict:
        step = self.step_time_s if math.isfinite(self.step_time_s) else None  # strict JSON: no Infinity
        return {"fits": self.fits, "step_time_s": step, "samples_per_s": self.samples_per_s,
                "samples_per_step": self.samples_per_step, "shares": self.shares, "compute_s": self.compute_s,
                "comm_s": self.comm_s, "sync_s": self.sync_s, "peak_memory_bytes": self.peak_memory_bytes,
                "problems": self.problems, **self.extra}


class GraphCostModel:
    """Prices partitioned and sampled data-parallel training of `model` on a graph for `cluster`."""

    def __init__(self, model: nn.Module, stats: GraphStats, cluster: Cluster, precision: str = "fp32",
                 optimizer: object = "adamw", memory_reserve: float = 0.1, profiles: dict | None = None) -> None:
        self.shapes = model_shapes(model)
        self.profiles = check_profiles(profiles, cluster)  # by device type, priced instead of the saved ones
        self.layers = sum(1 for s in self.shapes if s.kind != "dense")
        self.stats, self.cluster, self.precision, self.reserve = stats, cluster, precision, memory_reserve
        self.b = 2 if precision in ("bf16", "fp16") else 4
        self.params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.optimizer = optimizer_name(optimizer)
        per_param = state_bytes_per_param(optimizer, precision)
        self.per_param = per_param
        self.model = model
        self._state_total = per_param.total * self.params
        # resident: fp32 weights, gradients, optimizer state, plus autocast's low-precision weight copies that
        # the one forward in flight keeps for its backward (GraphProgram runs the plan's precision)
        self.state = self._state_total + per_param.cast_copy * self.params
        self._cm: dict[str, ComputeModel] = {}
        self._halo_cache: dict[int, float] = {}
        self._locality: torch.Tensor | None = None
        world = list(range(cluster.world_size))
        self._grad_bytes = self.params * per_param.grads
        self.sync_s = (collective_time("all_reduce", self._grad_bytes, world, cluster)
                       + max(self._opt_time(d) for d in world))

    def cm(self, d: int) -> ComputeModel:
        spec = self.cluster.devices[d].spec
        if spec.name not in self._cm:
            self._cm[spec.name] = ComputeModel(spec, self.profiles.get(spec.name), dtype=self.precision)
        return self._cm[spec.name]

    def host_cm(self) -> ComputeModel:
        """The compute model of the CPU that samples (sampling.py runs on CPU tensors on every rank): a cluster's
        cpu device, else this host (`host.cpu_spec`, what a cluster's cpu devices resolve to)."""
        cpus = [d.index for d in self.cluster.devices if d.spec.kind == "cpu"]
        if cpus:
            return self.cm(cpus[0])
        if "cpu" not in self._cm:
            from ..cost_models.host import cpu_spec

            self._cm["cpu"] = ComputeModel(cpu_spec(), self.profiles.get("cpu"), dtype=self.precision)
        return self._cm["cpu"]

    def locality(self) -> torch.Tensor:
        """The graph's locality order (data.locality_order), computed once: partition and the layer pipeline
        both cut it."""
        if self._locality is None:
            assert self.stats.edge_index is not None
            self._locality = locality_order(self.stats.edge_index, self.stats.num_nodes)
        return self._locality

    def usable(self, d: int) -> float:
        return self.cluster.devices[d].spec.memory * (1 - self.reserve)

    def _opt_time(self, d: int) -> float:
        return 2 * self._state_total / self.cluster.devices[d].spec.memory_bandwidth

    # ---- partition ----------------------------------------------------------------------------------
    def expected_halo(self, n: float) -> float:
        s = self.stats
        return (s.num_nodes - n) * (1 - math.exp(-n * s.avg_degree / max(s.num_nodes, 1)))

    def _chunk_halo(self, chunk: float) -> float:
        """The halo of a rank owning `chunk` nodes, for the memory caps: with the graph's data, the mean halo of
        an equal split into N / chunk parts by the better of the locality order and METIS (a clustered graph's
        parts have far smaller halos than a random graph's); else the random-graph expectation."""
        s = self.stats
        parts = max(1, round(s.num_nodes / max(chunk, 1.0)))
        if s.edge_index is None or parts < 2:
            return self.expected_halo(chunk)
        if parts not in self._halo_cache:
            equal = proportional_shares(s.num_nodes, [1.0] * parts)
            part, _ = metis_parts(s.edge_index, s.num_nodes, [1.0 / parts] * parts)
            metis_order = order_of_parts(part, parts)[0]
            halos = [partition_quality(s.edge_index, s.num_nodes, o, equal, cut=False)["halo_volume"] / parts
                     for o in (self.locality(), metis_order)]
            self._halo_cache[parts] = float(min(halos))
        return self._halo_cache[parts]

    def _partition_time(self, d: int, n: float) -> float:
        work, _ = self._partition_rank(d, n, self.expected_halo(n), n * self.stats.avg_degree)
        return work.fwd + work.bwd

    def _partition_rank(self, d: int, n: float, halo: float, edges: float,
                        send: float | None = None) -> tuple[Work, float]:
        rows = n + halo
        # message-passing layers read owned + halo rows; node-wise layers run on owned rows only
        work = forward_work(self.cm(d), self.shapes, [rows] * self.layers + [n], [edges] * self.layers, self.b,
                            [n] * (self.layers + 1))
        part, exchange = self.graph_bytes(n, halo, edges, halo if send is None else send)
        memory = self.state + part + work.act + max(exchange, work.transient)
        return work, memory

    def graph_bytes(self, n: float, halo: float, edges: float, send: float) -> tuple[float, float]:
        """The graph bytes a rank owning n nodes holds: its part (store.py's tensors: owned features, labels and
        ids; halo ids and owners; local edges; global degrees of its rows; the send index) and the halo
        exchange's buffers of its widest message-passing layer (the rows it sends and those it receives; the
        [owned; halo] rows a layer reads are its input activation, in `Work.act`): (part, exchange buffers)."""
        s = self.stats
        part = n * (s.features * s.feature_bytes + 16) + 16 * halo + 16 * edges + 8 * (n + halo) + 8 * send
        widest, elem = 0.0, s.feature_bytes  # a first layer reading x exchanges the features' dtype
        for sh in self.shapes:
            if sh.kind != "dense":
                widest = max(widest, (send + halo) * sh.d_in * elem)
            elem = self.b
        return part, widest

    def partition(self) -> Candidate:
        s, world = self.stats, self.cluster.world_size
        devices = range(world)
        chunk = max(1.0, s.num_nodes / world)
        fixed, marginal, caps = [], [], []
        for d in devices:
            t1 = self._partition_time(d, chunk)
            t2 = self._partition_time(d, 2 * chunk)
            marginal.append(max((t2 - t1) / chunk, 1e-15))
            fixed.append(max(t1 - marginal[-1] * chunk, 0.0))
            _, mem = self._partition_rank(d, chunk, self._chunk_halo(chunk), chunk * s.avg_degree)
            per_node = max(mem - self.state, 1.0) / chunk
            caps.append(max(0.0, (self.usable(d) - self.state) / per_node))
        if sum(int(c) for c in caps) < s.num_nodes:
            return self._infeasible("partition", [f"device {d} holds at most {int(caps[d])} nodes"
                                                  for d in devices] + [f"the graph has {s.num_nodes} nodes"])
        order = self.locality() if s.edge_index is not None else None
        best, best_t, best_marginal, best_allowed = None, math.inf, marginal, caps
        # the balance ignores the halo exchange, which grows with every rank that owns nodes (over the network
        # most): also try fewer owners (_owner_sets); the others own no nodes, their `idle` reasons say why
        for owners in self._owner_sets(marginal):
            allowed = [caps[d] if d in owners else 0.0 for d in devices]
            if sum(int(c) for c in allowed) < s.num_nodes:
                continue
            rates = list(marginal)
            # halos grow as shares shrink: re-balance once with the per-rank rates the halos give
            for _ in range(2):
                shares = balanced_shares(s.num_nodes, fixed, rates, allowed)
                priced = self._price_partition(shares, order)
                t = self._partition_step(priced)
                if t < best_t:
                    best, best_t, best_marginal, best_allowed = priced, t, rates, allowed
                rates = [max((priced[2][d] - fixed[d]) / shares[d], 1e-15) if shares[d] else rates[d]
                         for d in devices]
            # the affine fit at N / world overstates a slow device's fixed time where its time per node falls
            # with its share (a CPU's efficiency, halos growing slower than shares), leaving it idle where a small
            # part would shorten the step: balance the priced times themselves too, then once more with each
            # rank's time scaled by the exact halos' price at its share
            scale = [1.0] * world
            for _ in range(2):
                shares = self._level_shares(s.num_nodes, allowed, scale)
                priced = self._price_partition(shares, order)
                t = self._partition_step(priced)
                if t < best_t:
                    best, best_t, best_allowed = priced, t, allowed
                    best_marginal = [max((priced[2][d] - fixed[d]) / shares[d], 1e-15) if shares[d] else marginal[d]
                                     for d in devices]
                scale = [priced[2][d] / max(self._partition_time(d, shares[d]), 1e-15) if shares[d] else 1.0
                         for d in devices]
        best, order, chosen = self._partitioners(best, order, best_allowed)

        def price(alt: list[int]) -> tuple[list[float], float]:
            priced = self._price_partition(alt, order)
            return priced[2], self._halo_comm(priced[1])

        idle = self._idle(best[0], best[2], self._halo_comm(best[1]), fixed, best_marginal, caps, price)
        # a zero-share device whose priced share makes the step faster takes it (the balancers' time models
        # missed it), one device at a time, as long as that keeps paying
        for _ in range(world):
            better = [i for i in idle if i["why"] == "balance"]
            if not better:
                break
            best = self._price_partition(min(better, key=lambda i: i["step_s"])["shares"], order)
            idle = self._idle(best[0], best[2], self._halo_comm(best[1]), fixed, best_marginal, caps, price)
            table = chosen.get("partitioners", {}).get(chosen.get("partitioner"))
            if table is not None and s.edge_index is not None and order is not None:
                table.update(step_time_s=self._partition_step(best) + self.sync_s,
                             shares=list(best[0]), **partition_quality(s.edge_index, s.num_nodes, order, best[0]))
        shares, halos, compute, mems, flops, owner_edges, exact, graph_bytes = best
        problems = [_mem_problem(self.cluster, d, mems[d], self.usable(d), f"{shares[d]} nodes")
                    for d in devices if mems[d] > self.usable(d)]
        comm = self._halo_comm(halos)
        step = max(compute) + comm + self.sync_s
        extra = {"halo": [int(h) for h in halos], "local_edges": [int(e) for e in owner_edges], "halo_exact": exact,
                 "idle": [{k: v for k, v in i.items() if k != "shares"} for i in idle],
                 "graph_bytes": [sum(b) for b in graph_bytes], "graph_part_bytes": [b[0] for b in graph_bytes],
                 **chosen}
        return Candidate("partition", shares, not problems, step, s.labelled, compute, comm, self.sync_s, mems,
                         flops, problems, extra)

    def _level_shares(self, total: int, caps: list[float], scale: list[float]) -> list[int]:
        """Shares minimising the slowest rank's priced compute time (`_partition_time` x `scale`, increasing in
        the share): bisect the level T at which the largest shares each rank finishes within T cover `total`."""
        world = len(caps)
        kinds = {d: (self.cluster.devices[d].spec.name, scale[d], min(caps[d], total)) for d in range(world)}

        def most(d: int, level: float, memo: dict) -> float:
            if kinds[d] in memo:  # devices of one type with one scale and cap take the same share
                return memo[kinds[d]]
            lo, hi = 0.0, float(kinds[d][2])
            if hi >= 1 and self._partition_time(d, 1.0) * scale[d] <= level:
                for _ in range(20):
                    mid = (lo + hi) / 2
                    lo, hi = (mid, hi) if self._partition_time(d, mid) * scale[d] <= level else (lo, mid)
            memo[kinds[d]] = lo
            return lo

        usable = [d for d in range(world) if caps[d] >= 1]
        lo, hi = 0.0, max(self._partition_time(d, total) * scale[d] for d in usable)
        for _ in range(24):
            mid, memo = (lo + hi) / 2, {}
            lo, hi = (lo, mid) if sum(most(d, mid, memo) for d in usable) >= total else (mid, hi)
        memo: dict = {}
        ideal = [most(d, hi, memo) if d in usable else 0.0 for d in range(world)]
        return proportional_shares(total, ideal if sum(ideal) > 0 else [1.0 if d in usable else 0.0
                                                                         for d in range(world)], caps)

    def metis_weights(self) -> list[float]:
        """[a, b] of the METIS node weight a + b x in-degree: a node's compute (its rows through every layer,
        its in-edges through every message-passing layer) on the fastest device, scaled to a = WEIGHT_SCALE."""
        d = min(range(self.cluster.world_size), key=lambda i: self._partition_time(i, 1e4))
        n, b = 1e4, self.b

        def t(rows: float, edges: float) -> float:
            work = forward_work(self.cm(d), self.shapes, [rows] * (self.layers + 1), [edges] * self.layers, b)
            return work.fwd + work.bwd

        per_row, per_edge = (t(2 * n, 0) - t(n, 0)) / n, (t(n, n) - t(n, 0)) / n
        return [float(WEIGHT_SCALE), WEIGHT_SCALE * max(per_edge, 0.0) / max(per_row, 1e-30)]

    def _partitioners(self, best: tuple, order: torch.Tensor | None, allowed: list[float]
                      ) -> tuple[tuple, torch.Tensor | None, dict]:
        """Price the locality order's partition `best` against METIS's and a random one's on the same graph;
        the fastest predicted step that fits memory wins (ties keep the locality order). Returns the winner's
        priced partition, its order, and the plan entries: `partitioner`, `partitioners` (per partitioner its
        step, edge cut, crossing edges, halos and shares) and, for METIS, its inputs (`metis`), from which every
        rank recomputes the same parts. `allowed`: each rank's node cap for `best`'s owners (0 elsewhere)."""
        s, world = self.stats, self.cluster.world_size
        shares = best[0]
        if s.edge_index is None or order is None or sum(1 for x in shares if x) < 2:
            why = "no graph data to compare partitioners on" if s.edge_index is None else "one rank owns every node"
            return best, order, {"partitioner": "locality", "partitioners": {}, "partitioner_why": why}
        ei, n = s.edge_index, s.num_nodes
        rnd = random_order(n, 0)
        cands: dict[str, tuple] = {"locality": (order, best), "random": (rnd, self._price_partition(shares, rnd))}
        coeffs = self.metis_weights()
        weights = node_weights(ei, n, coeffs)

        def metis_partition(targets: list[float]) -> tuple:
            for _ in range(4):  # a part over its rank's memory: aim lower and partition again
                part, cut = metis_parts(ei, n, targets, weights, 0, METIS_UFACTOR)
                m_order, m_shares = order_of_parts(part, world)
                priced = self._price_partition(m_shares, m_order)
                over = [d for d in range(world) if priced[3][d] > self.usable(d) and m_shares[d]]
                if not over:
                    break
                targets = list(targets)
                for d in over:
                    targets[d] *= 0.97 * max(self.usable(d) - self.state, 0.0) / max(priced[3][d] - self.state, 1.0)
            return m_order, priced, targets, cut, not over

        m_order, priced, targets, cut, _ = metis_partition([x / n for x in shares])
        # METIS's parts differ from the locality order's in their edges and halos, so the shares balanced on
        # that order need not balance here (a small part's edges and halo most): re-balance on METIS's own
        # priced times, as `partition` does on the locality order, while that shortens the step
        for _ in range(2):
            m_shares = priced[0]
            scale = [priced[2][d] / max(self._partition_time(d, m_shares[d]), 1e-15) if m_shares[d] else 1.0
                     for d in range(world)]
            again = self._level_shares(n, allowed, scale)
            t_order, t_priced, t_targets, t_cut, fits = metis_partition([x / n for x in again])
            if not fits or self._partition_step(t_priced) >= self._partition_step(priced):
                break
            m_order, priced, targets, cut = t_order, t_priced, t_targets, t_cut
        cands["metis"] = (m_order, priced)
        metis = {"targets": targets, "weights": coeffs, "seed": 0, "ufactor": METIS_UFACTOR, "edge_cut": cut}
        table = {}
        for name in PARTITIONERS:
            o, p = cands[name]
            q = partition_quality(ei, n, o, p[0])
            fits = all(p[3][d] <= self.usable(d) for d in range(world))
            table[name] = {"step_time_s": self._partition_step(p) + self.sync_s, "fits": fits,
                           "shares": list(p[0]), **q}
        ok = [m for m in PARTITIONERS if table[m]["fits"]] or list(PARTITIONERS)
        name = min(ok, key=lambda m: (table[m]["step_time_s"], PARTITIONERS.index(m)))
        runner = min((m for m in ok if m != name), key=lambda m: table[m]["step_time_s"], default=None)
        why = (f"fastest predicted step ({table[name]['step_time_s'] * 1e3:.3g} ms, halo volume "
               f"{table[name]['halo_volume']} rows per layer against {runner}'s "
               f"{table[runner]['step_time_s'] * 1e3:.3g} ms, {table[runner]['halo_volume']})" if runner else
               "the only partition that fits memory")
        extra = {"partitioner": name, "partitioners": table, "partitioner_why": why}
        if name == "metis":
            extra["metis"] = metis
        return cands[name][1], cands[name][0], extra

    def _owner_sets(self, marginal: list[float]) -> list[frozenset[int]]:
        """Device sets that may own nodes: the fastest device types (1, 2, ... of them, by per-node time), each
        also restricted to its best-provisioned cluster node, and the single fastest device."""
        devs = self.cluster.devices
        speed: dict[str, float] = {}
        for d in devs:
            speed[d.spec.name] = min(speed.get(d.spec.name, math.inf), marginal[d.index])
        kinds = sorted(speed, key=speed.__getitem__)
        sets: list[frozenset[int]] = []
        for j in range(len(kinds), 0, -1):
            typed = [d for d in devs if d.spec.name in kinds[:j]]
            rate = {}
            for d in typed:
                rate[d.node] = rate.get(d.node, 0.0) + 1.0 / marginal[d.index]
            node = max(rate, key=rate.__getitem__)
            sets += [frozenset(d.index for d in typed), frozenset(d.index for d in typed if d.node == node)]
        sets.append(frozenset([min(range(len(devs)), key=marginal.__getitem__)]))
        return list(dict.fromkeys(sets))

    def _partition_step(self, priced: tuple) -> float:
        """A priced partition's step before the gradient sync: its slowest rank's compute, then the halo exchange."""
        return max(priced[2]) + self._halo_comm(priced[1])

    def _halo_comm(self, halos: list[float]) -> float:
        """Two all_to_all per message-passing layer (forward rows, backward gradients), every rank taking part.
        A layer exchanges its input rows: the features' dtype for a first layer that reads x, else the
        activations' (autocast outputs in mixed precision)."""
        world = list(range(self.cluster.world_size))
        if len(world) == 1:
            return 0.0
        comm, elem = 0.0, self.stats.feature_bytes
        for sh in self.shapes:
            if sh.kind != "dense":
                comm += 2 * collective_time("all_to_all", max(halos) * sh.d_in * elem, world, self.cluster)
            elem = self.b
        return comm

    def _price_partition(self, shares: list[int], order: torch.Tensor | None) -> tuple:
        s = self.stats
        if s.edge_index is not None:
            order = self.locality() if order is None else order
            q = partition_quality(s.edge_index, s.num_nodes, order, shares, cut=False)
            halos, owner_edges, sends = ([float(v) for v in q[k]] for k in ("halo", "edges", "send"))
        else:
            halos = [self.expected_halo(n) for n in shares]
            owner_edges = [n * s.avg_degree for n in shares]
            sends = halos
        compute, mems, flops, graph = [], [], 0.0, []
        for d in range(self.cluster.world_size):
            work, mem = self._partition_rank(d, shares[d], halos[d], owner_edges[d], sends[d])
            compute.append(work.fwd + work.bwd)
            mems.append(int(mem))
            graph.append([int(b) for b in self.graph_bytes(shares[d], halos[d], owner_edges[d], sends[d])])
            flops += work.flops
        return shares, halos, compute, mems, flops, owner_edges, s.edge_index is not None, graph

    # ---- sampled data parallel ----------------------------------------------------------------------
    def sampled_degree(self, fanout: int) -> float:
        s = self.stats
        if s.edge_index is not None:
            deg = in_degree(s.edge_index, s.num_nodes, exclude_self_loops=True)
            return float(deg.clamp(max=fanout).float().mean()) if fanout > 0 else float(deg.float().mean())
        return min(float(fanout), s.avg_degree) if fanout > 0 else s.avg_degree

    def levels(self, seeds: float, k: float) -> tuple[list[float], list[float]]:
        """Expected node-set sizes n_0..n_L and edges per layer of a mini-batch of `seeds` seeds."""
        n_total = max(self.stats.num_nodes, 1)
        sizes, edges = [float(seeds)], []
        for _ in range(self.layers):
            n = sizes[0]
            edges.insert(0, n * k)
            sizes.insert(0, min(n_total, n + (n_total - n) * (1 - math.exp(-n * k / n_total))))
        return sizes, edges

    def _sampled_rank(self, d: int, seeds: float, k: float) -> tuple[float, float, Work, str]:
        s = self.stats
        sizes, edges = self.levels(seeds, k)
        work = forward_work(self.cm(d), self.shapes, sizes, edges, self.b)
        graph_bytes = s.num_nodes * s.features * s.feature_bytes + 16 * s.num_edges
        feat = sizes[0] * s.features * s.feature_bytes
        base = self.state + work.act + work.transient + 16 * sum(edges) + feat
        if base + graph_bytes <= self.usable(d):
            where, mem = "device", base + graph_bytes
            fetch = self.cm(d).op_time("gather", 0, 2 * feat)
        else:
            where, mem = "host", base
            link = self.cluster.devices[d].spec.host_link
            fetch = link.latency + feat / link.bandwidth
        # the program samples on the host CPU, then trains: in sampled_dp the two are serial on every rank
        sample = self.host_cm().op_time("other", 0, 16 * sum(sizes[1:]) * max(self.stats.avg_degree, 1.0))
        return work.fwd + work.bwd + fetch + sample, mem, work, where

    def sampled_dp(self, batch_size: int, fanout: int) -> Candidate:
        world = self.cluster.world_size
        batch = max(1, min(batch_size, self.stats.labelled))
        k = self.sampled_degree(fanout)
        chunk = max(1.0, batch / world)
        fixed, marginal, caps = [], [], []
        for d in range(world):
            t1, mem, _, _ = self._sampled_rank(d, chunk, k)
            t2 = self._sampled_rank(d, 2 * chunk, k)[0]
            marginal.append(max((t2 - t1) / chunk, 1e-15))
            fixed.append(max(t1 - marginal[-1] * chunk, 0.0))
            caps.append(batch if mem <= self.usable(d) else max(0.0, math.floor(chunk * self.usable(d) / mem)))
        if sum(int(c) for c in caps) < batch:
            return self._infeasible("sampled_dp", [f"a mini-batch of {batch} seeds does not fit the devices' memory"])
        shares = balanced_shares(batch, fixed, marginal, caps)
        compute, mems, flops, problems, where = [], [], 0.0, [], []
        for d in range(world):
            t, mem, work, w = self._sampled_rank(d, shares[d], k) if shares[d] else (0.0, self.state, Work(), "-")
            compute.append(t)
            mems.append(int(mem))
            flops += work.flops
            where.append(w)
            if mem > self.usable(d):
                problems.append(_mem_problem(self.cluster, d, mem, self.usable(d), f"{shares[d]} seeds"))
        step = max(compute) + self.sync_s

        def price(alt: list[int]) -> tuple[list[float], float]:
            return [self._sampled_rank(d, alt[d], k)[0] if alt[d] else 0.0 for d in range(world)], 0.0

        return Candidate("sampled_dp", shares, not problems, step, batch, compute, 0.0, self.sync_s, mems, flops,
                         problems, {"batch_size": batch, "fanout": fanout, "sampled_degree": k,
                                    "features_on": where,
                                    "idle": self._idle(shares, compute, 0.0, fixed, marginal, caps, price)})

    # ---- sampled pipeline: cpu ranks sample and gather, accelerator ranks train --------------------------
    def pipeline_roles(self) -> tuple[list[int], list[int]]:
        """(samplers, trainers): the cluster's cpu devices and the others; PlanError unless both exist."""
        devs = self.cluster.devices
        samplers = [d.index for d in devs if d.spec.kind == "cpu"]
        trainers = [d.index for d in devs if d.spec.kind != "cpu"]
        if not samplers or not trainers:
            has = "no cpu devices" if not samplers else "only cpu devices"
            raise PlanError(f"graph mode 'sampled_pipeline' needs cpu devices beside accelerators (the cpu ranks "
                            f"sample and gather, the accelerators train); this cluster has {has}. Add cpu devices "
                            f"(e.g. '1x2xA100-80GB+1x2xcpu') or use graph_options={{'mode': 'sampled_dp'}}.")
        return samplers, trainers

    @staticmethod
    def sampler_of(samplers: list[int], trainers: list[int]) -> dict[int, int]:
        """Which sampler feeds which trainer: round robin."""
        return {t: samplers[i % len(samplers)] for i, t in enumerate(trainers)}

    def _batch_bytes(self, sizes: list[float], edges: list[float]) -> float:
        """What a sampler sends a trainer per step: gathered features, local edges, degrees, labels, sizes."""
        return sizes[0] * self.stats.features * self.stats.feature_bytes + 16 * sum(edges) + 8 * sizes[0] \
            + 8 * sizes[-1] + 8 * (2 * len(sizes) + 2)

    def _pipeline_sampler(self, d: int, seeds: float, k: float) -> float:
        """Seconds sampler `d` takes to sample one trainer's mini-batch of `seeds` seeds and gather its features."""
        sizes, _ = self.levels(seeds, k)
        feat = sizes[0] * self.stats.features * self.stats.feature_bytes
        sample = self.cm(d).op_time("other", 0, 16 * sum(sizes[1:]) * max(self.stats.avg_degree, 1.0))
        return sample + self.cm(d).op_time("gather", 0, 2 * feat)

    def _pipeline_trainer(self, d: int, seeds: float, k: float) -> tuple[float, float, Work]:
        """(training seconds, memory, work) of trainer `d` on a received mini-batch of `seeds` seeds."""
        sizes, edges = self.levels(seeds, k)
        work = forward_work(self.cm(d), self.shapes, sizes, edges, self.b)
        return (work.fwd + work.bwd, self.state + work.act + work.transient + 2 * self._batch_bytes(sizes, edges),
                work)

    def sampled_pipeline(self, batch_size: int, fanout: int) -> Candidate:
        """cpu ranks sample and gather each step's mini-batches and send them to the accelerator ranks, which
        train them data parallel: step = max(sampling + gathering on the busiest sampler, the transfers into the
        busiest trainer, its training + gradient all-reduce among the trainers + optimizer), the stages of step
        k + 1 overlapping step k's."""
        samplers, trainers = self.pipeline_roles()
        world = self.cluster.world_size
        batch = max(1, min(batch_size, self.stats.labelled))
        k = self.sampled_degree(fanout)
        feeds = self.sampler_of(samplers, trainers)
        chunk = max(1.0, batch / len(trainers))
        fixed, marginal, caps = [0.0] * world, [1.0] * world, [0.0] * world
        for d in trainers:
            t1, mem, _ = self._pipeline_trainer(d, chunk, k)
            t2 = self._pipeline_trainer(d, 2 * chunk, k)[0]
            marginal[d] = max((t2 - t1) / chunk, 1e-15)
            fixed[d] = max(t1 - marginal[d] * chunk, 0.0)
            caps[d] = batch if mem <= self.usable(d) else max(0.0, math.floor(chunk * self.usable(d) / mem))
        if sum(int(c) for c in caps) < batch:
            return self._infeasible("sampled_pipeline",
                                    [f"a mini-batch of {batch} seeds does not fit the accelerators' memory"])
        shares = balanced_shares(batch, fixed, marginal, caps)
        sync = collective_time("all_reduce", self._grad_bytes, trainers, self.cluster) + max(
            self._opt_time(d) for d in trainers)
        train, transfer, mems, flops, problems = [0.0] * world, [0.0] * world, [0] * world, 0.0, []
        sample = [0.0] * world
        s = self.stats
        graph_bytes = s.num_nodes * s.features * s.feature_bytes + 16 * s.num_edges
        for d in trainers:
            if shares[d]:
                t, mem, work = self._pipeline_trainer(d, shares[d], k)
                sizes, edges = self.levels(shares[d], k)
                transfer[d] = collective_time("p2p", self._batch_bytes(sizes, edges), [feeds[d], d], self.cluster)
                sample[feeds[d]] += self._pipeline_sampler(feeds[d], shares[d], k)
                train[d], flops = t, flops + work.flops
                mems[feeds[d]] = max(mems[feeds[d]], int(graph_bytes))
            else:
                mem = self.state
            mems[d] = int(mem)
        for d in range(world):
            if mems[d] > self.usable(d):
                problems.append(_mem_problem(self.cluster, d, mems[d], self.usable(d),
                                             f"{shares[d]} seeds" if d in trainers else "the graph it samples"))
        stages = {"sample_s": max(sample), "transfer_s": max(transfer), "train_s": max(train) + sync}
        step = max(stages.values())
        compute = [sample[d] if d in samplers else train[d] for d in range(world)]
        return Candidate("sampled_pipeline", shares, not problems, step, batch, compute, max(transfer), sync,
                         mems, flops, problems,
                         {"batch_size": batch, "fanout": fanout, "sampled_degree": k, "samplers": samplers,
                          "trainers": trainers, "sampler_of": {str(t): f for t, f in feeds.items()},
                          "stages": stages, "idle": []})

    # ---- layer pipeline: the message-passing layers split into stages over the ranks -------------------------
    def layer_pipeline(self, chunks: int | None = None, stages: list[int] | None = None) -> Candidate:
        """Full-graph training with rank s computing layers [a_s, b_s) for every node, the nodes in chunks
        (layer_pipeline.py): for each chunk count C tried (`chunks`, else 1, 2, 4, 8), the stages' layers (given
        as layers per rank in `stages`, else the split minimising the slowest stage's compute among those that
        fit memory), the step simulated with the runtime's schedule on the graph's chunk dependencies; the
        fastest C that fits memory wins (ties: fewer chunks). PlanError when the model cannot be pipelined
        (fewer message-passing layers than ranks, a forward that is not a chain of layers)."""
        from .layer_pipeline import StageGraph, chunk_layout, even_chunks, task_bytes_probe, unit_params

        s, world = self.stats, self.cluster.world_size
        sg = StageGraph(self.model)
        L = sg.layers
        if L < world:
            raise PlanError(f"graph mode 'layer_pipeline' gives every rank at least one message-passing layer, but "
                            f"{type(self.model).__name__} has {L} for {world} ranks: plan on at most {L} devices, "
                            f"use a deeper model, or use graph mode 'partition'.")
        if stages is not None:
            stages = [int(v) for v in stages]
            if len(stages) != world or min(stages) < 1 or sum(stages) != L:
                raise PlanError(f"graph_options['stages'] = {stages}: give the number of message-passing layers of "
                                f"each of the {world} ranks, each at least 1, summing to the model's {L}.")
        if chunks is not None and not 1 <= int(chunks) <= s.num_nodes:
            raise PlanError(f"graph_options['chunks'] = {chunks}: give a number of node chunks between 1 and the "
                            f"graph's {s.num_nodes} nodes.")
        mp = [sh for sh in self.shapes if sh.kind != "dense"]
        dense = self._unit_dense(sg)
        params = unit_params(self.model, sg)
        kept = task_bytes_probe(self.model, sg, self.precision,
                                torch.float16 if s.feature_bytes == 2 else torch.float32)
        edge_pos = None
        if s.edge_index is not None:
            order = self.locality()
            position = torch.empty(s.num_nodes, dtype=torch.long)
            position[order] = torch.arange(s.num_nodes)
            edge_pos = position[s.edge_index]
        tried = [int(chunks)] if chunks is not None else [c for c in (1, 2, 4, 8) if c <= s.num_nodes]
        options: dict[int, dict] = {}
        best: tuple | None = None
        for C in tried:
            layout, _ = chunk_layout(edge_pos, s.num_nodes, even_chunks(s.num_nodes, C), s.avg_degree)
            priced = self._pipeline_price(sg, mp, dense, params, kept, layout, stages)
            options[C] = {"step_time_s": priced["step"], "fits": priced["fits"],
                          "peak_memory_bytes": max(priced["mems"]), "stage_layers": priced["stage_layers"],
                          "bubble_fraction": priced["bubble_fraction"], "halo": layout.halo}
            key = (not priced["fits"], priced["step"], C)
            if best is None or key < best[0]:
                best = (key, C, layout, priced)
        assert best is not None
        _, C, layout, priced = best
        problems = [_mem_problem(self.cluster, d, priced["mems"][d], self.usable(d),
                                 f"layers {priced['stage_layers'][d]}") for d in range(world)
                    if priced["mems"][d] > self.usable(d)]
        if not priced["split_fits"]:
            problems = [f"no split of the layers into {world} stages fits memory (the most even one: "
                        + "; ".join(problems) + ")"] if problems else ["no split of the layers into stages fits "
                                                                       "memory"]
        why = (f"{C} chunk{'s' if C > 1 else ''}: " + ("given" if chunks is not None else
               "the fastest predicted step that fits" if priced["fits"] else "none fits; the fastest"))
        extra = {"stage_layers": priced["stage_layers"], "chunks": C, "chunk_sizes": even_chunks(s.num_nodes, C),
                 "chunk_halo": layout.halo, "chunk_reads": [len(r) for r in layout.reads],
                 "stage_params": priced["stage_params"], "boundary_bytes": priced["boundary"],
                 "pipeline": priced["pipeline"], "chunk_options": {str(k): v for k, v in options.items()},
                 "chunks_why": why, "order": "bfs", "idle": []}
        return Candidate("layer_pipeline", [b - a for a, b in priced["stage_layers"]],
                         not problems, priced["step"], s.labelled, priced["busy"], priced["transfer"],
                         priced["sync"], [int(m) for m in priced["mems"]], priced["flops"], problems, extra)

    def _unit_dense(self, sg: object) -> list[list[LayerShape]]:
        """Per unit of the layer chain (0: the code before the first layer; l + 1: after layer l) its linears."""
        out: list[list[LayerShape]] = []
        for names in sg.unit_modules():  # type: ignore[attr-defined]
            shapes = []
            for target in names:
                try:
                    obj = self.model.get_submodule(target)
                except AttributeError:  # a parameter or constant read directly
                    continue
                if isinstance(obj, nn.Linear):
                    shapes.append(LayerShape("dense", obj.in_features, obj.out_features, 0,
                                             2.0 * obj.in_features * obj.out_features))
            out.append(shapes)
        return out

    def _pipeline_tasks(self, d: int, mp: list[LayerShape], dense: list[list[LayerShape]], layout: object
                        ) -> tuple[list[list[float]], list[list[float]], float]:
        """Forward and backward seconds of every unit's task per chunk on device d ([unit][chunk]; unit 0: the
        prefix) and FLOPs of one step over all units."""
        cm, b = self.cm(d), self.b
        C = layout.chunks  # type: ignore[attr-defined]
        fwd = [[0.0] * C for _ in range(len(mp) + 1)]
        bwd = [[0.0] * C for _ in range(len(mp) + 1)]
        flops = 0.0
        for k in range(C):
            n = layout.size(k)  # type: ignore[attr-defined]
            h, e = layout.halo[k], layout.edges[k]  # type: ignore[attr-defined]
            for u in range(len(mp) + 1):
                w = Work()
                if u == 0:  # gather chunk k's feature rows, then the code before layer 0
                    f = self.stats.features * self.stats.feature_bytes
                    w.fwd += cm.op_time("gather", 0, 2 * n * f)
                else:
                    sh = mp[u - 1]
                    lw = layer_work(cm, sh, n + h, n, e, b)
                    w.fwd, w.bwd, w.flops = lw.fwd, lw.bwd, lw.flops
                    if h:  # the halo's rows gathered from the other pieces and joined to the chunk's
                        copy = 2 * (n + h) * sh.d_in * b
                        w.fwd += cm.op_time("gather", 0, copy, launches=2)
                        w.bwd += cm.op_time("gather", 0, 2 * copy, launches=2)
                for sh in dense[u]:
                    lw = layer_work(cm, sh, n, n, 0, b)
                    w.fwd, w.bwd, w.flops = w.fwd + lw.fwd, w.bwd + lw.bwd, w.flops + lw.flops
                fwd[u][k], bwd[u][k] = w.fwd, w.bwd
                flops += w.flops
        return fwd, bwd, flops

    def _pipeline_memory(self, d: int, a: int, b_: int, last: bool, mp: list[LayerShape], params: list[int],
                         kept: list, layout: object) -> float:
        """Bytes rank d holds at its peak computing layers [a, b_) of the layer pipeline: its stage's training
        state and the chunks' graphs, then its tasks in order (layer_pipeline.py's memory paragraph): a forward
        task adds what it keeps (`TaskBytes.kept`, and its joined own + halo input when the chunk has a halo)
        and peaks at that plus its transient; the backward starts with the gradients received for the pieces
        sent, and each backward task peaks at what is alive plus its transient, then frees what it kept and
        its output's gradient and leaves its input rows' gradient."""
        s, b = self.stats, self.b
        C = layout.chunks  # type: ignore[attr-defined]
        sizes = [layout.size(k) for k in range(C)]  # type: ignore[attr-defined]
        halo, edges = layout.halo, layout.edges  # type: ignore[attr-defined]
        p = sum(params[u] for u in range(a + 1, b_ + 1)) + (params[0] if a == 0 else 0)
        pp = self.per_param
        live = p * (pp.total + pp.cast_copy)
        live += 16 * sum(edges) + 8 * sum(n + h for n, h in zip(sizes, halo, strict=True)) + 8 * sum(halo) \
            + 8 * s.num_nodes + (8 * s.num_nodes if last else 0)
        peak = live
        if a == 0:  # the feature rows of every chunk, then the code before the first layer
            live += s.num_nodes * s.features * s.feature_bytes
            for n in sizes:
                peak = max(peak, live + kept[0].forward(n, n, 0))
                live += kept[0].kept(n, n, 0)
        else:  # the pieces received from the previous stage (all receives posted at once)
            live += s.num_nodes * mp[a].d_in * b
        for li in range(a, b_):
            for k in range(C):
                n, h, e = sizes[k], halo[k], edges[k]
                joined = (n + h) * mp[li].d_in * b if h else 0.0
                peak = max(peak, live + joined + kept[li + 1].forward(n + h, n, e))
                live += joined + kept[li + 1].kept(n + h, n, e)
        peak = max(peak, live)
        out_width = mp[b_].d_in if not last else 0
        if not last:  # the gradients of the pieces sent, their receives posted at once
            live += s.num_nodes * out_width * b
            peak = max(peak, live)
        for li in range(b_ - 1, a - 1, -1):
            for k in range(C):
                n, h, e = sizes[k], halo[k], edges[k]
                joined = (n + h) * mp[li].d_in * b if h else 0.0
                peak = max(peak, live + kept[li + 1].backward(n + h, n, e))
                grad_out = n * (mp[li + 1].d_in if li + 1 < len(mp) else 0) * b
                live += n * mp[li].d_in * b - joined - kept[li + 1].kept(n + h, n, e) - grad_out
        return peak

    def _pipeline_price(self, sg: object, mp: list[LayerShape], dense: list[list[LayerShape]], params: list[int],
                        kept: list, layout: object, stages: list[int] | None) -> dict:
        """The layer pipeline priced at one chunk layout: the stages' split, step, per-rank memory."""
        from .layer_pipeline import simulate

        world, L = self.cluster.world_size, len(mp)
        tasks = {}
        for d in range(world):  # one pricing per device type
            name = self.cluster.devices[d].spec.name
            if name not in tasks:
                tasks[name] = self._pipeline_tasks(d, mp, dense, layout)
        per = [tasks[self.cluster.devices[d].spec.name] for d in range(world)]

        def stage_time(d: int, a: int, b_: int) -> float:
            fwd, bwd = per[d][0], per[d][1]
            t = sum(sum(fwd[u]) + sum(bwd[u]) for u in range(a + 1, b_ + 1))
            return t + (sum(per[d][0][0]) if a == 0 else 0.0)

        def fits(d: int, a: int, b_: int) -> bool:
            return self._pipeline_memory(d, a, b_, d == world - 1, mp, params, kept, layout) <= self.usable(d)

        if stages is not None:
            bounds = [0]
            for n in stages:
                bounds.append(bounds[-1] + n)
            split = [(bounds[i], bounds[i + 1]) for i in range(world)]
        else:
            split = self._split_layers(L, world, stage_time, fits)
        feasible = split is not None
        if split is None:  # nothing fits: price the even split, to say by how much
            q, r = divmod(L, world)
            bounds = [0]
            for i in range(world):
                bounds.append(bounds[-1] + q + (1 if i < r else 0))
            split = [(bounds[i], bounds[i + 1]) for i in range(world)]
        b = self.b
        fwd = [[per[d][0][u + 1] for u in range(a, b_)] for d, (a, b_) in enumerate(split)]
        bwd = [[per[d][1][u + 1] for u in range(a, b_)] for d, (a, b_) in enumerate(split)]
        xfer = [[collective_time("p2p", layout.size(k) * mp[split[d][1]].d_in * b, [d, d + 1], self.cluster)
                 for k in range(layout.chunks)] for d in range(world - 1)]  # type: ignore[attr-defined]
        sim = simulate(split, layout, fwd, bwd, (per[0][0][0], per[0][1][0]), xfer)  # type: ignore[arg-type]
        mems = [self._pipeline_memory(d, a, b_, d == world - 1, mp, params, kept, layout)
                for d, (a, b_) in enumerate(split)]
        stage_params = [sum(params[u] for u in range(a + 1, b_ + 1)) + (params[0] if a == 0 else 0)
                        for a, b_ in split]
        pp = self.per_param
        opt = [2 * p * pp.total / self.cluster.devices[d].spec.memory_bandwidth for d, p in enumerate(stage_params)]
        sync = max(opt) + collective_time("all_reduce", 4, list(range(world)), self.cluster)
        step = sim.step_s + sync
        flops = per[0][2]
        bubble = [sim.step_s - sim.busy[d] for d in range(world)]
        return {"stage_layers": [list(x) for x in split], "split_fits": feasible,
                "fits": feasible and all(m <= self.usable(d) for d, m in enumerate(mems)), "step": step,
                "mems": mems, "busy": sim.busy, "transfer": sim.transfer_s, "sync": sync, "flops": flops,
                "stage_params": stage_params,
                "boundary": [int(sum(layout.size(k) for k in range(layout.chunks)) * mp[b_].d_in * b)  # type: ignore[attr-defined]
                             for _, b_ in split[:-1]],
                "bubble_fraction": sum(bubble) / world / step if step > 0 else 0.0,
                "pipeline": {"forward_end_s": sim.forward_end, "backward_end_s": sim.backward_end,
                             "busy_s": sim.busy, "idle_s": bubble, "transfer_s": sim.transfer_s,
                             "optimizer_s": opt}}

    @staticmethod
    def _split_layers(L: int, world: int, time: Callable[[int, int, int], float],
                      fits: Callable[[int, int, int], bool]) -> list[tuple[int, int]] | None:
        """Consecutive layer ranges, one per rank, minimising the slowest rank's compute among the splits whose
        every stage fits its rank's memory (dynamic programming over the split points); None if none fits."""
        inf = math.inf
        best = [[inf] * (L + 1) for _ in range(world + 1)]
        back = [[-1] * (L + 1) for _ in range(world + 1)]
        best[0][0] = 0.0
        for d in range(world):
            for b_ in range(d + 1, L - (world - d - 1) + 1):
                for a in range(d, b_):
                    if best[d][a] == inf or not fits(d, a, b_):
                        continue
                    t = max(best[d][a], time(d, a, b_))
                    if t < best[d + 1][b_]:
                        best[d + 1][b_], back[d + 1][b_] = t, a
        if best[world][L] == inf:
            return None
        split, b_ = [], L
        for d in range(world, 0, -1):
            a = back[d][b_]
            split.append((a, b_))
            b_ = a
        return split[::-1]

    def _idle(self, shares: list[int], compute: list[float], comm: float, fixed: list[float],
              marginal: list[float], caps: list[float],
              price: Callable[[list[int]], tuple[list[float], float]]) -> list[dict]:
        """Why each device left with a zero share gets none, in the cost model's numbers: it has no memory for
        one item, or giving it k items (1, and 1/4, 1/2, all of its speed-proportional share; taken from the
        working ranks in proportion to their shares) prices no faster step. The best k tried is kept."""
        world, total = len(shares), sum(shares)
        step = max(compute) + comm + self.sync_s
        busiest = max(range(world), key=lambda r: compute[r])
        out = []
        for d in (d for d in range(world) if shares[d] == 0):
            info: dict = {"device": d, "type": self.cluster.devices[d].spec.name, "cap": int(caps[d])}
            if int(caps[d]) < 1 or total < 2:
                out.append({**info, "why": "memory" if int(caps[d]) < 1 else "too_small"})
                continue
            weights = [1.0 / marginal[r] if shares[r] or r == d else 0.0 for r in range(world)]
            prop = proportional_shares(total, weights, caps)[d]
            best: dict = {}
            for k in sorted({1, max(1, prop // 4), max(1, prop // 2), max(1, prop)}):
                if k > caps[d] or k >= total:
                    continue
                alt = proportional_shares(total - k, [float(x) for x in shares])
                alt[d] = k
                alt_compute, alt_comm = price(alt)
                alt_step = max(alt_compute) + alt_comm + self.sync_s
                if not best or alt_step < best["step_s"]:
                    best = {"share": k, "step_s": alt_step, "compute_s": max(alt_compute), "comm_s": alt_comm,
                            "own_compute_s": alt_compute[d], "shares": alt}
            rel = best["step_s"] / step - 1 if step > 0 else 0.0
            why = "slower" if rel > 1e-3 else ("no_gain" if rel >= -1e-3 else "balance")
            out.append({**info, **best, "why": why, "fixed_s": fixed[d], "chosen_step_s": step,
                        "chosen_compute_s": max(compute), "chosen_comm_s": comm, "busiest": busiest,
                        "busiest_fixed_s": fixed[busiest]})
        return out

    def infeasible(self, mode: str, problems: list[str]) -> Candidate:
        """A candidate that cannot run: `problems` say why."""
        return self._infeasible(mode, problems)

    def _infeasible(self, mode: str, problems: list[str]) -> Candidate:
        world = self.cluster.world_size
        return Candidate(mode, [0] * world, False, math.inf, 0, [0.0] * world, 0.0, 0.0, [0] * world, 0.0, problems)


def _mem_problem(cluster: Cluster, d: int, need: float, usable: float, what: str) -> str:
    return (f"device {d} ({cluster.devices[d].spec.name}) needs {need / 2**30:.2f} GiB for {what}, "
            f"{usable / 2**30:.2f} GiB usable")


__all__ = ["Candidate", "GraphCostModel", "GraphStats", "LayerShape", "forward_work", "layer_work",
           "model_shapes"]
