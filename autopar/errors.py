"""Errors autopar raises for bad input: each names what is wrong and what would fix it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class ClusterError(AutoparError, ValueError):
    """A cluster description is malformed or names something unknown."""


class CaptureError(AutoparError, RuntimeError):
    """A model could not be captured into a graph."""


class PlanError(AutoparError, ValueError):
    """A plan or strategy is inconsistent with the model or the cluster."""


class InfeasibleError(AutoparError, RuntimeError):
    """No plan fits the cluster's memory (or other hard limits)."""


class RendezvousError(AutoparError, RuntimeError):
    """The process group did not form: a rank started too late or cannot reach the others."""


class KernelError(AutoparError, RuntimeError):
    """A generated kernel failed to build or launch where kernels="triton" forces Triton."""


class KernelFallbackWarning(RuntimeWarning):
    """A fused region runs its torch ops instead of its generated kernel (the kernel failed on its first
    use, or the region does not lower at the actual shapes); the message names the region, its ops and
    the error, and the kernel report (`Program.dump`) records it."""


class UnpricedOpWarning(UserWarning):
    """The cost model could not measure an op of the captured graph (no meta kernel, or no FLOP formula at
    its arguments) and priced it by its bytes instead: 0 FLOPs, one read of its inputs and one write of its
    output, nothing saved for backward. The message names each such op and the price used; the plan's time
    (and memory, if the op saves tensors) for it may be low."""


class PrecisionChangeWarning(UserWarning):
    """autopar chose a precision (`autopar.default_precision`: bf16/fp16 autocast on GPU clusters) that computes
    differently from the model's own dtype; the message names what each device type computes in and how to
    keep the model's math (precision="fp32")."""


class PlanFallbackWarning(UserWarning):
    """What the planner chose could not be used and the program runs something simpler instead (the
    torch.compile backend's data parallelism when planning or building the tensor-parallel graph failed);
    the message gives the reason."""


class FusedKernelWarning(UserWarning):
    """Generated Triton kernels replace fused regions of the program (kernels="auto" on CUDA, or "triton"); they
    compute what the torch ops compute, but round differently: the message says how (evaluation order, fp32
    intermediates under autocast; dropout is never fused, its masks are autopar's keyed ones) and that
    kernels="torch" keeps torch's ops."""


class RandomnessWarning(UserWarning):
    """A random op of the model draws from torch's generator, not autopar's plan-invariant keyed stream
    (passes/randomness.py): its values depend on the plan."""


class PlanDriftWarning(UserWarning):
    """A rank's measured peak memory exceeded its plan's prediction by more than 15 % or its device's capacity
    (runtime/plan_check.py): the memory model priced the plan wrong. The message names the rank, the figures
    and the plan options of its stages."""


def close_matches(word: str, choices: Iterable[str], n: int = 3) -> str:
    """A ' Did you mean ...?' suffix, or '' when nothing is close."""
    choices = list(choices)
    lowered = {c.lower(): c for c in choices}
    found = difflib.get_close_matches(word.lower(), list(lowered), n=n, cutoff=0.5)
    if not found:
        return ""
    return " Did you mean " + " or ".join(repr(lowered[f]) for f in found) + "?"
