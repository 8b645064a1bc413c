"""The communication half of the planner's cost model (`pricing.model.CostModel` inherits it): collectives over
device groups, memoised by what their time depends on, and point-to-point stage sends, compressed or not
(pricing.py's docstring, "Compressed sends")."""

from __future__ import annotations

from typing import Any

from ...cluster import Cluster
from ...cost_models.comm import collective_time, group_bandwidth, p2p_time
from .plan import ACT_BYTES, SLOW_LINK_BYTES_PER_S, WIRE_BYTES


class CommPricing:
    """Mixin of `pricing.model.CostModel`: needs its `cluster`, `precision`, `_memo`, `_sigs`, `_sig_of_group`."""

    cluster: Cluster
    precision: str
    _memo: dict[tuple, Any]
    _sigs: dict[tuple, int]
    _sig_of_group: dict[tuple[int, ...], int]

    # ---- communication ------------------------------------------------------------------------
    def group_sig(self, group: tuple[int, ...]) -> int:
        """A small int naming what a collective's time over `group` depends on (group size, members per
        node and node links, ring bottleneck), so equivalent groups share cache entries."""
        sig = self._sig_of_group.get(group)
        if sig is None:
            sig = self._sig_of_group[group] = self._sigs.setdefault(self.group_signature(group), len(self._sigs))
        return sig

    def group_signature(self, group: tuple[int, ...]) -> tuple:
        """What `group_sig` numbers (in the order groups are first asked for): the same for equivalent groups
        in any process, whatever was asked before."""
        nodes: dict[int, int] = {}
        for d in group:
            node = self.cluster.devices[d].node
            nodes[node] = nodes.get(node, 0) + 1
        return (len(group), tuple((self.cluster.nodes[k].intra_node, self.cluster.nic_bandwidth(k), c)
                                  for k, c in nodes.items()),
                group_bandwidth(group, self.cluster), {self.cluster.devices[d].spec.kind for d in group} == {"gpu"})

    def collective(self, kind: str, nbytes: float, group: tuple[int, ...], concurrent: int = 1) -> float:
        """`concurrent`: groups of this shape running it at once, sharing their nodes' NICs (comm.py)."""
        if len(group) < 2 or nbytes <= 0:
            return 0.0
        key = (kind, nbytes, self.group_sig(group), concurrent)
        t = self._memo.get(key)
        if t is None:
            t = self._memo[key] = float(collective_time(kind, nbytes, group, self.cluster, concurrent=concurrent))
        return t  # type: ignore[return-value]

    def send_time(self, nbytes: float, src: int, dst: int, compress: str | None = None) -> float:
        """Point-to-point seconds for one activation (or its gradient) of `nbytes` (in the plan's precision)
        between two stages; with `compress` the wire carries 2-byte elements, cast on both ends."""
        if src == dst:
            return 0.0
        link = self.cluster.link(src, dst)
        key = ("p2p", nbytes, link, compress, self.cluster.devices[src].spec.name,
               self.cluster.devices[dst].spec.name)
        t = self._memo.get(key)
        if t is None:
            if compress is None:
                t = float(p2p_time(nbytes, src, dst, self.cluster))
            else:
                elems = nbytes / ACT_BYTES[self.precision]
                cast = elems * (ACT_BYTES[self.precision] + WIRE_BYTES[compress])  # read + write, each end
                t = float(p2p_time(elems * WIRE_BYTES[compress], src, dst, self.cluster)) + sum(
                    cast / self.cluster.devices[d].spec.memory_bandwidth for d in (src, dst))
            self._memo[key] = t
        return t  # type: ignore[return-value]

    def compress_choice(self, nbytes: float, src: int, dst: int) -> str | None:
        """The wire dtype for a stage boundary under the planner's rule (pricing.py's docstring, "Compressed
        sends"): the dtype the user allows (`self.compress`) when the plan trains in fp32/tf32, the link is slow
        and the send gets faster; else None (always None unless the user allowed compression)."""
        if (self.compress is None or src == dst or self.precision not in ("fp32", "tf32")
                or self.cluster.link(src, dst).bandwidth > SLOW_LINK_BYTES_PER_S):
            return None
        faster = self.send_time(nbytes, src, dst, self.compress) < self.send_time(nbytes, src, dst)
        return self.compress if faster else None

    def boundary_send(self, nbytes: float, src: int, dst: int) -> float:
        """Send seconds of a stage boundary as the search plans it (compressed where `compress_choice` says)."""
        if src == dst:
            return 0.0
        key = ("boundary", nbytes, src, dst)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self.send_time(nbytes, src, dst, self.compress_choice(nbytes, src, dst))
        return hit  # type: ignore[return-value]

    def stage_send(self, nbytes: float, src: tuple[int, ...], dst: tuple[int, ...]) -> float:
        """`boundary_send` between the tensor-parallel groups of two consecutive stages, times
        `boundary_copies`: what one rank of the smaller group sends into a larger one."""
        if len(src) == len(dst):
            return self.boundary_send(nbytes, src[0], dst[0])
        return self.boundary_send(nbytes, src[0], dst[0]) * boundary_copies(src, dst)


def boundary_copies(src: tuple[int, ...], dst: tuple[int, ...]) -> int:
    """Copies of a stage-boundary tensor one rank sends when consecutive stages differ in tensor-parallel
    degree (runtime/program.py `_peers`: each rank of the larger group receives from one rank of the smaller,
    so a sender of the smaller group serves ceil(larger / smaller) of them, one after another). Priced in both
    directions (a stage has one send time for its activations and their gradients), so the direction that
    sends one copy is priced high by that factor."""
    a, b = sorted((len(src), len(dst)))
    return -(-b // a)


__all__ = ["CommPricing", "boundary_copies"]
