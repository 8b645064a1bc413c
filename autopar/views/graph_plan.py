"""The graph section of `Plan.explain()` for graph workloads (graphs/planner.py's plans): the mode, each
rank's share of nodes or events with its halo, compute and peak memory, the devices given no share and why,
and both modes' predictions. Reads only `Plan.graph`, so a plan read back from JSON shows the same."""

from __future__ import annotations

from ..graphs.planner import FULL_GRAPH_MODES, GRAPH_MODES
from ..report import fmt_bytes, fmt_time, render_table

SAMPLED_MODES = {"sampled_dp", "sampled_pipeline"}  # one algorithm, two divisions of labour


def explain_graph(graph: dict) -> str:
    """The graph section of Plan.explain(): mode, per-rank shares, and both modes' predictions."""
    mode = graph.get("mode", "?")
    if mode in ("temporal_dp", "temporal_pipeline"):
        lines = [f"temporal graph: {graph.get('num_nodes', '?')} nodes; mode {mode}"]
    else:
        lines = [f"graph: {graph.get('num_nodes', '?')} nodes, {graph.get('num_edges', '?')} edges, "
                 f"{graph.get('labelled', '?')} labelled; mode {mode}"]
    if mode == "partition":
        lines[0] += (f" (full-graph training, the model as written: each rank owns a {graph.get('order', 'bfs')}"
                     f"-ordered node range, halo exchange before each of {graph.get('layers')} message-passing "
                     f"layers)")
    elif mode == "sampled_dp":
        lines[0] += f" ({graph.get('batch_size')} seeds/step, fanout {graph.get('fanout')})"
        lines.append(f"sampled mini-batch training with fanout {graph.get('fanout')}: a different estimator than "
                     f"full-graph training (each step trains {graph.get('batch_size')} seeds, every node "
                     f"aggregating at most {graph.get('fanout')} in-neighbours sampled per step with seed "
                     f"{graph.get('seed')}); it equals one process training model(x, sampled_graph(...)) on the "
                     f"same seeds, not full-graph training. Asked for with graph_options mode='sampled_dp'.")
    elif mode == "sampled_pipeline":
        st = graph.get("stages", {})
        lines[0] += f" ({graph.get('batch_size')} seeds/step, fanout {graph.get('fanout')})"
        lines.append(f"sampled mini-batch training with fanout {graph.get('fanout')} (the sampled_dp algorithm, "
                     f"not full-graph training) in a pipeline: cpu ranks {graph.get('samplers')} sample and gather "
                     f"each step's mini-batches and send them to ranks {graph.get('trainers')}, which train data "
                     f"parallel; step k + 1 is sampled while step k trains. Stages: sample + gather "
                     f"{fmt_time(st.get('sample_s', 0.0))}, transfer {fmt_time(st.get('transfer_s', 0.0))}, "
                     f"train + all-reduce {fmt_time(st.get('train_s', 0.0))}; the step is the slowest. Asked for "
                     f"with graph_options mode='sampled_pipeline'.")
    elif mode == "temporal_dp":
        lines[0] += f" ({graph.get('batch_size')} events/step split across ranks, node memory replicated)"
    elif mode == "temporal_pipeline":
        lines += temporal_pipeline_lines(graph)
    elif mode == "layer_pipeline":
        lines += layer_pipeline_lines(graph)
    if graph.get("mode_why"):
        lines.append(f"why {mode}: {graph['mode_why']}")
    cand = graph.get("candidates", {})
    chosen = cand.get(mode, {})
    if mode == "layer_pipeline":
        pass  # its per-rank table is layer_pipeline_lines'
    elif "shares" in graph:
        head = ["rank", graph.get("unit", "share"), "halo", "compute", "peak mem"]
        rows = [head]
        for r, share in enumerate(graph["shares"]):
            halo = graph.get("halo", [])
            rows.append([str(r), str(share), str(halo[r]) if r < len(halo) else "-",
                         fmt_time(chosen.get("compute_s", [0.0] * (r + 1))[r]) if chosen else "-",
                         fmt_bytes(chosen.get("peak_memory_bytes", [0] * (r + 1))[r]) if chosen else "-"])
        lines.append(render_table(rows, right={1, 2, 3, 4}))
    lines += idle_lines(graph.get("idle", []), graph.get("unit", "share"))
    lines += partitioner_lines(graph)
    for m, c in cand.items():
        status = "fits" if c.get("fits") else "does not fit: " + "; ".join(c.get("problems", []))
        rate = f"{c['samples_per_s']:.4g} samples/s, {fmt_time(c['step_time_s'])}/step" if c.get("fits") else ""
        if m == mode:
            tag = " (chosen)"
        elif {m, mode} <= set(FULL_GRAPH_MODES):
            faster = c.get("fits") and chosen.get("step_time_s") and c["step_time_s"] < chosen["step_time_s"]
            tag = (" (the same full-graph training, " + ("not " if not faster else "") + "faster on this cluster: "
                   + ("the layers split into stages over the ranks" if m == "layer_pipeline" else
                      "every rank computing every layer for its own nodes") + f"; graph_options mode={m!r} asks "
                   f"for it)")
        elif {m, mode} <= SAMPLED_MODES:
            faster = c.get("fits") and chosen.get("step_time_s") and c["step_time_s"] < chosen["step_time_s"]
            tag = (f" (the same sampled algorithm, {'faster' if faster else 'not faster'} on this cluster: "
                   + ("cpu ranks sample for the accelerator ranks" if m == "sampled_pipeline" else
                      "every rank samples its own seeds") + f"; graph_options mode={m!r} asks for it)")
        else:
            tag = (" (not considered: a different algorithm than the one asked for; graph_options "
                   f"mode={m!r} asks for it)" if mode in GRAPH_MODES else "")
        lines.append(f"  {m}{tag}: {rate} {status}".rstrip())
    if mode == "partition" and "layer_pipeline" not in cand and len(graph.get("shares", [])) > 1:
        lines.append("  layer_pipeline (not priced: partition fits and its step is not bound by the halo exchange; "
                     "graph_options mode='layer_pipeline' asks for it)")
    return "\n".join(lines)


