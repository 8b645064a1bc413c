"""The search's outer candidates (search.py's "Outer" paragraph): tensor-parallel groups, groupings of them
into pipelines (one degree for all, or one per device type: `mixed_tp_layouts`), schedules and micro-batch
sizes. Pure functions of the cost model; `search.Search._configs` combines them into configs."""

from __future__ import annotations

import itertools
import math
from typing import Any

from ..pricing import context, experts
from ..pricing.pricing import CostModel
from ..split.split import Unit

CHUNKS = (2, 4)
MICROBATCH_ENUMERATION = 32  # batch shares up to which every micro-batch size is tried
# device types up to which pipelines spanning types ("mixed" groupings) also get a tp per type: with more,
# the degree assignments multiply the configs (a 3-type cluster: 4x), so only by-type pipelines get them
MIXED_TP_SPAN_TYPES = 2


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_degrees(cluster: Any) -> list[int]:
    """The plan-wide tensor-parallel degrees: those dividing every node's device count (tp stays in a node)."""
    gcd = 0
    for node in cluster.nodes:
        gcd = math.gcd(gcd, len(node.devices))
    return divisors(gcd)


def layouts(cm: Any) -> list[tuple[int, str, tuple[tuple[Unit, ...], ...]]]:
    """Every (tp, grouping name, pipelines) the search enumerates, whatever memory says: one degree for the
    plan (`tp_degrees`) or one per device type (`mixed_tp_layouts`), each grouping the experts admit
    (`experts.config_ok`). `cm`: a cost model, or any object with its cluster, B, L and expert_parallel
    (infeasible.py asks about other batches, depths and clusters)."""
    cp = context.degree(cm)
    if cp > 1:  # context parallelism: units of cp tensor-parallel groups, one degree for the plan
        return [(t, name, pipes) for t in tp_degrees(cm.cluster) for name, pipes in groupings(cm, cp_units(cm, t, cp))]
    uniform = [(t, name, pipes) for t in tp_degrees(cm.cluster) for name, pipes in groupings(cm, tp_units(cm, t))]
    return [(t, name, pipes) for t, name, pipes in uniform + mixed_tp_layouts(cm) if experts.config_ok(cm, t, pipes)]


def tp_units(cm: CostModel, t: int) -> list[Unit]:
    """The tensor-parallel groups of degree t: consecutive devices of one node."""
    return [tuple(node.devices[i:i + t]) for node in cm.cluster.nodes for i in range(0, len(node.devices), t)]


