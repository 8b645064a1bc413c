"""Pipeline simulator: closed forms for GPipe, 1F1B and interleaved; comm, uneven stages, trace."""

from __future__ import annotations

import json

import pytest

from autopar.errors import PlanError
from autopar.ir.schedule import Action, Schedule, gpipe, interleaved_1f1b, one_f_one_b
from autopar.ir.simulate import simulate

F, B = 1.0, 2.0


@pytest.mark.parametrize("p,m", [(1, 1), (1, 4), (2, 3), (4, 4), (4, 8), (5, 2), (6, 12)])
def test_gpipe_closed_form(p: int, m: int) -> None:
    r = simulate(gpipe(p, m), F, B)
    assert r.step_time == (m + p - 1) * (F + B)
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    for rank in range(p):
        assert r.per_rank_busy[rank] == m * (F + B)
        assert r.per_rank_bubble[rank] == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p,m", [(1, 3), (2, 2), (3, 5), (4, 8), (6, 3), (6, 12)])
def test_1f1b_matches_gpipe_with_equal_times(p: int, m: int) -> None:
    assert simulate(one_f_one_b(p, m), F, B).step_time == simulate(gpipe(p, m), F, B).step_time
    assert simulate(one_f_one_b(p, m), F, B).step_time == (m + p - 1) * (F + B)


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (2, 8, 3), (3, 3, 2), (3, 6, 2), (4, 4, 2), (4, 8, 3),
                                   (4, 12, 4), (1, 4, 3), (3, 12, 1)])
def test_interleaved_megatron_closed_form(p: int, m: int, v: int) -> None:
    # Each of the v chunks of a rank takes f/v, b/v: the bubble shrinks to (p-1)(f+b)/v, so
    # step = (m*v + p - 1) * (f+b)/v and bubble fraction = (p-1) / (m*v + p - 1). The schedule (Megatron
    # warm-up 2(p-r-1) + (v-1)p) reproduces this exactly, including m == p.
    r = simulate(interleaved_1f1b(p, m, v), F / v, B / v)
    assert r.step_time == pytest.approx((m * v + p - 1) * (F + B) / v, rel=1e-12)
    assert r.bubble_fraction == pytest.approx((p - 1) / (m * v + p - 1), rel=1e-9, abs=1e-12)


def test_interleaving_reduces_bubble() -> None:
    p, m = 4, 8
    base = simulate(one_f_one_b(p, m), F, B).bubble_fraction
    bubbles = [simulate(interleaved_1f1b(p, m, v), F / v, B / v).bubble_fraction for v in (1, 2, 4)]
    assert bubbles[0] == pytest.approx(base)
    assert bubbles[0] > bubbles[1] > bubbles[2]


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 6), (5, 3)])
def test_p2p_latency_gpipe(p: int, m: int) -> None:
    # Forward: each of the p-1 hops delays the last stage's first forward by t, and the forwards
    # behind it stream at rate f (t <= f, so the sender's comm stream keeps up). Backward: same over p-1
    # hops with t <= b. Total critical path grows by exactly 2(p-1)t.
    t = 0.25
    r = simulate(gpipe(p, m), F, B, p2p_time=t)
    assert r.step_time == pytest.approx((m + p - 1) * (F + B) + 2 * (p - 1) * t, rel=1e-12)


def test_p2p_time_callable_per_link() -> None:
    # Only the 1 -> 2 link (and 2 -> 1 back) is slow: the critical path pays it once each way.
    slow = lambda src, dst: 0.5 if {src, dst} == {1, 2} else 0.0
    r = simulate(gpipe(3, 4), F, B, p2p_time=slow)
    assert r.step_time == pytest.approx(6 * (F + B) + 2 * 0.5)


def test_sends_and_recvs_on_comm_streams_overlap_compute() -> None:
    r = simulate(gpipe(2, 3), F, B, p2p_time=0.5)
    sends = [e for e in r.events if e[2].startswith("SEND")]
    recvs = [e for e in r.events if e[2].startswith("RECV")]
    assert {e[1] for e in sends} == {"comm"} and {e[1] for e in recvs} == {"recv"}
    assert len(sends) == len(recvs) == 6
    # rank 0 runs F1 while F0's activation is in flight
    f1 = next(e for e in r.events if e[0] == 0 and e[2] == "F s0 mb1")
    send0 = next(e for e in r.events if e[2] == "SEND_F s0 mb0")
    assert f1[3] == send0[3] == 1.0


@pytest.mark.parametrize("sched", [gpipe, one_f_one_b])
def test_uneven_two_stages_slow_last(sched) -> None:
    # f=[1,2], b=[2,3], m=4: stage 1 is the bottleneck and, once fed after f0, runs without a gap
    # (f0+b0 <= f1+b1 keeps it fed). Stage 0 then drains its last backward: step = f0 + m(f1+b1) + b0.
    f, b, m = [1.0, 2.0], [2.0, 3.0], 4
    r = simulate(sched(2, m), f, b)
    assert r.step_time == 1 + m * (2 + 3) + 2 == 23.0
    assert r.per_rank_bubble[1] == pytest.approx(1 - 20 / 23)


