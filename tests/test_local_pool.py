"""`spawn_local` under the suite's `LocalPool` (tests/conftest.py): the processes are kept between calls, yet
each call starts as a fresh process would (environment, sys.path, warning filters, torch defaults, a new
process group), and a failing call says which rank failed and leaves the next call working."""

from __future__ import annotations

import os
import sys
import warnings

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
