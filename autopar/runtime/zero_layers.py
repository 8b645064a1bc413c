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
planner prices that path for it (`solver/stage_memory.py`, from `plan.layerwise_stages`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..graph import TrainingGraph
from ..plan import layerwise_stages
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
    """Canonical name -> layer of the ZeRO-2/3 parameters reduced (and gathered) per layer: those of the
    stages `plan.layerwise_stages` names, read by one layer only, not offloaded ("params": they stream)."""
    by_layer, layers_of = _layers_of(graph)
    stages = layerwise_stages([(p.num_microbatches, [(st.layers, len(st.ranks)) for st in p.stages])
                               for p in layout.pipelines])
    out: dict[str, int] = {}
    for i, j in stages:
        for layer in range(*layout.pipelines[i].stages[j].layers):
            for n in by_layer.get(layer, ()):
                if levels.get(n, 0) >= 2 and n not in offloaded and len(layers_of[n]) == 1:
                    out[n] = layer
    return out


def streamed_params(graph: TrainingGraph, levels: dict[str, int], offloaded: set[str]) -> dict[str, int]:
    """Canonical name -> layer of the offloaded parameters streamed per layer (docstring)."""
    _, layers_of = _layers_of(graph)
    return {n: next(iter(layers_of[n])) for n in sorted(offloaded)
            if levels.get(n, 0) <= 2 and len(layers_of.get(n, ())) == 1}


class LayerwiseMemory:
    """The layer hooks (layered.LayerHooks) that carry out one rank's per-layer memory actions."""

    def __init__(self, zero: ZeroRuntime, reduced: dict[str, int], streamed: dict[str, int],
                 stages: list[tuple[int, int]]) -> None:
        """`stages`: the layer ranges of this rank's stages (a prefetch never crosses a stage boundary)."""
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
        self._needed = {layer: set(names) for layer, names in self.names.items()}  # what finishes a layer
        pick = lambda names, ok: [n for n in names if ok(n)]  # noqa: E731
        self.reduced = {lay: pick(ns, lambda n: n in reduced) for lay, ns in self.names.items()}
        self.streamed = {lay: pick(ns, lambda n: n in streamed) for lay, ns in self.names.items()}
        self.gathered = {lay: pick(ns, lambda n: n in reduced and state[n].level == 3)
                         for lay, ns in self.names.items()}
        self.resident: set[int] = set()  # layers brought in now (the same on every holder)
        self._prefetched: dict[int, list[tuple]] = {}  # layer -> its gather in flight
        self._reducing: tuple[int, list[tuple]] | None = None  # the layer whose gradient reduction is in flight
        # the next / previous layer with ZeRO-3 parameters in the same stage: what forward / backward prefetch
        self._next: dict[int, int] = {}
        self._prev: dict[int, int] = {}
        for a, e in stages:
            mine = [lay for lay in range(a, e) if self.gathered.get(lay)]
            self._next.update(zip(mine, mine[1:], strict=False))
            self._prev.update(zip(mine[1:], mine, strict=False))
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
        self._bring(layer, self._next.get(layer))

    def after_forward(self, layer: int) -> None:
        if self.armed:
            self._drop(layer)

    def before_backward(self, layer: int) -> None:
        self._bring(layer, self._prev.get(layer))

    # ---- one backward ------------------------------------------------------------------------------
    def begin_backward(self, layers: tuple[int, int]) -> None:
        self._pending = sorted((layer for layer in self.names if layers[0] <= layer < layers[1]), reverse=True)
        self._seen = {}

    def end_backward(self) -> None:
        """Finish what the backward left (layers some of whose parameters got no gradient), in order."""
        while self._pending:
            self._finish(self._pending.pop(0))
        self._complete()
        self.settle()

    def _accumulated(self, name: str) -> None:
        layer = self.layer_of[name]
        self._seen.setdefault(layer, set()).add(name)
        while self._pending and self._seen.get(self._pending[0], set()) >= self._needed[self._pending[0]]:
            self._finish(self._pending.pop(0))

    # ---- actions -----------------------------------------------------------------------------------
    def _bring(self, layer: int, ahead: int | None = None) -> None:
        """Make `layer` resident, then start gathering `ahead` (the layer this pass runs next), so its
        broadcast overlaps `layer`'s compute: at most two layers' ZeRO-3 parameters are on the device."""
        if not self.armed or layer not in self.names:
            return
        if layer not in self.resident:
            for pending in self._prefetched.pop(layer, None) or self.zero.gather(self.gathered[layer]):
                self.zero.finish_broadcast(pending)
            self.zero.stream_in(self.streamed[layer])
            self.resident.add(layer)
        if ahead is not None and ahead not in self.resident and ahead not in self._prefetched \
                and self.gathered.get(ahead):
            self._prefetched[ahead] = self.zero.gather(self.gathered[ahead])

    def settle(self) -> None:
        """Complete prefetches nobody used (a layer whose backward never ran) and free them again."""
        for layer in sorted(self._prefetched):
            for pending in self._prefetched.pop(layer):
                self.zero.finish_broadcast(pending)
            self.zero.free(self.gathered[layer])

    def _drop(self, layer: int) -> None:
        if layer in self.resident:
            self.zero.free(self.gathered[layer] + self.streamed[layer])
            self.resident.discard(layer)

    def _finish(self, layer: int) -> None:
        """Layer `layer`'s backward is done: start reducing its gradients (the previous layer's reduction is
        completed first, so one is in flight while the backward goes on) and free its parameters."""
        self._complete()
        if self.reduced[layer]:
            self._reducing = (layer, self.zero.launch_reduces(self.reduced[layer]))
        else:
            self.zero.stream_out_grads(self.streamed[layer])
        self._drop(layer)

    def _complete(self) -> None:
        if self._reducing is None:
            return
        layer, pendings = self._reducing
        self._reducing = None
        for pending in pendings:
            self.zero.finish_reduce(pending)
        self.zero.stream_out_grads(self.streamed[layer])
