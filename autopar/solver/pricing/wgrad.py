"""The weight-gradient share of a stage's backward, from the graph: what a zero-bubble schedule's W runs.

A zero-bubble schedule (schedule.py, `zb_h1`) splits each backward into B, the input gradients the previous
stage waits for, and W, the parameters' gradients. For a linear layer both are one matmul of the same FLOPs
(dX = dY W^T and dW = X^T dY, 2 n d_in d_out each), so W is about half of a matmul-dominated backward; the
rest of a block (attention's score matmuls, softmax, norms, activations) has no weights and stays in B.

Which recorded backward kernels are weight gradients: per node, for each parameter it reads, the last of its
backward kernels whose output has the parameter's element count (autograd computes a node's gradients in
argument order, the weight after the input, e.g. addmm's mat1 then mat2; an embedding's backward is its
weight's gradient). The share is their time over the layer range's backward compute time, both priced by
the device's compute model at the captured batch (`CostModel.layer_compute`); a stage's W time (`bwd_w_s`,
pricing.py, and the search's 7th stage time, split.py) is that share of its priced backward, the same in
both, so the search ranks zero-bubble plans as `price` prices them. (The share is applied to the whole
backward: a tensor-parallel stage's backward all-reduces, which belong to B, are shared out too.)
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from typing import TYPE_CHECKING

from ...cost_models.compute import kernel_flops

if TYPE_CHECKING:
    from .pricing import CostModel


def _wgrad_kernels(cm: CostModel, layer: int) -> tuple[tuple[tuple[str, float, float], int], ...]:
    """(kind, flops, bytes) -> count of the layer's weight-gradient backward kernels (module docstring)."""
    g = cm.graph
    found: Counter = Counter()
    for name in g.layers[layer].nodes:
        node = g.nodes[name]
        sizes = [g.params[a].meta.numel for a in node.args if a in g.params and not g.params[a].is_buffer]
        claimed: set[int] = set()
        for numel in sizes:
            for j in range(len(node.kernels_bwd) - 1, -1, -1):
                k = node.kernels_bwd[j]
                if j not in claimed and k.elems == numel and kernel_flops(k) + k.nbytes > 0:
                    claimed.add(j)
                    found[(k.kind, kernel_flops(k), k.nbytes)] += 1
                    break
    return tuple(sorted(found.items()))


def wgrad_share(cm: CostModel, a: int, e: int, dtype: str) -> float:
    """The weight-gradient share (0..1) of the backward compute of layers [a, e) on device type `dtype`."""
    n = cm.B

    def share() -> float:
        op_time = cm.models[dtype].op_time
        scale = n / cm.B
        w = b = 0.0
        for i in range(a, e):
            kernels = cm.memoised(("wk", cm.cls[i]), partial(_wgrad_kernels, cm, i))
            w += sum(c * op_time(kind, f * scale, nb * scale) for (kind, f, nb), c in kernels)
            b += cm.layer_compute(i, dtype, n, 1)[1]
        return min(w / b, 1.0) if b > 0 else 0.0

    return cm.memoised(("wgrad", cm.range_key(a, e), dtype), share)


def zero_bubble_backward(cm: CostModel, a: int, e: int, dtype: str, bwd: float, recompute_s: float,
                         first: bool) -> tuple[float, float]:
    """(backward seconds, their W part) of a stage of layers [a, e) under a zero-bubble schedule, from its
    priced backward `bwd` (which includes `recompute_s`, its recomputed blocks' forward, once). B and W each
    need the recomputed activations: runtime/split_backward.py recomputes in B and again in W, so the
    backward is priced one recompute longer than under 1F1B, W being the weight-gradient share of the rest
    plus that recompute. The pipeline's first stage sends no input gradient: its whole backward runs as one
    (in W), with one recompute."""
    share = wgrad_share(cm, a, e, dtype)
    if first or recompute_s <= 0.0:
        return bwd, share * bwd
    return bwd + recompute_s, share * (bwd - recompute_s) + recompute_s


__all__ = ["wgrad_share", "zero_bubble_backward"]
