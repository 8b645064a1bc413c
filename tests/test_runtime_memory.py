"""ZeRO 1-3 and CPU offload train exactly like one process, and really hold less per rank.

One spawn of 4 gloo processes runs every case. Ranks of a dp=2 x pp=2 layout (Megatron order): stage 0 on
ranks 0 and 1 (pipelines 0 and 1), stage 1 on ranks 2 and 3; each pair is one stage's data-parallel peers.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from autopar import models
from autopar.errors import PlanError
from autopar.runtime import zero
from autopar.runtime.launch import spawn_local
from autopar.runtime.zero import BUCKET_BYTES

from .runtime_cases import STEPS, assert_matches_reference, build, compile_case, optimizer, reference

RTOL, ATOL = 1e-4, 1e-5
GPT = ("gpt", {"layers": 4, "batch": 8})
DP_PP = {"dp": 2, "pp": 2, "m": 2}
PAIRS = [(0, 1), (2, 3)]  # data-parallel peers of stage 0 and of stage 1
ALL_OFFLOAD = ("optimizer", "activations", "params")

# id -> (model, model kwargs, strategy); every case trains STEPS steps and is compared to the reference
CASES: dict[str, tuple[str, dict, dict]] = {
    "zero0": (*GPT, DP_PP),
    "zero1": (*GPT, {**DP_PP, "zero": 1}),
    "zero2": (*GPT, {**DP_PP, "zero": 2}),
    "zero3": (*GPT, {**DP_PP, "zero": 3}),
    # pipelines run 4 and 2 micro-batches: ZeRO collectives must not follow the schedule
    # (and a small bucket size splits every collective into several)
    "zero3-uneven": (*GPT, {**DP_PP, "zero": 3, "m": 4, "batch_split": [6, 2], "bucket_bytes": 100_000}),
    "zero3-tied-recompute": ("gpt", {"layers": 4, "batch": 8, "tie_embeddings": True},
                             {**DP_PP, "zero": 3, "recompute": True}),
    "zero2-tp": ("gpt", {"layers": 2, "batch": 4}, {"tp": 2, "dp": 2, "zero": 2}),
    "zero3-tp-offload-all": ("gpt", {"layers": 2, "batch": 4},
                             {"tp": 2, "dp": 2, "zero": 3, "offload": ALL_OFFLOAD}),
    "offload-optimizer": (*GPT, {**DP_PP, "offload": ("optimizer",)}),
    "offload-activations": (*GPT, {**DP_PP, "offload": ("activations",)}),
    "offload-params": (*GPT, {**DP_PP, "offload": ("params",)}),
    "zero1-offload-optimizer-params": (*GPT, {**DP_PP, "zero": 1, "offload": ("optimizer", "params")}),
}
# the ZeRO-2 case's state_dict is loaded into these and trained one more step
RELOAD = {"pp4": {"pp": 4, "m": 2}, "zero3-offload": {**DP_PP, "zero": 3, "offload": ("optimizer", "params")}}


def _local(p: torch.Tensor) -> torch.Tensor:
    return p._local_tensor if isinstance(p, DTensor) else p


def _nbytes(t: torch.Tensor) -> int:
    return _local(t).numel() * t.element_size()


class _CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """save_on_cpu that counts the tensors it packs (patched in to see the activation offload run)."""

    packed = 0

    def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
        super().__init__(pin_memory, device_type)
        pack = self.pack_hook

        def counted(t: torch.Tensor) -> Any:
            _CountingSaveOnCpu.packed += 1
            return pack(t)

        self.pack_hook = counted


def _stats(prog: Any) -> dict:
    """Bytes this rank holds between steps, and what the offload paths did."""
    opt = prog.optimizer
    states = opt.state.values() if opt else []
    state = [v for st in states for v in st.values() if isinstance(v, torch.Tensor)]
    opt_params = [p for g in (opt.param_groups if opt else []) for p in g["params"]]
    ids = {id(p) for p in prog.params.values()}
    params = list(prog.params.values())
    return {
        "opt_bytes": sum(_nbytes(v) for v in state),
        "param_bytes": sum(_local(p).untyped_storage().nbytes() for p in params),
        "full_param_bytes": sum(_nbytes(p) for p in params),
        "largest_param_bytes": max((_nbytes(p) for p in params), default=0),
        "host_bytes": sum(_nbytes(st.host) for st in prog.zero.state.values() if st.host is not None),
        "opt_on_cpu_copies": bool(opt_params) and all(p.device.type == "cpu" and id(p) not in ids
                                                      for p in opt_params),
        "opt_params": len(opt_params),
    }


def _grad_bytes_after_sync(prog: Any, case: models.ModelCase) -> int:
    """Gradient bytes a rank keeps after the reduction of one forward/backward (no optimizer step)."""
    prog.zero.prepare()
    prog._run(prog.lowered.actions, case.example_inputs, case.example_target)
    prog._sync_gradients()
    out = sum(_nbytes(p.grad) for p in prog.params.values() if p.grad is not None)
    for p in prog.params.values():
        p.grad = None
    prog.zero.release()
    return out


def run_memory_cases(rank: int, world: int) -> dict:
    """Worker body: every case, then the reload cases, on one process group."""
    out: dict[str, Any] = {}
    for cid, (name, kwargs, spec) in CASES.items():
        t0 = time.perf_counter()
        case, prog = compile_case(name, kwargs, spec, rank, world)
        real, _CountingSaveOnCpu.packed = torch.autograd.graph.save_on_cpu, 0
        torch.autograd.graph.save_on_cpu = _CountingSaveOnCpu
        zero.BUCKET_BYTES = spec.get("bucket_bytes", BUCKET_BYTES)
        try:
            losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(STEPS)]
        finally:
            torch.autograd.graph.save_on_cpu, zero.BUCKET_BYTES = real, BUCKET_BYTES
        sd = prog.state_dict()
        stats = _stats(prog) | {"packed_on_cpu": _CountingSaveOnCpu.packed}
        if cid in ("zero0", "zero2"):
            stats["grad_bytes"] = _grad_bytes_after_sync(prog, case)
        out[cid] = {"losses": losses, "model": sd["model"], "stats": stats,
                    "seconds": time.perf_counter() - t0}
        if cid == "zero2":
            out["zero2-state"] = sd
    for cid, spec in RELOAD.items():
        case, prog = compile_case(*GPT, spec, rank, world)
        prog.load_state_dict(out["zero2-state"])
        loss = prog.step(*case.example_inputs, target=case.example_target)
        out[f"reload-{cid}"] = {"loss": loss, "model": prog.state_dict()["model"], "step": prog.step_count}
    if rank:
        del out["zero2-state"]
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn_local(run_memory_cases, 4, timeout_s=240)


@pytest.fixture(scope="module")
def refs() -> dict:
    memo: dict = {}

    def get(name: str, kwargs: dict, steps: int = STEPS) -> tuple[list[float], dict]:
        key = (name, tuple(sorted(kwargs.items())), steps)
        if key not in memo:
            memo[key] = reference(name, kwargs, steps)
        return memo[key]

    return get  # type: ignore[return-value]


@pytest.mark.parametrize("cid", list(CASES))
def test_training_matches_single_process(results: list[dict], refs: Any, cid: str) -> None:
    name, kwargs, _ = CASES[cid]
    for rank, per_rank in enumerate(results):
        r = per_rank[cid]
        assert_matches_reference(r["losses"], r["model"], *refs(name, kwargs), f"{cid} rank {rank}")


def test_zero1_partitions_optimizer_state(results: list[dict]) -> None:
    for a, b in PAIRS:
        base = results[a]["zero0"]["stats"]
        assert results[b]["zero0"]["stats"]["opt_bytes"] == base["opt_bytes"]
        sa, sb = results[a]["zero1"]["stats"], results[b]["zero1"]["stats"]
        # every parameter's state is allocated exactly once across the two peers ...
        assert sa["opt_bytes"] + sb["opt_bytes"] == base["opt_bytes"]
        # ... and the split is balanced to within one parameter's state (AdamW: 2 tensors + step)
        assert abs(sa["opt_bytes"] - sb["opt_bytes"]) <= 2 * base["largest_param_bytes"] + 64
        assert 0 < sa["opt_bytes"] < 0.75 * base["opt_bytes"]
        assert sa["opt_params"] + sb["opt_params"] == base["opt_params"]
        for s in (sa, sb):  # ZeRO-1 keeps every parameter
            assert s["param_bytes"] == base["param_bytes"] == base["full_param_bytes"]


def test_zero2_drops_non_owned_gradients(results: list[dict]) -> None:
    for a, b in PAIRS:
        full = results[a]["zero0"]["stats"]["grad_bytes"]
        assert full == results[a]["zero0"]["stats"]["full_param_bytes"]
        ga, gb = results[a]["zero2"]["stats"]["grad_bytes"], results[b]["zero2"]["stats"]["grad_bytes"]
        assert ga + gb == full and 0 < ga < full and 0 < gb < full


def test_zero3_releases_non_owned_parameters(results: list[dict]) -> None:
    for a, b in PAIRS:
        base = results[a]["zero0"]["stats"]["param_bytes"]
        sa, sb = results[a]["zero3"]["stats"], results[b]["zero3"]["stats"]
        assert sa["param_bytes"] + sb["param_bytes"] == base
        assert abs(sa["param_bytes"] - sb["param_bytes"]) <= sa["largest_param_bytes"]
        assert sa["opt_bytes"] + sb["opt_bytes"] == results[a]["zero0"]["stats"]["opt_bytes"]
    for rank in range(4):  # with tensor parallelism: each rank's shards, split with its dp peer
        s = results[rank]["zero3-tp-offload-all"]["stats"]
        assert s["param_bytes"] == 0  # owners keep theirs on the host, non-owners nothing
        assert 0 < s["host_bytes"] < s["full_param_bytes"]
    assert sum(results[r]["zero3-tp-offload-all"]["stats"]["host_bytes"] for r in (0, 2)) == \
        results[0]["zero3-tp-offload-all"]["stats"]["full_param_bytes"]


def test_offload_paths_run(results: list[dict]) -> None:
    for rank in range(4):
        opt = results[rank]["offload-optimizer"]["stats"]
        assert opt["opt_on_cpu_copies"] and opt["host_bytes"] == opt["full_param_bytes"]
        assert results[rank]["zero0"]["stats"]["opt_on_cpu_copies"] is False
        par = results[rank]["offload-params"]["stats"]
        assert par["param_bytes"] == 0 and par["host_bytes"] == par["full_param_bytes"]
        assert results[rank]["offload-activations"]["stats"]["packed_on_cpu"] > 0
        assert results[rank]["zero0"]["stats"]["packed_on_cpu"] == 0
        both = results[rank]["zero1-offload-optimizer-params"]["stats"]
        assert both["opt_on_cpu_copies"] and both["param_bytes"] == 0


@pytest.mark.parametrize("target", list(RELOAD))
def test_zero2_state_dict_round_trip(results: list[dict], refs: Any, target: str) -> None:
    ref_losses, ref_params = refs(*GPT, steps=STEPS + 1)
    for rank, per_rank in enumerate(results):
        r = per_rank[f"reload-{target}"]
        assert r["step"] == STEPS + 1
        assert_matches_reference([r["loss"]], r["model"], [ref_losses[-1]], ref_params,
                                 f"reload into {target} rank {rank}")


def test_zero2_state_dict_loads_into_plain_model(results: list[dict], refs: Any) -> None:
    sd = results[0]["zero2-state"]
    case = build(*GPT[:1], **GPT[1])
    case.model.load_state_dict(sd["model"])
    opt = optimizer(list(case.model.parameters()))
    named = dict(case.model.named_parameters())
    assert sd["optimizer"].keys() == named.keys()
    for name, state in sd["optimizer"].items():
        opt.state[named[name]] = {k: v.clone() for k, v in state.items()}
    loss = models.loss_of(case)
    loss.backward()
    opt.step()
    ref_losses, ref_params = refs(*GPT, steps=STEPS + 1)
    assert_matches_reference([loss.item()], case.model.state_dict(), [ref_losses[-1]], ref_params, "plain model")


def test_bad_stage_options_raise() -> None:
    from autopar.ir.lowered import PipelineLayout, StageLayout
    from autopar.lowering import make_layout

    for kw, msg in (({"zero": 4}, "zero must be an integer 0-3"), ({"offload": ("disk",)}, "unknown offload"),
                    ({"offload": "params"}, "tuple of kinds")):
        with pytest.raises(PlanError, match=msg):
            make_layout([PipelineLayout(0, (StageLayout((0, 3), (0,), **kw),), 0, 4, 1)], 1, 4, 3)
