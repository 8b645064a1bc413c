"""autopar's planner against baselines priced by the same cost model.

Per case, the predicted training throughput (samples/s) of
  autopar     `autopar.plan()` with its default 60 s time limit (capture included in `plan_s`)
  DP-only     dp = every device, tp = pp = 1, even batch split (as even as possible when the batch does
              not divide), the smallest ZeRO stage 0..3 at which some plan fits; at that stage the
              fastest of 1/2/4/8 micro-batches (gradient accumulation) x recompute off/on
  DP-speed    the same, with each device's batch share proportional to its speed on the model (the cost
              model's forward + backward time per sample), at least one sample each, and every replica
              running 1/2/4/8 micro-batches of its own share (as autopar's uneven replicas may)
  Megatron    grid over uniform (dp, tp, pp, micro-batch size) in Megatron rank order with even layer and
              batch splits: tp a power of two dividing every node's device count (tp stays in a node),
              pp dividing the repeated blocks, dp = world / (tp pp) dividing the batch, micro-batch
              sizes the powers of two dividing the per-replica batch and that batch itself, ZeRO 0/1,
              recompute off/on, 1F1B and interleaved 1F1B (2 or 4 chunks, Megatron's divisibility
              rules), and each such plan also with its stage sends compressed where autopar's plan may
              compress them (`CostModel.compress_choice`: bf16 on slow links in fp32/tf32 training); the
              fastest that fits
  exhaustive  (small cases only) the optimum over every plan of equal-depth pipelines: every tp degree
              autopar allows (one per plan), every assignment and order of the tp groups into pipelines, gpipe / 1f1b /
              interleaved (2, 4 chunks), every batch split, every micro-batch count per pipeline, every
              layer split and every per-stage ZeRO / recompute / offload combination. Options are pruned
              only by dominance (a per-rank combination that fits and is no slower in every stage time
              than another beats it: the simulated step is monotone in every stage time), and pipelines
              are optimised independently (the step is the slowest pipeline's, and a pipeline's times and
              memory do not depend on the others' choices). The optimum is re-priced with
              `pricing.price` as a whole plan. Run twice: over that whole space, and restricted to the
              part autopar's search enumerates (its groupings, its schedules but zero-bubble ones, its shared
              micro-batch sizes), which separates a search that misses its own optimum from a space that
              lacks the optimum.
Baselines are priced like `autopar.estimate` (`price_strategy` on one cost model per case, built by
`autopar.api.cost_model` as `plan`/`estimate` do); the first case checks that against `autopar.estimate`.

Ideal: total training FLOPs of a step (forward + backward of every layer, as in the plan's MFU) over the
sum of every device's peak FLOP/s at the plan's precision; each method is reported as a fraction of it.

Every figure is a prediction of the same cost model, so the ratios compare predictions with predictions.
A plan that stopped at autopar.plan's time limit (the search's warning: best plan so far after k of N
configurations) is marked `plan_time_limited` with `plan_configs` = "k/N".

Targets: autopar never below the best baseline (DP-only, DP-speed, Megatron); >= 1.3x the best uniform plan
(the same baselines) on the heterogeneous cases, 3 and 4 (case 5's four boards are all one device type, so
a uniform plan is the natural one there and only the never-below target applies); <= 60 s planning for
GPT-3 175B on 1024 A100s; at least the exhaustive optimum on the exhaustive cases (within 1e-9 relative;
autopar's space is the larger one: it also has zero-bubble schedules, which the exhaustive search does not
price, so it may beat it).

Scaling: planning time of GPT-3 175B (batch 1536) on 64 to 16,384 A100-80GB (`scaling`), printed as a table
and stored under the summary's "scaling". Times are wall-clock on whatever machine runs this (a shared one
is slower while others run).

The peers' published plans (AMP's and Sailor's, on their own clusters and models) against autopar's own plan,
priced by the same `estimate()` pricing: bench/peers.py (Metis's plans are not in ../shared/reference).

Run: cd bench && python planner.py
"""

from __future__ import annotations

