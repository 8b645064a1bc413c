"""Rough edges of issue 13: estimates that do not fit say so first, nonsense numbers are refused where they
enter, `compile` trains a hand-written Strategy, and `autopar run` takes its options after the script."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import autopar
from autopar import cli, models
from autopar.errors import AutoparError, PlanError
from autopar.ir.plan import Strategy
from autopar.runtime.launch import spawn_local

from .runtime_cases import STEPS, assert_matches_reference, build, optimizer, reference

REPO = Path(__file__).resolve().parents[1]


# ---- item 4: an estimate that does not fit says so in `predicted` and first in explain() -----------------


@functools.cache
def _gpt3_dp8() -> autopar.Estimate:
    c = models.gpt(device="meta", batch=8, **models.gpt_config("gpt3-175b"))
    return autopar.estimate(c.model, "1x8xA100-80GB", Strategy(dp=8), c.example_inputs, c.example_target,
                            c.loss_fn)


def test_item4_estimate_that_does_not_fit_says_so_in_predicted() -> None:
    est = _gpt3_dp8()
    assert est.predicted["fits"] is False and est.fits is False
    problems = est.predicted["memory_problems"]
    assert len(problems) == 8 and problems == est.memory_problems
    # 175 B parameters with AdamW state cannot sit on one 80 GB device
    assert all(f"device {d} (A100-80GB" in p and "usable of 80.00GiB" in p for d, p in enumerate(problems))


def test_item4_explain_says_does_not_fit_first() -> None:
    text = _gpt3_dp8().explain()
    first = text.splitlines()[:2]
    assert "DOES NOT FIT" in first[0], text
    assert "device 0 (A100-80GB" in "\n".join(first)
    predicted_line = next(i for i, line in enumerate(text.splitlines()) if line.startswith("predicted"))
    assert predicted_line > 0 and "DOES NOT FIT" not in "\n".join(text.splitlines()[predicted_line:])


def test_item4_fitting_estimate_has_fits_true_and_no_warning_line() -> None:
    c = models.gpt(device="meta", batch=8, layers=2)
    est = autopar.estimate(c.model, "1x2xA100-80GB", Strategy(dp=2), c.example_inputs, c.example_target,
                           c.loss_fn)
    assert est.predicted["fits"] is True and est.predicted["memory_problems"] == []
    assert "DOES NOT FIT" not in est.explain()


def test_item4_no_pipeline_bubble_without_a_pipeline() -> None:
    """pp=1: the idle time after the backward is the gradient sync that nothing overlaps, not a bubble."""
    est = _gpt3_dp8()
    pr = est.predicted
    stage = est.plan.pipelines[0].stages[0].predicted
    assert pr["bubble_fraction"] == pytest.approx(0.0, abs=1e-12)
    assert stage["bubble_s"] == pytest.approx(0.0, abs=1e-12 * pr["step_time_s"])
    # one micro-batch: the step is fwd + bwd, then the gradient all-reduce and optimizer step (sync_s)
    assert pr["step_time_s"] == pytest.approx(stage["fwd_s"] + stage["bwd_s"] + stage["sync_s"], rel=1e-12)
    assert pr["exposed_sync_fraction"] == pytest.approx(stage["sync_s"] / pr["step_time_s"], rel=1e-12)
    headline = next(line for line in est.explain().splitlines() if line.startswith("predicted"))
    assert "pipeline bubble 0.0%" in headline
    assert f"gradient sync not overlapped {100 * stage['sync_s'] / pr['step_time_s']:.1f}%" in headline


def test_item4_pipeline_bubble_is_the_pipelines_idle_compute_time() -> None:
    """GPipe on 2 equal stages: each device idles (p - 1) micro-batch slots of fwd and bwd."""
    c = models.gpt(device="meta", batch=8, layers=2)
    est = autopar.estimate(c.model, "1x2xA100-80GB", Strategy(pp=2, schedule="gpipe", microbatch_size=1),
                           c.example_inputs, c.example_target, c.loss_fn)
    s0, s1 = (st.predicted for st in est.plan.pipelines[0].stages)
    assert s0["bubble_s"] > 0 and s1["bubble_s"] > 0
    total_idle = 2 * est.predicted["step_time_s"] - sum(
        8 * (s["fwd_s"] + s["bwd_s"]) for s in (s0, s1))  # step - busy, summed over both devices
    split = est.predicted["bubble_fraction"] + est.predicted["exposed_sync_fraction"]
    assert 2 * split * est.predicted["step_time_s"] == pytest.approx(total_idle, rel=1e-9)


# ---- item 6: nonsense limits, counts and sizes are refused where they enter ------------------------------


def _mlp() -> models.ModelCase:
    return models.mlp(batch=8)


@pytest.mark.parametrize("kwargs, names", [
    ({"time_limit_s": -5}, ["time_limit_s", "-5", "> 0"]),
    ({"time_limit_s": 0}, ["time_limit_s", "> 0"]),
    ({"time_limit_s": float("nan")}, ["time_limit_s", "nan"]),
    ({"memory_reserve": 1.0}, ["memory_reserve", "1.0", "[0, 1)"]),
    ({"memory_reserve": -0.1}, ["memory_reserve", "-0.1", "[0, 1)"]),
])
def test_item6_plan_refuses_nonsense_limits(kwargs: dict, names: list[str]) -> None:
    c = _mlp()
    with pytest.raises(PlanError) as e:
        autopar.plan(c.model, "1x2xA100-80GB", c.example_inputs, c.example_target, c.loss_fn, **kwargs)
    assert all(n in str(e.value) for n in names), str(e.value)


def test_item6_estimate_and_cost_model_refuse_a_bad_memory_reserve() -> None:
    c = _mlp()
    args = (c.model, "1x2xA100-80GB")
    kw = dict(example_inputs=c.example_inputs, example_target=c.example_target, loss_fn=c.loss_fn)
    with pytest.raises(PlanError, match=r"memory_reserve must be a number in \[0, 1\).*got 2"):
        autopar.estimate(*args, Strategy(dp=2), memory_reserve=2, **kw)
    with pytest.raises(PlanError, match=r"memory_reserve .* got 1"):
        autopar.api.cost_model(*args, memory_reserve=1, **kw)
    with pytest.raises(PlanError, match=r"strategy must be an autopar.Strategy"):
        autopar.estimate(*args, {"dp": 2}, **kw)


@functools.cache
def _gpt_cost_model() -> object:
    c = models.gpt(device="meta", batch=8, layers=2)
    return autopar.api.cost_model(c.model, "1x2xA100-80GB", c.example_inputs, c.example_target, c.loss_fn)


@pytest.mark.parametrize("fields, expect", [
    ({"dp": 2, "microbatch_size": 0}, "Strategy.microbatch_size must be an integer >= 1 or None, got 0"),
    ({"dp": 2, "microbatch_size": -2}, "Strategy.microbatch_size must be an integer >= 1 or None, got -2"),
    ({"pp": 2, "schedule": "interleaved_1f1b", "chunks": 0}, "Strategy.chunks must be an integer >= 1 or None"),
    ({"dp": 2, "ep": 0}, "Strategy.ep must be an integer >= 1, got 0"),
    ({"dp": 2, "tp": 1.0}, "Strategy.tp must be an integer >= 1, got 1.0"),
    ({"dp": 2, "zero": 1.5}, "Strategy.zero must be an integer, got 1.5"),
    ({"pp": 2, "layer_split": [1.5, 0.5]}, "Strategy.layer_split[0] must be an integer, got 1.5"),
    ({"dp": 2, "batch_split": 8}, "Strategy.batch_split must be a list of integers or None, got 8"),
])
def test_item6_strategy_refuses_nonsense_counts(fields: dict, expect: str) -> None:
    from autopar.solver.pricing.pricing import price_strategy

    with pytest.raises(PlanError) as e:
        price_strategy(_gpt_cost_model(), Strategy(**fields))  # what autopar.estimate and compile run
    assert expect in str(e.value)


def test_item6_compile_refuses_nonsense_limits() -> None:
    c = _mlp()
    for kw, name in (({"time_limit_s": -5}, "time_limit_s"), ({"timeout_s": 0}, "timeout_s")):
        with pytest.raises(PlanError, match=f"{name} must be a number > 0"):
            autopar.compile(c.model, "1x1xcpu", c.example_inputs, c.example_target, c.loss_fn, **kw)


def test_compile_refuses_a_plan_of_another_kind_before_capturing(monkeypatch: pytest.MonkeyPatch) -> None:
    c = _mlp()
    exports = []
    real = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exports.append(a) or real(*a, **k))
    with pytest.raises(PlanError, match="plan must be None .autopar plans., an autopar.Strategy, a Plan or its JSON; "
                                        "got int"):
        autopar.compile(c.model, "1x1xcpu", c.example_inputs, c.example_target, c.loss_fn, plan=42)
    assert exports == []


@pytest.mark.parametrize("argv, option", [
    (["plan", "autopar.models:mlp", "--cluster", "1x1xcpu", "--time-limit", "-5"], "--time-limit"),
    (["plan", "autopar.models:mlp", "--cluster", "1x1xcpu", "--memory-reserve", "1.5"], "--memory-reserve"),
    (["analyze", "autopar.models:mlp", "--cluster", "1x1xcpu", "--max-rows", "0"], "--max-rows"),
    (["run", "--cluster", "1x2xcpu", "--nproc", "0", "t.py"], "--nproc"),
    (["run", "--cluster", "1x2xcpu", "--max-restarts", "-1", "t.py"], "--max-restarts"),
    (["run", "t.py", "--cluster", "1x2xcpu", "--node-rank", "-1"], "--node-rank"),
    (["demo", "--steps", "0"], "--steps"),
])
def test_item6_cli_refuses_nonsense_numbers(capsys, argv: list[str], option: str) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: must be" in err and argv[argv.index(option) + 1] in err, err


def test_item6_run_refuses_a_node_rank_beyond_the_cluster() -> None:
    from autopar.runtime.run import run

    with pytest.raises(PlanError, match=r"node_rank must be an integer in \[0, 1\] or None, got 2 \(the cluster"):
        run(["t.py"], "2x8xA100-80GB", node_rank=2, dry_run=True)


# ---- item 7: compile trains a hand-written Strategy, exactly that one ------------------------------------


GPT = ("gpt", {"layers": 2, "batch": 4})
TINY = {"nodes": [{"device": {"name": "speck", "based_on": "cpu", "memory_GiB": 0.00001},
                   "devices_per_node": 2}]}
STRATEGY_CASES = [  # (cluster, strategy)
    ("1x2xcpu", Strategy(dp=2)),
    ("1x2xcpu", Strategy(pp=2, microbatch_size=1)),
    (TINY, Strategy(dp=2, zero=1)),  # does not fit the 10 KB device: trained anyway, with a warning
]


def _layout(prog: object) -> list[tuple]:
    return [(p.batch_offset, p.batch_size, p.num_microbatches, p.schedule,
             [(s.layers, s.ranks, s.zero, s.recompute) for s in p.stages]) for p in prog.layout.pipelines]


def run_strategies(rank: int, world: int) -> list[tuple]:
    out = []
    for cluster, strategy in STRATEGY_CASES:
        case = build(*GPT[:1], **GPT[1])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prog = autopar.compile(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn,
                                   optimizer, plan=strategy, timeout_s=60)
        losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(STEPS)]
        held = sorted(prog.params)
        out.append((losses, prog.state_dict()["model"], _layout(prog), held,
                    [str(w.message) for w in caught if "does not fit" in str(w.message)]))
    try:  # an inconsistent strategy: a clear error on every rank, no hang
        case = build(*GPT[:1], **GPT[1])
        autopar.compile(case.model, "1x2xcpu", case.example_inputs, case.example_target, case.loss_fn,
                        optimizer, plan=Strategy(dp=3), timeout_s=60)
        out.append("no error")
    except AutoparError as e:
        out.append(f"{type(e).__name__}: {e}")
    return out


@pytest.fixture(scope="module")
def strategy_results() -> list:
    return spawn_local(run_strategies, 2, timeout_s=240)


@pytest.fixture(scope="module")
def strategy_reference() -> tuple:
    return reference(GPT[0], GPT[1])


def test_item7_compile_trains_strategy_dp2(strategy_results: list, strategy_reference: tuple) -> None:
    ref_losses, ref_params = strategy_reference
    for rank, res in enumerate(strategy_results):
        losses, params, layout, held, _ = res[0]
        assert_matches_reference(losses, params, ref_losses, ref_params, f"Strategy(dp=2) rank {rank}")
        # two replicas of the whole model (4 layers), two samples each
        assert layout == [(0, 2, 1, "1f1b", [((0, 4), (0,), 0, False)]),
                          (2, 2, 1, "1f1b", [((0, 4), (1,), 0, False)])]


def test_item7_compile_trains_strategy_pp2(strategy_results: list, strategy_reference: tuple) -> None:
    ref_losses, ref_params = strategy_reference
    for rank, res in enumerate(strategy_results):
        losses, params, layout, held, _ = res[1]
        assert_matches_reference(losses, params, ref_losses, ref_params, f"Strategy(pp=2) rank {rank}")
        # one pipeline: embedding + block 0 on rank 0, block 1 + head on rank 1, 4 micro-batches of 1
        assert layout == [(0, 4, 4, "1f1b", [((0, 2), (0,), 0, False), ((2, 4), (1,), 0, False)])]
    rank0, rank1 = strategy_results[0][1][3], strategy_results[1][1][3]
    assert any(n.startswith("blocks.0.") for n in rank0) and not any(n.startswith("blocks.1.") for n in rank0)
    assert any(n.startswith("blocks.1.") for n in rank1) and not any(n.startswith("blocks.0.") for n in rank1)


def test_item7_strategy_that_does_not_fit_trains_with_a_warning(strategy_results: list,
                                                                strategy_reference: tuple) -> None:
    ref_losses, ref_params = strategy_reference
    for rank, res in enumerate(strategy_results):
        losses, params, layout, _, warned = res[2]
        assert_matches_reference(losses, params, ref_losses, ref_params, f"Strategy(dp=2, zero=1) rank {rank}")
        assert [p[4][0][2] for p in layout] == [1, 1]  # ZeRO-1 as asked
        if rank == 0:
            assert len(warned) == 1 and "device 0 (speck" in warned[0] and "trains it anyway" in warned[0]


def test_item7_inconsistent_strategy_is_a_clear_error_on_every_rank(strategy_results: list) -> None:
    for res in strategy_results:
        assert res[3].startswith("PlanError: dp * tp * cp * pp = 3 * 1 * 1 * 1 = 3, but the cluster has 2"), res[3]


# ---- item 8: `autopar run train.py --cluster c.yaml` ----------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["run", "--cluster", "c.yaml", "train.py", "--lr", "0.1"],
    ["run", "train.py", "--cluster", "c.yaml", "--lr", "0.1"],
    ["run", "train.py", "--lr", "0.1", "--cluster=c.yaml"],
    ["run", "--cluster", "c.yaml", "--", "train.py", "--lr", "0.1"],
])
def test_item8_run_options_before_or_after_the_script(argv: list[str]) -> None:
    args = cli.parse_args(argv)
    assert args.cluster == "c.yaml" and args.script == ["train.py", "--lr", "0.1"]


def test_item8_run_passes_the_rest_to_the_script() -> None:
    args = cli.parse_args(["run", "train.py", "--nproc", "2", "--steps", "3", "-h", "--cluster", "c.yaml", "--",
                           "--cluster", "x"])
    assert (args.cluster, args.nproc) == ("c.yaml", 2)
    assert args.script == ["train.py", "--steps", "3", "-h", "--cluster", "x"]
    args = cli.parse_args(["run", "-m", "pkg.train", "--cluster", "c.yaml", "--dry-run", "--epochs", "2"])
    assert (args.cluster, args.dry_run) == ("c.yaml", True)
    assert args.script == ["-m", "pkg.train", "--epochs", "2"]


def test_item8_run_option_given_twice_is_a_clear_error(capsys) -> None:
    assert cli.main(["run", "--cluster", "a", "train.py", "--cluster", "b"]) == 2
    err = capsys.readouterr().err
    assert "--cluster is given twice" in err and "after `--`" in err


def test_item8_run_without_cluster_is_a_clear_error(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "train.py", "--lr", "0.1"])
    assert e.value.code == 2 and "the following arguments are required: --cluster" in capsys.readouterr().err


def test_item8_run_dry_run_prints_the_script_arguments(capsys) -> None:
    assert cli.main(["run", "train.py", "--cluster", "1x2xcpu", "--nproc", "2", "--dry-run", "--lr", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "2 worker processes" in out and "train.py --lr 0.1 " in out  # one process per device, args kept
    assert cli.main(["run", "train.py", "--cluster", "1x2xcpu", "--nproc", "2", "--max-restarts", "1", "--dry-run",
                     "--lr", "0.1"]) == 0  # with restarts: torchrun's elastic agent
    cmd = capsys.readouterr().out.strip().split()
    assert "--nproc-per-node=2" in cmd and cmd[-3:] == ["train.py", "--lr", "0.1"]


def test_item8_run_script_first_launches_processes(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} argv {sys.argv[1:]} "
              f"cluster {os.environ['AUTOPAR_CLUSTER']}", flush=True)
    """))
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "autopar.cli", "run", str(script), "--cluster", "1x2xcpu",
                          "--lr", "0.1"], capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    for r in range(2):
        assert f"rank {r} of 2 argv ['--lr', '0.1'] cluster 1x2xcpu" in out.stdout, out.stdout
