"""autopar's runtime against the torch baselines, side by side in one run (ratios, not absolute seconds).

1. data parallel, 2 gloo ranks: autopar's dp=2 Program (DDP-style overlapped bucket all-reduce,
   runtime/grad_sync.py) vs torch DDP (samples/s ratio, target >= 0.95)
2. pipeline, 2 ranks, 4 micro-batches, 1F1B and GPipe: autopar pp=2 vs torch.distributed.pipelining with
   the same layer split (samples/s ratio, target >= 1.0)
3. one rank: autopar's Program vs plain eager training in the same process (overhead, target <= 5 %)
5. the plan's self-check (compile's default): compile + 100 steps with check_plan on vs off (target <= 5 %)
4. per-rank peak of live tensor bytes measured at the allocator (torch.profiler memory events, see
   runtime/memtrace.py) over compiling the program from autopar.plan on "1x2xcpu" plus MEMORY_STEPS steps,
   vs the plan's prediction (within 15 %); bench/memory.py does the same for every plan family

Contenders run in the same processes, alternating block by block (ABBA order) after a warm-up; ratios are
medians of the per-repetition paired ratios, so slow drift of a noisy machine cancels.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from common import print_table, write_results
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.nn.parallel import DistributedDataParallel

import autopar
from autopar import models
from autopar.cluster import Cluster
from autopar.compiler import compile as compile_program
from autopar.cost_models.memory import state_bytes_per_param
from autopar.ir.plan import Plan, Strategy, plan_from_strategy
from autopar.runtime.launch import spawn_local
from autopar.runtime.memtrace import phase, track_memory
from autopar.runtime.program import Program

CFG = dict(hidden=256, layers=4, seq=64, batch=16)
CLUSTER = "1x2xcpu"
MICROBATCHES = 4
WARMUP = 2  # steps per contender before timing
STEPS = 4  # steps per timed block
REPS = 10  # timed blocks per contender
REPS_1RANK = 12
MEMORY_STEPS = 3
LR = 1e-3
TARGETS = {"dp": 0.95, "pp": 1.0, "overhead_pct": 5.0, "memory_tol": 0.15}


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def build() -> models.ModelCase:
    return models.gpt(**CFG, seed=0)


def graph_shape(case: models.ModelCase) -> tuple[int, int, list[str]]:
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    kinds = [layer.kind for layer in g.layers]
    return len(kinds), kinds.count("block"), kinds


def make_plan(case: models.ModelCase, dp: int, pp: int, m: int, schedule: str = "1f1b") -> Plan:
    """The Plan of a Megatron-order dp x pp strategy with m micro-batches per replica (what the program lowers)."""
    n_layers, n_blocks, _ = graph_shape(case)
    world = dp * pp
    strategy = Strategy(dp=dp, pp=pp, microbatch_size=CFG["batch"] // dp // m, schedule=schedule)
    return plan_from_strategy(strategy, world_size=world, global_batch=CFG["batch"], num_layers=n_layers,
                              first_block=1, num_blocks=n_blocks, precision="fp32", optimizer="adamw",
                              cluster=Cluster.load(f"1x{world}xcpu").to_dict(), model={"num_layers": n_layers})


# ---- timing ---------------------------------------------------------------------------------------------


def alternate(contenders: dict[str, Callable[[], Any]], reps: int, world: int) -> dict[str, list[float]]:
    """Seconds per step of each contender, one entry per repetition; blocks alternate ABBA..."""

    def sync() -> None:
        if world > 1:
            dist.barrier()

    for fn in contenders.values():
        for _ in range(WARMUP):
            fn()
    names = list(contenders)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        for name in names if r % 2 == 0 else names[::-1]:
            sync()
            t0 = time.perf_counter()
            for _ in range(STEPS):
                contenders[name]()
            sync()
            times[name].append((time.perf_counter() - t0) / STEPS)
    return times


# ---- 1. data parallel ------------------------------------------------------------------------------------


def data_parallel(rank: int, world: int) -> dict[str, list[float]]:
    case = build()
    x, y = case.example_inputs[0], case.example_target
    prog = Program(case.model, make_plan(case, dp=world, pp=1, m=1), case.example_inputs, y, case.loss_fn,
                   adamw, rank, world)
    ref = build()
    ddp = DistributedDataParallel(ref.model)
    opt = adamw(list(ddp.parameters()))
    share = CFG["batch"] // world
    x_mine, y_mine = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]

    def ddp_step() -> float:
        loss = ref.loss_fn(ddp(x_mine), y_mine)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return alternate({"autopar": lambda: prog.step(x, target=y), "torch": ddp_step}, REPS, world)


# ---- 2. pipeline -----------------------------------------------------------------------------------------


class Front(nn.Module):
    """Stage 0 of the hand-split GPT: embeddings + the first blocks."""

    def __init__(self, gpt: models.GPT, blocks: int) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop
        self.blocks = nn.ModuleList(gpt.blocks[:blocks])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return x


class Back(nn.Module):
    """Last stage: the remaining blocks, final norm and head."""

    def __init__(self, gpt: models.GPT, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(gpt.blocks[blocks:])
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def pipeline(rank: int, world: int, schedule: str) -> dict[str, Any]:
    case = build()
    x, y = case.example_inputs[0], case.example_target
    plan = make_plan(case, dp=1, pp=world, m=MICROBATCHES, schedule=schedule)
    prog = Program(case.model, plan, case.example_inputs, y, case.loss_fn, adamw, rank, world)
    _, _, kinds = graph_shape(case)
    # the same split as autopar's plan: stage 0 holds the blocks inside its layer range
    first = plan.pipelines[0].stages[0].layers
    front_blocks = kinds[first[0]:first[1]].count("block")
    ref = build()
    module = Front(ref.model, front_blocks) if rank == 0 else Back(ref.model, front_blocks)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    sched_cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    sched = sched_cls(stage, MICROBATCHES, loss_fn=ref.loss_fn)
    opt = adamw(list(module.parameters()))

    def torch_step() -> None:
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, return_outputs=False)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = alternate({"autopar": lambda: prog.step(x, target=y), "torch": torch_step}, REPS, world)
    split = [kinds[a:e].count("block") for a, e in (st.layers for st in plan.pipelines[0].stages)]
    return {"times": times, "split": split}


# ---- 3. one rank (in this process, no torch.distributed) ------------------------------------------------


def one_rank() -> dict[str, list[float]]:
    case = build()
    x, y = case.example_inputs[0], case.example_target
    prog = Program(case.model, make_plan(case, dp=1, pp=1, m=1), case.example_inputs, y, case.loss_fn,
                   adamw, 0, 1)
    ref = build()
    opt = adamw(list(ref.model.parameters()))

    def eager_step() -> float:
        loss = ref.loss_fn(ref.model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return alternate({"autopar": lambda: prog.step(x, target=y), "eager": eager_step}, REPS_1RANK, 1)


# ---- 5. the plan's self-check (runtime/plan_check.py) -------------------------------------------------------

CHECK_STEPS, CHECK_REPS = 100, 3


def plan_check_overhead() -> dict[str, list[float]]:
    """Seconds of `autopar.compile` + CHECK_STEPS steps on one rank with the plan's self-check on (a profiler
    memory window over building the program and the first steps) and off, alternated CHECK_REPS times."""
    case = build()
    x, y = case.example_inputs[0], case.example_target
    plan = make_plan(case, dp=1, pp=1, m=1).to_json()
    times: dict[str, list[float]] = {"check on": [], "check off": []}
    for r in range(CHECK_REPS):
        for on in (True, False) if r % 2 == 0 else (False, True):
            model = build().model
            t0 = time.perf_counter()
            prog = autopar.compile(model, "1x1xcpu", (x,), y, case.loss_fn, adamw, plan=plan, check_plan=on)
            for _ in range(CHECK_STEPS):
                prog.step(x, target=y)
            times["check on" if on else "check off"].append(time.perf_counter() - t0)
    return times


# ---- 4. memory -------------------------------------------------------------------------------------------


def memory(rank: int, world: int, plan_json: str) -> dict[str, Any]:
    """Peak live tensor bytes at the allocator over compile + MEMORY_STEPS steps (runtime/memtrace.py);
    the user's model, built before, is not in the window."""
    case = build()
    x, y = case.example_inputs[0], case.example_target
    with track_memory() as trace:
        with phase("compile"):
            prog = compile_program(case.model, CLUSTER, case.example_inputs, y, case.loss_fn, "adamw",
                                   plan=plan_json)
        for k in range(MEMORY_STEPS):
            with phase(f"step {k + 1}"):
                prog.step(x, target=y)
    out = trace.summary()
    out["steps_peak_bytes"] = max(b for p, b in trace.phase_peaks.items() if p.startswith("step"))
    return out


