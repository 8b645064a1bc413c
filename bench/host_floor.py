"""The host-bound floor (issue 25 part 1): how autopar prices the host's issuing of kernels, and what it changes
against measured runs.

1. The host path of this host (`autopar calibrate --host`: per kernel, view, module call, autograd node,
   micro-batch and optimizer step, timed on the CPU with tensors of a few elements, so every figure is host
   time) and the GPU stack priced from it (each kernel plus the cited CUDA launch).
2. Does counting events price a whole block? A small GPT trained on this CPU at tiny sizes (hidden 64, seq 8,
   one sample), where the kernels do almost no work: the measured time per layer per micro-batch (the slope
   over 2 and 6 layers, forward + backward) next to the counted host time (overhead.layer_counts x the
   measured figures, kernel launches included). Measured, not fitted.
3. What the floor does to predictions of measured mixed-GPU runs (../shared/reference/measured/, bench/measured.py's
   rows and pricing), side by side in one run:
     additive      the pricing before this change: host terms added to the kernels (default figures)
     floor         stage time = max(device, host), default CUDA figures
     floor+host    the same with the GPU host figures from this host's measured path
   per set: median predicted/measured, median |error|, Spearman. A ratio below 1 is a prediction too fast.

The published single-node Megatron-DeepSpeed runs the issue measured the host-bound gap on are not in this
repository (only AMP's and Sailor's are, under ../shared/reference/measured/), so the gap this closes is reported
on those sets only.

Run: cd bench && python host_floor.py
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from common import print_table, write_results

import autopar
from autopar import models
from autopar.cost_models import overhead
from autopar.cost_models.calibrate import calibrate_host
from autopar.cost_models.overhead import CPU_EAGER, HostOverhead, gpu_host_from_path, layer_counts, layer_host_seconds
from autopar.passes.annotate import annotate
from autopar.solver.pricing import model as pricing_model

TINY = dict(hidden=64, heads=4, seq=8, batch=1, vocab=128)
LAYERS = (2, 6)
REPEATS = 40


def _step_seconds(layers: int) -> float:
    case = models.gpt(layers=layers, **TINY)
    m, x, target = case.model, case.example_inputs, case.example_target

    def step() -> None:
        m.zero_grad(set_to_none=True)
        case.loss_fn(m(*x), target).backward()

    for _ in range(5):
        step()
    best = float("inf")
    for _ in range(5):  # best of five groups: other processes only slow a group down
        t = time.perf_counter()
        for _ in range(REPEATS):
            step()
        best = min(best, (time.perf_counter() - t) / REPEATS)
    return best


def block_check(host: HostOverhead) -> dict[str, Any]:
    """Measured seconds per block per micro-batch (forward + backward) against the counted host time."""
    case = models.gpt(layers=2, **TINY)
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    a = annotate(g, autopar.Cluster.load("1x1xcpu"), precision="fp32")
    counts = layer_counts(a)
    block = next(i for i, layer in enumerate(a.layers) if layer.kind == "block")
    c = counts[block]
    f, b = layer_host_seconds(c, host)
    counted = f + b + (c.kernels_fwd + c.kernels_bwd) * host.kernel_s
    measured = (_step_seconds(LAYERS[1]) - _step_seconds(LAYERS[0])) / (LAYERS[1] - LAYERS[0])
    return {"kernels_fwd": c.kernels_fwd, "kernels_bwd": c.kernels_bwd, "views": c.views, "modules": c.modules,
            "autograd_nodes": c.autograd_nodes, "counted_ms": counted * 1e3, "measured_ms": measured * 1e3,
            "counted_over_measured": counted / measured}


def _additive(kernels_s: float, host_s: float, launch_s: float, charged_s: float, bound: bool) -> float:
    return kernels_s + host_s + (launch_s - charged_s)


def predictions(mode: str, host_dir: str, empty_dir: str) -> dict[str, list[dict]]:
    import measured as bench_measured

    os.environ["AUTOPAR_PROFILE_DIR"] = host_dir if mode == "floor+host" else empty_dir
    saved = pricing_model.floored
    if mode == "additive":
        pricing_model.floored = _additive
    try:
        pricer = bench_measured.Pricer()
        return {"amp_het": bench_measured.amp_rows(pricer, "het"), "amp_homo": bench_measured.amp_rows(pricer, "homo"),
                "sailor_mit": bench_measured.sailor_rows(pricer)}
    finally:
        pricing_model.floored = saved


def stats(rows: list[dict]) -> dict[str, float]:
    ok = [r for r in rows if r.get("status") == "ok" and "predicted_s" in r and r.get("measured_s")]
    ratio = [r["predicted_s"] / r["measured_s"] for r in ok]
    from measured import spearman

    return {"rows": len(ok), "median_ratio": statistics.median(ratio),
            "median_abs_err_pct": 100 * statistics.median(abs(x - 1) for x in ratio),
            "spearman": spearman([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok])}


def main() -> None:
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = calibrate_host(save=False)
    cpu = HostOverhead.from_meta(path["framework"], CPU_EAGER)
    gpu = gpu_host_from_path(path["framework"])
    print("== 1. this host's measured host path (us) and the GPU stack priced from it ==")
    names = ["kernel_s", "view_s", "module_s", "autograd_node_s", "microbatch_s", "step_s", "step_tensor_s"]
    rows1 = [{"figure": n, "measured_cpu_us": getattr(cpu, n) * 1e6, "gpu_priced_us": getattr(gpu, n) * 1e6,
              "cuda_default_us": getattr(overhead.CUDA_EAGER, n) * 1e6} for n in names]
    print_table(rows1, ["figure", "measured_cpu_us", "gpu_priced_us", "cuda_default_us"])
    for w in caught:
        print(f"  note: {w.message}")

    print("\n== 2. a GPT block's host time: counted events x measured figures vs a measured tiny-size step ==")
    check = block_check(cpu)
    print_table([check], ["kernels_fwd", "kernels_bwd", "views", "modules", "autograd_nodes", "counted_ms",
                          "measured_ms", "counted_over_measured"])

    print("\n== 3. predicted / measured on the measured mixed-GPU runs (predictions, compared with measurements) ==")
    rows3 = []
    with tempfile.TemporaryDirectory() as tmp:
        host_dir, empty_dir = str(Path(tmp) / "host"), str(Path(tmp) / "empty")
        Path(host_dir).mkdir()
        Path(empty_dir).mkdir()
        (Path(host_dir) / overhead.HOST_PATH_FILE).write_text(json.dumps(path))
        before = os.environ.get("AUTOPAR_PROFILE_DIR")
        try:
            for mode in ("additive", "floor", "floor+host"):
                for name, rows in predictions(mode, host_dir, empty_dir).items():
                    rows3.append({"set": name, "mode": mode, **stats(rows)})
        finally:
            if before is None:
                os.environ.pop("AUTOPAR_PROFILE_DIR", None)
            else:
                os.environ["AUTOPAR_PROFILE_DIR"] = before
    rows3.sort(key=lambda r: (r["set"], r["mode"]))
    print_table(rows3, ["set", "mode", "rows", "median_ratio", "median_abs_err_pct", "spearman"])
    summary = {"host_path": path, "gpu_stack": {n: getattr(gpu, n) for n in names}, "block_check": check,
               "measured_sets": rows3, "elapsed_s": time.perf_counter() - t0,
               "note": "the published single-node Megatron-DeepSpeed runs are not in this repository"}
    print(f"\nwrote {write_results('host_floor', rows3, summary)} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
