"""Time to capture and annotate a GPT-3-175B-shaped model on the meta device (target: <= 20 s, 2 cores)."""

from __future__ import annotations

import time

from common import print_table, write_results

import autopar
from autopar import models
from autopar.passes.annotate import annotate


def main() -> None:
    rows = []
    for name, batch in (("gpt2-medium", 8), ("gpt-1.3b", 8), ("llama-7b", 8), ("gpt3-175b", 8)):
        cfg = models.gpt_config(name)
        factory = models.llama if name.startswith("llama") else models.gpt
        t0 = time.perf_counter()
        case = factory(**cfg, batch=batch, device="meta")
        t1 = time.perf_counter()
        g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
        t2 = time.perf_counter()
        annotate(g, autopar.Cluster.load("128x8xA100-80GB+1x4xV100-16GB"), precision="bf16")
        t3 = time.perf_counter()
        rows.append(
            {
                "model": name,
                "params_B": g.num_params() / 1e9,
                "ops": len(g.nodes),
                "layers": len(g.layers),
                "build_s": t1 - t0,
                "capture_s": t2 - t1,
                "annotate_s": t3 - t2,
                "total_s": t3 - t0,
            }
        )
    print_table(rows, ["model", "params_B", "ops", "layers", "build_s", "capture_s", "annotate_s", "total_s"])
    big = rows[-1]
    summary = {"gpt3_175b_total_s": big["total_s"], "target_s": 20.0, "met": big["total_s"] <= 20.0}
    print(
        f"\nGPT-3 175B capture+annotate: {big['total_s']:.1f} s (target <= 20 s): "
        f"{'met' if summary['met'] else 'NOT met'}"
    )
    print("wrote", write_results("capture", rows, summary))


if __name__ == "__main__":
    main()
