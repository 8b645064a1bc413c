"""What the search memoises for speed (issue 25 part 4) answers as the unmemoised computation does.

* `Search._slots` keeps each grouping's NCCL communicator counts per grouping *and* chunks: an interleaved
  schedule adds a pipeline peer (the last rank sends its chunk on to the first), so counts taken at one chunk
  count would misprice the memory budget at another.
* `Splitter.stage` prices a range's options' memory on demand, in time order, and takes the first that fits
  clear of the budget without the floor check: it must pick what the full check over every option
  (`Splitter.ranked`, the floor, the first that fits) picks, budgets at an option's exact need included.
* `Splitter._exact` drops dynamic-program states whose term reaches the search's cutoff (`split(prune=True)`):
  sound because, with every micro-batch full, a split's lower bound is at least its surrogate, so the search
  keeps the same splits and plans while the dynamic program holds fewer states.
"""

from __future__ import annotations

import math

import pytest

from autopar.api import cost_model
from autopar.ir.plan import even_split
from autopar.models import gpt
from autopar.solver.pricing.pricing import lower_bound
from autopar.solver.search.search import Search, config_communicators
from autopar.solver.split import split as split_module
from autopar.solver.split.split import NO_CHUNKS, Splitter, priced_surrogate


def _cm(cluster: str, layers: int = 8):
    mc = gpt(batch=8, seq=32, vocab=256, hidden=64, layers=layers, heads=4, device="meta")
    return cost_model(mc.model, cluster, mc.example_inputs, mc.example_target, mc.loss_fn)


def test_slot_budgets_count_the_communicators_of_their_own_chunks() -> None:
    cm = _cm("1x4xA100-80GB")
    search = Search(cm)
    configs = search._configs()
    # one grouping at several chunk counts, visited alternately (as configs in bound order are)
    by_grouping: dict[int, list] = {}
    for cfg in configs:
        by_grouping.setdefault(id(cfg.pipelines), []).append(cfg)
    mixed = [cfgs for cfgs in by_grouping.values() if len({c.chunks for c in cfgs}) > 1]
    assert mixed, "no grouping runs at several chunk counts"
    checked = differ = 0
    for cfgs in mixed:
        for cfg in cfgs + cfgs[::-1]:
            pipe = cfg.pipelines[0]
            slots = search._slots(cfg, pipe, 4)
            dp = [tuple(other[r][0] for other in cfg.pipelines) for r in range(len(pipe))]
            comms = config_communicators(cfg.pipelines, dp, cfg.chunks, cm.cluster.world_size)
            for j, slot in enumerate(slots):
                assert slot.budget == min(cm.usable(d, comms.get(d)) for d in pipe[j % len(pipe)])
                checked += 1
        counts = {c.chunks: config_communicators(c.pipelines, [tuple(o[r][0] for o in c.pipelines)
                                                               for r in range(len(c.pipelines[0]))],
                                                 c.chunks, cm.cluster.world_size) for c in cfgs}
        differ += len({tuple(sorted(v.items())) for v in counts.values()}) > 1
    assert checked and differ, "the chunk counts tried do not change any communicator count"


def _reference(sp: Splitter, slot, a: int, e: int, m: int, n: int):
    """`Splitter.stage` as the full check computes it: every option's memory, the floor, the first that fits."""
    ranked = sp.ranked(slot, a, e, m, n)
    if not NO_CHUNKS.fits(sp._floor(ranked, slot.inflight), slot):
        return None
    return next(((opt, tm, mem) for _, opt, tm, mem in ranked if NO_CHUNKS.fits(mem, slot)), None)


def test_stage_picks_what_the_full_option_check_picks() -> None:
    cm = _cm("1x2xA100-80GB")
    probe = Search(cm)
    cfg = next(c for c in probe._configs() if len(c.pipelines) == 1 and len(c.pipelines[0]) == 2)
    base_slot = probe._slots(cfg, cfg.pipelines[0], 2)[0]
    a, e, m, n = cm.first_block, cm.first_block + 3, 2, 4
    needs = sorted({NO_CHUNKS.need(mem, base_slot.inflight, base_slot.microbatches)
                    for _, _, _, mem in Splitter(cm).ranked(base_slot, a, e, m, n)})
    # budgets at every option's exact need, just under it, between needs, and none fits / all fit
    budgets = {0.0, math.inf}
    for x in needs:
        budgets |= {x, math.nextafter(x, 0.0), x * (1 - 1e-10), x * 1.5}
    seen = set()
    for budget in sorted(budgets):
        slot = base_slot._replace(budget=budget)
        want = _reference(Splitter(cm), slot, a, e, m, n)
        got = Splitter(cm).stage(slot, a, e, m, n)
        assert (None if got is None else (got.option, got.times, got.memory)) == want, budget
        assert got is None or got.out_bytes == cm.base(a, e, slot.dtype, n, slot.tp_group).out_bytes
        seen.add(None if want is None else want[0])
    assert len(seen) > 2, "the budgets tried do not reach several options"


