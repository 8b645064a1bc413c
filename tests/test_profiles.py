"""`profiles=`: compute profiles handed to the planner as an argument (issue #23, part 3), never through an
environment variable. A re-plan around a straggler prices the slowed device with scaled profiles passed the
same way (solver/reshare.py `scaled_profiles`; runtime/straggler.py used to rewrite AUTOPAR_PROFILE_DIR)."""

from __future__ import annotations

import os
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

import autopar
from autopar import models
from autopar.cluster import Cluster
from autopar.cost_models.compute import ComputeModel
from autopar.errors import PlanError
from autopar.solver.reshare import scaled_cluster, scaled_profiles

SLOW = 4.0


def _stage_times(cluster: Cluster, profiles: dict | None) -> list[tuple[float, float]]:
    case = models.gpt(seed=0)
    half = case.example_inputs[0].shape[0] // 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = autopar.estimate(case.model, cluster, autopar.Strategy(dp=2, batch_split=[half, half]),
                               case.example_inputs, case.example_target, case.loss_fn, profiles=profiles)
    return [(p.stages[0].predicted["fwd_s"], p.stages[0].predicted["bwd_s"]) for p in est.plan.pipelines]


@pytest.mark.parametrize("base", ["1x2xcpu", "1x2xA100-80GB"])
def test_a_scaled_device_is_priced_exactly_that_much_slower(base: str) -> None:
    """Device 1 measured 4x slower: its own type, priced from the profiles passed to the planner, 4x slower at
    the same forward and backward; without them the new type would be priced from its kind's defaults."""
    cluster = Cluster.load(base)
    slowed = scaled_cluster(cluster, {1: SLOW})
    profiles = scaled_profiles(cluster, {1: SLOW})
    assert list(profiles) == [slowed.devices[1].spec.name]
    (fast_f, fast_b), (slow_f, slow_b) = _stage_times(slowed, profiles)
    assert slow_f == pytest.approx(SLOW * fast_f, rel=1e-9) and slow_b == pytest.approx(SLOW * fast_b, rel=1e-9)
    (_, _), (unscaled_f, _) = _stage_times(slowed, None)
    assert unscaled_f != pytest.approx(slow_f, rel=0.05)  # the argument is what priced it


def test_profiles_replace_the_saved_one_for_their_type() -> None:
    cluster = Cluster.load("1x2xcpu")
    base = ComputeModel(cluster.spec("cpu")).profile
    slower = replace(base, overhead_s=base.overhead_s * 1000)
    (plain, _), _ = _stage_times(cluster, None)
    (given, _), _ = _stage_times(cluster, {"cpu": slower})
    assert given > 10 * plain


def test_scaling_writes_no_file_and_no_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOPAR_PROFILE_DIR", str(tmp_path))
    before = dict(os.environ)
    cluster = Cluster.load("1x4xcpu")
    profiles = scaled_profiles(cluster, {1: 3.0, 2: 1.0})
    assert dict(os.environ) == before and list(tmp_path.iterdir()) == []
    (name,) = profiles
    assert profiles[name].meta["slowdown"] == 3.0 and profiles[name].meta["scaled_from"] == "cpu"
    # the user's own profile of a type is the base a re-plan scales
    mine = replace(ComputeModel(cluster.spec("cpu")).profile, overhead_s=1e-3)
    again = scaled_profiles(cluster, {1: 3.0}, {"cpu": mine})
    assert again["cpu"] is mine and again[name].overhead_s == pytest.approx(3e-3)


def test_bad_profiles_say_what_is_wrong() -> None:
    case = models.mlp(seed=0)
    args = (case.model, "1x2xcpu", case.example_inputs, case.example_target, case.loss_fn)
    profile = ComputeModel(Cluster.load("1x1xcpu").spec("cpu")).profile
    with pytest.raises(PlanError, match="'A100-80GB', which is not a device type of cluster"):
        autopar.plan(*args, profiles={"A100-80GB": profile})
    with pytest.raises(PlanError, match="must map device type names"):
        autopar.plan(*args, profiles=[profile])
    with pytest.raises(PlanError, match=r"profiles\['cpu'\] is a str, not a Profile"):
        autopar.estimate(case.model, "1x2xcpu", autopar.Strategy(dp=2), case.example_inputs, case.example_target,
                         case.loss_fn, profiles={"cpu": "cpu.json"})


def test_the_annotated_graph_is_timed_with_the_profiles_given() -> None:
    case = models.mlp(seed=0)
    cluster = Cluster.load("1x1xcpu")
    base = ComputeModel(cluster.spec("cpu")).profile
    slower = replace(base, overhead_s=base.overhead_s * 1000)
    args = (case.model, cluster, case.example_inputs, case.example_target, case.loss_fn)
    plain, given = autopar.analyze(*args), autopar.analyze(*args, profiles={"cpu": slower})
    total = lambda g: sum(n.time_fwd["cpu"] + n.time_bwd["cpu"] for n in g.nodes.values())  # noqa: E731
    assert total(given) > 10 * total(plain)


def test_a_profile_given_prices_as_the_same_profile_saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every compute model of the planner takes the profile given (annotate's, the cost model's and the
    intra-op ILP's, which prices a tensor-parallel block's shards with its own): pricing with `profiles=`
    equals pricing with the same profile saved where `autopar calibrate` saves it, to the last bit."""
    from autopar.api import cost_model
    from autopar.cost_models.compute import profile_path
    from autopar.solver.intra_op.pricing import tp_layer_cost

    case = models.gpt(seed=0)
    cluster = Cluster.load("1x2xcpu")
    base = ComputeModel(cluster.spec("cpu")).profile
    slower = replace(base, overhead_s=base.overhead_s * 50, meta={**base.meta, "dtype": "fp32"})
    costs = []
    for profiles in ({"cpu": slower}, None):
        if profiles is None:  # the same profile, saved
            monkeypatch.setenv("AUTOPAR_PROFILE_DIR", str(tmp_path))
            slower.save(profile_path("cpu"))
        cm = cost_model(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn,
                        precision="fp32", profiles=profiles)
        block = cm.is_block.index(True)
        costs.append(tp_layer_cost(cm, block, "cpu", cm.B // 2, (0, 1)))
    assert costs[0].ilp and costs[1].ilp
    assert costs[0] == costs[1]


def test_graph_workloads_are_planned_with_the_profiles_given() -> None:
    """A GNN goes to the graph planner (and a compile of it to compile_graph): the profiles reach its cost model."""
    case = models.gnn(seed=0)
    cluster = Cluster.load("1x2xcpu")
    base = ComputeModel(cluster.spec("cpu")).profile
    slower = replace(base, overhead_s=base.overhead_s * 1000)
    steps = []
    for profiles in (None, {"cpu": slower}):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = autopar.plan(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn,
                                profiles=profiles)
        assert plan.graph
        steps.append(plan.predicted["step_time_s"])
    assert steps[1] > 10 * steps[0]
