"""bench/peers.py gives autopar's plan a published row's measured time only where the plan runs that row's layout
(`layout_key`): same schedule, pipelines, stages' layers and tp, micro-batches, and device types per stage."""

from __future__ import annotations

from dataclasses import replace

import autopar
from autopar import Strategy, models

from . import bench_scripts

CLUSTER = "1x2xV100-16GB+1x2xT4"


def _est(case: models.ModelCase, strategy: Strategy) -> autopar.Estimate:
    return autopar.estimate(case.model, CLUSTER, strategy, case.example_inputs, case.example_target, case.loss_fn)


def test_layout_key_and_compare_give_the_measured_time_of_the_same_layout_only() -> None:
    peers = bench_scripts.load("peers")
    case = models.gpt(batch=4, layers=2, device="meta")
    a = _est(case, Strategy(dp=2, pp=2, microbatch_size=1)).plan
    twin = _est(case, Strategy(dp=2, pp=2, microbatch_size=1, zero=1)).plan  # options may differ
    other_mbs = _est(case, Strategy(dp=2, pp=2, microbatch_size=2)).plan
    other_split = _est(case, Strategy(dp=2, pp=2, microbatch_size=1, layer_split=[2, 0])).plan
    gpipe = _est(case, Strategy(dp=2, pp=2, microbatch_size=1, schedule="gpipe")).plan
    # the same layout with its stages' device types swapped (the first stage on the T4s)
    swapped = replace(a, pipelines=[replace(p, stages=[replace(s, devices=[d ^ 2 for d in s.devices])
                                                       for s in p.stages]) for p in a.pipelines])
    assert peers.layout_key(a) == peers.layout_key(twin)
    assert peers.layout_key(a) == peers.layout_key(autopar.Plan.from_json(a.to_json()))
    for plan in (other_mbs, other_split, gpipe, swapped):
        assert peers.layout_key(plan) != peers.layout_key(a)

    rows = [{"id": 0, "config": "a", "status": "ok", "measured_s": 2.0, "predicted_s": 1.0, "plan": a},
            {"id": 1, "config": "mbs2", "status": "ok", "measured_s": 1.5, "predicted_s": 1.2, "plan": other_mbs},
            {"id": 2, "config": "crashed", "status": "failed", "measured_s": None, "predicted_s": 0.9, "plan": gpipe}]
    got = peers.compare("g", rows, rows[0], {"autopar_s": 0.8, "_plan": twin}, "")
    assert (got["autopar_same_as"], got["autopar_measured_s"]) == ("0", 2.0)
    assert got["best"].startswith("1:") and got["meas_peer/best"] == 2.0 / 1.5
    assert got["pred_peer/autopar"] == 1.0 / 0.8 and got["pred_best/autopar"] == 1.2 / 0.8
    got = peers.compare("g", rows, rows[0], {"autopar_s": 0.8, "_plan": swapped}, "")
    assert (got["autopar_same_as"], got["autopar_measured_s"]) == ("-", None)
    got = peers.compare("g", rows, rows[0], {"autopar_s": 0.8, "_plan": gpipe}, "")  # a row that did not run
    assert (got["autopar_same_as"], got["autopar_measured_s"]) == ("2", None)
