"""Graph mode "layer_pipeline": full-graph GNN training with the message-passing layers split into consecutive
stages over the ranks, the graph's nodes flowing through them in chunks; exact against one process.

When: a GNN deep enough that one rank cannot hold every layer's activations for the whole graph, on a graph whose
node partitions have large halos (random and power-law graphs: a partition rank then computes almost every node
at every layer, so `partition` does not divide the activations). A stage holds only its own layers'. For
GraphSAGE that pays in memory roughly where L x (a partition rank's halo / N) > in-degree + 2 (L layers; the
whole-graph messages of one layer are a stage's transient); the planner prices both (cost.py) and compares.

Design
------
The model is traced once with torch.fx, its message-passing layers as leaves (`StageGraph`). Its forward must be
a chain: prefix (node-wise code on x, e.g. an encoder) -> layer 0 -> segment 1 -> layer 1 -> ... -> layer L-1 ->
segment L (node-wise code after the last layer: activation, head). Segment l + 1 is the code between layers l and
l + 1 (a ReLU, a norm, a linear); it may read only layer l's output (no skip connection across layers). Stage s
(rank s) owns layers [a_s, b_s) and the segments after them; stage 0 also the prefix, the last stage also the head
and the loss. A parameter lives on the rank of its stage only: on the others it is a meta tensor (no storage).

Nodes are renumbered in the locality order (data.locality_order) and cut into C contiguous chunks, the
micro-batches of destination nodes (`chunk_layout`). Task (l, k) computes layer l and the segment after it for
the nodes of chunk k: it reads layer l's input rows of chunk k and of its halo (the in-neighbours in other
chunks; the local graph a partition rank builds, halo.partition_graph's layout, with chunk k as the owned rows)
and keeps chunk k's rows. Every layer's input is kept whole, as one "piece" per chunk: a stage boundary
carries the whole layer output, chunk by chunk as each is computed, and a stage starts task (l, k) only once
every piece it reads exists. No embedding is stale, so the results equal one process's (summation order aside).

Schedule (`next_forward`, `next_backward`; the cost model simulates the same policy, `simulate`):

* forward: a stage runs its ready tasks, deepest layer first (its last layer emits chunks early), then lowest
  chunk; when none is ready it waits for the next piece from stage s - 1, in chunk order. Each chunk of its last
  layer's output goes to stage s + 1 as soon as it is computed.
* backward (GPipe: after the stage's whole forward): every piece is a detached leaf, so each task's backward runs
  once, when the gradient of its output piece is complete: every task that read that piece has run its backward
  (the last stage: the chunk's loss). Shallowest layer first, then lowest chunk. The gradients of the stage's
  input pieces go back to stage s - 1 in chunk order as each completes.
* parameter gradients stay on their stage's rank: no gradient all-reduce; each rank steps its own optimizer.
  The loss (on the last stage) reaches every rank with one all-reduce of one element.

How much the stages overlap is the graph's: task (l, k) waits for every chunk holding one of its halo rows. On
a graph with local structure (a mesh or road network in BFS order) chunk k reads chunks k - 1..k + 1 and the
stages overlap like GPipe micro-batches; on a random or power-law graph every chunk reads every other, so a stage
cannot start before its predecessor has finished, and chunks only add halo copies. The planner simulates the
schedule on the plan's graph and picks C (1 where chunks do not pay); plan.graph["chunk_options"] lists each.

Memory per rank (what cost.GraphCostModel.layer_pipeline prices): its stage's parameters, gradients and
optimizer state; what its layers keep for the backward over the whole graph (one process's activations for those
layers; measured per layer kind by `task_bytes_probe`) and the transient of the task running (a GraphSAGE layer's
backward holds its chunk's messages, E_k x width: C > 1 divides it), plus with C > 1 each task's gathered input
(own + halo rows) beside the pieces; the boundary buffers: the pieces received from stage s - 1 (layer a's input), the
pieces sent (kept for the backward), and in the backward the gradient pieces received from stage s + 1 (their
receives are posted at once) and those sent back; the chunks' local graphs (every in-edge once, with the
global in-degrees GCN's normalisation reads) and the node order. Stage 0 also gathers the features' rows.

The runtime is layer_program.py (`LayerPipeline`, one rank's stage, run by program.GraphProgram). Point to point
follows NCCL's rules (gloo runs the same schedule): every transfer is one `batch_isend_irecv` of
one P2POp, without tags, whose peer posts the matching op, as torch.distributed.pipelining does; on each
adjacent pair the order is fixed: a header (the boundary's width and dtype; first forward only), the C
forward pieces in chunk order, then the C gradient pieces in chunk order. Receivers post their receives up
front; a sender posts each send when its chunk is computed and waits for them once its backward is done (an
eval forward: at its end).
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import PlanError
from .data import in_degree
from .layers import LocalGraph, layer_kind, local_layers, message_passing_layers

# ---- the graph in chunks --------------------------------------------------------------------------------------


def even_chunks(total: int, parts: int) -> list[int]:
    """`total` nodes in `parts` chunks as even as possible, larger ones first."""
    q, r = divmod(total, parts)
    return [q + 1 if i < r else q for i in range(parts)]


@dataclass
class ChunkLayout:
    """How C contiguous chunks of the node order read each other: task (l, k) reads pieces `reads[k]` (k first,
    then its halo's chunks ascending) of layer l's input; `halo[k]` rows, `edges[k]` in-edges."""

    bounds: list[int]
    reads: list[list[int]]
    halo: list[int]
    edges: list[int]

    @property
    def chunks(self) -> int:
        return len(self.bounds) - 1

    def size(self, k: int) -> int:
        return self.bounds[k + 1] - self.bounds[k]

    def readers(self) -> list[list[int]]:
        """readers[j]: the chunks whose tasks read piece j."""
        out: list[list[int]] = [[] for _ in range(self.chunks)]
        for k, rs in enumerate(self.reads):
            for j in rs:
                out[j].append(k)
        return out


@dataclass
class ChunkGraph:
    """Chunk k's local graph (on the device): rows [own (bounds[k]..bounds[k+1]); halo (ascending)]."""

    lo: int
    hi: int
    edges: torch.Tensor  # (2, E_k) local edge_index: every in-edge of the chunk's nodes
    degree: torch.Tensor  # global in-degree (self-loops excluded) of every local row
    halo_rows: list[tuple[int, torch.Tensor]]  # (piece j, rows of piece j), ascending j: the halo, in order


def _bounds(sizes: list[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def chunk_layout(edge_pos: torch.Tensor | None, num_nodes: int, sizes: list[int], avg_degree: float = 0.0,
                 graphs: bool = False) -> tuple[ChunkLayout, list[ChunkGraph]]:
    """The chunks of `sizes` over node positions (edge_pos: the (2, E) edge_index in positions of the node
    order). Without edges (planning on a meta graph): every chunk reads every other, halos the random-graph
    expectation. `graphs`: also each chunk's local graph (CPU tensors)."""
    bounds = _bounds(sizes)
    C = len(sizes)
    if sum(sizes) != num_nodes or min(sizes) < 1:
        raise PlanError(f"chunk sizes {sizes} must be positive and sum to the graph's {num_nodes} nodes.")
    if edge_pos is None:
        halo = [int((num_nodes - n) * (1 - math.exp(-n * avg_degree / max(num_nodes, 1)))) for n in sizes]
        reads = [[k] + [j for j in range(C) if j != k] for k in range(C)]
        return ChunkLayout(bounds, reads, halo, [int(n * avg_degree) for n in sizes]), []
    src, dst = edge_pos[0].long(), edge_pos[1].long()
    cut = torch.tensor(bounds[1:-1], dtype=torch.long)
    chunk_of = torch.bucketize(dst, cut, right=True)
    degree = in_degree(edge_pos, num_nodes, exclude_self_loops=True) if graphs else None
    reads, halos, edges, out = [], [], [], []
    for k in range(C):
        lo, hi = bounds[k], bounds[k + 1]
        mine = chunk_of == k
        s, d = src[mine], dst[mine]
        outside = (s < lo) | (s >= hi)
        halo = torch.unique(s[outside])  # sorted
        piece = torch.bucketize(halo, cut, right=True)
        used = torch.unique(piece).tolist()
        reads.append([k] + [j for j in used if j != k])
        halos.append(int(halo.numel()))
        edges.append(int(s.numel()))
        if graphs:
            n = hi - lo
            local_src = torch.where(outside, n + torch.searchsorted(halo, s), s - lo)
            assert degree is not None
            rows = [(j, halo[piece == j] - bounds[j]) for j in used]
            out.append(ChunkGraph(lo, hi, torch.stack([local_src, d - lo]),
                                  torch.cat([degree[lo:hi], degree[halo]]), rows))
    return ChunkLayout(bounds, reads, halos, edges), out


# ---- the schedule (shared by the runtime and the cost model's simulation) --------------------------------------


def next_forward(a: int, b: int, C: int, reads: list[list[int]], have: set[tuple[int, int]],
                 done: set[tuple[int, int]]) -> tuple[int, int] | None:
    """The next forward task of a stage owning layers [a, b): deepest ready layer, then lowest chunk. Task (l, k)
    is ready when every piece (l, j), j in reads[k], exists (`have`)."""
    for li in range(b - 1, a - 1, -1):
        for k in range(C):
            if (li, k) not in done and all((li, j) in have for j in reads[k]):
                return li, k
    return None


def next_backward(a: int, b: int, C: int, readers: list[list[int]], last: bool, received: int,
                  done: set[tuple[int, int]]) -> tuple[int, int] | None:
    """The next backward task: shallowest ready layer, then lowest chunk. Task (l, k) is ready when its output
    piece's gradient is complete: every reader (l + 1, r) of piece k done; for l = b - 1 the chunk's loss (last
    stage) or its gradient received from the next stage (`received` pieces so far, in chunk order)."""
    for li in range(a, b):
        for k in range(C):
            if (li, k) in done:
                continue
            if li + 1 < b:
                ready = all((li + 1, r) in done for r in readers[k])
            else:
                ready = last or k < received
            if ready:
                return li, k
    return None


@dataclass
class Simulated:
    """One simulated step of the layer pipeline (seconds from the step's start)."""

    step_s: float  # the last stage-0 backward task's end (optimizer and loss reduction not included)
    forward_end: list[float]  # per stage
    backward_end: list[float]
    busy: list[float]  # per stage: its tasks' seconds
    transfer_s: float  # sum over boundaries of one direction's piece transfer seconds, forward + backward


def simulate(stage_layers: list[tuple[int, int]], layout: ChunkLayout, fwd: list[list[list[float]]],
             bwd: list[list[list[float]]], prefix: tuple[list[float], list[float]],
             xfer: list[list[float]]) -> Simulated:
    """Run `next_forward` / `next_backward` on task times: fwd[s][l - a_s][k], bwd likewise (seconds of task
    (l, k) on stage s's device), prefix = (fwd, bwd) seconds per chunk of stage 0's prefix, xfer[s][k] the
    seconds of moving piece k across boundary s -> s + 1 (the same back for its gradient). A link carries one
    piece at a time."""
    S, C = len(stage_layers), layout.chunks
    reads, readers = layout.reads, layout.readers()
    arrive = [0.0] * C
    fwd_end, busy = [0.0] * S, [0.0] * S
    for s, (a, b) in enumerate(stage_layers):
        t = sum(prefix[0]) if s == 0 else 0.0
        busy[s] += t
        have = {(a, k) for k in range(C)} if s == 0 else set()
        done: set[tuple[int, int]] = set()
        emit, waited = [0.0] * C, 0
        while len(done) < (b - a) * C:
            task = next_forward(a, b, C, reads, have, done)
            if task is None:
                t = max(t, arrive[waited])
                have.add((a, waited))
                waited += 1
                continue
            li, k = task
            t += fwd[s][li - a][k]
            busy[s] += fwd[s][li - a][k]
            done.add(task)
            have.add((li + 1, k))
            if li == b - 1:
                emit[k] = t
        fwd_end[s] = t
        if s + 1 < S:
            link, arrive = 0.0, [0.0] * C
            for k in range(C):
                link = max(link, emit[k]) + xfer[s][k]
                arrive[k] = link
    back_end = [0.0] * S
    grad_arrive = [0.0] * C
    for s in range(S - 1, -1, -1):
        a, b = stage_layers[s]
        last = s == S - 1
        t = fwd_end[s]
        done = set()
        received, sent_upto, emit = 0, 0, [0.0] * C
        while len(done) < (b - a) * C:
            task = next_backward(a, b, C, readers, last, received, done)
            if task is None:
                t = max(t, grad_arrive[received])
                received += 1
                continue
            li, k = task
            t += bwd[s][li - a][k]
            busy[s] += bwd[s][li - a][k]
            done.add(task)
            while sent_upto < C and all((a, r) in done for r in readers[sent_upto]):
                emit[sent_upto] = t
                sent_upto += 1
        if s == 0:
            t += sum(prefix[1])
            busy[s] += sum(prefix[1])
        back_end[s] = t
        if s > 0:
            link, grad_arrive = 0.0, [0.0] * C
            for k in range(C):
                link = max(link, emit[k]) + xfer[s - 1][k]
                grad_arrive[k] = link
    transfer = 2 * sum(sum(x) for x in xfer)
    return Simulated(back_end[0], fwd_end, back_end, busy, transfer)


# ---- the model as a chain of layers and node-wise segments ------------------------------------------------------

_FACTORIES = ("zeros", "ones", "full", "empty", "arange", "rand", "randn", "zeros_like", "ones_like")


class _Tracer(fx.Tracer):
    def __init__(self, leaves: set[int]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return id(m) in self.leaves or super().is_leaf_module(m, qualname)


def _trace(model: nn.Module, leaves: set[int]) -> fx.Graph:
    """torch.fx graph of model.forward with `leaves` as leaf modules; torch's factory functions called with a
    traced size (torch.zeros(x.shape[0], ...)) are recorded rather than failing. Tensor constants the tracer
    attaches to the model are taken off it again."""
    tracer = _Tracer(leaves)
    before = set(vars(model))
    saved = {name: getattr(torch, name) for name in _FACTORIES}

    def wrap(fn: Any) -> Any:
        def inner(*args: Any, **kwargs: Any) -> Any:
            if any(isinstance(a, fx.Proxy) for a in torch.utils._pytree.tree_leaves((args, kwargs))):
                return tracer.create_proxy("call_function", fn, args, kwargs)
            return fn(*args, **kwargs)
        return inner

    try:
        for name, fn in saved.items():
            setattr(torch, name, wrap(fn))
        graph = tracer.trace(model)
    finally:
        for name, fn in saved.items():
            setattr(torch, name, fn)
    graph._autopar_constants = {k: getattr(model, k) for k in set(vars(model)) - before  # type: ignore[attr-defined]
                                if k.startswith("_tensor_constant")}
    for k in graph._autopar_constants:  # type: ignore[attr-defined]
        delattr(model, k)
    return graph


def _fetch(model: nn.Module, target: str, constants: dict) -> Any:
    if target in constants:
        return constants[target]
    obj: Any = model
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class StageGraph:
    """A GNN's forward as a chain of message-passing layers and the node-wise segments between them (module
    docstring). PlanError (naming what to change) when the forward is not such a chain."""

    def __init__(self, model: nn.Module) -> None:
        layers = message_passing_layers(model)
        if not layers:
            raise PlanError(f"{type(model).__name__} has no message-passing layer: nothing to pipeline.")
        self.names = [n for n, _ in layers]
        self.kinds = [layer_kind(m) for _, m in layers]
        by_id = {id(m): n for n, m in layers}
        try:
            graph = _trace(model, set(by_id))
        except Exception as e:  # noqa: BLE001 (any tracing failure is the same PlanError)
            raise PlanError(f"graph mode 'layer_pipeline' runs {type(model).__name__}'s forward layer by layer, so "
                            f"torch.fx must trace it with the message-passing layers as leaves; it failed: "
                            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. Use graph mode "
                            f"'partition' (any forward) or write the forward without data-dependent control "
                            f"flow.") from None
        self.constants: dict = graph._autopar_constants  # type: ignore[attr-defined]
        nodes = list(graph.nodes)
        placeholders = [n for n in nodes if n.op == "placeholder"]
        if len(placeholders) != 2:
            raise PlanError(f"graph mode 'layer_pipeline' needs forward(x, edge_index); "
                            f"{type(model).__name__}.forward takes {len(placeholders)} inputs.")
        self.x, self.edge_index = placeholders
        calls = [n for n in nodes if n.op == "call_module" and n.target in self.names]
        order = [n.target for n in calls]
        if order != self.names:
            raise PlanError(f"graph mode 'layer_pipeline' needs every message-passing layer called once per forward, "
                            f"in the order the model registers them ({self.names}); the forward calls {order}.")
        self.calls = calls
        self.inputs = [self._x_arg(c, k) for c, k in zip(calls, self.kinds, strict=True)]
        out = next(n for n in nodes if n.op == "output")
        if not isinstance(out.args[0], fx.Node):
            raise PlanError("graph mode 'layer_pipeline' needs a forward returning one tensor of per-node outputs.")
        self.output = out.args[0]
        sources = self._sources(nodes)
        L = len(calls)
        self.seg_in = [self.x] + calls  # segment j reads seg_in[j] ...
        self.seg_out = self.inputs + [self.output]  # ... and produces seg_out[j]
        for j in range(L + 1):
            src, dst = self.seg_in[j], self.seg_out[j]
            if sources[dst] - {src}:
                what = ("the model's output" if j == L else f"the input of layer {j} ({self.names[j]})")
                got = sorted(n.name for n in sources[dst] - {src})
                before = "the features x" if j == 0 else f"layer {j - 1}'s output"
                raise PlanError(f"graph mode 'layer_pipeline' needs a chain of layers: {what} must depend only on "
                                f"{before}, but it reads {got} (a skip connection across layers, or a graph "
                                f"computation outside the message-passing layers). Use graph mode 'partition'.")
        self.segments = [self._between(self.seg_in[j], self.seg_out[j], nodes) for j in range(L + 1)]

    def _x_arg(self, call: fx.Node, kind: str) -> fx.Node:
        want = 4 if kind == "graphconv" else 2
        x = call.args[0] if call.args else call.kwargs.get("x")
        extra = set(call.kwargs) - {"x", "edge_index"}
        if len(call.args) + len(call.kwargs) != want or extra or not isinstance(x, fx.Node):
            raise PlanError(f"graph mode 'layer_pipeline' runs message-passing layers called as layer(x, edge_index) "
                            f"(GraphConv: layer(x, src, dst, inv_degree)); {call.target} is called with "
                            f"{len(call.args)} arguments and keywords {sorted(call.kwargs)}.")
        return x

    def _sources(self, nodes: list[fx.Node]) -> dict[fx.Node, set[fx.Node]]:
        """Per node, the placeholders and layer calls its value derives from (a call's own: itself)."""
        calls = set(self.calls)
        out: dict[fx.Node, set[fx.Node]] = {}
        for n in nodes:
            if n.op == "placeholder" or n in calls:
                out[n] = {n}
            else:
                out[n] = set().union(*(out[i] for i in n.all_input_nodes)) if n.all_input_nodes else set()
        return out

    @staticmethod
    def _between(src: fx.Node, dst: fx.Node, nodes: list[fx.Node]) -> list[fx.Node]:
        """The nodes computing dst from src (and constants), in graph order."""
        need: set[fx.Node] = set()
        stack = [dst]
        while stack:
            n = stack.pop()
            if n is src or n in need:
                continue
            need.add(n)
            stack.extend(n.all_input_nodes)
        return [n for n in nodes if n in need]

    @property
    def layers(self) -> int:
        return len(self.calls)

    def run_segment(self, j: int, value: torch.Tensor, model: nn.Module) -> torch.Tensor:
        """Segment j (0: the prefix on x; l + 1: after layer l, the last one ending in the output) on `value`."""
        env: dict[fx.Node, Any] = {self.seg_in[j]: value}
        for n in self.segments[j]:
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            if n.op == "call_module":
                env[n] = model.get_submodule(n.target)(*args, **kwargs)
            elif n.op == "call_function":
                env[n] = n.target(*args, **kwargs)
            elif n.op == "call_method":
                env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
            elif n.op == "get_attr":
                env[n] = _fetch(model, n.target, self.constants)
            else:
                raise PlanError(f"graph mode 'layer_pipeline' cannot run node {n.name} ({n.op}).")
        return env[self.seg_out[j]]

    def run_layer(self, li: int, model: nn.Module, x_own: torch.Tensor, ctx: LocalGraph) -> torch.Tensor:
        """Layer l on chunk rows `x_own`, its halo and edges from `ctx` (layers.local_layers' adapters)."""
        module = model.get_submodule(self.names[li])
        rest = (None, None, None) if self.kinds[li] == "graphconv" else (None,)
        with local_layers(model, ctx):
            out = module(x_own, *rest)
        return out[0] if isinstance(out, tuple) else out

    def unit_modules(self) -> list[list[str]]:
        """Per unit (0: the prefix; l + 1: layer l and the segment after it), the modules and attributes it runs."""
        units: list[list[str]] = []
        for j, seg in enumerate(self.segments):
            names = [] if j == 0 else [self.names[j - 1]]
            names += [str(n.target) for n in seg if n.op in ("call_module", "get_attr")]
            units.append(names)
        return units

    def owners(self, model: nn.Module, stage_layers: list[tuple[int, int]]) -> dict[str, int]:
        """Parameter and buffer name -> the stage holding it. Unused ones go to stage 0; one used by two stages
        (a weight tied across layers of different stages) is a PlanError."""
        stage_of_unit = [0] + [next(s for s, (a, b) in enumerate(stage_layers) if a <= li < b)
                               for li in range(self.layers)]
        by_tensor: dict[int, int] = {}
        named = dict(model.named_parameters(remove_duplicate=False))
        named.update(dict(model.named_buffers(remove_duplicate=False)))
        for u, names in enumerate(self.unit_modules()):
            for target in names:
                if target in self.constants:
                    continue
                obj = _fetch(model, target, self.constants)
                tensors = [obj] if isinstance(obj, torch.Tensor) else (
                    list(obj.parameters()) + list(obj.buffers()) if isinstance(obj, nn.Module) else [])
                for t in tensors:
                    s = stage_of_unit[u]
                    if by_tensor.setdefault(id(t), s) != s:
                        name = next(k for k, v in named.items() if v is t)
                        raise PlanError(f"{name} is used by stages {by_tensor[id(t)]} and {s} of the layer pipeline "
                                        f"(a weight shared across layers): give those layers one stage with "
                                        f"graph_options['stages'], or use graph mode 'partition'.")
        return {k: by_tensor.get(id(v), 0) for k, v in named.items()}


def unit_params(model: nn.Module, sg: StageGraph) -> list[int]:
    """Trainable parameters per unit (0: the prefix; l + 1: layer l and the segment after it); parameters no unit
    uses count with the prefix (stage 0 holds them)."""
    counts = [0] * (sg.layers + 1)
    seen: set[int] = set()
    for u, names in enumerate(sg.unit_modules()):
        for target in names:
            if target in sg.constants:
                continue
            obj = _fetch(model, target, sg.constants)
            params = [obj] if isinstance(obj, nn.Parameter) else (
                list(obj.parameters()) if isinstance(obj, nn.Module) else [])
            for p in params:
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    counts[u] += p.numel()
    counts[0] += sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in seen)
    return counts


# ---- what a task keeps and needs while it runs, measured on small graphs ----------------------------------------


@dataclass
class TaskBytes:
    """A unit's task memory, each figure linear in (1, rows read (own + halo), rows kept, in-edges):
    `kept`: what the task leaves alive for its backward (autograd's saved tensors and its output);
    `forward`: the most bytes alive beyond that while it runs; `backward`: the most bytes alive during its
    backward beyond what was alive when it started (the gradients of its input rows included)."""

    kept_c: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    forward_c: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    backward_c: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)

    @staticmethod
    def _at(c: tuple[float, float, float, float], rows_in: float, rows_out: float, edges: float) -> float:
        return max(c[0] + c[1] * rows_in + c[2] * rows_out + c[3] * edges, 0.0)

    def kept(self, rows_in: float, rows_out: float, edges: float) -> float:
        return self._at(self.kept_c, rows_in, rows_out, edges)

    def forward(self, rows_in: float, rows_out: float, edges: float) -> float:
        return self._at(self.forward_c, rows_in, rows_out, edges)

    def backward(self, rows_in: float, rows_out: float, edges: float) -> float:
        return self._at(self.backward_c, rows_in, rows_out, edges)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages the ops run inside it create that are still alive (a weak reference per storage:
    `StorageWeakRef`, so what autograd keeps counts until it is released), and their peak; checked at every
    op, so a temporary counts from the op creating it to the first op after its release."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live = 0
        self.peak = 0

    def sweep(self) -> int:
        for key in [k for k, (r, _) in self.refs.items() if r.expired()]:
            self.live -= self.refs.pop(key)[1]
        return self.live

    def reset_peak(self) -> None:
        self.peak = self.sweep()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.sweep()
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_meta:
                st = t.untyped_storage()
                ref = StorageWeakRef(st)
                if ref.cdata not in self.refs:
                    self.refs[ref.cdata] = (ref, st.nbytes())
                    self.live += st.nbytes()
        self.peak = max(self.peak, self.live)
        return out


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def task_bytes_probe(model: nn.Module, sg: StageGraph, precision: str = "fp32",
                     features: torch.dtype = torch.float32) -> list[TaskBytes]:
    """Measure each unit's `TaskBytes` (0: the prefix; l + 1: layer l and its segment) on a CPU copy of the model,
    each run as the layer pipeline runs it (own rows, a halo joined by `extend`, local edges) on small random
    graphs: kept = autograd's saved tensors (`torch.autograd.graph.saved_tensors_hooks`; unique storages,
    parameters, the inputs and the joined input excluded: the runtime holds those apart) plus the output; the
    transients from `LiveBytes`; each fitted linear in rows read, rows kept and in-edges. Units of one
    signature (layer type, widths, segment, input dtype) are measured once. Each unit reads what the one before
    returns (under autocast a layer's output is low precision; the prefix reads the `features` dtype)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread (several only contend on a busy host)
    try:
        probe = _cpu_copy(model)
        found: dict[str, tuple[TaskBytes, torch.dtype]] = {}
        out = []
        dtype = features
        for u in range(sg.layers + 1):
            key = _signature(probe, sg, u, precision) + str(dtype)
            if key not in found:
                found[key] = _probe(probe, sg, u, precision, dtype)
            out.append(found[key][0])
            dtype = found[key][1]
        return out
    finally:
        torch.set_num_threads(threads)


def _signature(model: nn.Module, sg: StageGraph, unit: int, precision: str) -> str:
    parts: list[Any] = [precision, unit == 0, unit == sg.layers]
    if unit:
        m = model.get_submodule(sg.names[unit - 1])
        parts += [type(m).__name__, sg.kinds[unit - 1], _lin_shapes(m), repr(m)]
    for n in sg.segments[unit]:
        if n.op == "call_module":
            sub = model.get_submodule(n.target)
            parts.append((type(sub).__name__, repr(sub), [tuple(p.shape) for p in sub.parameters()]))
        else:
            parts.append((n.op, str(n.target), repr(n.args[1:]), repr(sorted(n.kwargs.items()))))
    return repr(parts)


def _probe(probe: nn.Module, sg: StageGraph, unit: int, precision: str, in_dtype: torch.dtype
           ) -> tuple[TaskBytes, torch.dtype]:
    """One unit's `TaskBytes` on `probe` (a CPU copy of the model) reading `in_dtype` rows, and its output
    dtype."""
    params = {_storage_key(t) for t in list(probe.parameters()) + list(probe.buffers())}
    d_in = _width_in(probe, sg, unit)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)  # what autocast computes in
    samples = [(64, 64, 256), (64, 128, 256), (64, 64, 512), (128, 128, 256), (128, 192, 768), (96, 96, 640)]
    rows, kept, fwd, bwd = [], [], [], []
    g = torch.Generator().manual_seed(0)
    for n, r, e in samples:
        if unit == 0:
            r, e = n, 0
        x = torch.randn(n, d_in, generator=g).to(in_dtype).requires_grad_(unit > 0)
        halo = torch.randn(r - n, d_in, generator=g).to(in_dtype).requires_grad_(unit > 0)
        edges = torch.stack([torch.randint(0, r, (e,), generator=g), torch.randint(0, n, (e,), generator=g)])
        degree = torch.bincount(edges[1], minlength=r).clamp(min=1)
        saved: dict[tuple[int, int], int] = {}
        joined: list[torch.Tensor] = []

        def pack(t: torch.Tensor, saved: dict = saved) -> torch.Tensor:
            saved[_storage_key(t)] = _storage_key(t)[1]
            return t

        def extend(h: torch.Tensor, halo: torch.Tensor = halo, joined: list = joined) -> torch.Tensor:
            if not halo.shape[0]:
                return h
            joined.append(torch.cat([h, halo.to(h.dtype)]))
            return joined[-1]

        ctx = LocalGraph([edges], [n], [n], degree, extend)
        live = LiveBytes()
        with live, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                (torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()):
            out = sg.run_segment(0, x, probe) if unit == 0 else \
                sg.run_segment(unit, sg.run_layer(unit - 1, probe, x, ctx), probe)
        saved.setdefault(_storage_key(out), _storage_key(out)[1])
        for t in [x, halo, edges, degree, *joined]:
            saved.pop(_storage_key(t), None)
        kept.append(float(sum(v for k, v in saved.items() if k not in params)))
        after = live.sweep()
        fwd.append(max(live.peak - after, 0.0))
        backward_extra = 0.0
        if out.requires_grad:
            grad = torch.randn(out.shape, generator=g).to(out.dtype)
            with live:
                start = live.sweep()
                live.reset_peak()
                torch.autograd.backward(out, grad)
            backward_extra = max(live.peak - start, 0.0)
        rows.append([1.0, float(r), float(n), float(e)])
        bwd.append(backward_extra)
    a = torch.tensor(rows, dtype=torch.float64)

    def fit(values: list[float]) -> tuple[float, float, float, float]:
        c = torch.linalg.lstsq(a, torch.tensor(values, dtype=torch.float64)[:, None]).solution.flatten().tolist()
        return (c[0], c[1], c[2], c[3])

    return TaskBytes(fit(kept), fit(fwd), fit(bwd)), out.dtype


def _cpu_copy(model: nn.Module) -> nn.Module:
    """A CPU copy of `model` with defined values (a meta model gets random ones)."""
    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        probe = copy.deepcopy(model).to_empty(device="cpu")
        with torch.no_grad():
            for p in probe.parameters():
                p.normal_(0, 0.1)
        return probe
    return copy.deepcopy(model).cpu()


def _lin_shapes(m: nn.Module) -> list[tuple[int, int]]:
    out = []
    for sub in m.modules():
        w = getattr(sub, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and (isinstance(sub, nn.Linear)
                                                             or type(sub).__name__ == "Linear"):
            out.append((int(w.shape[1]), int(w.shape[0])))
    return out


def _width_in(model: nn.Module, sg: StageGraph, unit: int) -> int:
    """The input width of a unit: the first linear's input of layer unit - 1 (unit 0: of the first module the
    prefix runs, else of layer 0)."""
    if unit > 0:
        lin = _lin_shapes(model.get_submodule(sg.names[unit - 1]))
        return lin[0][0] if lin else 1
    for target in sg.unit_modules()[0]:
        obj = _fetch(model, target, sg.constants)
        if isinstance(obj, nn.Module) and _lin_shapes(obj):
            return _lin_shapes(obj)[0][0]
    lin = _lin_shapes(model.get_submodule(sg.names[0]))
    return lin[0][0] if lin else 1


def check_stage_layers(stage_layers: list[tuple[int, int]], layers: int, world: int) -> None:
    """PlanError unless `stage_layers` tiles [0, layers) with one non-empty range per rank, in order."""
    ok = len(stage_layers) == world and stage_layers[0][0] == 0 and stage_layers[-1][1] == layers and all(
        a < b for a, b in stage_layers) and all(stage_layers[i][1] == stage_layers[i + 1][0]
                                                 for i in range(len(stage_layers) - 1))
    if not ok:
        raise PlanError(f"the layer pipeline's stages {[list(s) for s in stage_layers]} must split the model's "
                        f"{layers} message-passing layers into {world} consecutive non-empty ranges, one per rank.")



__all__ = ["ChunkGraph", "ChunkLayout", "LiveBytes", "Simulated", "StageGraph", "TaskBytes",
           "check_stage_layers", "chunk_layout", "even_chunks", "task_bytes_probe", "next_backward", "next_forward",
           "simulate", "unit_params"]
