"""Measured blocks (issue 25 part 2): the profile's answers, pricing from it, `autopar profile` on this CPU."""

from __future__ import annotations

import json

import pytest

import autopar
from autopar import models
from autopar.cli import main
from autopar.cost_models.measured_blocks import BlockProfile, Entry, Point
from autopar.errors import PlanError
from autopar.runtime.block_profiler import profile_blocks
from autopar.solver.pricing.pricing import Option

GPT = dict(layers=3, hidden=32, heads=2, seq=8, batch=4, vocab=64)


def _case() -> models.ModelCase:
    return models.gpt(**GPT, seed=0)


def test_answers_at_measured_between_and_beyond_sizes():
    pts = [Point(2, 2.0, 4.0, 2.5, 100.0), Point(4, 3.0, 7.0, None, 300.0)]
    p = BlockProfile(entries=[Entry("cpu", 1, 1, "fp32", pts, "bench")], name="p.json")
    at = p.times("cpu", 1, 1, "fp32", 2)
    assert (at.fwd_s, at.bwd_s, at.recompute_s, at.peak_bytes) == (2.0, 4.0, 2.5, 100.0)
    mid = p.times("cpu", 1, 1, "fp32", 3)
    assert (mid.fwd_s, mid.bwd_s, mid.recompute_s, mid.peak_bytes) == (2.5, 5.5, 2.75, 200.0)
    assert "interpolated from micro-batches 2 and 4 to 3" in mid.source and mid.source.startswith("p.json")
    far = p.times("cpu", 1, 1, "fp32", 8)
    assert far.fwd_s == pytest.approx(5.0) and "extrapolated" in far.source
    assert p.times("cpu", 0, 1, "fp32", 2) is None and p.times("cpu", 1, 2, "fp32", 2) is None
    assert p.times("T4", 1, 1, "fp32", 2) is None
    one = BlockProfile(entries=[Entry("T4", 0, 2, "*", [Point(1, 0.5, 1.0)])])
    assert one.times("T4", 0, 2, "fp16", 4).fwd_s == pytest.approx(2.0)  # per-sample figures scale with n
    back = BlockProfile.from_json(p.to_json(), "p.json")
    assert back.times("cpu", 1, 1, "fp32", 3) == mid


def test_a_profile_of_another_model_is_refused(tmp_path):
    case = _case()
    prof = profile_blocks(case.model, "1x1xcpu", case.example_inputs, case.example_target, case.loss_fn,
                          microbatch_sizes=[4], repeats=1)
    other = models.gpt(**{**GPT, "layers": 2}, seed=0)
    path = prof.save(tmp_path / "prof.json")
    with pytest.raises(PlanError, match="measured on another model"):
        autopar.estimate(other.model, "1x1xcpu", autopar.Strategy(), other.example_inputs, other.example_target,
                         other.loss_fn, precision="fp32", profile=path)
    (tmp_path / "bad.json").write_text(json.dumps({"version": 99}))
    with pytest.raises(PlanError, match="version-1"):
        BlockProfile.load(tmp_path / "bad.json")
    with pytest.raises(PlanError, match="BlockProfile"):
        autopar.estimate(case.model, "1x1xcpu", autopar.Strategy(), case.example_inputs, case.example_target,
                         case.loss_fn, precision="fp32", profile=42)


def test_amp_known_cost_tables_are_read_per_type_degree_and_layer(tmp_path):
    path = tmp_path / "amp.csv"
    path.write_text("spec_idx,spec_name,fwd_s_P3_1,fwd_s_P3_2,fwd_s_G4_1\n"
                    "0,embed,0.001,0.002,0.003\n1,transpose,0.0001,0.0002,0.0003\n2,block0,0.01,0.006,0.02\n")
    prof = BlockProfile.from_amp_csv(path, {"P3": "V100-16GB", "G4": "T4"}, layers=[[0, 1], [2]])
    emb = prof.times("V100-16GB", 0, 1, "fp16", 4)
    assert emb.fwd_s == pytest.approx(4 * 0.0011) and emb.bwd_s == pytest.approx(2 * 4 * 0.0011)
    assert prof.times("V100-16GB", 1, 2, "fp16", 1).fwd_s == pytest.approx(0.006)
    assert prof.times("T4", 1, 1, "fp16", 2).fwd_s == pytest.approx(0.04)
    assert prof.times("T4", 1, 2, "fp16", 2) is None
    with pytest.raises(PlanError, match="none of its device types"):
        BlockProfile.from_amp_csv(path, {"X": "A100-40GB"}, layers=[[0]])


