"""Recovery from a lost device: time from a killed rank to training resumed, and steps lost, by restart
from a checkpoint and by re-routing without a restart.

Each scenario runs what `autopar run --cluster 1x4xcpu --max-restarts 1 recovery.py --worker ...` runs: 4
local gloo processes under torchrun's elastic agent train a small GPT with `autopar.compiler.train`,
checkpointing every `every` steps. Device 3 records itself lost and exits (os._exit(1)) right after step
`die_after` on the first attempt; the agent stops the others and restarts the group, the worker of device 3
stands down and the other three re-plan, load the newest checkpoint (resharding it) and continue.

Columns (seconds, wall clock): restart = kill -> new worker processes running (agent noticing the exit,
stopping the survivors, rendezvous, spawn); startup = interpreter + torch + autopar imports; join = the
smaller process group; plan = capture + plan on rank 0 + broadcast + building the program; load = the DCP
checkpoint; step = the first step after resuming; total = kill -> first step done. Steps lost = steps
completed before the kill that had to be trained again (those after the last checkpoint).

Re-routing (no restart; `autopar run` without --max-restarts, runtime/reroute.py): 4 local gloo processes
train the same GPT under dp=2 x pp=2 or dp=2 x tp=2 with `autopar.compile`; rank `dying` SIGKILLs itself
after step `die_after`; the survivors re-route its pipeline's micro-batches to the other pipeline and go
on. Columns:
steps_lost (completed steps trained again: 0 when the failed step is redone from the state before it),
detect_s (kill -> the failure diagnosed on the survivors, LOST_AFTER_S of heartbeat watching included),
rebuild_s (agreement, new process group, re-pricing, new program), resume_s = kill -> the redone step
done; samples/s measured before and after the loss against each plan's prediction (a prediction, from the
cost model of the stand-in devices: `after_vs_predicted / before_vs_predicted` removes the model's
constant offset on this machine); copy_MiB = the priced pre-step state copy re-routing holds (largest
device, solver/reroute_memory.py). Written to bench/results/recovery_reroute.json.

Run: cd bench && python recovery.py [--part restart|reroute|all]
"""

from __future__ import annotations

import time

T_PROCESS = time.time()  # before the imports, so startup time is measured

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

CLUSTER = "1x4xcpu"
GPT = {"layers": 4, "batch": 8, "hidden": 128, "seq": 64}
STEPS = 6
DYING_DEVICE = 3
# (checkpoint every, the dying device exits after this step)
SCENARIOS = [(1, 3), (2, 3), (4, 3)]


def _worker(root: str, every: int, die_after: int) -> int:
    import torch

    from autopar import compiler, models
    from autopar.runtime import elastic

    def on_step(info: compiler.StepInfo) -> None:
        if info.attempt == 0 and info.device == DYING_DEVICE and info.step == die_after:
            elastic.mark_lost(info.checkpoint_dir, info.device, "bench: emulated device failure")
            Path(root, "kill.json").write_text(json.dumps({"t_kill": time.time(), "step": info.step}))
            os._exit(1)

    res = compiler.train(lambda: models.gpt(**GPT, seed=0), CLUSTER, STEPS, root, every=every,
                        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), on_step=on_step, keep=2,
                        timeout_s=60)
    if res is not None and res.program.rank == 0:
        Path(root, f"attempt{res.attempt}.json").write_text(json.dumps(
            {"t_process": T_PROCESS, **res.times, "devices": res.devices, "resumed_from": res.resumed_from,
             "world": res.program.world_size}))
    return 0


REROUTE_STEPS = 8
# (the rank that SIGKILLs itself, after this step, strategy): under dp=2 x pp=2 rank 2 holds stage 1 of
# pipeline 0, rank 0 stage 0 of pipeline 0 (its process does not host the store under `autopar run`); under
# dp=2 x tp=2 rank 1 is the second tensor-parallel rank of pipeline 0 (rank 0, its tp peer, goes idle)
REROUTE_SCENARIOS = [(2, 3, "dp=2,pp=2"), (0, 3, "dp=2,pp=2"), (1, 3, "dp=2,tp=2")]


