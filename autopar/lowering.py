"""Lowering: a Plan and the model's graph -> everything one rank executes, `lower(plan, graph, rank)`.

The plan is the one description of what runs; a rank's view of it is derived here by pure functions
(no process groups, no tensors), and the runtime (runtime/program.py) executes exactly that view:

    layout_of(plan, num_layers)     the pipelines: each stage's layer range, tensor-parallel group of
                                    ranks, ZeRO level, recompute, offload, compression; each pipeline's
                                    batch slice, micro-batches, schedule. Checked (PlanError) here.
    placements                      per parameter: the groups holding a copy (`holders`), its ZeRO level
                                    (the highest among its holding stages; 0 with a single holder), its
                                    owner (`assign_owners`), this rank's offload kinds, and whether its
                                    memory actions run per layer (`layer_reduced`, `layer_gathered`,
                                    `streamed`) or for the whole step
    memory_actions(schedule, ...)   the pipeline schedule (schedule.py) with this rank's per-layer memory
                                    actions inserted around each F/B: GATHER_F / FREE_F, GATHER_B /
                                    REDUCE / FREE_B (schedule.py's docstring)
    RankProgram                     all of it; `Plan.simulate` prices the same action lists
                                    (`priced_schedule`) and the runtime runs them (zero_layers.py)

Collective order. Per-layer memory actions run inside the pipeline schedule, so they are used only where
every holder of a parameter executes the same sequence of them: a parameter is per-layer when all
pipelines holding it hold it in the same stage (same index and layer range, tensor-parallel degree 1),
with the same micro-batch count, schedule and chunks (`plan.layerwise_stages`), and it is read by one layer
only (not a tied embedding) and not offloaded. Its holders then run identical action lists, reductions are
issued strictly in descending layer order, and each gather/free is an action of the list, never a decision
taken from ownership. Streaming needs no collective: every offloaded parameter read by one layer, at ZeRO
level <= 2, that this rank does not update on the device (its optimizer is offloaded, or another replica
owns it) streams, on stages of tensor-parallel degree 1 without expert parallelism. Every other parameter
keeps the whole-step path of runtime/zero.py (gathered or brought back at the start of the step, reduced
after the schedule), and the planner prices that path for it (solver/pricing/stage_memory.py, pricing.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .cluster import Cluster
from .errors import PlanError
from .ir.graph import TrainingGraph
from .ir.lowered import COMPRESS_DTYPES, Group, Layout, PipelineLayout, Position, RankProgram, StageLayout
from .ir.plan import CP_ATTENTION, OFFLOAD_KINDS, Pipeline, Plan, layerwise_stages, recompute_count
from .ir.plan_simulate import cached_schedule
from .ir.schedule import SPLIT_SCHEDULES, Action, Schedule, make_schedule, splits_backward
from .ir.schedule_nccl import TRANSFER_KINDS, Batch, P2POp, batch_transfers, nccl_problems, settle
from .ir.schedule_waves import call_of_wave, wave_calls

# ---- the layout: who does what ---------------------------------------------------------------------------

def _check_stage(p: PipelineLayout, s: int, st: StageLayout) -> None:
    if isinstance(st.zero, bool) or not isinstance(st.zero, int) or not 0 <= st.zero <= 3:
        raise PlanError(f"pipeline {p.index} stage {s}: zero must be an integer 0-3, got {st.zero!r}.")
    if not isinstance(st.recompute, (bool, int)) or st.recompute < 0:
        raise PlanError(f"pipeline {p.index} stage {s}: recompute must be True, False or the number of the "
                        f"stage's first blocks to recompute (an integer >= 0), got {st.recompute!r}.")
    if isinstance(st.offload, str):
        raise PlanError(f"pipeline {p.index} stage {s}: offload must be a tuple of kinds, got the string "
                        f"{st.offload!r}; write ({st.offload!r},).")
    unknown = sorted(set(st.offload) - set(OFFLOAD_KINDS))
    if unknown:
        raise PlanError(f"pipeline {p.index} stage {s}: unknown offload kind(s) {unknown}; offload is a "
                        f"subset of {list(OFFLOAD_KINDS)}.")
    if st.compress not in COMPRESS_DTYPES:
        raise PlanError(f"pipeline {p.index} stage {s}: compress={st.compress!r}; choose one of "
                        f"{sorted(k for k in COMPRESS_DTYPES if k)} or None (uncompressed).")


def make_layout(pipelines: list[PipelineLayout], world_size: int, global_batch: int, num_layers: int,
                ep: int = 1) -> Layout:
    """Check a layout for consistency and index rank positions."""
    positions: dict[int, Position] = {}
    covered = 0
    for p in sorted(pipelines, key=lambda p: (p.batch_offset, p.seq_part[0])):
        c, cp = p.seq_part
        if not (isinstance(cp, int) and cp >= 1 and 0 <= c < cp):
            raise PlanError(f"pipeline {p.index}: context-parallel part {p.seq_part} is not (c, cp) with 0 <= c < cp.")
        if c > 0:  # a cp sibling takes the same samples as its group's first pipeline
            first = next(q for q in pipelines if q.batch_offset == p.batch_offset and q.seq_part == (0, cp))
            if (p.batch_size, p.num_microbatches, p.bounds(), p.schedule, p.chunks) != \
                    (first.batch_size, first.num_microbatches, first.bounds(), first.schedule, first.chunks):
                raise PlanError(f"pipeline {p.index} is context-parallel rank {c} of pipeline {first.index} but "
                                f"differs from it in batch, micro-batches, stages or schedule.")
            covered -= p.batch_size
        if p.batch_offset != covered:
            raise PlanError(f"pipeline {p.index} takes samples from {p.batch_offset}, expected {covered}: batch "
                            f"shares must tile the global batch.")
        covered += p.batch_size
        if p.num_microbatches < 1 or p.num_microbatches > p.batch_size:
            raise PlanError(f"pipeline {p.index}: {p.num_microbatches} micro-batches for {p.batch_size} samples.")
        if p.stages[0].layers[0] != 0 or p.stages[-1].layers[1] != num_layers:
            raise PlanError(f"pipeline {p.index} must cover layers [0, {num_layers}), got {p.bounds()}.")
        if p.chunks < 1 or len(p.stages) % p.chunks:
            raise PlanError(f"pipeline {p.index}: {len(p.stages)} stages cannot be {p.chunks} chunks per group.")
        for s, st in enumerate(p.stages):
            _check_stage(p, s, st)
            if s and st.layers[0] != p.stages[s - 1].layers[1]:
                raise PlanError(f"pipeline {p.index}: stage {s} starts at layer {st.layers[0]}, expected "
                                f"{p.stages[s - 1].layers[1]}.")
            group = s % p.num_groups
            if st.ranks != p.stages[group].ranks:
                raise PlanError(f"pipeline {p.index}: stage {s} must run on the devices of stage {group} "
                                f"({list(p.stages[group].ranks)}) with {p.chunks} chunks per device group.")
            for k, r in enumerate(st.ranks):
                if not 0 <= r < world_size:
                    raise PlanError(f"rank {r} in pipeline {p.index} stage {s} is outside the world of "
                                    f"{world_size} ranks.")
                if r in positions and s < p.num_groups:
                    raise PlanError(f"rank {r} is used twice (pipeline {p.index} stage {s} and {positions[r]}).")
                old = positions.get(r)
                positions[r] = Position(p.index, group, k, (old.stages if old else ()) + (s,))
    if covered != global_batch:
        raise PlanError(f"pipelines take {covered} samples but the global batch has {global_batch}.")
    return Layout(tuple(pipelines), world_size, global_batch, positions, ep)


def _pipeline_cp(index: int, p: Pipeline) -> int:
    """The context-parallel degree of plan pipeline `index` (every stage's; PlanError when they differ or a
    stage's devices are not cp groups of equal size)."""
    cps = {s.cp for s in p.stages}
    if len(cps) != 1:
        raise PlanError(f"pipeline {index}: its stages have context-parallel degrees {sorted(cps)}; every stage of "
                        f"a pipeline splits the sequence the same way (one cp for the pipeline).")
    cp = cps.pop()
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise PlanError(f"pipeline {index}: Stage.cp must be an integer >= 1, got {cp!r}.")
    for j, s in enumerate(p.stages):
        if len(s.devices) % cp:
            raise PlanError(f"pipeline {index} stage {j}: {len(s.devices)} devices are not cp={cp} tensor-parallel "
                            f"groups of equal size; give it a multiple of {cp} devices.")
        if s.cp_attention not in CP_ATTENTION:
            raise PlanError(f"pipeline {index} stage {j}: cp_attention={s.cp_attention!r}; choose one of "
                            f"{list(CP_ATTENTION)}.")
    return cp


def layout_of(plan: Plan, num_layers: int) -> Layout:
    """The rank-level layout of a Plan (pipelines in order take consecutive slices of the batch)."""
    if plan.model.get("num_layers") not in (None, num_layers):
        raise PlanError(f"the plan was made for a model with {plan.model['num_layers']} layers in its chain, but "
                        f"this model has {num_layers}: plan again for this model.")
    pipelines, offset = [], 0
    for i, p in enumerate(plan.pipelines):
        cp = _pipeline_cp(i, p)
        for c in range(cp):
            stages = tuple(
                StageLayout((int(s.layers[0]), int(s.layers[1])), tuple(s.cp_groups()[c]), s.zero, s.recompute,
                            tuple(s.offload), s.compress,
                            None if s.sharding is None else tuple(sorted(s.sharding.items())))
                for s in p.stages)
            pipelines.append(PipelineLayout(len(pipelines), stages, offset, p.batch_share, p.num_microbatches,
                                            plan.schedule, plan.chunks, (c, cp), i))
        offset += p.batch_share
    world = Cluster.load(plan.cluster).world_size
    ep = int((plan.experts or {}).get("degree", 1))
    return make_layout(pipelines, world, plan.global_batch, num_layers, ep)


# ---- parameters: who holds, owns, partitions, streams what -----------------------------------------------

def params_by_layer(graph: TrainingGraph) -> dict[int, set[str]]:
    """Layer index -> canonical names of the (non-buffer) parameters its ops read."""
    by_layer: dict[int, set[str]] = {}
    for n in graph.nodes.values():
        for a in n.args:
            if a in graph.params and not graph.params[a].is_buffer:
                by_layer.setdefault(n.layer, set()).add(graph.canonical(a))
    return by_layer


def _layers_of(by_layer: dict[int, set[str]]) -> dict[str, set[int]]:
    layers_of: dict[str, set[int]] = {}
    for layer, names in by_layer.items():
        for n in names:
            layers_of.setdefault(n, set()).add(layer)
    return layers_of


def _holdings(by_layer: dict[int, set[str]], layout: Layout) -> Iterator[tuple[str, StageLayout]]:
    """(parameter, stage) for every stage (any pipeline) holding the parameter (`params_by_layer`'s map)."""
    for p in layout.pipelines:
        for st in p.stages:
            for layer in range(*st.layers):
                for name in by_layer.get(layer, ()):
                    yield name, st


def param_groups(graph: TrainingGraph, layout: Layout,
                 by_layer: dict[int, set[str]] | None = None) -> dict[str, tuple[Group, ...]]:
    """Canonical parameter name -> the tensor-parallel groups (stages, any pipeline) holding a copy.
    `by_layer`: `params_by_layer(graph)` when the caller has it."""
    holders: dict[str, set[Group]] = {}
    for name, st in _holdings(params_by_layer(graph) if by_layer is None else by_layer, layout):
        holders.setdefault(name, set()).add(tuple(st.ranks))
    return {k: tuple(sorted(v)) for k, v in sorted(holders.items())}


def zero_levels(graph: TrainingGraph, layout: Layout,
                by_layer: dict[int, set[str]] | None = None) -> dict[str, int]:
    """Canonical parameter name -> the highest ZeRO level among the stages (any pipeline) holding it.
    `by_layer`: `params_by_layer(graph)` when the caller has it."""
    levels: dict[str, int] = {}
    for name, st in _holdings(params_by_layer(graph) if by_layer is None else by_layer, layout):
        levels[name] = max(levels.get(name, 0), st.zero)
    return levels


def assign_owners(holders: dict[str, tuple[Group, ...]], levels: dict[str, int],
                  sizes: dict[str, int]) -> dict[str, Group]:
    """The owning tensor-parallel group of every parameter: greedy balancing of owned elements per group
    over partitioned parameters, the first holder otherwise. Deterministic: equal on every rank."""
    load: dict[Group, int] = {}
    owners: dict[str, Group] = {}
    for name in sorted(holders, key=lambda n: (-sizes.get(n, 0), n)):
        groups = holders[name]
        if levels.get(name, 0) == 0 or len(groups) == 1:
            owners[name] = groups[0]
            continue
        best = min(groups, key=lambda g: (load.get(g, 0), g))
        owners[name] = best
        load[best] = load.get(best, 0) + sizes.get(name, 0)
    return owners


def layerwise_params(graph: TrainingGraph, layout: Layout, levels: dict[str, int],
                     offloaded: set[str] = frozenset(), by_layer: dict[int, set[str]] | None = None) -> dict[str, int]:
    """Canonical name -> layer of the ZeRO-2/3 parameters reduced (and gathered) per layer: those of the
    stages `plan.layerwise_stages` names, read by one layer only, not offloaded ("params": they stream).
    `levels`: effective levels (0 for a single holder); `by_layer`: `params_by_layer(graph)` if known."""
    if by_layer is None:
        by_layer = params_by_layer(graph)
    layers_of = _layers_of(by_layer)
    stages = layerwise_stages([(p.num_microbatches, [(st.layers, len(st.ranks)) for st in p.stages])
                               for p in layout.pipelines])
    out: dict[str, int] = {}
    for i, j in stages:
        for layer in range(*layout.pipelines[i].stages[j].layers):
            for n in by_layer.get(layer, ()):
                if levels.get(n, 0) >= 2 and n not in offloaded and len(layers_of[n]) == 1:
                    out[n] = layer
    return out


# ---- the memory actions -----------------------------------------------------------------------------------

def memory_actions(schedule: Schedule, group: int, gathered: dict[int, set[int]],
                   reduced: dict[int, set[int]]) -> Schedule:
    """`schedule` with pipeline rank `group`'s memory actions inserted (a new Schedule): around each F of
    stage s with layers in `gathered[s]` (ascending) GATHER_F before and FREE_F after; around each B
    (descending) GATHER_B before and, after it, REDUCE for the layers in `reduced[s]` and FREE_B for
    those in `gathered[s]`. Layers are absolute; each action's stage is its compute action's. A schedule
    that splits the backward (zero-bubble) gets the REDUCEs after the W of the micro-batch instead."""
    out: list[Action] = []
    split = splits_backward(schedule)
    for a in schedule.actions[group]:
        if a.kind not in ("F", "B", "W"):
            out.append(a)
            continue
        r, s, m = a.rank, a.stage, a.microbatch
        g = sorted(gathered.get(s, ()))
        red = sorted(reduced.get(s, ()), reverse=True)
        if a.kind == "F":
            out += [Action(r, "GATHER_F", s, m, lay) for lay in g] + [a]
            out += [Action(r, "FREE_F", s, m, lay) for lay in g]
        else:
            out += [Action(r, "GATHER_B", s, m, lay) for lay in reversed(g) if a.kind == "B"] + [a]
            out += [Action(r, "REDUCE", s, m, lay) for lay in red if (a.kind == "W") == split]
            out += [Action(r, "FREE_B", s, m, lay) for lay in reversed(g) if a.kind == "B"]
    actions = dict(schedule.actions)
    actions[group] = out
    return Schedule(schedule.name, schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank,
                    actions)


def pipeline_schedule(pipe: PipelineLayout) -> Schedule:
    return make_schedule(pipe.schedule, pipe.num_groups, pipe.num_microbatches, pipe.chunks)


def recomputed_blocks(graph: TrainingGraph, pipe: PipelineLayout, s: int) -> frozenset[int]:
    """The blocks stage `s` of `pipe` recomputes: all, none, or its first k (`plan.recompute_count`: the order
    of the lower peak under 1F1B, plan.py's docstring); PlanError when k exceeds the stage's blocks."""
    st = pipe.stages[s]
    blocks = [lay for lay in range(*st.layers) if graph.layers[lay].kind == "block"]
    k = recompute_count(st.recompute, len(blocks), f"pipeline {pipe.index} stage {s} recompute")
    return frozenset(blocks[:k])


def lower(plan: Plan, graph: TrainingGraph, rank: int) -> RankProgram:
    """What `rank` executes of `plan` for the model captured as `graph` (module docstring). Pure."""
    layout = layout_of(plan, len(graph.layers))
    if not 0 <= rank < layout.world_size:
        raise PlanError(f"rank {rank} is outside the plan's world of {layout.world_size} devices.")
    by_layer = params_by_layer(graph)
    layers_of = _layers_of(by_layer)
    holders = param_groups(graph, layout, by_layer)
    levels = zero_levels(graph, layout, by_layer)
    effective = {n: (levels.get(n, 0) if len(g) > 1 else 0) for n, g in holders.items()}
    sizes = {info.name: info.meta.numel for info in graph.params.values() if not info.is_buffer}
    owners = assign_owners(holders, levels, sizes)
    groups = process_groups(layout, holders)
    pos = layout.position(rank)
    if pos is None:
        return RankProgram(rank, layout, None, holders, levels, owners, (), {}, {}, {}, {}, {}, groups, None)
    pipe = layout.pipelines[pos.pipeline]
    mine: dict[str, set[str]] = {}
    for s in pos.stages:
        st = pipe.stages[s]
        for layer in range(*st.layers):
            for n in by_layer.get(layer, ()):
                mine.setdefault(n, set()).update(st.offload)
    offload = {n: frozenset(k) for n, k in sorted(mine.items())}
    my_group = tuple(pipe.stages[pos.stages[0]].ranks)
    # the runtime's per-layer memory actions need single-device stages (DTensor stages keep whole-step ZeRO)
    # and a backward not split into B and W (zero_layers.py reduces a layer as its B ends)
    per_layer = len(my_group) == 1 and layout.ep == 1 and pipe.schedule not in SPLIT_SCHEDULES
    offloaded = {n for n, k in offload.items() if "params" in k}
    reduced = {n: lay for n, lay in layerwise_params(graph, layout, effective, offloaded, by_layer).items()
               if n in offload} if per_layer else {}
    gathered = {n: lay for n, lay in reduced.items() if effective[n] == 3}
    streamed = {n: next(iter(layers_of[n])) for n in sorted(offloaded)
                if per_layer and effective[n] <= 2 and len(layers_of.get(n, ())) == 1
                # its device value is never the optimizer's: the master is on the host, or another replica updates it
                and ("optimizer" in offload[n] or (effective[n] >= 1 and owners[n] != my_group))}
    recompute = {s: recomputed_blocks(graph, pipe, s) for s in pos.stages}
    stage_of = {lay: s for s in pos.stages for lay in range(*pipe.stages[s].layers)}
    bring: dict[int, set[int]] = {}
    red: dict[int, set[int]] = {}
    for lay in {**gathered, **streamed}.values():
        bring.setdefault(stage_of[lay], set()).add(lay)
    for lay in {**reduced, **streamed}.values():
        red.setdefault(stage_of[lay], set()).add(lay)
    schedule = memory_actions(pipeline_schedule(pipe), pos.group, bring, red)
    return RankProgram(rank, layout, pos, holders, levels, owners, tuple(sorted(mine)), offload, reduced,
                       gathered, streamed, recompute, groups, schedule, tuple(schedule.actions[pos.group]),
                       transfer_steps(pipe)[pos.group], transfer_steps(pipe, True)[pos.group])


def process_groups(layout: Layout, holders: dict[str, tuple[Group, ...]]) -> tuple[Group, ...]:
    """The rank sets the runtime makes process groups of: every stage's tensor-parallel group, per
    parameter the set of its holding groups' first ranks (its data-parallel and context-parallel replicas),
    and every context-parallel group (`Layout.cp_groups`: the ring of ranks exchanging keys and values)."""
    tp_groups = {tuple(st.ranks) for p in layout.pipelines for st in p.stages}
    reps = {tuple(g[0] for g in groups) for groups in holders.values()}
    return tuple(sorted(tp_groups | reps | set(layout.cp_groups())))


def communicator_sets(pipelines: list[list[Group]], groups: list[Group] | tuple[Group, ...], world: int
                      ) -> dict[int, tuple[Group, ...]]:
    """Per rank of `pipelines`, the rank sets of the NCCL communicators it creates: the world's (the loss
    all-reduce spans it), each of `groups` holding it other than the world (runtime/dist.py `Groups`), and one
    pair per peer it sends activations or gradients to or receives them from: the batched transfers run on the
    world's communicator, where NCCL still connects each peer with buffers of its own (cost_models/memory.py).
    `pipelines`: per pipeline, the rank group of each stage in order, interleaved chunks included; peers as
    `PipelineLayout.peers` picks them (the same tensor-parallel index, modulo the other stage's degree)."""
    held = _communicators(pipelines, groups, world, lambda g: g)
    return {r: tuple(sorted(v)) for r, v in held.items()}


def communicator_counts(pipelines: list[list[Group]], groups: list[Group] | tuple[Group, ...], world: int
                        ) -> dict[int, int]:
    """Per rank, `len(communicator_sets(...)[rank])`, without building the sorted sets: each group is named
    once (a rank set of more than two ranks by a number, so a rank's set holds no long tuples to hash), and
    two-rank sets by themselves, so a two-rank group and a peer pair over the same ranks stay one communicator
    as they are there. The planner's search counts every config this way (search.py `config_communicators`)."""
    names: dict[Group, object] = {}
    held = _communicators(pipelines, groups, world, lambda g: g if len(g) <= 2 else names.setdefault(g, len(names)))
    return {r: len(v) for r, v in held.items()}


def _communicators(pipelines: list[list[Group]], groups: list[Group] | tuple[Group, ...], world: int,
                   name: Callable[[Group], Any]) -> dict[int, set]:
    """Per rank of `pipelines`, the `name`s of its communicators' rank sets (`communicator_sets`); one pass over
    the groups and the neighbours for every rank (1024-device configs)."""
    ranks = {r for stages in pipelines for st in stages for r in st}
    if world <= 1:
        return {r: set() for r in ranks}
    everyone = name(tuple(range(world)))
    out: dict[int, set] = {r: {everyone} for r in ranks}
    for g in groups:
        if 1 < len(g) < world:
            key = name(tuple(sorted(g)))
            for r in g:
                out.setdefault(r, {everyone}).add(key)
    for stages in pipelines:
        for s, members in enumerate(stages):
            for nb in (s - 1, s + 1):
                if not 0 <= nb < len(stages):
                    continue
                other = stages[nb]
                n_other, n_members = len(other), len(members)
                for tp_index, rank in enumerate(members):
                    held = out[rank]
                    # received from other[tp_index % n_other]; sent to the ranks of other at indices = tp_index
                    # modulo n_members
                    for q in (other[tp_index % n_other], *other[tp_index::n_members]):
                        if q != rank:
                            held.add((rank, q) if rank < q else (q, rank))
    return {r: v for r, v in out.items() if r in ranks}


def plan_communicators(plan: Plan, graph: TrainingGraph, world: int | None = None) -> dict[int, tuple[Group, ...]]:
    """Rank -> `communicator_sets` of the ranks `plan` runs on (expert-parallel groups not included); `world`: the
    world's size where the plan's cluster is part of it (a plan on a sub-cluster, `CostModel.on_subset`)."""
    layout = layout_of(plan, len(graph.layers))
    groups = process_groups(layout, param_groups(graph, layout, params_by_layer(graph)))
    pipelines = [[tuple(st.ranks) for st in p.stages] for p in layout.pipelines]
    return dict(sorted(communicator_sets(pipelines, groups, world or layout.world_size).items()))


# ---- transfers under NCCL's rules (schedule_nccl.py) -----------------------------------------------------

def transfer_message(action: Any) -> tuple[Any, ...]:
    """What a transfer action moves, the same for a send and its receive: ("F" | "B", the sending stage,
    micro-batch, wave)."""
    kind, s = action.kind, action.stage
    sender = s + 1 if kind == "RECV_B" else s - 1 if kind == "RECV_F" else s
    return (kind[-1], sender, action.microbatch, getattr(action, "wave", 0))


def p2p_batches(pipe: PipelineLayout, tp_index: int, steps: Sequence[Sequence[Any]],
                nbytes: Callable[[Any], int] | None = None) -> tuple[Batch, ...]:
    """A rank's transfer steps (`batch_transfers`' batches) as the point-to-point ops it posts, peers resolved
    as the runtime resolves them (`PipelineLayout.peers`); `nbytes`: a transfer action's message size, when
    known. Steps without ops (a send with no targets, compute) post nothing."""
    out = []
    for step in steps:
        ops = tuple(op for a in step if a.kind in TRANSFER_KINDS for op in _ops(pipe, tp_index, a, nbytes))
        if ops:
            out.append(Batch(" ".join(str(a) for a in step if a.kind in TRANSFER_KINDS), ops))
    return tuple(out)


StepsOf = Callable[[PipelineLayout, int], Sequence[Sequence[Any]]]


def transfer_steps(pipe: PipelineLayout, forward_only: bool = False) -> dict[int, tuple[tuple[Action, ...], ...]]:
    """Per device group of `pipe`, the executor's steps of its schedule (`forward_only`: eval_step's F / SEND_F /
    RECV_F list): adjacent transfers batched (`schedule_nccl.batch_transfers`), receives pulled earlier where
    NCCL's rules need it (`schedule_nccl.settle`). Memory actions are inert among transfers, so these are
    the batches of the lowered lists too (`RankProgram.steps`). Memoized per pipeline shape."""
    return _transfer_steps(_shape(pipe), forward_only)


@functools.lru_cache(maxsize=256)
def _transfer_steps(shape: tuple[Any, ...], forward_only: bool) -> dict[int, tuple[tuple[Action, ...], ...]]:
    pipe = _stand_in(shape)
    lists = pipeline_schedule(pipe).actions
    if forward_only:
        lists = {g: [a for a in acts if a.kind in ("F", "SEND_F", "RECV_F")] for g, acts in lists.items()}
    steps = {g: batch_transfers(acts) for g, acts in lists.items()}
    ranks = {g: pipe.stages[g].ranks for g in steps}
    return settle(steps, ranks, lambda g, k, a: _ops(pipe, k, a, None))


def _stand_in(shape: tuple[Any, ...]) -> PipelineLayout:
    """A pipeline of `shape` (`_shape`) on ranks 0, 1, ... in group order."""
    schedule, groups, m, chunks, degrees = shape
    firsts = [sum(degrees[:g]) for g in range(groups)]
    stages = tuple(StageLayout((s, s + 1), tuple(range(firsts[s % groups], firsts[s % groups] + degrees[s % groups])))
                   for s in range(groups * chunks))
    return PipelineLayout(0, stages, 0, m, m, schedule, chunks)


def _ops(pipe: PipelineLayout, tp_index: int, a: Any, nbytes: Callable[[Any], int] | None) -> tuple[P2POp, ...]:
    return tuple(P2POp(peer, a.kind.startswith("SEND"), transfer_message(a), -1 if nbytes is None else nbytes(a))
                 for peer in pipe.peers(a, tp_index))


def train_steps(pipe: PipelineLayout, group: int) -> tuple[tuple[Action, ...], ...]:
    """Device group `group`'s training steps (`transfer_steps`)."""
    return transfer_steps(pipe)[group]


def eval_steps(pipe: PipelineLayout, group: int) -> tuple[tuple[Action, ...], ...]:
    """Device group `group`'s steps of eval_step's forward-only list (`transfer_steps`)."""
    return transfer_steps(pipe, forward_only=True)[group]


def flushless_steps(waves: int) -> StepsOf:
    """The flushless 2BW executor's steps (runtime/flushless.py) over its calls of waves 0..waves-1 and the
    drain after the last, each call batched on its own (a batch never spans two calls)."""
    def steps(pipe: PipelineLayout, group: int) -> list[tuple[Any, ...]]:
        calls, drains = wave_calls(len(pipe.stages), pipe.num_microbatches, group)
        out: list[tuple[Any, ...]] = []
        for r in range(waves):
            out += batch_transfers(call_of_wave(calls, r))
        return out + list(batch_transfers(call_of_wave(drains, waves - 1)))
    return steps


def layout_programs(layout: Layout, steps_of: StepsOf, nbytes: Callable[[Any], int] | None = None
                    ) -> dict[int, tuple[Batch, ...]]:
    """Every pipeline rank's posted batches (`p2p_batches`) when each device group runs `steps_of(pipe, g)`."""
    out: dict[int, tuple[Batch, ...]] = {}
    for pipe in layout.pipelines:
        for g in range(pipe.num_groups):
            steps = steps_of(pipe, g)
            for k, r in enumerate(pipe.stages[g].ranks):
                out[r] = p2p_batches(pipe, k, steps, nbytes)
    return out


def _shape(pipe: PipelineLayout) -> tuple[Any, ...]:
    return (pipe.schedule, pipe.num_groups, pipe.num_microbatches, pipe.chunks,
            tuple(len(pipe.stages[g].ranks) for g in range(pipe.num_groups)))


@functools.lru_cache(maxsize=256)
def _shape_ok(shape: tuple[Any, ...], flushless: bool) -> bool:
    """Whether a pipeline of this shape completes under NCCL's rules, on stand-in ranks (the outcome does not
    depend on which ranks run it)."""
    pipe = _stand_in(shape)
    layout = Layout((pipe,), sum(shape[4]), pipe.num_microbatches)
    return not any(nccl_problems(layout_programs(layout, f)) for f in _steps_checked(flushless))


def _steps_checked(flushless: bool) -> tuple[StepsOf, ...]:
    if flushless:
        return tuple(flushless_steps(k) for k in (1, 2, 3, 4)) + (eval_steps,)
    return (train_steps, eval_steps)


def check_transfers(layout: Layout, flushless: bool = False) -> None:
    """Raise PlanError naming the ranks and stuck actions if any pipeline's transfers, as the executors issue
    them (training steps, eval's forward-only list; `flushless`: the 2BW executor's calls), would hang or
    mis-deliver under NCCL's rules (schedule_nccl.py). Memoized per pipeline shape."""
    for pipe in layout.pipelines:
        if pipe.num_groups < 2 or _shape_ok(_shape(pipe), flushless):
            continue
        one = Layout((pipe,), layout.world_size, layout.global_batch)
        for steps_of in _steps_checked(flushless):
            problems = nccl_problems(layout_programs(one, steps_of))
            if problems:
                what = getattr(steps_of, "__name__", "steps")
                raise PlanError(f"pipeline {pipe.index} ({pipe.schedule}, {pipe.num_groups} device groups, "
                                f"{pipe.num_microbatches} micro-batches, {what}) would hang on NCCL, which matches "
                                f"sends and receives by order only and blocks a send until its receive is posted: "
                                + " | ".join(problems[:4]) + ". Issue adjacent transfers as one batch "
                                "(schedule_nccl.batch_transfers) in the same per-pair order on both ranks.")


def priced_schedule(plan: Plan, pipe: Pipeline) -> tuple[Schedule, dict[Any, float]]:
    """Pipeline `pipe` of `plan` as `Plan.simulate` prices it: its schedule with the memory actions of its
    stages priced per layer (`Stage.predicted` gather_s / reduce_s > 0; every layer of such a stage gets
    them, as the plan does not say which layers hold parameters: their times sum to the stage's either way),
    and the seconds of each memory action by (kind, stage)."""
    ranks = len(pipe.stages) // plan.chunks
    times: dict[Any, float] = {}
    actions: list[tuple[tuple[tuple[int, int, int], ...], tuple[tuple[int, int, int], ...]]] = []
    for g in range(ranks):
        bring: list[tuple[int, int, int]] = []
        red: list[tuple[int, int, int]] = []
        for s in range(g, len(pipe.stages), ranks):
            p = pipe.stages[s].predicted
            lo, hi = pipe.stages[s].layers
            n = hi - lo
            if p.get("gather_s", 0.0) > 0:
                bring.append((s, lo, hi))
                for kind in ("GATHER_F", "GATHER_B"):
                    times[(kind, s)] = p["gather_s"] / n
            if p.get("reduce_s", 0.0) > 0:
                red.append((s, lo, hi))
                times[("REDUCE", s)] = p["reduce_s"] / n
        actions.append((tuple(bring), tuple(red)))
    return _memory_schedule(plan.schedule, ranks, pipe.num_microbatches, plan.chunks, tuple(actions)), times


@functools.lru_cache(maxsize=256)
def _memory_schedule(name: str, ranks: int, microbatches: int, chunks: int,
                     actions: tuple[tuple[tuple[tuple[int, int, int], ...], tuple[tuple[int, int, int], ...]], ...]
                     ) -> Schedule:
    """`priced_schedule`'s schedule, memoised on its shape and each pipeline rank's (stage, first layer, end)
    gathered and reduced: the planner prices many plans of few such shapes, and a schedule object met again
    keeps its compiled form (`schedule.compiled`). Do not mutate."""
    sched = cached_schedule(name, ranks, microbatches, chunks)
    for g, (bring, red) in enumerate(actions):
        if bring or red:
            sched = memory_actions(sched, g, {s: set(range(lo, hi)) for s, lo, hi in bring},
                                   {s: set(range(lo, hi)) for s, lo, hi in red})
    return sched


__all__ = ["assign_owners", "check_transfers", "communicator_counts", "communicator_sets", "eval_steps",
           "flushless_steps", "layerwise_params", "layout_of", "layout_programs", "lower", "make_layout",
           "memory_actions", "p2p_batches", "param_groups", "params_by_layer", "pipeline_schedule",
           "plan_communicators", "priced_schedule", "process_groups", "recomputed_blocks", "train_steps",
           "transfer_message", "transfer_steps", "zero_levels"]
