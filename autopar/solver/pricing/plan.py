"""Plan-level pieces of the pricing (`pricing`): consistency checks, the step's lower bound, the sync of
parameters several stages hold, the wire dtypes of compressed sends and memory problem messages (device
and host memory)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...cost_models.memory import OPTIMIZER_STATE_BYTES
from ...errors import PlanError
from ...ir.plan import OFFLOAD_KINDS, Plan, recompute_count
from ...ir.precision import ELEMENT_BYTES
from ...ir.schedule import SCHEDULES
from ...ir.simulate import SimResult
from ...report import fmt_bytes

if TYPE_CHECKING:
    from .model import CostModel
    from .stage_memory import StageMemory

ACT_BYTES = ELEMENT_BYTES  # bytes of an activation element per precision
WIRE_BYTES = {"bf16": 2, "fp16": 2}  # the wire dtypes a stage boundary may be compressed to


def check_compress(compress: str | None) -> str | None:
    """`compress` (the wire dtype a plan may send stage boundaries in) unchanged when valid, else PlanError."""
    if compress is not None and compress not in WIRE_BYTES:
        raise PlanError(f"compress={compress!r}: choose one of {sorted(WIRE_BYTES)} (stage sends rounded to that "
                        f"dtype where it pays) or None (the default: sends keep the plan's dtypes).")
    return compress


SLOW_LINK_BYTES_PER_S = 1.25e9  # 10 Gb/s: links at most this fast count as slow for compression
# Host bytes per owned parameter with the optimizer offloaded, besides its moments: the fp32 copy the
# optimizer updates and the fp32 copy of its gradient (runtime/zero.py, ZeroRuntime.step)
HOST_MASTER_BYTES = 4
HOST_GRAD_BYTES = 4


def check_plan(cm: CostModel, plan: Plan) -> None:
    """Raise PlanError unless `plan` places every layer once per pipeline and every device at most once
    (devices it leaves out are idle: allowed), and its stage options are valid."""
    if plan.schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {plan.schedule!r}; choose one of {', '.join(SCHEDULES)}.")
    if sum(p.batch_share for p in plan.pipelines) != cm.B:
        raise PlanError(f"batch shares {[p.batch_share for p in plan.pipelines]} sum to "
                        f"{sum(p.batch_share for p in plan.pipelines)}, not the global batch {cm.B}.")
    used: dict[int, str] = {}
    for i, p in enumerate(plan.pipelines):
        if not 1 <= p.num_microbatches <= p.batch_share:
            raise PlanError(f"pipeline {i}: {p.num_microbatches} micro-batches for a batch share of "
                            f"{p.batch_share}; need 1 <= micro-batches <= share.")
        if p.microbatch_size != -(-p.batch_share // p.num_microbatches):
            raise PlanError(f"pipeline {i}: microbatch_size {p.microbatch_size} should be "
                            f"ceil({p.batch_share} / {p.num_microbatches}).")
        ranks = len(p.stages) // plan.chunks
        if ranks < 1 or len(p.stages) % plan.chunks:
            raise PlanError(f"pipeline {i} has {len(p.stages)} stages, not a multiple of "
                            f"chunks={plan.chunks}.")
        if plan.schedule == "interleaved_1f1b" and p.num_microbatches % ranks:
            raise PlanError(f"pipeline {i}: interleaved_1f1b needs the micro-batch count "
                            f"({p.num_microbatches}) to be a multiple of the pipeline depth ({ranks}).")
        edge = 0
        for j, st in enumerate(p.stages):
            a, e = st.layers
            if a != edge or e <= a or e > cm.L:
                raise PlanError(f"pipeline {i} stage {j} covers layers [{a}, {e}); expected [{edge}, ...) "
                                f"with at least one layer, within the {cm.L} layers of the model.")
            edge = e
            if st.devices != p.stages[j % ranks].devices:
                raise PlanError(f"pipeline {i} stage {j} must run on the devices of stage {j % ranks} "
                                f"(chunks={plan.chunks}).")
            if not st.devices or any(not 0 <= d < cm.cluster.world_size for d in st.devices):
                raise PlanError(f"pipeline {i} stage {j} names devices {st.devices}; the cluster has "
                                f"0..{cm.cluster.world_size - 1}.")
            if len({cm.cluster.devices[d].spec.name for d in st.devices}) > 1:
                raise PlanError(f"pipeline {i} stage {j}: a tensor-parallel group must hold one device type.")
            if not 0 <= st.zero <= 3 or set(st.offload) - set(OFFLOAD_KINDS):
                raise PlanError(f"pipeline {i} stage {j}: zero must be 0-3 and offload a subset of "
                                f"{list(OFFLOAD_KINDS)}, got zero={st.zero}, offload={st.offload}.")
            recompute_count(st.recompute, sum(cm.is_block[a:e]), f"pipeline {i} stage {j} recompute")
            if st.compress is not None and st.compress not in WIRE_BYTES:
                raise PlanError(f"pipeline {i} stage {j}: compress={st.compress!r}; use one of "
                                f"{sorted(WIRE_BYTES)} (the dtype sends to the next stage travel in) or None.")
            if j < ranks:
                for d in st.devices:
                    if d in used:
                        raise PlanError(f"device {d} is used twice ({used[d]} and pipeline {i} stage {j}).")
                    used[d] = f"pipeline {i} stage {j}"
        if edge != cm.L:
            raise PlanError(f"pipeline {i} stops at layer {edge}; the model has {cm.L} layers.")


def lower_bound(stages: list[tuple[float, ...]], sizes: list[int], ranks: int, split: bool = False) -> float:
    """A bound no simulated step of this pipeline beats; stages[j] = (fwd, fwd_small, bwd, bwd_small,
    send, sync) with sizes[0] the largest micro-batch.

    Device r first computes F(stage r, 0), which waits for the forward of stages < r; its last compute is
    B(stage r, last), followed on its comm stream by the gradient send to stage r - 1 and stage r's sync,
    and by the backward chain back to stage 0, which stage 0's sync follows. `split` (a zero-bubble schedule,
    schedule.SPLIT_SCHEDULES): device r's last compute may be a W, after which only its own sync is sure.
    """
    full = sizes[0]
    n_full = sum(s == full for s in sizes)
    last_small = sizes[-1] != full
    best = 0.0
    pre_f = pre_b = 0.0
    for r in range(ranks):
        work = sum(n_full * (st[0] + st[2]) + (len(sizes) - n_full) * (st[1] + st[3])
                   for st in stages[r::ranks])
        send_back = stages[r - 1][4] if r else 0.0
        tail = stages[r][5] if split else max(pre_b + stages[0][5], send_back + stages[r][5])
        best = max(best, pre_f + work + tail)
        pre_f += stages[r][0] + stages[r][4]
        pre_b += (stages[r][3] if last_small else stages[r][2]) + stages[r][4]
    return best


def tied_sync(cm: CostModel, stages: list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]) -> list[float]:
    """Per stage (a, e, tp group, data-parallel group) of one pipeline, the seconds its per-step sync takes
    beyond `stage_times` for parameters several stages hold (tied embeddings on the first and last stage):
    the runtime all-reduces such a gradient once over every copy (all holding stages of all replicas), not
    within each stage's data-parallel group. Priced as that all-reduce minus the one `stage_times` counts."""
    out = [0.0] * len(stages)
    g = cm.state.grads
    for numel, _, users in cm.shared:
        holders = [j for j, (a, e, _, _) in enumerate(stages) if any(a <= u < e for u in users)]
        union = tuple(sorted({d for j in holders for d in stages[j][3]}))
        if len(holders) < 2 or len(union) < 2:
            continue
        for j in holders:
            nbytes = numel * g / len(cm.tp_part(stages[j][2]))
            out[j] += max(0.0, cm.collective("all_reduce", nbytes, union)
                          - cm.collective("all_reduce", nbytes, stages[j][3]))
    return out


