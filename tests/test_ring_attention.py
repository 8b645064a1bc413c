"""Context-parallel attention (runtime/ring_attention.py): ring and Ulysses attention on gloo ranks give each
rank exactly its rows (and gradients) of F.scaled_dot_product_attention over the whole sequence, with equal
causal work per rank and the bytes `exchange_bytes` prices."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.runtime import ring_attention as ra
from autopar.runtime.launch import spawn_local
from autopar.runtime.ring_attention import exchange_bytes, ring_attention, ulysses_attention, zigzag_positions

B, H, D, T_LOCAL = 2, 4, 8, 8


def _case(mode: str, causal: bool = True, heads_kv: int = H, scale: float | None = None, bf16: bool = False,
          groups: list[list[int]] | None = None, unfused: bool = False) -> dict[str, Any]:
    return {"mode": mode, "causal": causal, "heads_kv": heads_kv, "scale": scale, "bf16": bf16, "groups": groups,
            "unfused": unfused}


def _cases(world: int) -> dict[str, dict[str, Any]]:
    cases = {
        "ring causal": _case("ring"),
        "ring full": _case("ring", causal=False),
        "ring gqa scale": _case("ring", heads_kv=H // 2, scale=0.3),
        "ring gqa full": _case("ring", causal=False, heads_kv=H // 2),
        "ring bf16": _case("ring", heads_kv=H // 2, bf16=True),
        # the blocks as they run off the CPU (a GPU rank: no fused CPU kernel), here on CPU tensors
        "ring unfused causal gqa": _case("ring", heads_kv=H // 2, unfused=True),
        "ring unfused full": _case("ring", causal=False, unfused=True),
    }
    if H % world == 0:
        cases |= {
            "ulysses causal": _case("ulysses"),
            "ulysses full": _case("ulysses", causal=False),
            "ulysses gqa scale": _case("ulysses", heads_kv=H // 2, scale=0.3),  # cp=4: k/v repeated to 4 heads
            "ulysses bf16": _case("ulysses", bf16=True),
        }
    if world == 4:  # two cp groups of 2 whose members are not neighbours: the ring uses global ranks
        cases |= {"ring subgroups": _case("ring", heads_kv=H // 2, groups=[[0, 2], [1, 3]]),
                  "ulysses subgroups": _case("ulysses", groups=[[0, 2], [1, 3]])}
    return cases


def _full_inputs(cp: int, heads_kv: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(7)
    t = T_LOCAL * cp
    return (torch.randn(B, H, t, D, generator=g), torch.randn(B, heads_kv, t, D, generator=g),
            torch.randn(B, heads_kv, t, D, generator=g), torch.randn(B, H, t, D, generator=g))


def run_attention(rank: int, world: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every case on this rank: its output and gradient rows, the blocks it computed and the bytes it sent."""
    events: list[tuple[str, Any]] = []
    attend, attend_backward, fused = ra._attend, ra._attend_backward, ra._fused
    batch, all_to_all = dist.batch_isend_irecv, dist.all_to_all_single

    def counting_attend(q: torch.Tensor, k: torch.Tensor, *args: Any) -> Any:
        events.append(("block", (q.shape[-2], k.shape[-2], bool(args[-1]))))
        return attend(q, k, *args)

    def counting_attend_backward(q: torch.Tensor, k: torch.Tensor, *args: Any) -> Any:
        events.append(("block", (q.shape[-2], k.shape[-2], bool(args[-1]))))
        return attend_backward(q, k, *args)

    def counting_batch(ops: list[dist.P2POp]) -> Any:
        events.append(("send", sum(o.tensor.numel() * o.tensor.element_size() for o in ops if o.op is dist.isend)))
        return batch(ops)

    def counting_all_to_all(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        events.append(("send", input.numel() * input.element_size()))
        return all_to_all(output, input, *args, **kwargs)

    ra._attend, ra._attend_backward = counting_attend, counting_attend_backward
    dist.batch_isend_irecv, dist.all_to_all_single = counting_batch, counting_all_to_all
    results: dict[str, Any] = {}
    try:
        for name, case in cases.items():
            group = dist.group.WORLD
            if case["groups"] is not None:  # every rank creates every group
                made = [dist.new_group(members) for members in case["groups"]]
                group = next(g for g, m in zip(made, case["groups"], strict=True) if rank in m)
            cp, index = dist.get_world_size(group), dist.get_rank(group)
            pos = zigzag_positions(T_LOCAL * cp, cp, index)
            q, k, v, dout = (t[:, :, pos].clone().requires_grad_() for t in _full_inputs(cp, case["heads_kv"]))
            fn = ring_attention if case["mode"] == "ring" else ulysses_attention
            events.clear()
            amp = torch.autocast("cpu", dtype=torch.bfloat16) if case["bf16"] else contextlib.nullcontext()
            ra._fused = (lambda t: False) if case["unfused"] else fused
            with amp:
                out = fn(q, k, v, group=group, causal=case["causal"], scale=case["scale"])
            forward = list(events)
            events.clear()
            out.backward(dout.detach().to(out.dtype))
            ra._fused = fused
            results[name] = {"index": index, "cp": cp, "dtype": out.dtype, "out": out.detach().float(),
                             "dq": q.grad, "dk": k.grad, "dv": v.grad, "forward": forward, "backward": list(events)}
        errors = {}
        for what, call in [("odd tokens", lambda: ring_attention(*[torch.zeros(1, 2, 3, 4)] * 3, group=None)),
                           ("heads", lambda: ulysses_attention(*[torch.zeros(1, 2, 4, 4)] * 3, group=None))]:
            try:
                call()
            except ValueError as e:
                errors[what] = str(e)
        results["errors"] = errors
    finally:
        ra._attend, ra._attend_backward, ra._fused = attend, attend_backward, fused
        dist.batch_isend_irecv, dist.all_to_all_single = batch, all_to_all
    return results


@pytest.fixture(scope="module", params=[2, 3, 4])
def ranks(request: pytest.FixtureRequest) -> tuple[int, dict, list[dict]]:
    world = request.param
    cases = _cases(world)
    return world, cases, spawn_local(run_attention, world, cases, timeout_s=120)


def _gathered(per_rank: list[dict], key: str, cp: int) -> torch.Tensor:
    first = per_rank[0][key]
    full = torch.zeros(*first.shape[:2], first.shape[2] * cp, first.shape[3], dtype=first.dtype)
    for res in per_rank:
        full[:, :, zigzag_positions(full.shape[2], cp, res["index"])] = res[key]
    return full


def _reference(case: dict[str, Any], cp: int) -> dict[str, torch.Tensor]:
    q, k, v, dout = (t.requires_grad_() for t in _full_inputs(cp, case["heads_kv"]))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=case["causal"], scale=case["scale"],
                                         enable_gqa=case["heads_kv"] != H)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _members(world: int, case: dict[str, Any]) -> list[list[int]]:
    return case["groups"] or [list(range(world))]


