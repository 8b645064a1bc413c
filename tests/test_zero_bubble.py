"""Zero-bubble pipeline schedules (ZB-H1): the split backward in the IR, its simulation, its pricing, and the
runtime, which trains exactly like one process and like 1F1B (fp32, 3 AdamW steps on gloo ranks)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from autopar.errors import PlanError
from autopar.ir.plan import Strategy, plan_from_strategy, simulate_stages
from autopar.ir.schedule import (
    Action,
    Schedule,
    make_schedule,
    peak_inflight,
    splits_backward,
)
from autopar.ir.schedule_check import validate
from autopar.ir.simulate import simulate
from autopar.lowering import memory_actions
from autopar.runtime.launch import spawn_local
from autopar.runtime.split_backward import backward_input, backward_weight
from autopar.solver.pricing.pricing import inflight_closed_form

from .runtime_cases import (
    ATOL,
    RTOL,
    assert_ranks_match_reference,
    assert_work_split,
    build,
)

# ---- the IR -------------------------------------------------------------------------------------------


def test_w_actions_round_trip_through_text_and_json() -> None:
    assert str(Action.parse("r1:s3W7")) == "r1:s3W7"
    assert Action.parse("s0W2", rank=0) == Action(0, "W", 0, 2)
    for p, m in [(1, 1), (2, 4), (4, 8), (3, 2)]:
        s = make_schedule("zb_h1", p, m)
        assert Schedule.parse(str(s)) == s and Schedule.from_json(s.to_json()) == s
        assert splits_backward(s) and not splits_backward(make_schedule("1f1b", p, m))
        validate(s)
        for r in range(p):  # one F, B and W per micro-batch, W after its B
            acts = [(a.kind, a.microbatch) for a in s.actions[r] if a.kind in ("F", "B", "W")]
            for kind in "FBW":
                assert sorted(mb for k, mb in acts if k == kind) == list(range(m))
            for mb in range(m):
                assert acts.index(("B", mb)) < acts.index(("W", mb))


def test_zb_h1_text_of_two_stages() -> None:
    """Stage 1 (the last) keeps one W pending: W0 runs after B1; stage 0 runs W right after B, as written out
    by hand from section 3.1 of Qi et al. 2023."""
    text = str(make_schedule("zb_h1", 2, 3))
    assert text.splitlines()[1:] == [
        "r0: s0F0 s0SEND_F0 s0F1 s0SEND_F1 s0RECV_B0 s0B0 s0W0 s0F2 s0SEND_F2 s0RECV_B1 s0B1 s0W1 s0RECV_B2 s0B2 "
        "s0W2 s0ALLREDUCE",
        "r1: s1RECV_F0 s1F0 s1B0 s1SEND_B0 s1RECV_F1 s1F1 s1B1 s1SEND_B1 s1W0 s1RECV_F2 s1F2 s1B2 s1SEND_B2 s1W1 "
        "s1W2 s1ALLREDUCE",
    ]


def test_validate_catches_a_w_before_its_b_and_a_missing_w() -> None:
    s = make_schedule("zb_h1", 2, 2)
    acts = s.actions[1]
    b0, w0 = acts.index(Action(1, "B", 1, 0)), acts.index(Action(1, "W", 1, 0))
    acts[b0], acts[w0] = acts[w0], acts[b0]
    with pytest.raises(PlanError, match=r"r1:s1W0 is scheduled before its input-gradient backward r1:s1B0"):
        validate(s)
    s = make_schedule("zb_h1", 2, 2)
    s.actions[0].remove(Action(0, "W", 0, 1))
    with pytest.raises(PlanError, match=r"r0:s0W1 is missing"):
        validate(s)
    s = make_schedule("zb_h1", 2, 2)  # the ALLREDUCE must wait for every W
    acts = s.actions[0]
    acts.remove(Action(0, "ALLREDUCE", 0, -1))
    acts.insert(acts.index(Action(0, "W", 0, 1)), Action(0, "ALLREDUCE", 0, -1))
    with pytest.raises(PlanError, match=r"ALLREDUCE is scheduled before the backward r0:s0W1"):
        validate(s)


def test_reduce_follows_the_w_in_a_split_schedule() -> None:
    s = memory_actions(make_schedule("zb_h1", 2, 2), 0, {0: {0}}, {0: {0}})
    kinds = [a.compact() for a in s.actions[0] if a.microbatch == 0 and a.kind not in ("SEND_F", "RECV_B")]
    assert kinds == ["s0GATHER_F0L0", "s0F0", "s0FREE_F0L0", "s0GATHER_B0L0", "s0B0", "s0FREE_B0L0", "s0W0",
                     "s0REDUCE0L0"]
    validate(s)
    acts = s.actions[0]  # a REDUCE before its W is caught
    i, j = acts.index(Action(0, "W", 0, 0)), acts.index(Action(0, "REDUCE", 0, 0, 0))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(PlanError, match="REDUCE0L0 is scheduled before its compute action r0:s0W0"):
        validate(s)


# ---- simulation -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_zb_h1_meets_the_papers_bubble_with_f_b_w_equal(p: int, m: int) -> None:
    """F = B = W = 1 (bwd 2, W half of it): 1F1B's step is (m + p - 1)(F + B + W); ZB-H1's bubble is
    (p - 1)(F + B - W) (Qi et al. 2023, section 3.1), so its step is 3m + p - 1 for m >= p."""
    one = simulate(make_schedule("1f1b", p, m), 1.0, 2.0).step_time
    zb = simulate(make_schedule("zb_h1", p, m), 1.0, 2.0).step_time
    assert one == pytest.approx(3 * (m + p - 1))
    assert zb == pytest.approx(3 * m + (p - 1))
    assert zb < one


def test_zb_equals_1f1b_when_w_is_empty_and_beats_it_otherwise() -> None:
    for p, m in [(2, 4), (4, 8)]:
        one = simulate(make_schedule("1f1b", p, m), 1.0, 2.0).step_time
        # W = 0: B is the whole backward; the pending W's cost nothing, the order is 1F1B's
        assert simulate(make_schedule("zb_h1", p, m), 1.0, 2.0, wgrad_time=0.0).step_time == pytest.approx(one)
        for w in (0.2, 0.5, 1.0, 1.5):
            assert simulate(make_schedule("zb_h1", p, m), 1.0, 2.0, wgrad_time=w).step_time < one


def test_peak_inflight_of_zb_h1_is_1f1bs_peak_and_the_closed_form_agrees() -> None:
    for p in (1, 2, 3, 4, 8):
        for m in (1, 2, 3, 4, 8, 16):
            zb, one = peak_inflight(make_schedule("zb_h1", p, m)), peak_inflight(make_schedule("1f1b", p, m))
            assert max(zb.values()) == max(one.values()) == min(p, m)
            assert [zb[r] for r in range(p)] == inflight_closed_form("zb_h1", p, m)


def test_stage_w_times_reach_the_simulation() -> None:
    """A 7th stage time (bwd_w_s) sets W; smaller micro-batches take the same share of their bwd."""
    times = [(1.0, 0.5, 2.0, 1.0, 0.0, 0.0, 1.5), (1.0, 0.5, 2.0, 1.0, 0.0, 0.0, 1.5)]
    zb = simulate_stages("zb_h1", 1, 8, 4, times)
    expect = simulate(make_schedule("zb_h1", 2, 4), 1.0, 2.0, wgrad_time=1.5)
    assert zb.step_time == pytest.approx(expect.step_time)
    w_events = [e for e in zb.events if e[2].startswith("W ")]
    assert len(w_events) == 8 and all(e[4] - e[3] == pytest.approx(1.5) for e in w_events)
    plain = simulate_stages("1f1b", 1, 8, 4, times)  # no W actions: the 7th time is ignored
    assert plain.step_time == pytest.approx(simulate(make_schedule("1f1b", 2, 4), 1.0, 2.0).step_time)


FIELDS = dict(precision="fp32", optimizer="adamw", cluster={}, model={})


def test_strategy_accepts_zb_h1_and_names_the_schedules_on_a_typo() -> None:
    plan = plan_from_strategy(Strategy(pp=2, schedule="zb_h1"), world_size=2, global_batch=8, num_layers=6,
                              first_block=1, num_blocks=4, **FIELDS)
    assert plan.schedule == "zb_h1" and plan.chunks == 1
    with pytest.raises(PlanError, match="zb_h1"):
        plan_from_strategy(Strategy(pp=2, schedule="zb-h1"), world_size=2, global_batch=8, num_layers=6,
                           first_block=1, num_blocks=4, **FIELDS)


def test_priced_plan_splits_the_backward_from_the_graph() -> None:
    """The planner's W time is the graph's weight-gradient matmuls: about half of a GPT's backward compute."""
    import autopar

    case = build("gpt", layers=4, batch=8)
    est = {}
    for schedule in ("1f1b", "zb_h1"):
        est[schedule] = autopar.estimate(case.model, "1x2xcpu", Strategy(pp=2, schedule=schedule, microbatch_size=2),
                                         case.example_inputs, case.example_target, case.loss_fn, precision="fp32")
    stages = est["zb_h1"].plan.pipelines[0].stages
    shares = [st.predicted["bwd_w_s"] / st.predicted["bwd_s"] for st in stages]
    assert all(0.2 < x < 0.7 for x in shares), shares  # matmul-dominated: about half (solver/pricing/wgrad.py)
    # a prediction, model vs model: the simulated zb_h1 step is shorter than 1F1B's with the same stage times
    assert est["zb_h1"].plan.predicted["step_time_s"] < est["1f1b"].plan.predicted["step_time_s"]


