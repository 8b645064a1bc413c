"""The intra-op ILP's data (`intra_op` has the formulation): per group of ops, its strategies and their
costs; per group pair, resharding matrices; the reshardings several groups share (`Shared`); and what a
solved problem gives (`Solution`, summed into an `IntraOpResult`).

Built by intra_op/build.py, solved by intra_op/ilp.py, used by intra_op.py (`solve_intra_op`) and
intra_op/pricing.py (`LayerPricer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ...ir.graph import Layer
from .strategies import Strategy, layout_name

PS = 1e12  # objective unit: picoseconds


@dataclass
class IntraOpResult:
    """`solve_intra_op`'s answer for a stage's layers (and `LayerPricer.cost`'s for one): per device."""

    tp: int
    time_fwd: float  # seconds per global batch, compute + communication
    time_bwd: float
    comm_time: float  # the communication part of time_fwd + time_bwd
    param_bytes_per_device: float  # weights only, comparable to Layer.param_bytes
    activation_bytes_per_device: float  # saved for backward per global batch, like Layer.saved_bytes
    strategies: dict[str, str]  # node name -> strategy name
    comm_fwd: float = 0.0  # the communication parts of time_fwd and time_bwd
    comm_bwd: float = 0.0
    # model parameter name -> "replicate" | "shard(d)": what the runtime runs (intra_op.pricing, runtime mode)
    sharding: dict[str, str] | None = None
    source: str = ""  # LayerPricer: which candidate placements won (intra_op.pricing.SOURCES)


@dataclass
class Cost:
    """Seconds and bytes per device of one strategy choice (of a group, an edge, or summed over a layer)."""

    compute_fwd: float = 0.0
    compute_bwd: float = 0.0
    comm_fwd: float = 0.0
    comm_bwd: float = 0.0
    param_bytes: float = 0.0
    state_bytes: float = 0.0
    act_bytes: float = 0.0

    def add(self, other: Cost, weight: float = 1.0) -> None:
        for k, v in vars(other).items():
            setattr(self, k, getattr(self, k) + weight * v)

    @property
    def seconds(self) -> float:
        return self.compute_fwd + self.compute_bwd + self.comm_fwd + self.comm_bwd


@dataclass(frozen=True)
class NodeStrategy:
    """A Strategy with inputs keyed by argument name (an argument read twice must agree)."""

    base: Strategy
    ins: dict[str, int]
    grads: dict[str, int]


@dataclass
class Group:
    members: list[str]  # root first
    choices: list[dict[str, NodeStrategy]]  # per strategy of the root: member -> its strategy


@dataclass
class Problem:
    """One layer's ILP data: per group, per strategy costs; per group pair, resharding matrices; the
    gradient reductions shared by several readers (`Shared`)."""

    groups: list[Group]
    cost: list[list[int]]  # picoseconds
    memory: list[list[int]]  # bytes
    edges: dict[tuple[int, int], list[list[int]]]
    detail: list[list[Cost]]
    edge_detail: dict[tuple[int, int], list[list[tuple[float, float]]]]
    const: Cost = field(default_factory=Cost)
    shared: list[Shared] = field(default_factory=list)

    def objective(self, choice: Sequence[int]) -> int:
        return sum(c[i] for c, i in zip(self.cost, choice, strict=True)) + sum(
            m[choice[u]][choice[v]] for (u, v), m in self.edges.items()) + sum(
            round(g.paid(choice) * PS) for g in self.shared)

    @property
    def const_memory(self) -> int:
        return round(self.const.state_bytes + self.const.act_bytes)

    def memory_of(self, choice: Sequence[int]) -> int:
        return self.const_memory + sum(
            m[i] for m, i in zip(self.memory, choice, strict=True))

    def breakdown(self, choice: Sequence[int]) -> Cost:
        total = Cost()
        total.add(self.const)
        for d, i in zip(self.detail, choice, strict=True):
            total.add(d[i])
        for (u, v), m in self.edge_detail.items():
            f, b = m[choice[u]][choice[v]]
            total.comm_fwd += f
            total.comm_bwd += b
        total.comm_fwd += sum(g.paid(choice) for g in self.shared if not g.backward)
        total.comm_bwd += sum(g.paid(choice) for g in self.shared if g.backward)
        return total

    def names(self, choice: Sequence[int]) -> dict[str, str]:
        out = {}
        for g, i in zip(self.groups, choice, strict=True):
            for m, s in g.choices[i].items():
                out[m] = s.base.name if m == g.members[0] else layout_name(s.base.out)
        return out


@dataclass(frozen=True)
class Solution:
    """One layer's problem solved (what the answer cache keeps): objective, memory, breakdown, strategy names."""

    objective: int
    memory: int
    cost: Cost
    names: tuple[str, ...]  # by position in the layer's node list ("" for nodes without outputs)


@dataclass(frozen=True)
class Shared:
    """A resharding several groups share, paid once when any of them needs it, however many do.

    Backward: more than one reader may return a partial-sum gradient; autograd adds the readers' gradients
    first (a sum of partial sums is one), so one reduction (all-reduce, or reduce-scatter to a sharded
    producer) turns them into what the producer's backward needs. Forward (not in runtime mode, where
    DTensor reshards for every op): several readers take the tensor in the same other layout, and one
    all-gather / all-to-all serves them all (as Megatron's sequence parallelism gathers once per norm)."""

    producer: int | None  # the group producing the tensor; None: read from outside the layer (layout fixed)
    readers: tuple[tuple[int, frozenset[int]], ...]  # (group, its strategies that need the resharding)
    seconds: tuple[float, ...]  # the resharding per producer strategy (one value when producer is None)
    backward: bool = True

    def paid(self, choice: Sequence[int]) -> float:
        if any(choice[v] in part for v, part in self.readers):
            return self.seconds[0 if self.producer is None else choice[self.producer]]
        return 0.0

    @property
    def cost(self) -> list[int]:
        return [round(x * PS) for x in self.seconds]


def solution_of(prob: Problem, layer: Layer, choice: Sequence[int]) -> Solution:
    """`layer`'s problem `prob` with strategy index `choice` per group."""
    names = prob.names(choice)
    return Solution(prob.objective(choice), prob.memory_of(choice), prob.breakdown(choice),
                     tuple(names.get(n, "") for n in layer.nodes))


def result_of(tp: int, layers: list[Layer], keys: list[tuple], sols: dict[tuple, Solution]) -> IntraOpResult:
    """The `IntraOpResult` of `layers`, layer i solved as `sols[keys[i]]`."""
    total = Cost()
    names: dict[str, str] = {}
    for layer, k in zip(layers, keys, strict=True):
        total.add(sols[k].cost)
        names.update((n, s) for n, s in zip(layer.nodes, sols[k].names, strict=True) if s)
    return IntraOpResult(tp, total.compute_fwd + total.comm_fwd, total.compute_bwd + total.comm_bwd,
                         total.comm_fwd + total.comm_bwd, total.param_bytes, total.act_bytes, names,
                         total.comm_fwd, total.comm_bwd)


__all__ = ["PS", "Cost", "Group", "IntraOpResult", "NodeStrategy", "Problem", "Shared", "Solution", "result_of",
           "solution_of"]
