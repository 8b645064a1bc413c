"""What a plan puts where, as the views show it: the labels `explain()` prints (`ranges`, `recompute_label`,
`layer_label`), each device's role (`device_roles`: its pipeline, stages, layers and share, or why it idles),
each device's memory figures (`device_memory`) and the simulated step as Gantt bars (`gantt`).

Everything here reads only what a `Plan` carries (its stages, `predicted`, the embedded cluster), and the
timeline is `Plan.simulate()`'s, the simulator `timeline()` uses: the HTML report (html_report.py), the picture
(plot.py) and the diff (diff.py) show the same figures as the text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import PlanError

if TYPE_CHECKING:
    from ..ir.plan import Plan

# what the memory bars split a device's peak into, when the plan itemizes it: `predicted[MEMORY_PARTS]` maps
# a device to bytes per part (parts the plan does not give are left out; the rest of the peak is "other")
MEMORY_PARTS = "peak_memory_parts_bytes"
PART_ORDER = ("parameters", "gradients", "optimizer state", "activations", "buffers")


def recompute_label(recompute: bool | int) -> str:
    """The `explain()` cell of a stage's recompute: yes, no, or 'first k'."""
    if isinstance(recompute, bool) or not recompute:
        return "yes" if recompute else "no"
    return f"first {recompute}"


def ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    out: list[str] = []
    xs = sorted(xs)
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def layer_label(plan: Plan, start: int, end: int) -> str:
    """Layers [start, end) of the coarse chain by name ('blocks.1..post (3)'), or by index without names."""
    names = plan.model.get("layer_names") or []
    if len(names) < end:
        return f"{start}-{end - 1}" if end - start > 1 else str(start)
    return names[start] if end - start == 1 else f"{names[start]}..{names[end - 1]} ({end - start})"


@dataclass
class StageRole:
    """One stage a device computes."""

    pipeline: int
    stage: int
    layers: tuple[int, int]  # [start, end) of the coarse chain
    label: str  # layer_label
    tp: int
    tp_group: list[int]
    zero: int
    recompute: str  # recompute_label
    offload: list[str]
    compress: str | None
    cp: int = 1  # context-parallel degree: tp_group is this device's own group among the stage's cp groups


@dataclass
class DeviceRole:
    """What a plan gives one device of its cluster: stages and a batch share, or nothing and why."""

    device: int
    type: str
    node: int  # index of the cluster node holding it (Plan.cluster's node groups, expanded)
    stages: list[StageRole] = field(default_factory=list)
    batch_share: int = 0  # samples per step of its pipeline (0: idle)
    microbatches: tuple[int, int] = (0, 0)  # (count, largest size)
    idle_why: str | None = None  # predicted["idle_devices"][device], or a plain reason when the plan gives none


def node_of_devices(plan: Plan) -> dict[int, int]:
    """Device index -> node index, from the embedded cluster description (file order, as Cluster.load numbers)."""
    out: dict[int, int] = {}
    node = 0
    for group in plan.cluster["nodes"]:
        for _ in range(group.get("count", 1)):
            for _ in range(group.get("devices_per_node", 1)):
                out[len(out)] = node
            node += 1
    return out


def device_roles(plan: Plan) -> list[DeviceRole]:
    """Every device of the plan's cluster, in index order, with what the plan runs on it."""
    names = plan.device_names()
    nodes = node_of_devices(plan)
    roles = {d: DeviceRole(d, names[d], nodes.get(d, 0)) for d in names}
    for i, pipe in enumerate(plan.pipelines):
        for j, s in enumerate(pipe.stages):
            for d in s.devices:
                role = roles.setdefault(d, DeviceRole(d, names.get(d, "?"), nodes.get(d, 0)))
                group = next(g for g in s.cp_groups() if d in g)
                role.stages.append(StageRole(i, j, (s.layers[0], s.layers[1]), layer_label(plan, *s.layers), s.tp,
                                             group, s.zero, recompute_label(s.recompute),
                                             list(s.offload), s.compress, s.cp))
                role.batch_share = pipe.batch_share
                role.microbatches = (pipe.num_microbatches, pipe.microbatch_size)
    idle = {int(d): why for d, why in (plan.predicted.get("idle_devices") or {}).items()}
    for d, role in roles.items():
        if not role.stages:
            role.idle_why = idle.get(d, "the plan gives it no stage and no batch share")
    return [roles[d] for d in sorted(roles)]


