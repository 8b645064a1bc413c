"""Plans you can see (issue 28): `plan.report("plan.html")`, `plan.plot("plan.png")`, `autopar diff a.json b.json`,
`autopar plan ... --html`, AUTOPAR_DUMP's plan.html and the progress bars.

The report's structure is read back with html.parser and every figure checked against the plan it came from (device
map, memory bars, Gantt bars, idle devices, the summary, explain()'s text, measured next to predicted); where a
Chromium is on PATH (.ci/run installs one) the page is also rendered headless, its DOM dumped and a screenshot's
pixels checked for the bars' colours.
"""

from __future__ import annotations

import copy
import html
import io
import json
import shutil
import subprocess
import sys
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest

import autopar
from autopar import Plan, PlanError
from autopar.cli import main, plan_progress
from autopar.ir.plan import Pipeline, Stage
from autopar.models import gpt
from autopar.report import fmt_bytes
from autopar.runtime.launch import _wait_all
from autopar.runtime.plan_check import RankFigures, RunReport, StageFigures
from autopar.solver.pricing.pricing import model_summary, price
from autopar.views.html_report import KIND_COLOURS, PIPELINE_COLOURS
from autopar.views.layout import MEMORY_PARTS

from .test_planner import cm_for

MIXED = "1x2xA100-80GB+1x2xT4"


# ---- plans to show --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def planned() -> Plan:
    """What the planner gives a small GPT on the demo's cluster: one pipeline, tp 2 stages, zero-bubble."""
    c = gpt(batch=8, layers=4, hidden=64, seq=32, device="meta")
    return autopar.plan(c.model, MIXED, c.example_inputs, c.example_target, c.loss_fn)


@pytest.fixture(scope="module")
def idle_plan() -> Plan:
    """Two pipelines of different shapes (a 2-stage one on an A100 and a T4, one stage on the other A100) leaving
    device 3 idle, priced by the planner's pricing."""
    cm = cm_for(MIXED, layers=4, batch=8)
    pipes = [Pipeline(6, 3, 2, [Stage([0, 3], [0]), Stage([3, cm.L], [2])]),
             Pipeline(2, 1, 2, [Stage([0, cm.L], [1])])]
    plan = Plan(cm.B, cm.precision, cm.optimizer, "1f1b", 1, cm.cluster.to_dict(), model_summary(cm.graph), pipes,
                {}, cm.reserve)
    priced = price(cm, plan, idle_reasons={3: "a third replica on a T4 would wait for it: predicted 0.8x"})
    assert priced.fits and sorted(priced.plan.predicted["idle_devices"]) == [3]
    return priced.plan


@pytest.fixture(scope="module")
def tp_plan() -> Plan:
    """One GPipe pipeline of two tensor-parallel stages over all four devices, priced: what `idle_plan` is diffed
    against (both hand-made, so the diff does not follow the planner's choices)."""
    cm = cm_for(MIXED, layers=4, batch=8)
    pipes = [Pipeline(8, 2, 4, [Stage([0, 2], [0, 1]), Stage([2, cm.L], [2, 3])])]
    plan = Plan(cm.B, cm.precision, cm.optimizer, "gpipe", 1, cm.cluster.to_dict(), model_summary(cm.graph), pipes,
                {}, cm.reserve)
    priced = price(cm, plan)
    assert priced.fits
    return priced.plan


# ---- reading a page back ---------------------------------------------------------------------------------------

VOID = {"meta", "br", "img", "input", "link", "hr", "line", "rect", "path", "circle"}


class Element:
    def __init__(self, tag: str, attrs: dict[str, str]) -> None:
        self.tag, self.attrs, self.children, self.text = tag, attrs, [], []

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def all_text(self) -> str:
        return "".join(t if isinstance(t, str) else t.all_text() for t in self.text)

    def find(self, tag: str | None = None, cls: str | None = None) -> list[Element]:
        out = []
        for c in self.children:
            if (tag is None or c.tag == tag) and (cls is None or cls in c.classes):
                out.append(c)
            out += c.find(tag, cls)
        return out


