"""The runtime of graph mode "layer_pipeline": one rank's stage (`LayerPipeline`, driven by
program.GraphProgram). The design, its schedule and its memory: layer_pipeline.py's docstring."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import PlanError
from .data import locality_order
from .layer_pipeline import (
    ChunkGraph,
    StageGraph,
    check_stage_layers,
    chunk_layout,
    next_backward,
    next_forward,
)
from .layers import LocalGraph

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@dataclass
class _Forward:
    """One forward's state on a rank (kept for its backward)."""

    pieces: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (l, k) -> input piece (a leaf)
    outs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (l, k) -> task output (graph)
    prefix: dict[int, torch.Tensor] = field(default_factory=dict)  # stage 0: prefix output per chunk (graph)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)  # last stage: chunk k's weighted loss
    value: float = 0.0  # last stage: the loss
    sent: list[tuple[list[Any], torch.Tensor, int]] = field(default_factory=list)  # (works, tensor, peer)


class LayerPipeline:
    """Rank `rank`'s stage of a layer_pipeline plan (GraphProgram drives it; module docstring)."""

    def __init__(self, model: nn.Module, plan: Any, rank: int, world: int, timeout_s: float) -> None:
        from ..runtime.devices import CommDevices

        g = plan.graph
        self.model, self.rank, self.world, self.timeout_s = model, rank, world, timeout_s
        self.sg = StageGraph(model)
        self.stage_layers = [tuple(int(v) for v in s) for s in g["stage_layers"]]
        check_stage_layers(self.stage_layers, self.sg.layers, world)
        self.a, self.b = self.stage_layers[rank]
        self.last = rank == world - 1
        self.sizes = [int(c) for c in g["chunk_sizes"]]
        self.C = len(self.sizes)
        owners = self.sg.owners(model, self.stage_layers)
        self.owned = {k for k, s in owners.items() if s == rank}
        _drop_others(model, self.owned)
        device = next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
        self.comm = CommDevices.of_plan(plan, device)
        self._spec: tuple[int, torch.dtype] | None = None  # the width and dtype of the pieces received
        self._header_sent = False
        self._key: tuple | None = None
        self._label_key: tuple | None = None

    # ---- the graph, once per graph ----
    def prepare(self, x: torch.Tensor, edge_index: torch.Tensor, target: torch.Tensor | None) -> None:
        """The chunks' local graphs (once per graph) and, on the last stage, each chunk's labels."""
        n = x.shape[0]
        if sum(self.sizes) != n:
            raise PlanError(f"the plan cuts {sum(self.sizes)} nodes into chunks but the graph has {n}: plan again.")
        key = (edge_index.data_ptr(), tuple(edge_index.shape), n, x.device)
        if key != self._key:
            cpu = edge_index.cpu()
            order = locality_order(cpu, n)
            position = torch.empty(n, dtype=torch.long)
            position[order] = torch.arange(n)
            self.layout, graphs = chunk_layout(position[cpu], n, self.sizes, graphs=True)
            dev = x.device
            self.order = order.to(dev)
            self.graphs = [ChunkGraph(c.lo, c.hi, c.edges.to(dev), c.degree.to(dev),
                                      [(j, r.to(dev)) for j, r in c.halo_rows]) for c in graphs]
            self._key, self._label_key = key, None
        if target is None or not self.last:
            return
        label_key = (target.data_ptr(), tuple(target.shape))
        if label_key == self._label_key:
            return
        from .sampling import labelled_nodes

        y = target[self.order.to(target.device)]
        self.labels = [y[c.lo:c.hi] for c in self.graphs]
        is_lab = torch.zeros(n, dtype=torch.bool)
        is_lab[labelled_nodes(target.cpu())] = True
        lab = is_lab[self.order.cpu()]
        self.counts = [int(lab[c.lo:c.hi].sum()) for c in self.graphs]
        self.total = max(sum(self.counts), 1)
        self._label_key = label_key

    # ---- transfers ----
    def _post(self, is_send: bool, t: torch.Tensor, peer: int) -> list[Any]:
        from ..runtime.dist import batch_p2p

        per_op, _ = batch_p2p([(is_send, t, peer)], [self.comm.of([self.rank, peer])])
        return per_op[0]

    def _wait(self, works: list[Any], what: str, peer: int, device: torch.device) -> None:
        from ..runtime.dist import wait

        for w in works:
            wait(w, what, peer, self.timeout_s, device=device)

    # ---- one forward ----
    def _task(self, li: int, k: int, pieces: dict, policy: Any) -> torch.Tensor:
        c = self.graphs[k]
        halo = [pieces[(li, j)].index_select(0, rows) for j, rows in c.halo_rows]
        extend = (lambda h: torch.cat([h, *[t.to(h.dtype) for t in halo]])) if halo else (lambda h: h)
        ctx = LocalGraph([c.edges], [c.hi - c.lo], [c.hi - c.lo], c.degree, extend)
        with policy.forward():
            out = self.sg.run_segment(li + 1, self.sg.run_layer(li, self.model, pieces[(li, k)], ctx), self.model)
        if not isinstance(out, torch.Tensor) or out.shape[0] != c.hi - c.lo:
            where = "the model's output" if li + 1 == self.sg.layers else f"the input of layer {li + 1}"
            raise PlanError(f"{where} has {getattr(out, 'shape', type(out))} rows for a chunk of {c.hi - c.lo} "
                            f"nodes: the code between message-passing layers must be node-wise (one row per node).")
        return out

    def forward(self, x: torch.Tensor, policy: Any, loss_fn: Any, train: bool) -> _Forward:
        """This stage's forward over every chunk (module docstring's schedule)."""
        a, b, C = self.a, self.b, self.C
        f = _Forward()
        have: set[tuple[int, int]] = set()
        recvs: list[tuple[list[Any], torch.Tensor]] = []
        if self.rank == 0:
            for k, c in enumerate(self.graphs):
                xk = x.index_select(0, self.order[c.lo:c.hi])
                with policy.forward():
                    o = self.sg.run_segment(0, xk, self.model)
                if o.shape[0] != c.hi - c.lo:
                    raise PlanError("the code before the first message-passing layer must be node-wise.")
                if train and o.requires_grad:
                    f.prefix[k] = o
                    f.pieces[(a, k)] = o.detach().requires_grad_()
                else:
                    f.pieces[(a, k)] = o.detach()
                have.add((a, k))
        done: set[tuple[int, int]] = set()
        waited = 0
        while len(done) < (b - a) * C:
            task = next_forward(a, b, C, self.layout.reads, have, done)
            if task is None:  # wait for the next piece from the previous stage
                if not recvs:
                    recvs = self._post_piece_receives(x.device)
                works, buf = recvs[waited]
                self._wait(works, f"layer pipeline: chunk {waited} of layer {a}'s input from stage {self.rank - 1}",
                           self.rank - 1, buf.device)
                f.pieces[(a, waited)] = buf.requires_grad_(train)
                have.add((a, waited))
                waited += 1
                continue
            li, k = task
            out = self._task(li, k, f.pieces, policy)
            done.add(task)
            have.add((li + 1, k))
            if li + 1 < b:
                f.pieces[(li + 1, k)] = out.detach().requires_grad_(train and out.requires_grad)
            elif not self.last:
                self._send_piece(f, k, out)
            if train and (li + 1 < b or not self.last):
                f.outs[(li, k)] = out
            if li + 1 == b and self.last:
                if train:
                    f.outs[(li, k)] = out
                    if self.counts[k]:
                        with policy.forward():
                            loss = loss_fn(out, self.labels[k]).float() * (self.counts[k] / self.total)
                        f.losses[k] = loss
                        f.value += float(loss.detach())
                else:
                    f.outs[(li, k)] = out.detach()
        return f

    def _post_piece_receives(self, device: torch.device) -> list[tuple[list[Any], torch.Tensor]]:
        """The header (first forward) then every piece's receive, posted at once."""
        prev = self.rank - 1
        if self._spec is None:
            header = torch.zeros(2, dtype=torch.long, device=device)
            self._wait(self._post(False, header, prev), f"layer pipeline: header from stage {prev}", prev, device)
            width, code = (int(v) for v in header.tolist())
            self._spec = (width, DTYPES[code])
        width, dtype = self._spec
        out = []
        for n in self.sizes:
            buf = torch.empty((n, width), dtype=dtype, device=device)
            out.append((self._post(False, buf, prev), buf))
        return out

    def _send_piece(self, f: _Forward, k: int, out: torch.Tensor) -> None:
        nxt = self.rank + 1
        t = out.detach()
        if t.dim() != 2 or t.dtype not in DTYPES:
            raise PlanError(f"the input of layer {self.b} is {tuple(t.shape)} {t.dtype}: a layer pipeline boundary "
                            f"carries one (nodes, width) floating tensor.")
        t = t.contiguous()
        if not self._header_sent:
            header = torch.tensor([t.shape[1], DTYPES.index(t.dtype)], dtype=torch.long, device=t.device)
            f.sent.append((self._post(True, header, nxt), header, nxt))
            self._header_sent = True
        f.sent.append((self._post(True, t, nxt), t, nxt))

    # ---- its backward ----
    def backward(self, f: _Forward, policy: Any) -> None:
        a, b, C = self.a, self.b, self.C
        readers = self.layout.readers()
        grads: list[tuple[list[Any], torch.Tensor | None]] = []
        if not self.last:
            for k in range(C):
                buf = torch.empty_like(f.outs[(b - 1, k)])
                grads.append((self._post(False, buf, self.rank + 1), buf))
        done: set[tuple[int, int]] = set()
        received, sent_upto = 0, 0
        while len(done) < (b - a) * C:
            task = next_backward(a, b, C, readers, self.last, received, done)
            if task is None:
                works, buf = grads[received]
                assert buf is not None
                self._wait(works, f"layer pipeline: gradient of chunk {received} from stage {self.rank + 1}",
                           self.rank + 1, buf.device)
                received += 1
                continue
            li, k = task
            out = f.outs.pop((li, k))
            if li + 1 < b:
                g = f.pieces.pop((li + 1, k)).grad
                if g is not None and out.requires_grad:
                    torch.autograd.backward(out, g)
            elif self.last:
                if k in f.losses:
                    policy.scale(f.losses.pop(k)).backward()
            else:
                g = grads[k][1]
                grads[k] = ([], None)  # the received gradient is used up: freed after this backward
                if out.requires_grad:
                    torch.autograd.backward(out, g)
                del g
            del out
            done.add(task)
            while sent_upto < C and all((a, r) in done for r in readers[sent_upto]):
                self._piece_done(f, sent_upto)
                sent_upto += 1
        self.finish(f)

    def finish(self, f: _Forward) -> None:
        """Wait for the step's sends (forward chunks, gradients back) once the stage has nothing left to do; a
        forward without backward (eval) calls it itself."""
        for works, t, peer in f.sent:
            self._wait(works, f"layer pipeline: a send of stage {self.rank} to stage {peer}", peer, t.device)
        f.sent.clear()

    def _piece_done(self, f: _Forward, k: int) -> None:
        """Every reader of input piece k has run its backward: its gradient is complete."""
        piece = f.pieces.pop((self.a, k))
        if self.rank > 0:
            g = piece.grad if piece.grad is not None else torch.zeros_like(piece)
            g = g.contiguous()
            f.sent.append((self._post(True, g, self.rank - 1), g, self.rank - 1))
        elif k in f.prefix and piece.grad is not None:
            torch.autograd.backward(f.prefix.pop(k), piece.grad)

    def output(self, f: _Forward) -> torch.Tensor | None:
        """The last stage: the model's output for every node, in node order."""
        if not self.last:
            return None
        rows = torch.cat([f.outs[(self.b - 1, k)] for k in range(self.C)])
        full = rows.new_empty(rows.shape)
        full[self.order] = rows
        return full


def _drop_others(model: nn.Module, owned: set[str]) -> None:
    """Replace every parameter and buffer not in `owned` by a meta tensor of its shape (no storage)."""
    for prefix, m in model.named_modules():
        for name, p in list(m._parameters.items()):
            full = f"{prefix}.{name}" if prefix else name
            if p is not None and full not in owned and not p.is_meta:
                m._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                   requires_grad=p.requires_grad)
        for name, t in list(m._buffers.items()):
            full = f"{prefix}.{name}" if prefix else name
            if t is not None and full not in owned and not t.is_meta:
                m._buffers[name] = torch.empty(t.shape, dtype=t.dtype, device="meta")


__all__ = ["DTYPES", "LayerPipeline"]