def temporal_pipeline_lines(graph: dict) -> list[str]:
    """The MSPipe pipeline's staleness, roles, stages and predicted speed-up (graphs/temporal_pipeline.py)."""
    st, s = graph.get("stages", {}), graph.get("staleness")
    return [f"node memory up to staleness {s} batch(es) stale (MSPipe): batch i reads the memory as of after batch "
            f"i-1-{s}; {'exact training' if s == 0 else 'results differ from exact training'}. Memory ranks "
            f"{graph.get('memory_ranks')} compute each write-back (GRU rows, no gradient) while ranks "
            f"{graph.get('trainers')} train on {graph.get('batch_size')} events/step; why: "
            f"{graph.get('staleness_why', '')}.",
            f"stages: train + all-reduce {fmt_time(st.get('train_s', 0.0))}, memory GRU "
            f"{fmt_time(st.get('memory_s', 0.0))}, write-back latency {fmt_time(st.get('latency_s', 0.0))} (theta "
            f"{fmt_time(st.get('theta_s', 0.0))}, rows {fmt_time(st.get('rows_s', 0.0))}) over {s} + 1 step(s); "
            f"predicted speed-up vs exact temporal_dp {graph.get('speedup_vs_temporal_dp', 0.0):.2f}x."]


def layer_pipeline_lines(graph: dict) -> list[str]:
    """The layer pipeline's shape: stages and their layers, the chunks and why, each rank's figures, the chunk
    counts tried (graphs/layer_pipeline.py, cost.GraphCostModel.layer_pipeline)."""
    stages, C = graph.get("stage_layers", []), graph.get("chunks", 1)
    pipe = graph.get("pipeline", {})
    chosen = graph.get("candidates", {}).get("layer_pipeline", {})
    flow = (f"the nodes in {C} {graph.get('order', 'bfs')}-ordered chunks flowing through them" if C > 1 else
            "the whole graph as one chunk")
    lines = [f"full-graph training, the model as written, its {graph.get('layers')} message-passing layers split "
             f"into {len(stages)} stages (one per rank), {flow} ({graph.get('chunks_why', '')}); a stage starts a "
             f"chunk once every chunk holding one of its in-neighbours has arrived, so nothing is stale"]
    reads = graph.get("chunk_reads", [])
    if C > 1 and reads:
        lines.append(f"each chunk reads {min(reads)}-{max(reads)} of the {C} chunks (its own and its halo's): "
                     + ("every chunk waits for all of them, so stages run one after the other"
                        if min(reads) == C else "later stages start before earlier ones finish"))
    rows = [["rank", "layers", "params", "compute", "idle", "peak mem", "sends"]]
    busy, idle = pipe.get("busy_s", []), pipe.get("idle_s", [])
    peaks, bounds = chosen.get("peak_memory_bytes", []), graph.get("boundary_bytes", [])
    for r, (a, b) in enumerate(stages):
        rows.append([str(r), f"[{a}, {b})", str(graph.get("stage_params", ["-"] * (r + 1))[r]),
                     fmt_time(busy[r]) if r < len(busy) else "-", fmt_time(idle[r]) if r < len(idle) else "-",
                     fmt_bytes(peaks[r]) if r < len(peaks) else "-",
                     fmt_bytes(bounds[r]) if r < len(bounds) else "-"])
    lines.append(render_table(rows, right={2, 3, 4, 5, 6}))
    options = graph.get("chunk_options", {})
    if len(options) > 1:
        rows = [["chunks", "step (predicted)", "idle", "largest peak", "fits"]]
        for k, o in options.items():
            rows.append([k + (" (chosen)" if int(k) == C else ""), fmt_time(o["step_time_s"]),
                         f"{100 * o.get('bubble_fraction', 0.0):.0f}%", fmt_bytes(o["peak_memory_bytes"]),
                         "yes" if o.get("fits") else "no"])
        lines.append(render_table(rows, right={1, 2, 3}))
    return lines