def _strategy(spec: str) -> dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}


def _reroute_worker(root: str, dying: int, die_after: int, spec: str) -> int:
    import signal

    import torch

    import autopar
    from autopar import models

    case = models.gpt(**GPT, seed=0)
    prog = autopar.compile(case.model, os.environ["AUTOPAR_CLUSTER"], case.example_inputs, case.example_target,
                           case.loss_fn, lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                           plan=autopar.Strategy(**_strategy(spec)), timeout_s=10)
    rank = int(os.environ["RANK"])
    before = prog.plan.predicted.get("samples_per_s")
    ends = []
    for i in range(REROUTE_STEPS):
        prog.step(*case.example_inputs, target=case.example_target)
        ends.append(time.time())
        if rank == dying and i + 1 == die_after:
            Path(root, "kill.json").write_text(json.dumps({"t_kill": time.time(), "step": i + 1}))
            os.kill(os.getpid(), signal.SIGKILL)
    if prog.rank == 0:
        events = [{k: v for k, v in vars(e).items() if k != "plan"} for e in getattr(prog, "events", [])]
        Path(root, "reroute.json").write_text(json.dumps(
            {"ends": ends, "events": events, "predicted_before": before, "steps": prog.step_count,
             "world": prog.world_size, "global_batch": prog.plan.global_batch,
             "copy_bytes": max((prog.plan.predicted.get("reroute") or {}).get("copy_bytes", {"-": 0}).values(),
                               default=0)}))
    return 0


def reroute_scenario(dying: int, die_after: int, spec: str) -> dict[str, Any]:
    from autopar.runtime.run import run

    with tempfile.TemporaryDirectory(prefix="autopar-reroute-") as root:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        rc = run([__file__, "--reroute-worker", root, str(dying), str(die_after), spec], CLUSTER)
        if rc != 0:
            raise SystemExit(f"re-route scenario rank {dying} after step {die_after}: the job failed (exit {rc})")
        kill = json.loads(Path(root, "kill.json").read_text())
        r = json.loads(Path(root, "reroute.json").read_text())
    [ev] = r["events"]
    ends, b = r["ends"], r["global_batch"]
    redo = ev["step"] - 1  # index of the redone step in `ends`
    rate = lambda a, z: b * (z - a) / (ends[z] - ends[a])  # samples/s over steps a+1..z
    before = rate(0, die_after - 1)  # the first step (warm-up) left out
    after = rate(redo, len(ends) - 1)
    pred_after = ev["predicted_samples_per_s"]
    return {
        "strategy": spec, "dying_rank": dying, "killed_after_step": kill["step"], "steps_done": r["steps"],
        "steps_lost": kill["step"] - (ev["step"] - 1), "world_after": r["world"],
        "detect_s": ev["t_failed"] - kill["t_kill"], "rebuild_s": ev["t_rebuilt"] - ev["t_failed"],
        "resume_s": ev["t_resumed"] - kill["t_kill"],
        "before_samples_per_s": before, "after_samples_per_s": after,
        "predicted_before": r["predicted_before"], "predicted_after": pred_after,
        "before_vs_predicted": before / r["predicted_before"], "after_vs_predicted": after / pred_after,
        "after_vs_predicted_calibrated": (after / pred_after) / (before / r["predicted_before"]),
        "copy_MiB": r["copy_bytes"] / 2**20,  # the priced pre-step copy after the loss, largest device
    }