def planned_components(plan: Plan, n_params: int) -> dict[str, float] | None:
    """The planner's terms of a pure data-parallel plan's peak, per the formula in solver/pricing/pricing.py;
    activations are what remains of the prediction. None for layouts this does not decompose."""
    st = plan.pipelines[0].stages[0]
    if any(len(p.stages) != 1 or len(p.stages[0].devices) != 1 for p in plan.pipelines) \
            or "params" in st.offload or st.zero == 3:
        return None
    per = state_bytes_per_param(plan.optimizer, plan.precision)
    dp = len(plan.pipelines)
    zero = st.zero if dp > 1 else 0
    opt = 0.0 if "optimizer" in st.offload else n_params * per.optimizer / (dp if zero >= 1 else 1)
    out = {"params": float(n_params * per.weights), "grads": n_params * per.grads / (dp if zero >= 2 else 1),
           "optimizer": opt}
    out["act"] = plan.predicted["peak_memory_bytes"][0] - sum(out.values())
    return out


# ---- driver ----------------------------------------------------------------------------------------------


def two_ranks(rank: int, world: int, plan_json: str) -> dict[str, Any]:
    out: dict[str, Any] = {"dp": data_parallel(rank, world)}
    for schedule in ("1f1b", "gpipe"):
        out[schedule] = pipeline(rank, world, schedule)
    out["memory"] = memory(rank, world, plan_json)
    return out


