"""Ready for GPUs, checked on the CPU (runtime/devices.py, dist.py, elastic.py, run.py, compiler.py): the rank's
device rule, process-group setup (CUDA device and device_id before init_process_group, "cpu:gloo,cuda:nccl"),
the plan broadcast's device and the launcher's commands and environments, with torch.cuda's answers mocked."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar import compiler, models
from autopar.cluster import Cluster, catalog_name_for_gpu
from autopar.errors import PlanError, RendezvousError
from autopar.runtime import devices, elastic, run
from autopar.runtime import dist as rdist
from autopar.runtime.devices import DeviceMismatchError, check_rank_gpu, launch_device, rank_device
from autopar.runtime.weights import ModelWeights

A100 = "NVIDIA A100-SXM4-80GB"


def fake_cuda(monkeypatch, names: list[str], calls: list | None = None) -> None:
    """torch.cuda answering as a machine with GPUs `names` (80 GiB each); set_device calls go to `calls`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(names))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: names[getattr(i, "index", i) or 0])
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: (calls if calls is not None else []).append(("set", d)))


# ---- item 2: the rank's device ------------------------------------------------------------------------


def test_the_ranks_device_comes_from_the_plan_not_the_model() -> None:
    c = Cluster.load("1x2xA100-80GB+1x1xcpu")
    assert rank_device(c.devices[1].spec, 1, cuda_available=True) == torch.device("cuda", 1)
    assert rank_device(c.devices[2].spec, 0, cuda_available=True) == torch.device("cpu")  # a cpu device
    assert rank_device(c.devices[0].spec, 0, cuda_available=False) == torch.device("cpu")  # gloo stand-in
    # rank r of the launcher is device r of the cluster file, on cuda:LOCAL_RANK
    assert launch_device(c, {"RANK": "1", "LOCAL_RANK": "1"}, True) == torch.device("cuda", 1)
    assert launch_device(c, {"RANK": "2", "LOCAL_RANK": "0"}, True) == torch.device("cpu")


def test_weights_of_a_cpu_model_go_to_the_ranks_device() -> None:
    case = models.mlp(batch=4, seed=0)
    w = ModelWeights(case.model, device=torch.device("meta"))
    name = next(iter(dict(case.model.named_parameters())))
    assert w.param(name).device.type == "meta"


def test_an_empty_message_is_made_on_the_ranks_device() -> None:
    assert rdist.pack([], device=torch.device("meta")).device.type == "meta"
    assert rdist.pack([]).device.type == "cpu"


def test_captured_device_constants_are_retargeted_whatever_they_were_captured_on() -> None:
    case = models.CASES["gpt"](seed=0)
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    from autopar.codegen.split import split_stages

    st = split_stages(g, [(0, len(g.layers))])[0]
    named = lambda: {a for n in st.gm.graph.nodes for a in torch.utils._pytree.tree_leaves((n.args, n.kwargs))
                     if isinstance(a, torch.device)}
    assert torch.device("cpu") in named()  # the capture's arange names the CPU
    ModelWeights(case.model, device=torch.device("meta")).retarget(st)
    assert named() == {torch.device("meta")}


# ---- items 12 and 6: setup ----------------------------------------------------------------------------


def test_setup_sets_the_device_before_the_group_with_device_id_and_a_mixed_backend(monkeypatch) -> None:
    calls: list = []
    fake_cuda(monkeypatch, [A100, A100], calls)
    monkeypatch.delenv("AUTOPAR_BACKEND", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend, kw)))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    assert rdist.ensure_initialized(30) == (1, 2)
    assert calls[0] == ("set", torch.device("cuda", 1))
    assert calls[1][:2] == ("init", "cpu:gloo,cuda:nccl")
    assert calls[1][2]["device_id"] == torch.device("cuda", 1)
    # a cpu device in a GPU plan: no CUDA device, the same mixed backend (its CPU tensors go to gloo)
    calls.clear()
    rdist.ensure_initialized(30, torch.device("cpu"))
    assert calls == [("init", "cpu:gloo,cuda:nccl", {"timeout": calls[0][2]["timeout"]})]


