"""Gradient all-reduce overlapped with backward, as torch DDP does, for plain data-parallel layouts.

When every parameter a rank holds is held by the same replica group (no tensor parallelism, no ZeRO
partitioning or parameter/optimizer offload, one stage per rank, and all parameters of a stage shared
by the same replicas), gradients need no per-parameter routing: they are packed into buckets in reverse
order of first use (about the order backward produces them; the first bucket small, 1 MiB, then 25 MiB,
DDP's defaults), and each bucket's all-reduce is launched asynchronously from the post-accumulate-grad
hooks of the step's last backward as soon as the bucket is complete (under a zero-bubble schedule the
last W: the B's compute input gradients only, the W's accumulate the parameters', split_backward.py).
Buckets are launched strictly in bucket order (a ready bucket waits for its predecessors), so every rank
issues the same collectives in the same order whatever order its autograd runs in. As DDP's
`gradient_as_bucket_view`, each `.grad` is a view of its slice of the bucket (`prepare()`, at the start of
a step, zeroes the buckets and points the gradients at them), so autograd accumulates straight into the
buckets and the gradients take N g bytes, not twice that. `finish()` launches what is left, waits, and
leaves each `.grad` on the reduced slice.

Gradients travel in their own dtype: summing fp32 gradients of the replicas in fp32 is what DDP does and
stays within the runtime tests' rtol 1e-4. When the replica group is the whole world and every rank
computes a share of the loss, the loss share rides in the last bucket, saving the step's separate
loss all-reduce.

Every other layout keeps `zero.ZeroRuntime.sync_gradients` (per parameter, after the schedule).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..ir.graph import TrainingGraph
from ..ir.lowered import Layout
from ..lowering import params_by_layer
from .dist import on_comm_device, wait

FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


def plain_data_parallel(graph: TrainingGraph, layout: Layout, holders: dict[str, tuple[tuple[int, ...], ...]]
                        ) -> bool:
    """Whether the bucketed, overlapped route applies to this layout (the same answer on every rank)."""
    by_layer = params_by_layer(graph)
    for p in layout.pipelines:
        if p.chunks != 1:
            return False
        for st in p.stages:
            if st.zero or len(st.ranks) != 1 or {"params", "optimizer"} & set(st.offload):
                return False
            names = {n for layer in range(*st.layers) for n in by_layer.get(layer, ())}
            if len({holders[n] for n in names}) > 1:
                return False
    return True


def first_use_order(graph: TrainingGraph, names: set[str]) -> list[str]:
    """Canonical parameter names in the order the forward first reads them."""
    order: list[str] = []
    for n in graph.nodes.values():
        for a in n.args:
            info = graph.params.get(a)
            if info is None or info.is_buffer:
                continue
            canon = graph.canonical(a)
            if canon in names and canon not in order:
                order.append(canon)
    return order + sorted(names - set(order))


class BucketedGradSync:
    """Overlapped gradient all-reduce of one rank's parameters over its replica group (see module doc)."""

    def __init__(self, params: dict[str, nn.Parameter], order: list[str], group: Any, timeout_s: float,
                 carry_loss: bool, comm: torch.device | None = None) -> None:
        """`comm`: the replica group's comm device (devices.CommDevices; None: the parameters' own)."""
        self.params, self.group, self.timeout_s = params, group, timeout_s
        self.comm = comm
        self.carry_loss = carry_loss and bool(order) and params[order[0]].dtype in (torch.float32, torch.float64)
        self.buckets: list[list[str]] = []
        cap, size, dtype = FIRST_BUCKET_BYTES, 0, None
        for name in reversed(order):
            p = params[name]
            nbytes = p.numel() * p.element_size()
            if not self.buckets or (size and size + nbytes > cap) or p.dtype != dtype:
                if self.buckets:
                    cap = BUCKET_BYTES
                self.buckets.append([])
                size, dtype = 0, p.dtype
            self.buckets[-1].append(name)
            size += nbytes
        self.bucket_of = {n: b for b, names in enumerate(self.buckets) for n in names}
        self.offsets: dict[str, int] = {}
        self.flats: list[torch.Tensor] = []
        for b, names in enumerate(self.buckets):
            off = 0
            for n in names:
                self.offsets[n] = off
                off += params[n].numel()
            extra = 1 if self.carry_loss and b == len(self.buckets) - 1 else 0
            self.flats.append(torch.zeros(off + extra, dtype=params[names[0]].dtype,
                                          device=params[names[0]].device))
        self.final = False  # set around the step's last backward of this rank (its last W under zero-bubble)
        self.loss: torch.Tensor | float = 0.0  # the rank's loss share (a device tensor), rides in the last bucket
        self._reset()
        for name, p in params.items():
            p.register_post_accumulate_grad_hook(lambda p, name=name: self._on_grad(name, p))

    def _reset(self) -> None:
        self.missing = [len(names) for names in self.buckets]
        self.done: set[str] = set()
        self.works: list[Any] = []

    def prepare(self) -> None:
        """Start of a step: zeroed buckets, every gradient a view of its slice (autograd accumulates there)."""
        for b, names in enumerate(self.buckets):
            self.flats[b].zero_()
            for n in names:
                self.params[n].grad = self._view(n)

    def _view(self, name: str) -> torch.Tensor:
        p = self.params[name]
        off = self.offsets[name]
        return self.flats[self.bucket_of[name]][off:off + p.numel()].view_as(p)

    def _on_grad(self, name: str, p: nn.Parameter) -> None:
        if not self.final or name in self.done:
            return
        self.done.add(name)
        b = self.bucket_of[name]
        off = self.offsets[name]
        if p.grad is not None and p.grad.data_ptr() != self._view(name).data_ptr():
            self.flats[b][off:off + p.numel()].copy_(p.grad.reshape(-1))  # autograd replaced the view
        self.missing[b] -= 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while len(self.works) < len(self.buckets) and (force or self.missing[len(self.works)] == 0):
            b = len(self.works)
            flat = self.flats[b]
            for n in self.buckets[b]:
                if n not in self.done:  # no gradient in the last backward: whatever accumulated, else zeros
                    p = self.params[n]
                    part = flat[self.offsets[n]:self.offsets[n] + p.numel()]
                    if p.grad is None:
                        part.zero_()
                    elif p.grad.data_ptr() != part.data_ptr():
                        part.copy_(p.grad.reshape(-1))
            if self.carry_loss and b == len(self.buckets) - 1:
                flat[-1] = self.loss
            self.works.append(on_comm_device(dist.all_reduce, self.comm or flat.device, flat, group=self.group,
                                             async_op=True))

    def finish(self) -> torch.Tensor | None:
        """Wait for every bucket and hand the reduced gradients to the parameters; returns the summed loss
        (a float64 device tensor: no host read) when it rode in the last bucket."""
        self._launch_ready(force=True)
        for work in self.works:
            wait(work, "bucketed gradient all-reduce", "in its group", self.timeout_s, self.group, self.flats[0].device)
        for names in self.buckets:
            for n in names:
                self.params[n].grad = self._view(n)
        loss = self.flats[-1][-1].to(torch.float64, copy=True) if self.carry_loss and self.buckets else None
        self.final = False
        self._reset()
        return loss
