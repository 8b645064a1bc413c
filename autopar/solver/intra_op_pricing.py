"""The intra-op ILP (`intra_op`) as the planner's price of a tensor-parallel layer (`pricing.tp_layer_cost`)."""

from __future__ import annotations

import copy
from collections.abc import Sequence

from ..cluster import Cluster
from ..errors import PlanError
from ..graph import Layer, TrainingGraph
from .intra_op import _CACHE, _STATS, IntraOpResult, _build, _check, _Context, _result, _solution, solve_problems
from .intra_op_strategies import R


class LayerPricer:
    """Per-micro-batch costs of single layers on one tensor-parallel group, for the planner's pricing.

    The ILP is solved per (layer signature, micro-batch size bucket): at the powers of two just below and
    above the size (`buckets`), and both optima are priced at the exact size, the faster kept. So a size
    that is a power of two gets the ILP's optimum there (never worse than Megatron's sharding, which is in
    its space), and the planner, which meets dozens of sizes (every share of a batch split), runs a few
    solves per layer class and group (~0.1 s each). Solutions are kept in the module cache. `cost` returns
    None when the ILP finds no solution within the time limit.
    """

    def __init__(self, graph: TrainingGraph, tp: int, device_type: str, cluster: Cluster, group: Sequence[int],
                 time_limit_s: float = 2.0) -> None:
        _check(graph, [0], tp, device_type, cluster, group)
        self.ctx = _Context(graph, tp, device_type, cluster, group)
        self.time_limit_s = time_limit_s
        self._choices: dict[tuple, tuple[int, tuple[int, ...]] | None] = {}

    def _at(self, batch: int) -> _Context:
        ctx = copy.copy(self.ctx)  # shares the strategy and collective memo tables: neither depends on frac
        ctx.frac = batch / ctx.graph.batch_size
        return ctx

    def _choice(self, layer: Layer, batch: int) -> tuple[int, tuple[int, ...]] | None:
        """(boundary layout, strategy index per group) of the ILP optimum for `layer` at `batch` samples."""
        ctx = self._at(batch)
        key = ("choice", ctx.layer_key(layer))
        if key in _CACHE:
            _STATS["hits"] += 1
            return _CACHE[key]  # type: ignore[return-value]
        _STATS["misses"] += 1
        plain = ctx.boundary_key(layer, R)
        best: tuple[int, int, tuple[int, ...]] | None = None
        for boundary in (R, 0, 1):
            if boundary != R and ctx.boundary_key(layer, boundary) == plain:
                continue
            prob = _build(ctx, layer, boundary)
            try:
                (choice,) = solve_problems([(prob, 1)], None, self.time_limit_s)
            except PlanError:
                continue
            value = prob.objective(choice)
            if best is None or value < best[0]:
                best = (value, boundary, choice)
        _CACHE[key] = None if best is None else best[1:]  # type: ignore[assignment]
        return _CACHE[key]  # type: ignore[return-value]

    def cost(self, layer_index: int, batch: int) -> IntraOpResult | None:
        """The layer's times and memory per device for one micro-batch of `batch` samples."""
        layer = self.ctx.graph.layers[layer_index]
        ctx = self._at(batch)
        key = ctx.layer_key(layer)
        best: tuple[float, IntraOpResult] | None = None
        for size in buckets(batch):
            picked = self._choice(layer, size)
            if picked is None:
                continue
            boundary, choice = picked
            sol = _solution(_build(ctx, layer, boundary, choice), layer, (0,) * len(choice))
            res = _result(ctx.tp, [layer], [key], {key: sol})
            if best is None or res.time_fwd + res.time_bwd < best[0]:
                best = (res.time_fwd + res.time_bwd, res)
        return None if best is None else best[1]


def buckets(batch: int) -> tuple[int, ...]:
    """The micro-batch sizes the ILP is solved at for `batch` samples: the powers of two around it."""
    lo = 1 << (batch.bit_length() - 1)
    return (lo,) if lo == batch else (lo, 2 * lo)


__all__ = ["LayerPricer", "buckets"]
