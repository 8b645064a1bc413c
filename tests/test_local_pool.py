"""`spawn_local` under the suite's `LocalPool` (tests/conftest.py): the processes are kept between calls, yet
each call starts as a fresh process would (environment, sys.path, warning filters, torch defaults, a new
process group), and a failing call says which rank failed and leaves the next call working."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.runtime.launch import LocalPool, spawn_local


def _seen(rank: int, world: int) -> dict:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"pid": os.getpid(), "sum": t.item(), "mark": os.environ.get("AUTOPAR_POOL_MARK"),
            "dtype": torch.get_default_dtype(), "grad": torch.is_grad_enabled(), "path": list(sys.path),
            "threads": torch.get_num_threads()}


def _spoil(rank: int, world: int) -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    os.environ["AUTOPAR_POOL_MARK"] = "left behind"
    torch.set_num_threads(2)


def _fail_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one gives up")
    dist.barrier()  # rank 0 waits here for a peer that never comes


def _warn(rank: int, world: int) -> None:
    warnings.warn("a rank's warning", UserWarning, stacklevel=1)


def test_processes_are_kept_and_each_call_starts_fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    assert LocalPool._active is not None  # the suite's pool (tests/conftest.py)
    first = spawn_local(_seen, 2)
    spawn_local(_spoil, 2)
    second = spawn_local(_seen, 2)
    assert [r["pid"] for r in second] == [r["pid"] for r in first]  # the same processes
    for r in second:
        assert r["sum"] == 3.0  # a working process group of both ranks
        assert (r["mark"], r["dtype"], r["grad"], r["threads"]) == (None, torch.float32, True, 1)
        assert r["path"] == sys.path
    monkeypatch.setenv("AUTOPAR_POOL_MARK", "set by the test")
    marked = spawn_local(_seen, 2)
    assert [r["mark"] for r in marked] == ["set by the test"] * 2


def test_a_failing_rank_is_named_and_the_next_call_works() -> None:
    with pytest.raises(AutoparError, match=r"rank 1 failed:(.|\n)*rank one gives up"):
        spawn_local(_fail_on_one, 2, timeout_s=30)
    assert [r["sum"] for r in spawn_local(_seen, 2)] == [3.0, 3.0]


def test_ranks_filter_warnings_as_the_caller_does() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with pytest.raises(AutoparError, match="a rank's warning"):
            spawn_local(_warn, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert spawn_local(_warn, 2) == [None, None]


def _tp_losses(rank: int, world: int, extra_groups: int) -> list[float]:
    from .runtime_cases import run_cases

    for _ in range(extra_groups):  # group names count up from 0 in each process group: shift this call's
        dist.new_group(list(range(world)))
    return run_cases(rank, world, [("gpt", {"layers": 2, "batch": 4}, {"tp": 2, "dp": 2})])[0][0]


def test_tensor_parallel_programs_run_in_consecutive_calls() -> None:
    """DTensor caches its sharding plans by mesh, and a new mesh over the same ranks equals the last call's,
    whose groups are gone: the pool clears those caches between calls (as torch's DTensor tests do)."""
    first = spawn_local(_tp_losses, 4, 3)  # the tensor-parallel groups are new groups (of 2 of the 4 ranks)
    assert spawn_local(_tp_losses, 4, 0) == first


def _origin(rank: int, world: int, modules: tuple[str, ...]) -> tuple[int, list[bool]]:
    return os.getppid(), [m in sys.modules for m in modules]


def test_ranks_are_forked_from_the_preloaded_server_where_the_environment_is_the_pools(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite's pool preloads (tests/conftest.py PRELOAD): its ranks are children of multiprocessing's fork
    server with those modules already imported; a set for a changed environment is spawned by this process and
    imports only what its job needs (a preloaded module read the server's environment at its import)."""
    pool = LocalPool._active
    assert pool is not None and pool.preload
    for ppid, loaded in spawn_local(_origin, 2, pool.preload):
        assert ppid != os.getpid() and all(loaded), (ppid, dict(zip(pool.preload, loaded, strict=True)))
    assert pool.start_method() == "forkserver"  # what a test that starts its own processes is told
    monkeypatch.setenv("AUTOPAR_POOL_MARK", "another environment")
    for ppid, loaded in spawn_local(_origin, 2, pool.preload):
        assert ppid == os.getpid() and not all(loaded)
    assert pool.start_method() == "spawn"


_KEPT: list = []  # what a job leaves alive in its rank until the process ends


class _OnTeardown:
    """Writes `path` when the interpreter's teardown frees it (module globals cleared at exit)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __del__(self, write: object = os.write, open_: object = os.open,
                flags: int = os.O_WRONLY | os.O_CREAT) -> None:  # (bound now: globals may be gone by then)
        write(open_(self.path, flags), b"torn down")  # type: ignore[operator]


def _leave_marks(rank: int, world: int, out: str) -> int:
    _KEPT.append(multiprocessing.get_context("spawn").RLock())  # a semaphore, as tqdm's lock in fx's Interpreter
    atexit.register(Path(out, f"atexit{rank}").write_text, "ran")
    _KEPT.append(_OnTeardown(Path(out, f"teardown{rank}")))
    return os.getpid()


def test_a_smaller_call_runs_on_kept_ranks_and_a_closed_pool_skips_the_teardown(tmp_path: Path) -> None:
    """A call of fewer ranks runs on the first ranks of a kept set (no processes started for it); a served rank
    leaves without the interpreter's teardown (1-4 s with torch, transformers and triton loaded, paid at every
    pool close), yet runs its exit handlers: multiprocessing's release the semaphores its jobs made, which the
    resource tracker would otherwise report as leaked."""
    pool = LocalPool()  # beside the suite's: not entered, closed here
    out = str(tmp_path)
    pool.run(_seen, 3, (), out, 60.0)
    procs = [proc for kept in pool._pools.values() for proc in kept.procs]
    pool.run(_leave_marks, 2, (out,), out, 60.0)
    assert len(pool._pools) == 1 and sorted(torch.load(Path(out, f"rank{r}.pt")) for r in (0, 1)) \
        == sorted(proc.pid for proc in procs[:2])
    pool.close()
    assert [proc.exitcode for proc in procs] == [0, 0, 0]
    assert sorted(f.name for f in tmp_path.glob("atexit*")) == ["atexit0", "atexit1"]
    assert not list(tmp_path.glob("teardown*"))
