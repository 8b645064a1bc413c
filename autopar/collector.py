"""CPython's cyclic garbage collector, paused around the work that builds many long-lived objects.

A capture (torch.export's fx nodes and fake tensors) and the planner's search (its memo tables of ranges, options
and splits) allocate millions of small objects that stay alive until the call returns. Every full collection the
allocations trigger re-traverses all of them, and a forked search worker's collections also write to each object it
inherited (copying the parent's pages). Measured on bench/plan_identity.py's cases (2026-12-07, this 2-core host):
20-30 % of `autopar.plan`'s time. Reference counting still frees everything outside a cycle while paused; cycles
made meanwhile (by any thread: the collector is the process's) are left to the first collection after. The same
pause as torch.distributed.checkpoint's `state_dict` takes around its many small objects (`_gc_context`), and what
`gc.freeze`'s documentation recommends for a parent process that forks. Peak memory of the planning process: +4-10 %
(GPT-3 175B, Llama 7B, transformers' Llama).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The block runs with the cyclic collector off; the state found is restored after (nesting is fine)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


__all__ = ["collector_paused"]
