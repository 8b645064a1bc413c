"""`autopar demo`: plan a small GPT for a heterogeneous cluster, train it on local processes standing in
for the cluster's devices, and check every step against a single-process run."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

DEMO_CLUSTER = "1x2xA100-80GB+1x2xV100-32GB"
STEPS = 5


def _case():
    from . import models

    return models.gpt(batch=8, seq=32, vocab=128, hidden=64, layers=4, heads=4, seed=0)


def _optimizer(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def worker(out_dir: str, cluster: str, steps: int) -> None:
    """Runs on every rank (started by torchrun): compile the saved plan and train."""
    from autopar.compiler import compile as compile_program
    from autopar.runtime.elastic import shutdown

    case = _case()
    plan = (Path(out_dir) / "plan.json").read_text()
    prog = compile_program(
        case.model,
        cluster,
        example_inputs=case.example_inputs,
        example_target=case.example_target,
        loss_fn=case.loss_fn,
        optimizer=_optimizer,
        plan=plan,
    )
    losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(steps)]
    state = prog.state_dict()["model"]
    if prog.rank == 0:
        torch.save({"losses": losses, "state": state}, Path(out_dir) / "result.pt")
    shutdown()


def report_path(html: str | None = None) -> Path:
    """Where the demo writes its plan's report page: `html`, else autopar-demo/plan.html in the temp directory."""
    return Path(html) if html else Path(tempfile.gettempdir()) / "autopar-demo" / "plan.html"


def main(cluster: str = DEMO_CLUSTER, steps: int = STEPS, html: str | None = None) -> int:
    import autopar

    from .runtime.run import run

    case = _case()
    print(
        f"autopar demo: a {sum(p.numel() for p in case.model.parameters()) / 1e3:.0f}K-parameter GPT on "
        f"{cluster}, emulated by local CPU processes\n"
    )
    plan = autopar.plan(
        case.model,
        cluster,
        example_inputs=case.example_inputs,
        example_target=case.example_target,
        loss_fn=case.loss_fn,
        time_limit_s=30,
        # the CPU processes standing in for the GPUs compute in fp32, so the check against one process is exact;
        # on the real cluster the default would be fp16 mixed precision (autopar.default_precision)
        precision="fp32",
    )
    print(f"(planned in fp32, as the CPU stand-ins compute; on the real devices autopar would default to "
          f"{autopar.default_precision(autopar.Cluster.load(cluster))})\n")
    print(plan.explain())
    page = report_path(html)
    page.parent.mkdir(parents=True, exist_ok=True)
    plan.report(page)
    print(f"\nthe same plan as a page (device map, memory, timeline): open {page.resolve().as_uri()}\n")
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "plan.json").write_text(plan.to_json())
        code = run(
            ["-m", "autopar.demo", "--worker", d, "--cluster", cluster, "--steps", str(steps)], cluster
        )
        if code != 0:
            print(f"autopar demo: the training processes failed (exit code {code})", file=sys.stderr)
            return code
        result = torch.load(Path(d) / "result.pt", weights_only=False)
    ref_losses, ref_state = _reference(steps)
    print(f"\n{'step':>4}  {'autopar loss':>12}  {'1-process loss':>14}  {'|diff|':>9}")
    for i, (a, b) in enumerate(zip(result["losses"], ref_losses, strict=True)):
        print(f"{i:>4}  {a:>12.6f}  {b:>14.6f}  {abs(a - b):>9.2e}")
    worst = max((result["state"][k] - v).abs().max().item() for k, v in ref_state.items())
    ok = all(abs(a - b) <= 1e-5 + 1e-4 * abs(b) for a, b in zip(result["losses"], ref_losses, strict=True))
    ok = ok and all(torch.allclose(result["state"][k], v, rtol=1e-4, atol=1e-5) for k, v in ref_state.items())
    falling = result["losses"][-1] < result["losses"][0]
    print(f"\nlargest parameter difference after {steps} steps: {worst:.2e}")
    print(
        f"loss falling: {'yes' if falling else 'NO'}; matches single-process training: {'yes' if ok else 'NO'}"
    )
    print(json.dumps({"predicted_samples_per_s": plan.predicted.get("samples_per_s"), "match": ok}))
    return 0 if ok and falling else 1


def _reference(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    from . import models

    return models.train_reference(_case(), _optimizer, steps)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", default=None)
    ap.add_argument("--cluster", default=DEMO_CLUSTER)
    ap.add_argument("--steps", type=int, default=STEPS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.cluster, a.steps)
    else:
        sys.exit(main(a.cluster, a.steps))