def test_zigzag_positions_partition_the_sequence_in_chunk_order() -> None:
    for seq, cp in [(16, 2), (24, 3), (32, 4), (8, 4)]:
        held = [zigzag_positions(seq, cp, i) for i in range(cp)]
        assert all(p.dtype == torch.int64 and p.numel() == seq // cp for p in held)
        assert torch.equal(torch.cat(held).sort().values, torch.arange(seq))
        c = seq // (2 * cp)
        for i, p in enumerate(held):
            assert p.tolist() == [*range(i * c, (i + 1) * c), *range((2 * cp - 1 - i) * c, (2 * cp - i) * c)]
    assert zigzag_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert torch.equal(zigzag_positions(7, 1, 0), torch.arange(7))
    with pytest.raises(ValueError, match=r"seq=18 .*2\*cp=8 \(cp=4\).*pad the sequence to a multiple of 8"):
        zigzag_positions(18, 4, 0)
    with pytest.raises(ValueError, match="index"):
        zigzag_positions(16, 2, 2)


def test_matches_scaled_dot_product_attention(ranks: tuple[int, dict, list[dict]]) -> None:
    world, cases, results = ranks
    for name, case in cases.items():
        ref = _reference(case, len(_members(world, case)[0]))
        loose = case["bf16"]
        for members in _members(world, case):
            per_rank = [results[r][name] for r in members]
            assert all(res["dtype"] == (torch.bfloat16 if loose else torch.float32) for res in per_rank), name
            for key in ("out", "dq", "dk", "dv"):
                got = _gathered(per_rank, key, len(members))
                assert got.dtype == torch.float32  # gradients of the fp32 leaves, under autocast too
                tol = {"atol": 4e-2, "rtol": 4e-2} if loose else {"atol": 1e-5, "rtol": 1e-5}
                torch.testing.assert_close(got, ref[key], **tol, msg=lambda m, n=name, k=key: f"{n} {k}: {m}")


def test_causal_ring_work_is_equal_and_skips_the_future(ranks: tuple[int, dict, list[dict]]) -> None:
    world, cases, results = ranks
    for name, case in cases.items():
        if case["mode"] != "ring":
            continue
        for members in _members(world, case):
            cp = len(members)
            for phase in ("forward", "backward"):
                blocks = [[e[1] for e in results[r][name][phase] if e[0] == "block"] for r in members]
                chunk = T_LOCAL // 2  # one chunk of queries (all H heads) against one chunk of keys
                assert all(q_rows == chunk and k_rows == chunk for b in blocks for q_rows, k_rows, _ in b)
                masked = [sum(m for *_, m in b) for b in blocks]
                if case["causal"]:  # 3 pairs with its own block, 2 with each other one; 2 on the diagonal
                    assert [len(b) for b in blocks] == [2 * cp + 1] * cp, (name, phase)
                    assert masked == [2] * cp, (name, phase)
                    assert 2 * cp + 1 < (2 * cp) ** 2 // cp
                else:
                    assert [len(b) for b in blocks] == [4 * cp] * cp and masked == [0] * cp, (name, phase)


def test_sent_bytes_are_exchange_bytes(ranks: tuple[int, dict, list[dict]]) -> None:
    world, cases, results = ranks
    for name, case in cases.items():
        for members in _members(world, case):
            cp = len(members)
            itemsize = 2 if case["bf16"] else 4
            want = exchange_bytes(B, case["heads_kv"], T_LOCAL, D, cp, itemsize, case["mode"], heads=H)
            for r in members:
                res = results[r][name]
                for phase in ("forward", "backward"):
                    sends = [e[1] for e in res[phase] if e[0] == "send"]
                    assert sum(sends) == want[phase], (name, phase, r, sends)
                if case["mode"] == "ring":  # K/V of a step are posted before the first block is computed
                    assert res["forward"][0][0] == "send" and res["backward"][0][0] == "send", name
                    ring_steps = cp - 1
                    assert len([e for e in res["forward"] if e[0] == "send"]) == ring_steps
                    # K/V again, and the dK/dV buffers after every step (the last one sends them home)
                    assert len([e for e in res["backward"] if e[0] == "send"]) == ring_steps + cp


def test_errors_name_the_fix(ranks: tuple[int, dict, list[dict]]) -> None:
    world, _, results = ranks
    errors = results[0]["errors"]
    assert f"seq={3 * world}" in errors["odd tokens"] and f"cp={world}" in errors["odd tokens"]
    if world == 2:
        assert "heads" not in errors  # 2 heads over 2 ranks
    else:
        assert "H=2" in errors["heads"] and f"cp={world}" in errors["heads"]


def test_exchange_bytes_formulas() -> None:
    kv = 2 * 3 * 8 * 16  # batch, heads_kv, t_local, head_dim
    assert exchange_bytes(2, 3, 8, 16, 1, 2, "ring") == {"forward": 0, "backward": 0}
    assert exchange_bytes(2, 3, 8, 16, 4, 2, "ring") == {"forward": 3 * 2 * kv * 2,
                                                        "backward": 3 * 2 * kv * 2 + 4 * 2 * kv * 4}
    # q (6 heads) and out, k and v repeated from 3 to lcm(3, 2) = 6 heads
    assert exchange_bytes(2, 3, 8, 16, 2, 4, "ulysses", heads=6) == {"forward": 4 * 2 * kv * 4,
                                                                     "backward": 4 * 2 * kv * 4}
    with pytest.raises(ValueError, match="mode"):
        exchange_bytes(2, 3, 8, 16, 2, 4, "allgather")