def scenario(every: int, die_after: int) -> dict[str, Any]:
    from autopar.runtime.run import run

    with tempfile.TemporaryDirectory(prefix="autopar-recovery-") as root:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        start = time.time()
        rc = run([__file__, "--worker", root, str(every), str(die_after)], CLUSTER, max_restarts=1)
        wall = time.time() - start
        if rc != 0:
            raise SystemExit(f"scenario every={every} die_after={die_after}: the job failed (exit code {rc})")
        kill = json.loads(Path(root, "kill.json").read_text())
        a = json.loads(Path(root, "attempt1.json").read_text())
    resumed = a["resumed_from"] or 0
    return {
        "every": every, "killed_after_step": kill["step"], "resumed_from": resumed,
        "steps_lost": kill["step"] - resumed, "devices_after": len(a["devices"]),
        "restart_s": a["t_process"] - kill["t_kill"], "startup_s": a["start"] - a["t_process"],
        "join_s": a["joined"] - a["start"], "plan_s": a["planned"] - a["joined"],
        "load_s": a["loaded"] - a["planned"], "step_s": a["first_step"] - a["loaded"],
        "total_s": a["first_step"] - kill["t_kill"], "job_wall_s": wall,
    }


def main_reroute() -> None:
    from common import print_table, write_results

    rows = []
    for dying, die_after, spec in REROUTE_SCENARIOS:
        print(f"re-route scenario ({spec}): rank {dying} SIGKILLs itself after step {die_after}", file=sys.stderr)
        rows.append(reroute_scenario(dying, die_after, spec))
    cols = ["strategy", "dying_rank", "killed_after_step", "steps_done", "steps_lost", "world_after", "detect_s",
            "rebuild_s", "resume_s", "before_samples_per_s", "after_samples_per_s", "predicted_after",
            "after_vs_predicted", "after_vs_predicted_calibrated", "copy_MiB"]
    print_table(rows, cols)
    summary = {"cluster": CLUSTER, "model": GPT, "strategies": sorted({r["strategy"] for r in rows}),
               "steps": REROUTE_STEPS,
               "steps_lost": [r["steps_lost"] for r in rows],
               "median_resume_s": statistics.median(r["resume_s"] for r in rows),
               "median_after_vs_predicted": statistics.median(r["after_vs_predicted"] for r in rows),
               "median_after_vs_predicted_calibrated":
                   statistics.median(r["after_vs_predicted_calibrated"] for r in rows)}
    print(json.dumps(summary, indent=1))
    print(f"wrote {write_results('recovery_reroute', rows, summary)}")


def main() -> None:
    from common import print_table, write_results

    rows = []
    for every, die_after in SCENARIOS:
        print(f"scenario: checkpoint every {every} step(s), device {DYING_DEVICE} dies after step "
              f"{die_after}", file=sys.stderr)
        rows.append(scenario(every, die_after))
    cols = ["every", "killed_after_step", "resumed_from", "steps_lost", "devices_after", "restart_s",
            "startup_s", "join_s", "plan_s", "load_s", "step_s", "total_s"]
    print_table(rows, cols)
    totals = [r["total_s"] for r in rows]
    summary = {"cluster": CLUSTER, "model": GPT, "steps": STEPS,
               "median_kill_to_resumed_s": statistics.median(totals), "max_kill_to_resumed_s": max(totals),
               "median_restart_s": statistics.median(r["restart_s"] for r in rows),
               "median_plan_s": statistics.median(r["plan_s"] for r in rows),
               "median_load_s": statistics.median(r["load_s"] for r in rows),
               "steps_lost": {str(r["every"]): r["steps_lost"] for r in rows}}
    print(json.dumps(summary, indent=1))
    print(f"wrote {write_results('recovery', rows, summary)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=3, metavar=("DIR", "EVERY", "DIE_AFTER"),
                        help="(internal) run as one torchrun worker")
    parser.add_argument("--reroute-worker", nargs=4, metavar=("DIR", "DYING", "DIE_AFTER", "STRATEGY"),
                        help="(internal) run as one worker of the re-route scenario")
    parser.add_argument("--part", choices=["restart", "reroute", "all"], default="all")
    args = parser.parse_args()
    if args.worker:
        sys.exit(_worker(args.worker[0], int(args.worker[1]), int(args.worker[2])))
    if args.reroute_worker:
        w = args.reroute_worker
        sys.exit(_reroute_worker(w[0], int(w[1]), int(w[2]), w[3]))
    if args.part in ("restart", "all"):
        main()
    if args.part in ("reroute", "all"):
        main_reroute()