def test_a_group_that_does_not_form_in_time_is_a_clear_error(monkeypatch) -> None:
    """A peer that never joins (a rank started later than timeout_s, or unreachable): torch says only "Wait
    timeout"; the error names the timeout and the fix, and is still a RuntimeError for callers catching those."""
    monkeypatch.setenv("AUTOPAR_BACKEND", "gloo")
    with pytest.raises(RendezvousError, match=r"gloo process group did not form within timeout_s=1 s(.|\n)*"
                                              r"Raise timeout_s") as caught:
        devices.init_process_group(1.0, store=dist.HashStore(), rank=0, world_size=2)
    assert isinstance(caught.value, RuntimeError) and isinstance(caught.value.__cause__, dist.DistError)
    assert not dist.is_initialized()

    def fails(backend: str, **kw: object) -> None:
        raise RuntimeError("Default process group has already been initialized")  # not a timeout: unchanged

    with pytest.raises(RuntimeError, match="already been initialized") as other:
        devices.init_process_group(1.0, init=fails)
    assert not isinstance(other.value, RendezvousError)

    def port_taken(backend: str, **kw: object) -> None:  # torch's own words for a port in use
        raise dist.DistNetworkError("The server socket has failed to listen on any local network address. port: 29500, "
                                    "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")

    with pytest.raises(dist.DistNetworkError, match="EADDRINUSE") as taken:
        devices.init_process_group(1.0, init=port_taken)
    assert not isinstance(taken.value, RendezvousError)  # not a late peer: "raise timeout_s" would not fix it


def test_elastic_restarts_join_through_the_same_setup(monkeypatch) -> None:
    calls: list = []
    fake_cuda(monkeypatch, [A100, A100], calls)
    monkeypatch.delenv("AUTOPAR_BACKEND", raising=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **k: object())
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: ("prefix", prefix))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend, kw)))
    elastic.join_attempt(1, 2, 2, 0, 30)
    assert calls[0] == ("set", torch.device("cuda", 1))
    assert calls[1][1] == "cpu:gloo,cuda:nccl" and calls[1][2]["device_id"] == torch.device("cuda", 1)
    assert calls[1][2]["rank"] == 1 and calls[1][2]["world_size"] == 2


def test_backends(monkeypatch) -> None:
    assert devices.backend_for(cuda_available=True) == "cpu:gloo,cuda:nccl"
    assert devices.backend_for(cuda_available=False) == "gloo"
    assert devices.backend_for(cuda_available=True, forced="gloo") == "gloo"
    # the plan broadcast of a mixed world goes over gloo on every rank, else on the rank's GPU
    mixed, gpus = Cluster.load("1x1xA100-80GB+1x1xcpu"), Cluster.load("1x2xA100-80GB")
    assert devices.world_comm_device(mixed, torch.device("cuda", 0)) == torch.device("cpu")
    assert devices.world_comm_device(gpus, torch.device("cuda", 1)) == torch.device("cuda", 1)


def test_a_user_created_group_still_gets_this_ranks_cuda_device(monkeypatch) -> None:
    calls: list = []
    fake_cuda(monkeypatch, [A100, A100], calls)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    rdist.ensure_initialized(30)
    assert calls == [("set", torch.device("cuda", 1))]


class _Stop(Exception):
    pass


def test_the_plan_broadcast_uses_the_ranks_device(monkeypatch) -> None:
    fake_cuda(monkeypatch, [A100, A100])
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    seen: dict = {}
    monkeypatch.setattr(compiler, "ensure_initialized", lambda timeout_s, device=None: (1, 2))

    def broadcast(box, src, **kw):
        seen.update(kw)
        raise _Stop

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    case = models.mlp(batch=4, seed=0)
    with pytest.raises(_Stop):
        compiler.compile(case.model, "1x2xA100-80GB", case.example_inputs, case.example_target, case.loss_fn)
    assert seen.get("device") == torch.device("cuda", 1)


# ---- item 3: the launcher -----------------------------------------------------------------------------


