"""autopar on one CUDA GPU, in one command that finishes in under 5 minutes.

On a machine with an NVIDIA GPU, from the repository root, after `pip install -e ".[test]"` (torch with CUDA,
triton; an uninstalled checkout runs from its source when its dependencies are there; nothing is downloaded):

    python bench/gpu_check.py --out bench/results/gpu_check.json

Sections, each timed and guarded (a failure is recorded and the next section runs; the exit code is 1 when
any section failed):
1. env: torch / CUDA / triton / NCCL versions, the GPU, and the catalog type it maps to (`Cluster.local()`).
2. nccl_program: a 1-process NCCL group (an all-reduce and a broadcast on the GPU), a small GPT compiled with
   `autopar.compile` for the 1-GPU cluster, 3 steps with kernels "torch" and "auto" (generated Triton
   kernels), loss and every parameter against single-process eager training on the same GPU.
2b. nccl_ready: what issue 21 found would break on a first GPU run: a model built on the CPU with CPU inputs
   (the README's path), the group joined by autopar's own `ensure_initialized`; its parameters must be on
   the GPU and its steps equal eager; host-device syncs per step counted under
   `torch.cuda.set_sync_debug_mode("warn")` (more than the step's one loss read is a finding); and the time
   autopar's `dist.wait` holds the host on an all-reduce queued behind ~0.1 s of matmuls (a wait that
   blocks the host fails the section).
3. kernels: bench/fused_kernels.py's region cases compiled by Triton for real (not interpreted): max relative
   error against torch, median ms fused vs eager (`--inductor` adds torch.compile, ~1 min more).
4. calibrate: `autopar calibrate --quick --device cuda` (profile under <out>_files/profiles, used by the
   plans below), then the fitted model against a matmul and an add it did not time.
5. gpt_1gpu: GPT-2 medium's shape (24 layers, hidden 1024, seq 1024, 355M parameters), planned for the
   GPU, compiled, median step time and `torch.cuda.max_memory_allocated` vs the plan's predictions.
6. gpt_capped: the same GPT with the GPU capped by `torch.cuda.set_per_process_memory_fraction` to a small
   device whose memory cannot hold the training state (weights, gradients, AdamW moments; `--cap-gib`
   overrides), planned for a custom device `based_on` the real one with that memory, so the plan must
   offload; measured vs predicted time and memory. Running out of memory is reported as a finding.

Sections 5 and 6 plan (and so run) in `--precision` (default fp32; section 2 always fp32, as its eager
reference); the JSON records each plan's precision. No section starts past `--budget-s` (default 270 s);
the JSON is rewritten after every section, so a run stopped from outside keeps what it measured, and a
hang is cut (with a traceback) 25 s after the budget. `--cpu` (or `--dry-run`) runs the same pipeline on
the CPU with tiny shapes: gloo instead of NCCL, no Triton kernels and no calibration (what
tests/test_gpu_check.py runs).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import functools
import gc
import importlib.util
import itertools
import json
import os
import platform
import socket
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
if importlib.util.find_spec("autopar") is None:  # a checkout that is not installed: run from its source
    sys.path.insert(1, str(BENCH.parent))

import torch  # noqa: E402
from common import RESULTS  # noqa: E402

import autopar  # noqa: E402
from autopar import models  # noqa: E402
from autopar.cluster import Cluster, GiB  # noqa: E402
from autopar.report import render_table  # noqa: E402

SECTIONS = ("env", "nccl_program", "nccl_ready", "kernels", "calibrate", "gpt_1gpu", "gpt_capped")
SIZES = {  # models.gpt keyword arguments per mode
    "cuda": {"small": dict(batch=8, seq=128, vocab=1024, hidden=256, layers=2, heads=4),
             "big": dict(models.gpt_config("gpt2-medium"), batch=8)},
    "cpu": {"small": dict(batch=4, seq=16, vocab=64, hidden=32, layers=2, heads=2),
            "big": dict(batch=2, seq=16, vocab=128, hidden=128, layers=2, heads=4)},  # mostly weights: the cap binds
}
SMALL_STEPS = 3
# (loss atol, loss rtol, param rtol, param atol) against eager: torch ops are the same kernels; generated
# kernels reduce in another order (fp32 rounding, ~1e-6 relative)
TOLERANCES = {"torch": (1e-5, 1e-4, 1e-4, 1e-5), "auto": (1e-5, 1e-4, 1e-3, 1e-4)}
KERNEL_REL_TOL = 1e-4
CAP_SHARE = 0.8  # the capped device holds this share of the training state (after the plan's reserve)
STEP_RESERVE_S = 15.0  # measured steps stop when less than this is left of the budget
# on a GPU, a section does not start with less than this left (seconds; first Triton compiles included)
NEEDS_S = {"nccl_ready": 20, "kernels": 40, "calibrate": 30, "gpt_1gpu": 45, "gpt_capped": 40}


class Skip(Exception):
    """A section that cannot run here; the message is the reason."""


# ---- budget ----------------------------------------------------------------------------------------------


class Deadline:
    """The run's wall-clock budget: no section starts past it, and sections size their loops by `left()`."""

    def __init__(self, budget_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget_s, self.clock = budget_s, clock
        self.start = clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def expired(self) -> bool:
        return self.left() <= 0


@dataclass
class Context:
    args: argparse.Namespace
    deadline: Deadline
    cpu: bool  # the CPU pipeline (--cpu, or no CUDA device)
    files: Path  # profiles and plans of this run

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.cpu else torch.device("cuda", 0)

    @property
    def sizes(self) -> dict:
        big = dict(SIZES["cpu" if self.cpu else "cuda"]["big"])
        big.update({k: v for k, v in (("batch", self.args.batch), ("layers", self.args.layers)) if v})
        return {"small": SIZES["cpu" if self.cpu else "cuda"]["small"], "big": big}


# ---- the runner ------------------------------------------------------------------------------------------


def run_sections(sections: list[tuple[str, Callable[[Context], dict]]], ctx: Context,
                 after_each: Callable[[list[dict]], Any] | None = None) -> list[dict]:
    """Run each section in turn; every one ends with a status: ok, finding (ran, with a result to look at,
    e.g. out of memory), failed (error and traceback kept) or skipped (reason)."""
    results: list[dict] = []
    for name, fn in sections:
        res: dict[str, Any] = {"section": name}
        t0 = time.perf_counter()
        left, needs = ctx.deadline.left(), 0 if ctx.cpu else NEEDS_S.get(name, 0)
        if name in ctx.args.skip:
            res.update(status="skipped", reason="--skip")
        elif left <= 0:
            res.update(status="skipped", reason=f"budget of {ctx.deadline.budget_s:.0f} s used up")
        elif left < needs:
            res.update(status="skipped", reason=f"budget: {left:.0f} s left, the section needs ~{needs} s")
        else:
            print(f"[{ctx.deadline.elapsed():6.1f} s] {name} ...", file=sys.stderr, flush=True)
            try:
                figures = fn(ctx) or {}
                res.update(status="finding" if figures.get("finding") else "ok", figures=figures)
            except Skip as e:
                res.update(status="skipped", reason=str(e))
            except Exception as e:  # a broken section is a result; the next one still runs
                res.update(status="failed", error=f"{type(e).__name__}: {_first_line(e)}",
                           traceback=traceback.format_exc()[-4000:])
            finally:
                _release_device(ctx)
        res["seconds"] = round(time.perf_counter() - t0, 2)
        results.append(res)
        if after_each is not None:
            after_each(results)
    return results


def exit_code(results: list[dict]) -> int:
    return 1 if any(r["status"] == "failed" for r in results) else 0


def headline(res: dict) -> str:
    if res["status"] == "failed":
        return res["error"][:110]
    if res["status"] == "skipped":
        return res["reason"][:110]
    return str(res.get("figures", {}).get("headline", ""))


def write_report(results: list[dict], path: Path, meta: dict) -> Path:
    """JSON {meta, summary, rows} as the other bench scripts write it (rows: one per section)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    by = {s: [r["section"] for r in results if r["status"] == s] for s in ("ok", "finding", "failed", "skipped")}
    summary = {**by, "seconds": round(sum(r["seconds"] for r in results), 1), "exit_code": exit_code(results)}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "summary": summary, "rows": results}, indent=1, default=str))
    tmp.replace(path)
    return path


def report_text(results: list[dict]) -> str:
    lines = [render_table([["section", "status", "s", "result"]] + [
        [r["section"], r["status"], f"{r['seconds']:.1f}", headline(r)] for r in results], right={2})]
    measured = [r for r in results if r["section"].startswith("gpt_") and "measured_step_s" in r.get("figures", {})]
    if measured:
        rows = [["case", "plan", "step s pred", "step s meas", "meas/pred", "peak GiB pred", "peak GiB meas",
                 "meas/pred"]]
        for r in measured:
            f = r["figures"]
            rows.append([r["section"], f["plan"], _fmt(f["predicted_step_s"]), _fmt(f["measured_step_s"]),
                         _fmt(f.get("step_ratio")), _fmt(f["predicted_peak_GiB"]), _fmt(f.get("measured_peak_GiB")),
                         _fmt(f.get("peak_ratio"))])
        lines += ["", render_table(rows, right=set(range(2, 8)))]
    return "\n".join(lines)


# ---- helpers ---------------------------------------------------------------------------------------------


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.4g}" if isinstance(x, float) else str(x)


def _release_device(ctx: Context) -> None:
    gc.collect()
    if not ctx.cpu and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_cluster(ctx: Context) -> dict:
    """The cluster file of this machine's first device: the GPU as `Cluster.local()` maps it, or the CPU."""
    if ctx.cpu:
        return {"name": "local-cpu", "nodes": [{"device": "cpu", "devices_per_node": 1}]}
    src = Cluster.local().source
    return {"name": "local-gpu", "nodes": [dict(src["nodes"][0], devices_per_node=1)]}


def capped_cluster(local: dict, cap_bytes: int, kind: str | None = None) -> dict:
    """`local` with its device's memory set to `cap_bytes`: a custom device `based_on` the real one, keeping
    its name so its calibrated profile still prices it (and its kind unless `kind` is given)."""
    group = dict(local["nodes"][0])
    dev = group["device"]
    entry = dict(dev) if isinstance(dev, dict) else {"based_on": dev}
    entry.update(name=Cluster.load(local).devices[0].spec.name, memory_GiB=cap_bytes / GiB)
    if kind is not None:
        entry["kind"] = kind
    # offload goes to this host's RAM (a custom device's default host memory scales with its own memory)
    group.setdefault("host_memory_GiB", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB)
    return {"name": "capped", "nodes": [dict(group, device=entry)]}


def release_storage(model: torch.nn.Module) -> int:
    """Free the storage of `model`'s parameters and buffers (the compiled program trains its own copies),
    so the device holds what the plan priced; returns the bytes freed."""
    freed, seen = 0, set()
    for t in itertools.chain(model.parameters(), model.buffers()):
        s = t.untyped_storage()
        if s.data_ptr() not in seen and s.nbytes():
            seen.add(s.data_ptr())
            freed += s.nbytes()
            s.resize_(0)
    return freed


def describe_plan(plan: Any) -> dict:
    p = plan.pipelines[0]
    stages = [{"layers": list(s.layers), "zero": s.zero, "recompute": s.recompute, "offload": list(s.offload)}
              for s in p.stages]
    offload = sorted({k for s in stages for k in s["offload"]})
    recompute = any(s["recompute"] for s in stages)
    short = (f"{len(stages)} stage(s), {p.num_microbatches} micro-batch(es)" + (", recompute" if recompute else "")
             + (f", offload {'+'.join(offload)}" if offload else ""))
    pred = plan.predicted
    first = lambda d: next(iter(d.values())) if d else None
    return {"plan": short, "precision": plan.precision, "kernels": plan.model.get("kernels"),
            "schedule": plan.schedule, "microbatches": p.num_microbatches, "stages": stages, "offload": offload,
            "recompute": recompute, "predicted_step_s": pred.get("step_time_s"),
            "predicted_peak_GiB": first(pred.get("peak_memory_bytes", {})) / GiB,
            "capacity_GiB": first(pred.get("memory_capacity_bytes", {})) / GiB}


def _adamw(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def _plan(ctx: Context, case: models.ModelCase, cluster: dict, precision: str | None = None) -> Any:
    return autopar.plan(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn,
                        optimizer="adamw", precision=precision or ctx.args.precision,
                        time_limit_s=ctx.args.plan_time_limit)


@contextlib.contextmanager
def profile_dir(path: Path) -> Iterator[None]:
    """Profiles read and written under `path` for the run (the host's own are left alone)."""
    from autopar.cost_models import host

    with mock.patch.dict(os.environ, {"AUTOPAR_PROFILE_DIR": str(path)}):
        host.cpu_spec.cache_clear()  # the CPU's figures come from its profile
        try:
            yield
        finally:
            host.cpu_spec.cache_clear()


# ---- sections --------------------------------------------------------------------------------------------


def section_env(ctx: Context) -> dict:
    f: dict[str, Any] = {"mode": "cpu" if ctx.cpu else "cuda", "torch": torch.__version__, "cuda": torch.version.cuda,
                         "python": platform.python_version(), "host_cpus": os.cpu_count(),
                         "autopar": autopar.__version__}
    try:
        import triton

        f["triton"] = triton.__version__
    except ImportError:
        f["triton"] = None
    spec = Cluster.load(local_cluster(ctx)).devices[0].spec
    f.update(catalog_type=spec.name, catalog_memory_GiB=round(spec.memory / GiB, 2))
    if ctx.cpu:
        f["headline"] = f"CPU pipeline (--cpu{'' if torch.cuda.is_available() else '; no CUDA device'}), " \
                        f"torch {torch.__version__}"
        return f
    props = torch.cuda.get_device_properties(0)
    nccl = torch.cuda.nccl.version()
    f.update(gpu=props.name, gpu_memory_GiB=round(props.total_memory / GiB, 2), capability=f"{props.major}."
             f"{props.minor}", sms=props.multi_processor_count, gpus=torch.cuda.device_count(),
             nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
             tf32_matmul=torch.backends.cuda.matmul.allow_tf32, alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    f["headline"] = (f"{props.name} {f['gpu_memory_GiB']} GiB as catalog {spec.name}; torch {torch.__version__} "
                     f"CUDA {torch.version.cuda} NCCL {f['nccl']} triton {f['triton']}")
    return f


def section_nccl_program(ctx: Context) -> dict:
    import torch.distributed as dist

    backend = "gloo" if ctx.cpu else "nccl"
    if not ctx.cpu:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        probe = torch.arange(4.0, device=ctx.device)
        dist.all_reduce(probe)
        dist.broadcast(probe, src=0)
        if not torch.equal(probe.cpu(), torch.arange(4.0)):
            raise AssertionError(f"{backend} all-reduce/broadcast on one rank changed the tensor: {probe}")
        cluster = local_cluster(ctx)
        build = lambda: models.gpt(**ctx.sizes["small"], device=ctx.device, seed=0)
        case = build()
        plan = _plan(ctx, case, cluster, "fp32")  # the reference trains in fp32
        ref_losses, ref_state = models.train_reference(build(), _adamw, SMALL_STEPS)
        f: dict[str, Any] = {"backend": backend, "plan": describe_plan(plan)["plan"], "precision": plan.precision,
                             "reference_losses": ref_losses}
        ok = True
        for mode in ("auto",) if ctx.cpu else ("torch", "auto"):
            case = build()
            prog = autopar.compile(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn,
                                   optimizer=_adamw, plan=plan, kernels=mode, timeout_s=60)
            losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(SMALL_STEPS)]
            state = prog.state_dict()["model"]
            l_atol, l_rtol, p_rtol, p_atol = TOLERANCES[mode]
            loss_ok = all(abs(a - b) <= l_atol + l_rtol * abs(b) for a, b in zip(losses, ref_losses, strict=True))
            params_ok = all(torch.allclose(state[k], v, rtol=p_rtol, atol=p_atol) for k, v in ref_state.items())
            reports = [r for v in getattr(prog, "kernel_reports", {}).values()
                       for r in (v if isinstance(v, list) else [v])]
            f[mode] = {"losses": losses, "max_loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses,
                                                                                      strict=True)),
                       "max_param_diff": max((state[k] - v).abs().max().item() for k, v in ref_state.items()),
                       "loss_match": loss_ok, "params_match": params_ok,
                       "fused_regions": sum(len(r.fused) for r in reports),
                       "kernel_fallbacks": [n for r in reports for reg in r.regions for n in reg.notes]}
            ok = ok and loss_ok and params_ok
            del prog, case
        f["match"] = ok
        f["loss_falling"] = ref_losses[-1] < ref_losses[0]
        diffs = ", ".join(f"{m}: loss {f[m]['max_loss_diff']:.1e} params {f[m]['max_param_diff']:.1e}"
                          + (f" ({len(f[m]['kernel_fallbacks'])} kernel fallbacks)" if f[m]["kernel_fallbacks"] else "")
                          for m in ("torch", "auto") if m in f)
        f["headline"] = f"{backend}, {SMALL_STEPS} steps vs eager, {diffs}: {'match' if ok else 'MISMATCH'}"
        if not ok:
            raise AssertionError(f["headline"])
        return f
    finally:
        dist.destroy_process_group()