def spread(ratios: list[float]) -> str:
    q = statistics.quantiles(ratios, n=4)
    return f"{q[0]:.3f}-{q[2]:.3f}"


def throughput_row(name: str, a: str, b: str, times: dict[str, list[float]], target: float) -> dict:
    sps = {k: CFG["batch"] / statistics.median(v) for k, v in times.items()}
    # samples/s ratio = inverse ratio of seconds per step
    ratios = [t / a for t, a in zip(times["torch"], times["autopar"], strict=True)]
    ratio = statistics.median(ratios)
    # interference from other processes only ever adds time, so the fastest blocks are a second, robust view
    best = min(times["torch"]) / min(times["autopar"])
    return {"comparison": name, "A": a, "B": b, "A_value": sps["autopar"], "B_value": sps["torch"],
            "unit": "samples/s", "ratio": ratio, "IQR": spread(ratios), "best": best,
            "target": f">= {target}", "met": "yes" if ratio >= target else "NO"}


def memory_notes(plan: Plan, n_params: int, ranks: list[dict]) -> list[str]:
    mib = lambda b: f"{b / 2**20:.2f}"
    st = plan.pipelines[0].stages[0]
    m = ranks[0]["memory"]
    lines = [
        f"plan: {len(plan.pipelines)} pipeline(s) x {len(plan.pipelines[0].stages)} stage(s), "
        f"ZeRO {st.zero}, recompute {st.recompute}, offload {list(st.offload) or 'none'}, {plan.precision}, "
        f"{plan.optimizer}; predicted peak {mib(plan.predicted['peak_memory_bytes'][0])} MiB per device "
        f"(the {100 * plan.memory_reserve:.0f}% memory reserve only limits capacity, it is not in the "
        f"prediction).",
        f"measured, rank 0: peak live tensor bytes over compile + {MEMORY_STEPS} steps {mib(m['peak_bytes'])} "
        f"MiB (highest during a step {mib(m['steps_peak_bytes'])} MiB), reached at '{m['peak_label']}'.",
        "live at the peak (MiB, phase: what allocated it): "
        + "; ".join(f"{k} {mib(v)}" for k, v in m["at_peak"].items() if v >= 2**18) + "."]
    comp = planned_components(plan, n_params)
    if comp is None:
        lines.append("planner terms: not decomposed for this layout (see solver/pricing/pricing.py stage_memory).")
    else:
        lines.append(f"planner terms (solver/pricing/pricing.py stage_memory) (MiB): params {mib(comp['params'])}, "
                     f"gradients {mib(comp['grads'])}, optimizer state {mib(comp['optimizer'])}, activations "
                     f"(the rest) {mib(comp['act'])}.")
    return lines


