"""An InfeasibleError names the constraint that binds (issue 13, item 5): memory only when memory is what
stops every plan (the same model plans on the same cluster with unlimited memory), the layout rules (every
device in one stage of one replica: replicas <= batch, stages <= layers, tp inside a node, device types
split evenly) when no layout exists at all, with the numbers and fixes that work. These are the whole cluster's
refusals (`Search` on every device); `autopar.plan` then falls back onto a subset (issue 29,
tests/test_idle_fallback.py) and raises them only when no subset trains the model either."""

from __future__ import annotations

import sys
import warnings

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import autopar
from autopar import Cluster, InfeasibleError, models
from autopar.api import cost_model
from autopar.solver.search.search import Search

from .runtime_cases import captured_case

TYPES = ["A100-80GB", "H100-SXM", "V100-16GB", "T4", "L4", "RTX-3090"]
ISSUE_CLUSTER = "2x4xH100-SXM+2x4xL4+1x4xRTX-3090"
MEMORY = "no plan fits in memory"


def _plan(cluster: object, batch: int, layers: int = 2, hidden: int = 64, seq: int = 16,
          whole: bool = True) -> str | None:
    """None when a plan is found, else the InfeasibleError's message: of the search on every device of the
    cluster (`whole`), or of `autopar.plan` (which may leave devices idle)."""
    # the examples plan each shape on many clusters
    case, graph = captured_case(models.gpt, layers=layers, hidden=hidden, seq=seq, batch=batch, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a time-limit warning is no failure here
        try:
            if whole:
                Search(cost_model(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn,
                                  captured=graph), time_limit_s=5).run()
            else:
                autopar.plan(case.model, cluster, case.example_inputs, case.example_target, case.loss_fn,
                             time_limit_s=5, captured=graph)
        except InfeasibleError as e:
            return str(e)
    return None


def _unlimited(cluster: dict) -> dict:
    """The same nodes and device types with (practically) unlimited device and host memory."""
    groups = []
    for g in cluster["nodes"]:
        dev = g["device"]
        name, base = (dev, dev) if isinstance(dev, str) else (dev["name"], dev["based_on"])
        groups.append({**g, "device": {"name": name, "based_on": base, "memory_GiB": 1e6}, "host_memory_GiB": 1e7})
    return {"nodes": groups}


def test_a_tp_per_device_type_places_the_issue_case() -> None:
    # 2 H100 and 2 L4 groups at tp 4, 2 RTX-3090 groups at tp 2: three one-type pipelines of two stages
    assert _plan(ISSUE_CLUSTER, batch=3) is None


def test_the_issue_case_names_the_layout_constraint_and_fixes_that_work(monkeypatch: pytest.MonkeyPatch) -> None:
    # one tensor-parallel degree for the whole plan (as before degrees per device type were searched): no layout
    monkeypatch.setattr(sys.modules["autopar.solver.search.configs"], "mixed_tp_layouts", lambda cm: [])
    msg = _plan(ISSUE_CLUSTER, batch=3)
    assert msg is not None and not msg.startswith(MEMORY)
    assert "memory is not the constraint" in msg and "all 20 devices" in msg
    assert "at most 3 replica(s)" in msg and "at most 4 stages" in msg  # batch 3, 4 layers (pre, 2 blocks, post)
    assert "tp=4: 5 group(s)" in msg and "1x5 (5 stages > 4 layers)" in msg and "5x1 (5 replicas > batch 3)" in msg
    assert "raise the global batch to at least 5 samples" in msg
    assert "2x4xH100-SXM+2x4xL4 nodes: cluster.subset([*range(0, 16)])" in msg
    # the fixes it names work, and the batch it names is the least that does
    assert _plan(ISSUE_CLUSTER, batch=5) is None
    assert _plan(ISSUE_CLUSTER, batch=4) is not None
    assert _plan(Cluster.load(ISSUE_CLUSTER).subset(list(range(16))), batch=3) is None
    assert _plan(ISSUE_CLUSTER, batch=3, layers=3) is None  # "a deeper model (at least 5 layers in its chain)"
    assert "at least 5 layers" in msg
    # autopar.plan does not refuse: it leaves devices idle, saying why and what would use them all
    case = models.gpt(layers=2, hidden=64, seq=16, batch=3, device="meta")
    plan = autopar.plan(case.model, ISSUE_CLUSTER, case.example_inputs, case.example_target, case.loss_fn)
    idle = plan.predicted["idle_devices"]
    assert idle and all("no parallel layout uses all 20 devices" in why and "at least 5 samples" in why
                        for why in idle.values())


@st.composite
def clusters(draw: st.DrawFn) -> dict:
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(TYPES))
        dev: str | dict = name
        if draw(st.integers(0, 2)) == 0:  # a board with too little memory for the model, sometimes
            gib = draw(st.sampled_from([0.00001, 0.0001, 0.0005]))
            dev = {"name": f"small-{name}", "based_on": name, "memory_GiB": gib}
        groups.append({"device": dev, "devices_per_node": draw(st.sampled_from([1, 2, 4])),
                       "count": draw(st.integers(1, 2))})
    return {"nodes": groups}


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(clusters(), st.integers(1, 6), st.integers(1, 3))
@example({"nodes": [{"device": "H100-SXM", "devices_per_node": 4, "count": 2},
                    {"device": "L4", "devices_per_node": 4, "count": 2},
                    {"device": "RTX-3090", "devices_per_node": 4, "count": 1}]}, 3, 2)  # layouts bind
