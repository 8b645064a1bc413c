"""The `autopar` command line."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from .checks import describe_range, in_range
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


# a progress bar appears on work longer than this, and only on a terminal (stderr): logs stay quiet
PROGRESS_DELAY_S = 2.0


@contextlib.contextmanager
def progress_bar(desc: str, unit: str, status: str = "") -> Iterator[Any]:
    """A tqdm bar on stderr, shown after PROGRESS_DELAY_S and redrawn twice a second (so the elapsed time moves
    while nothing is counted yet, e.g. while the model is captured), or None where stderr is not a terminal."""
    if not sys.stderr.isatty():
        yield None
        return
    import threading
    import time

    from tqdm import tqdm

    bar = tqdm(total=None, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True,
               delay=PROGRESS_DELAY_S)
    bar.set_postfix_str(status, refresh=False)
    stop = threading.Event()
    shown_from = time.monotonic() + PROGRESS_DELAY_S

    def tick() -> None:
        while not stop.wait(0.5):
            if time.monotonic() >= shown_from:
                bar.refresh()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield bar
    finally:
        stop.set()
        ticker.join()
        bar.close()


def count(bar: Any, done: int, total: int, status: str) -> None:
    """Set `bar` to `done` of `total` with `status` beside it (drawn by the bar's next redraw)."""
    bar.total = total
    bar.n = done
    bar.set_postfix_str(status, refresh=False)


def plan_progress(bar: Any) -> Callable[..., None]:
    """The planner's `progress(done, total, best[, bound])` drawn on `bar`: configurations searched, the best step
    so far and, where the search passes the least lower bound of the configurations left, the bound gap."""
    def progress(done: int, total: int, best: float | None, bound: float | None = None) -> None:
        if bar is None:
            return
        text = f"best {best * 1e3:.4g} ms/step" if best is not None else "no plan fits yet"
        if best is not None and bound is not None and bound > 0:
            text += f", bound gap {100 * max(0.0, best / bound - 1):.1f}%"
        count(bar, done, total, text)

    return progress


def cmd_plan(args: argparse.Namespace) -> None:
    import time

    from .api import plan

    model, inputs, loss_fn, target = load_target(args.target)
    start = time.perf_counter()
    with progress_bar("planning", "config", "capturing and pricing the model") as bar:
        result = plan(model, args.cluster, example_inputs=inputs, example_target=target, loss_fn=loss_fn,
                      optimizer=args.optimizer, time_limit_s=args.time_limit, precision=args.precision,
                      memory_reserve=args.memory_reserve, progress=plan_progress(bar) if bar is not None else None,
                      compress=args.compress, profile=args.profile,
                      **({} if args.work_limit is None else {"work_limit": args.work_limit}))
    print(f"planned in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(result.explain())
    if args.json:
        with open(args.json, "w") as f:
            f.write(result.to_json())
        print(f"plan written to {args.json}", file=sys.stderr)
    if args.html:
        result.report(args.html)
        print(f"report written to {args.html} (open it in a browser)", file=sys.stderr)


def cmd_diff(args: argparse.Namespace) -> None:
    from .views.diff import diff_files

    print(diff_files(args.a, args.b))


def cmd_calibrate(args: argparse.Namespace) -> None:
    from .cost_models.calibrate import calibrate, calibrate_host

    if args.host:
        from .cost_models.compute import host_path_path
        from .cost_models.overhead import gpu_host_from_path

        out = calibrate_host(quick=args.quick, save=True)
        gpu = gpu_host_from_path(out["framework"])
        print(f"saved this host's eager-PyTorch host path to {host_path_path()} in {out['seconds']} s "
              f"(other load {out['other_load_cpus']} CPUs); GPUs without their own profile now price their host as:")
        for name in ("kernel_s", "view_s", "module_s", "autograd_node_s", "microbatch_s", "step_s", "step_tensor_s"):
            print(f"  {name:16s} {getattr(gpu, name) * 1e6:8.2f} us  {gpu.sources.get(name, '')}")
        return
    prof = calibrate(device=args.device, quick=args.quick, save=True)
    print(f"saved profile for {prof.device}")
    for kind, curve in sorted(prof.curves.items()):
        print(f"  {kind:12s} {curve}")


def cmd_profile(args: argparse.Namespace) -> None:
    from .runtime.block_profiler import profile_blocks

    model, inputs, loss_fn, target = load_target(args.target)
    sizes = None
    if args.microbatch_sizes:
        try:
            sizes = [int(x) for x in args.microbatch_sizes.split(",") if x.strip()]
        except ValueError:
            raise AutoparError(f"--microbatch-sizes must be comma-separated integers (e.g. 1,2,4), got "
                               f"{args.microbatch_sizes!r}.") from None
    with progress_bar("profiling", "timing", "capturing the model") as bar:
        prof = profile_blocks(model, args.cluster, inputs, target, loss_fn, microbatch_sizes=sizes,
                              budget_s=args.budget,
                              progress=(lambda done, total, what: count(bar, done, total, what)) if bar else None)
    prof.save(args.out)
    meta = prof.meta
    print(f"timed {len({e.layer for e in prof.entries})} layers on {', '.join(meta['devices'].values())} at "
          f"micro-batch sizes {meta['microbatch_sizes']} in {meta['spent_s']} s (budget {meta['budget_s']} s); "
          f"wrote {args.out}")
    for t, why in meta["not_profiled"].items():
        print(f"  {t}: {why}")
    for s in meta["skipped"]:
        print(f"  left out (budget): {s}")


CLUSTER_HELP = "cluster file (YAML/JSON) or shorthand like 1x8xA100-80GB"


def number(integer: bool = False, **bounds: Any) -> Callable[[str], Any]:
    """An argparse type: the number, or a usage error naming the valid range (the checks of autopar.checks)."""
    def parse(text: str) -> Any:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            value = None
        if value is None or not in_range(value, integer=integer, **bounds):
            raise argparse.ArgumentTypeError(f"must be {describe_range(integer=integer, **bounds)}, got {text!r}")
        return value

    return parse


# `autopar run`'s own options: recognized before or after the script (up to a `--`), see split_run_args
RUN_OPTIONS: dict[str, dict[str, Any]] = {
    "--cluster": dict(required=True, help=CLUSTER_HELP),
    "--nproc": dict(type=number(integer=True, low=1), default=None,
                    help="local processes (default: one per device)"),
    "--node-rank": dict(type=number(integer=True, low=0), default=None,
                        help="on a GPU cluster: run this node's share"),
    "--master": dict(default=None, help="HOST:PORT of the rendezvous (multi-node)"),
    "--max-restarts": dict(type=number(integer=True, low=0), default=0,
                           help="torchrun elastic restarts after a failure"),
    "--dry-run": dict(action="store_true", help="print the torchrun command(s) only"),
}
RUN_RULE = ("autopar's own options (" + ", ".join(RUN_OPTIONS) + ") may come before or after the script; every "
            "other argument after the script goes to the script, and so does everything after `--` (e.g. a "
            "script option named like one of autopar's): autopar run train.py --cluster c.yaml --lr 0.1 -- "
            "--nproc 4")


def split_run_args(tokens: list[str]) -> tuple[list[str], list[str]]:
    """`autopar run`'s arguments as (its own options, the script and the script's arguments), by RUN_RULE.
    Before the script, an unambiguous prefix of an own option counts (argparse's abbreviations)."""
    own: list[str] = []
    script: list[str] = []
    seen: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "--":
            script += tokens[i + 1:]
            break
        name = tok.split("=", 1)[0]
        if not script and name.startswith("--") and name not in RUN_OPTIONS:
            prefixed = [k for k in RUN_OPTIONS if k.startswith(name)]
            name = prefixed[0] if len(prefixed) == 1 and len(name) > 2 else name
        if name in RUN_OPTIONS:
            n = 1 if "=" in tok or RUN_OPTIONS[name].get("action") == "store_true" else 2
            given = " ".join(tokens[i:i + n])
            if name in seen:
                raise AutoparError(f"{name} is given twice ({seen[name]!r} and {given!r}); to pass "
                                   f"{name} to the script, put it after `--`.")
            seen[name] = given
            own += tokens[i:i + n]
            i += n
        elif not script and tok == "-m":  # `-m module`: the module and what follows are the script
            script += tokens[i:i + 2]
            i += 2
        else:
            # before the script an unknown option (or -h) is argparse's to report
            (own if not script and tok.startswith("-") else script).append(tok)
            i += 1
    return own, script


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line; `autopar run`'s options are first taken out from around the script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        own, script = split_run_args(argv[1:])
        argv = ["run", *own, *(["--", *script] if script else [])]
    args = build_parser().parse_args(argv)
    if args.cmd == "run" and args.script[:1] == ["--"]:  # argparse keeps the `--` in a REMAINDER
        args.script = args.script[1:]
    return args


def cmd_run(args: argparse.Namespace) -> None:
    from .runtime.run import run

    if not args.script:
        raise AutoparError("autopar run needs a script: autopar run train.py --cluster CLUSTER [args...]")
    with progress_bar("autopar run", "worker", "starting") as bar:
        code = run(args.script, args.cluster, nproc=args.nproc, node_rank=args.node_rank, master=args.master,
                   max_restarts=args.max_restarts, dry_run=args.dry_run,
                   progress=(lambda done, total: count(bar, done, total, f"{total - done} running"))
                   if bar is not None and not args.dry_run else None)
    if code:
        raise SystemExit(code)


def cmd_probe(args: argparse.Namespace) -> None:
    import os

    from .runtime.run import run

    script = ["-m", "autopar.runtime.probe", "--out", os.path.abspath(args.out), "--iters", str(args.iters)]
    if args.max_mib is not None:
        script += ["--max-mib", str(args.max_mib)]
    code = run(script, args.cluster, node_rank=args.node_rank, master=args.master, dry_run=args.dry_run)
    if code:
        raise SystemExit(code)


def cmd_demo(args: argparse.Namespace) -> None:
    from .demo import DEMO_CLUSTER
    from .demo import main as demo_main

    code = demo_main(args.cluster or DEMO_CLUSTER, args.steps, html=args.html)
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
    s.add_argument("--max-rows", type=number(integer=True, low=1), default=200)
    s.set_defaults(func=cmd_analyze)
    s = sub.add_parser("plan", help="find the fastest parallel plan for a model on a cluster")
    s.add_argument("target", help="MODULE:FUNCTION returning (model, example_inputs[, loss_fn, target])")
    s.add_argument("--cluster", required=True, help=CLUSTER_HELP)
    s.add_argument("--json", default=None, help="also write the plan as JSON to this file")
    s.add_argument("--time-limit", type=number(low=0, low_open=True), default=60.0,
                   help="wall-clock guard in seconds (default 60): where it stops the search, the plan depends on "
                        "the machine's load")
    s.add_argument("--work-limit", type=number(integer=True, low=1), default=None,
                   help="configurations the search solves at most (default: the planner's, 2000): the same plan "
                        "on any machine")
    s.add_argument("--precision", default=None, choices=["fp32", "tf32", "bf16", "fp16"],
                   help="default: bf16 mixed precision, fp16 where a device lacks bf16 (V100, T4, Turing), "
                        "fp32 on CPU-only clusters")
    s.add_argument("--optimizer", default="adamw")
    s.add_argument("--memory-reserve", type=number(low=0, high=1, high_open=True), default=0.1,
                   help="fraction of each device's memory kept free (default 0.1)")
    s.add_argument("--compress", default=None, choices=["bf16", "fp16"],
                   help="allow stage sends on slow links to be rounded to this dtype (default: never)")
    s.add_argument("--profile", default=None,
                   help="measured blocks (`autopar profile --out FILE`): price the layers it has from them")
    s.add_argument("--html", default=None,
                   help="also write the plan as a page to open in a browser (device map, memory, timeline)")
    s.set_defaults(func=cmd_plan)
    s = sub.add_parser("diff", help="what changed between two plans (layers, shares, options, predicted time and "
                       "memory per device)")
    s.add_argument("a", help="a plan file (`autopar plan ... --json a.json`, plan.to_json())")
    s.add_argument("b", help="the plan to compare it with")
    s.set_defaults(func=cmd_diff)
    s = sub.add_parser("profile", help="time each distinct block of a model (forward, backward, recompute, peak "
                       "memory) on this machine's devices of the cluster's types, for plan --profile")
    s.add_argument("target", help="MODULE:FUNCTION returning (model, example_inputs[, loss_fn, target])")
    s.add_argument("--cluster", required=True, help=CLUSTER_HELP)
    s.add_argument("--out", required=True, help="the JSON file to write")
    s.add_argument("--microbatch-sizes", default=None,
                   help="comma-separated sizes to time (default: powers of two up to the batch, and the batch)")
    s.add_argument("--budget", type=number(low=0, low_open=True), default=120.0,
                   help="seconds of timing, about (default 120): larger sizes beyond it are left out")
    s.set_defaults(func=cmd_profile)
    s = sub.add_parser("run", help="start one process per device of the cluster running a script "
                                   "(independent processes that survive a lost one; torchrun with --max-restarts)",
                       description="Start one process per device of the cluster running a script. "
                       + RUN_RULE + ".")
    for name, kwargs in RUN_OPTIONS.items():
        s.add_argument(name, **kwargs)
    s.add_argument("script", nargs=argparse.REMAINDER, help="script.py [args...] (or -m module [args...])")
    s.set_defaults(func=cmd_run)
    s = sub.add_parser("probe", help="measure the cluster's links (collectives, send/recv) on the machines at "
                       "hand and write them into a cluster file",
                       description="Measure the cluster's links with torch.distributed (gloo here, NCCL on GPUs), "
                       "started like `autopar run`: one process per device of the cluster file. Writes the "
                       "cluster with measured intra-node and network figures to --out.")
    s.add_argument("--cluster", required=True, help=CLUSTER_HELP)
    s.add_argument("--out", required=True, help="cluster file to write (YAML, or JSON for a .json name)")
    s.add_argument("--max-mib", type=number(low=0, low_open=True), default=None,
                   help="large message size in MiB (default 64 on GPUs, 4 on CPUs)")
    s.add_argument("--iters", type=number(integer=True, low=1), default=5, help="timed repetitions per size")
    for name in ("--node-rank", "--master", "--dry-run"):
        s.add_argument(name, **RUN_OPTIONS[name])
    s.set_defaults(func=cmd_probe)
    s = sub.add_parser("demo", help="plan a small GPT for a mixed cluster, train it on local processes, "
                       "check it against single-process training")
    s.add_argument("--cluster", default=None, help="default: 1x2xA100-80GB+1x2xT4")
    s.add_argument("--steps", type=number(integer=True, low=1), default=5)
    s.add_argument("--html", default=None,
                   help="where to write the plan's report page (default: autopar-demo/plan.html in the temp dir)")
    s.set_defaults(func=cmd_demo)
    s = sub.add_parser("calibrate", help="time kernels on the local device and save a cost profile")
    s.add_argument("--device", default="local")
    s.add_argument("--quick", action="store_true", help="a shorter sweep (~20 s)")
    s.add_argument("--host", action="store_true",
                   help="measure this host's eager-PyTorch host path (per kernel, view, module call, autograd "
                        "node) on the CPU and save it: GPUs without their own profile price their host time "
                        "(the floor under small kernels) from it (~2 s)")
    s.set_defaults(func=cmd_calibrate)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        args.func(args)
    except AutoparError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
