"""Tensor-parallel attention runs the fused kernel the planner prices (passes/annotate.py prices sdpa as flash
attention: no seq x seq scores), not the math formulation, wherever the layouts allow.

On CUDA meshes the captured op stays: DTensor (torch 2.13) shards flash, memory-efficient and cuDNN attention
over heads. On CPU DTensor has no rule for the CPU flash kernel, so each rank runs it on its own heads (or
batch rows); other layouts fall back to the math formulation. Two gloo ranks check the CPU path's numerics
and that the fused kernel is what ran; attention with dropout (its keyed math formulation) runs per shard too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from autopar.passes.randomness import keyed_attention
from autopar.runtime.launch import spawn_local
from autopar.runtime.tensor_parallel import FUSED_ATTENTION, substitutions

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


def test_cuda_table_keeps_the_fused_op_dtensor_shards() -> None:
    cuda = substitutions("cuda")
    assert SDPA not in cuda  # sdpa dispatches to flash / efficient / cudnn attention, sharded by DTensor
    strategies = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    assert FUSED_ATTENTION["cuda"]
    for op in FUSED_ATTENTION["cuda"]:
        assert op in strategies, f"DTensor has no sharding strategy for {op}"
    assert cuda[aten.view.default] is aten.reshape.default


def test_cpu_table_replaces_sdpa_since_dtensor_has_no_cpu_flash_rule() -> None:
    strategies = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    assert aten._scaled_dot_product_flash_attention_for_cpu.default not in strategies
    assert SDPA in substitutions("cpu")


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.seen.add(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def _attention(rank: int, world: int) -> list[Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import implicit_replication

    mesh = init_device_mesh("cpu", (world,))
    sdpa = substitutions(mesh.device_type)[SDPA]
    out = []
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g) for _ in range(3))
    head_mask = torch.randn(1, 4, 16, 16, generator=g)  # differs per head: not local to a head shard
    cases = [("heads", [Shard(1)], {"is_causal": True}), ("batch", [Shard(0)], {"is_causal": True}),
             ("replicated", [Replicate()], {}), ("head mask", [Shard(1)], {"attn_mask": head_mask})]
    for name, placements, kw in cases:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = torch.nn.functional.scaled_dot_product_attention(*leaves, **kw)
        ref.sum().backward()
        dts = [DTensor.from_local(t, mesh, [Replicate()], run_check=False).redistribute(mesh, placements)
               .detach().requires_grad_() for t in (q, k, v)]
        mode = _Ops()
        with mode:
            y = sdpa(*dts, **{a: (DTensor.from_local(m, mesh, [Replicate()], run_check=False)
                                  if isinstance(m, torch.Tensor) else m) for a, m in kw.items()})
            y.full_tensor().sum().backward()
        err = max([(y.full_tensor() - ref).abs().max().item()]
                  + [(d.grad.full_tensor() - t.grad).abs().max().item() for d, t in zip(dts, leaves, strict=True)])
        out.append((name, err, sorted(mode.seen), [str(p) for p in y.placements]))
    keyed = substitutions(mesh.device_type)[keyed_attention]
    for name, placements in (("keyed heads", [Shard(1)]), ("keyed batch", [Shard(0)])):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = keyed_attention(*leaves, dropout_p=0.25, is_causal=True, key=7)  # one device, the whole mask
        ref.sum().backward()
        dts = [DTensor.from_local(t, mesh, [Replicate()], run_check=False).redistribute(mesh, placements)
               .detach().requires_grad_() for t in (q, k, v)]
        mode = _Ops()
        with implicit_replication(), mode:  # as the interpreter runs it (TPStage.run)
            y = keyed(*dts, dropout_p=0.25, is_causal=True, key=7)
        y.full_tensor().sum().backward()
        err = max([(y.full_tensor() - ref).abs().max().item()]
                  + [(d.grad.full_tensor() - t.grad).abs().max().item() for d, t in zip(dts, leaves, strict=True)])
        out.append((name, err, sorted(mode.seen), [str(p) for p in y.placements]))
    return out


def test_cpu_tp_attention_runs_the_fused_kernel_per_shard() -> None:
    results = spawn_local(_attention, 2, timeout_s=120)
    for rank_results in results:
        by = {name: (err, seen, placements) for name, err, seen, placements in rank_results}
        for name, (err, _, _) in by.items():
            assert err < 1e-5, f"{name}: differs from single-device attention by {err}"
        for name, placements in (("heads", ["S(1)"]), ("batch", ["S(0)"]), ("replicated", ["R"])):
            err, seen, got = by[name]
            assert "_scaled_dot_product_flash_attention_for_cpu" in seen, f"{name}: ran {seen}"
            assert not {"_safe_softmax", "_softmax"} & set(seen)  # no seq x seq scores
            assert got == placements
        # a per-head mask cannot be cut to a rank's heads here: the math formulation (still correct)
        assert "_safe_softmax" in by["head mask"][1]
        # attention with dropout (passes/randomness.py) runs on each rank's own heads or batch rows too, each
        # drawing its block of the whole mask (on DTensors its causal masking fails: a plain mask beside
        # DTensor scores)
        for name, placements in (("keyed heads", ["S(1)"]), ("keyed batch", ["S(0)"])):
            err, seen, got = by[name]
            assert not {"all_gather_into_tensor", "all_reduce"} & set(seen), f"{name}: ran {seen}"
            assert got == placements