@example({"nodes": [{"device": {"name": "speck", "based_on": "T4", "memory_GiB": 0.00001},
                     "devices_per_node": 2, "count": 1}]}, 4, 2)  # memory binds
def test_memory_is_blamed_exactly_when_memory_binds(cluster: dict, batch: int, layers: int) -> None:
    msg = _plan(cluster, batch, layers=layers, hidden=32, seq=8)
    if msg is None:
        return
    fits_without_memory_limits = _plan(_unlimited(cluster), batch, layers=layers, hidden=32, seq=8) is None
    if fits_without_memory_limits:
        assert msg.startswith(MEMORY) and "To fit" in msg and "usable" in msg, msg
    else:
        assert not msg.startswith(MEMORY) and "memory is not the constraint" in msg, msg
        assert "replicas x stages" in msg and "To plan:" in msg, msg
    # autopar.plan leaves devices idle rather than refuse, and refuses only for memory
    user = _plan(cluster, batch, layers=layers, hidden=32, seq=8, whole=False)
    assert user is None or (MEMORY in user and "usable" in user), user


@pytest.mark.parametrize("cluster,batch", [("1x5xA100-80GB+1x2xT4", 1), ("1x1xA100-80GB+4x1xT4", 1)])
def test_a_subset_named_by_the_message_can_be_planned_on(cluster: str, batch: int) -> None:
    msg = _plan(cluster, batch)
    assert msg is not None and "memory is not the constraint" in msg
    start = msg.index("cluster.subset([") + len("cluster.subset(")
    subset = eval(msg[start:msg.index("])", start) + 1], {"range": range})  # noqa: S307  (our own message)
    assert 0 < len(subset) < Cluster.load(cluster).world_size
    assert _plan(Cluster.load(cluster).subset(subset), batch) is None


def test_a_candidate_that_does_not_fit_when_priced_is_dropped_and_said(monkeypatch) -> None:
    """Should the search's memory checks ever admit a plan that full pricing rejects, the plan is skipped with
    a warning, never returned (and never an AssertionError)."""
    import dataclasses
    import importlib

    search_mod = importlib.import_module("autopar.solver.search.search")  # the module

    real, calls = search_mod.price, []

    def first_does_not_fit(cm, plan):
        priced = real(cm, plan)
        calls.append(priced)
        if len(calls) == 1:
            return dataclasses.replace(priced, fits=False, problems=["(forced by the test)"])
        return priced

    monkeypatch.setattr(search_mod, "price", first_does_not_fit)
    c = autopar.models.gpt(layers=2, hidden=64, seq=16, batch=4, device="meta")
    with pytest.warns(UserWarning, match="does not fit when priced in full"):
        try:
            plan = autopar.plan(c.model, "1x2xA100-80GB", c.example_inputs, c.example_target, c.loss_fn,
                                time_limit_s=30)
        except autopar.InfeasibleError:
            plan = None
    assert len(calls) >= 1
    if plan is not None:
        assert plan.predicted["fits"] and calls[0].plan is not plan
