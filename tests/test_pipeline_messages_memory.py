"""A pipeline whose stages hold one block each at a long sequence, where a stage's messages (its output kept for
the backward, the received gradient, send buffers) and its backward's op gradients are a large part of its peak
(bench/long_context.py's pp 4 rows were 1.45-1.50x their prediction before these were priced and the runtime
released sends per batch): every rank's peak at the allocator, compile included, within 15 % of the plan."""

from __future__ import annotations

from autopar.runtime.launch import spawn_local

KW = dict(hidden=64, heads=4, layers=2, vocab=256, batch=2, seq=1024)


def _run(rank: int, world: int) -> list[float]:
    import autopar
    from autopar import Strategy, models

    case = models.gpt(**KW, seed=0)
    prog = autopar.compile(case.model, "1x4xcpu", case.example_inputs, case.example_target, case.loss_fn, "adamw",
                           plan=Strategy(pp=4, layer_split=[0, 1, 1, 0], microbatch_size=1), timeout_s=120)
    for _ in range(2):
        prog.step(*case.example_inputs, target=case.example_target)
    return [r.ratio for r in prog.report().ranks]


def test_one_block_stages_at_a_long_sequence_stay_within_their_predicted_peak() -> None:
    ratios = spawn_local(_run, 4, timeout_s=300)
    for rank, rs in enumerate(ratios):
        assert all(abs(x - 1) <= 0.15 for x in rs), (rank, rs)