def _mlp_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    twin = copy.deepcopy(m)
    return m, twin


def test_split_backward_computes_input_grads_in_b_and_weight_grads_in_w() -> None:
    m, twin = _mlp_pair()
    x = torch.randn(5, 4, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    g = torch.randn(5, 3)
    torch.autograd.backward([m(x)], [g])  # one plain backward: the expectation
    fired: list[str] = []
    for name, p in twin.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    pending = backward_input([twin(x2)], [g], [x2], list(twin.parameters()))
    assert torch.equal(x2.grad, x.grad)
    assert all(p.grad is None for p in twin.parameters()) and not fired  # B left the weights alone
    backward_weight(pending)
    assert sorted(fired) == sorted(n for n, _ in twin.named_parameters())  # W accumulated through autograd
    for (name, p), q in zip(twin.named_parameters(), m.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    m, first = _mlp_pair()  # a first stage (no input needs a gradient): the whole backward runs in W
    data = torch.randn(5, 4)
    torch.autograd.backward([m(data)], [g])
    pending = backward_input([first(data)], [g], [data], list(first.parameters()))
    assert all(p.grad is None for p in first.parameters())
    backward_weight(pending)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(first.parameters(), m.parameters(), strict=True))


class _SharedBranches(torch.nn.Module):
    """c's branch joins the input-gradient graph where a's and b's do: torch's grouping listed a and c twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Parameter(torch.randn(4)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (self.a + self.c) + x * (self.b + self.c)


def _plain_then_b(m: torch.nn.Module) -> tuple[Any, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One plain backward of `m` (its parameter gradients kept), then B of the split on a fresh copy of the
    input: (what B left for W, the plain input, the split's input, the plain parameter gradients)."""
    torch.manual_seed(0)
    x, g = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    torch.autograd.backward([m(x)], [g])
    want = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    x2 = x.detach().clone().requires_grad_(True)
    return backward_input([m(x2)], [g], [x2], list(m.parameters())), x, x2, want


def test_split_backward_merges_groups_that_share_a_parameter() -> None:
    torch.manual_seed(0)
    m = _SharedBranches()
    pending, _, _, want = _plain_then_b(m)
    assert len(pending.groups) == 1  # one group: each parameter and join node in exactly one
    backward_weight(pending)  # raised "Trying to backward through the graph a second time"
    for p, w in zip(m.parameters(), want, strict=True):
        assert torch.equal(p.grad, w)


class _BiasTwice(torch.nn.Module):
    """One bias added below and above a linear layer (T5's relative position bias, added in every layer): the
    bias joins the input-gradient graph at two nodes, one below the other."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.bias = torch.nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.bias * 2
        return self.lin(x + b) + b


def test_split_backward_runs_nested_joins_whole_in_b() -> None:
    torch.manual_seed(0)
    m = _BiasTwice()
    pending, x, x2, want = _plain_then_b(m)
    # W from the upper join would run lin's backward again, after lin's own W freed it
    assert pending.mode == "whole"
    backward_weight(pending)
    assert torch.equal(x2.grad, x.grad)
    for p, w in zip(m.parameters(), want, strict=True):
        assert torch.equal(p.grad, w)


# ---- the runtime ----------------------------------------------------------------------------------------

GPT = ("gpt", {"layers": 4, "batch": 8})
# (model, kwargs, spec) on 4 ranks; every zb_h1 case is followed by its 1F1B twin (same spec otherwise)
CASES_4 = [
    (*GPT, {"pp": 4, "m": 4, "schedule": "zb_h1"}),
    (*GPT, {"pp": 4, "m": 4, "schedule": "1f1b"}),
    (*GPT, {"pp": 2, "dp": 2, "m": 4, "schedule": "zb_h1"}),  # bucketed DDP sync: launched in the last W
    (*GPT, {"pp": 2, "dp": 2, "m": 4, "schedule": "1f1b"}),
    ("gpt", {"layers": 4, "batch": 8, "tie_embeddings": True}, {"pp": 2, "dp": 2, "m": 2, "recompute": True,
                                                               "schedule": "zb_h1"}),
    ("gpt", {"layers": 4, "batch": 8, "tie_embeddings": True}, {"pp": 2, "dp": 2, "m": 2, "recompute": True,
                                                               "schedule": "1f1b"}),
    (*GPT, {"pp": 2, "dp": 2, "m": 2, "zero": 2, "schedule": "zb_h1"}),  # ZeRO-2 runs whole-step under zb
    (*GPT, {"pp": 2, "dp": 2, "m": 2, "zero": 2, "schedule": "1f1b"}),
]
CASES_2 = [
    (*GPT, {"pp": 2, "m": 4, "schedule": "zb_h1"}),
    (*GPT, {"pp": 2, "m": 4, "schedule": "1f1b"}),
    ("hf_gpt2", {"layers": 2, "batch": 4}, {"pp": 2, "m": 2, "schedule": "zb_h1"}),
    ("hf_gpt2", {"layers": 2, "batch": 4}, {"pp": 2, "m": 2, "schedule": "1f1b"}),
]


def run_watching_w(rank: int, world: int, cases: list) -> tuple[list, list[dict[str, int]]]:
    """`run_cases`, also counting per case where this rank's parameter gradients accumulate: inside the
    executor's W (`backward_weight`) or elsewhere (B, or a plain backward)."""
    import autopar.runtime.program as program

    from .runtime_cases import STEPS, compile_case, work_of

    in_w = [False]
    real = program.backward_weight

    def watched(pending: Any) -> None:
        in_w[0] = True
        try:
            real(pending)
        finally:
            in_w[0] = False

    program.backward_weight = watched
    out, counts = [], []
    try:
        for name, kwargs, spec in cases:
            case, prog = compile_case(name, kwargs, spec, rank, world)
            count = {"W": 0, "elsewhere": 0}
            for p in prog.params.values():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(
                        lambda _p, count=count: count.update(W=count["W"] + in_w[0],
                                                             elsewhere=count["elsewhere"] + (not in_w[0])))
            losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(STEPS)]
            out.append((losses, prog.state_dict()["model"], work_of(prog)))
            counts.append(count)
    finally:
        program.backward_weight = real
    return out, counts


