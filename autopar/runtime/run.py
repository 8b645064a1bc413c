"""`autopar run`: start one process per device of a cluster.

On a machine without GPUs every device of the cluster file becomes a local gloo process standing in for
its device type, so a heterogeneous plan can be executed and checked here. Without --max-restarts the
workers are plain processes sharing a store the launcher hosts (launch.launch_workers): when one dies the
others re-route its micro-batches and keep training (reroute.py; each rank then keeps a copy of its state
before every step, priced into `prog.plan.predicted["reroute"]`: where it does not fit, re-routing is off
and a lost rank stops the job, so run such a job with --max-restarts). With --max-restarts K they run under
torchrun's elastic agent, which restarts the whole group from the last checkpoint (elastic.py). For a
cluster of several GPU nodes it prints the torchrun command to start on each node (or runs this node's
share with --node-rank).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import torch

from ..checks import check_number
from ..cluster import Cluster
from .launch import free_port, launch_workers


def torchrun_command(
    script: list[str],
    nproc: int,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    master: str = "127.0.0.1:29500",
    max_restarts: int = 0,
    min_nodes: int | None = None,
) -> list[str]:
    """With restarts the job is elastic (--nnodes=MIN:MAX, MIN = `min_nodes`, default 1): a node that is
    gone does not hold the restart up, and one that comes back joins at the next restart."""
    nodes = f"{min_nodes or 1}:{nnodes}" if max_restarts > 0 else str(nnodes)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--nnodes={nodes}",
        f"--max-restarts={max_restarts}",
    ]
    if nnodes == 1 and max_restarts == 0:
        cmd.append("--standalone")
    else:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={master}", f"--node-rank={node_rank}"]
    return cmd + script


def run(
    script: list[str],
    cluster: str,
    nproc: int | None = None,
    node_rank: int | None = None,
    master: str | None = None,
    max_restarts: int = 0,
    dry_run: bool = False,
) -> int:
    """Launch `script` (path and its arguments) on the cluster; returns the exit code."""
    c = Cluster.load(cluster)
    check_number("nproc", nproc, integer=True, low=1, optional=True)
    check_number("node_rank", node_rank, integer=True, low=0, high=len(c.nodes) - 1, optional=True,
                 hint=f"the cluster has {len(c.nodes)} node(s)")
    check_number("max_restarts", max_restarts, integer=True, low=0)
    env = dict(os.environ, AUTOPAR_CLUSTER=cluster)
    if max_restarts > 0:
        # restarted workers must not share torchrun's store with the previous attempt (pytorch#135712)
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    gpus = torch.cuda.device_count()
    if gpus == 0 or nproc is not None:
        n = nproc if nproc is not None else c.world_size
        env["AUTOPAR_BACKEND"] = "gloo"
        cmd = torchrun_command(
            script, n, master=master or f"127.0.0.1:{free_port()}", max_restarts=max_restarts
        )
        print(f"autopar run: {n} local gloo process(es) standing in for {c.describe()}", file=sys.stderr)
        if max_restarts == 0:  # each worker its own process: survivors of a lost worker keep training
            if dry_run:
                print(f"{n} worker processes of {shlex.join([sys.executable, *script])} sharing a TCPStore "
                      f"hosted by autopar run (no torchrun agent; lost workers are re-routed around)")
                return 0
            return launch_workers(script, n, env)
        if dry_run:
            print(shlex.join(cmd))
            return 0
        return subprocess.call(cmd, env=env)
    sizes = {len(n.devices) for n in c.nodes}
    master = master or "<host-of-node-0>:29500"
    cmds = [
        torchrun_command(
            script, len(n.devices), nnodes=len(c.nodes), node_rank=i, master=master, max_restarts=max_restarts
        )
        for i, n in enumerate(c.nodes)
    ]
    if node_rank is None or dry_run:
        print("start on each node (rank r of the job is device r of the cluster file):")
        for i, cmd in enumerate(cmds):
            print(f"  node {i}: AUTOPAR_CLUSTER={shlex.quote(cluster)} {shlex.join(cmd)}")
        if len(sizes) > 1:
            print(
                "note: nodes have different device counts; torchrun assigns global ranks node by node in "
                "--node-rank order, which matches the cluster file when node i runs with --node-rank i."
            )
        return 0
    return subprocess.call(cmds[node_rank], env=env)
