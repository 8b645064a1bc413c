"""Per-rank training programs for graph workloads (built by `autopar.compile` when the plan has `plan.graph`).

partition: rank r owns a range of nodes (plan.graph["shares"]), runs the model on its owned rows with halo
    exchange before every message-passing layer (layers.py, partition.py); loss = sum over ranks of
    (local labelled mean) x (local labelled / global labelled) = the global labelled mean.
sampled_dp: every step takes a global mini-batch of seeds (sampling.seeds_for_step); rank r takes its share
    and runs the layered subgraph of per-node deterministic samples; loss weighted by seeds share.
sampled_pipeline: the sampled_dp algorithm with cpu ranks sampling and gathering for the accelerator ranks
    (pipeline.py); only the trainers hold a share of seeds, compute gradients and step their optimizer.
layer_pipeline: rank s holds the parameters of stage s's message-passing layers (rank 0's weights at start; the
    other stages' are meta tensors) and computes them for every node, the nodes in chunks flowing from stage to
    stage (layer_pipeline.py); each rank steps its own optimizer, no gradient is reduced.
The others: parameters replicated (rank 0's weights at start), gradients summed with one all-reduce, then the
optimizer steps identically everywhere. The plan's precision runs as everywhere else (runtime/precision.py):
bf16/fp16 autocast around the forward with fp32 weights, optimizer state and gradient reduction, fp16 with
dynamic loss scaling; fp32 plans compute in fp32.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import PlanError
from ..passes.capture import LossFn
from ..runtime.dist import DEFAULT_TIMEOUT_S, all_reduce, broadcast
from ..runtime.precision import PrecisionPolicy
from ..runtime.program import OptimizerFactory, make_optimizer
from ..runtime.whole_model import WholeModelState
from .data import IGNORE, check_graph_inputs
from .exchange import halo_exchange
from .halo import partition_graph
from .layer_program import LayerPipeline
from .layers import LocalGraph, local_layers, message_passing_layers
from .partitioners import partition_order
from .pipeline import pipeline_groups, recv_batch, send_batches, step_batches
from .sampling import InEdges, build_minibatch, labelled_nodes, seeds_for_step

if TYPE_CHECKING:
    from ..runtime.plan_check import PlanCheck
    from .store import LocalPart
    from .tgn import TGN


def sync_replicas(model: nn.Module, world: int, timeout_s: float) -> None:
    """Every replica starts from rank 0's parameters and buffers."""
    if world > 1:
        for t in list(model.parameters()) + list(model.buffers()):
            broadcast(t.data, 0, "initial parameter broadcast", timeout_s)


def reduce_step(params: list[nn.Parameter], weighted_loss: torch.Tensor, world: int, timeout_s: float,
                what: str, group: object | None = None) -> float:
    """Sum every parameter's gradient and the weighted loss over ranks (one flat all-reduce); the global loss.

    A parameter no rank computed a gradient for keeps grad None, as in single-process training (the optimizer
    then skips it: no weight decay, no step count)."""
    dtype = params[0].dtype if params else torch.float32
    has = torch.tensor([0.0 if p.grad is None else 1.0 for p in params], dtype=dtype,
                       device=weighted_loss.device)  # NCCL reduces device tensors
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                     + [has, weighted_loss.detach().reshape(1).to(dtype)])
    if world > 1:
        all_reduce(flat, dist.group.WORLD if group is None else group, what, timeout_s)
    offset, total = 0, sum(p.numel() for p in params)
    used = (flat[total:total + len(params)] > 0).tolist()  # one device sync, not one per parameter
    for i, p in enumerate(params):
        p.grad = flat[offset:offset + p.numel()].view_as(p).clone() if used[i] else None
        offset += p.numel()
    return float(flat[-1])


def train_step(policy: PrecisionPolicy, params: list[nn.Parameter], optimizer: torch.optim.Optimizer,
               weighted_loss: torch.Tensor, world: int, timeout_s: float, what: str,
               group: object | None = None) -> float:
    """Backward of this rank's weighted loss (loss-scaled under fp16), the gradient all-reduce, the optimizer
    step (skipped on every rank alike when fp16 gradients overflow); the global loss."""
    policy.scale(weighted_loss).backward()
    value = reduce_step(params, weighted_loss, world, timeout_s, what, group)
    if policy.unscale(params, optimizer, world):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return value