def offload_host_bytes(optimizer: str, w: float, n: float, owned: float, zero: int,
                       offload: tuple[str, ...]) -> float:
    """Host bytes one device keeps for a stage's offloaded optimizer state and parameters (pricing.py's
    docstring): n parameters per device, `owned` of them updated by it, `w` bytes per weight."""
    host = 0.0
    if "optimizer" in offload:
        host += owned * (HOST_MASTER_BYTES + HOST_GRAD_BYTES + OPTIMIZER_STATE_BYTES[optimizer])
    if "params" in offload:  # a copy of each value kept between steps; the optimizer's fp32 copy serves
        host += ((owned if zero == 3 else n) - (owned if "optimizer" in offload else 0.0)) * w
        if zero in (1, 2):  # streamed parameters it does not own accumulate fp32 gradients on the host
            host += (n - owned) * HOST_GRAD_BYTES
    return host


def settled_work(mem: StageMemory, inflight: int, microbatches: int | None = None) -> float:
    """The working set `rank_peak` counts for `mem` with `inflight` of a step's `microbatches` micro-batches in
    flight at the device's peak. Its gradient accumulation's transient (`StageMemory.accumulation`) comes with
    every backward that finds a parameter's `.grad` already there: each after the step's first, or every one where
    the gradients are the buckets' views from the start (`StageMemory.accumulates`). So it meets the full
    in-flight count only when the step has more micro-batches than are in flight (1F1B's steady state); a stage
    holding every micro-batch at once meets its second backward with one fewer in flight, and a step of one
    micro-batch never meets it. Nor does a step's first backward have the stage's gradients yet where it
    reaches the loss's transient (`StageMemory.first`: both). `microbatches=None` (unknown: an interleaved
    device's chunks in the search, the asynchronous modes) counts them always, never less than the runtime's."""
    if not mem.first or mem.accumulates or microbatches is None or microbatches > inflight:
        return mem.work
    settled = mem.work - mem.first  # the step's first backward (`StageMemory.first`)
    if microbatches <= 1:
        return settled
    # the larger of the first backward at the full count and the second at one fewer: an offloaded stage keeps
    # one micro-batch's activations on the device either way
    return mem.work if mem.offload_act else settled + max(0.0, mem.first - mem.act)