@pytest.fixture(scope="module")
def watched_4() -> list:
    return spawn_local(run_watching_w, 4, CASES_4, timeout_s=300)


@pytest.fixture(scope="module")
def results_4(watched_4: list) -> list:
    return [r[0] for r in watched_4]


@pytest.fixture(scope="module")
def watched_2() -> list:
    pytest.importorskip("transformers")
    return spawn_local(run_watching_w, 2, CASES_2, timeout_s=300)


@pytest.fixture(scope="module")
def results_2(watched_2: list) -> list:
    return [r[0] for r in watched_2]


@pytest.mark.parametrize("ranks", [2, 4])
def test_zb_h1_accumulates_the_weight_gradients_in_w(ranks: int, request: pytest.FixtureRequest) -> None:
    """The split is real: under zb_h1 every rank's parameter gradients accumulate in its W actions (so B
    leaves them for later), under 1F1B never; a zb_h1 that ran the whole backward in B would still train
    right, and only this notices."""
    watched = request.getfixturevalue(f"watched_{ranks}")
    cases = CASES_4 if ranks == 4 else CASES_2
    for index, (_, _, spec) in enumerate(cases):
        for rank, (_, counts) in enumerate(watched):
            c = counts[index]
            if spec["schedule"] == "zb_h1":
                assert c["W"] > 0 and c["W"] >= 3 * c["elsewhere"], (spec, rank, c)
            else:
                assert c["W"] == 0 and c["elsewhere"] > 0, (spec, rank, c)


