"""A memory-based temporal GNN (TGN-style node memory) and its exact data-parallel plan (`plan_temporal`; the
program that runs it is graphs/program.py `TemporalProgram`).

Model (Rossi et al. 2020, reduced to its memory module): every node has a memory vector. A batch of events
(src, dst, t, msg) is trained as TGN does:
  1. the memory of nodes touched by the previous batch is updated by a GRU from their latest raw message
     [own memory, other end's memory, msg, cos-time-encoding(t - last update)] (the "last" aggregator);
  2. node embeddings = Linear([updated memory, time encoding of the time since the update]);
  3. link prediction: an MLP scores (src, dst) against (src, negative), binary cross-entropy; negatives are
     a hash of the global event id, so they do not depend on how events are split;
  4. after the optimizer step the updated memory (detached) is kept and this batch's events become the
     pending messages (`commit`).

Data parallelism: the events of a global batch are split across ranks (speed-proportional shares). Step 1
depends only on the previous global batch, so every rank recomputes it identically (memory stays
replicated, no exchange); steps 2-3 run on the rank's events with loss weight (its events / batch); the
gradient all-reduce then sums exactly the single-process gradient, and every rank commits the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..cluster import Cluster
from ..models import ModelCase, building
from .sampling import edge_scores

if TYPE_CHECKING:
    from ..ir.plan import Pipeline, Plan
    from ..runtime.program import OptimizerFactory


class TGN(nn.Module):
    def __init__(self, num_nodes: int, msg_dim: int, memory_dim: int = 32, time_dim: int = 16, emb_dim: int = 32):
        super().__init__()
        self.num_nodes = num_nodes
        self.time_enc = nn.Linear(1, time_dim)
        self.gru = nn.GRUCell(2 * memory_dim + msg_dim + time_dim, memory_dim)
        self.embed = nn.Linear(memory_dim + time_dim, emb_dim)
        self.score = nn.Sequential(nn.Linear(2 * emb_dim, emb_dim), nn.ReLU(), nn.Linear(emb_dim, 1))
        self.register_buffer("memory", torch.zeros(num_nodes, memory_dim))
        self.register_buffer("last_update", torch.zeros(num_nodes))
        # the previous batch's events: the messages of the next memory update
        self.register_buffer("pending", torch.zeros(0, 3 + msg_dim))
        self._next: tuple[torch.Tensor, torch.Tensor] | None = None

    def encode_time(self, dt: torch.Tensor) -> torch.Tensor:
        return torch.cos(self.time_enc(dt.unsqueeze(-1)))

    def pending_index(self, pending: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Of a batch of pending events: the nodes it touches (ascending), the row of each one's latest event in
        the two-role concatenation [src events; dst events] ("last" aggregator: src role before dst role at
        the same event), and that event's time."""
        src, dst, t = pending[:, 0].long(), pending[:, 1].long(), pending[:, 2]
        b = src.shape[0]
        node = torch.cat([src, dst])
        ar = torch.arange(b, device=src.device)
        key = torch.cat([2 * ar, 2 * ar + 1])
        latest = torch.full((self.num_nodes,), -1, dtype=torch.long, device=src.device).scatter_reduce(
            0, node, key, "amax")
        nodes = (latest >= 0).nonzero().flatten()
        k = latest[nodes]
        sel = torch.where(k % 2 == 0, k // 2, b + k // 2)  # the key's position in the concatenation
        return nodes, sel, torch.cat([t, t])[sel]

    def raw_messages(self, memory: torch.Tensor, last: torch.Tensor, pending: torch.Tensor, nodes: torch.Tensor,
                     sel: torch.Tensor, tt: torch.Tensor) -> torch.Tensor:
        """The GRU inputs of `nodes` (rows of `pending_index`): [own memory, other end's memory, msg, time]."""
        src, dst, msg = pending[:, 0].long(), pending[:, 1].long(), pending[:, 3:]
        other = torch.cat([dst, src])
        return torch.cat([memory[nodes], memory[other[sel]], torch.cat([msg, msg])[sel],
                          self.encode_time(tt - last[nodes])], dim=1)

    def updated_memory(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(memory, last_update) after applying the pending messages; differentiable in the parameters."""
        memory, last = self.memory, self.last_update
        if self.pending.shape[0] == 0:
            return memory, last
        nodes, sel, tt = self.pending_index(self.pending)
        raw = self.raw_messages(memory, last, self.pending, nodes, sel, tt)
        new = memory.index_put((nodes,), self.gru(raw, memory[nodes]).to(memory.dtype))  # autocast: fp16 out
        return new, last.index_put((nodes,), tt)

    def link_loss(self, memory: torch.Tensor, last: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                  t: torch.Tensor, eid: torch.Tensor, seed: int = 0,
                  row: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Mean link-prediction loss of these events on node memory rows `memory` / `last`; `row` maps node
        ids to rows of them (None: the rows are the whole table)."""
        neg = edge_scores(eid, 0, seed + 7) % self.num_nodes

        def z(v: torch.Tensor) -> torch.Tensor:
            r = v if row is None else row(v)
            return self.embed(torch.cat([memory[r], self.encode_time(t - last[r])], dim=1))

        zs = z(src)
        pos = self.score(torch.cat([zs, z(dst)], dim=1)).squeeze(-1)
        negs = self.score(torch.cat([zs, z(neg)], dim=1)).squeeze(-1)
        return (F.binary_cross_entropy_with_logits(pos, torch.ones_like(pos))
                + F.binary_cross_entropy_with_logits(negs, torch.zeros_like(negs)))

    def forward(self, src: torch.Tensor, dst: torch.Tensor, t: torch.Tensor, msg: torch.Tensor,
                eid: torch.Tensor, seed: int = 0) -> torch.Tensor:
        """Mean link-prediction loss of these events (positives and one hashed negative per event)."""
        memory, last = self.updated_memory()
        self._next = (memory.detach(), last.detach())
        return self.link_loss(memory, last, src, dst, t, eid, seed)

    @torch.no_grad()
    def commit(self, src: torch.Tensor, dst: torch.Tensor, t: torch.Tensor, msg: torch.Tensor) -> None:
        """After the optimizer step: keep the updated memory, queue this (global) batch's messages."""
        if self._next is None:
            self._next = tuple(x.detach() for x in self.updated_memory())  # type: ignore[assignment]
        self.memory.copy_(self._next[0])
        self.last_update.copy_(self._next[1])
        self.pending = torch.cat([src[:, None].float(), dst[:, None].float(), t[:, None], msg], dim=1)
        self._next = None


def random_events(num_nodes: int, num_events: int, msg_dim: int = 8, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """A generated event stream (time-sorted): src, dst, t, msg, eid. Destinations prefer a few hubs."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, num_nodes, (num_events,), generator=g)
    hubs = torch.randint(0, num_nodes, (max(1, num_nodes // 8),), generator=g)
    dst = torch.where(torch.rand(num_events, generator=g) < 0.5,
                      hubs[torch.randint(0, hubs.numel(), (num_events,), generator=g)],
                      torch.randint(0, num_nodes, (num_events,), generator=g))
    t = torch.sort(torch.rand(num_events, generator=g) * 100).values
    msg = torch.randn(num_events, msg_dim, generator=g)
    return {"src": src, "dst": dst, "t": t, "msg": msg, "eid": torch.arange(num_events)}


def event_batch(events: dict[str, torch.Tensor], batch_size: int, k: int) -> tuple[torch.Tensor, ...]:
    """Batch k as the model's inputs (src, dst, t, msg, eid)."""
    s = slice(k * batch_size, (k + 1) * batch_size)
    return tuple(events[n][s] for n in ("src", "dst", "t", "msg", "eid"))


def tgn_case(num_nodes: int = 100, num_events: int = 600, msg_dim: int = 8, batch_size: int = 50, *,
             seed: int = 0) -> tuple[ModelCase, dict[str, torch.Tensor]]:
    """The TGN model with its first batch as example inputs, and the whole event stream."""
    with building("cpu", seed):
        model = TGN(num_nodes, msg_dim)
    events = random_events(num_nodes, num_events, msg_dim, seed=seed)
    return ModelCase(model, event_batch(events, batch_size, 0), None, None, "tgn"), events


def train_tgn_reference(model: TGN, events: dict[str, torch.Tensor], batch_size: int, steps: int,
                        optimizer: OptimizerFactory) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process TGN training over the first `steps` batches."""
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for k in range(steps):
        batch = event_batch(events, batch_size, k)
        loss = model(*batch)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.commit(*batch[:4])
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def plan_temporal(model: TGN, cluster: Cluster | str | dict, example_inputs: tuple, optimizer: object = "adamw",
                  precision: str | None = None, *, memory_reserve: float = 0.1, profiles: dict | None = None) -> Any:
    """Data-parallel plan for a TGN: events of a batch split by device speed, memory replicated; `profiles` as
    in `autopar.plan`."""
    from ..cost_models.comm import collective_time
    from ..cost_models.compute import ComputeModel, check_profiles
    from ..cost_models.memory import state_bytes_per_param
    from ..ir.plan import Pipeline, Stage
    from ..ir.precision import resolve_precision
    from .halo import balanced_shares

    cluster = Cluster.load(cluster)
    precision = resolve_precision(cluster, precision)
    profiles = check_profiles(profiles, cluster)
    batch = int(example_inputs[0].shape[0])
    params = sum(p.numel() for p in model.parameters())
    per_event_flops = 6 * sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)) * 3
    update_flops = 2 * 6 * model.gru.weight_ih.numel() * 3 * batch  # two ends of every pending event
    fixed, marginal = [], []
    for d in cluster.devices:
        cm = ComputeModel(d.spec, profiles.get(d.spec.name), dtype=precision)
        one = cm.op_time("matmul", per_event_flops * batch, 4 * per_event_flops * batch / 6, launches=12)
        two = cm.op_time("matmul", 2 * per_event_flops * batch, 8 * per_event_flops * batch / 6, launches=12)
        marginal.append(max((two - one) / batch, 1e-15))
        # the replicated memory update is paid by every rank whatever its share
        fixed.append(one - marginal[-1] * batch + cm.op_time("matmul", update_flops, 4 * update_flops / 6, 6))
    shares = balanced_shares(batch, fixed, marginal)
    grads = state_bytes_per_param(optimizer, precision).grads * params
    sync = collective_time("all_reduce", grads, list(range(cluster.world_size)), cluster)
    compute = [fixed[r] + shares[r] * marginal[r] for r in range(cluster.world_size)]
    step = max(compute) + sync
    state = state_bytes_per_param(optimizer, precision).total * params + model.memory.numel() * 4 * 2
    pipes = [Pipeline(s, s, 1, [Stage([0, 1], [r], predicted={"fwd_s": c / 3, "bwd_s": 2 * c / 3, "compute_s": c,
                                                               "comm_s": 0.0, "sync_s": sync})])
             for r, (s, c) in enumerate(zip(shares, compute, strict=True))]
    peak = dict.fromkeys(range(cluster.world_size), int(state))
    graph = {"mode": "temporal_dp", "unit": "events", "shares": shares, "batch_size": batch,
             "num_nodes": model.num_nodes,
             "candidates": {"temporal_dp": {"fits": True, "step_time_s": step, "samples_per_s": batch / step,
                                            "compute_s": compute, "peak_memory_bytes": list(peak.values())}}}
    flops = per_event_flops * batch + update_flops * cluster.world_size  # the update runs on every rank
    return temporal_plan(cluster, batch, precision, optimizer, memory_reserve, params, pipes, step, flops, peak, graph)


def temporal_plan(cluster: Cluster, batch: int, precision: str, optimizer: Any, memory_reserve: float, params: int,
                  pipes: list[Pipeline], step: float, flops: float, peak: dict[int, int], graph: dict) -> Plan:
    """A temporal GNN's Plan (one one-layer stage per rank) from its priced step: `flops` the step's total."""
    from ..cost_models.memory import optimizer_name
    from ..ir.plan import Plan

    peak_flops = sum(d.spec.flops(precision) for d in cluster.devices)
    predicted = {"step_time_s": step, "samples_per_s": batch / step,
                 "tflops_per_device": flops / step / cluster.world_size / 1e12, "mfu": flops / step / peak_flops,
                 "bubble_fraction": 0.0, "peak_memory_bytes": peak,
                 "memory_capacity_bytes": {d.index: d.spec.memory for d in cluster.devices}}
    return Plan(batch, precision, optimizer_name(optimizer), "gpipe", 1, cluster.to_dict(),
                {"name": "TGN", "num_layers": 1, "params": params, "layer_names": ["tgn"]}, pipes, predicted,
                memory_reserve, graph=graph)


__all__ = ["TGN", "event_batch", "plan_temporal", "random_events", "tgn_case",
           "train_tgn_reference"]
