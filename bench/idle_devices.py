"""A plan for every cluster that can train the model (issue 29): random (GPT shape, batch, mixed cluster) cases.

The issue's measurement, repeated side by side on the same cases: 40 random cases, each a `models`-style GPT built
on meta (vocab, seq, hidden, heads, layers) with a global batch, on a random mixed cluster of 1-4 node groups
(data-centre GPUs, consumer GPUs, a Jetson; sometimes a device with 0.1 GiB or 1 GiB; 1 or 25 GB/s per device).
Per case:
  before   the search on every device of the cluster (`Search(cm).run()`: what `autopar.plan` did before issue
           29): a plan, or a refusal ("layout": no parallel layout uses every device; "memory": nothing fits)
  after    `autopar.plan` with the default objective: a plan (how many devices it leaves idle, and why, by
           kind: no layout / memory / too slow to pay for itself), or a refusal (which must be memory's)
and each one's planning time (capture excluded: both start from the same captured graph). Every step time is a
prediction of the cost model; `after_vs_before` compares the two predictions where both plan.

Run: cd bench && python idle_devices.py
"""

from __future__ import annotations

import random
import time
import warnings
from typing import Any

from common import print_table, write_results

import autopar
from autopar import InfeasibleError, models
from autopar.api import cost_model
from autopar.passes.capture import capture
from autopar.solver.search.search import Search

CASES = 40
SEED = 29
TYPES = ["A100-80GB", "A100-40GB", "H100-SXM", "V100-16GB", "T4", "L4", "RTX-3090", "Jetson-AGX-Orin"]


def random_case(rng: random.Random) -> tuple[dict, dict]:
    heads = rng.choice([1, 2, 4, 8])
    sizes = dict(vocab=rng.choice([97, 512, 8192]), seq=rng.choice([32, 64, 256]),
                 hidden=heads * rng.choice([8, 32, 64]), heads=heads, layers=rng.randint(1, 4),
                 batch=rng.choice([1, 1, 2, 3, 4, 8]))
    groups = []
    for _ in range(rng.randint(1, 4)):
        name = rng.choice(TYPES)
        device: str | dict = name
        if rng.random() < 0.25:
            gib = rng.choice([0.1, 1])
            device = {"name": f"{name}-{gib}GiB", "based_on": name, "memory_GiB": gib}
        groups.append({"device": device, "devices_per_node": rng.choice([1, 2, 3, 4]), "count": rng.randint(1, 3)})
    return sizes, {"nodes": groups, "network": {"bandwidth_GBps": rng.choice([1, 25]), "latency_us": 5}}


def _kind(why: str) -> str:
    if "no parallel layout" in why:
        return "layout"
    if "fits in memory" in why:
        return "memory"
    if "too slow" in why:
        return "slow"
    return "other"


def run_case(k: int, sizes: dict, cluster: dict) -> dict[str, Any]:
    case = models.gpt(device="meta", **sizes)
    graph = capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    c = autopar.Cluster.load(cluster)
    row: dict[str, Any] = {"case": k, "devices": c.world_size, "types": len(c.device_types()),
                           "batch": sizes["batch"], "layers": sizes["layers"], "hidden": sizes["hidden"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = cost_model(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn, captured=graph)
        t = time.perf_counter()
        try:
            before = Search(cm).run().predicted["step_time_s"]
            row["before"] = "plan"
        except InfeasibleError as e:
            before, row["before"] = None, "refuses: " + ("layout" if "no parallel layout" in str(e) else "memory")
        row["before_s"] = time.perf_counter() - t
        t = time.perf_counter()
        try:
            plan = autopar.plan(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn,
                                captured=graph)
            idle = plan.predicted["idle_devices"]
            kinds = sorted({_kind(w) for w in idle.values()})
            row["after"] = f"plan, {len(idle)} idle" + (f" ({'/'.join(kinds)})" if idle else "")
            row["after_step_ms"] = plan.predicted["step_time_s"] * 1e3
            if before is not None:
                row["after_vs_before"] = plan.predicted["step_time_s"] / before
        except InfeasibleError as e:
            row["after"] = "refuses: " + ("memory" if "fits in memory" in str(e) else "other")
        row["after_s"] = time.perf_counter() - t
    return row


def main() -> None:
    rng = random.Random(SEED)
    rows = [run_case(k, *random_case(rng)) for k in range(CASES)]
    print_table(rows, ["case", "devices", "types", "batch", "layers", "hidden", "before", "before_s", "after",
                       "after_s", "after_step_ms", "after_vs_before"])
    summary = {
        "cases": CASES,
        "before_plans": sum(r["before"] == "plan" for r in rows),
        "before_layout_refusals": sum(r["before"] == "refuses: layout" for r in rows),
        "before_memory_refusals": sum(r["before"] == "refuses: memory" for r in rows),
        "after_plans": sum(r["after"].startswith("plan") for r in rows),
        "after_plans_with_idle_devices": sum(r["after"].startswith("plan") and not r["after"].startswith("plan, 0")
                                             for r in rows),
        "after_memory_refusals": sum(r["after"] == "refuses: memory" for r in rows),
        "after_other_refusals": sum(r["after"] == "refuses: other" for r in rows),
        "after_faster_where_both_plan": sum(r.get("after_vs_before", 1.0) < 1.0 for r in rows),
        "median_plan_s_before": sorted(r["before_s"] for r in rows)[CASES // 2],
        "median_plan_s_after": sorted(r["after_s"] for r in rows)[CASES // 2],
        "max_plan_s_after": max(r["after_s"] for r in rows),
    }
    print(summary)
    print("wrote", write_results("idle_devices", rows, summary))


if __name__ == "__main__":
    main()