def _check(results: list, cases: list, index: int) -> None:
    name, kwargs, spec = cases[index]
    # the same gradient route as 1F1B: equal to rounding; ZeRO-2 reduces whole-step under zb and per layer
    # (summing micro-batches at the owner in another order) under 1F1B: equal to reduction-order noise
    tol = dict(rtol=RTOL, atol=ATOL) if spec.get("zero", 0) >= 2 else dict(rtol=1e-6, atol=1e-7)
    ref_losses, _ = assert_ranks_match_reference(results, index, name, kwargs, "zb_h1 ")
    for rank, per_rank in enumerate(results):
        losses, params, _ = per_rank[index]
        twin_losses, twin_params, _ = per_rank[index + 1]  # the same plan under 1F1B: the same numbers
        assert losses == pytest.approx(twin_losses, rel=tol["rtol"], abs=tol["atol"])
        for k, v in twin_params.items():
            torch.testing.assert_close(params[k], v, **tol, msg=f"rank {rank} {k} vs 1F1B")
    full = build(name, **kwargs).model.state_dict()
    assert_work_split([r[index][2] for r in results], spec, kwargs["batch"], full)
    assert ref_losses[-1] < ref_losses[0]


@pytest.mark.parametrize("index", range(0, len(CASES_4), 2), ids=[str(c[2]) for c in CASES_4[::2]])
def test_zb_h1_trains_like_one_process_and_like_1f1b_on_4_ranks(results_4: list, index: int) -> None:
    _check(results_4, CASES_4, index)