WAIT_MATMULS = 6  # nccl_ready: queued 8192^2 matmuls (~20 ms each on an A100-class GPU) ahead of the all-reduce


def _syncs_per_step(ctx: Context, step: Callable[[], float], steps: int) -> tuple[list[float], list[int]]:
    """Run `step` `steps` times, counting the host-device synchronizations inside each: torch's own detector
    (`torch.cuda.set_sync_debug_mode("warn")`) on a GPU, autopar's CPU stand-in (runtime/sync_audit.py) on
    the CPU."""
    import warnings

    losses, counts = [], []
    for _ in range(steps):
        if ctx.cpu:
            from autopar.runtime.sync_audit import host_syncs

            with host_syncs() as found:
                losses.append(step())
            counts.append(len(found))
            continue
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                losses.append(step())
            finally:
                torch.cuda.set_sync_debug_mode(0)
        counts.append(sum("synchroniz" in str(w.message) for w in seen))
    return losses, counts


def _wait_blocking(ctx: Context) -> dict:
    """How long autopar's `dist.wait` holds the host on an all-reduce queued behind GPU work: a wait that only
    orders the stream returns at once; one that blocks returns when the GPU is done."""
    import torch.distributed as dist

    from autopar.runtime import dist as adist

    n = 8192 if not ctx.cpu else 512
    a = torch.randn(n, n, device=ctx.device)
    t = torch.ones(1 << 20, device=ctx.device)
    if not ctx.cpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(WAIT_MATMULS):
        a = a @ a
        a = a / a.norm()
    queued = time.perf_counter()
    work = dist.all_reduce(t, async_op=True)
    adist.wait(work, "gpu_check all-reduce", "itself")
    waited = time.perf_counter()
    if not ctx.cpu:
        torch.cuda.synchronize()
    done = time.perf_counter()
    f = {"queue_ms": (queued - t0) * 1e3, "wait_host_ms": (waited - queued) * 1e3,
         "device_done_ms": (done - queued) * 1e3}
    # on the CPU pipeline there is no device stream to order: gloo's wait on CPU tensors returns when the all-reduce
    # is done, so the host always waits (its length is the host's speed, which failed this check on a loaded host)
    f["wait_blocked_host"] = (not ctx.cpu and f["wait_host_ms"] > 0.5 * f["device_done_ms"]
                              and f["device_done_ms"] > 5)
    return f


