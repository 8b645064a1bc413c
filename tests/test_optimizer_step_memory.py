"""The optimizer step's own buffers on the device are priced (cost_models/memory.py `optimizer_step_bytes`).

On the CPU torch's AdamW updates one tensor at a time and holds two fp32 buffers of the tensor it updates (the
root of its second moment and the quotient), so a model whose largest tensor is a big embedding table peaks in
the step: measured at the allocator over compile + 3 steps (the plan's own check, torch.profiler memory
events), the peak is within 5 % of the prediction (measured: 1.00002x) only with those buffers priced (1.13x).
"""

from __future__ import annotations

import autopar
from autopar import models

from .runtime_cases import optimizer


def test_a_big_embedding_peaks_in_the_step_as_priced() -> None:
    case = models.gpt(seed=0, batch=2, seq=8, vocab=8192, hidden=64, layers=1, heads=2)
    plan = autopar.estimate(case.model, "1x1xcpu", autopar.Strategy(), case.example_inputs, case.example_target,
                            case.loss_fn, precision="fp32").plan
    prog = autopar.compile(case.model, "1x1xcpu", case.example_inputs, case.example_target, case.loss_fn,
                           optimizer, plan=plan.to_json(), timeout_s=60)
    for _ in range(3):
        prog.step(*case.example_inputs, target=case.example_target)
    (r,) = prog.report().ranks
    assert r.measured_peak_bytes is not None and "optimizer step" in r.peak_in, r
    # measured 1.00002; 1.13 without the step's buffers priced
    assert abs(r.ratio - 1) <= 0.05, r
