"""Plan rewrites for a job whose devices changed: a batch split in proportion to weights (`proportional`),
a plan keeping some pipelines with new shares, renumbered onto the devices that remain (`with_shares`),
the plan without lost devices (`without`, and `unsupported`: why a lost rank's state cannot be carried
over), and a rewritten plan re-simulated from the old one's stage times (`simulated`). Re-routing around a
lost rank (runtime/reroute.py) and shedding a straggler's share (runtime/straggler.py) run what these
return; they are the planner's part of those modes and import nothing of the runtime.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..cluster import Cluster
from ..cost_models.compute import ComputeModel, Profile
from ..errors import PlanError
from ..ir.plan import Pipeline, Plan, even_split


def proportional(total: int, weights: list[float], minimum: list[int] | None = None) -> list[int]:
    """`total` split in proportion to `weights` (largest remainders, ties to the first), every part at least
    its `minimum` (default 1: a pipeline kept in the plan runs at least one sample)."""
    low = minimum or [1] * len(weights)
    if not weights or total < sum(low) or any(w <= 0 for w in weights):
        raise PlanError(f"cannot split {total} samples over {len(weights)} pipelines with weights {weights}: "
                        f"each pipeline needs at least {low} samples and a positive weight.")
    exact = [total * w / sum(weights) for w in weights]
    parts = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (parts[i] - exact[i], i))
    for i in order[:total - sum(parts)]:
        parts[i] += 1
    for i in range(len(parts)):
        while parts[i] < low[i]:  # from the part furthest above its own minimum
            parts[i] += 1
            parts[max(range(len(parts)), key=lambda j: (parts[j] - low[j], -j))] -= 1
    return parts


def with_shares(plan: Plan, shares: dict[int, int], devices: list[int] | None = None) -> Plan:
    """A copy of `plan` keeping the pipelines in `shares` (pipeline index -> its new batch share), each cut
    into micro-batches of at most its old micro-batch size. With `devices` (the devices that remain, in the
    order of their new indices) the plan is renumbered onto them and its cluster cut to them. Predictions
    are cleared: price the result (`ReroutingProgram` does)."""
    if sum(shares.values()) != plan.global_batch:
        raise PlanError(f"batch shares {shares} do not sum to the global batch {plan.global_batch}.")
    index = {d: i for i, d in enumerate(devices)} if devices is not None else None
    pipes = []
    for i in sorted(shares):
        p, share = plan.pipelines[i], shares[i]
        groups = len(p.stages) // plan.chunks
        m = max(1, math.ceil(share / max(1, p.microbatch_size)))
        if plan.chunks > 1:  # interleaved schedules run whole rounds of micro-batches
            m = math.ceil(m / groups) * groups
            if m > share:
                raise PlanError(f"pipeline {i} would get {share} samples, fewer than its {groups} stage groups "
                                f"need under {plan.schedule}.")
        stages = [replace(st, devices=[index[d] for d in st.devices] if index else list(st.devices),
                          predicted={}) for st in p.stages]
        pipes.append(Pipeline(share, max(even_split(share, m)), m, stages))
    cluster = plan.cluster if devices is None else \
        Cluster.load(plan.cluster).subset(devices, name=f"{plan.cluster.get('name', 'cluster')}"
                                                         f"[{','.join(map(str, devices))}]").to_dict()
    return replace(plan, pipelines=pipes, cluster=cluster, predicted={})


def lost_pipelines(plan: Plan, lost: set[int]) -> list[int]:
    return [i for i, p in enumerate(plan.pipelines) if any(d in lost for st in p.stages for d in st.devices)]


def unsupported(plan: Plan) -> str | None:
    """Why a rank lost under `plan` cannot be re-routed (its state would be lost), or None. Tensor parallelism
    is re-routed: every data-parallel replica of a stage holds the same layers with its own tensor-parallel
    group's shards, so a surviving pipeline keeps its shards (a pipeline-only or single-replica tp job has no
    such peer and is refused by `without`)."""
    if plan.experts:
        return "expert parallelism spreads the experts' state over the replicas"
    if plan.graph:
        return "graph programs are not re-routed"
    for p in plan.pipelines:
        for st in p.stages:
            if st.zero > 0:
                return (f"ZeRO-{st.zero} partitions the optimizer state{' and gradients' if st.zero > 1 else ''}"
                        f"{' and parameters' if st.zero > 2 else ''} across the data-parallel replicas, so the "
                        f"lost rank's partition exists nowhere else; plan with zero=0 (e.g. "
                        f"Strategy(..., zero=0)) for a job that survives a lost rank, or restart from the last "
                        f"checkpoint (`autopar run --max-restarts K` with autopar.compiler.train)")
    return None


def without(plan: Plan, lost: set[int]) -> tuple[Plan | None, str]:
    """The plan on the devices that remain when `lost` devices are gone: every pipeline that lost a device is
    dropped and its batch share spread over the surviving pipelines in proportion to their shares; devices
    renumbered in order. (None, why) when no pipeline survives whole or the state cannot be carried over."""
    why = unsupported(plan)
    if why:
        return None, why
    dropped = set(lost_pipelines(plan, lost))
    keep = [i for i in range(len(plan.pipelines)) if i not in dropped]
    if not keep:
        return None, (f"no data-parallel peer holds the lost rank's layers (every one of the plan's "
                      f"{len(plan.pipelines)} pipeline(s) lost a device)")
    shares = proportional(plan.global_batch, [float(plan.pipelines[i].batch_share) for i in keep])
    world = Cluster.load(plan.cluster).world_size
    return with_shares(plan, dict(zip(keep, shares, strict=True)),
                       [d for d in range(world) if d not in lost]), ""


def simulated(plan: Plan, old: Plan) -> Plan:
    """`plan` with its stage times taken from `old` (same stages, same micro-batch size: same per-micro-batch
    times) and its step re-simulated; the fallback pricing when no cost model is at hand."""
    by_layers = {tuple(st.layers): st.predicted for p in old.pipelines for st in p.stages}
    for p in plan.pipelines:
        for st in p.stages:
            st.predicted = dict(by_layers.get(tuple(st.layers), {}))
    if not all(st.predicted for p in plan.pipelines for st in p.stages):
        return plan
    step = max(r.step_time for r in plan.simulate())
    plan.predicted = {"step_time_s": step, "samples_per_s": plan.global_batch / step,
                      "priced": "re-simulated from the previous plan's stage times"}
    return plan


def shed_plan(plan: Plan | None, measured: dict[int, float]) -> Plan | None:
    """`plan` with every pipeline's batch share in proportion to its measured speed (share / the compute
    seconds per step of its slowest rank; `measured`: rank -> compute seconds per step, the straggler
    report's), the same global batch; its step re-simulated from the old stage times (same micro-batch size).
    None when there is nothing to shed to (one pipeline, experts, graph programs), nothing changes, or a
    share cannot run whole rounds of the old micro-batch size under an interleaved schedule (the caller
    re-plans instead)."""
    if plan is None or len(plan.pipelines) < 2 or plan.experts or plan.graph:
        return None
    speeds = []
    for p in plan.pipelines:
        slowest = max(measured.get(d, 0.0) for st in p.stages for d in st.devices)
        if slowest <= 0:
            return None
        speeds.append(p.batch_share / slowest)
    # an interleaved schedule runs whole rounds: each pipeline at least one sample per stage group
    low = [len(p.stages) // plan.chunks if plan.chunks > 1 else 1 for p in plan.pipelines]
    shares = proportional(plan.global_batch, speeds, low)
    if shares == [p.batch_share for p in plan.pipelines]:
        return None
    try:
        shed = with_shares(plan, dict(enumerate(shares)))
    except PlanError:  # with_shares' only refusal here: an interleaved share too small for whole rounds
        return None
    return simulated(shed, plan)


def scaled_cluster(cluster: Cluster, slowdown: dict[int, float]) -> Cluster:
    """`cluster` with device i `slowdown[i]` times slower, as its own device type.

    A cluster file gives each node one device type, so a node holding a scaled device is split into runs
    of alike devices; on a single-node cluster the network between the pieces is set to the node's own
    link so that communication is priced as before (with several nodes, traffic between the pieces of a
    split node is priced at the network's speed: the planner then avoids tensor parallelism across it).
    """
    specs = []
    for d in cluster.devices:
        f = slowdown.get(d.index, 1.0)
        if f <= 1.0:
            specs.append(d.spec)
            continue
        specs.append(replace(d.spec, name=scaled_name(d.spec.name, f),
                             peak_flops={k: v / f for k, v in d.spec.peak_flops.items()},
                             memory_bandwidth=d.spec.memory_bandwidth / f))
    groups: list[dict] = []
    for node in cluster.nodes:
        run: list[int] = []
        for i in node.devices + (-1,):
            if run and (i < 0 or specs[i] != specs[run[0]]):
                groups.append({"device": specs[run[0]].to_dict(), "devices_per_node": len(run), "count": 1,
                               "intra_node": node.intra_node.to_dict()})
                run = []
            if i >= 0:
                run.append(i)
    network = cluster.nodes[0].intra_node if len(cluster.nodes) == 1 else cluster.network
    return Cluster.load({"name": f"{cluster.name}-measured", "nodes": groups, "network": network.to_dict()})


def scaled_name(base: str, factor: float) -> str:
    return f"{base}~{factor:.2g}x-slower"


def _slower(curve: dict, f: float) -> dict:
    """A compute curve (compute.py's module docstring) of a device `f` times slower: its per-kernel overhead
    and the seconds at which an op reaches half its efficiency (`half_s`, against a peak divided by f) times f,
    in every nested curve (flop, bw, flop_by_dtype)."""
    return {k: v * f if k in ("overhead_s", "half_s") and isinstance(v, (int, float)) else
            _slower(v, f) if isinstance(v, dict) else v for k, v in curve.items()}


def scaled_profiles(base: Cluster, slowdown: dict[int, float], profiles: dict[str, Profile] | None = None
                    ) -> dict[str, Profile]:
    """The compute profiles to plan `scaled_cluster(base, slowdown)` with (`plan(..., profiles=)`): each scaled
    device type gets its base type's profile (`profiles`' where given, else the one ComputeModel would use:
    the saved profile or the type's defaults) with peak and bandwidth divided by the factor, and multiplied
    by it the per-kernel overheads, the sizes' half-efficiency times (`_slower`) and the host seconds per
    framework event of a forward and backward (view, module call, autograd node, micro-batch: overhead.py).
    So small, overhead- and host-bound ops slow down too: a rank measured f times slower at its forward and
    backward is priced f times slower at them (the optimizer step's host figures are kept). The types that
    are not scaled keep `profiles`' entries where the scaled cluster still has them (the others their saved
    ones)."""
    profiles = profiles or {}
    # the types scaled_cluster keeps: those with a device left unscaled
    kept = {d.spec.name for d in base.devices if slowdown.get(d.index, 1.0) <= 1.0}
    out = {name: p for name, p in profiles.items() if name in kept}
    for i, f in slowdown.items():
        if f <= 1.0:
            continue
        spec = base.devices[i].spec
        model = ComputeModel(spec, profiles.get(spec.name))  # the profile and host figures priced unscaled
        prof, host = model.profile, model.host
        curves = {k: _slower(c, f) for k, c in prof.curves.items()}
        host = replace(host, kernel_s=host.kernel_s * f, view_s=host.view_s * f, module_s=host.module_s * f,
                       autograd_node_s=host.autograd_node_s * f, microbatch_s=host.microbatch_s * f)
        scaled = replace(prof, device=scaled_name(spec.name, f), curves=curves, overhead_s=prof.overhead_s * f,
                         peak_flops=prof.peak_flops / f if prof.peak_flops else None,
                         memory_bandwidth=prof.memory_bandwidth / f if prof.memory_bandwidth else None,
                         meta={**prof.meta, "framework": host.to_meta(), "scaled_from": spec.name, "slowdown": f})
        out[scaled.device] = scaled
    return out


__all__ = ["lost_pipelines", "proportional", "scaled_cluster", "scaled_name", "scaled_profiles", "shed_plan",
           "simulated", "unsupported", "with_shares", "without"]
