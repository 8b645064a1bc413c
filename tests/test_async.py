"""Asynchronous training (runtime/asynchronous.py): delayed updates on gloo ranks equal a single-process
replay of the stated rule W[c+1] = W[c] - opt(grad L_c(W[max(0, c-D)])), losses and parameters."""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

import pytest
import torch

import autopar
from autopar import models
from autopar.errors import PlanError
from autopar.runtime.asynchronous import AsyncProgram, AsyncUpdateWarning
from autopar.runtime.launch import spawn_local
from autopar.runtime.straggler import SLOWDOWN_ENV
from autopar.solver.asynchronous import delay_of, plan_problems, predicted_wave
from tests.runtime_cases import assert_matches_reference, build, optimizer, plan_for

WAVES = 6  # more than D + 1 for every delay below, so late updates and the bound are exercised


def delayed_reference(case: models.ModelCase, delay: int, steps: int = WAVES
                      ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the rule written out: wave c's loss and gradient are taken on the stored version
    W[max(0, c - delay)] (a second copy of the model loaded with it), and the gradient is applied to the
    newest version W[c] by the optimizer, which holds the newest parameters."""
    model = case.model
    opt = optimizer(list(model.parameters()))
    shadow = dataclasses.replace(case, model=copy.deepcopy(model))
    history = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    losses = []
    for c in range(steps):
        version = history[max(0, c - delay)]
        with torch.no_grad():
            for n, p in shadow.model.named_parameters():
                p.copy_(version[n])
        shadow.model.zero_grad(set_to_none=True)
        loss = models.loss_of(shadow)
        loss.backward()
        losses.append(loss.item())
        stale = dict(shadow.model.named_parameters())
        for n, p in model.named_parameters():
            p.grad = None if stale[n].grad is None else stale[n].grad.clone()
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_reference_without_delay_is_synchronous_training() -> None:
    """The replay itself: delay 0 is plain training (models.train_reference), a delay changes the losses."""
    sync = models.train_reference(build("gpt"), optimizer, WAVES)
    zero = delayed_reference(build("gpt"), 0)
    assert_matches_reference(zero[0], zero[1], sync[0], sync[1], "delay 0")
    late = delayed_reference(build("gpt"), 1)
    assert late[0][:2] == pytest.approx([sync[0][0]] * 2)  # waves 0 and 1 both on W[0]
    assert late[0][2] != pytest.approx(sync[0][2], rel=1e-4)


def test_modes_and_staleness_are_checked() -> None:
    assert delay_of("sync", None) == 0 and delay_of("2bw", None) == 1 and delay_of("wsp", None) == 1
    assert delay_of("wsp", 3) == 3
    for sync, staleness, words in [("async", None, "choose one of"), ("2bw", 2, "exactly one step"),
                                   ("wsp", 0, "staleness >= 1"), ("sync", 2, "no staleness"),
                                   ("wsp", 1.5, "whole number")]:
        with pytest.raises(PlanError, match=words):
            delay_of(sync, staleness)


# ---- gloo ranks ----------------------------------------------------------------------------------------

# (model, kwargs, plan spec for tests.runtime_cases.plan_for, sync, staleness, slowed rank or None)
CASES_2 = [
    ("gpt", {}, {"dp": 2, "m": 2, "batch_split": [3, 1]}, "wsp", 2, 1),  # replicas of 1 stage, uneven shares
    ("gpt", {}, {"pp": 2, "m": 2}, "2bw", None, None),  # a 2-stage pipeline, 1F1B
    ("mlp", {}, {"dp": 2, "m": 1}, "wsp", 1, 0),
]
REFUSED_2 = [({"dp": 2, "m": 1, "zero": 2}, "ZeRO level 2"), ({"dp": 2, "offload": ["optimizer"]}, "CPU offload")]


def _compile(name: str, kwargs: dict, spec: dict, sync: str, staleness: int | None, rank: int, world: int
             ) -> tuple[models.ModelCase, AsyncProgram]:
    case = build(name, **kwargs)
    g = autopar.capture(case.model, case.example_inputs, case.loss_fn, case.example_target)
    prog = AsyncProgram(case.model, plan_for(g, world, spec), case.example_inputs, case.example_target,
                        case.loss_fn, optimizer, rank, world, timeout_s=60, graph=g, sync=sync, staleness=staleness)
    return case, prog


def run_async_cases(rank: int, world: int, cases: list, refused: list) -> list:
    out = []
    for name, kwargs, spec, sync, staleness, slow in cases:
        os.environ[SLOWDOWN_ENV] = f"{slow}:3" if slow is not None else ""  # read when the program is built
        case, prog = _compile(name, kwargs, spec, sync, staleness, rank, world)
        local = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(WAVES)]
        in_flight = prog.in_flight
        sd = prog.state_dict()["model"]  # flushes: every update applied
        out.append(([prog.losses[c] for c in range(WAVES)], sd, in_flight, local))
    os.environ[SLOWDOWN_ENV] = ""
    errors = []
    for spec, _ in refused:
        try:
            _compile("gpt", {}, spec, "wsp", 1, rank, world)
            errors.append(None)
        except PlanError as e:
            errors.append(str(e))
    return [out, errors]


@pytest.fixture(scope="module")
def results_2() -> list:
    return spawn_local(run_async_cases, 2, CASES_2, REFUSED_2, timeout_s=240)


@pytest.mark.parametrize("index", range(len(CASES_2)))
def test_delayed_updates_match_the_replayed_rule(results_2: list, index: int) -> None:
    name, kwargs, spec, sync, staleness, _ = CASES_2[index]
    delay = delay_of(sync, staleness)
    ref_losses, ref_params = delayed_reference(build(name, **kwargs), delay)
    sync_losses, _ = models.train_reference(build(name, **kwargs), optimizer, WAVES)
    assert ref_losses != pytest.approx(sync_losses, rel=1e-4)  # the delay matters in this case
    for rank, (out, _) in enumerate(results_2):
        losses, params, in_flight, _ = out[index]
        assert in_flight == delay + 1, "after a wave, D + 1 waves' updates are pending (the bound)"
        assert_matches_reference(losses, params, ref_losses, ref_params, f"{name} {spec} {sync} rank {rank}")


@pytest.mark.parametrize("index", range(len(CASES_2)))
def test_step_returns_the_global_loss_on_every_rank(results_2: list, index: int) -> None:
    """As `Program.step`: the wave's global mean loss on every rank, pipeline stages without the loss
    included (case 1's stage 0), replicas with uneven shares too (case 0); the replay's loss of that wave."""
    name, kwargs, _, sync, staleness, _ = CASES_2[index]
    ref_losses, _ = delayed_reference(build(name, **kwargs), delay_of(sync, staleness))
    for rank, (out, _) in enumerate(results_2):
        losses, _, _, returned = out[index]
        assert returned == pytest.approx(ref_losses, rel=1e-4), f"rank {rank}"
        assert returned == losses, "step() returns what `losses` records"


@pytest.mark.parametrize("index", range(len(REFUSED_2)))
def test_unsupported_layouts_are_refused(results_2: list, index: int) -> None:
    for _, errors in results_2:
        assert errors[index] is not None and REFUSED_2[index][1] in errors[index]
        assert "ZeRO 0 or 1" in errors[index] and "sync='sync'" in errors[index]


def test_fp16_is_refused_naming_bf16() -> None:
    """fp16's loss scale is not tracked per wave: refused, saying why and what to use instead."""
    from tests.runtime_cases import chain

    plan = plan_for(chain(4, 2), 2, {"dp": 2})
    plan.precision = "fp16"
    (problem,) = plan_problems(plan)
    assert problem.startswith("fp16 loss scaling") and "precision='bf16'" in problem


# ---- one process: compile keywords, warning, planner hook ----------------------------------------------


def test_compile_warns_and_trains_the_rule_in_one_process() -> None:
    case = build("gpt")
    with pytest.warns(AsyncUpdateWarning, match=r"sync='wsp'.*staleness D=2.*W\[c\+1\] = W\[c\] - opt"):
        prog = autopar.compile(case.model, "1x1xcpu", case.example_inputs, case.example_target, case.loss_fn,
                               optimizer, plan=autopar.Strategy(dp=1, pp=1), sync="wsp", staleness=2)
    assert isinstance(prog, AsyncProgram)
    local = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(WAVES)]
    params = prog.state_dict()["model"]
    ref_losses, ref_params = delayed_reference(build("gpt"), 2)
    assert_matches_reference(local, params, ref_losses, ref_params, "one process")
    assert [prog.losses[c] for c in range(WAVES)] == pytest.approx(ref_losses, rel=1e-4)


def test_compile_refuses_bad_modes_before_planning() -> None:
    case = build("mlp")
    with pytest.raises(PlanError, match="choose one of"):
        autopar.compile(case.model, "1x1xcpu", case.example_inputs, case.example_target, case.loss_fn,
                        sync="hogwild")
    with pytest.raises(PlanError, match="adapt"):
        autopar.compile(case.model, "1x1xcpu", case.example_inputs, case.example_target, case.loss_fn,
                        sync="2bw", adapt=True)


def _one_pipeline_expectation(pr: dict[str, Any], delay: int) -> float:
    """With one pipeline every rank's idle tail is the same: the exposed gradient sync and optimizer step,
    `exposed_sync_fraction` of the step (the pricer's split); delayed, it hides under the next D waves."""
    step, tail = pr["step_time_s"], pr["exposed_sync_fraction"] * pr["step_time_s"]
    return max(step - tail, tail / delay)


def test_predicted_wave_hides_the_sync_tail() -> None:
    case = build("gpt")
    one = autopar.estimate(case.model, "1x1xcpu", autopar.Strategy(dp=1, pp=1), case.example_inputs,
                           case.example_target, case.loss_fn)
    for delay in (1, 2):
        assert predicted_wave(one.plan, delay) == pytest.approx(_one_pipeline_expectation(one.predicted, delay),
                                                                rel=1e-9)
    assert predicted_wave(one.plan, 0) == pytest.approx(one.predicted["step_time_s"], rel=1e-9)


def test_planner_chooses_asynchrony_only_when_allowed() -> None:
    """`plan(sync=...)`: the chosen plan runs under AsyncProgram (ZeRO 0, no offload) and the figures are the
    synchronous best's step against the chosen plan's predicted wave."""
    case = build("gpt")
    args = (case.model, "1x2xcpu", case.example_inputs, case.example_target, case.loss_fn)
    synchronous = autopar.plan(*args, time_limit_s=20)
    assert "async" not in synchronous.predicted
    planned = autopar.plan(*args, time_limit_s=20, sync="2bw")
    a = planned.predicted["async"]
    assert a["asked"] == "2bw" and a["sync_step_time_s"] == pytest.approx(synchronous.predicted["step_time_s"])
    if a["sync"] == "2bw":
        assert not plan_problems(planned) and a["staleness"] == 1
        assert a["step_time_s"] == pytest.approx(predicted_wave(planned, 1), rel=1e-9)
        assert a["step_time_s"] < a["sync_step_time_s"]
        # memory: the plan's peak is the asynchronous one, with one wave's gradients (4 bytes per parameter,
        # the stages tiling the model's) more than the synchronous figure on each device
        n_bytes = 4 * sum(p.numel() for p in case.model.parameters())
        tp1 = all(st.tp == 1 for p in planned.pipelines for st in p.stages)
        assert a["fits"] and (not tp1 or sum(a["pending_gradient_bytes"].values()) == n_bytes * len(planned.pipelines))
        for d, peak in planned.predicted["peak_memory_bytes"].items():
            assert peak == a["peak_memory_bytes"][str(d)]
            assert peak >= a["sync_peak_memory_bytes"][str(d)] + a["pending_gradient_bytes"][str(d)]
    else:
        assert a["reason"] and a["step_time_s"] == a["sync_step_time_s"]
    assert a["speedup"] == pytest.approx(a["sync_step_time_s"] / a["step_time_s"])
    assert "asynchrony" in planned.explain() and "asynchrony" not in synchronous.explain()