@pytest.mark.parametrize("index", range(0, len(CASES_2), 2), ids=[f"{c[0]}-{c[2]}" for c in CASES_2[::2]])
def test_zb_h1_trains_like_one_process_and_like_1f1b_on_2_ranks(results_2: list, index: int) -> None:
    _check(results_2, CASES_2, index)


def test_zero_bubble_prices_the_second_recompute_its_w_runs() -> None:
    """runtime/split_backward.py recomputes a stage's recomputed blocks in B and again in W: under zb_h1 a
    recomputing stage's backward is priced one recompute (the 1F1B difference between recompute on and
    off) longer than under 1F1B, that recompute in W; the first stage (whole backward in W) and stages
    without recompute are priced as under 1F1B."""
    from autopar.solver.pricing.pricing import price_strategy

    from .test_planner import cm_for

    cm = cm_for("1x2xA100-80GB", layers=4, batch=8, hidden=256, seq=128)

    def stages(schedule: str, rc: bool) -> list[dict]:
        plan = price_strategy(cm, Strategy(pp=2, microbatch_size=2, schedule=schedule, recompute=rc)).plan
        return [st.predicted for st in plan.pipelines[0].stages]

    plain, rc = stages("1f1b", False), stages("1f1b", True)
    zb_plain, zb_rc = stages("zb_h1", False), stages("zb_h1", True)
    recompute = rc[1]["bwd_s"] - plain[1]["bwd_s"]
    assert recompute > 0
    assert zb_plain[1]["bwd_s"] == pytest.approx(plain[1]["bwd_s"], rel=1e-12)
    assert zb_rc[1]["bwd_s"] == pytest.approx(rc[1]["bwd_s"] + recompute, rel=1e-9)
    assert zb_rc[1]["bwd_w_s"] - zb_plain[1]["bwd_w_s"] == pytest.approx(recompute, rel=1e-9)
    assert zb_rc[0]["bwd_s"] == pytest.approx(rc[0]["bwd_s"], rel=1e-12)
