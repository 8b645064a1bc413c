"""`autopar run`: start one process per device of a cluster.

On a machine without GPUs every device of the cluster file becomes a local gloo process standing in for
its device type, so a heterogeneous plan can be executed and checked here. Without --max-restarts the
workers are plain processes sharing a store the launcher hosts (launch.launch_workers): when one dies the
others re-route its micro-batches and keep training (reroute.py; each rank then keeps a copy of its state
before every step, priced into `prog.plan.predicted["reroute"]`: where it does not fit, re-routing is off
and a lost rank stops the job, so run such a job with --max-restarts). With --max-restarts K they run under
torchrun's elastic agent, which restarts the whole group from the last checkpoint (elastic.py). A cluster of
one GPU node runs on this machine, one worker per GPU (checked: enough GPUs; each worker's GPU type is
checked by `compile`). For a cluster of several GPU nodes it prints the torchrun command to start on each node
(or runs this node's share with --node-rank): a static rendezvous ordered by --node-rank, so rank r is device
r of the cluster file. With --max-restarts the rendezvous is torchrun's elastic one, which orders nodes as
they arrive: allowed only when every node is the same (any order is then the same cluster), refused
otherwise. Workers on GPU machines get CUDA_DEVICE_ORDER=PCI_BUS_ID unless it is set.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Callable

import torch

from ..checks import check_number
from ..cluster import Cluster
from ..errors import PlanError
from .devices import DeviceMismatchError, computes_on_cpu
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
    """With restarts the job is elastic (--nnodes=MIN:MAX, MIN = `min_nodes`, default 1; c10d rendezvous): a
    node that is gone does not hold the restart up, and one that comes back joins at the next restart.
    Without restarts several nodes meet in torchrun's static rendezvous, which numbers the nodes by
    --node-rank and their workers' global ranks in that order, so rank r is device r of the cluster file
    (c10d ignores --node-rank and numbers nodes in arrival order)."""
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
    elif max_restarts > 0:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={master}"]
    else:
        host, _, port = master.rpartition(":")
        cmd += ["--rdzv-backend=static", f"--master-addr={host}", f"--master-port={port}",
                f"--node-rank={node_rank}"]
    return cmd + script


def worker_env(cluster: str, gpus: int, max_restarts: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the workers start with: the cluster file, on a machine without GPUs the gloo
    stand-ins, on one with GPUs CUDA's PCI bus order (unless set), so cuda:i is the i-th GPU in the machine,
    the order a cluster file lists a node's devices in (CUDA's default puts the fastest first)."""
    env = dict(os.environ if base is None else base, AUTOPAR_CLUSTER=cluster)
    if max_restarts > 0:
        # restarted workers must not share torchrun's store with the previous attempt (pytorch#135712)
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if gpus == 0:
        env["AUTOPAR_BACKEND"] = "gloo"
    else:
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    return env


def check_node_gpus(c: Cluster, node: int, gpus: int) -> None:
    """A clear error before any worker starts when this machine has fewer GPUs than node `node` of the cluster
    has GPU devices (each worker's own GPU type is checked by `autopar.compile`, under the workers' device
    order)."""
    need = sum(1 for d in c.nodes[node].devices if not computes_on_cpu(c.devices[d].spec))
    kind = c.devices[c.nodes[node].devices[0]].spec.name
    if gpus < need:
        raise DeviceMismatchError(
            f"node {node} of cluster {c.name!r} has {need} GPU device(s) ({kind}) but this machine has {gpus} "
            f"visible GPU(s): start this node's share (--node-rank {node}) on a machine with {need} GPUs, check "
            f"CUDA_VISIBLE_DEVICES, or fix the cluster file.")


def elastic_ranks_match(c: Cluster) -> bool:
    """Whether torchrun's elastic (c10d) rendezvous, which numbers nodes in arrival order, still gives rank r
    a device of device r's type and node shape: only when every node of the cluster is the same (same device
    count, types and links), so any order of the nodes is the same cluster."""
    shapes = [([c.devices[d].spec for d in n.devices], n.intra_node, n.host_memory, n.nic_bandwidth)
              for n in c.nodes]
    return all(s == shapes[0] for s in shapes) and not c.pair_links


def run(
    script: list[str],
    cluster: str,
    nproc: int | None = None,
    node_rank: int | None = None,
    master: str | None = None,
    max_restarts: int = 0,
    dry_run: bool = False,
    gpus: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Launch `script` (path and its arguments) on the cluster; returns the exit code. `gpus`: this machine's
    GPU count (default `torch.cuda.device_count()`). `progress(finished, total)`: called about twice a second
    with the workers that have exited, where this launcher hosts them (no --max-restarts, one machine)."""
    c = Cluster.load(cluster)
    check_number("nproc", nproc, integer=True, low=1, optional=True)
    check_number("node_rank", node_rank, integer=True, low=0, high=len(c.nodes) - 1, optional=True,
                 hint=f"the cluster has {len(c.nodes)} node(s)")
    check_number("max_restarts", max_restarts, integer=True, low=0)
    gpus = torch.cuda.device_count() if gpus is None else gpus
    env = worker_env(cluster, gpus, max_restarts)
    if gpus == 0 or nproc is not None or len(c.nodes) == 1:
        # one machine runs every device: gloo stand-ins without GPUs, else one worker per GPU of its one node
        n = nproc if nproc is not None else c.world_size
        if gpus == 0:
            what = f"{n} local gloo process(es) standing in for {c.describe()}"
        else:
            if nproc is None:
                check_node_gpus(c, 0, gpus)
            elif nproc > gpus:
                raise DeviceMismatchError(f"--nproc {nproc} on a machine with {gpus} GPU(s): each worker needs its "
                                          f"own GPU; pass --nproc {gpus} or fewer.")
            what = f"{n} local process(es), one per GPU, for {c.describe()}"
        cmd = torchrun_command(
            script, n, master=master or f"127.0.0.1:{free_port()}", max_restarts=max_restarts
        )
        print(f"autopar run: {what}", file=sys.stderr)
        if max_restarts == 0:  # each worker its own process: survivors of a lost worker keep training
            if dry_run:
                print(f"{n} worker processes of {shlex.join([sys.executable, *script])} sharing a TCPStore "
                      f"hosted by autopar run (no torchrun agent; lost workers are re-routed around)")
                return 0
            return launch_workers(script, n, env, progress=progress)
        if dry_run:
            print(shlex.join(cmd))
            return 0
        return subprocess.call(cmd, env=env)
    if max_restarts > 0 and not elastic_ranks_match(c):
        raise PlanError(
            f"--max-restarts on cluster {c.name!r}, whose nodes differ: torchrun's elastic rendezvous numbers the "
            f"nodes in the order they arrive, so rank r would not be device r of the cluster file and stages "
            f"would land on the wrong devices. Run without --max-restarts (a static rendezvous keeps rank r = "
            f"device r; a lost worker is re-routed around where the plan allows), or make every node the same.")
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
    check_node_gpus(c, node_rank, gpus)
    return subprocess.call(cmds[node_rank], env=env)
