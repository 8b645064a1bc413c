"""Temporal GNN training pipelined with bounded memory staleness (MSPipe, Sheng et al., KDD 2024): its rule, its
options, its price and its plan (`plan_temporal_pipeline`; graphs/temporal_program.py runs it).

The rule (replayed on one process by `train_stale_reference`). W_k is the node-memory table (memory and last
update time of every node) after the write-backs of steps 0..k; E_j is batch j's events; U_theta(W, E) applies
the messages of E to the nodes E touches with the GRU (tgn.TGN.updated_memory). Step i, staleness s:

    V_i = U_theta_i(W_{i-1-s}, E_{i-1-s})        batch i reads the memory as of after batch i-1-s
    loss_i = link loss of E_i on V_i              differentiable in theta_i (the GRU included)
    W_i = W_{i-1} with the rows E_{i-1-s} touches replaced by V_i's (detached): the write-back of step i

(W_{-1} = the initial table; no messages for i-1-s < 0). Every batch's messages are applied once, in order,
s steps late; at s = 0 this is exact TGN training (tgn.train_tgn_reference). Where a node's rows are written
by steps i-s..i-1 and again by step i, step i's write (from the older table) wins, as in MSPipe.

Division of labour. The GRU write-back over every node a batch touches is the replicated, step-serial part of
exact training (plan_temporal: every rank recomputes it). Here it leaves the trainers: `memory ranks` (the
slowest devices, cpu ones first) compute the write-back rows with no gradient, each a slice of the touched
nodes, and broadcast them; `trainers` split each batch's events and compute, with gradients, only the rows
their events read (at most 3 per event), then all-reduce among themselves. The write-back of step i needs
theta_i and W_{i-1-s} only, so it runs while the trainers train step i (and the s steps after it); the
trainers wait for it at step i+1+s. Every rank keeps the table (replicated, updated in place from the
broadcast rows) and the rows of the s+1 write-backs in flight: the extra memory staleness costs.

Pricing: a trainer's step T (events' embedding and scores, needed GRU rows, all-reduce), the memory ranks' busy
time M (their GRU slice), and the write-back's latency L (theta to the memory ranks, GRU, rows to every rank).
The step is max(T, M, L / (s + 1)); the least s with L / (s + 1) <= max(T, M) keeps the pipeline busy
(staleness "auto", at most max_staleness).
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..cluster import Cluster
from ..errors import PlanError
from .tgn import TGN, event_batch

if TYPE_CHECKING:
    from ..runtime.program import OptimizerFactory

TEMPORAL_MODES = ("temporal_dp", "temporal_pipeline")
TEMPORAL_DEFAULTS: dict[str, Any] = {"mode": "temporal_dp", "staleness": "auto", "max_staleness": 4,
                                     "memory_ranks": "auto"}


class StalenessWarning(UserWarning):
    """A plan whose training reads node memory some batches stale: its results differ from exact training."""


def temporal_options(options: dict | None, world: int) -> dict[str, Any]:
    """graph_options of a temporal GNN, checked: mode, staleness, max_staleness, memory_ranks."""
    given = dict(options or {})
    unknown = sorted(set(given) - set(TEMPORAL_DEFAULTS))
    if unknown:
        raise PlanError(f"graph options {unknown} do not apply to a temporal GNN (tgn.TGN); its options are "
                        f"{sorted(TEMPORAL_DEFAULTS)} with mode in {TEMPORAL_MODES}.")
    opts = {**TEMPORAL_DEFAULTS, **given}
    if opts["mode"] not in TEMPORAL_MODES:
        raise PlanError(f"graph_options mode {opts['mode']!r} is not a temporal GNN mode: use 'temporal_dp' (exact "
                        f"data parallel, the default) or 'temporal_pipeline' (memory staleness, opt-in).")
    if opts["mode"] == "temporal_dp":
        extra = [k for k in ("staleness", "max_staleness", "memory_ranks") if k in given]
        if extra:
            raise PlanError(f"graph_options {extra} need mode 'temporal_pipeline' (temporal_dp is exact and has no "
                            f"staleness): add 'mode': 'temporal_pipeline' to opt in.")
        return opts
    for key in ("max_staleness", "staleness"):
        v = opts[key]
        if key == "staleness" and v == "auto":
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise PlanError(f"graph_options {key}={v!r}: give a whole number of batches >= 0 (0 is exact)"
                            + (" or 'auto'." if key == "staleness" else "."))
    m = opts["memory_ranks"]
    if m != "auto" and (isinstance(m, bool) or not isinstance(m, int) or not 1 <= m < world):
        raise PlanError(f"graph_options memory_ranks={m!r}: give 'auto' or a number of ranks from 1 to "
                        f"{world - 1} (the other ranks train) on this {world}-rank cluster.")
    if world < 2:
        raise PlanError("mode 'temporal_pipeline' divides the ranks into memory ranks and trainers: it needs at "
                        "least 2 ranks; on one device use mode 'temporal_dp'.")
    return opts


def memory_slices(count: int, weights: list[float]) -> list[int]:
    """Rows of a write-back each memory rank computes (contiguous, in node order): proportional to speed."""
    from .halo import proportional_shares

    return proportional_shares(count, weights)


def gru_parameters(model: TGN) -> list[nn.Parameter]:
    """The parameters a write-back uses (the GRU and the time encoding), in a fixed order."""
    return [*model.gru.parameters(), *model.time_enc.parameters()]


def distinct(k: float, n: int) -> float:
    """Expected distinct nodes among k uniform draws from n (the priced count of rows a batch touches)."""
    return n * (1.0 - math.exp(-k / max(n, 1)))


def read_rows(model: TGN, batch: int, share: int) -> float:
    """Expected GRU rows a trainer computes: the distinct nodes its events read (src, dst, negative) that the
    pending batch touches."""
    n = model.num_nodes
    return distinct(3 * share, n) * distinct(2 * batch, n) / max(n, 1)


def pipeline_memory_bytes(model: TGN, batch: int, share: int, staleness: int, role: str, params: int,
                          slice_rows: float | None = None, first_trainer: bool = False) -> int:
    """Bytes a rank of the temporal pipeline holds at its peak (what temporal_program.py allocates): the
    model and its node-memory table; the events of the s+2 steps from E_{i-1-s} to E_i and the write-back rows
    of the s+1 steps in flight; the theta buffer (memory ranks, first trainer); a memory rank's GRU slice; a
    trainer's gradients, AdamW moments and, whichever is larger, the optimizer step's temporaries or the
    activations its loss keeps for the backward (per event: 3 embeddings' inputs and time encodings, 2 scores'
    inputs and hidden rows; per GRU row: its inputs and gates)."""
    n, d = model.num_nodes, model.memory.shape[1]
    time_dim, emb = model.time_enc.out_features, model.embed.out_features
    msg = model.gru.input_size - 2 * d - time_dim
    touched = distinct(2 * batch, n)
    resident = 4 * params + 4 * n * (d + 1)  # parameters, memory table and last-update times
    inflight = (staleness + 2) * 4 * batch * (3 + msg) + (staleness + 1) * touched * (4 * d + 8 + 4)
    theta = 4 * sum(p.numel() for p in gru_parameters(model))
    gru_in = 2 * d + msg + time_dim
    if role == "memory":
        rows = touched if slice_rows is None else slice_rows
        return int(resident + inflight + theta + 4 * rows * (gru_in + 8 * d))
    acts = (4 * read_rows(model, batch, share) * (gru_in + 7 * d + time_dim + 4)
            + 4 * share * (3 * (d + 2 * time_dim) + 2 * 3 * emb + 13))
    backward = 4 * params * 3 + acts  # AdamW's two moments, the gradients, the saved activations
    # the gradient reduction: the moments, the gradients, the flat reduced buffer and the one parameter's gradient
    # being copied out of it (the optimizer step's temporaries take no more)
    step = 4 * params * 4 + 4 * max(p.numel() for p in model.parameters())
    return int(resident + inflight + max(backward, step) + (theta if first_trainer else 0))


def price_pipeline(model: TGN, cluster: Cluster, batch: int, precision: str, optimizer: object,
                   profiles: dict, memory_ranks: int, staleness: int | None, max_staleness: int) -> dict[str, Any]:
    """The pipeline's roles, shares, stage times, staleness and memory with `memory_ranks` memory ranks.
    `staleness` None: the least that keeps the pipeline busy, at most `max_staleness`."""
    from ..cost_models.comm import collective_time
    from ..cost_models.compute import ComputeModel
    from ..cost_models.memory import state_bytes_per_param
    from .halo import balanced_shares

    world = cluster.world_size
    speed = [d.spec.flops(precision) for d in cluster.devices]
    # the slowest devices keep the memory (cpu ones first); the fastest train
    order = sorted(range(world), key=lambda r: (cluster.devices[r].spec.kind != "cpu", speed[r], -r))
    mem = sorted(order[:memory_ranks])
    trainers = [r for r in range(world) if r not in mem]
    params = sum(p.numel() for p in model.parameters())
    d = model.memory.shape[1]
    gru_row = 2 * (model.gru.weight_ih.numel() + model.gru.weight_hh.numel())  # forward flops per node row
    per_event = 6 * sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)) * 3
    cms = [ComputeModel(dev.spec, profiles.get(dev.spec.name), dtype=precision) for dev in cluster.devices]

    def train_time(r: int, n: int) -> float:
        rows = read_rows(model, batch, n)
        flops = per_event * n + 3 * gru_row * rows
        return cms[r].op_time("matmul", flops, 4 * flops / 6, launches=16)

    fixed, marginal = [], []
    for r in trainers:
        one, two = train_time(r, batch), train_time(r, 2 * batch)
        marginal.append(max((two - one) / batch, 1e-15))
        fixed.append(one - marginal[-1] * batch)
    shares_t = balanced_shares(batch, fixed, marginal)
    touched = round(distinct(2 * batch, model.num_nodes))
    slices = memory_slices(touched, [speed[m] for m in mem])
    mem_s = [cms[m].op_time("matmul", gru_row * k, 4 * gru_row * k / 6, launches=6) for m, k in zip(mem, slices,
                                                                                                  strict=True)]
    grads = state_bytes_per_param(optimizer, precision).grads * params
    sync = collective_time("all_reduce", grads, trainers, cluster)
    train_s = [train_time(r, n) for r, n in zip(trainers, shares_t, strict=True)]
    merge = max(cms[r].op_time("elementwise", 0, 3 * 4 * touched * d, launches=2) for r in range(world))
    T = max(train_s) + sync + merge
    M = max(mem_s)
    theta = collective_time("broadcast", 4 * sum(p.numel() for p in gru_parameters(model)),
                            [trainers[0], *mem], cluster)
    rows = sum(collective_time("broadcast", 4 * k * d, list(range(world)), cluster) for k in slices)
    latency = theta + M + rows
    busy = max(T, M)
    need = max(0, math.ceil(latency / busy - 1e-9) - 1)
    s = min(need, max_staleness) if staleness is None else staleness
    step = max(T, M, latency / (s + 1))
    shares = [0] * world
    for r, n in zip(trainers, shares_t, strict=True):
        shares[r] = n
    rows_at = dict(zip(mem, memory_slices(round(distinct(2 * batch, model.num_nodes)), [speed[m] for m in mem]),
                       strict=True))
    peak = [pipeline_memory_bytes(model, batch, shares[r], s, "memory" if r in mem else "trainer", params,
                                  rows_at.get(r), r == trainers[0]) for r in range(world)]
    compute = [0.0] * world
    for r, t in zip(trainers, train_s, strict=True):
        compute[r] = t
    for m, t in zip(mem, mem_s, strict=True):
        compute[m] = t
    return {"memory_ranks": mem, "trainers": trainers, "shares": shares, "memory_slices": slices,
            "staleness": s, "staleness_needed": need, "step_time_s": step, "compute_s": compute,
            "peak_memory_bytes": peak, "sync_s": sync,
            "stages": {"train_s": T, "memory_s": M, "latency_s": latency, "theta_s": theta, "rows_s": rows}}


def plan_temporal_pipeline(model: TGN, cluster: Cluster | str | dict, example_inputs: tuple,
                           optimizer: object = "adamw", precision: str | None = None, *,
                           options: dict | None = None, memory_reserve: float = 0.1,
                           profiles: dict | None = None) -> Any:
    """The plan of a temporal GNN: exact data parallel (mode 'temporal_dp', tgn.plan_temporal) or, on request,
    the MSPipe pipeline with bounded staleness (mode 'temporal_pipeline'; StalenessWarning naming it)."""
    from ..cost_models.compute import check_profiles
    from ..errors import InfeasibleError
    from ..ir.plan import Pipeline, Stage
    from ..ir.precision import resolve_precision
    from .tgn import plan_temporal, temporal_plan

    cluster = Cluster.load(cluster)
    opts = temporal_options(options, cluster.world_size)
    exact = plan_temporal(model, cluster, example_inputs, optimizer, precision, memory_reserve=memory_reserve,
                          profiles=profiles)
    if opts["mode"] == "temporal_dp":
        return exact
    precision = resolve_precision(cluster, precision)
    profiles = check_profiles(profiles, cluster)
    batch = int(example_inputs[0].shape[0])
    fixed = None if opts["staleness"] == "auto" else int(opts["staleness"])
    counts = range(1, cluster.world_size) if opts["memory_ranks"] == "auto" else [int(opts["memory_ranks"])]
    options_priced = [price_pipeline(model, cluster, batch, precision, optimizer, profiles, k, fixed,
                                     int(opts["max_staleness"])) for k in counts]
    best = min(options_priced, key=lambda c: (c["step_time_s"], len(c["memory_ranks"])))
    capacity = [(1 - memory_reserve) * d.spec.memory for d in cluster.devices]
    over = [r for r in range(cluster.world_size) if best["peak_memory_bytes"][r] > capacity[r]]
    if over:
        raise InfeasibleError(f"temporal_pipeline does not fit memory on ranks {over}: each rank keeps the node "
                              f"memory table and s+1 write-backs; lower the staleness or use temporal_dp.")
    dp = exact.graph["candidates"]["temporal_dp"]
    step = best["step_time_s"]
    s = best["staleness"]
    speedup = dp["step_time_s"] / step
    why = (f"staleness {s}: the write-back (theta to the memory ranks, their GRU, rows to every rank) takes "
           f"{best['stages']['latency_s']:.3g} s against a busy stage of "
           f"{max(best['stages']['train_s'], best['stages']['memory_s']):.3g} s, so it needs "
           f"{best['staleness_needed']} step(s) of slack" + (" (given)" if fixed is not None else
                                                             f" (at most max_staleness {opts['max_staleness']})"))
    warnings.warn(f"temporal_pipeline trains with node memory up to {s} batch(es) stale (MSPipe bounded "
                  f"staleness): batch i reads the memory as of after batch i-1-{s}; losses and parameters differ "
                  f"from exact training (mode 'temporal_dp')" + ("" if s else ", except at staleness 0, which "
                                                                  "is exact") + ".", StalenessWarning, stacklevel=2)
    pipes = []
    for r in range(cluster.world_size):
        c = best["compute_s"][r]
        pred = {"fwd_s": c / 3, "bwd_s": 2 * c / 3, "compute_s": c, "comm_s": 0.0, "sync_s": best["sync_s"]}
        pipes.append(Pipeline(best["shares"][r], best["shares"][r], 1, [Stage([0, 1], [r], predicted=pred)]))
    peak = dict(enumerate(best["peak_memory_bytes"]))
    cand = {"fits": True, "step_time_s": step, "samples_per_s": batch / step, "compute_s": best["compute_s"],
            "peak_memory_bytes": best["peak_memory_bytes"], "staleness": s}
    graph = {"mode": "temporal_pipeline", "unit": "events", "shares": best["shares"], "batch_size": batch,
             "num_nodes": model.num_nodes, "staleness": s, "staleness_needed": best["staleness_needed"],
             "max_staleness": int(opts["max_staleness"]), "staleness_why": why,
             "memory_ranks": best["memory_ranks"], "trainers": best["trainers"],
             "memory_slices": best["memory_slices"], "stages": best["stages"],
             "speedup_vs_temporal_dp": speedup,
             "candidates": {"temporal_dp": dp, "temporal_pipeline": cand}}
    flops = exact.predicted["tflops_per_device"] * 1e12 * exact.predicted["step_time_s"] * cluster.world_size
    return temporal_plan(cluster, batch, precision, optimizer, memory_reserve,
                         sum(p.numel() for p in model.parameters()), pipes, step, flops, peak, graph)


def train_stale_reference(model: TGN, events: dict[str, torch.Tensor], batch_size: int, steps: int, staleness: int,
                          optimizer: OptimizerFactory) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process replaying the rule (module docstring) with the model's own full-table forward: step i sets
    the model's table to W_{i-1-s} and its pending messages to E_{i-1-s}, trains batch i, and keeps the write-
    back (the touched rows of the detached updated table) to apply s steps later. Returns the losses and the
    final state with every write-back applied (the table W_{steps-1}; `pending` the next batch to apply)."""
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    width = model.pending.shape[1]
    batches = [event_batch(events, batch_size, k) for k in range(steps)]
    packed = [torch.cat([b[0][:, None].float(), b[1][:, None].float(), b[2][:, None], b[3]], dim=1) for b in batches]
    writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    losses = []
    for i in range(steps):
        j = i - 1 - staleness
        with torch.no_grad():
            model.pending = packed[j] if j >= 0 else torch.zeros(0, width)
        loss = model(*batches[i])
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
        nodes = model.pending_index(model.pending)[0] if j >= 0 else torch.zeros(0, dtype=torch.long)
        new_mem, new_last = model._next  # type: ignore[misc]
        writes.append((nodes, new_mem[nodes].clone(), new_last[nodes].clone()))
        model._next = None
        if i - staleness >= 0:  # the table becomes W_{i-s}: the next step reads it
            _apply(model, writes[i - staleness])
    for k in range(max(0, steps - staleness), steps):
        _apply(model, writes[k])
    with torch.no_grad():
        model.pending = packed[steps - 1 - staleness] if steps - 1 - staleness >= 0 else torch.zeros(0, width)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def _apply(model: TGN, write: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    nodes, mem, last = write
    model.memory[nodes] = mem
    model.last_update[nodes] = last


__all__ = ["TEMPORAL_DEFAULTS", "TEMPORAL_MODES", "StalenessWarning", "distinct", "gru_parameters",
           "memory_slices", "pipeline_memory_bytes", "plan_temporal_pipeline", "price_pipeline", "read_rows",
           "temporal_options", "train_stale_reference"]
