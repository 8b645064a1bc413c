"""Why the search found no plan, in words, with the numbers and what would fix it.

Two different reasons (`message`):
  layout  no way to place every device: each device runs in exactly one stage of one data-parallel
          replica, so world = replicas x stages x tp, with at most one replica per sample of the global
          batch, at most one stage per layer of the chain, tp dividing every node's device count (tp stays
          in a node) and, on several device types, replicas holding equal slices of every type ("mixed")
          or pipelines of one type ("by-type"); `configs.layouts` (with `experts.config_ok`) is the rule,
          checked here on the same code. Memory plays no part, so the message never blames it;
          it names the smallest global batch (and layer count) that would allow a layout and a subset of
          the cluster that can be planned on as it is.
  memory  layouts exist but no stage option fits a device's memory (or its node's host memory): what the
          splitter recorded as the stage nearest to fitting (`split.Splitter.closest`, `closest_host`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ...cluster import Cluster
from ...report import fmt_bytes
from ..pricing import experts
from ..pricing.plan import offload_host_bytes
from . import configs


class _Shape(NamedTuple):
    """What the layout enumeration reads of a cost model, so other batches, depths and clusters can be asked."""

    cluster: Cluster
    B: int
    L: int
    expert_parallel: experts.ExpertParallel


def layouts(cm: Any, cluster: Cluster | None = None, B: int | None = None, L: int | None = None
            ) -> list[tuple[int, str, tuple]]:
    """(tp, grouping, pipelines) the search would enumerate on `cluster` with global batch B and L layers
    (default: the cost model's own), whatever memory says."""
    return configs.layouts(_Shape(cluster or cm.cluster, B or cm.B, L or cm.L, cm.expert_parallel))


def _ranges(idx: list[int]) -> str:
    """[0, 1, 2, 5] -> '*range(0, 3), 5' as the argument list of a Python list."""
    out, start = [], 0
    for k in range(1, len(idx) + 1):
        if k == len(idx) or idx[k] != idx[k - 1] + 1:
            run = idx[start:k]
            out.append(str(run[0]) if len(run) == 1 else f"*range({run[0]}, {run[-1] + 1})")
            start = k
    return ", ".join(out)


def _nodes_text(cluster: Cluster, nodes: list[int]) -> str:
    counts: dict[tuple[int, str], int] = {}
    for k in nodes:
        n = cluster.nodes[k]
        key = (len(n.devices), cluster.devices[n.devices[0]].spec.name)
        counts[key] = counts.get(key, 0) + 1
    return "+".join(f"{c}x{per}x{name}" for (per, name), c in counts.items())


def _best_subset(cm: Any) -> tuple[list[int], list[int]] | None:
    """Whole nodes of the cluster that can be planned on as they are (a layout exists), the most peak
    FLOP/s first: candidates are one device type's nodes, and the first k nodes in file order and in
    speed order. (node indices, device indices), or None if no candidate has a layout."""
    cluster = cm.cluster
    speed = [sum(cluster.devices[i].spec.flops(cm.precision) for i in n.devices) for n in cluster.nodes]
    by_type: dict[str, list[int]] = {}
    for n in cluster.nodes:
        by_type.setdefault(cluster.devices[n.devices[0]].spec.name, []).append(n.index)
    fastest = sorted(range(len(cluster.nodes)), key=lambda k: -speed[k])
    cands = list(by_type.values()) + [list(range(k)) for k in range(1, len(cluster.nodes))]
    cands += [sorted(fastest[:k]) for k in range(1, len(cluster.nodes))]
    best = None
    for nodes in cands:
        devices = [i for k in nodes for i in cluster.nodes[k].devices]
        if len(devices) == cluster.world_size or not layouts(cm, cluster=cluster.subset(devices)):
            continue
        key = (sum(speed[k] for k in nodes), -len(devices))
        if best is None or key > best[0]:
            best = (key, nodes, devices)
    return None if best is None else (best[1], best[2])


def _why_not(cm: Any, t: int) -> str:
    """Why tp=t has no layout: each replicas x stages factorisation of the tp groups and what breaks it."""
    shape = _Shape(cm.cluster, cm.B, cm.L, cm.expert_parallel)
    U = cm.cluster.world_size // t
    types = len(cm.cluster.device_types())
    parts = []
    for D in configs.divisors(U):
        p = U // D
        if D > cm.B:
            why = f"{D} replicas > batch {cm.B}"
        elif p > cm.L:
            why = f"{p} stages > {cm.L} layers"
        elif not any(len(pipes) == D for _, pipes in configs.groupings(shape, configs.tp_units(shape, t))):
            why = (f"the {types} device types do not split into {D} replicas with equal slices of each or "
                   f"into {p}-stage pipelines of one type")
        else:
            ep = shape.expert_parallel.degree
            why = f"expert parallelism ep={ep} needs groups of {ep} identical replicas"
        parts.append(f"{D}x{p} ({why})")
    return f"tp={t}: {U} group(s) as replicas x stages = " + ", ".join(parts)


def layout_message(cm: Any) -> str:
    """No layout covers the cluster (see the module docstring): the constraint, the numbers, the fixes."""
    cluster, W = cm.cluster, cm.cluster.world_size
    degrees = configs.tp_degrees(cluster)
    state = cm.graph.num_params() * cm.state.total
    msg = (f"no parallel layout uses all {W} devices of {cluster.describe()}; memory is not the constraint "
           f"(the training state is {fmt_bytes(state)}). Every device must run one stage of one data-parallel "
           f"replica: {W} devices = replicas x stages x tp, with at most {cm.B} replica(s) (one sample of the "
           f"global batch of {cm.B} each), at most {cm.L} stages per replica (one layer of the model's {cm.L} "
           f"at least each), tp dividing every node's device count ({', '.join(map(str, degrees))}) or, "
           f"on several device types, one per type (dividing its nodes' device counts, within a factor 2 of "
           f"the others), and, on several device types, replicas holding equal slices of every type or "
           f"pipelines of one type. "
           + "; ".join(_why_not(cm, t) for t in degrees) + ".")
    return msg + " To plan: " + "; or ".join(layout_fixes(cm)) + "."


def layout_fixes(cm: Any, subset: bool = True) -> list[str]:
    """What would give the whole cluster a layout: the least larger global batch, the least deeper chain and
    (`subset`) a subset of whole nodes that has one, each that exists, in words."""
    W, fixes = cm.cluster.world_size, []
    batch = next((b for b in range(cm.B + 1, W + 1) if layouts(cm, B=b)), None)
    if batch is not None:
        fixes.append(f"raise the global batch to at least {batch} samples")
    depth = next((n for n in range(cm.L + 1, W + 1) if layouts(cm, L=n)), None)
    if depth is not None:
        fixes.append(f"plan a deeper model (at least {depth} layers in its chain)")
    sub = _best_subset(cm) if subset else None
    if sub is not None:
        nodes, devices = sub
        fixes.append(f"plan on a subset of the cluster, e.g. its {_nodes_text(cm.cluster, nodes)} nodes: "
                     f"cluster.subset([{_ranges(devices)}]) (or a smaller cluster file)")
    return fixes


def least_state_bytes(cm: Any) -> float:
    """The fewest bytes the training state takes wherever it is kept: every parameter's state lives on a device
    (state.total bytes) or, offloaded, on its host (the optimizer's fp32 copy, its gradient and moments)."""
    host_per_param = offload_host_bytes(cm.optimizer, cm.state.weights, 1.0, 1.0, 0, ("optimizer", "params"))
    return cm.graph.num_params() * min(cm.state.total, host_per_param)


def memory_message(cm: Any, splitter: Any) -> str:
    """What does not fit, device or host memory, with the bytes needed and what would fix it."""
    devices, nodes = cm.cluster.devices, cm.cluster.nodes
    P = cm.graph.num_params()
    state = P * cm.state.total
    total = sum(d.spec.memory for d in devices)
    host_total = sum(n.host_memory for n in nodes)
    per_sample = sum(cm.saved) / cm.B
    msg = (f"no plan fits in memory on {cm.cluster.describe()}. The training state alone "
           f"({P:,} parameters x {cm.state.total} bytes for {cm.optimizer} in "
           f"{cm.precision}) is {fmt_bytes(state)}; the cluster has {fmt_bytes(total)} of device memory "
           f"in all ({fmt_bytes(total * (1 - cm.reserve))} usable with the {100 * cm.reserve:.0f}% "
           f"reserve) and {fmt_bytes(host_total)} of host memory in its {len(nodes)} node(s) "
           f"({fmt_bytes(host_total * (1 - cm.reserve))} usable).")
    host_per_param = offload_host_bytes(cm.optimizer, cm.state.weights, 1.0, 1.0, 0, ("optimizer", "params"))
    least = least_state_bytes(cm)
    dev, host = splitter.closest, splitter.closest_host
    fixes = []
    if least > (total + host_total) * (1 - cm.reserve):
        W = len(devices)
        per_node = "; ".join(
            f"node {n.index} ({len(n.devices)} device(s)): {fmt_bytes(P * host_per_param * len(n.devices) / W)}"
            f" needed, has {fmt_bytes(n.host_memory)}" for n in nodes[:4]) + ("; ..." if len(nodes) > 4 else "")
        msg += (f" Wherever it is kept (on a device, or offloaded to the host at {host_per_param:g} bytes per "
                f"parameter: the optimizer's fp32 copy, its gradient and moments), it needs at least "
                f"{fmt_bytes(least)}, more than the cluster's device and host memory together. With the "
                f"model spread over all {W} devices and everything offloaded, host memory per node: "
                f"{per_node}.")
        fixes.append(f"give the nodes more host memory (at least {fmt_bytes(least / (1 - cm.reserve))} "
                     f"across the cluster, host_memory_GiB in the cluster file)")
    elif dev is not None and dev.need > dev.budget:
        msg += (f" Even with ZeRO-3 across replicas, recompute, CPU offload and micro-batches of one "
                f"sample, a {dev.dtype} needs at least {fmt_bytes(dev.need)} for its share but has "
                f"{fmt_bytes(dev.budget)} usable (with {_option_text(dev.option)}, which also keeps "
                f"{fmt_bytes(dev.host)} in host memory).")
        fixes.append(f"use devices with at least {fmt_bytes(dev.need / (1 - cm.reserve))} of memory")
    elif dev is None:
        fixes.append("use devices with more memory")
    if host is not None and not fixes:
        k = devices[host.device].node
        n_dev = len(nodes[k].devices)
        node_need = host.host * n_dev / (1 - cm.reserve)
        msg += (f" Host memory is what does not fit: layers {host.layers[0]}-{host.layers[1] - 1} on a "
                f"{host.dtype} fit its memory with {_option_text(host.option)} ({fmt_bytes(host.need)} of "
                f"{fmt_bytes(host.budget)} usable) but keep {fmt_bytes(host.host)} in host memory (offloaded "
                f"optimizer state, parameter copies and activations), more than its share of node {k}'s: "
                f"{fmt_bytes(host.host_budget)} usable ({fmt_bytes(nodes[k].host_memory)} for {n_dev} "
                f"device(s)). With such stages on all its devices, node {k} would need at least "
                f"{fmt_bytes(node_need)} of host memory.")
        fixes.append(f"give the nodes more host memory (host_memory_GiB >= {node_need / 2**30:.4g} in the "
                     f"cluster file, where the machines have it)")
    return msg + (f" To fit: {', '.join(fixes)}, add devices (pipeline and tensor parallelism split the "
                  f"model further), or lower the global batch or sequence length (activations take "
                  f"{fmt_bytes(per_sample)} per sample).")


def message(cm: Any, splitter: Any) -> str:
    """The InfeasibleError text of a search on `cm` that found no plan (see the module docstring)."""
    if not layouts(cm):
        return layout_message(cm)
    return memory_message(cm, splitter)


def _option_text(opt: object) -> str:
    zero, recompute, offload = opt  # type: ignore[misc]
    parts = [f"ZeRO-{zero}" if zero else "no ZeRO", "recompute" if recompute else "no recompute",
             "offload " + "+".join(offload) if offload else "no offload"]
    return ", ".join(parts)


__all__ = ["layout_fixes", "layout_message", "layouts", "least_state_bytes", "memory_message", "message"]
