"""Start local gloo processes (tests, `autopar run` on a machine without GPUs)."""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
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
    rank: int, fn: Callable, world_size: int, port: int, args: tuple, out_dir: str, timeout_s: float
) -> None:
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
    `fn` must be importable (a module-level function).
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _worker,
            args=(fn, world_size, free_port(), args, out_dir, timeout_s),
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
