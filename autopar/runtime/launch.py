"""Start local gloo processes: `spawn_local` (tests) and `launch_workers` (`autopar run` on one machine)."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import AutoparError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, fn: Callable, world_size: int, port: int, args: tuple, out_dir: str, timeout_s: float,
    warning_filters: list | None = None,
) -> None:
    if warning_filters is not None:  # a rank's warnings are filtered as its caller's are (e.g. errors in tests)
        warnings.filters[:] = warning_filters
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "AUTOPAR_BACKEND": "gloo",
        }
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        from .elastic import shutdown

        shutdown()


def spawn_local(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` gloo processes; return each rank's result.

    A rank that raises or dies makes this raise within `timeout_s`, naming the rank and its error.
    `fn` must be importable (a module-level function). The ranks filter warnings as the caller does at the
    call (a warning that is an error here is one there).
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _worker,
            args=(fn, world_size, free_port(), args, out_dir, timeout_s, list(warnings.filters)),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s + 60
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    raise AutoparError(
                        f"local run of {world_size} ranks did not finish in {timeout_s + 60:.0f} s"
                    )
        except mp.ProcessRaisedException as e:
            raise AutoparError(f"rank {e.error_index} failed:\n{e.msg}") from None
        except mp.ProcessExitedException as e:
            raise AutoparError(f"rank {e.error_index} died (exit code {e.exit_code}).") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def launch_workers(script: list[str], nproc: int, env: dict[str, str] | None = None, host: str = "127.0.0.1",
                   ) -> int:
    """Run `script` (a path or `-m module`, then its arguments) as `nproc` worker processes of one job, each its
    own process with no agent over it, meeting in a TCPStore this launcher hosts (torchrun's environment:
    RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT with TORCHELASTIC_USE_AGENT_STORE=True, so an unchanged
    script's init_process_group finds the store). Unlike torchrun's agent it does not stop the others when a
    worker dies: the survivors re-route around it (reroute.py, enabled by AUTOPAR_REROUTE=1, which it sets
    unless the caller set it) and keep the store, which does not die with any worker.

    Returns 0 when every worker exited 0 or died with its loss re-routed by the survivors (reported on
    stderr), else the first other worker's exit code (128 + signal for a killed one)."""
    from .reroute import ENV, absorbed

    port = free_port()
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    base = dict(os.environ if env is None else env)
    base.setdefault(ENV, "1")
    procs = []
    for r in range(nproc):
        worker_env = dict(base, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                          GROUP_RANK="0", MASTER_ADDR=host, MASTER_PORT=str(port),
                          TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
        procs.append(subprocess.Popen([sys.executable, *script], env=worker_env))
    try:
        codes = [p.wait() for p in procs]
    except BaseException:  # Ctrl-C / SIGTERM of the launcher: take the workers down with it
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait()
        raise
    failed = [r for r, c in enumerate(codes) if c != 0]
    taken = absorbed(store, failed)
    for r, info in taken.items():
        why = f"killed by {signal.Signals(-codes[r]).name}" if codes[r] < 0 else f"exit code {codes[r]}"
        print(f"autopar run: worker {r} died ({why}); the survivors {info['by']} re-routed its micro-batches from "
              f"step {info['step']} on and finished without a restart.", file=sys.stderr)
    rest = [r for r in failed if r not in taken]
    if not rest:
        return 0
    code = codes[rest[0]]
    return 128 - code if code < 0 else code
