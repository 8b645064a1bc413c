"""Generated Triton kernels per fused region kind: time against eager and torch.compile (inductor) on a GPU;
on a machine without CUDA, correctness only (max abs error vs eager through the Triton interpreter).

Each case is captured to the export training IR (what autopar's stage programs run), fused with
apply_kernels, and run forward + backward. Times are medians of CUDA-event-timed repeats.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import print_table, write_results
from torch import nn

from autopar.codegen.kernels import apply_kernels

CUDA = torch.cuda.is_available()
R, H, V = (8192, 1024, 8192) if CUDA else (256, 96, 512)  # rows, hidden, classes; small under the interpreter


Case = tuple[Callable, list[tuple[int, ...]], dict]


def cases(rows: int = R, hidden: int = H, classes: int = V) -> dict[str, Case]:
    """region kind -> (function, input shapes, integer inputs {index: (high, shape)})."""
    R, H, V = rows, hidden, classes
    return {
        "elementwise": (lambda x, y: torch.tanh(x) * torch.sigmoid(y) + x * 0.5 - torch.exp(-y.abs()),
                        [(R, H), (R, H)], {}),
        "bias_act": (lambda x, w, b: F.gelu(F.linear(x, w, b)), [(R, H), (4 * H, H), (4 * H,)], {}),
        "residual_norm": (lambda x, y, w, b: F.layer_norm(x + y, (H,), w, b),
                          [(R, H), (R, H), (H,), (H,)], {}),
        "rms_norm": (lambda x, y, w: F.rms_norm(x + y, (H,), w, 1e-6), [(R, H), (R, H), (H,)], {}),
        "softmax": (lambda x: (x * 0.125).softmax(-1), [(R, H)], {}),
        "dropout": (lambda x, y: F.dropout(x, 0.1, True) + y, [(R, H), (R, H)], {}),
        "cross_entropy": (lambda x, t: F.cross_entropy(x, t), [(R, V), (R,)], {1: (V, (R,))}),
    }


class _Fn(nn.Module):
    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.fn(*xs)


def _inputs(shapes: list, ints: dict, device: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    xs = [torch.randn(s, device=device) for s in shapes]
    for i, (high, shape) in ints.items():
        xs[i] = torch.randint(0, high, shape, device=device)
    return xs


def _step(fn: Callable, xs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    xs = [x.detach().requires_grad_(x.is_floating_point()) for x in xs]
    torch.manual_seed(1)
    out = fn(*xs)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    diff = [x for x in xs if x.requires_grad]
    gen = torch.Generator(outs[0].device).manual_seed(2)
    ups = [torch.randn(o.shape, device=o.device, generator=gen) for o in outs]
    grads = torch.autograd.grad(outs, diff, ups)
    return [o.detach() for o in outs], list(grads)


def cuda_ms(call: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of `call()` timed by CUDA events, after `warmup` calls."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _time_ms(fn: Callable, xs: list[torch.Tensor], reps: int = 20) -> float:
    return cuda_ms(lambda: _step(fn, xs), reps)


def check(kind: str, case: Case, device: str, timed: bool, inductor: bool = True) -> dict:
    """One region kind: capture, fuse with apply_kernels("triton"), compare forward and gradients with the
    unfused graph (not for dropout) and, when `timed` (CUDA), median ms of eager, fused (and inductor)."""
    fn, shapes, ints = case
    xs = _inputs(shapes, ints, device)
    gm = torch.export.export(_Fn(fn), tuple(xs), strict=False).graph_module
    fused, report = apply_kernels(gm, "triton")
    row: dict = {"kind": kind, "shape": "x".join(map(str, shapes[0])),
                 "regions": ",".join(r.kind for r in report.fused) or "-"}
    if kind != "dropout":  # a different random stream than torch's: compared by its own test
        ref_out, ref_grads = _step(gm, xs)
        out, grads = _step(fused, xs)
        err = lambda xs, ys: max((a - b).abs().max().item() for a, b in zip(xs, ys, strict=True))
        row["max_abs_err_fwd"], row["max_abs_err_bwd"] = err(out, ref_out), err(grads, ref_grads)
        row["max_rel_err"] = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
                                 for a, b in zip(out + grads, ref_out + ref_grads, strict=True))
    # forward bytes the cost model prices: as separate torch ops, as the fused kernel(s)
    row["bytes_torch"] = sum(r.bytes_before for r in report.fused)
    row["bytes_fused"] = sum(r.bytes_after for r in report.fused)
    notes = [n for r in report.regions for n in r.notes]
    row["kernels_ran"] = "no: " + notes[0][:60] if notes else "yes"  # a failed kernel falls back to torch
    if timed:
        row["eager_ms"] = _time_ms(fn, xs)
        row["kernel_ms"] = _time_ms(fused, xs)
        row["speedup_vs_eager"] = row["eager_ms"] / row["kernel_ms"]
        if inductor:
            row["inductor_ms"] = _time_ms(torch.compile(fn), xs)
            row["speedup_vs_inductor"] = row["inductor_ms"] / row["kernel_ms"]
    return row


def main() -> None:
    device = "cuda" if CUDA else "cpu"
    rows = []
    for kind, case in cases().items():
        rows.append(check(kind, case, device, timed=CUDA))
        print(f"{kind}: done", file=sys.stderr)
    cols = ["kind", "shape", "regions", "kernels_ran", "bytes_torch", "bytes_fused", "max_abs_err_fwd",
            "max_abs_err_bwd", "max_rel_err"]
    if CUDA:
        cols += ["eager_ms", "kernel_ms", "inductor_ms", "speedup_vs_eager", "speedup_vs_inductor"]
    print_table(rows, cols)
    summary = {"device": torch.cuda.get_device_name(0) if CUDA else "cpu (Triton interpreter)", "timed": CUDA,
               "max_rel_err": max(r["max_rel_err"] for r in rows if "max_rel_err" in r), "kinds": len(rows)}
    if CUDA:
        for k in ("speedup_vs_eager", "speedup_vs_inductor"):
            summary[f"geomean_{k}"] = statistics.geometric_mean(r[k] for r in rows)
    else:
        summary["note"] = ("no CUDA device: GPU timings (kernel vs eager vs inductor) are not available here; "
                           "kernels ran in the Triton interpreter, correctness only")
        print("\nNo CUDA device: kernels ran in the Triton interpreter, so only correctness is reported "
              "(max abs error vs eager, forward and gradients); GPU timings are not available here.")
    print("wrote", write_results("fused_kernels", rows, summary))


if __name__ == "__main__":
    main()