class Tree(HTMLParser):
    """The page as a tree of elements, each with its attributes and its text (children's text included)."""

    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("root", {})
        self.stack = [self.root]
        self.feed(page)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        el = Element(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(el)
        self.stack[-1].text.append(el)
        if tag not in VOID:
            self.stack.append(el)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        el = Element(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(el)
        self.stack[-1].text.append(el)

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID:
            return
        while len(self.stack) > 1:
            if self.stack.pop().tag == tag:
                break

    def handle_data(self, data: str) -> None:
        self.stack[-1].text.append(data)


def _by_device(elements: list[Element]) -> dict[int, Element]:
    return {int(e.attrs["data-device"]): e for e in elements}


def check_report(plan: Plan, page: str) -> Tree:
    """Every figure of `page` against `plan`: the assertions of the structural test."""
    tree = Tree(page)
    root = tree.root
    pr = plan.predicted
    # nothing from the network: inline CSS and SVG only
    assert "http://" not in page.replace("http://www.w3.org", "") and "https://" not in page
    assert not root.find("script") and not root.find("link") and not root.find("img")
    # summary cards
    stats = {e.attrs["data-stat"]: e for e in root.find(cls="stat")}
    assert float(stats["step-time"].attrs["data-value"]) == pr["step_time_s"]
    assert float(stats["samples-per-s"].attrs["data-value"]) == pr["samples_per_s"]
    assert f"{pr['samples_per_s']:.4g}" in stats["samples-per-s"].all_text()
    assert int(stats["devices-used"].attrs["data-value"]) == plan.world_size
    assert stats["fits"].attrs["data-value"] == str(pr["fits"])
    # device map: each device's stages, layers, tp and batch share, or idle and why
    cards = _by_device(root.find("div", "dev"))
    names = plan.device_names()
    assert sorted(cards) == sorted(names)
    want: dict[int, set[tuple]] = {d: set() for d in names}
    share: dict[int, int] = {}
    for i, p in enumerate(plan.pipelines):
        for j, s in enumerate(p.stages):
            for d in s.devices:
                want[d].add((str(i), str(j), f"{s.layers[0]}-{s.layers[1]}", str(s.tp)))
                share[d] = p.batch_share
    idle = {int(d): why for d, why in pr.get("idle_devices", {}).items()}
    for d, card in cards.items():
        assert names[d] in card.all_text()
        got = {(e.attrs["data-pipeline"], e.attrs["data-stage"], e.attrs["data-layers"], e.attrs["data-tp"])
               for e in card.find(cls="stage")}
        assert got == want[d], (d, got, want[d])
        if want[d]:
            assert card.attrs["data-idle"] == "0"
            assert int(card.find(cls="what")[-1].attrs["data-batch"]) == share[d]
        else:
            assert card.attrs["data-idle"] == "1" and idle[d] in card.all_text()
    # the layer strips: every stage of every pipeline, its layer range
    segs = {(e.attrs["data-pipeline"], e.attrs["data-stage"], e.attrs["data-layers"]) for e in root.find(cls="seg")}
    assert segs == {(str(i), str(j), f"{s.layers[0]}-{s.layers[1]}")
                    for i, p in enumerate(plan.pipelines) for j, s in enumerate(p.stages)}
    # memory bars: predicted peak and capacity per device, as explain() formats them
    bars = _by_device(root.find(cls="membar"))
    assert sorted(bars) == sorted(int(d) for d in pr["peak_memory_bytes"])
    for d, bar in bars.items():
        peak, cap = pr["peak_memory_bytes"][d], pr["memory_capacity_bytes"][d]
        assert int(bar.attrs["data-peak"]) == peak and int(bar.attrs["data-capacity"]) == cap
        assert int(bar.attrs["data-usable"]) == int(cap * (1 - plan.memory_reserve))
        parts = {e.attrs["data-part"]: int(e.attrs["data-bytes"]) for e in bar.find(cls="part")}
        given = (pr.get(MEMORY_PARTS) or {}).get(d)
        if given:
            assert {k: v for k, v in parts.items() if k != "other"} == given
            assert sum(parts.values()) == max(peak, sum(given.values()))
        else:
            assert parts == {}
    figures = [e.all_text() for e in root.find(cls="fig")]
    assert figures == [f"{fmt_bytes(pr['peak_memory_bytes'][d])} / {fmt_bytes(pr['memory_capacity_bytes'][d])}"
                       f" ({100 * pr['peak_memory_bytes'][d] / pr['memory_capacity_bytes'][d]:.0f}%)"
                       for d in sorted(bars)]
    # Gantt: every action of every distinct simulated pipeline, at its simulated times
    drawn = Counter((e.attrs["data-pipeline"], e.attrs["data-rank"], e.attrs["data-stream"], e.attrs["data-name"],
                     float(e.attrs["data-start"]), float(e.attrs["data-end"])) for e in root.find("rect", "ev"))
    simulated: Counter = Counter()
    seen: set[int] = set()
    for i, sim in enumerate(plan.simulate()):
        if id(sim) in seen:
            continue
        seen.add(id(sim))
        simulated.update((str(i), str(r), stream, name, start, end) for r, stream, name, start, end in sim.events)
    assert drawn == simulated and drawn
    (end,) = root.find("line", "step-end")
    assert float(end.attrs["data-step"]) == pr["step_time_s"]
    assert sorted(int(e.attrs["data-device"]) for e in root.find("rect", "idle-row")) == sorted(idle)
    # idle devices and why
    listed = _by_device(root.find("li", "idle"))
    assert sorted(listed) == sorted(idle)
    for d, li in listed.items():
        assert idle[d] in li.all_text() and names[d] in li.all_text()
    # the text view, verbatim
    (pre,) = root.find("pre")
    assert pre.all_text() == plan.explain()
    return tree


# ---- the report ------------------------------------------------------------------------------------------------


def test_report_figures_equal_the_plans(planned: Plan, idle_plan: Plan, tmp_path: Path) -> None:
    for plan in (planned, idle_plan):
        page = plan.report(tmp_path / "plan.html")
        assert (tmp_path / "plan.html").read_text(encoding="utf-8") == page
        check_report(plan, page)
        # a plan read back from JSON shows the same page
        assert Plan.from_json(plan.to_json()).report() == page


def test_memory_bars_split_the_peak_where_the_plan_itemizes_it(idle_plan: Plan) -> None:
    plan = copy.deepcopy(idle_plan)
    peak = plan.predicted["peak_memory_bytes"]
    plan.predicted[MEMORY_PARTS] = {d: {"parameters": b // 4, "gradients": b // 4, "optimizer state": b // 4,
                                        "activations": b // 8} for d, b in peak.items()}
    tree = check_report(Plan.from_json(plan.to_json()), plan.report())
    legend = " ".join(e.all_text() for e in tree.root.find(cls="legend"))
    assert all(k in legend for k in ("parameters", "gradients", "optimizer state", "activations", "other"))


def test_a_broken_figure_is_caught(idle_plan: Plan) -> None:
    """The structural check fails when the page shows a figure the plan does not have."""
    page = idle_plan.report()
    d, peak = next(iter(idle_plan.predicted["peak_memory_bytes"].items()))
    broken = page.replace(f'data-peak="{peak}"', f'data-peak="{peak + 1}"', 1)
    with pytest.raises(AssertionError):
        check_report(idle_plan, broken)
    name = idle_plan.simulate()[0].events[0][2]
    with pytest.raises(AssertionError):
        check_report(idle_plan, page.replace(f'data-name="{name}"', 'data-name="F s9 mb9"', 1))
    with pytest.raises(AssertionError):
        check_report(idle_plan, page.replace('data-idle="1"', 'data-idle="0"', 1))


def _measured(plan: Plan) -> RunReport:
    ranks = []
    for d in sorted(plan.predicted["peak_memory_bytes"]):
        p = plan.predicted["peak_memory_bytes"][d]
        cap = plan.predicted["memory_capacity_bytes"][d]
        ranks.append(RankFigures(d, plan.device_names()[d], [f"stage {d}"], p, cap, int(p * 1.1) if d != 1 else None,
                                 plan.predicted["step_time_s"],
                                 step_seconds=[0.004, 0.005, 0.006], not_measured="profiler already running",
                                 stage_times=[StageFigures("stage 0", 0.001, 0.0012)]))
    return RunReport(ranks)


def test_report_puts_measured_next_to_predicted(idle_plan: Plan) -> None:
    measured = _measured(idle_plan)
    tree = check_report(idle_plan, idle_plan.report(measured=measured))
    rows = {int(e.attrs["data-rank"]): e for e in tree.root.find("tr", "measured-rank")}
    assert sorted(rows) == [r.rank for r in measured.ranks]
    for r in measured.ranks:
        row = rows[r.rank]
        assert int(row.attrs["data-predicted-peak"]) == r.predicted_peak_bytes
        assert row.attrs["data-measured-peak"] == ("" if r.measured_peak_bytes is None else str(r.measured_peak_bytes))
        assert float(row.attrs["data-measured-step"]) == r.measured_step_s
        if r.measured_peak_bytes is not None:
            assert fmt_bytes(r.measured_peak_bytes) in row.all_text() and "1.10" in row.all_text()
        else:
            assert "profiler already running" in row.all_text()
    markers = {int(e.attrs["data-measured-bytes"]) for e in tree.root.find(cls="measured")}
    assert markers == {r.measured_peak_bytes for r in measured.ranks if r.measured_peak_bytes is not None}
    assert len(tree.root.find("tr", "measured-stage")) == len(measured.ranks)
    with pytest.raises(PlanError, match="prog.report"):
        idle_plan.report(measured={"rank 0": 1})


CHROMIUM = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on PATH (.ci/run installs one); the structural test ran")
def test_report_renders_in_a_headless_browser(idle_plan: Plan, tmp_path: Path) -> None:
    page = tmp_path / "plan.html"
    idle_plan.report(page)
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,1800"]
    dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    tree = Tree(dom.stdout)  # the DOM the browser built from the page
    root = tree.root
    assert {s.attrs.get("id") for s in root.find("section")} >= {"device-map", "memory", "timeline", "idle", "text"}
    assert len(root.find("div", "dev")) == len(idle_plan.device_names())
    assert len(root.find(cls="membar")) == len(idle_plan.predicted["peak_memory_bytes"])
    assert len(root.find("rect", "ev")) == sum(len(s.events) for s in idle_plan.simulate())
    assert [int(e.attrs["data-device"]) for e in root.find("li", "idle")] == [3]
    shot = tmp_path / "shot.png"
    out = subprocess.run([*flags, f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and shot.is_file(), out.stderr[-2000:]
    from PIL import Image

    colours = {c for _, c in Image.open(shot).convert("RGB").getcolors(maxcolors=2**24)}
    for hex_colour in (KIND_COLOURS["forward"], KIND_COLOURS["backward"], KIND_COLOURS["sync"], PIPELINE_COLOURS[0],
                       PIPELINE_COLOURS[1]):
        rgb = tuple(int(hex_colour[k:k + 2], 16) for k in (1, 3, 5))
        assert rgb in colours, f"{hex_colour} is not on the rendered page"


# ---- the picture -------------------------------------------------------------------------------------------------


def test_plot_draws_the_device_map_and_timeline(idle_plan: Plan, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")  # in the test extra: installed wherever the suite runs
    from PIL import Image

    out = idle_plan.plot(tmp_path / "plan.png")
    assert out == tmp_path / "plan.png"
    img = Image.open(out).convert("RGB")
    assert img.size[0] >= 1000
    colours = {c for _, c in img.getcolors(maxcolors=2**24)}
    for hex_colour in (PIPELINE_COLOURS[0], PIPELINE_COLOURS[1], KIND_COLOURS["forward"], KIND_COLOURS["backward"]):
        rgb = tuple(int(hex_colour[k:k + 2], 16) for k in (1, 3, 5))
        assert rgb in colours, f"{hex_colour} is not in the picture"
    assert idle_plan.plot(tmp_path / "plan.svg").read_text().lstrip().startswith("<?xml")
    with pytest.raises(PlanError, match=r"\.png"):
        idle_plan.plot(tmp_path / "plan.jpeg")


def test_plot_without_matplotlib_says_how_to_get_it(idle_plan: Plan, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlanError, match=r"autopar\[plot\]"):
        idle_plan.plot(tmp_path / "plan.png")


# ---- diff --------------------------------------------------------------------------------------------------------


def test_diff_names_what_changed(tp_plan: Plan, idle_plan: Plan, tmp_path: Path, capsys) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(tp_plan.to_json())
    b.write_text(idle_plan.to_json())
    assert main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "schedule: gpipe -> 1f1b" in out
    assert "data-parallel pipelines: 1 -> 2" in out and "devices used: 4 of 4 -> 3 of 4" in out
    sa, sb = tp_plan.predicted["step_time_s"], idle_plan.predicted["step_time_s"]
    assert f"({100 * (sb / sa - 1):+.1f}%)" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line[:1].isdigit()}
    assert sorted(rows) == ["0", "1", "2", "3"]
    assert "p0 s1 layers 2-5 tp2; batch 8 (4 x 2)" in rows["3"] and rows["3"].split()[-1] == "-"
    assert "idle" in rows["3"] and "p1 s0 layers 0-5; batch 2 (2 x 1)" in rows["1"]
    pb = idle_plan.predicted["peak_memory_bytes"]
    assert f"-> {fmt_bytes(pb[2])}" in rows["2"]
    assert main(["diff", str(a), str(a)]) == 0
    same = capsys.readouterr().out
    assert "options:\n  the same" in same and "per device: nothing changed" in same


@pytest.mark.parametrize("content, why", [("[1, 2]", "a JSON list"), ("not json", "not JSON"), (None, "no such"),
                                          (json.dumps({"pipelines": []}), "not a valid autopar plan")])
def test_diff_of_a_file_that_is_not_a_plan(tp_plan: Plan, tmp_path: Path, capsys, content, why) -> None:
    good, bad = tmp_path / "a.json", tmp_path / "b.json"
    good.write_text(tp_plan.to_json())
    if content is not None:
        bad.write_text(content)
    assert main(["diff", str(good), str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and why in err and "--json FILE" in err


# ---- the CLI, the dump, progress ----------------------------------------------------------------------------------


def test_plan_html_and_the_dump_write_the_report(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    out, js = tmp_path / "plan.html", tmp_path / "plan.json"
    monkeypatch.setenv("AUTOPAR_DUMP", str(tmp_path / "dump"))
    assert main(["plan", "autopar.models:mlp", "--cluster", "1x2xA100-80GB", "--json", str(js),
                 "--html", str(out)]) == 0
    err = capsys.readouterr().err
    plan = Plan.from_json(js.read_text())
    check_report(plan, out.read_text(encoding="utf-8"))
    check_report(plan, (tmp_path / "dump" / "plan.html").read_text(encoding="utf-8"))
    # stderr is not a terminal here: no progress, only the summary lines
    assert "planning" not in err and "config" not in err and f"report written to {out}" in err


def test_progress_shows_configurations_best_and_gap() -> None:
    from tqdm import tqdm

    stream = io.StringIO()
    bar = tqdm(total=None, desc="planning", unit="config", file=stream, delay=0, mininterval=0)
    progress = plan_progress(bar)
    for args in [(1, 40, None), (10, 40, 0.0015), (20, 40, 0.0015, 0.001)]:  # last: the least bound left
        progress(*args)
        bar.refresh()  # what the redraw thread of cli.progress_bar does twice a second
    text = stream.getvalue()
    assert "no plan fits yet" in text and "20/40" in text
    assert "best 1.5 ms/step" in text and "bound gap 50.0%" in text
    plan_progress(None)(3, 40, 0.001)  # not a terminal: nothing to draw


def test_run_waits_for_workers_telling_progress() -> None:
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.6)"]),
             subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])]
    calls: list[tuple[int, int]] = []
    assert _wait_all(procs, lambda done, total: calls.append((done, total))) == [0, 3]
    assert calls[-1] == (2, 2) and all(t == 2 for _, t in calls) and calls == sorted(calls)


def test_profile_tells_progress() -> None:
    from autopar.runtime.block_profiler import profile_blocks

    case = gpt(batch=4, layers=2, hidden=32, seq=8, seed=0)
    calls: list[tuple[int, int, str]] = []
    profile_blocks(case.model, "1x1xcpu", case.example_inputs, case.example_target, case.loss_fn,
                   microbatch_sizes=[2, 4], repeats=1, progress=lambda *a: calls.append(a))
    assert calls and calls[-1][0] == calls[-1][1] and [c[0] for c in calls] == list(range(1, len(calls) + 1))
    assert "micro-batch 4" in calls[-1][2]


def test_demo_writes_its_report_beside_the_text(tmp_path: Path) -> None:
    from autopar.demo import report_path

    assert report_path(str(tmp_path / "x.html")) == tmp_path / "x.html"
    assert report_path().name == "plan.html" and report_path().parent.name == "autopar-demo"


def test_report_escapes_what_it_shows(idle_plan: Plan) -> None:
    plan = copy.deepcopy(idle_plan)
    plan.model["name"] = "<script>alert(1)</script>"
    page = plan.report()
    assert "<script>" not in page and html.escape("<script>alert(1)</script>") in page


def test_the_planner_itemizes_each_peak() -> None:
    """`predicted["peak_memory_parts_bytes"]` sums to each device's peak, and its state parts are what the model
    holds, counted from its parameters here: fp32 AdamW keeps 4 bytes of weight, 4 of gradient and 8 of moments
    per parameter on one device, and ZeRO-1 over two replicas halves the moments."""
    c = gpt(batch=4, layers=2, hidden=64, seq=16)
    numel = sum(p.numel() for p in c.model.parameters())
    args = (c.example_inputs, c.example_target, c.loss_fn)
    one = autopar.estimate(c.model, "1x1xA100-80GB", autopar.Strategy(), *args, precision="fp32").plan
    two = autopar.estimate(c.model, "1x2xA100-80GB", autopar.Strategy(dp=2, zero=1), *args, precision="fp32").plan
    for plan in (one, two, Plan.from_json(two.to_json())):
        pr = plan.predicted
        for d, parts in pr[MEMORY_PARTS].items():
            assert sum(parts.values()) == pr["peak_memory_bytes"][d]
            assert parts["parameters"] == 4 * numel and parts["gradients"] == 4 * numel
            assert parts["activations"] > 0
    assert one.predicted[MEMORY_PARTS][0]["optimizer state"] == 8 * numel
    assert all(two.predicted[MEMORY_PARTS][d]["optimizer state"] == pytest.approx(4 * numel, abs=1) for d in (0, 1))


def test_the_search_reports_the_least_bound_left_to_a_callback_that_takes_it() -> None:
    c = gpt(batch=8, layers=4, hidden=64, seq=32, device="meta")
    args = (c.example_inputs, c.example_target, c.loss_fn)
    four: list[tuple] = []
    three: list[tuple] = []
    plan = autopar.plan(c.model, "1x4xA100-80GB", *args, progress=lambda d, t, b, bound: four.append((d, t, b, bound)))
    autopar.plan(c.model, "1x4xA100-80GB", *args, progress=lambda d, t, b: three.append((d, t, b)))
    assert four and [x[:3] for x in four] == three  # a three-argument callback still works, and sees the same
    bounds = [bound for *_, bound in four if bound is not None]
    assert bounds and bounds == sorted(bounds)  # best-first: the least bound left only grows
    assert four[-1][2] == pytest.approx(plan.predicted["step_time_s"], rel=0.5)