def rank_peak(mems: list[StageMemory], inflight: int, microbatches: int | None = None) -> float:
    """Peak bytes of one device holding these stages (model chunks) with `inflight` micro-batches of a step's
    `microbatches` in flight (`settled_work`)."""
    act = max((min(inflight, 1) if m.offload_act else inflight) * m.act for m in mems)
    work = max(settled_work(m, inflight, microbatches) for m in mems)
    return sum(m.static for m in mems) + max(act + work, max(m.sync for m in mems))


def rank_peak_ordered(mems: list[StageMemory], actions: list, ranks: int, split: bool) -> float:
    """Peak bytes of one device holding several model chunks (`mems`, chunk k = stage k * ranks + r), walked
    along its schedule `actions`: each chunk's activations live from its forward until its backward (W under
    a split backward), so the peak is the largest sum of the chunks actually in flight plus the working set
    of the one computing; `rank_peak` would count every in-flight pair as the largest chunk. A chunk's working
    set has the gradient accumulation's transient (`settled_work`) from its second backward on (from its first
    where its gradients are bucket views: `StageMemory.accumulates`)."""
    end = "W" if split else "B"
    live = peak = 0.0
    graded: set[int] = set()
    for a in actions:
        if a.kind not in ("F", "B", "W"):
            continue
        m = mems[a.stage // ranks]
        if a.kind == "F":
            live += m.act
        peak = max(peak, live + m.work - (0.0 if m.accumulates or a.stage in graded else m.accumulation))
        if a.kind == end:
            live -= m.act
            graded.add(a.stage)
    return sum(m.static for m in mems) + max(peak, max(m.sync for m in mems))


def rank_host(mems: list[StageMemory], inflight: int) -> float:
    """Host bytes one device holding these stages keeps (what they offload), as `rank_peak` counts them."""
    return sum(m.host for m in mems) + inflight * max(m.host_act for m in mems)


def rank_shared(mems: list[StageMemory], inflight: int, need: float) -> float:
    """Peak bytes of one CPU allocator holding both the device's tensors (`need`: its peak, `rank_peak`) and
    what it keeps on the host (`rank_host`): the `cpu` device's, whose memory is the host's, and that of a rank
    computing an accelerator's stages on the CPU (no CUDA: the gloo stand-in; runtime/plan_check.py). Through
    the schedule the host holds all of its share but the gradient copies the offloaded optimizer's step makes;
    in that step the device's activations are gone, its gradients leave for the host as they are copied, and
    the CPU optimizer adds its buffers (`StageMemory.host_step`, `step_freed`, `host_work`)."""
    on_host = rank_host(mems, inflight)
    schedule = need + on_host - sum(m.host_step for m in mems)
    step = sum(m.static - m.step_freed + m.host for m in mems) + max(m.host_work for m in mems)
    return max(schedule, step)


def memory_problem(cm: CostModel, device: int, pipeline: int, rank: int, need: float,
                    mems: list[StageMemory], inflight: int, host: float = 0.0, communicators: int | None = None
                    ) -> str:
    """Why one device does not fit; `need` includes the `host` bytes it offloads when its memory is the
    host's (`CostModel.unified`); `communicators`: its NCCL communicators (`CostModel.usable`)."""
    spec = cm.cluster.devices[device].spec
    static = sum(m.static for m in mems)
    shared = (f", offloaded state {fmt_bytes(host)}, which stays in this device's memory: it is the host's"
              if host else "")
    return (f"device {device} ({spec.name}, pipeline {pipeline} stage {rank}) needs {fmt_bytes(need)} "
            f"(parameters, gradients and optimizer state {fmt_bytes(static)}, activations of {inflight} "
            f"in-flight micro-batch(es) {fmt_bytes(need - static - host)}{shared}) but has "
            f"{fmt_bytes(cm.usable(device, communicators))} usable of {fmt_bytes(spec.memory)} "
            f"({100 * cm.reserve:.0f}% reserve).")


def host_problem(cm: CostModel, node: int, need: float, host: dict[int, float]) -> str:
    """Why node `node`'s host memory overflows: `host` maps devices to the host bytes they fill."""
    nd = cm.cluster.nodes[node]
    spec = cm.cluster.devices[nd.devices[0]].spec
    per = ", ".join(f"device {d} {fmt_bytes(host[d])}" for d in nd.devices if host.get(d))
    return (f"node {node} ({len(nd.devices)}x {spec.name}) keeps {fmt_bytes(need)} in host memory ({per}: "
            f"offloaded optimizer state, parameter copies and activations) but has "
            f"{fmt_bytes(cm.host_usable(node))} usable of {fmt_bytes(nd.host_memory)} host memory "
            f"({100 * cm.reserve:.0f}% reserve). Offload less (ZeRO-partition the state over data-parallel "
            f"replicas instead), or give its node group more host_memory_GiB in the cluster file.")


def idle_split(res: SimResult, ranks: int, step: float) -> tuple[list[float], float, float]:
    """A pipeline's idle seconds in a step of `step` (the slowest pipeline's), split three ways: per rank
    the pipeline bubble (waiting for other stages while the pipeline still computes: none with one stage),
    then the pipeline's tail after its last F/B (the gradient sync and optimizer step nothing overlaps) and
    the wait for slower replicas. Their sum is step - busy, each rank's whole idle time."""
    compute_end = max((end for _, _, name, _, end in res.events if name[:2] in ("F ", "B ")), default=0.0)
    bubble = [max(0.0, compute_end - res.per_rank_busy[r]) for r in range(ranks)]
    return bubble, res.step_time - compute_end, step - res.step_time
