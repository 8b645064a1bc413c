"""Asynchronous training on a 2-speed emulated cluster: synchronous vs 2bw vs wsp (runtime/asynchronous.py).

Two gloo ranks train a small GPT data-parallel (one replica per rank, one stage each, ZeRO 0, even batch
shares); rank 1 emulates a device SLOW times slower (AUTOPAR_EMULATE_SLOWDOWN: each of its forwards and
backwards sleeps (SLOW - 1) x its duration, straggler.py). Each mode trains STEPS steps from the same
initial weights on the same stream of batches (a fixed pool of synthetic next-token sequences with
structure to learn: token t+1 = (a * token t + b) mod vocab per sequence). Measured: samples/s over the
timed steps (after WARMUP steps; an asynchronous mode's pending updates are flushed inside the timed window,
so no work is left out), the global loss of the last wave and the mean of the last 5. The throughput is
measured; the loss figures are what each update rule reaches after STEPS steps (a convergence benchmark:
no claim that the rules converge alike in general).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch
from common import print_table, write_results

from autopar import models
from autopar.cluster import Cluster
from autopar.errors import AutoparError
from autopar.plan import Strategy, plan_from_strategy
from autopar.runtime.asynchronous import AsyncProgram
from autopar.runtime.launch import spawn_local
from autopar.runtime.program import Program
from autopar.runtime.straggler import SLOWDOWN_ENV

CFG = dict(hidden=128, layers=2, seq=32, batch=16, vocab=64)
SLOW = 2.0  # rank 1 emulates a device this many times slower
STEPS = 40
WARMUP = 2
POOL = 8  # distinct batches, cycled
LR = 3e-3
MODES = [("sync", None), ("2bw", None), ("wsp", 2)]
ORDER = MODES + MODES[::-1] + MODES  # each mode 3 times, alternating: drift of a loaded machine spreads evenly


def batches(vocab: int, batch: int, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(POOL):
        a = torch.randint(1, vocab, (batch, 1), generator=g)
        b = torch.randint(0, vocab, (batch, 1), generator=g)
        x0 = torch.randint(0, vocab, (batch, 1), generator=g)
        seqs = [x0]
        for _ in range(seq):
            seqs.append((a * seqs[-1] + b) % vocab)
        toks = torch.cat(seqs, dim=1)
        out.append((toks[:, :-1].contiguous(), toks[:, 1:].contiguous()))
    return out


def optimizer(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def build() -> tuple[models.ModelCase, Any]:
    import autopar

    case = models.gpt(**CFG, seed=0)
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    n_layers = len(g.layers)
    blocks = sum(1 for layer in g.layers if layer.kind == "block")
    strategy = Strategy(dp=2, pp=1, zero=0)
    strategy.microbatch_size = CFG["batch"] // 2
    plan = plan_from_strategy(strategy, world_size=2, global_batch=CFG["batch"], num_layers=n_layers,
                              first_block=1, num_blocks=blocks, precision="fp32", optimizer="adamw",
                              cluster=Cluster.load("1x2xcpu").to_dict(),
                              model={"num_layers": n_layers})
    return case, (plan, g)


def worker(rank: int, world: int) -> list[dict]:
    os.environ[SLOWDOWN_ENV] = f"1:{SLOW}"
    data = batches(CFG["vocab"], CFG["batch"], CFG["seq"])
    rows = []
    for sync, staleness in ORDER:
        case, (plan, g) = build()
        args = (case.model, plan, case.example_inputs, case.example_target, case.loss_fn, optimizer, rank, world)
        prog = Program(*args, timeout_s=120, graph=g) if sync == "sync" else \
            AsyncProgram(*args, timeout_s=120, graph=g, sync=sync, staleness=staleness)
        losses = []
        t0 = 0.0
        for step in range(STEPS):
            if step == WARMUP:
                torch.distributed.barrier()
                t0 = time.perf_counter()
            x, y = data[step % POOL]
            losses.append(prog.step(x, target=y))
        if isinstance(prog, AsyncProgram):
            prog.flush()
            losses = [prog.losses[c] for c in range(STEPS)]
        elapsed = time.perf_counter() - t0
        rows.append({"mode": sync, "staleness": 0 if sync == "sync" else prog.delay, "rank": rank,
                     "seconds": elapsed, "samples_per_s": (STEPS - WARMUP) * CFG["batch"] / elapsed,
                     "final_loss": losses[-1], "last5_loss": sum(losses[-5:]) / 5, "first_loss": losses[0]})
        torch.distributed.barrier()
    return rows


def main() -> None:
    try:
        per_rank = spawn_local(worker, 2, timeout_s=600)
    except AutoparError as e:
        print(e, file=sys.stderr)
        raise SystemExit(1) from None
    rows = []
    for sync, _ in MODES:
        runs = [(per_rank[0][j], per_rank[1][j]) for j, (m, _) in enumerate(ORDER) if m == sync]
        # a run ends when the slower rank's work is done; samples/s: the median over the runs
        rates = [(STEPS - WARMUP) * CFG["batch"] / max(a["seconds"], b["seconds"]) for a, b in runs]
        r0 = runs[0][0]
        if any(r[0]["final_loss"] != r0["final_loss"] for r in runs):
            raise AutoparError(f"{sync}: runs of the same rule ended at different losses "
                               f"({[r[0]['final_loss'] for r in runs]}): the run is not deterministic")
        rows.append({"mode": sync, "staleness": r0["staleness"], "samples_per_s": statistics.median(rates),
                     "samples_per_s_runs": rates, "first_loss": r0["first_loss"], "final_loss": r0["final_loss"],
                     "last5_loss": r0["last5_loss"]})
    base = rows[0]["samples_per_s"]
    for r in rows:
        r["throughput_vs_sync"] = r["samples_per_s"] / base
    print(f"GPT hidden {CFG['hidden']}, {CFG['layers']} blocks, batch {CFG['batch']} x {CFG['seq']} tokens, dp=2 "
          f"on 2 gloo ranks, rank 1 emulated {SLOW:g}x slower, {STEPS} steps (samples/s measured over the last "
          f"{STEPS - WARMUP}, median of 3 alternating runs; load average {os.getloadavg()[0]:.1f})")
    print_table(rows, ["mode", "staleness", "samples_per_s", "throughput_vs_sync", "first_loss", "final_loss",
                       "last5_loss"])
    summary = {r["mode"]: {k: r[k] for k in ("staleness", "samples_per_s", "throughput_vs_sync", "final_loss",
                                             "last5_loss")} for r in rows}
    summary["setup"] = {**CFG, "slowdown": SLOW, "steps": STEPS, "warmup": WARMUP, "lr": LR,
                        "load_average": os.getloadavg()[0]}
    print("wrote", write_results("async", rows, summary))


if __name__ == "__main__":
    main()
