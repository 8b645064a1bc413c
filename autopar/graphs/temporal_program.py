"""One rank's program of the temporal pipeline (graph_options mode 'temporal_pipeline'; the rule, the division
of labour and the price: graphs/temporal_pipeline.py).

Per step i, with j = i - 1 - s (s the plan's staleness), every rank is called with the global batch E_i:
* a memory rank makes the table W_j (applies the write-backs up to step j), takes theta_i from the first
  trainer (broadcast; theta_0 is the initial broadcast), computes with no gradient its slice of the GRU rows
  of the nodes E_j touches, and broadcasts it: the write-back of step i. `step()` returns nan.
* a trainer posts the receives of step i's write-back, makes W_j, computes its events' loss with gradients
  through the GRU rows those events read (at most 3 per event), all-reduces the gradients among the trainers
  and steps its optimizer (the first trainer sends theta_i at the start of step i).
Each rank's table is updated in place from the rows, so every rank's table is W_j at step i; the write-backs of
steps j+1..i are in flight (their rows held), and step i+1+s is the first to wait for step i's. Three groups
keep the traffic apart: the trainers' gradient all-reduce, theta (first trainer and memory ranks), and the
write-back rows (every rank).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PlanError
from ..runtime.dist import DEFAULT_TIMEOUT_S, wait
from ..runtime.precision import PrecisionPolicy
from ..runtime.program import OptimizerFactory, make_optimizer
from ..runtime.whole_model import WholeModelState
from .program import sync_replicas, train_step
from .sampling import edge_scores
from .temporal_pipeline import gru_parameters, memory_slices
from .tgn import TGN


class TemporalPipelineProgram(WholeModelState):
    """One rank of TGN training with MSPipe bounded staleness: `step(src, dst, t, msg, eid)` on a global batch
    (the loss on trainers, nan on memory ranks); `flush()` applies the write-backs in flight (end of training)."""

    def __init__(self, model: TGN, plan: Any, optimizer: str | OptimizerFactory, rank: int, world_size: int,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        g = plan.graph or {}
        if g.get("mode") != "temporal_pipeline" or len(g.get("shares", [])) != world_size:
            raise PlanError(f"a temporal_pipeline program needs a temporal_pipeline plan with one entry per rank "
                            f"({world_size}); plan for this cluster with graph_options mode 'temporal_pipeline'.")
        if not isinstance(model, TGN):
            raise PlanError("mode 'temporal_pipeline' trains a temporal GNN (autopar.graphs.TGN).")
        self.model, self.plan, self.rank, self.world_size, self.timeout_s = model, plan, rank, world_size, timeout_s
        self.staleness = int(g["staleness"])
        self.memory_ranks = [int(r) for r in g["memory_ranks"]]
        self.trainers = [int(r) for r in g["trainers"]]
        self.shares = [int(s) for s in g["shares"]]
        self.weights = [float(w) for w in g["memory_slices"]]
        self.role = "memory" if rank in self.memory_ranks else "trainer"
        self.step_count, self.flushed = 0, False
        sync_replicas(model, world_size, timeout_s)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(optimizer, self.params)
        self.policy = PrecisionPolicy.of_plan(plan, model.memory.device, timeout_s)
        # every rank creates every group, in this order
        self.g_train = dist.new_group(self.trainers)
        self.g_theta = dist.new_group([self.trainers[0], *self.memory_ranks])
        self.g_rows = dist.new_group(list(range(world_size)))
        self.theta = gru_parameters(model)
        self.events: dict[int, torch.Tensor] = {}  # step -> its packed events, until their messages are applied
        self.inflight: dict[int, tuple] = {}  # step -> (nodes, times, rows per memory rank, works)
        self.applied = -1  # the table is W_applied
        self._theta_work: Any = None
        # theta travels in one buffer, reused every step (sent by the first trainer, received by memory ranks)
        self._flat = (torch.empty(sum(p.numel() for p in self.theta), dtype=self.theta[0].dtype,
                                  device=self.theta[0].device)
                      if rank in (self.trainers[0], *self.memory_ranks) else None)
        self.gru_rows: list[int] = []  # per step: node rows this rank ran the GRU on (what the split gave it)

    def what_runs(self) -> str:
        if self.role == "memory":
            return (f"the node-memory write-backs (GRU rows of memory slice {self.memory_ranks.index(self.rank)}, "
                    f"no gradient), staleness {self.staleness} (temporal_pipeline)")
        return (f"the loss of {self.shares[self.rank]} events per batch with their memory rows, staleness "
                f"{self.staleness} (temporal_pipeline)")

    def checkpoint_writer(self) -> int:
        return self.trainers[0]

    def state_dict(self) -> dict:
        """The whole model and optimizer state, once `flush()` applied the write-backs in flight (before it, the
        table lags the trained steps: a PlanError says so instead of returning it)."""
        self._check_flushed("state_dict()")
        return super().state_dict()

    def save(self, path: str | os.PathLike) -> None:
        """`WholeModelState.save`, once `flush()` applied the write-backs in flight. Collective."""
        self._check_flushed("save()")
        super().save(path)

    def _check_flushed(self, what: str) -> None:
        if self.inflight and not self.flushed:
            raise PlanError(f"{what}: the node-memory table has {len(self.inflight)} write-back(s) in flight "
                            f"(staleness {self.staleness}), so it lags the trained steps; call prog.flush() first "
                            f"(collective: it applies them and ends the pipeline).")

    # ---- the table ----------------------------------------------------------------------------------------
    def _apply_through(self, k: int) -> None:
        """Make the table W_k: apply the write-backs of steps applied+1..k in order (waiting for their rows)."""
        while self.applied < k:
            step = self.applied + 1
            nodes, tt, rows, works = self.inflight.pop(step)
            for m, w in zip(self.memory_ranks, works, strict=True):
                if w is not None:
                    wait(w, f"write-back rows of step {step} from memory rank {m}", m, self.timeout_s, self.g_rows)
            if nodes.numel():
                with torch.no_grad():
                    self.model.memory[nodes] = torch.cat(rows).to(self.model.memory.dtype)
                    self.model.last_update[nodes] = tt
            self.applied = step

    def flush(self) -> None:
        """Apply every write-back in flight: the model's table becomes W_{last step} and its `pending` the next
        batch to apply (what `temporal_pipeline.train_stale_reference` returns); the memory ranks take the
        first trainer's parameters (they train none). Collective. Ends the pipeline: the next step would read
        an older table than the one kept."""
        self._check_open()
        if self._theta_work is not None:
            wait(self._theta_work, "theta to the memory ranks", self.trainers[0], self.timeout_s, self.g_theta)
            self._theta_work = None
        self._apply_through(self.step_count - 1)
        if self.rank == self.trainers[0] or self.role == "memory":
            for p in self.params:
                wait(dist.broadcast(p.data, self.trainers[0], group=self.g_theta, async_op=True),
                     "trained parameters to the memory ranks", self.trainers[0], self.timeout_s, self.g_theta)
        j = self.step_count - 1 - self.staleness
        with torch.no_grad():
            self.model.pending = (self.events[j] if j in self.events
                                  else torch.zeros(0, self.model.pending.shape[1], device=self.model.memory.device))
        self.flushed = True

    # ---- steps --------------------------------------------------------------------------------------------
    def eval_step(self, src: torch.Tensor, dst: torch.Tensor, t: torch.Tensor, msg: torch.Tensor,
                  eid: torch.Tensor) -> torch.Tensor:
        """Forward only on a batch of events, no gradient, no update: the loss as the next step would compute it
        (memory staleness included), on a trainer (memory ranks do not train the embedding). Before `flush()`."""
        self._check_open()
        if self.role == "memory":
            raise PlanError(f"rank {self.rank} is a memory rank of the temporal pipeline: call eval_step on a "
                            f"trainer ({self.trainers}).")
        j = self.step_count - 1 - self.staleness
        self._apply_through(j)
        with torch.no_grad(), self.policy.forward():
            return self._loss(src, dst, t, msg, eid, self.events.get(j), j)

    def step(self, src: torch.Tensor, dst: torch.Tensor, t: torch.Tensor, msg: torch.Tensor, eid: torch.Tensor,
             target: Any = None) -> float:
        """One step on a global batch of events (every rank gets the whole batch): its mean loss on trainers,
        nan on memory ranks."""
        with self.timed_step():
            return self._step(src, dst, t, msg, eid)

    def _check_open(self) -> None:
        if self.flushed:
            raise PlanError("flush() applied every write-back in flight, so the table is past the stale one the "
                            "next step reads: compile a new program to train on.")

    def _step(self, src: torch.Tensor, dst: torch.Tensor, t: torch.Tensor, msg: torch.Tensor, eid: torch.Tensor
              ) -> float:
        self._check_open()
        b, i = src.shape[0], self.step_count
        if b != sum(self.shares):
            raise PlanError(f"the plan splits batches of {sum(self.shares)} events, got {b}: plan again.")
        self.events[i] = torch.cat([src[:, None].float(), dst[:, None].float(), t[:, None], msg], dim=1)
        j = i - 1 - self.staleness
        pending = self.events.get(j)
        index = self.model.pending_index(pending) if pending is not None else None
        if self.role == "memory":
            if pending is None:
                self.gru_rows.append(0)
            value = self._memory_step(i, j, pending, index)
        else:
            value = self._trainer_step(i, j, pending, index, src, dst, t, msg, eid)
        self.events.pop(j, None)
        self.step_count += 1
        return value

    def _slices(self, count: int) -> list[int]:
        return memory_slices(count, self.weights)

    def _memory_step(self, i: int, j: int, pending: torch.Tensor | None, index: tuple | None) -> float:
        self._apply_through(j)
        if i >= 1:  # theta_i, sent by the first trainer at the start of its step i
            flat = self._flat
            assert flat is not None
            work = dist.broadcast(flat, self.trainers[0], group=self.g_theta, async_op=True)
            wait(work, f"theta of step {i} from the first trainer", self.trainers[0], self.timeout_s, self.g_theta)
            with torch.no_grad():
                offset = 0
                for p in self.theta:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
        if index is None:
            self.inflight[i] = (torch.zeros(0, dtype=torch.long), None, [], [None] * len(self.memory_ranks))
            return math.nan
        assert pending is not None
        nodes, sel, tt = index
        sizes = self._slices(nodes.numel())
        me = self.memory_ranks.index(self.rank)
        lo = sum(sizes[:me])
        mine = slice(lo, lo + sizes[me])
        memory, last = self.model.memory, self.model.last_update
        with torch.no_grad(), self.policy.forward():
            raw = self.model.raw_messages(memory, last, pending, nodes[mine], sel[mine], tt[mine])
            out = self.model.gru(raw, memory[nodes[mine]]).to(memory.dtype)
        self.gru_rows.append(int(out.shape[0]))
        rows, works = [], []
        for m, n in zip(self.memory_ranks, sizes, strict=True):
            buf = out if m == self.rank else torch.empty(n, memory.shape[1], dtype=memory.dtype, device=memory.device)
            rows.append(buf)
            works.append(dist.broadcast(buf, m, group=self.g_rows, async_op=True) if n else None)
        self.inflight[i] = (nodes, tt, rows, works)
        return math.nan

    def _trainer_step(self, i: int, j: int, pending: torch.Tensor | None, index: tuple | None, src: torch.Tensor,
                      dst: torch.Tensor, t: torch.Tensor, msg: torch.Tensor, eid: torch.Tensor) -> float:
        if self.rank == self.trainers[0] and i >= 1:
            if self._theta_work is not None:  # the buffer is free again once the last send completed
                wait(self._theta_work, "theta to the memory ranks", self.trainers[0], self.timeout_s,
                     self.g_theta)
            flat = self._flat
            assert flat is not None
            torch.cat([p.detach().reshape(-1) for p in self.theta], out=flat)
            self._theta_work = dist.broadcast(flat, self.trainers[0], group=self.g_theta, async_op=True)
        if index is None:
            self.inflight[i] = (torch.zeros(0, dtype=torch.long), None, [], [None] * len(self.memory_ranks))
        else:
            nodes, _, tt = index
            d, memory = self.model.memory.shape[1], self.model.memory
            rows = [torch.empty(n, d, dtype=memory.dtype, device=memory.device)
                    for n in self._slices(nodes.numel())]
            works = [dist.broadcast(r, m, group=self.g_rows, async_op=True) if r.shape[0] else None
                     for m, r in zip(self.memory_ranks, rows, strict=True)]
            self.inflight[i] = (nodes, tt, rows, works)
        self._apply_through(j)
        if pending is None:
            self.gru_rows.append(0)
        b = src.shape[0]
        lo, n = sum(self.shares[:self.rank]), self.shares[self.rank]
        part = [x[lo:lo + n] if n else x[:1] for x in (src, dst, t, msg, eid)]
        with self.policy.forward():
            loss = self._loss(*part, pending, j, index)
            if not n:
                loss = loss * 0.0
        return train_step(self.policy, self.params, self.optimizer, loss.float() * (n / b), len(self.trainers),
                          self.timeout_s, "gradient all-reduce among the trainers (temporal_pipeline)", self.g_train)

    def _loss(self, src: torch.Tensor, dst: torch.Tensor, t: torch.Tensor, msg: torch.Tensor, eid: torch.Tensor,
              pending: torch.Tensor | None, j: int, index: tuple | None = None) -> torch.Tensor:
        """The link loss of these events on V = U(W_j, E_j) restricted to the rows they read: the GRU runs,
        with gradients, on the nodes E_j touches among them only (the table holds W_j)."""
        model = self.model
        memory, last = model.memory, model.last_update
        neg = edge_scores(eid, 0, 7) % model.num_nodes  # TGN.link_loss's negatives (seed 0)
        need = torch.unique(torch.cat([src, dst, neg]))  # sorted
        mem_rows, last_rows = memory[need], last[need]
        if pending is not None:
            nodes, sel, tt = index if index is not None else model.pending_index(pending)
            keep = torch.isin(nodes, need)
            nodes, sel, tt = nodes[keep], sel[keep], tt[keep]
            raw = model.raw_messages(memory, last, pending, nodes, sel, tt)
            at = torch.searchsorted(need, nodes)
            # the GRU is in the graph whenever messages are pending (zero gradient when none is read), as in TGN
            mem_rows = mem_rows.index_put((at,), model.gru(raw, memory[nodes]).to(memory.dtype))
            if torch.is_grad_enabled():
                self.gru_rows.append(int(nodes.numel()))
            last_rows = last_rows.index_put((at,), tt)
        return model.link_loss(mem_rows, last_rows, src, dst, t, eid, 0, lambda v: torch.searchsorted(need, v))


__all__ = ["TemporalPipelineProgram"]