import itertools
import math
import re
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from baselines import dp_only, dp_speed, megatron_grid
from common import print_table, write_results

import autopar
from autopar import models
from autopar.api import cost_model
from autopar.ir.plan import OFFLOAD_KINDS, Estimate, Pipeline, Plan, Stage, Strategy, simulate_stages
from autopar.solver.pricing.pricing import (
    CostModel,
    Option,
    StageTimes,
    inflight_closed_form,
    model_summary,
    price,
    rank_peak,
    stage_option,
    tied_sync,
)
from autopar.solver.search.search import (
    config_communicators,
    config_microbatch_sizes,
    divisors,
    groupings,
    microbatch_count,
    schedules,
    tp_units,
)
from autopar.solver.split.surrogate import position_microbatches

TIME_LIMIT_S = 60.0  # autopar.plan's default
EXACT_RTOL = 1e-9
HET_TARGET = 1.3
PLAN_TIME_TARGET_S = 60.0
EXHAUSTIVE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")  # the schedules the exhaustive search prices
TINY_GPT = dict(layers=4, hidden=1024, heads=16, seq=512, vocab=8192)


@dataclass(frozen=True)
class Case:
    key: str
    model: str  # a models.gpt_config preset, or "tiny-gpt"
    batch: int
    cluster: str
    het_target: bool = False  # the >= 1.3x-over-uniform target applies
    exhaustive: bool = False
    plan_time_target: bool = False


CASES = [
    Case("1 gpt-1.3b", "gpt-1.3b", 64, "1x8xA100-80GB"),
    Case("2 gpt3-175b", "gpt3-175b", 1536, "128x8xA100-80GB", plan_time_target=True),
    Case("3 llama-7b", "llama-7b", 96, "1x8xA100-80GB+1x8xV100-32GB+2x4xT4", het_target=True),
    Case("4 gpt2-medium", "gpt2-medium", 32, "3x4xV100-16GB+1x4xT4", het_target=True),
    Case("5 bert-base", "bert-base", 32, "4x1xJetson-AGX-Orin"),
    Case("6 tiny-gpt", "tiny-gpt", 24, "1x1xA100-80GB+1x1xT4", exhaustive=True),
    Case("7 tiny-gpt", "tiny-gpt", 24, "1x2xA100-80GB+1x1xV100-16GB", exhaustive=True),
]


def build(case: Case) -> models.ModelCase:
    if case.model == "tiny-gpt":
        return models.gpt(**TINY_GPT, batch=case.batch, device="meta")
    factory: Callable[..., models.ModelCase] = {"llama-7b": models.llama, "bert-base": models.hf_bert}.get(
        case.model, models.gpt)
    return factory(**models.gpt_config(case.model), batch=case.batch, device="meta")


def ideal_samples_per_s(cm: CostModel) -> float:
    flops = sum(layer.flops_fwd + layer.flops_bwd for layer in cm.graph.layers)
    peak = sum(d.spec.flops(cm.precision) for d in cm.cluster.devices)
    return cm.B * peak / flops


def _runs(tokens: list[str]) -> str:
    """['a', 'b', 'b', 'b'] -> 'a>b*3'."""
    out = []
    for tok, run in itertools.groupby(tokens):
        n = len(list(run))
        out.append(tok if n == 1 else f"{tok}*{n}")
    return ">".join(out)