def section_nccl_ready(ctx: Context) -> dict:
    """The user's path on the GPU, as issue 21 found it broken: a model built on the CPU (as the README shows)
    with CPU inputs, the process group joined by autopar's own setup (`ensure_initialized`: device set first,
    `device_id`, cpu:gloo,cuda:nccl); the program's parameters must be on the GPU, its steps equal eager
    training and hold no host-device sync beyond the step's loss; and autopar's wait must not block the host."""
    import copy

    import torch.distributed as dist

    from autopar.runtime.dist import ensure_initialized

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0"}
    if ctx.cpu:
        env["AUTOPAR_BACKEND"] = "gloo"
    with mock.patch.dict(os.environ, env):
        ensure_initialized(60)
    try:
        f: dict[str, Any] = {"backend": str(dist.get_backend())}
        case = models.gpt(**ctx.sizes["small"], device="cpu", seed=0)
        ref = copy.deepcopy(case)
        ref.model.to(ctx.device)
        ref.example_inputs = tuple(x.to(ctx.device) for x in ref.example_inputs)
        ref.example_target = ref.example_target.to(ctx.device)
        ref_losses, ref_state = models.train_reference(ref, _adamw, SMALL_STEPS)
        cluster = local_cluster(ctx)
        plan = _plan(ctx, case, cluster, "fp32")
        prog = autopar.compile(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn,
                               optimizer=_adamw, plan=plan, kernels="torch", timeout_s=60)
        devices = sorted({str(p.device) for p in prog.params.values()})
        f["param_devices"] = devices
        f["params_on_device"] = devices == [str(ctx.device)]
        step = functools.partial(prog.step, *case.example_inputs, target=case.example_target)
        losses, syncs = _syncs_per_step(ctx, step, SMALL_STEPS)
        state = prog.state_dict()["model"]
        l_atol, l_rtol, p_rtol, p_atol = TOLERANCES["torch"]
        f["loss_match"] = all(abs(a - b) <= l_atol + l_rtol * abs(b)
                              for a, b in zip(losses, ref_losses, strict=True))
        f["params_match"] = all(torch.allclose(state[k].to(ctx.device), v, rtol=p_rtol, atol=p_atol)
                                for k, v in ref_state.items())
        f["state_dict_devices"] = sorted({str(v.device) for v in state.values()})
        f["syncs_per_step"] = syncs
        del prog, step
        f["wait"] = _wait_blocking(ctx)
        problems = [what for what, bad in (
            ("parameters not on the rank's device", not f["params_on_device"]),
            ("losses differ from eager", not f["loss_match"]), ("parameters differ from eager", not f["params_match"]),
            ("the wait blocked the host", f["wait"]["wait_blocked_host"])) if bad]
        if max(syncs[1:] or syncs) > 1:
            f["finding"] = f"{max(syncs)} host-device syncs in a step (1 expected: the step's loss)"
        f["headline"] = (f"{f['backend']}: CPU-built model on {devices}, syncs/step {syncs}, wait held the host "
                         f"{f['wait']['wait_host_ms']:.1f} of {f['wait']['device_done_ms']:.1f} ms"
                         + (f"; {', '.join(problems)}" if problems else ", matches eager"))
        if problems:
            raise AssertionError(f["headline"])
        return f
    finally:
        dist.destroy_process_group()


