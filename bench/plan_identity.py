"""Which plan `autopar.plan` returns, and how long it takes, per case: for changes meant to make planning faster
without changing plans (issue 25 part 4). Run it on the commit before a change and after, and compare.

Cases: bench/planner.py's seven, and OPT-350M- and GPT-Neo-2.7B-shaped GPTs (models.gpt; batch 256, seq 2048,
tied embeddings) on 8 A100-40GB + 8 V100-16GB. Per case one JSON line: the planning time (capture included), the
first 16 hex digits of sha256(plan.to_json()), the predicted step time (repr, every digit), and the planner's
"planning stopped" warnings. The wall-clock guard is set high (--time-limit, default 3600 s) so that the work
budget alone decides the plan, whatever the machine's load.

Run: cd bench && python plan_identity.py [--time-limit S] [case ...]   (cases by key, e.g. 2-gpt3-175b opt350m)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
import warnings
from collections.abc import Callable, Iterator

from planner import CASES, build

import autopar
from autopar import models

MIXED = "1x8xA100-40GB+1x8xV100-16GB"
EXTRA = {  # shapes as Sailor (OPT-350M) and Hugging Face (GPT-Neo 2.7B) give them
    "opt350m": dict(layers=24, hidden=1024, heads=16, seq=2048, vocab=50272, tie_embeddings=True),
    "neo2.7b": dict(layers=32, hidden=2560, heads=20, seq=2048, vocab=50257, tie_embeddings=True),
}
EXTRA_BATCH = 256


def cases() -> Iterator[tuple[str, Callable[[], models.ModelCase], str]]:
    for c in CASES:
        yield c.key.replace(" ", "-"), (lambda c=c: build(c)), c.cluster
    for key, cfg in EXTRA.items():
        yield key, (lambda cfg=cfg: models.gpt(**cfg, batch=EXTRA_BATCH, device="meta")), MIXED


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=3600.0)
    ap.add_argument("keys", nargs="*")
    args = ap.parse_args()
    for key, make, cluster in cases():
        if args.keys and key not in args.keys:
            continue
        mc = make()
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = autopar.plan(mc.model, cluster, mc.example_inputs, mc.example_target, mc.loss_fn,
                                time_limit_s=args.time_limit)
        print(json.dumps({"case": key, "cluster": cluster, "plan_s": round(time.perf_counter() - t0, 2),
                          "hash": hashlib.sha256(plan.to_json().encode()).hexdigest()[:16],
                          "step": repr(plan.predicted["step_time_s"]),
                          "stopped": [str(w.message) for w in caught if "planning stopped" in str(w.message)]}),
              flush=True)


if __name__ == "__main__":
    main()
