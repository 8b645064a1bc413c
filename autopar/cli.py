"""The `autopar` command line."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from .errors import AutoparError


def load_target(spec: str) -> tuple[Any, tuple, Any, Any]:
    """Call `module:function`; it returns (model, example_inputs) or (model, inputs, loss_fn, target)."""
    if ":" not in spec:
        raise AutoparError(f"expected MODULE:FUNCTION (e.g. mymodels:build), got {spec!r}.")
    mod_name, fn_name = spec.split(":", 1)
    if "." not in sys.path:
        sys.path.insert(0, ".")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise AutoparError(f"cannot import module {mod_name!r}: {e}. Run from the directory that holds it "
                           f"or install it.") from e
    fn = getattr(mod, fn_name, None)
    if fn is None:
        raise AutoparError(f"module {mod_name!r} has no function {fn_name!r}.")
    out = fn()
    if hasattr(out, "model") and hasattr(out, "example_inputs"):  # an autopar.models.ModelCase
        return out.model, tuple(out.example_inputs), out.loss_fn, out.example_target
    if not isinstance(out, tuple) or len(out) not in (2, 4):
        raise AutoparError(f"{spec}() must return (model, example_inputs) or "
                           f"(model, example_inputs, loss_fn, "
                           f"example_target); got {type(out).__name__}.")
    model, inputs = out[0], out[1]
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    return (model, inputs, out[2], out[3]) if len(out) == 4 else (model, inputs, None, None)


def cmd_devices(args: argparse.Namespace) -> None:
    from .cluster import catalog_table

    print(catalog_table())


def cmd_analyze(args: argparse.Namespace) -> None:
    from .api import analyze
    from .report import layer_table

    model, inputs, loss_fn, target = load_target(args.target)
    g = analyze(model, args.cluster, example_inputs=inputs, example_target=target, loss_fn=loss_fn,
                precision=args.precision, dump_dir=args.dump)
    print(g.table(max_rows=args.max_rows))
    print()
    print(layer_table(g))


def cmd_plan(args: argparse.Namespace) -> None:
    import time

    from .api import plan

    model, inputs, loss_fn, target = load_target(args.target)
    start = time.perf_counter()
    tty = sys.stderr.isatty()

    def progress(done: int, total: int, best: float | None) -> None:
        if not tty and done not in (1, total) and done % 100:
            return
        best_txt = f"best {best:.4g} s/step" if best is not None else "no plan fits yet"
        line = f"planning: {done}/{total} configurations, {best_txt}, {time.perf_counter() - start:.1f} s"
        # on a terminal, redraw one status line; in logs, print a line now and then
        print("\r" + line if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)

    result = plan(model, args.cluster, example_inputs=inputs, example_target=target, loss_fn=loss_fn,
                  optimizer=args.optimizer, time_limit_s=args.time_limit, precision=args.precision,
                  memory_reserve=args.memory_reserve, progress=progress)
    print(("\n" if tty else "") + f"planned in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(result.explain())
    if args.json:
        with open(args.json, "w") as f:
            f.write(result.to_json())
        print(f"plan written to {args.json}", file=sys.stderr)


def cmd_calibrate(args: argparse.Namespace) -> None:
    from .cost_models.calibrate import calibrate

    prof = calibrate(device=args.device, quick=args.quick, save=True)
    print(f"saved profile for {prof.device}")
    for kind, curve in sorted(prof.curves.items()):
        print(f"  {kind:12s} {curve}")


CLUSTER_HELP = "cluster file (YAML/JSON) or shorthand like 1x8xA100-80GB"


def cmd_run(args: argparse.Namespace) -> None:
    from .runtime.run import run

    if not args.script:
        raise AutoparError("autopar run needs a script: autopar run --cluster CLUSTER train.py [args...]")
    code = run(args.script, args.cluster, nproc=args.nproc, node_rank=args.node_rank, master=args.master,
               max_restarts=args.max_restarts, dry_run=args.dry_run)
    if code:
        raise SystemExit(code)


def cmd_demo(args: argparse.Namespace) -> None:
    from .demo import DEMO_CLUSTER
    from .demo import main as demo_main

    code = demo_main(args.cluster or DEMO_CLUSTER, args.steps)
    if code:
        raise SystemExit(code)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autopar", description="Auto-parallelize PyTorch training on "
                                "heterogeneous clusters.")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("devices", help="list the built-in device catalog")
    s.set_defaults(func=cmd_devices)
    s = sub.add_parser("analyze", help="capture a model and print its per-node cost table")
    s.add_argument("target", help="MODULE:FUNCTION returning (model, example_inputs[, loss_fn, target])")
    s.add_argument("--cluster", required=True, help=CLUSTER_HELP)
    s.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "bf16", "fp16"])
    s.add_argument("--dump", default=None, help="directory for graph.txt/json/dot (default: $AUTOPAR_DUMP)")
    s.add_argument("--max-rows", type=int, default=200)
    s.set_defaults(func=cmd_analyze)
    s = sub.add_parser("plan", help="find the fastest parallel plan for a model on a cluster")
    s.add_argument("target", help="MODULE:FUNCTION returning (model, example_inputs[, loss_fn, target])")
    s.add_argument("--cluster", required=True, help=CLUSTER_HELP)
    s.add_argument("--json", default=None, help="also write the plan as JSON to this file")
    s.add_argument("--time-limit", type=float, default=60.0, help="seconds to search (default 60)")
    s.add_argument("--precision", default=None, choices=["fp32", "tf32", "bf16", "fp16"],
                   help="default: bf16 mixed precision, fp32 on CPU-only clusters")
    s.add_argument("--optimizer", default="adamw")
    s.add_argument("--memory-reserve", type=float, default=0.1,
                   help="fraction of each device's memory kept free (default 0.1)")
    s.set_defaults(func=cmd_plan)
    s = sub.add_parser("run", help="start one process per device of the cluster (torchrun) running a script")
    s.add_argument("--cluster", required=True, help=CLUSTER_HELP)
    s.add_argument("--nproc", type=int, default=None, help="local processes (default: one per device)")
    s.add_argument("--node-rank", type=int, default=None, help="on a GPU cluster: run this node's share")
    s.add_argument("--master", default=None, help="HOST:PORT of the rendezvous (multi-node)")
    s.add_argument("--max-restarts", type=int, default=0, help="torchrun elastic restarts after a failure")
    s.add_argument("--dry-run", action="store_true", help="print the torchrun command(s) only")
    s.add_argument("script", nargs=argparse.REMAINDER, help="script.py [args...] (or -m module [args...])")
    s.set_defaults(func=cmd_run)
    s = sub.add_parser("demo", help="plan a small GPT for a mixed cluster, train it on local processes, "
                       "check it against single-process training")
    s.add_argument("--cluster", default=None, help="default: 1x2xA100-80GB+1x2xT4")
    s.add_argument("--steps", type=int, default=5)
    s.set_defaults(func=cmd_demo)
    s = sub.add_parser("calibrate", help="time kernels on the local device and save a cost profile")
    s.add_argument("--device", default="local")
    s.add_argument("--quick", action="store_true", help="a shorter sweep (~20 s)")
    s.set_defaults(func=cmd_calibrate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except AutoparError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