class GraphProgram(WholeModelState):
    """One rank's program for full-graph partitioned or sampled data-parallel GNN training."""

    def __init__(self, model: nn.Module, plan: Any, loss_fn: LossFn | None, optimizer: str | OptimizerFactory,
                 rank: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S, data: LocalPart | None = None,
                 plan_check: PlanCheck | None = None) -> None:
        """`data`: this rank's part of partition-local graph data (store.py, `compile(graph_data=)`): the
        program then trains on it alone, `step()` without the graph. `plan_check`: the window measuring this
        rank's memory against the plan (opened before `data` was read; closed after its first steps)."""
        g = plan.graph or {}
        if data is not None and g.get("mode") != "partition":
            raise PlanError("graph_data= trains partition-mode plans; this plan is "
                            f"{g.get('mode')!r}.")
        if g.get("mode") not in ("partition", "sampled_dp", "sampled_pipeline", "layer_pipeline"):
            raise PlanError(f"plan.graph mode must be 'partition', 'sampled_dp', 'sampled_pipeline' or "
                            f"'layer_pipeline', got {g.get('mode')!r}.")
        if len(g["shares"]) != world_size:
            raise PlanError(f"the plan has {len(g['shares'])} graph shares but {world_size} ranks run; plan for "
                            f"this cluster.")
        if loss_fn is None:
            raise PlanError("graph training needs loss_fn(output_rows, target_rows), e.g. F.cross_entropy.")
        self.model, self.plan, self.loss_fn = model, plan, loss_fn
        self.mode, self.shares = g["mode"], [int(s) for s in g["shares"]]
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.layers = len(message_passing_layers(model))
        self.step_count = 0
        self._key: tuple | None = None
        self._part_key: tuple | None = None  # the graph `part` was made for (`_partition`)
        self.data, self.plan_check = data, plan_check
        sync_replicas(model, world_size, timeout_s)
        if self.mode == "layer_pipeline":  # this rank keeps its stage's parameters only
            self.pipe = LayerPipeline(model, plan, rank, world_size, timeout_s)
        self.params = [p for p in model.parameters() if p.requires_grad and not p.is_meta]
        self.optimizer = make_optimizer(optimizer, self.params)
        if self.mode == "sampled_pipeline":
            self.trainers = [int(t) for t in g["trainers"]]
            self.sampler_of = {int(t): int(f) for t, f in g["sampler_of"].items()}
            self.role = "trainer" if rank in self.trainers else "sampler"
            self.groups = pipeline_groups(self.trainers)
            self._ahead: tuple | None = None  # (graph key, step, batches) sampled during the last step
        if data is not None:
            device = self.params[0].device if self.params else torch.device("cpu")
            self.part = replace(data.part, **{k: getattr(data.part, k).to(device)
                                              for k in ("owned", "edges", "degree", "send_index")})
            self.x_local, self.y_local = data.x.to(device), data.y.to(device)
            self.local_labelled = int((data.y != IGNORE).sum())
            self.device = device
            self.policy = PrecisionPolicy.of_plan(plan, device, timeout_s)

    def _check(self, x: torch.Tensor, edge_index: torch.Tensor) -> None:
        check_graph_inputs(x, edge_index)
        g, n = self.plan.graph, x.shape[0]
        if g.get("num_nodes") not in (None, n):
            raise PlanError(f"the plan was made for a graph of {g['num_nodes']} nodes, this one has {n}: plan "
                            f"again for this graph.")

    def _partition(self, x: torch.Tensor, edge_index: torch.Tensor) -> Any:
        """This rank's part of the graph (partition mode) on the data's device, computed once per graph
        (index bookkeeping on the CPU)."""
        key = (edge_index.data_ptr(), tuple(edge_index.shape), x.shape[0])
        if key != self._part_key:
            cpu = edge_index.cpu()
            part = partition_graph(cpu, x.shape[0], self.shares, self.rank,
                                   partition_order(cpu, x.shape[0], self.plan.graph))
            self.part = replace(part, **{k: getattr(part, k).to(x.device)
                                         for k in ("owned", "edges", "degree", "send_index")})
            self._part_key = key
        return self.part

    @staticmethod
    def _partitioned(part: Any) -> LocalGraph:
        """The layers' view of a partition: the owned rows with their halo, exchanged before every layer."""
        n_own = part.owned.numel()
        return LocalGraph([part.edges], [n_own], [n_own], part.degree, lambda h: halo_exchange(h, part))

    def _prepare(self, x: torch.Tensor, edge_index: torch.Tensor, target: torch.Tensor) -> None:
        key = (edge_index.data_ptr(), tuple(edge_index.shape), x.shape[0], target.data_ptr())
        if key == self._key:
            return
        self._check(x, edge_index)
        n = x.shape[0]
        self.device = x.device
        self.policy = PrecisionPolicy.of_plan(self.plan, self.device, self.timeout_s)
        self.labelled = labelled_nodes(target.cpu())
        if self.mode == "layer_pipeline":
            self.pipe.prepare(x, edge_index, target)
        elif self.mode == "partition":
            is_lab = torch.zeros(n, dtype=torch.bool)
            is_lab[self.labelled] = True
            self.local_labelled = int(is_lab[self._partition(x, edge_index).owned.cpu()].sum())
        elif not (self.mode == "sampled_pipeline" and self.role == "trainer"):  # trainers receive their batches
            self.in_edges = InEdges(edge_index.cpu(), n)
        self._key = key

    def checkpoint_writer(self) -> int:
        return self.trainers[0] if self.mode == "sampled_pipeline" else 0

    # ---- layer_pipeline: each rank holds its stage's parameters, its state is its stage's ----
    def state_dict(self) -> dict:
        """The model's and optimizer's state dicts and the step; in layer_pipeline mode this rank's stage only
        (the entries it holds: the other stages' parameters are meta tensors here)."""
        sd = super().state_dict()
        if self.mode == "layer_pipeline":
            sd["model"] = {k: v for k, v in sd["model"].items() if not v.is_meta}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if self.mode != "layer_pipeline":
            super().load_state_dict(sd)
            return
        mine = {k: v for k, v in sd["model"].items() if k in self.pipe.owned}
        missing = sorted(self.pipe.owned - set(mine))
        if missing:
            raise PlanError(f"load_state_dict: rank {self.rank}'s stage needs {missing[:4]}"
                            f"{' ...' if len(missing) > 4 else ''}, which the state dict does not hold.")
        self.model.load_state_dict(mine, strict=False)
        if isinstance(sd.get("optimizer"), dict) and "param_groups" in sd["optimizer"]:
            self.optimizer.load_state_dict(sd["optimizer"])
        self.step_count = int(sd.get("step", self.step_count))

    def checkpoint_entries(self) -> dict:
        """layer_pipeline: every rank writes its stage's entries (rank 0 also the step and the plan), so the
        directory holds the whole model, as any program's does; the other modes: `checkpoint_writer()` writes."""
        if self.mode == "layer_pipeline":
            return self.state_entries(with_step=self.rank == 0)
        return super().checkpoint_entries()

    def save(self, path: Any) -> None:
        self.share_trained()
        super().save(path)

    def load(self, path: Any) -> None:
        """Load any program's checkpoint; layer_pipeline: each rank reads its stage's entries. Collective."""
        if self.mode != "layer_pipeline":
            super().load(path)
            return
        from ..runtime import checkpoint

        self.step_count = checkpoint.load_into_model(self.model, path, self.optimizer, only=self.pipe.owned)
        if self.world_size > 1 and dist.is_initialized():
            dist.barrier()

    def share_trained(self) -> None:
        """sampled_pipeline: sampler ranks take the first trainer's parameters and buffers (they never train
        theirs). `save`, `load` and `eval_step` call it; call it before reading `state_dict()` on a sampler.
        Collective; nothing in the other modes."""
        if self.mode == "sampled_pipeline" and self.world_size > 1:
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                broadcast(t.data, self.trainers[0], "trained parameters to the sampler ranks", self.timeout_s)

    def what_runs(self) -> str:
        if self.mode == "sampled_pipeline" and self.role == "sampler":
            fed = [t for t, f in self.sampler_of.items() if f == self.rank]
            return f"samples and gathers the mini-batches of ranks {fed} (sampled_pipeline)"
        if self.mode == "layer_pipeline":
            a, b = self.pipe.a, self.pipe.b
            return (f"message-passing layers [{a}, {b}) of {self.layers} for every node, {self.pipe.C} chunk"
                    f"{'s' if self.pipe.C > 1 else ''} (layer_pipeline)")
        unit = "nodes owned" if self.mode == "partition" else "seeds per step"
        return f"the whole model, {self.shares[self.rank]} {unit} ({self.mode})"

    def eval_step(self, x: torch.Tensor | None = None, edge_index: torch.Tensor | None = None) -> torch.Tensor:
        """Forward only, no gradient and no update: the model's output for every node of the graph, the same on
        every rank. Partitioned: each rank computes its own nodes with the halo exchange, as in training, and
        the rows are gathered in node order; sampled: the model as written on the full graph (every neighbour,
        on every rank: what a sampled-trained GNN is evaluated with). With graph_data (`eval_step()`): this
        rank's owned rows only, in the order of `prog.part.owned` (their global ids); no rank gathers the
        whole graph's output. Collective."""
        from ..runtime.eval import concat_from

        if self.data is not None:
            self._no_graph(x, edge_index, None)
            with torch.no_grad(), local_layers(self.model, self._partitioned(self.part)), self.policy.forward():
                return self.model(self.x_local, self.part.edges)
        if x is None or edge_index is None:
            raise PlanError("eval_step(x, edge_index): this program was compiled without graph_data=, so it "
                            "needs the graph.")
        self._check(x, edge_index)
        self.share_trained()
        policy = PrecisionPolicy.of_plan(self.plan, x.device, self.timeout_s)
        if self.mode == "layer_pipeline":  # the last stage's output for every node, sent to every rank
            self.pipe.prepare(x, edge_index, None)
            with torch.no_grad():
                f = self.pipe.forward(x, policy, self.loss_fn, train=False)
                self.pipe.finish(f)
                out = self.pipe.output(f)
            return concat_from(None if out is None else [out], [self.world_size - 1], self.world_size,
                               self.timeout_s, x.device, self.pipe.comm.world)[0]
        with torch.no_grad():
            if self.mode != "partition":
                with policy.forward():
                    return self.model(x, edge_index)
            part = self._partition(x, edge_index)
            with local_layers(self.model, self._partitioned(part)), policy.forward():
                out = self.model(x[part.owned], part.edges)
            rows, owned = concat_from([out, part.owned], list(range(self.world_size)), self.world_size,
                                      self.timeout_s, x.device)
            full = rows.new_empty((x.shape[0], *rows.shape[1:]))
            full[owned.to(full.device)] = rows.to(full.device)
            return full

    def step(self, x: torch.Tensor | None = None, edge_index: torch.Tensor | None = None,
             target: torch.Tensor | None = None) -> float:
        """One optimizer step on the graph; returns the global loss (mean over labelled nodes or seeds).
        Compiled with graph_data=: `step()` / `step(target=None)` trains on this rank's part."""
        if self.plan_check is not None:
            self.plan_check.step_started()
        with self.timed_step():
            value = self._step(x, edge_index, target)
        if self.plan_check is not None:
            self.plan_check.step_done()
        return value

    def _no_graph(self, x: Any, edge_index: Any, target: Any) -> None:
        if x is not None or edge_index is not None or target is not None:
            raise PlanError(f"this program trains on rank {self.rank}'s part of graph_data= "
                            f"({self.data.meta.get('num_nodes')} nodes written by autopar.graphs.partition): call "
                            f"prog.step() / prog.step(target=None) without x, edge_index or target, or compile "
                            f"without graph_data= to train on a graph every rank holds.")

    def _step(self, x: torch.Tensor | None, edge_index: torch.Tensor | None, target: torch.Tensor | None) -> float:
        if self.data is not None:
            self._no_graph(x, edge_index, target)
            return self._local_step()
        if target is None:
            raise PlanError("graph training needs target= (per-node labels, -100 for unlabelled nodes), or a "
                            "program compiled with graph_data= (prog.step(target=None) then trains on its part).")
        if x is None or edge_index is None:
            raise PlanError("step(x, edge_index, target=y): this program was compiled without graph_data=, so it "
                            "needs the graph.")
        self._prepare(x, edge_index, target)
        if self.mode == "sampled_pipeline":
            return self._pipeline_step(x, target)
        if self.mode == "layer_pipeline":
            return self._layer_pipeline_step(x)
        if self.mode == "partition":
            part = self._partition(x, edge_index)
            ctx = self._partitioned(part)
            rows, count, total = part.owned, self.local_labelled, self.labelled.numel()
            model_edges = part.edges
        else:
            g = self.plan.graph
            seeds = seeds_for_step(self.labelled, int(g["batch_size"]), self.step_count, int(g.get("seed", 0)))
            if seeds.numel() != sum(self.shares):
                raise PlanError(f"the plan splits {sum(self.shares)} seeds per step but the graph gives "
                                f"{seeds.numel()} (labelled nodes: {self.labelled.numel()}); plan again.")
            lo = sum(self.shares[:self.rank])
            mb = build_minibatch(self.in_edges, seeds[lo:lo + self.shares[self.rank]], self.layers,
                                 int(g["fanout"]), self.step_count, int(g.get("seed", 0)))
            edges = [e.to(self.device) for e in mb.edges]
            ctx = LocalGraph(edges, mb.sizes[:-1], mb.sizes[1:], mb.degree.to(self.device), lambda h: h)
            rows, count, total = mb.nodes.to(self.device), self.shares[self.rank], seeds.numel()
            model_edges = edges[0]
        with local_layers(self.model, ctx), self.policy.forward():
            out = self.model(x[rows], model_edges)
        n_out = count if self.mode == "sampled_dp" else rows.numel()
        out_rows = out.shape[0] if isinstance(out, torch.Tensor) else None
        if out_rows != n_out:
            raise PlanError(f"the model returned {out_rows} rows for {n_out} nodes: graph training expects one "
                            f"output row per node (node classification / regression).")
        labels = target[rows] if self.mode == "partition" else target[rows[:count]]
        with self.policy.forward():  # the loss under autocast too, as in a captured stage (its fp32 list)
            loss = self.loss_fn(out, labels) if count else out.sum() * 0.0
        value = train_step(self.policy, self.params, self.optimizer, loss.float() * (count / total),
                           self.world_size, self.timeout_s, f"gradient all-reduce of graph training ({self.mode})")
        self.step_count += 1
        return value

    def _pipeline_step(self, x: torch.Tensor, target: torch.Tensor) -> float:
        """sampled_pipeline. A sampler sends this step's batches (sampled during the last step), samples the
        next step's while the trainers train, and returns nan (the loss is known on the trainers). A trainer
        receives its batch and trains it, the gradients all-reduced among the trainers."""
        g, step = self.plan.graph, self.step_count
        if self.role == "sampler":
            fed = [t for t, f in self.sampler_of.items() if f == self.rank]
            if self._ahead is not None and self._ahead[:2] == (self._key, step):
                batches = self._ahead[2]
            else:
                batches = step_batches(self.in_edges, x, target, self.labelled, g, self.shares, fed, self.layers,
                                       step)
            works = send_batches(batches, self.groups.transfer)
            self._ahead = (self._key, step + 1, step_batches(self.in_edges, x, target, self.labelled, g,
                                                             self.shares, fed, self.layers, step + 1))
            for w in works:
                w.wait()
            self.step_count += 1
            return math.nan
        batch = recv_batch(self.sampler_of[self.rank], self.layers, x.cpu(), target.cpu(), self.groups.transfer)
        sizes, edges, degree = batch.minibatch(self.layers)
        edges = [e.to(self.device) for e in edges]
        ctx = LocalGraph(edges, sizes[:-1], sizes[1:], degree.to(self.device), lambda h: h)
        count, total = self.shares[self.rank], sum(self.shares)
        with local_layers(self.model, ctx), self.policy.forward():
            out = self.model(batch.features.to(self.device), edges[0])
        if not isinstance(out, torch.Tensor) or out.shape[0] != count:
            raise PlanError(f"the model returned {getattr(out, 'shape', type(out))} for {count} seeds: graph "
                            f"training expects one output row per node (node classification / regression).")
        with self.policy.forward():
            loss = self.loss_fn(out, batch.labels.to(self.device)) if count else out.sum() * 0.0
        value = train_step(self.policy, self.params, self.optimizer, loss.float() * (count / total),
                           len(self.trainers), self.timeout_s, "gradient all-reduce among the trainers "
                           "(sampled_pipeline)", self.groups.trainers)
        self.step_count += 1
        return value

    def _layer_pipeline_step(self, x: torch.Tensor) -> float:
        """layer_pipeline: this stage's forward and backward over every chunk (layer_pipeline.py), the loss from
        the last stage to every rank (one all-reduce of one element), then this rank's optimizer step."""
        f = self.pipe.forward(x, self.policy, self.loss_fn, train=True)
        self.pipe.backward(f, self.policy)
        loss = torch.tensor([f.value if self.pipe.last else 0.0], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            all_reduce(loss, dist.group.WORLD, "the loss from the last stage (layer_pipeline)", self.timeout_s,
                       self.pipe.comm.world)
        if self.policy.unscale(self.params, self.optimizer, self.world_size, self.pipe.comm.world):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        return float(loss)

    def _local_step(self) -> float:
        """A partition step on this rank's part of graph_data (the same arithmetic as `_step` on the full
        graph: the part's rows are the rows partition_graph gives this rank)."""
        assert self.data is not None
        count, total = self.local_labelled, self.data.labelled
        with local_layers(self.model, self._partitioned(self.part)), self.policy.forward():
            out = self.model(self.x_local, self.part.edges)
        if not isinstance(out, torch.Tensor) or out.shape[0] != self.x_local.shape[0]:
            raise PlanError(f"the model returned {getattr(out, 'shape', type(out))} for {self.x_local.shape[0]} "
                            f"nodes: graph training expects one output row per node.")
        with self.policy.forward():
            loss = self.loss_fn(out, self.y_local) if count else out.sum() * 0.0
        value = train_step(self.policy, self.params, self.optimizer, loss.float() * (count / max(total, 1)),
                           self.world_size, self.timeout_s, "gradient all-reduce of graph training (graph_data)")
        self.step_count += 1
        return value

    def report(self) -> Any:
        """As `WholeModelState.report`, with this rank's measured peak when the plan's check measured it
        (graph_data programs). Collective."""
        if self.plan_check is None:
            return super().report()
        self.plan_check.close()
        self.plan_check.figures.stages = [self.what_runs()]
        return self.plan_check.report(self.world_size if dist.is_initialized() else 1)


class TemporalProgram(WholeModelState):
    """One rank's exact data-parallel TGN training: `step(src, dst, t, msg, eid)` on a global batch."""

    def __init__(self, model: TGN, plan: Any, optimizer: str | OptimizerFactory, rank: int, world_size: int,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if (plan.graph or {}).get("mode") != "temporal_dp" or len(plan.graph["shares"]) != world_size:
            raise PlanError("a TGN needs a temporal_dp plan with one event share per rank; plan for this cluster.")
        self.model, self.plan, self.rank, self.world_size, self.timeout_s = model, plan, rank, world_size, timeout_s
        self.shares, self.step_count = [int(s) for s in plan.graph["shares"]], 0
        sync_replicas(model, world_size, timeout_s)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(optimizer, self.params)
        self.policy = PrecisionPolicy.of_plan(plan, model.memory.device, timeout_s)

    def what_runs(self) -> str:
        return f"the whole model, {self.shares[self.rank]} events per batch (temporal_dp)"

    def eval_step(self, src: torch.Tensor, dst: torch.Tensor, t: torch.Tensor, msg: torch.Tensor,
                  eid: torch.Tensor) -> torch.Tensor:
        """Forward only on a batch of events, no gradient, no update and no memory commit: the model's loss on
        it, the same on every rank (the node memory is replicated, so every rank computes the whole batch)."""
        with torch.no_grad(), self.policy.forward():
            return self.model(src, dst, t, msg, eid)

    def step(self, src: torch.Tensor, dst: torch.Tensor, t: torch.Tensor, msg: torch.Tensor, eid: torch.Tensor,
             target: Any = None) -> float:
        """One optimizer step on a global batch of events; returns its mean loss."""
        with self.timed_step():
            return self._step(src, dst, t, msg, eid)

    def _step(self, src: torch.Tensor, dst: torch.Tensor, t: torch.Tensor, msg: torch.Tensor, eid: torch.Tensor
              ) -> float:
        b = src.shape[0]
        if b != sum(self.shares):
            raise PlanError(f"the plan splits batches of {sum(self.shares)} events, got {b}: plan again.")
        lo, n = sum(self.shares[:self.rank]), self.shares[self.rank]
        part = [x[lo:lo + n] for x in (src, dst, t, msg, eid)]
        with self.policy.forward():
            loss = self.model(*part) if n else self.model(*[x[:1] for x in (src, dst, t, msg, eid)]) * 0.0
        value = train_step(self.policy, self.params, self.optimizer, loss.float() * (n / b), self.world_size,
                           self.timeout_s, "gradient all-reduce (TGN)")
        self.model.commit(src, dst, t, msg)
        self.step_count += 1
        return value


__all__ = ["GraphProgram", "TemporalProgram", "reduce_step", "sync_replicas", "train_step"]