def test_layer_keys_and_groups_kept_across_micro_batch_sizes_name_their_own_size() -> None:
    """The intra-op pricer keeps each layer's key and op groups across its copies at other micro-batch sizes
    (`Context.layer_key`, `Context.merged`): the key must still carry each copy's own size, as a fresh context
    at that size computes it, and the groups must be the ones `merge_followers` builds."""
    from autopar.solver.intra_op.build import merge_followers
    from autopar.solver.intra_op.context import Context

    cm = _cm("1x2xA100-80GB", layers=2)
    dtype = cm.cluster.devices[0].spec.name
    pricer = cm.layer_pricer(dtype, (0, 1))
    layer = cm.graph.layers[cm.first_block]
    members = [n for n in layer.nodes if cm.graph.nodes[n].outputs]
    for batch in (2, 4, 2, 8):
        ctx = pricer._at(batch)
        fresh = Context(cm.graph, 2, dtype, cm.cluster, (0, 1), batch / cm.graph.batch_size, runtime=True)
        assert ctx.layer_key(layer) == fresh.layer_key(layer)
        got, want = ctx.merged(members, merge_followers), merge_followers(fresh, members)
        assert [(g.members, [{m: (s.ins, s.grads) for m, s in c.items()} for c in g.choices]) for g in got] == \
            [(g.members, [{m: (s.ins, s.grads) for m, s in c.items()} for c in g.choices]) for g in want]


def _exact_case(cm):
    """A 4-stage 1F1B pipeline of `cm` with 8 full micro-batches, its slots and `split`'s starting incumbent."""
    search = Search(cm)
    cfg = next(c for c in search._configs() if len(c.pipelines[0]) == 4 and c.schedule == "1f1b")
    m, share = 8, 8 * cm.B // 8
    slots = search._slots(cfg, cfg.pipelines[0], m)
    sp = Splitter(cm)
    return sp, slots, m, -(-share // m), sp.greedy(slots, math.inf, m, -(-share // m), 1)


def test_exact_with_a_cutoff_returns_the_same_split_under_it_and_the_incumbent_at_it() -> None:
    cm = _cm("1x4xA100-80GB", layers=16)
    sp, slots, m, n, start = _exact_case(cm)
    best = sp._exact(slots, m, n, start)
    assert best.surrogate < start.surrogate, "the incumbent is already optimal: the case does not exercise the DP"
    above = sp._exact(slots, m, n, start, best.surrogate * (1 + 1e-9))
    assert [(a, e, c.option) for a, e, c in above.stages] == [(a, e, c.option) for a, e, c in best.stages]
    assert above.surrogate == best.surrogate
    assert sp._exact(slots, m, n, start, best.surrogate) is start


def test_a_split_lower_bound_is_at_least_its_surrogate_with_full_micro_batches() -> None:
    """The premise of the pruning: what `Search._solve` bounds a split by never undercuts the surrogate the
    dynamic program prunes on (every micro-batch full, a schedule whose backward is not split)."""
    cm = _cm("1x4xA100-80GB", layers=16)
    sp, slots, m, n, start = _exact_case(cm)
    checked = 0
    for cuts in ((1, 2, 3), (5, 9, 13), (3, 8, 17), (2, 10, 12)):
        edges = (0, *cuts, cm.L)
        stages = [(edges[j], edges[j + 1], sp.stage(slots[j], edges[j], edges[j + 1], m, n)) for j in range(4)]
        if any(c is None for _, _, c in stages):
            continue
        split = split_module.Split(stages, 0.0)
        vals = sp.values(slots, split, 0)
        assert lower_bound(vals, even_split(m * n, m), 4) >= priced_surrogate(cm, slots, stages, 1, m) * (1 - 1e-12)
        checked += 1
    assert checked >= 3


@pytest.mark.timeout(120)
def test_pruned_dynamic_program_plans_the_same_with_fewer_states(monkeypatch) -> None:
    """Every dynamic program the search runs with a cutoff gives the unpruned optimum where it is under the
    cutoff and the incumbent where not, from fewer states (counted at the Pareto filter), and the plan is the
    one the search finds without pruning."""
    cm = _cm("1x8xT4", layers=16)
    seen = {"states": 0}
    pareto, exact = split_module._pareto, Splitter._exact
    totals = {"pruned": 0, "unpruned": 0, "calls": 0}

    def counted(states):
        seen["states"] += len(states)
        return pareto(states)

    def checked(self, slots, m, n, incumbent, cutoff=math.inf):
        seen["states"] = 0
        got = exact(self, slots, m, n, incumbent, cutoff)
        if cutoff < math.inf:
            pruned = seen["states"]
            seen["states"] = 0
            want = exact(self, slots, m, n, incumbent)
            if want.surrogate < cutoff:
                assert [(a, e, c.option) for a, e, c in got.stages] == [(a, e, c.option) for a, e, c in want.stages]
            else:
                assert got is incumbent
            totals["pruned"] += pruned
            totals["unpruned"] += seen["states"]
            totals["calls"] += 1
        return got

    monkeypatch.setattr(split_module, "_pareto", counted)
    monkeypatch.setattr(Splitter, "_exact", checked)
    plan = Search(cm, work_limit=None).run()
    assert totals["calls"] >= 5, totals
    assert totals["pruned"] < 0.75 * totals["unpruned"], totals
    plain_split = Splitter.split
    monkeypatch.setattr(Splitter, "split", lambda self, *a, **k: plain_split(self, *a, **{**k, "prune": False}))
    assert plan.to_json() == Search(cm, work_limit=None).run().to_json()