def main() -> None:
    t_start = time.perf_counter()
    threads = torch.get_num_threads()
    load_before = os.getloadavg()
    case = build()
    # one thread in this process too, like each spawned rank; the idle core absorbs OS noise
    torch.set_num_threads(1)
    one = one_rank()
    check = plan_check_overhead()
    torch.set_num_threads(threads)

    plan = autopar.plan(case.model, CLUSTER, case.example_inputs, case.example_target, case.loss_fn,
                        optimizer="adamw", time_limit_s=30)
    ranks = spawn_local(two_ranks, 2, plan.to_json(), timeout_s=270)
    r0 = ranks[0]

    rows = [throughput_row("data parallel, 2 ranks", "autopar dp=2", "torch DDP", r0["dp"], TARGETS["dp"])]
    for schedule, label in (("1f1b", "1F1B"), ("gpipe", "GPipe")):
        rows.append(throughput_row(f"pipeline pp=2 {label}, {MICROBATCHES} mb", f"autopar {label}",
                                   f"torch.pipelining {label}", r0[schedule]["times"], TARGETS["pp"]))
    ratios = [100 * (a / e - 1) for a, e in zip(one["autopar"], one["eager"], strict=True)]
    overhead = statistics.median(ratios)
    rows.append({"comparison": "1 rank, overhead %", "A": "autopar 1 rank", "B": "eager",
                 "A_value": CFG["batch"] / statistics.median(one["autopar"]),
                 "B_value": CFG["batch"] / statistics.median(one["eager"]), "unit": "samples/s",
                 "ratio": overhead, "IQR": spread(ratios),
                 "best": 100 * (min(one["autopar"]) / min(one["eager"]) - 1),
                 "target": f"<= {TARGETS['overhead_pct']}%",
                 "met": "yes" if overhead <= TARGETS["overhead_pct"] else "NO"})
    check_ratios = [100 * (a / b - 1) for a, b in zip(check["check on"], check["check off"], strict=True)]
    check_pct = statistics.median(check_ratios)
    rows.append({"comparison": f"plan self-check, compile + {CHECK_STEPS} steps, overhead %", "A": "check on",
                 "B": "check off", "A_value": statistics.median(check["check on"]),
                 "B_value": statistics.median(check["check off"]), "unit": "s", "ratio": check_pct,
                 "IQR": spread(check_ratios), "best": 100 * (min(check["check on"]) / min(check["check off"]) - 1),
                 "target": f"<= {TARGETS['overhead_pct']}%",
                 "met": "yes" if check_pct <= TARGETS["overhead_pct"] else "NO"})
    predicted = plan.predicted["peak_memory_bytes"]
    for rank, r in enumerate(ranks):
        ratio = r["memory"]["peak_bytes"] / predicted[rank]
        rows.append({"comparison": f"peak memory, rank {rank}", "A": "measured", "B": "plan prediction",
                     "A_value": r["memory"]["peak_bytes"] / 2**20, "B_value": predicted[rank] / 2**20,
                     "unit": "MiB", "ratio": ratio, "target": f"1 +- {TARGETS['memory_tol']}",
                     "met": "yes" if abs(ratio - 1) <= TARGETS["memory_tol"] else "NO"})
    wall = time.perf_counter() - t_start
    load_after = os.getloadavg()
    n_params = sum(p.numel() for p in case.model.parameters())

    cfg = ", ".join(f"{k}={v}" for k, v in CFG.items())
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, {threads} intra-op threads; each gloo "
          f"rank and the 1-rank comparison use 1 thread. Load average {load_before[0]:.1f} before, "
          f"{load_after[0]:.1f} after (above ~2 means other work shares the cores: ratios stay paired, "
          f"absolute samples/s do not).")
    print(f"model: models.gpt({cfg}), {n_params / 1e6:.2f}M params, AdamW lr={LR}. {REPS} ABBA-alternated "
          f"blocks of {STEPS} steps per contender after {WARMUP} warm-up steps ({REPS_1RANK} blocks for 1 "
          f"rank); ratio = median of the per-block paired ratios (IQR beside it; 'best' = the same from each "
          f"contender's fastest block); met judges the median; A_value/B_value = median samples/s.\n")
    print_table(rows, ["comparison", "A", "B", "A_value", "B_value", "unit", "ratio", "IQR", "best", "target",
                       "met"])
    print(f"\npipeline layer split (blocks per stage), the same for both contenders: {r0['1f1b']['split']}")
    print("\nmemory:")
    for line in memory_notes(plan, n_params, ranks):
        print("  " + line)
    missed = [r["comparison"] for r in rows if r["met"] != "yes"]
    print("\nTARGETS MISSED: " + "; ".join(missed) if missed else "\nall targets met")
    print(f"total wall time {wall:.0f} s")

    stage = plan.pipelines[0].stages[0]
    summary = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "threads": threads,
                           "rank_threads": 1, "loadavg_before": load_before[0],
                           "loadavg_after": load_after[0]},
               "config": {**CFG, "microbatches": MICROBATCHES, "reps": REPS, "steps_per_block": STEPS},
               "dp_ratio": rows[0]["ratio"], "pp_1f1b_ratio": rows[1]["ratio"],
               "pp_gpipe_ratio": rows[2]["ratio"],
               "one_rank_overhead_pct": overhead, "pp_layer_split": r0["1f1b"]["split"],
               "memory": [r["memory"] for r in ranks], "plan_peak_bytes": predicted,
               "plan_components": planned_components(plan, n_params),
               "plan_options": {"pipelines": len(plan.pipelines), "zero": stage.zero,
                                "recompute": stage.recompute, "offload": list(stage.offload)},
               "targets": TARGETS, "missed": missed, "wall_s": wall,
               "raw_times_s": {"dp": r0["dp"], "1f1b": r0["1f1b"]["times"], "gpipe": r0["gpipe"]["times"],
                               "one_rank": one}}
    print("wrote", write_results("runtime", rows, summary))


if __name__ == "__main__":
    main()