def test_one_gpu_node_without_node_rank_trains_locally(monkeypatch) -> None:
    fake_cuda(monkeypatch, [A100, A100])
    monkeypatch.delenv("AUTOPAR_BACKEND", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    started: list = []
    monkeypatch.setattr(run, "launch_workers", lambda script, n, env, **kw: started.append((script, n, env)) or 0)
    monkeypatch.setattr(run.subprocess, "call", lambda *a, **k: pytest.fail(f"printed/ran torchrun: {a}"))
    assert run.run(["train.py"], "1x2xA100-80GB") == 0
    assert len(started) == 1 and started[0][1] == 2
    env = started[0][2]
    assert "AUTOPAR_BACKEND" not in env and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_nproc_forces_gloo_only_without_gpus(monkeypatch) -> None:
    monkeypatch.delenv("AUTOPAR_BACKEND", raising=False)
    started: list = []
    monkeypatch.setattr(run, "launch_workers", lambda script, n, env, **kw: started.append(env) or 0)
    fake_cuda(monkeypatch, [A100, A100])
    run.run(["train.py"], "1x2xA100-80GB", nproc=2)
    fake_cuda(monkeypatch, [])
    run.run(["train.py"], "1x2xA100-80GB", nproc=2)
    assert "AUTOPAR_BACKEND" not in started[0] and started[1]["AUTOPAR_BACKEND"] == "gloo"


def test_multi_node_commands_keep_rank_r_on_device_r() -> None:
    cmd = run.torchrun_command(["t.py"], 4, nnodes=2, node_rank=1, master="node0:29500")
    assert "--rdzv-backend=static" in cmd and "--node-rank=1" in cmd  # c10d would ignore --node-rank
    assert "--master-addr=node0" in cmd and "--master-port=29500" in cmd
    assert not any("c10d" in a for a in cmd)
    elastic_cmd = run.torchrun_command(["t.py"], 4, nnodes=2, node_rank=1, master="node0:29500", max_restarts=2)
    assert "--rdzv-backend=c10d" in elastic_cmd and not any(a.startswith("--node-rank") for a in elastic_cmd)
    # static rendezvous numbers workers node by node: worker 1 of node 1 is rank 3, device 3 (a V100)
    c = Cluster.load("1x2xA100-80GB+1x4xV100-16GB")
    assert c.devices[3].spec.name == "V100-16GB" and c.devices[3].local_rank == 1
    assert launch_device(c, {"RANK": "3", "LOCAL_RANK": "1"}, True) == torch.device("cuda", 1)


def test_elastic_runs_on_nodes_that_differ_are_refused(monkeypatch) -> None:
    fake_cuda(monkeypatch, [A100, A100])
    monkeypatch.setattr(run.subprocess, "call", lambda *a, **k: 0)
    with pytest.raises(PlanError, match="without --max-restarts"):
        run.run(["t.py"], "1x2xA100-80GB+1x4xV100-16GB", node_rank=0, max_restarts=1, dry_run=True)
    assert run.run(["t.py"], "2x2xA100-80GB", node_rank=0, max_restarts=1, dry_run=True) == 0  # same nodes


def test_too_few_local_gpus_is_a_clear_error(monkeypatch) -> None:
    fake_cuda(monkeypatch, [A100, A100])
    monkeypatch.setattr(run.subprocess, "call", lambda *a, **k: 0)
    with pytest.raises(DeviceMismatchError, match="4 GPU device.*2 visible GPU"):
        run.run(["t.py"], "2x4xA100-80GB", node_rank=1)


def test_a_ranks_gpu_must_be_the_type_the_cluster_file_gives_it(monkeypatch) -> None:
    fake_cuda(monkeypatch, [A100, "Tesla V100-SXM2-16GB"])
    c = Cluster.load("1x2xA100-80GB")
    check_rank_gpu(c, 0, torch.device("cuda", 0), torch.cuda.get_device_name(0), catalog_name_for_gpu)
    with pytest.raises(DeviceMismatchError, match="device 1 type A100-80GB"):
        check_rank_gpu(c, 1, torch.device("cuda", 1), torch.cuda.get_device_name(1), catalog_name_for_gpu)


# ---- item 14: device order -------------------------------------------------------------------------------


def test_mixed_gpus_without_pci_bus_order_warn() -> None:
    with pytest.warns(UserWarning, match="CUDA_DEVICE_ORDER"):
        devices.warn_device_order([A100, "Tesla V100-SXM2-16GB"], env={})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        devices.warn_device_order([A100, "Tesla V100-SXM2-16GB"], env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
        devices.warn_device_order([A100, A100], env={})