def cp_units(cm: Any, t: int, cp: int) -> list[Unit]:
    """The stage device groups of a context-parallel search: cp tensor-parallel groups of degree t, consecutive
    devices (tp fastest, then cp, as `Stage.cp_groups` reads them): inside each node where cp t divides every
    node's device count, else spanning consecutive whole nodes of one device type where every node has the same
    count k and cp t is a multiple of it (a cp ring across nodes); none otherwise."""
    width = cp * t
    nodes = cm.cluster.nodes
    if all(len(node.devices) % width == 0 for node in nodes):
        return [tuple(node.devices[i:i + width]) for node in nodes for i in range(0, len(node.devices), width)]
    k = len(nodes[0].devices)
    if any(len(node.devices) != k for node in nodes) or width % k or len(nodes) % (width // k):
        return []
    span = width // k
    units = []
    for i in range(0, len(nodes), span):
        devices = [d for node in nodes[i:i + span] for d in node.devices]
        if len({cm.cluster.devices[d].spec.name for d in devices}) > 1:
            return []
        units.append(tuple(devices))
    return units


def groupings(cm: CostModel, units: list[Unit]) -> list[tuple[str, tuple[tuple[Unit, ...], ...]]]:
    by_type: dict[str, list[Unit]] = {}
    for u in units:
        by_type.setdefault(cm.cluster.devices[u[0]].spec.name, []).append(u)
    U, out = len(units), []
    for D in divisors(U):
        p = U // D
        if p > cm.L or D > cm.B:
            continue
        if len(by_type) == 1:
            out.append(("stage-major", tuple(tuple(units[s * D + d] for s in range(p)) for d in range(D))))
            if D > 1 and p > 1:
                out.append(("replica-major", tuple(tuple(units[d * p:(d + 1) * p]) for d in range(D))))
            continue
        if all(len(us) % D == 0 for us in by_type.values()):
            # the types in cluster order, and reversed (which device type runs the first stages matters
            # when memory differs: the first stages hold the most in-flight activations)
            types = list(by_type.values())
            for name, order in (("mixed", types), ("mixed-reversed", types[::-1])):
                out.append((name, tuple(tuple(u for us in order for u in us[d * len(us) // D:(d + 1) * len(us) // D])
                                        for d in range(D))))
        if all(len(us) % p == 0 for us in by_type.values()):
            out.append(("by-type", tuple(tuple(us[k * p:(k + 1) * p]) for us in by_type.values()
                                         for k in range(len(us) // p))))
    return out


def mixed_tp_layouts(cm: Any) -> list[tuple[int, str, tuple[tuple[Unit, ...], ...]]]:
    """Groupings with a tensor-parallel degree per device type, for clusters of several types (one type per
    node): every assignment of a degree to each type (dividing each of its nodes' device counts) with the
    largest at most twice the smallest and not one degree for all (`tp_units` covers those), on by-type
    pipelines (a tp per pipeline class) and, with at most MIXED_TP_SPAN_TYPES types, on pipelines spanning
    types too. (max degree, name, pipelines) each; none for expert-parallel models (their expert groups
    assume one degree). `cm`: a cost model, or what infeasible.py's layout enumeration passes (cluster, B,
    L, expert_parallel)."""
    if experts.degree(cm) > 1:
        return []
    counts: dict[str, int] = {}
    for node in cm.cluster.nodes:
        kinds = {cm.cluster.devices[d].spec.name for d in node.devices}
        if len(kinds) > 1:
            return []  # a node of several types: its tp groups would not be of one type
        for name in kinds:
            counts[name] = math.gcd(counts.get(name, 0), len(node.devices))
    if len(counts) < 2:
        return []
    names = list(counts)  # cluster order
    out = []
    for degrees in itertools.product(*(divisors(counts[k]) for k in names)):
        if len(set(degrees)) == 1 or max(degrees) > 2 * min(degrees):
            continue
        tp = dict(zip(names, degrees, strict=True))
        units = [tuple(node.devices[i:i + tp[cm.cluster.devices[node.devices[0]].spec.name]])
                 for node in cm.cluster.nodes
                 for i in range(0, len(node.devices), tp[cm.cluster.devices[node.devices[0]].spec.name])]
        label = ",".join(f"{k}:{tp[k]}" for k in names)
        out += [(max(degrees), f"{name} tp={label}", pipes) for name, pipes in groupings(cm, units)
                if name == "by-type" or len(names) <= MIXED_TP_SPAN_TYPES]
    return out


def microbatch_sizes(share: int) -> list[int]:
    """Candidate micro-batch sizes b; a replica then runs the fewest micro-batches of at most b samples.
    Up to MICROBATCH_ENUMERATION samples every size giving a distinct micro-batch count, else powers of two."""
    if share <= MICROBATCH_ENUMERATION:
        return sorted({-(-share // m) for m in range(1, share + 1)})
    sizes = [1 << k for k in range(share.bit_length()) if (1 << k) < share]
    return sizes + [share]


def config_microbatch_sizes(cm: CostModel, pipes: tuple[tuple[Unit, ...], ...]) -> list[int]:
    """The micro-batch sizes b the search tries on one grouping (one b shared by its pipelines). Replicas
    of one kind get even shares, so b up to that share; replicas that differ may get uneven shares, so
    when that is at most MICROBATCH_ENUMERATION, every size up to the largest share one can take (a smaller
    share then runs as one micro-batch of itself, so each replica can have its own micro-batch count);
    beyond that (large batches: planning time) the sizes of the even share."""
    kinds = {tuple(cm.cluster.devices[u[0]].spec.name for u in pipe) for pipe in pipes}
    top = cm.B - (len(pipes) - 1)
    if len(kinds) == 1 or top > MICROBATCH_ENUMERATION:
        return microbatch_sizes(-(-cm.B // len(pipes)))
    return list(range(1, top + 1))


def schedules(p: int, L: int) -> list[tuple[str, int]]:
    if p == 1:
        return [("1f1b", 1)]
    return [("gpipe", 1), ("1f1b", 1), ("zb_h1", 1)] + [("interleaved_1f1b", v) for v in CHUNKS if p * v <= L]


def microbatch_count(share: int, b: int, ranks: int, schedule: str) -> int | None:
    m = -(-share // b)
    if schedule == "interleaved_1f1b" and m % ranks:
        m += ranks - m % ranks
    return m if m <= share else None


__all__ = ["CHUNKS", "MICROBATCH_ENUMERATION", "MIXED_TP_SPAN_TYPES", "config_microbatch_sizes", "cp_units", "divisors",
           "groupings", "layouts", "microbatch_count", "microbatch_sizes", "mixed_tp_layouts", "schedules",
           "tp_degrees", "tp_units"]