def test_measured_layers_are_priced_from_the_profile_host_time_included():
    """Every layer measured: a stage's forward is the measured forwards plus the micro-batch's setup (no host
    terms per layer, no floor); its backward likewise; explain() names the profile for each stage."""
    case = _case()
    cm = autopar.api.cost_model(case.model, "1x2xcpu", case.example_inputs, case.example_target, case.loss_fn,
                                precision="fp32")
    L = len(cm.graph.layers)
    fwd = {i: 0.001 * (i + 1) for i in range(L)}
    prof = BlockProfile([{"kind": layer.kind, "signature": str(layer.signature)} for layer in cm.graph.layers],
                        [Entry("cpu", i, 1, "fp32", [Point(2, fwd[i], 2 * fwd[i])], "synthetic") for i in range(L)],
                        name="synthetic.json")
    cm2 = autopar.api.cost_model(case.model, "1x2xcpu", case.example_inputs, case.example_target, case.loss_fn,
                                 precision="fp32", profile=prof)
    base = cm2.base(0, L, "cpu", 2, (0,))
    host = cm2.models["cpu"].host
    assert base.fwd == pytest.approx(sum(fwd.values()) + host.microbatch_s, rel=1e-9)
    assert base.bwd == pytest.approx(2 * sum(fwd.values()) + host.microbatch_s, rel=1e-9)
    assert cm.base(0, L, "cpu", 2, (0,)).fwd != pytest.approx(base.fwd)
    strategy = autopar.Strategy(pp=2, microbatch_size=2, layer_split=[2, 1])
    est = autopar.estimate(case.model, "1x2xcpu", strategy, case.example_inputs, case.example_target, case.loss_fn,
                           precision="fp32", profile=prof)
    text = est.plan.explain()
    assert "compute of pipeline 0 stage 0:" in text and "synthetic.json: synthetic, measured at micro-batch 2" in text
    assert "compute of pipeline 0 stage 1:" in text


def test_profile_times_every_distinct_layer_on_this_cpu():
    """The blocks share one measurement (one signature); embedding and head are their own; every size asked
    for is timed; a GPU type this machine lacks is named, not measured."""
    case = _case()
    prof = profile_blocks(case.model, "1x1xcpu+1x1xT4", case.example_inputs, case.example_target, case.loss_fn,
                          microbatch_sizes=[1, 4], repeats=2)
    layers = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target).layers
    assert {e.layer for e in prof.entries} == set(range(len(layers)))
    assert prof.device_types() == ["cpu"] and "T4" in prof.meta["not_profiled"]
    blocks = [e for e in prof.entries if layers[e.layer].kind == "block"]
    assert len(blocks) == 3 and all(e.points == blocks[0].points for e in blocks)
    for e in prof.entries:
        assert [p.n for p in e.points] == [1, 4]
        assert all(p.fwd_s > 0 and p.bwd_s > 0 and p.recompute_s > 0 and p.peak_bytes > 0 for p in e.points)
    big = max(blocks[0].points, key=lambda p: p.n)
    assert big.peak_bytes > min(blocks[0].points, key=lambda p: p.n).peak_bytes  # more samples, more memory
    with pytest.raises(PlanError, match="none of the cluster's device types is on this machine"):
        profile_blocks(case.model, "1x2xT4", case.example_inputs, case.example_target, case.loss_fn)


def test_cli_profile_then_plan_with_it(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["profile", "autopar.models:mlp", "--cluster", "1x2xcpu", "--out", str(out),
                 "--microbatch-sizes", "2,4", "--budget", "30"]) in (0, None)
    assert out.is_file() and BlockProfile.load(out).entries
    assert main(["plan", "autopar.models:mlp", "--cluster", "1x2xcpu", "--profile", str(out),
                 "--time-limit", "30"]) in (0, None)
    text = capsys.readouterr().out
    # the plan it picks runs tp 2 on both CPUs, which one device per type cannot measure: explain says so
    assert ("p.json: measured by autopar profile on cpu" in text
            or "analytic: p.json has no layer on cpu at tensor-parallel degree 2 (measured: cpu tp 1)" in text), text


