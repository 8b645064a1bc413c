"""The per-layer memory actions of a rank's action list (lowering.py, schedule.py), carried out.

A compute action F(s, m) / B(s, m) of a stage run layer by layer (layered.py) carries the memory actions
the lowering listed around it; `begin(action, memory)` hands them over and the layer hooks run each at its
layer boundary, for layer l:

    GATHER_F / GATHER_B   bring l in: ZeRO-3 parameters gathered (broadcast from their owners into the
                          parameter's own storage), streamed (offloaded) parameters copied from their host
                          values; then start gathering the next GATHER of the same compute action (prefetch),
                          so at most two layers' ZeRO-3 parameters are on the device
    FREE_F / FREE_B       drop l: free the ZeRO-3 parameters this rank does not own and the streamed ones
    REDUCE                once every hooked parameter of l has its gradient accumulated: ZeRO-2/3 reduce
                          l's gradients to their owners (`dist.reduce`; the owner accumulates the sum over
                          micro-batches, non-owners drop theirs), streamed parameters move their gradient
                          to the host (accumulated there); one layer's reduction is in flight while the
                          backward goes on, and all have completed when the compute action ends

`end()` finishes the actions of layers whose parameters got no gradient, in list order, and raises
PlanError when a listed action did not run: the list is what runs. So a device holds its own shard
(N w / D, N g / D), no streamed state, plus the layers in use, as priced. After the schedule zero.py
reduces what is left (ZeRO-0/1 all-reduce, streamed gradients a bucket at a time through the device) and
steps the optimizer (streamed parameters have it on the host). Which parameters are per layer, and why
that order cannot deadlock, is lowering.py's docstring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import PlanError
from ..ir.lowered import RankProgram
from ..ir.schedule import Action

if TYPE_CHECKING:
    from .zero import ZeroRuntime


class LayerwiseMemory:
    """The layer hooks (layered.LayerHooks) that carry out one rank's per-layer memory actions."""

    def __init__(self, zero: ZeroRuntime, lowered: RankProgram) -> None:
        self.zero = zero
        state = zero.state
        reduced, streamed = lowered.layer_reduced, lowered.streamed
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
        self.gathered = {lay: pick(ns, lambda n: n in lowered.layer_gathered) for lay, ns in self.names.items()}
        self.resident: set[int] = set()  # layers brought in now (the same on every holder)
        self._prefetched: dict[int, list[tuple]] = {}  # layer -> its gather in flight
        self._reducing: tuple[int, list[tuple]] | None = None  # the layer whose gradient reduction is in flight
        self._todo: list[Action] = []  # the running compute action's memory actions not yet run, in list order
        self._ran: list[Action] = []
        self._pending: list[int] = []  # layers of the running backward awaiting REDUCE, in list order
        self._seen: dict[int, set[str]] = {}
        by_id = {id(zero.params[n]): n for n in self.layer_of}
        for n in self.layer_of:
            zero.params[n].register_post_accumulate_grad_hook(lambda p, by_id=by_id: self._accumulated(by_id[id(p)]))
        zero.layer_reduced = set(reduced)
        zero.layer_resident = set(lowered.layer_gathered) | set(streamed)

    def __bool__(self) -> bool:
        return bool(self.names)

    def layers(self) -> set[int]:
        return set(self.names)

    # ---- one compute action ------------------------------------------------------------------------
    def begin(self, action: Action, memory: list[Action]) -> None:
        """`action` (F or B) runs next, with its listed memory actions `memory`."""
        self._todo, self._ran, self._seen = list(memory), [], {}
        self._pending = [a.layer for a in memory if a.kind == "REDUCE"]

    def end(self, action: Action) -> None:
        """`action` ended: run what its backward left (layers some of whose parameters got no gradient), in
        order, complete the reduction in flight, and check that every listed action ran."""
        while self._pending:
            self._finish(self._pending.pop(0))
        self._complete()
        self.settle()
        if self._todo:
            raise PlanError(f"{action}: the lowered memory action(s) {', '.join(map(str, self._todo))} did "
                            f"not run (no layer hook reached them): the rank's program and its action list "
                            f"disagree.")
        self._todo = []

    def _take(self, kind: str, layer: int) -> Action | None:
        for i, a in enumerate(self._todo):
            if a.kind == kind and a.layer == layer:
                self._ran.append(a)
                return self._todo.pop(i)
        return None

    def _ahead(self, kind: str) -> int | None:
        """The layer of the next listed `kind` action (what this pass brings in next: its prefetch)."""
        return next((a.layer for a in self._todo if a.kind == kind), None)

    # ---- layered.LayerHooks ------------------------------------------------------------------------
    def before_forward(self, layer: int) -> None:
        if self._take("GATHER_F", layer):
            self._bring(layer, self._ahead("GATHER_F"))

    def after_forward(self, layer: int) -> None:
        if self._take("FREE_F", layer):
            self._drop(layer)

    def before_backward(self, layer: int) -> None:
        if self._take("GATHER_B", layer):
            self._bring(layer, self._ahead("GATHER_B"))

    def _accumulated(self, name: str) -> None:
        layer = self.layer_of[name]
        self._seen.setdefault(layer, set()).add(name)
        while self._pending and self._seen.get(self._pending[0], set()) >= self._needed[self._pending[0]]:
            self._finish(self._pending.pop(0))

    # ---- the actions ---------------------------------------------------------------------------------
    def _bring(self, layer: int, ahead: int | None = None) -> None:
        """Make `layer` resident, then start gathering `ahead`, so its broadcast overlaps `layer`'s compute."""
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
        """Layer `layer`'s backward is done: REDUCE (the previous layer's reduction is completed first, so
        one is in flight while the backward goes on), then FREE_B."""
        self._take("REDUCE", layer)
        self._complete()
        if self.reduced[layer]:
            self._reducing = (layer, self.zero.launch_reduces(self.reduced[layer]))
        else:
            self.zero.stream_out_grads(self.streamed[layer])
        if self._take("FREE_B", layer):
            self._drop(layer)

    def _complete(self) -> None:
        if self._reducing is None:
            return
        layer, pendings = self._reducing
        self._reducing = None
        for pending in pendings:
            self.zero.finish_reduce(pending)
        self.zero.stream_out_grads(self.streamed[layer])