def describe(plan: Plan) -> str:
    """One line: schedule, pipelines x stages, tp, batch shares, micro-batches, options."""
    pipes = plan.pipelines
    tps = sorted({s.tp for p in pipes for s in p.stages})
    shares = sorted({p.batch_share for p in pipes}, reverse=True)
    mbs = sorted({f"{p.num_microbatches}x{p.microbatch_size}" for p in pipes})
    zero = sorted({s.zero for p in pipes for s in p.stages})
    rc = sorted({s.recompute for p in pipes for s in p.stages})
    off = sorted({"+".join(s.offload) or "-" for p in pipes for s in p.stages})
    sched = plan.schedule + (f"x{plan.chunks}" if plan.chunks > 1 else "")
    ranks = sorted({len(p.stages) // plan.chunks for p in pipes})
    names = plan.device_names()
    layout = sorted({_runs([f"{names[s.devices[0]]}:{s.layers[1] - s.layers[0]}" for s in p.stages])
                     for p in pipes})
    return (f"{sched} dp={len(pipes)} pp={'/'.join(map(str, ranks))} tp={'/'.join(map(str, tps))} "
            f"shares={'/'.join(map(str, shares))} mb={','.join(mbs)} zero={'/'.join(map(str, zero))} "
            f"rc={'/'.join('y' if r else 'n' for r in rc)} offload={','.join(off)} "
            f"bubble={100 * plan.predicted.get('bubble_fraction', 0.0):.0f}% layers=[{' | '.join(layout)}]")


def strategy_label(st: Strategy) -> str:
    sched = st.schedule + (f"x{st.chunks}" if st.chunks else "")
    split = "" if st.batch_split is None else f" split={min(st.batch_split)}..{max(st.batch_split)}"
    sends = f" sends={st.compress} where slow" if st.compress else ""
    return (f"{sched} dp={st.dp} tp={st.tp} pp={st.pp} mbs={st.microbatch_size} zero={st.zero} "
            f"rc={'y' if st.recompute else 'n'}{split}{sends}")


# ---- exhaustive search ------------------------------------------------------------------------------


def _all_options(D: int, has_blocks: bool) -> list[Option]:
    offloads = [tuple(k for i, k in enumerate(OFFLOAD_KINDS) if mask >> i & 1)
                for mask in range(1 << len(OFFLOAD_KINDS))]
    return [Option(z, rc, off) for off in offloads for z in (range(4) if D > 1 else (0,))
            for rc in ((False, True) if has_blocks else (False,))]


def _pareto(items: list[tuple[tuple, Any]]) -> list[tuple[tuple, Any]]:
    """The items whose vector no other item's vector is <= in every component (one of equal vectors)."""
    kept: list[tuple[tuple, Any]] = []
    for vec, x in sorted(items, key=lambda it: it[0]):
        if not any(all(k <= v for k, v in zip(kv, vec, strict=True)) for kv, _ in kept):
            kept.append((vec, x))
    return kept


class Exhaustive:
    """The optimum over the plan space described in the module docstring, on one cost model."""

    def __init__(self, cm: CostModel) -> None:
        self.cm = cm
        self._stage: dict[tuple, list[tuple[tuple, Any]]] = {}
        self.simulated = 0

    @staticmethod
    def arrangements(units: list[tuple[int, ...]], p: int) -> Iterator[tuple[tuple[tuple[int, ...], ...], ...]]:
        """Every split of `units` into pipelines of p ordered ranks (the pipelines themselves unordered)."""
        if not units:
            yield ()
            return
        first, rest = units[0], units[1:]
        for others in itertools.combinations(rest, p - 1):
            left = [u for u in rest if u not in others]
            for order in itertools.permutations((first, *others)):
                for tail in Exhaustive.arrangements(left, p):
                    yield (order, *tail)

    def stage_choices(self, a: int, e: int, unit: tuple[int, ...], dp: tuple[int, ...], full: int, small: int,
                      inflight: int) -> list[tuple[tuple, Any]]:
        """Non-dominated (times + memory) options of one stage: ((fwd, fwd_small, bwd, bwd_small, sync,
        static, act, work), (option, times, memory))."""
        key = (a, e, unit, dp, full, small, inflight)
        if key not in self._stage:
            cm = self.cm
            dtype = cm.cluster.devices[unit[0]].spec.name
            base = cm.base(a, e, dtype, full, unit)
            small_base = cm.base(a, e, dtype, small, unit) if small else None
            items = []
            for opt in _all_options(len(dp), base.has_blocks):
                tf = cm.stage_times(base, opt, dtype, unit, dp)
                ts = (cm.stage_times(small_base, opt, dtype, unit, dp) if small_base is not None
                      else StageTimes(0.0, 0.0, 0.0, tf.sync))
                mem = cm.stage_memory(base, opt, len(unit), len(dp))
                act = (min(inflight, 1) if mem.offload_act else inflight) * mem.act
                items.append(((tf.fwd, ts.fwd, tf.bwd, ts.bwd, tf.sync, mem.static, act, mem.work),
                              (opt, mem, base.out_bytes)))
            self._stage[key] = _pareto(items)
        return self._stage[key]

    def pipeline_best(self, pipe: tuple[tuple[int, ...], ...], dp_groups: list[tuple[int, ...]], sched: str,
                      v: int, share: int, counts: list[int]) -> tuple[float, Any] | None:
        """Fastest (step, (m, edges, options)) of one pipeline taking `share` samples in m of `counts`
        micro-batches; None if nothing fits."""
        cm, p = self.cm, len(pipe)
        S = p * v
        best: tuple[float, Any] | None = None
        comms = config_communicators((pipe,), list(dp_groups), v, cm.cluster.world_size)  # as the search counts
        for m in counts:
            full = -(-share // m)
            small = full - 1 if share % m else 0
            inflight = cm.peak_inflight(sched, p, m, v)
            for cuts in itertools.combinations(range(1, cm.L), S - 1):
                edges = (0, *cuts, cm.L)
                per_rank = []
                for r in range(p):
                    stages = range(r, S, p)
                    lists = [self.stage_choices(edges[j], edges[j + 1], pipe[r], dp_groups[j], full, small,
                                                inflight[r]) for j in stages]
                    budget = min(cm.usable(d, comms.get(d)) for d in pipe[r])
                    combos = []
                    for combo in itertools.product(*lists):
                        # micro-batches as the search's positions count them (`Slot.microbatches`)
                        if rank_peak([c[1][1] for c in combo], inflight[r], position_microbatches(m, v)) <= budget:
                            combos.append((tuple(x for c in combo for x in c[0][:5]), combo))
                    if not combos:
                        break
                    per_rank.append(_pareto(combos))
                if len(per_rank) < p:
                    continue
                tied = tied_sync(cm, [(edges[j], edges[j + 1], pipe[j % p], dp_groups[j]) for j in range(S)])
                for pick in itertools.product(*per_rank):
                    chosen: list[Any] = [None] * S
                    for r, (_, combo) in enumerate(pick):
                        for k, j in enumerate(range(r, S, p)):
                            chosen[j] = combo[k]
                    vals = []
                    for j, c in enumerate(chosen):
                        send = (cm.boundary_send(c[1][2], pipe[j % p][0], pipe[(j + 1) % p][0]) if j + 1 < S
                                else 0.0)
                        f, fs, b, bs, sync = c[0][:5]
                        vals.append((f, fs, b, bs, send, sync + tied[j]))
                    step = simulate_stages(sched, v, share, m, vals).step_time
                    self.simulated += 1
                    if best is None or step < best[0]:
                        best = (step, (m, edges, [c[1][0] for c in chosen]))
        return best

    def spaces(self, autopar_space: bool) -> Iterator[tuple[tuple, str, int, Callable[[int], list[int]]]]:
        """(pipelines, schedule, chunks, micro-batch counts allowed for a share) of the whole plan space,
        or of the part autopar's search enumerates (its groupings, schedules and micro-batch sizes)."""
        cm = self.cm
        per_node = math.gcd(*(len(n.devices) for n in cm.cluster.nodes))
        for t in divisors(per_node):
            units = tp_units(cm, t)
            if autopar_space:
                for _, pipes in groupings(cm, units):
                    p = len(pipes[0])
                    for sched, v in schedules(p, cm.L):
                        if sched not in EXHAUSTIVE_SCHEDULES:
                            continue  # its stage times need more than `stage_times` gives (zero-bubble W split)
                        for b in config_microbatch_sizes(cm, pipes):
                            yield pipes, sched, v, lambda s, b=b, p=p, sched=sched: [
                                m for m in [microbatch_count(s, min(b, s), p, sched)] if m is not None]
                continue
            for D in divisors(len(units)):
                p = len(units) // D
                if D > cm.B or p > cm.L:
                    continue
                scheds = [("gpipe", 1), ("1f1b", 1)] + [("interleaved_1f1b", v) for v in (2, 4)
                                                        if p > 1 and p * v <= cm.L]
                for pipes in self.arrangements(units, p):
                    for sched, v in scheds:
                        yield pipes, sched, v, lambda s, p=p, sched=sched: [
                            m for m in range(1, s + 1) if sched != "interleaved_1f1b" or m % p == 0]

    def run(self, autopar_space: bool = False) -> tuple[float, Plan | None]:
        cm = self.cm
        best_step, best_plan = math.inf, None
        for pipes, sched, v, counts in self.spaces(autopar_space):
            D, p = len(pipes), len(pipes[0])
            dp_groups = [tuple(pipe[j % p][0] for pipe in pipes) for j in range(p * v)]
            tables: list[dict[int, Any]] = [{} for _ in pipes]
            for cuts in itertools.combinations(range(1, cm.B), D - 1):
                shares = [b - a for a, b in zip((0, *cuts), (*cuts, cm.B), strict=True)]
                for d, s in enumerate(shares):
                    if s not in tables[d]:
                        tables[d][s] = self.pipeline_best(pipes[d], dp_groups, sched, v, s, counts(s))
                got = [tables[d][s] for d, s in enumerate(shares)]
                if any(g is None for g in got):
                    continue
                step = max(g[0] for g in got)
                if step < best_step:
                    best_step, best_plan = step, self.plan(pipes, sched, v, shares, [g[1] for g in got])
        return best_step, best_plan

    def plan(self, pipes, sched: str, v: int, shares: list[int], picks: list[Any]) -> Plan:
        cm, out = self.cm, []
        for pipe, share, (m, edges, opts) in zip(pipes, shares, picks, strict=True):
            p = len(pipe)
            stages = [Stage([edges[j], edges[j + 1]], list(pipe[j % p]), o.zero, o.recompute, list(o.offload),
                            None if j + 1 == len(opts) else cm.compress_choice(
                                cm.base(edges[j], edges[j + 1], cm.cluster.devices[pipe[j % p][0]].spec.name,
                                        -(-share // m), pipe[j % p]).out_bytes, pipe[j % p][0], pipe[(j + 1) % p][0]))
                      for j, o in enumerate(opts)]
            out.append(Pipeline(share, -(-share // m), m, stages))
        return Plan(cm.B, cm.precision, cm.optimizer, sched, v, cm.cluster.to_dict(), model_summary(cm.graph),
                    out, {}, cm.reserve)


# ---- driver -----------------------------------------------------------------------------------------


def _sps(est: Estimate | Plan | None) -> float | None:
    if est is None:
        return None
    return est.predicted["samples_per_s"]


def run_case(case: Case, check_api: bool) -> dict[str, Any]:
    mc = build(case)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.plan(mc.model, case.cluster, mc.example_inputs, mc.example_target, mc.loss_fn,
                            time_limit_s=TIME_LIMIT_S)
    plan_s = time.perf_counter() - t0
    limit = next((str(w.message) for w in caught if "planning stopped" in str(w.message)), None)
    cm = cost_model(mc.model, case.cluster, mc.example_inputs, mc.example_target, mc.loss_fn)
    # the baselines' cost model must price autopar's own plan exactly as the planner did
    repriced = price(cm, plan)
    assert repriced is not None and repriced.fits
    assert repriced.plan.predicted["step_time_s"] == plan.predicted["step_time_s"]

    ideal = ideal_samples_per_s(cm)
    row: dict[str, Any] = {
        "case": case.key, "model": case.model, "cluster": case.cluster, "batch": cm.B,
        "precision": cm.precision, "params": cm.graph.num_params(), "ideal_sps": ideal,
        "plan_s": plan_s, "plan_time_limited": limit is not None, "plan_configs": time_limit_configs(limit),
        "time_limit": f"hit ({time_limit_configs(limit)})" if limit else "-",
        "autopar_step_s": plan.predicted["step_time_s"], "autopar_sps": _sps(plan), "autopar_plan": describe(plan),
    }
    t1 = time.perf_counter()
    dp_est, dp_st, dp_n = dp_only(cm)
    row.update(dp_sps=_sps(dp_est), dp_priced=dp_n,
               dp_plan=f"{strategy_label(dp_st)} | {describe(dp_est.plan)}" if dp_est and dp_st else "none fits")
    sp_est, sp_st, sp_n = dp_speed(cm)
    row.update(dpspeed_sps=_sps(sp_est), dpspeed_priced=sp_n,
               dpspeed_plan=f"{strategy_label(sp_st)} | {describe(sp_est.plan)}" if sp_est and sp_st else "none fits")
    grid_est, grid_st, grid_n, grid_fit = megatron_grid(cm)
    row.update(grid_sps=_sps(grid_est), grid_priced=grid_n, grid_fit=grid_fit,
               grid_plan=f"{strategy_label(grid_st)} | {describe(grid_est.plan)}" if grid_est and grid_st
               else "none fits")
    row["baselines_s"] = time.perf_counter() - t1
    if grid_est is not None and grid_est.predicted["samples_per_s"] > row["autopar_sps"]:
        row["grid_chunk_memory_note"] = chunk_memory_note(cm, grid_est)
    if check_api and grid_st is not None and grid_est is not None and grid_st.compress is None:
        via_api = autopar.estimate(mc.model, case.cluster, grid_st, mc.example_inputs, mc.example_target,
                                   mc.loss_fn)
        row["api_check_rel_diff"] = abs(via_api.predicted["step_time_s"] / grid_est.predicted["step_time_s"] - 1)
    if case.exhaustive:
        ex = Exhaustive(cm)
        for tag, restricted in (("exh", False), ("exh_space", True)):
            t2 = time.perf_counter()
            step, ex_plan = ex.run(autopar_space=restricted)
            row[f"{tag}_s"] = time.perf_counter() - t2
            if ex_plan is None:
                row.update({f"{tag}_sps": None, f"{tag}_plan": "none fits", f"{tag}_exact": False})
                continue
            priced = price(cm, ex_plan)
            assert priced is not None and priced.fits
            ex_step = priced.plan.predicted["step_time_s"]
            assert math.isclose(ex_step, step, rel_tol=1e-12), (ex_step, step)
            row.update({f"{tag}_step_s": ex_step, f"{tag}_sps": cm.B / ex_step, f"{tag}_plan": describe(priced.plan),
                        f"{tag}_exact": plan.predicted["step_time_s"] <= ex_step * (1 + EXACT_RTOL)})
        row["exhaustive_simulated"] = ex.simulated
    for k in ("autopar", "dp", "dpspeed", "grid", "exh", "exh_space"):
        if row.get(f"{k}_sps") is not None:
            row[f"{k}_ideal"] = row[f"{k}_sps"] / ideal
    uniform = [x for x in (row["dp_sps"], row["dpspeed_sps"], row["grid_sps"]) if x is not None]
    row["best_baseline_sps"] = max(uniform) if uniform else None
    row["vs_best_baseline"] = row["autopar_sps"] / max(uniform) if uniform else None
    return row


def time_limit_configs(warning: str | None) -> str | None:
    """"k/N" configurations searched, from the search's time-limit warning (None without one)."""
    got = re.search(r"after (\d+) of (\d+) configurations", warning or "")
    return f"{got[1]}/{got[2]}" if got else None


def chunk_memory_note(cm: CostModel, est: Estimate) -> str | None:
    """When a baseline interleaves, whether one of its chunks needs more than the 1/chunks share of a
    device's memory that autopar's interleaved layer split grants each chunk (`split.Splitter.split`)."""
    plan = est.plan
    if plan.chunks == 1:
        return None
    pipe = plan.pipelines[0]
    ranks = len(pipe.stages) // plan.chunks
    inflight = inflight_closed_form(plan.schedule, ranks, pipe.num_microbatches, plan.chunks)
    worst = (0.0, 0, 0.0)
    comms = cm.communicators(plan)
    for j, st in enumerate(pipe.stages):
        dtype = cm.cluster.devices[st.devices[0]].spec.name
        base = cm.base(st.layers[0], st.layers[1], dtype, pipe.microbatch_size, tuple(st.devices))
        mem = cm.stage_memory(base, stage_option(st), st.tp, len(plan.pipelines))
        share = min(cm.usable(d, comms.get(d)) for d in st.devices) / plan.chunks
        worst = max(worst, (mem.peak(inflight[j % ranks]) / share, j, share))
    if worst[0] <= 1:
        return None
    need = worst[0] * worst[2]
    return (f"its stage {worst[1]} needs {need / 2**30:.1f} GiB with these options, over the "
            f"{worst[2] / 2**30:.1f} GiB (1/{plan.chunks} of the device) that autopar's interleaved layer split "
            f"allows one chunk, though the whole device fits "
            f"({max(plan.predicted['peak_memory_bytes'].values()) / 2**30:.1f} GiB peak)")


def _yn(ok: bool) -> str:
    return "yes" if ok else "NO"


SCALING_SIZES = (64, 256, 1024, 4096, 16384)  # A100-80GB devices, 8 per node
SCALING_MODEL, SCALING_BATCH = "gpt3-175b", 1536


def scaling() -> list[dict[str, Any]]:
    """Planning time of GPT-3 175B (batch 1536) vs cluster size: `autopar.plan` end to end (capture included)
    with its default time limit, on N/8 nodes of 8 A100-80GB."""
    out = []
    mc = build(Case("scaling", SCALING_MODEL, SCALING_BATCH, ""))
    for n in SCALING_SIZES:
        cluster = f"{n // 8}x8xA100-80GB"
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = autopar.plan(mc.model, cluster, mc.example_inputs, mc.example_target, mc.loss_fn,
                                time_limit_s=TIME_LIMIT_S)
        limit = next((str(w.message) for w in caught if "planning stopped" in str(w.message)), None)
        out.append({"devices": n, "cluster": cluster, "plan_s": time.perf_counter() - t0,
                    "time_limit": f"hit ({time_limit_configs(limit)})" if limit else "-",
                    "samples_per_s": plan.predicted["samples_per_s"], "plan": describe(plan)})
        row = out[-1]
        print(f"    {n:6d} devices: plan {row['plan_s']:.1f} s {row['time_limit']}  {row['plan']}", flush=True)
    return out


def main() -> None:
    t0 = time.perf_counter()
    rows = []
    for k, case in enumerate(CASES):
        row = run_case(case, check_api=k == 0)
        rows.append(row)
        print(f"[{time.perf_counter() - t0:6.1f} s] case {case.key} on {case.cluster}, batch {case.batch}: "
              f"plan {row['plan_s']:.1f} s", flush=True)
        for who in ("autopar", "dp", "dpspeed", "grid", "exh", "exh_space"):
            if f"{who}_plan" in row:
                print(f"    {who:9s} {row[f'{who}_plan']}")
    print()
    cols = ["case", "batch", "plan_s", "time_limit", "autopar_sps", "dp_sps", "dpspeed_sps", "grid_sps",
            "exh_sps", "exh_space_sps", "autopar_ideal", "grid_ideal", "exh_ideal", "vs_best_baseline"]
    print_table(rows, cols)

    never_below = [r for r in rows if r["vs_best_baseline"] is not None]
    below = [r["case"] for r in never_below if r["vs_best_baseline"] < 1 - EXACT_RTOL]
    het = [r for r in rows if next(c for c in CASES if c.key == r["case"]).het_target]
    het_miss = [r["case"] for r in het if r["vs_best_baseline"] is None or r["vs_best_baseline"] < HET_TARGET]
    big = next(r for r in rows if next(c for c in CASES if c.key == r["case"]).plan_time_target)
    exh = [r for r in rows if "exh_exact" in r]
    inexact = [r["case"] for r in exh if not r["exh_exact"]]
    targets = {
        "never_below_best_baseline": {"met": not below, "missed_on": below},
        "heterogeneous_1.3x_best_uniform": {
            "met": not het_miss, "missed_on": het_miss,
            "ratios": {r["case"]: r["vs_best_baseline"] for r in het}},
        "gpt3_175b_plan_time_le_60s": {"met": big["plan_s"] <= PLAN_TIME_TARGET_S, "plan_s": big["plan_s"]},
        "exact_on_exhaustive_cases": {"met": not inexact, "missed_on": inexact},
    }
    print("\ntargets:")
    ratios = ", ".join(f"{r['case']}: {r['vs_best_baseline']:.2f}x" for r in het)
    for label, ok, extra in (
            ("autopar never below the best baseline", not below, f"below on {', '.join(below)}" if below else ""),
            (f">= {HET_TARGET}x the best uniform plan on the mixed-device cases", not het_miss, ratios),
            (f"GPT-3 175B planning <= {PLAN_TIME_TARGET_S:g} s", big["plan_s"] <= PLAN_TIME_TARGET_S,
             f"{big['plan_s']:.1f} s" + (", stopped early" if big["plan_time_limited"] else "")),
            ("at least the exhaustive optimum", not inexact,
             f"not exact on {', '.join(inexact)}" if inexact else "")):
        print(f"  {label + ':':50s} {_yn(ok):3s}" + (f"  ({extra})" if extra else ""))
    for r in exh:
        print(f"      {r['case']}: autopar / exhaustive = {r['autopar_sps'] / r['exh_sps']:.4f}; "
              f"within autopar's own search space: {'exact' if r['exh_space_exact'] else 'NOT exact'} "
              f"(autopar / that optimum = {r['autopar_sps'] / r['exh_space_sps']:.4f})")
    limited = [r["case"] for r in rows if r["plan_time_limited"]]
    if limited:
        print(f"  note: autopar.plan stopped early (its work budget, or its {TIME_LIMIT_S:g} s wall-clock guard) on "
              f"{', '.join(limited)} (best plan so far)")
    for r in rows:
        if r["case"] in below or r["case"] in het_miss:
            print(f"  MISSED on {r['case']}: autopar {r['autopar_sps']:.4g} samples/s [{r['autopar_plan']}]")
            best = next(k for k in ("dp", "dpspeed", "grid") if r[f"{k}_sps"] == r["best_baseline_sps"])
            name = {"dp": "DP-only", "dpspeed": "DP-speed", "grid": "Megatron grid"}[best]
            print(f"      {name} {r['best_baseline_sps']:.4g} samples/s [{r[f'{best}_plan']}]")
            if r.get("grid_chunk_memory_note"):
                print(f"      the Megatron plan fits, but {r['grid_chunk_memory_note']}")
        if r["case"] in inexact:
            print(f"  MISSED on {r['case']}: autopar {r['autopar_sps']:.4g} samples/s [{r['autopar_plan']}]")
            for tag, what in (("exh", "exhaustive"), ("exh_space", "exhaustive within autopar's search space")):
                print(f"      {what} {r[f'{tag}_sps']:.4g} samples/s [{r[f'{tag}_plan']}]")
    print(f"\nplanning time vs cluster size ({SCALING_MODEL}, batch {SCALING_BATCH}, A100-80GB; a shared machine: "
          f"times vary with its load):")
    scale = scaling()
    print_table(scale, ["devices", "plan_s", "time_limit", "samples_per_s"])
    summary = {"targets": targets, "all_met": all(t["met"] for t in targets.values()), "scaling": scale,
               "time_limit_s": TIME_LIMIT_S, "elapsed_s": time.perf_counter() - t0,
               "api_check_rel_diff": rows[0].get("api_check_rel_diff")}
    if summary["api_check_rel_diff"] is not None:
        print(f"  check: autopar.estimate() vs the cached cost model on case 1's Megatron plan: relative "
              f"difference {summary['api_check_rel_diff']:.1e}")
    print(f"\nall targets met: {_yn(summary['all_met'])}; elapsed {summary['elapsed_s']:.0f} s")
    print("wrote", write_results("planner", rows, summary))


if __name__ == "__main__":
    main()