@dataclass
class DeviceMemory:
    """A device's predicted peak against its capacity (bytes), as `explain()` prints it."""

    device: int
    peak: int
    capacity: int
    usable: int  # capacity less the plan's memory reserve
    parts: dict[str, int]  # predicted[MEMORY_PARTS][device] in PART_ORDER first; {} when the plan has none


def device_memory(plan: Plan) -> list[DeviceMemory]:
    """Each device the plan gives a peak (`predicted["peak_memory_bytes"]`), in index order."""
    pr = plan.predicted
    peak = {int(d): int(b) for d, b in (pr.get("peak_memory_bytes") or {}).items()}
    cap = {int(d): int(b) for d, b in (pr.get("memory_capacity_bytes") or {}).items()}
    all_parts = {int(d): v for d, v in (pr.get(MEMORY_PARTS) or {}).items()}
    out = []
    for d in sorted(peak):
        given = all_parts.get(d) or {}
        parts = {k: int(given[k]) for k in PART_ORDER if k in given}
        parts.update({k: int(v) for k, v in given.items() if k not in parts})
        capacity = cap.get(d, 0)
        out.append(DeviceMemory(d, peak[d], capacity, int(capacity * (1 - plan.memory_reserve)), parts))
    return out


@dataclass
class Bar:
    """One action of the simulated step: on `stream` of pipeline rank `rank`, [start, end) seconds."""

    rank: int  # pipeline rank (device group) within its pipeline
    stream: str  # "compute" | "comm" | "recv"
    name: str  # the simulator's action name: 'F s0 mb1', 'SEND_F s0 mb0', 'ALLREDUCE s1', ...
    start: float
    end: float

    @property
    def kind(self) -> str:
        """forward, backward, weight-grad, send, recv, sync or memory: what the Gantt colours by."""
        head = self.name.split()[0]
        if head in ("F", "B", "W"):
            return {"F": "forward", "B": "backward", "W": "weight-grad"}[head]
        if head.startswith("SEND"):
            return "send"
        if head.startswith("RECV"):
            return "recv"
        if head.startswith("ALLREDUCE"):
            return "sync"
        return "memory"


@dataclass
class GanttGroup:
    """Pipelines whose simulated step is the same (`Plan.simulate()` shares one result among them): their
    ranks' device groups (`devices[r]`: every device of those pipelines at rank r) and the step's actions."""

    pipelines: list[int]
    devices: list[list[int]]
    step_time: float
    bars: list[Bar]


def gantt(plan: Plan) -> list[GanttGroup]:
    """Every pipeline's simulated step from `Plan.simulate()` (the simulator behind `timeline()`), pipelines
    sharing a result shown once."""
    groups: dict[int, GanttGroup] = {}
    for i, (pipe, sim) in enumerate(zip(plan.pipelines, plan.simulate(), strict=True)):
        ranks = pipe.device_groups()
        g = groups.get(id(sim))
        if g is None:
            groups[id(sim)] = GanttGroup([i], [list(r) for r in ranks], sim.step_time,
                                         [Bar(*ev) for ev in sim.events])
        else:
            g.pipelines.append(i)
            for r, devs in enumerate(ranks):
                g.devices[r] += devs
    return list(groups.values())


def measured_ranks(measured: Any) -> list[Any]:
    """The per-rank figures of a measured report (`prog.report()`, runtime/plan_check.py `RunReport`); a
    PlanError naming what was given otherwise."""
    ranks = getattr(measured, "ranks", None)
    if not isinstance(ranks, list) or not all(hasattr(r, "measured_peak_bytes") for r in ranks):
        raise PlanError(f"measured={type(measured).__name__} is not a measured report: pass what a program's "
                        f"report() returns (prog.report(), a RunReport), or None.")
    return ranks


__all__ = ["MEMORY_PARTS", "PART_ORDER", "Bar", "DeviceMemory", "DeviceRole", "GanttGroup", "StageRole",
           "device_memory", "device_roles", "gantt", "layer_label", "measured_ranks", "node_of_devices", "ranges",
           "recompute_label"]
