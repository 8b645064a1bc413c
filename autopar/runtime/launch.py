"""Start local gloo processes: `spawn_local` (tests) and `launch_workers` (`autopar run` on one machine)."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import importlib
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
from multiprocessing.connection import Connection, wait
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


def _run_rank(
    rank: int, fn: Callable, world_size: int, port: int, args: tuple, out_dir: str, timeout_s: float,
    warning_filters: list | None = None,
) -> None:
    """One rank of one `spawn_local` call, in a fresh process group; its result lands in out_dir."""
    if warning_filters is not None:  # a rank's warnings are filtered as its caller's are (e.g. errors in tests)
        warnings.filters[:] = warning_filters
        warnings._filters_mutated()  # type: ignore[attr-defined]  # forget what "once" already showed
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


def _serve(rank: int, jobs: Connection) -> None:
    """A pooled rank: run the jobs it is sent, each as a fresh process would start it (the caller's
    environment, sys.path and warning filters; torch's first seed, fp32, grad mode, one thread), until told
    to stop, its caller goes away, or a job fails (then it reports and exits: the other ranks may be stuck)."""
    first_seed = torch.initial_seed()
    _freeze_survivors()
    try:
        _serve_jobs(rank, jobs, first_seed)
    except BaseException:
        gc.unfreeze()  # back in reach before the interpreter's exit, which frees (and nanobind checks) them
        raise
    # Served: every job has closed its process group and written its results, and the caller waits in `join`.
    # An interpreter's exit with torch, transformers and triton loaded takes 1-4 s (a final collection over
    # every object, module teardown) that nobody needs here: run the exit handlers (multiprocessing's release
    # the semaphores a job made, e.g. tqdm's lock, which the resource tracker would report as leaked), then go.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _serve_jobs(rank: int, jobs: Connection, first_seed: int) -> None:
    while True:
        try:
            job = jobs.recv()
        except EOFError:
            return
        if job is None:
            return
        fn, world_size, port, args, out_dir, timeout_s, filters, env, path = job
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path
        torch.manual_seed(first_seed)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        try:
            with warnings.catch_warnings():
                _run_rank(rank, fn, world_size, port, args, out_dir, timeout_s, filters)
        except BaseException:
            jobs.send(traceback.format_exc())
            return
        _forget_process_group_caches()
        jobs.send(None)


def _forget_process_group_caches() -> None:
    """What a finished job leaves that a fresh process would not have: DTensor's sharding caches (a new mesh
    over the same ranks equals the old one, so a hit would hand back the old mesh, whose groups are gone; as
    torch's own DTensor tests clear them between process groups), dynamo's compiled code (a later job compiles
    as in a fresh process, with no recompile limit hit) and the job's garbage."""
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()
        clear_redistribute_planner_cache()
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    gc.collect()
    _freeze_survivors()


def _freeze_survivors() -> None:
    """Move what is alive now (torch, the jobs' imports and module state: ~0.5M objects) out of the cyclic
    collector's reach. Every full collection traversed all of them, 0.2-0.5 s each, a dozen times in a job and
    once between jobs; objects freed by their reference count still are, and a job's own garbage is collected
    as before, so only a cycle among survivors would now wait for the process's end."""
    gc.freeze()


class _Pool:
    """`world_size` processes that serve `spawn_local` calls one after another, started by `method` ("spawn":
    a fresh interpreter each; "forkserver": forked from multiprocessing's fork server, which imported its
    preload modules once)."""

    def __init__(self, world_size: int, method: str = "spawn") -> None:
        ctx = mp.get_context(method)
        self.conns: list[Connection] = []
        self.procs = []
        for rank in range(world_size):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, theirs), name=f"autopar-rank{rank}")
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)

    def run(self, job: tuple, timeout_s: float, world_size: int) -> None:
        """Send `job` to the first `world_size` ranks (the others wait for a later job) and wait until they
        finished; on a failure, death or timeout, close the pool and raise naming the rank."""
        for conn in self.conns[:world_size]:
            conn.send(job)
        deadline = time.monotonic() + timeout_s
        pending = dict(enumerate(self.conns[:world_size]))
        try:
            while pending:
                left = deadline - time.monotonic()
                ready = wait([*pending.values(), *(self.procs[r].sentinel for r in pending)], timeout=max(left, 0))
                if not ready:
                    raise AutoparError(
                        f"local run of {len(self.procs)} ranks did not finish in {timeout_s:.0f} s")
                for rank, conn in list(pending.items()):
                    if conn in ready or self.procs[rank].sentinel in ready:
                        try:
                            error = conn.recv()
                        except EOFError:
                            self.procs[rank].join(timeout=5)
                            raise AutoparError(
                                f"rank {rank} died (exit code {self.procs[rank].exitcode}).") from None
                        if error is not None:
                            raise AutoparError(f"rank {rank} failed:\n{error}")
                        del pending[rank]
        except BaseException:
            self.close(graceful=False)  # the others may be inside a collective that never completes
            raise

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, graceful: bool = True) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if graceful and proc.is_alive():
                try:
                    conn.send(None)
                except OSError:
                    pass
        for proc in self.procs:
            proc.join(timeout=5 if graceful else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()


class LocalPool:
    """Processes kept between `spawn_local` calls, one set per environment: what the test suite uses so that
    each call does not pay for starting Python and importing torch again. Each call still runs in a fresh gloo
    process group, with the caller's environment, sys.path and warning filters; a call that fails closes its
    processes (the next call starts new ones). A call runs on the set's first ranks, the others idle; one of
    more ranks than the set replaces it with a larger one. Use it as a context manager (`with LocalPool():
    ...`); at most `max_processes` are kept, the least recently used closed first.

    `preload`: modules to import once in multiprocessing's fork server (torch, the code the jobs run), from
    which the processes of every set for the environment the pool was made in (having imported them too) are
    forked: a set costs a fork instead of an interpreter importing them again (~5 s of CPU per process with torch
    and transformers).
    A set for another environment is spawned as without `preload` (a preloaded module read the server's
    environment at its import). The server starts with the first forked set; the modules must do no work at
    import (the server forks single-threaded) and the pool must not be made after CUDA was used."""

    _active: LocalPool | None = None

    def __init__(self, max_processes: int = 12, preload: tuple[str, ...] = ()) -> None:
        self.max_processes = max_processes
        self.preload = tuple(preload)
        self._pools: dict[frozenset, _Pool] = {}  # by the environment the set started in
        # the fork server's environment, in which sets are forked (`preload`): the one here after importing what
        # it will import, since an import may set variables (torch's inductor sets TORCHINDUCTOR_CACHE_DIR); taken
        # before, a later import here would change every call's environment and no set would be forked again
        for name in self.preload:
            with contextlib.suppress(ImportError):  # as the server does
                importlib.import_module(name)
        self._home_env = _env_key(os.environ)

    def __enter__(self) -> LocalPool:
        if LocalPool._active is not None:
            raise AutoparError("a LocalPool is already in use; nest spawn_local calls inside that one")
        LocalPool._active = self
        return self

    def __exit__(self, *exc: object) -> None:
        LocalPool._active = None
        self.close()

    def close(self) -> None:
        while self._pools:
            self._pools.popitem()[1].close()

    def run(self, fn: Callable, world_size: int, args: tuple, out_dir: str, timeout_s: float) -> None:
        env = dict(os.environ)
        # import-time reads see the environment the processes started with: a changed one gets its own set
        key = _env_key(env)
        pool = self._pools.pop(key, None)
        if pool is not None and (len(pool.procs) < world_size or not pool.alive()):
            pool.close()  # too few ranks: the larger set that replaces it serves the smaller calls too
            pool = None
        if pool is None:
            while self._pools and sum(len(p.procs) for p in self._pools.values()) + world_size > self.max_processes:
                self._pools.pop(next(iter(self._pools))).close()
            pool = _Pool(world_size, self.start_method(key))
        job = (fn, world_size, free_port(), args, out_dir, timeout_s, list(warnings.filters), env, list(sys.path))
        pool.run(job, timeout_s + 60, world_size)  # raises (and has closed the pool) on a failure
        self._pools[key] = pool

    def start_method(self, key: frozenset | None = None) -> str:
        """How a process for the environment `key` (the current one by default) starts: "forkserver", forked
        from the preloaded server, where that is the pool's own environment; else "spawn". For processes a
        caller starts itself (`torch.multiprocessing.start_processes(..., start_method=...)`)."""
        key = _env_key(os.environ) if key is None else key
        if not self.preload or key != self._home_env:
            return "spawn"
        # read only when the server starts: with the first set forked from it, in this environment
        mp.get_context("forkserver").set_forkserver_preload(list(self.preload))
        return "forkserver"


_PER_TEST_ENV = {"PYTEST_CURRENT_TEST"}


def _env_key(env: Any) -> frozenset:
    """What a set of processes is kept for: the environment, less what differs per test."""
    return frozenset((k, v) for k, v in env.items() if k not in _PER_TEST_ENV)


def spawn_local(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` gloo processes; return each rank's result.

    A rank that raises or dies makes this raise within `timeout_s`, naming the rank and its error.
    `fn` must be importable (a module-level function). The ranks filter warnings as the caller does at the
    call (a warning that is an error here is one there). Inside `with LocalPool():` the processes are kept
    for the next call; otherwise each call starts its own.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        if LocalPool._active is not None:
            LocalPool._active.run(fn, world_size, args, out_dir, timeout_s)
        else:
            _spawn_once(fn, world_size, args, out_dir, timeout_s)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _spawn_once(fn: Callable, world_size: int, args: tuple, out_dir: str, timeout_s: float) -> None:
    ctx = mp.start_processes(
        _run_rank,
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


def _wait_all(procs: list[subprocess.Popen], progress: Callable[[int, int], None] | None) -> list[int]:
    """Every process's exit code, telling `progress` how many have exited as they do."""
    if progress is None:
        return [p.wait() for p in procs]
    while True:
        finished = sum(p.poll() is not None for p in procs)
        progress(finished, len(procs))
        if finished == len(procs):
            return [p.returncode for p in procs]
        time.sleep(0.5)


def launch_workers(script: list[str], nproc: int, env: dict[str, str] | None = None, host: str = "127.0.0.1",
                   progress: Callable[[int, int], None] | None = None) -> int:
    """Run `script` (a path or `-m module`, then its arguments) as `nproc` worker processes of one job, each its
    own process with no agent over it, meeting in a TCPStore this launcher hosts (torchrun's environment:
    RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT with TORCHELASTIC_USE_AGENT_STORE=True, so an unchanged
    script's init_process_group finds the store). Unlike torchrun's agent it does not stop the others when a
    worker dies: the survivors re-route around it (reroute.py, enabled by AUTOPAR_REROUTE=1, which it sets
    unless the caller set it) and keep the store, which does not die with any worker.

    Returns 0 when every worker exited 0 or died with its loss re-routed by the survivors (reported on
    stderr), else the first other worker's exit code (128 + signal for a killed one). `progress(finished, nproc)`
    is called about twice a second while they run."""
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
        codes = _wait_all(procs, progress)
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