def partitioner_lines(graph: dict) -> list[str]:
    """Which partitioner cut the nodes and why, and each one priced (graphs/partitioners.py, graphs/cost.py)."""
    if "partitioner" not in graph:
        return []
    lines = [f"partitioner: {graph['partitioner']} ({graph.get('partitioner_why', '')})"]
    table = graph.get("partitioners") or {}
    if table:
        rows = [["partitioner", "step (predicted)", "fits", "edge cut", "halo volume", "largest halo"]]
        for name, t in table.items():
            rows.append([name + (" (chosen)" if name == graph["partitioner"] else ""), fmt_time(t["step_time_s"]),
                         "yes" if t.get("fits") else "no", str(t.get("edge_cut", "-")),
                         str(t.get("halo_volume", "-")), str(max(t.get("halo", [0]) or [0]))])
        lines.append(render_table(rows, right={1, 3, 4, 5}))
    return lines


def _count(n: int, unit: str) -> str:
    return f"{n} {unit[:-1] if n == 1 and unit.endswith('s') else unit}"


def idle_lines(idle: list[dict], unit: str) -> list[str]:
    """One line per device type and reason for the devices the plan gives a zero share, in the cost model's
    numbers (GraphCostModel._idle)."""
    groups: dict[tuple, list[dict]] = {}
    for i in idle:
        groups.setdefault((i["type"], i["why"]), []).append(i)
    lines = []
    for (kind, why), members in groups.items():
        ids = ", ".join(str(i["device"]) for i in members)
        head = f"{kind} device{'s' if len(members) > 1 else ''} {ids} get{'' if len(members) > 1 else 's'} no {unit}"
        i = members[0]
        if why == "memory":
            lines.append(f"{head}: not enough memory for a single one (holds at most {i['cap']})")
        elif why == "too_small":
            lines.append(f"{head}: there is too little work to split")
        elif why == "no_gain":
            lines.append(f"{head}: giving {'them' if len(members) > 1 else 'it'} work does not make the step "
                         f"faster (device {i['device']} with {_count(i['share'], unit)}: {fmt_time(i['step_s'])}/step "
                         f"against {fmt_time(i['chosen_step_s'])}): the step is bound by costs paid whatever the "
                         f"share (kernel launches: {fmt_time(i['busiest_fixed_s'])} of device {i['busiest']}'s "
                         f"{fmt_time(i['chosen_compute_s'])} compute) and by the exchanges every rank joins")
        elif why == "balance":
            lines.append(f"{head}: the balancer's per-rank time model (fixed + per item) left it out, though "
                         f"giving device {i['device']} {_count(i['share'], unit)} prices "
                         f"{fmt_time(i['step_s'])}/step against {fmt_time(i['chosen_step_s'])}")
        else:
            if i["own_compute_s"] >= i["chosen_compute_s"]:
                cause = (f"its compute for them, {fmt_time(i['own_compute_s'])} (of which "
                         f"{fmt_time(i['fixed_s'])} is paid whatever the share: kernel launches), exceeds the "
                         f"{fmt_time(i['chosen_compute_s'])} the working ranks take")
            elif i["comm_s"] > i["chosen_comm_s"]:
                cause = (f"the halo exchange grows from {fmt_time(i['chosen_comm_s'])} to {fmt_time(i['comm_s'])}, "
                         f"more than its compute saves ({fmt_time(i['chosen_compute_s'])} -> "
                         f"{fmt_time(i['compute_s'])})")
            else:
                cause = f"the busiest rank's compute goes to {fmt_time(i['compute_s'])}"
            lines.append(f"{head}: adding {'them' if len(members) > 1 else 'it'} makes the step slower (device "
                         f"{i['device']} with {_count(i['share'], unit)}: {fmt_time(i['step_s'])}/step instead of "
                         f"{fmt_time(i['chosen_step_s'])}; {cause})")
    return lines


__all__ = ["explain_graph", "idle_lines", "layer_pipeline_lines", "partitioner_lines"]
