"""Finding the reshardings several groups of an intra-op problem share (`intra_op`): paid once, however many
readers need them (`shared_reshards`). What one is, `Shared` (and the objective unit PS), is problem data in
intra_op/problem.py, re-exported here; the ILP couples them to the readers' choices (`intra_op.ilp._needed`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .problem import PS, Group, NodeStrategy, Shared
from .strategies import P, R

if TYPE_CHECKING:
    from .context import Context


def shared_reshards(ctx: Context, groups: list[Group], index: dict[str, int], boundary: int
                    ) -> list[tuple[tuple[str, int, bool], Shared]]:
    """The reshardings several groups share ((tensor, layout, backward) -> Shared): partial gradients of a
    tensor more than one group may return one for (a norm's output read by separate column-parallel Q, K
    and V projections), and, outside runtime mode, the same layout taken by several readers."""
    readers: dict[str, list[tuple[int, list[NodeStrategy]]]] = {}
    for iv, g in enumerate(groups):
        root = g.members[0]
        for a in g.choices[0][root].ins:
            if a not in ctx.graph.params:
                readers.setdefault(a, []).append((iv, [c[root] for c in g.choices]))
    out = []
    for a, rs in readers.items():
        if len(rs) < 2:
            continue
        nbytes = ctx.tensor_bytes(ctx.meta(a))
        if a in index:
            u = index[a]
            srcs = [c[a].base.out for c in groups[u].choices]
        else:
            u, srcs = None, [ctx.boundary_layout(a, boundary) if a in ctx.graph.nodes else R]
        keys = [(P, True)] if ctx.needs_grad(a) else []
        if not ctx.runtime:
            keys += [(x, False) for x in sorted({s.ins[a] for _, ss in rs for s in ss}) if x != P]
        for layout, backward in keys:
            parts = tuple((iv, frozenset(j for j, s in enumerate(ss) if (s.grads if backward else s.ins)[a] == layout))
                          for iv, ss in rs)
            if sum(1 for _, part in parts if part) < 2:
                continue
            seconds = tuple(ctx.reshard(P, R if src == P else src, nbytes) if backward else
                            ctx.reshard(src, layout, nbytes) for src in srcs)
            if any(seconds):
                out.append(((a, layout, backward), Shared(u, parts, seconds, backward)))
    return out


__all__ = ["PS", "Shared", "shared_reshards"]