def test_uneven_two_stages_slow_first() -> None:
    # f=[2,1], b=[3,2], m=4, worked by hand:
    # 1F1B rank 0: F0 0-2, F1 2-4, B0 5-8 (waits for rank 1's B0 at 5), F2 8-10, B1 10-13, F3 13-15,
    # B2 15-18, B3 18-21, i.e. m(f0+b0) + (f1+b1-f0) = 21.
    # GPipe: rank 1's last forward ends m*f0 + f1 = 9, its B_k end 11, 13, 15, 17; rank 0's backwards
    # are then bound by b0 > b1: 11-14, 14-17, 17-20, 20-23, i.e. m*f0 + f1 + b1 + m*b0 = 23.
    f, b, m = [2.0, 1.0], [3.0, 2.0], 4
    assert simulate(one_f_one_b(2, m), f, b).step_time == 21.0
    assert simulate(gpipe(2, m), f, b).step_time == 23.0


def test_slowest_stage_bounds_throughput() -> None:
    m = 64
    f, b = [1.0, 1.0, 3.0, 1.0], [2.0, 2.0, 6.0, 2.0]
    step = simulate(one_f_one_b(4, m), f, b).step_time
    assert step >= m * (3 + 6)
    assert step <= m * (3 + 6) + sum(f) + sum(b)


def test_callable_times() -> None:
    r = simulate(gpipe(2, 2), lambda s, mb: 1.0 + mb, lambda s, mb: 2.0)
    assert r.per_rank_busy == {0: 1 + 2 + 4, 1: 1 + 2 + 4}


def test_allreduce_overlap_vs_not() -> None:
    # One rank holding two stages (interleaved, v=2), m=2, f=1, b=2 per stage: compute ends at 12 and
    # stage 1's last backward ends at 10, before stage 0's last backward (10-12).
    s = interleaved_1f1b(1, 2, 2)
    assert simulate(s, F, B).step_time == 12.0
    # overlapped: AR(s1) 10-11 on the comm stream under B(s0, 1); AR(s0) 12-13
    assert simulate(s, F, B, allreduce_time=1.0, overlap_allreduce=True).step_time == 13.0
    # not overlapped: AR(s1) 10-11 on the compute stream pushes B(s0, 1) to 11-13; AR(s0) 13-14
    r = simulate(s, F, B, allreduce_time=1.0, overlap_allreduce=False)
    assert r.step_time == 14.0
    assert r.per_rank_busy[0] == 12.0
    # comm-bound: long allreduces serialize on the comm stream: AR(s1) 10-13, AR(s0) 13-16
    assert simulate(s, F, B, allreduce_time=3.0).step_time == 16.0
    assert simulate(s, F, B, allreduce_time=[0.5, 3.0]).step_time == 13.5


def test_allreduce_after_last_stage_backward_in_gpipe() -> None:
    p, m, a = 3, 4, 0.5
    base = (m + p - 1) * (F + B)
    for overlap in (True, False):
        r = simulate(gpipe(p, m), F, B, allreduce_time=a, overlap_allreduce=overlap)
        assert r.step_time == base + a
        ars = [e for e in r.events if e[2].startswith("ALLREDUCE")]
        assert len(ars) == p and {e[1] for e in ars} == ({"comm"} if overlap else {"compute"})


def test_chrome_trace(tmp_path) -> None:
    s = interleaved_1f1b(2, 4, 2)
    r = simulate(s, F, B, p2p_time=0.1, allreduce_time=0.3)
    trace = json.loads(json.dumps(r.to_chrome_trace()))
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    compute = [e for e in xs if e["cat"] == "compute"]
    n_compute = sum(1 for acts in s.actions.values() for a in acts if a.kind in ("F", "B"))
    assert len(compute) == n_compute == 2 * s.num_stages * s.num_microbatches
    assert {e["pid"] for e in xs} == {0, 1}
    assert all(e["tid"] == 0 for e in compute)
    assert any(e["name"] == "F s1 mb3" for e in compute)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in xs)
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(r.step_time * 1e6)
    out = tmp_path / "trace.json"
    r.write_trace(out)
    assert json.loads(out.read_text())["traceEvents"] == trace["traceEvents"]


def test_simulate_rejects_deadlock_and_bad_inputs() -> None:
    s = Schedule("bad", 1, 1, (0,), {0: [Action(0, "B", 0, 0), Action(0, "F", 0, 0)]})
    with pytest.raises(PlanError, match="deadlocks"):
        simulate(s, F, B)
    with pytest.raises(PlanError, match="one time per stage"):
        simulate(gpipe(3, 2), [1.0, 1.0], B)


def test_64x256_step_covers_its_critical_path() -> None:  # its wall time: bench/fast_paths.py
    r = simulate(one_f_one_b(64, 256), [1.0] * 64, [2.0] * 64, p2p_time=0.01, allreduce_time=0.5)
    assert r.step_time >= (256 + 63) * 3.0


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 3, 5, 1), ("1f1b", 4, 7, 1), ("interleaved_1f1b", 2, 4, 2),
                                        ("zb_h1", 3, 6, 1)])
def test_step_only_simulation_is_the_full_one(name: str, p: int, m: int, v: int) -> None:
    """The planner's step-only path (plan_simulate.simulated_step_time -> simulate.step_time, no events) gives the
    very float the full simulation does, on uneven stages with a smaller last micro-batch, sends, syncs and W."""
    import random

    from autopar.ir.plan_simulate import _step_time, simulate_stages

    rng = random.Random(p * 100 + m)
    for _ in range(5):
        times = [(f, 0.9 * f, b, 0.8 * b, rng.uniform(0, 0.3), rng.uniform(0, 1), 0.4 * b)
                 for f, b in ((rng.uniform(0.1, 2), rng.uniform(0.1, 4)) for _ in range(p * v))]
        share = 2 * m + 1
        want = simulate_stages(name, v, share, m, times).step_time
        assert _step_time.__wrapped__(name, v, share, m, tuple(times)) == want
