"""Wall time of the paths that must stay cheap because the planner or a user calls them often: the
pipeline simulator, the NCCL transfer check over a large layout, and building GPT-3 175B on `meta`.
These used to be timed asserts in tests; timing belongs here, where a busy host shows as a figure
and not as a failed test. Each row: the best and the median of `reps` runs and the budget it should
stay under on an idle 2-core machine."""

from __future__ import annotations

import statistics
import time

from common import print_table, write_results

from autopar import lowering
from autopar.ir.lowered import PipelineLayout, StageLayout
from autopar.ir.schedule import one_f_one_b
from autopar.ir.simulate import simulate
from autopar.lowering import check_transfers, make_layout
from autopar.models import gpt, gpt_config


def simulate_64x256() -> None:
    simulate(one_f_one_b(64, 256), [1.0] * 64, [2.0] * 64, p2p_time=0.01, allreduce_time=0.5)


def check_64_ranks() -> None:
    """8 data-parallel copies of an 8-stage 1F1B pipeline with 32 micro-batches, caches cleared."""
    lowering._shape_ok.cache_clear()
    lowering._transfer_steps.cache_clear()
    stages, m, dp = 8, 32, 8
    pipes = [PipelineLayout(d, tuple(StageLayout((s, s + 1), (d * stages + s,)) for s in range(stages)),
                            d * m, m, m, "1f1b", 1) for d in range(dp)]
    check_transfers(make_layout(pipes, stages * dp, m * dp, stages))


def gpt3_on_meta() -> None:
    gpt(**gpt_config("gpt3-175b"), batch=1, device="meta")


CASES = [("simulate 1F1B 64 stages x 256 micro-batches", simulate_64x256, 1.0),
         ("check_transfers 64 ranks, 8x1F1B x 32", check_64_ranks, 5.0),
         ("build GPT-3 175B on meta", gpt3_on_meta, 2.0)]


def main(reps: int = 5) -> None:
    rows = []
    for name, fn, budget in CASES:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        rows.append({"path": name, "best_s": min(times), "median_s": statistics.median(times),
                     "budget_s": budget, "within": min(times) <= budget})
    print_table(rows, ["path", "best_s", "median_s", "budget_s", "within"])
    print("wrote", write_results("fast_paths", rows, {"all_within": all(r["within"] for r in rows)}))


if __name__ == "__main__":
    main()
