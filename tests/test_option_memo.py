"""The cost model's memo tells a stage recomputing all its blocks (recompute=True) from one recomputing its
first block (recompute=1): in Python True == 1, so an Option used as a key would share their entries, and
whichever was priced first would be returned for both (a plan recomputing all blocks was once priced with
one block's savings). Each is checked against a fresh cost model that prices only that option."""

from __future__ import annotations

from autopar.api import cost_model
from autopar.models import gpt
from autopar.solver.pricing.pricing import Option


def _cm():
    mc = gpt(batch=4, seq=32, vocab=256, hidden=64, layers=4, heads=4, device="meta")
    return cost_model(mc.model, "1x2xA100-80GB", mc.example_inputs, mc.example_target, mc.loss_fn)


def test_recompute_all_and_first_block_are_priced_apart_in_any_order() -> None:
    cm = _cm()
    dtype = cm.cluster.devices[0].spec.name
    a, e = cm.first_block, cm.first_block + 3  # three blocks: "all" and "the first one" differ
    tp, dp = (0,), (0, 1)
    base = cm.base(a, e, dtype, 2, tp)
    all_first = [cm.stage_times(base, Option(1, True), dtype, tp, dp), cm.stage_memory(base, Option(1, True), 1, 2)]
    one_after = [cm.stage_times(base, Option(1, 1), dtype, tp, dp), cm.stage_memory(base, Option(1, 1), 1, 2)]
    fresh = _cm()
    fbase = fresh.base(a, e, dtype, 2, tp)
    one_alone = [fresh.stage_times(fbase, Option(1, 1), dtype, tp, dp), fresh.stage_memory(fbase, Option(1, 1), 1, 2)]
    assert one_after == one_alone
    assert one_after[0].bwd < all_first[0].bwd  # one block's forward recomputed, not three
    assert one_after[1].act > all_first[1].act  # two blocks' activations kept
    three = [cm.stage_times(base, Option(1, 3), dtype, tp, dp), cm.stage_memory(base, Option(1, 3), 1, 2)]
    assert three == all_first  # 3 of 3 blocks is "all"
