"""ZeRO-2/3 and parameter offload at layer granularity: what the planner prices (solver/pricing.py).

Per micro-batch, on a stage run layer by layer (layered.py), for layer l:

    forward   bring l in: ZeRO-3 parameters gathered (broadcast from their owners into the parameter's
              own storage), streamed (offloaded) parameters copied from their host values; run l; drop l:
              free the ZeRO-3 parameters this rank does not own and the streamed ones
    backward  bring l in again before its backward (and recomputation); once every hooked parameter of l
              has its gradient accumulated: ZeRO-2/3 reduce l's gradients to their owners (`dist.reduce`;
              the owner accumulates the sum over micro-batches, non-owners drop theirs), streamed
              parameters move their gradient to the host (accumulated there); then drop l

So a device holds its own shard (N w / D, N g / D), no streamed state, plus the layer in use, as priced.
After the schedule zero.py reduces what is left (ZeRO-0/1 all-reduce, streamed gradients a bucket at a
time through the device) and steps the optimizer (streamed parameters have it on the host: they are
offloaded together with the optimizer).

Collective order. Layer collectives run inside the pipeline schedule, so they are used only where every
holder of a parameter executes the same sequence of them: `layerwise_params` takes a parameter layer-wise
when all pipelines holding it hold it in the same stage (same index and layer range, tensor-parallel
degree 1), with the same micro-batch count, schedule and chunks, and it is read by one layer only (not a
tied embedding) and not offloaded. Its holders then run identical action sequences, the hooks fire in
the same order on each (autograd's order is a function of the graph), reductions are issued strictly in
descending layer order, and the gather/free decisions are taken from state all holders share (which
layers are resident), never from ownership. Streaming needs no collective: `streamed_params` takes every
offloaded parameter read by one layer, at ZeRO level <= 2. Every other parameter keeps the whole-step path
of zero.py (gathered or brought back at the start of the step, reduced after the schedule), and the
planner prices that path for it (`solver.pricing_plan.layerwise_zero`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..graph import TrainingGraph
from .layout import Layout
from .zero import params_by_layer

if TYPE_CHECKING:
    from .zero import ZeroRuntime


def _layers_of(graph: TrainingGraph) -> tuple[dict[int, set[str]], dict[str, set[int]]]:
    by_layer = params_by_layer(graph)
    layers_of: dict[str, set[int]] = {}
    for layer, names in by_layer.items():
        for n in names:
            layers_of.setdefault(n, set()).add(layer)
    return by_layer, layers_of


def layerwise_params(graph: TrainingGraph, layout: Layout, levels: dict[str, int],
                     offloaded: set[str] = frozenset()) -> dict[str, int]:
    """Canonical name -> layer of the ZeRO-2/3 parameters reduced (and gathered) per layer (docstring).
    `offloaded`: parameters whose values are offloaded ("params"), which stream instead."""
    by_layer, layers_of = _layers_of(graph)
    holders: dict[str, list[tuple]] = {}
    for p in layout.pipelines:
        for s, st in enumerate(p.stages):
            key = (s, st.layers, len(p.stages), p.num_microbatches, p.schedule, p.chunks, len(st.ranks))
            for layer in range(*st.layers):
                for n in by_layer.get(layer, ()):
                    holders.setdefault(n, []).append((p.index, key))
    out: dict[str, int] = {}
    for n, held in holders.items():
        if levels.get(n, 0) < 2 or n in offloaded or len(layers_of.get(n, ())) != 1 or len(held) < 2:
            continue
        pipes = [i for i, _ in held]
        keys = {k for _, k in held}
        if len(set(pipes)) == len(pipes) and len(keys) == 1 and next(iter(keys))[-1] == 1:
            out[n] = next(iter(layers_of[n]))
    return out


def streamed_params(graph: TrainingGraph, levels: dict[str, int], offloaded: set[str]) -> dict[str, int]:
    """Canonical name -> layer of the offloaded parameters streamed per layer (docstring)."""
    _, layers_of = _layers_of(graph)
    return {n: next(iter(layers_of[n])) for n in sorted(offloaded)
            if levels.get(n, 0) <= 2 and len(layers_of.get(n, ())) == 1}


class LayerwiseMemory:
    """The layer hooks (layered.LayerHooks) that carry out one rank's per-layer memory actions."""

    def __init__(self, zero: ZeroRuntime, reduced: dict[str, int], streamed: dict[str, int]) -> None:
        self.zero = zero
        state = zero.state
        reduced = {n: layer for n, layer in reduced.items() if n in state and state[n].level >= 2}
        # the optimizer must not update a freed device tensor: streamed ones it owns are its host masters
        streamed = {n: layer for n, layer in streamed.items() if n in state and state[n].host is not None
                    and (state[n].master or not state[n].owned)}
        for n in streamed:
            state[n].streamed = True
        self.layer_of = {**reduced, **streamed}
        self.names: dict[int, list[str]] = {}
        for n in sorted(self.layer_of):
            self.names.setdefault(self.layer_of[n], []).append(n)
        pick = lambda names, ok: [n for n in names if ok(n)]  # noqa: E731
        self.reduced = {lay: pick(ns, lambda n: n in reduced) for lay, ns in self.names.items()}
        self.streamed = {lay: pick(ns, lambda n: n in streamed) for lay, ns in self.names.items()}
        self.gathered = {lay: pick(ns, lambda n: n in reduced and state[n].level == 3)
                         for lay, ns in self.names.items()}
        self.resident: set[int] = set()  # layers brought in now (the same on every holder)
        self.armed = False  # inside a training step's schedule
        self._pending: list[int] = []  # layers of the running backward awaiting their end actions, descending
        self._seen: dict[int, set[str]] = {}
        by_id = {id(zero.params[n]): n for n in self.layer_of}
        for n in self.layer_of:
            zero.params[n].register_post_accumulate_grad_hook(lambda p, by_id=by_id: self._accumulated(by_id[id(p)]))
        zero.layer_reduced = set(reduced)
        zero.layer_resident = {n for ns in self.gathered.values() for n in ns} | set(streamed)

    def __bool__(self) -> bool:
        return bool(self.names)

    def layers(self) -> set[int]:
        return set(self.names)

    # ---- layered.LayerHooks ------------------------------------------------------------------------
    def before_forward(self, layer: int) -> None:
        self._bring(layer)

    def after_forward(self, layer: int) -> None:
        if self.armed:
            self._drop(layer)

    def before_backward(self, layer: int) -> None:
        self._bring(layer)

    # ---- one backward ------------------------------------------------------------------------------
    def begin_backward(self, layers: tuple[int, int]) -> None:
        self._pending = sorted((layer for layer in self.names if layers[0] <= layer < layers[1]), reverse=True)
        self._seen = {}

    def end_backward(self) -> None:
        """Finish what the backward left (layers some of whose parameters got no gradient), in order."""
        while self._pending:
            self._finish(self._pending.pop(0))

    def _accumulated(self, name: str) -> None:
        layer = self.layer_of[name]
        self._seen.setdefault(layer, set()).add(name)
        while self._pending and self._seen.get(self._pending[0], set()) >= set(self.names[self._pending[0]]):
            self._finish(self._pending.pop(0))

    # ---- actions -----------------------------------------------------------------------------------
    def _bring(self, layer: int) -> None:
        if not self.armed or layer in self.resident or layer not in self.names:
            return
        self.zero.gather(self.gathered[layer])
        self.zero.stream_in(self.streamed[layer])
        self.resident.add(layer)

    def _drop(self, layer: int) -> None:
        if layer in self.resident:
            self.zero.free(self.gathered[layer] + self.streamed[layer])
            self.resident.discard(layer)

    def _finish(self, layer: int) -> None:
        self.zero.reduce_gradients(self.reduced[layer])
        self.zero.stream_out_grads(self.streamed[layer])
        self._drop(layer)