def test_a_measured_optimizer_step_replaces_the_analytic_update():
    """Where every layer's step was measured, a stage's sync is the measured steps (its ZeRO share of them) plus the
    step's fixed host work; the profiler steps a tied embedding with its first layer only."""
    case = _case()
    cm = autopar.api.cost_model(case.model, "1x2xcpu", case.example_inputs, case.example_target, case.loss_fn,
                                precision="fp32")
    L = len(cm.graph.layers)
    layers = [{"kind": layer.kind, "signature": str(layer.signature)} for layer in cm.graph.layers]
    pts = [Point(2, 1e-3, 2e-3)]
    prof = BlockProfile(layers, [Entry("cpu", i, 1, "fp32", pts, "synthetic", 0.01 * (i + 1), "adamw")
                                 for i in range(L)], name="s.json")
    cm2 = autopar.api.cost_model(case.model, "1x2xcpu", case.example_inputs, case.example_target, case.loss_fn,
                                 precision="fp32", profile=prof)
    host = cm2.models["cpu"].host
    steps = sum(0.01 * (i + 1) for i in range(L))
    base = cm2.base(0, L, "cpu", 2, (0,))
    assert cm2.stage_times(base, Option(), "cpu", (0,), (0,)).sync == pytest.approx(steps + host.step_s, rel=1e-9)
    z1 = cm2.stage_times(base, Option(zero=1), "cpu", (0,), (0, 1))
    z1_analytic = cm2.stage_times(base, Option(), "cpu", (0,), (0, 1))
    assert z1.sync < z1_analytic.sync  # each replica steps half of the parameters
    other = BlockProfile(layers, [Entry("cpu", i, 1, "fp32", [Point(2, 1e-3, 2e-3)], "synthetic", 0.01, "sgd")
                                  for i in range(L)])
    cm3 = autopar.api.cost_model(case.model, "1x2xcpu", case.example_inputs, case.example_target, case.loss_fn,
                                 precision="fp32", profile=other)
    assert cm3.stage_times(cm3.base(0, L, "cpu", 2, (0,)), Option(), "cpu", (0,), (0,)).sync != pytest.approx(
        steps + host.step_s)  # another optimizer's step is not this one's: analytic
    tied = models.CASES["hf_gpt2"](batch=2, seq=8, vocab=64, hidden=32, layers=2, heads=2, seed=0)
    measured = profile_blocks(tied.model, "1x1xcpu", tied.example_inputs, tied.example_target, tied.loss_fn,
                              microbatch_sizes=[2], repeats=2)
    assert all(e.step_s > 0 and e.optimizer == "adamw" for e in measured.entries if e.step_params)
    # every parameter stepped exactly once: the head's tied weight with the embedding
    assert sum(e.step_params or 0 for e in measured.entries) == sum(p.numel() for p in tied.model.parameters())


def test_compile_plans_with_the_profile():
    case = _case()
    prof = profile_blocks(case.model, "1x1xcpu", case.example_inputs, case.example_target, case.loss_fn,
                          microbatch_sizes=[4], repeats=1)
    prog = autopar.compile(case.model, "1x1xcpu", case.example_inputs, case.example_target, case.loss_fn,
                           precision="fp32", profile=prof, timeout_s=60)
    assert "compute of pipeline 0 stage 0:" in prog.plan.explain() and "autopar profile" in prog.plan.explain()
    assert prog.step(*case.example_inputs, target=case.example_target) > 0


def test_bad_profiling_requests_are_named():
    case = _case()
    args = (case.model, "1x1xcpu", case.example_inputs, case.example_target, case.loss_fn)
    with pytest.raises(PlanError, match=r"microbatch_sizes \[0, 9\] are not between 1 and the batch's 4"):
        profile_blocks(*args, microbatch_sizes=[0, 2, 9])
    with pytest.raises(PlanError, match="budget_s must be positive"):
        profile_blocks(*args, budget_s=0)
    with pytest.raises(PlanError, match="fp32 programs only"):
        profile_blocks(*args, precision="bf16")


def test_the_chain_times_each_layer_on_the_values_and_gradients_of_a_step():
    """`autopar profile` times the layers chained, as a pipeline of one-layer stages runs them: one pass gives
    every parameter the gradient of the model's own loss (the layers received the real values and gradients,
    not stand-ins), and the recompute runs each layer again on what it received."""
    import torch

    from autopar.codegen.split import split_stages
    from autopar.runtime.block_profiler import _chain_pass, _Runner, _weights

    case = models.CASES["hf_gpt2"](batch=4, seq=8, vocab=64, hidden=32, layers=3, heads=2, seed=0)  # tied head
    n = 2
    user = (*(x[:n] for x in case.example_inputs), case.example_target[:n])
    g = autopar.capture(case.model, user[:-1], case.loss_fn, user[-1])
    runs = [_Runner(st, g, _weights(case.model), user, torch.device("cpu"))
            for st in split_stages(g, [(i, i + 1) for i in range(len(g.layers))])]
    fwd, bwd, rc = _chain_pass(runs)
    assert len(fwd) == len(bwd) == len(rc) == len(runs) and min(fwd + bwd + rc) > 0
    got: dict[str, torch.Tensor] = {}
    for run in runs:
        for name, t in run.params.items():
            got[name] = got[name] + t.grad if name in got else t.grad
    models.loss_of(case, *user[:-1], target=user[-1]).backward()
    want = {k: p.grad for k, p in case.model.named_parameters()}  # a tied weight once, as the programs name it
    assert got.keys() == want.keys()
    for name, v in want.items():
        torch.testing.assert_close(got[name], v, rtol=1e-5, atol=1e-6, msg=name)
