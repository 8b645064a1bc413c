"""The intra-op ILPs of the configurations' work bounds, shared with a forked helper process that solves them ahead.

Before the search's workers fork (speculative.py), its process prices every configuration's work bound
(`ConfigBounds.work`), one core idle meanwhile; the first bound asking for a device type, tensor-parallel group and
micro-batch size prices each layer on that group, and for a repeated block that solves the block's intra-op ILPs
(`intra_op.pricing.LayerPricer`: a CP-SAT solve per micro-batch bucket and boundary layout; GPT-Neo-2.7B's shape
on 8 A100 + 8 V100: 54 solves, ~0.5 s of the bounds' ~1.1 s).

`IlpAhead` forks a helper at the start that prices those (device type, group, micro-batch size) items from the
last, in the order the bounds first ask for them, into its copy of the ILPs' answer cache (`intra_op.ilp.CACHE`,
each key naming everything its problem depends on), sending each item's new answers as it goes. The bounds are
computed in the search's process, in their own order (from the first item), as before; before pricing an item
there, the answers the helper has sent are taken, so its ILPs are cache hits, and once the search's process reaches
an item the helper has priced the two have met and the helper is stopped. Nothing else crosses over: the cost
model's memo is keyed by group signatures numbered in the order groups are first asked for, so every price is
computed where it was and the bounds, the configurations' order and the plan are the one-process search's. A
helper that fails, dies or warns (the wall-clock guard cut a solve: that answer depends on the machine) stops
there; what it has not sent is solved in the search's process, warning there.
"""

from __future__ import annotations

import multiprocessing
import signal
import warnings
from collections.abc import Iterable
from multiprocessing.connection import Connection
from typing import Any

from ..intra_op import ilp
from ..split.split import Unit

# (device type, tensor-parallel unit, micro-batch size)
Item = tuple[str, Unit, int]


def bound_items(cm: Any, groupings: Iterable[tuple[tuple[tuple[Unit, ...], ...], list[int]]]) -> list[Item]:
    """The tensor-parallel units (two devices or more) whose layers the work bounds of `groupings` ((pipelines,
    micro-batch sizes) each, in the search's order) price: one per device type, group signature and micro-batch
    size, the first unit the bounds ask for, in that order. Empty where no ILP prices a layer (intra-op pricing
    off, or no repeated block)."""
    if not cm.intra_op or not any(cm.is_block):
        return []
    seen: set[tuple] = set()
    out: list[Item] = []
    kinds: dict[Unit, tuple] = {}  # unit -> (device type, group signature): units recur in every grouping and size
    for pipes, sizes in groupings:
        for b in sizes:
            for pipe in pipes:
                for u in pipe:
                    if len(u) < 2:
                        continue
                    kind = kinds.get(u)
                    if kind is None:
                        kind = kinds[u] = (cm.cluster.devices[u[0]].spec.name, cm.group_signature(u))
                    if (*kind, b) not in seen:
                        seen.add((*kind, b))
                        out.append((kind[0], u, b))
    return out


def _solve(conn: Connection, price: Any, items: list[Item], keys: list[tuple]) -> None:
    """The helper: price the items from the last (`price(unit, b)`), sending after each its key and the ILP answers
    it added to the cache; it stops at the first that warns or raises (the search's process prices the rest)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt is the searching process's to handle
    try:
        for (_, u, b), key in zip(reversed(items), reversed(keys), strict=True):
            before = ilp.cache_keys()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                price(u, b)
            if caught:
                return
            conn.send((key, ilp.cache_entries_since(before)))
    except Exception:  # the search's process prices it itself, and raises there
        return
    finally:
        conn.close()


class IlpAhead:
    """A forked helper pricing `items` from the last with `price(unit, b)` (`ConfigBounds` unit costs) while the
    search's process prices them from the first: before pricing one (`before`), the search's process takes the
    answers the helper has sent; once it reaches one the helper has priced, they have met and the helper is
    stopped (anything left is priced in the search's process)."""

    def __init__(self, cm: Any, items: list[Item], price: Any) -> None:
        self.cm = cm
        keys = [(dtype, cm.group_signature(u), b) for dtype, u, b in items]
        self.done: set[tuple] = set()  # items the helper has priced
        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_solve, args=(child, price, items, keys), daemon=True)
        self.process.start()
        child.close()
        self.open = True

    def before(self, dtype: str, u: Unit, b: int) -> None:
        """Called before pricing unit u at micro-batch size b: take what the helper has sent; where it has priced
        this one, the two have met: it is stopped."""
        if not self.open:
            return
        self._receive()
        if (dtype, self.cm.group_signature(u), b) in self.done:
            self.close()

    def _receive(self) -> None:
        try:
            while self.conn.poll():
                key, entries = self.conn.recv()
                ilp.add_to_cache(entries)
                self.done.add(key)
        except (EOFError, OSError):  # it finished, stopped at a warning, or died: the rest is priced here
            self.close()

    def close(self) -> None:
        if not self.open:
            return
        self.open = False
        if self.process.is_alive():
            self.process.kill()  # what it still prices was priced here
        self.process.join(timeout=5.0)
        self.conn.close()


__all__ = ["IlpAhead", "Item", "bound_items"]