def _load_kernel_bench() -> Any:
    # by path: a package called `kernels` may be installed, and bench/ is not a package
    spec = importlib.util.spec_from_file_location("autopar_bench_kernels", BENCH / "fused_kernels.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def section_kernels(ctx: Context) -> dict:
    if ctx.cpu:
        raise Skip("no CUDA: the generated kernels compile for a GPU (bench/fused_kernels.py checks them on the CPU "
                   "in the Triton interpreter)")
    kb = _load_kernel_bench()
    rows, cut = [], None
    for kind, case in kb.cases().items():
        if ctx.deadline.left() < 60:
            cut = f"stopped before {kind}: budget"
            break
        rows.append(kb.check(kind, case, "cuda", timed=True, inductor=ctx.args.inductor))
    if not rows:
        raise Skip(cut or "no cases")
    errs = [r["max_rel_err"] for r in rows if "max_rel_err" in r]
    fell_back = [r["kind"] for r in rows if r["kernels_ran"] != "yes"]
    speedups = [r["speedup_vs_eager"] for r in rows]
    f = {"rows": rows, "max_rel_err": max(errs), "geomean_speedup_vs_eager": statistics.geometric_mean(speedups),
         "fell_back_to_torch": fell_back, "cut": cut}
    if ctx.args.inductor:
        f["geomean_speedup_vs_inductor"] = statistics.geometric_mean(r["speedup_vs_inductor"] for r in rows)
    print(render_table([["kind", "regions", "ran", "max rel err", "eager ms", "kernel ms", "x eager"]] + [
        [r["kind"], r["regions"], r["kernels_ran"][:20], _fmt(r.get("max_rel_err")), _fmt(r["eager_ms"]),
         _fmt(r["kernel_ms"]), _fmt(r["speedup_vs_eager"])] for r in rows], right=set(range(3, 7))))
    f["headline"] = (f"{len(rows)} kinds, max rel err {f['max_rel_err']:.1e}, fused vs eager geomean "
                     f"{f['geomean_speedup_vs_eager']:.2f}x" + (f"; fell back: {fell_back}" if fell_back else ""))
    if fell_back or f["max_rel_err"] > KERNEL_REL_TOL:
        raise AssertionError(f["headline"])
    return f


def section_calibrate(ctx: Context) -> dict:
    if ctx.cpu:
        raise Skip("--cpu: CPU calibration takes ~15 s (tests/test_compute.py runs it); the GPU run calibrates")
    from autopar.cli import main as cli_main
    from autopar.cost_models.compute import ComputeModel, load_profile, profile_path

    rc = cli_main(["calibrate", "--quick", "--device", "cuda"])
    if rc:
        raise RuntimeError(f"autopar calibrate --quick --device cuda exited with {rc}")
    spec = Cluster.load(local_cluster(ctx)).devices[0].spec
    prof = load_profile(spec.name)
    if prof is None:
        raise RuntimeError(f"calibration wrote no readable profile at {profile_path(spec.name)}")
    meta, cm, timed = prof.meta, ComputeModel(spec, prof, dtype="fp32"), _load_kernel_bench().cuda_ms
    n, e = 4096, 2**26
    a, b, x = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda"), torch.randn(e, device="cuda")
    checks = {"matmul_4096": (timed(lambda: torch.mm(a, b)), cm.op_time("matmul", 2.0 * n**3, 12.0 * n * n)),
              "add_64M": (timed(lambda: torch.add(x, x)), cm.op_time("elementwise", float(e), 12.0 * e))}
    f = {"profile": str(profile_path(spec.name)), "seconds": meta.get("seconds"), "samples": meta.get("samples"),
         "reliable": meta.get("reliable"), "rms_log_error": meta.get("rms_log_error"),
         "overhead_us": prof.overhead_s * 1e6, "other_load_cpus": meta.get("other_load_cpus"),
         "unseen_ops": {k: {"measured_ms": m, "predicted_ms": p * 1e3, "ratio": p * 1e3 / m}
                        for k, (m, p) in checks.items()}}
    ratios = ", ".join(f"{k} pred/meas {v['ratio']:.2f}" for k, v in f["unseen_ops"].items())
    f["headline"] = f"profile {spec.name} in {f['seconds']} s, {f['samples']} timings, {ratios}"
    return f


def _train_measured(ctx: Context, case: models.ModelCase, cluster: dict, plan: Any, steps: int,
                    cap_bytes: int | None = None) -> dict:
    """`_train_measured_once`, with the plan's own drift warnings (autopar.PlanDriftWarning) recorded as
    findings (`plan_drift`) rather than raised: this script reports figures."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", autopar.PlanDriftWarning)
        f = _train_measured_once(ctx, case, cluster, plan, steps, cap_bytes)
    f["plan_drift"] = [str(w.message) for w in seen if issubclass(w.category, autopar.PlanDriftWarning)]
    for w in seen:
        if not issubclass(w.category, autopar.PlanDriftWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return f


def _train_measured_once(ctx: Context, case: models.ModelCase, cluster: dict, plan: Any, steps: int,
                         cap_bytes: int | None = None) -> dict:
    """Compile under `plan`, free the model's own copy, (cap the GPU,) run 1 warm-up + `steps` measured steps:
    median step seconds and peak allocated bytes against the plan. Out of memory ends the run as a finding."""
    prog = autopar.compile(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn,
                           optimizer="adamw", plan=plan, timeout_s=120)
    f: dict[str, Any] = {"freed_model_copy_GiB": release_storage(case.model) / GiB}
    cuda = not ctx.cpu
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        f["resident_before_steps_GiB"] = torch.cuda.memory_allocated() / GiB
        if cap_bytes is not None:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total))
            f["cap_fraction"] = cap_bytes / total
        torch.cuda.reset_peak_memory_stats()
    times: list[float] = []
    losses: list[float] = []
    try:
        for i in range(1 + steps):
            if i == 1 and cuda:
                f["peak_first_step_GiB"] = torch.cuda.max_memory_allocated() / GiB
                torch.cuda.reset_peak_memory_stats()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            losses.append(prog.step(*case.example_inputs, target=case.example_target))
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            if i >= 1 and ctx.deadline.left() < STEP_RESERVE_S:
                f["cut"] = f"{i} measured step(s): budget"
                break
    except torch.OutOfMemoryError as e:
        f["oom"] = f"step {len(times) + 1} of {1 + steps}: {_first_line(e)}"
        f["finding"] = f"out of memory under the plan: {f['oom'][:200]}"
    f.update(losses=losses, step_times_s=times, first_step_s=times[0] if times else None)
    if len(times) > 1:
        f["measured_step_s"] = statistics.median(times[1:])
        f["step_ratio"] = f["measured_step_s"] / plan.predicted["step_time_s"]
    if cuda:  # the peak since the last reset: of the measured steps, else of what ran before running out
        peak = torch.cuda.max_memory_allocated() / GiB
        key = "peak_before_oom_GiB" if "oom" in f else "measured_peak_GiB" if len(times) > 1 else \
            "peak_first_step_GiB"
        f[key] = peak
        f["max_reserved_GiB"] = torch.cuda.max_memory_reserved() / GiB
        if key == "measured_peak_GiB":
            f["peak_ratio"] = peak / describe_plan(plan)["predicted_peak_GiB"]
    else:  # the plan's own check measured the CPU allocator, where a stand-in's host copies are too
        r = prog.report().ranks[0]
        if r.measured_peak_bytes is not None:
            f["plan_check"] = {"measured_peak_GiB": r.measured_peak_bytes / GiB, "ratio": r.ratio,
                               "predicted_GiB": r.predicted_peak_bytes / GiB}  # host overlap included
    del prog
    return f


def _big_case(ctx: Context) -> models.ModelCase:
    return models.gpt(**ctx.sizes["big"], device=ctx.device, seed=0)


def _gpt_headline(f: dict) -> str:
    if "measured_step_s" not in f:
        return f"{f['plan']}: " + (f.get("finding") or "no measured step")
    mem = f" peak {f['measured_peak_GiB']:.2f}/{f['predicted_peak_GiB']:.2f} GiB" if "peak_ratio" in f else ""
    return (f"{f['params_M']:.3g}M params, {f['plan']}, {f['precision']}: step {f['measured_step_s']:.3f}/"
            f"{f['predicted_step_s']:.3f} s (meas/pred){mem}")


def section_gpt_1gpu(ctx: Context) -> dict:
    cluster = local_cluster(ctx)
    case = _big_case(ctx)
    plan = _plan(ctx, case, cluster)
    f = {"params_M": sum(p.numel() for p in case.model.parameters()) / 1e6, **describe_plan(plan),
         "plan_file": str(ctx.files / "plan_gpt_1gpu.json")}
    Path(f["plan_file"]).write_text(plan.to_json())
    f.update(_train_measured(ctx, case, cluster, plan, ctx.args.steps))
    f["headline"] = _gpt_headline(f)
    return f


def section_gpt_capped(ctx: Context) -> dict:
    from autopar.cost_models.memory import state_bytes_per_param

    local = local_cluster(ctx)
    case = _big_case(ctx)
    numel = sum(p.numel() for p in case.model.parameters())
    state = numel * state_bytes_per_param("adamw", ctx.args.precision).total
    reserve = 0.1  # autopar.plan's default memory_reserve
    cap = int(ctx.args.cap_gib * GiB) if ctx.args.cap_gib else int(CAP_SHARE * state / (1 - reserve))
    # the cpu device's memory is the host's, so offloading saves nothing there: --cpu stands in a device
    # with its own memory (kind gpu) for the capped GPU
    cluster = capped_cluster(local, cap, "gpu" if ctx.cpu else None)
    plan = _plan(ctx, case, cluster)
    f = {"params_M": numel / 1e6, "training_state_GiB": state / GiB, "cap_GiB": cap / GiB, **describe_plan(plan),
         "plan_file": str(ctx.files / "plan_gpt_capped.json")}
    Path(f["plan_file"]).write_text(plan.to_json())
    if not f["offload"]:
        f["note"] = "the plan does not offload at this cap"
    f.update(_train_measured(ctx, case, cluster, plan, max(1, min(3, ctx.args.steps)), None if ctx.cpu else cap))
    f["headline"] = f"cap {cap / GiB:.3g} GiB: " + _gpt_headline(f)
    return f


SECTION_FNS: dict[str, Callable[[Context], dict]] = {
    "env": section_env, "nccl_program": section_nccl_program, "nccl_ready": section_nccl_ready,
    "kernels": section_kernels,
    "calibrate": section_calibrate, "gpt_1gpu": section_gpt_1gpu, "gpt_capped": section_gpt_capped,
}


# ---- entry point -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON report (default bench/results/gpu_check.json; the CPU pipeline: gpu_check_cpu.json)")
    ap.add_argument("--cpu", "--dry-run", dest="cpu", action="store_true",
                    help="the section pipeline on the CPU with tiny shapes (gloo; no kernels, no calibration)")
    ap.add_argument("--budget-s", type=float, default=270.0, help="no section starts after this (default 270)")
    ap.add_argument("--skip", type=lambda s: [x for x in s.split(",") if x], default=[],
                    help=f"comma-separated sections to skip, of {','.join(SECTIONS)}")
    ap.add_argument("--steps", type=int, default=5, help="measured steps of the large GPT (capped: at most 3)")
    ap.add_argument("--batch", type=int, default=None, help="batch of the large GPT (default 8; --cpu 2)")
    ap.add_argument("--layers", type=int, default=None, help="layers of the large GPT (default 24; --cpu 2)")
    ap.add_argument("--cap-gib", type=float, default=None,
                    help="capped device memory (default: 80%% of the training state after the plan's reserve)")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "bf16", "fp16"],
                    help="precision the large GPT's plans price and run (default fp32)")
    ap.add_argument("--plan-time-limit", type=float, default=20.0, help="seconds per plan search")
    ap.add_argument("--inductor", action="store_true", help="kernels: also time torch.compile (~1 min)")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.skip) - set(SECTIONS))
    if unknown:
        ap.error(f"--skip: unknown section(s) {unknown}; sections are {', '.join(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cpu = args.cpu or not torch.cuda.is_available()
    if not args.cpu and cpu:
        print("gpu_check: no CUDA device, running the CPU pipeline (--cpu)", file=sys.stderr)
    out = args.out or RESULTS / ("gpu_check_cpu.json" if cpu else "gpu_check.json")  # never mixed up
    ctx = Context(args, Deadline(args.budget_s), cpu, out.parent / f"{out.stem}_files")
    (ctx.files / "profiles").mkdir(parents=True, exist_ok=True)
    meta = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "machine": platform.machine(),
            "torch": torch.__version__, "mode": "cpu" if cpu else "cuda", "argv": sys.argv[1:] if argv is None
            else argv, "budget_s": args.budget_s}
    write = lambda results: write_report(results, out, meta)
    faulthandler.dump_traceback_later(args.budget_s + 25, exit=True)  # a hang must not eat the device time
    try:
        with profile_dir(ctx.files / "profiles"):
            results = run_sections([(n, SECTION_FNS[n]) for n in SECTIONS], ctx, write)
    finally:
        faulthandler.cancel_dump_traceback_later()
    print(report_text(results))
    print(f"wrote {write(results)} ({ctx.deadline.elapsed():.0f} s)")
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
