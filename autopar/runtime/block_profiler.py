"""Time each distinct block of a model on the devices of this machine (`autopar profile`, issue 25 part 2).

The model is captured at each micro-batch size asked for and split into one program per layer
(codegen/split.py, the programs the runtime runs per stage), so a layer runs exactly as a pipeline stage
holding it alone would: its parameters, the user inputs it reads, the values it receives. The layers run as
a chain, as a pipeline of one-layer stages runs them (`_time_chain`): the forwards in order on the values the
layer before made, the backwards in reverse from the gradients the layer after gave, the forwards again as
recompute runs them, so each is timed with the other layers' traffic through the caches, as in a step (a
layer timed alone, over and over, keeps its weights in the caches: 1.2-1.4x faster than in the step on this
CPU for small blocks). Each figure is the median of `repeats` after a warm-up, with a host sync around each
pass on a GPU (CUDA events would hide the host issuing time the floor is about); the layers of one class (the
repeated blocks of one signature; the layers before and after them are their own) share the median of their
members' figures. Each layer's optimizer step over its own parameters (`optimizer`, as the runtime builds it)
is timed in the chain too, after the backwards, on their gradients (alone and repeated, AdamW's step over one
block of the bench's models ran 1.5x faster, its state in the caches). Peak memory is what the allocator held
above the inputs during one layer's forward + backward, run alone (`torch.cuda.max_memory_allocated`, or
torch.profiler memory events on the CPU: runtime/memtrace.py).

Device types: a cluster type of kind `cpu` is timed on this host's CPU; a GPU type on a local GPU whose
name names it (`torch.cuda.get_device_name`). Types this machine has no device of are left out and
reported (`BlockProfile.meta["not_profiled"]`): the planner prices them analytically. Tensor parallelism
is not measured (one device per type): degrees above 1 stay analytic.

The work is bounded by `budget_s`: sizes are timed smallest first, and where the budget runs out the
larger sizes are left out (and listed in meta["skipped"]): the pricing interpolates and extrapolates
between the sizes measured (cost_models/measured_blocks.py).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..cluster import Cluster
from ..codegen.split import StageProgram, split_stages
from ..cost_models.measured_blocks import BlockProfile, Entry, Point
from ..cost_models.memory import optimizer_name
from ..errors import PlanError
from ..ir.graph import TrainingGraph
from ..passes.capture import capture
from .memtrace import track_memory
from .program import batch_slice, make_optimizer

# layers per timed chain (`_time_chain`): a chain holds its layers' weights and activations at once, so a model
# larger than one device is timed in windows of this many consecutive layers (a window's first layer receives
# random values)
CHAIN = 8


def default_sizes(batch: int) -> list[int]:
    """Micro-batch sizes to time by default: the powers of two below the batch, and the batch itself."""
    return sorted({2**k for k in range(int(math.log2(batch)) + 1)} | {batch})


def local_devices(cluster: Cluster) -> tuple[dict[str, torch.device], dict[str, str]]:
    """(device type -> the local device it is timed on, device type -> why it is not) for `cluster`'s types."""
    found: dict[str, torch.device] = {}
    missing: dict[str, str] = {}
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() \
        else []
    for t in cluster.device_types():
        spec = cluster.spec(t)
        if spec.kind == "cpu":
            found[t] = torch.device("cpu")
            continue
        key = spec.name.split("-")[0].lower()
        hit = next((i for i, g in enumerate(gpus) if key in g.lower().replace(" ", "")), None)
        if hit is None:
            missing[t] = (f"no local device of type {t} (local GPUs: {', '.join(gpus) or 'none'}): priced "
                          f"analytically; profile it on a machine that has one")
        else:
            found[t] = torch.device("cuda", hit)
    return found, missing


def _tensor(meta: Any, device: torch.device, grad: bool) -> torch.Tensor:
    dtype = getattr(torch, meta.dtype)
    if dtype.is_floating_point:
        t = torch.randn(meta.shape, dtype=dtype, device=device) * 0.02
        return t.requires_grad_(grad)
    if dtype == torch.bool:
        return torch.ones(meta.shape, dtype=dtype, device=device)
    return torch.zeros(meta.shape, dtype=dtype, device=device)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return {k: v for k, v in named.items() if not v.is_meta}


class _Runner:
    """One layer's program with its arguments on one device."""

    def __init__(self, st: StageProgram, graph: TrainingGraph, weights: dict[str, torch.Tensor],
                 user: tuple, device: torch.device) -> None:
        self.st, self.device = st, device
        metas = {graph.canonical(k): info.meta for k, info in graph.params.items()}
        args: list[torch.Tensor] = []
        self.leaves: list[torch.Tensor] = []
        for name in st.params:
            w = weights.get(name)
            t = (w.detach().to(device).clone().requires_grad_(w.dtype.is_floating_point) if w is not None
                 else _tensor(metas[name], device, True))
            args.append(t)
            self.leaves.append(t)
        self.params = {name: t for name, t in zip(st.params, self.leaves, strict=True) if t.requires_grad}
        for name in st.buffers:
            w = st.constants.get(name, weights.get(name))
            args.append(w.to(device) if w is not None else _tensor(metas[name], device, False))
        for i in st.inputs:
            x = user[i]
            args.append(x.to(device) if isinstance(x, torch.Tensor) else x)
        for name in st.recv:
            t = _tensor(st.value_meta[name], device, graph.nodes[name].requires_grad)
            args.append(t)
            if t.requires_grad:
                self.leaves.append(t)
        self.args = args

    def forward(self) -> Any:
        return self.st.gm(*self.args)

    def backward(self, out: Any) -> None:
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(o, torch.Tensor) and o.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        for t in self.leaves:
            t.grad = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _layer_optimizers(runs: list[_Runner], owned: list[set[str]], optimizer: Any) -> list[Any]:
    """One `optimizer` per layer of `runs` over the parameters it owns (a parameter several layers read, a tied
    embedding, steps with the first that reads it), as the runtime builds one over a stage's; None for a layer
    that owns none."""
    out: list[Any] = []
    for run, names in zip(runs, owned, strict=True):
        params = [p for name, p in run.params.items() if name in names]
        out.append(make_optimizer(optimizer, params) if params else None)
    return out


def _timed(device: torch.device, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """fn(*args)'s result and its seconds, the device synced before and after (a GPU's queued work counted)."""
    _sync(device)
    t = time.perf_counter()
    out = fn(*args)
    _sync(device)
    return out, time.perf_counter() - t


def _backward(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Backward from each (output, its gradient) pair, if any."""
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _chain_pass(runs: list[_Runner]) -> tuple[list[float], list[float], list[float]]:
    """One timed pass of `_time_chain`: (forward, backward, recompute seconds) per layer. The layers' parameter
    gradients are left as the pass made them."""
    dev = runs[0].device
    values: dict[str, torch.Tensor] = {}

    def received(run: _Runner) -> tuple[list[Any], list[torch.Tensor]]:
        """The run's arguments before its received values, and those values: the previous layer's outputs
        (detached: each layer's backward is its own), or the run's own stand-ins at a chain's start."""
        k = len(run.st.recv)
        own = run.args[len(run.args) - k:]
        return run.args[:len(run.args) - k], [values[n].detach().requires_grad_(values[n].requires_grad)
                                               if n in values else a for n, a in zip(run.st.recv, own, strict=True)]

    fwd, bwd, rc, done = [], [], [], []
    for run in runs:
        args, recv = received(run)
        out, seconds = _timed(dev, run.st.gm, *args, *recv)
        fwd.append(seconds)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if not run.st.is_last:
            values.update(zip(run.st.send, outs, strict=True))
        done.append((outs, recv))
    grads: dict[str, torch.Tensor] = {}
    for run, (outs, recv) in zip(reversed(runs), reversed(done), strict=True):
        st = run.st
        # the model's loss, and the outputs of a chain's last layer (no layer after it here), from ones
        end = st.is_last or run is runs[-1]
        names = [None] * len(outs) if st.is_last else st.send
        pairs = [(o, torch.ones_like(o) if end else grads[n]) for o, n in zip(outs, names, strict=True)
                 if isinstance(o, torch.Tensor) and o.requires_grad and (end or n in grads)]
        bwd.append(_timed(dev, _backward, pairs)[1])
        grads.update({n: v.grad for n, v in zip(st.recv, recv, strict=True) if v.grad is not None})
    bwd.reverse()
    del done, grads
    for run in runs:  # recompute: the same programs again, on the values they received
        args, recv = received(run)
        rc.append(_timed(dev, run.st.gm, *args, *recv)[1])
    return fwd, bwd, rc


def _time_chain(runs: list[_Runner], repeats: int, optimizers: list[Any]
                ) -> list[tuple[float, float, float, float | None]]:
    """(forward, backward, recompute, optimizer step seconds) of each layer of `runs` (consecutive layers, in
    order), run as a pipeline of one-layer stages would run them (`_chain_pass`): the forwards in order, each
    layer's received values the previous one's outputs, then the backwards in reverse, each from the gradients
    of the layer after it, then the forwards again (recompute), then each layer's optimizer step (`optimizers`,
    None where a layer owns no parameter) on the gradients the pass made, in order, as a stage's one optimizer
    steps its layers' parameters after the schedule. A layer timed alone, over and over, keeps its weights,
    activations and optimizer state in the caches; in a step the other layers' traffic evicts them (on this CPU
    1.2-1.4x slower forward and backward for blocks of hidden 128, about the same for hidden 256; AdamW's step
    over one block 1.5x slower: bench/measured_blocks.py's models). The median of `repeats` after a warm-up."""
    leaves = [t for run in runs for t in run.leaves]
    dev = runs[0].device

    def once() -> tuple[list[float], list[float], list[float], list[float | None]]:
        fwd, bwd, rc = _chain_pass(runs)
        steps: list[float | None] = []
        for opt in optimizers:
            steps.append(None if opt is None else _timed(dev, opt.step)[1])
        for t in leaves:
            t.grad = None
        return fwd, bwd, rc, steps

    for _ in range(2):  # warm-up: allocator pools, lazy kernels, autotuning, the optimizers' state
        once()
    timed = [once() for _ in range(repeats)]
    out: list[tuple[float, float, float, float | None]] = []
    for i in range(len(runs)):
        f, b, r = (statistics.median(t[kind][i] for t in timed) for kind in range(3))  # type: ignore[misc]
        out.append((f, b, r, None if optimizers[i] is None else statistics.median(t[3][i] for t in timed)))
    return out


def _peak(run: _Runner) -> float:
    """Bytes one layer's forward + backward allocates above its inputs, timed alone (the allocator's peak)."""
    dev = run.device
    run.backward(run.forward())  # warm-up: lazy kernels allocate on their first call
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        run.backward(run.forward())
        _sync(dev)
        return float(torch.cuda.max_memory_allocated(dev) - base)
    with track_memory("cpu") as trace:
        run.backward(run.forward())
    return float(trace.peak_bytes)


def profile_blocks(model: nn.Module, cluster: Cluster | str | dict, example_inputs: tuple = (),
                   example_target: Any = None, loss_fn: Any = None, *, precision: str = "fp32",
                   microbatch_sizes: list[int] | None = None, budget_s: float = 120.0,
                   repeats: int = 5, optimizer: Any = "adamw",
                   progress: Callable[[int, int, str], None] | None = None) -> BlockProfile:
    """Time each distinct layer of `model` at each micro-batch size (default `default_sizes` of the global
    batch) on the local devices of `cluster`'s types (module docstring), and one `optimizer` step over its
    parameters, within about `budget_s`. `progress(done, total, what)` is called after each layer timed (and
    for those the budget leaves out): timings done of the total, and what was timed."""
    if precision != "fp32":
        raise PlanError(f"autopar profile times fp32 programs only for now (precision={precision!r}); "
                        f"profile with precision='fp32' and price other precisions analytically.")
    if budget_s <= 0:
        raise PlanError(f"budget_s must be positive, got {budget_s!r}.")
    cluster = Cluster.load(cluster)
    opt_name = optimizer_name(optimizer)
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    t_start = time.perf_counter()
    graph = capture(model, inputs, loss_fn, example_target)
    B = graph.batch_size
    sizes = sorted(set(microbatch_sizes or default_sizes(B)))
    bad = [n for n in sizes if not isinstance(n, int) or n < 1 or n > B]
    if bad:
        raise PlanError(f"microbatch_sizes {bad} are not between 1 and the batch's {B} samples.")
    devices, missing = local_devices(cluster)
    if not devices:
        raise PlanError("none of the cluster's device types is on this machine: "
                        + "; ".join(missing.values()))
    layers = [{"kind": layer.kind, "signature": str(layer.signature)} for layer in graph.layers]
    classes: dict[tuple, list[int]] = {}
    for i, layer in enumerate(graph.layers):
        key = (layer.kind, str(layer.signature)) if layer.kind == "block" else (layer.kind, i)
        classes.setdefault(key, []).append(i)
    weights = _weights(model)
    day = time.strftime("%Y-%m-%d")
    points: dict[tuple[str, int], list[Point]] = {}
    steps: dict[tuple[str, int], tuple[list[float], int]] = {}
    skipped: list[str] = []
    total = len(sizes) * len(devices) * len(classes)
    done = 0
    for n in sizes:
        if time.perf_counter() - t_start > budget_s and any(points.values()):
            skipped += [f"micro-batch {n} on {t}" for t in devices]
            done += len(devices) * len(classes)
            if progress is not None:
                progress(done, total, f"micro-batch {n} left out (budget)")
            continue
        user = tuple(batch_slice(x, B, 0, n) for x in inputs) + (batch_slice(example_target, B, 0, n),)
        g = graph if n == B else capture(model, user[:-1], loss_fn, user[-1])
        if len(g.layers) != len(graph.layers):
            raise PlanError(f"capturing at micro-batch size {n} gave {len(g.layers)} layers, not "
                            f"{len(graph.layers)}: the model's structure depends on the batch size.")
        programs = split_stages(g, [(i, i + 1) for i in range(len(g.layers))])
        first: dict[str, int] = {}
        for i, st in enumerate(programs):
            for name in st.params:
                first.setdefault(name, i)
        owned = [{name for name in st.params if first[name] == i} for i, st in enumerate(programs)]
        for t, dev in devices.items():
            timed: dict[int, tuple[float, float, float, float | None]] = {}
            for w0 in range(0, len(programs), CHAIN):
                runs = [_Runner(st, g, weights, user, dev) for st in programs[w0:w0 + CHAIN]]
                optimizers = _layer_optimizers(runs, owned[w0:w0 + CHAIN], optimizer)
                timed.update(enumerate(_time_chain(runs, repeats, optimizers), w0))
                del runs, optimizers
            for members in classes.values():
                run = _Runner(programs[members[0]], g, weights, user, dev)
                # a class's figure: the median over its members, each timed in its place in the chain
                f, b, r = (statistics.median(timed[i][k] for i in members) for k in range(3))
                points.setdefault((t, members[0]), []).append(Point(n, f, b, r, _peak(run)))
                # the step does not depend on the micro-batch: its figure is the median over every size's chain
                elements = sum(p.numel() for name, p in run.params.items() if name in owned[members[0]])
                if elements:
                    steps.setdefault((t, members[0]), ([], elements))[0].extend(
                        timed[i][3] for i in members if timed[i][3] is not None)
                del run
                done += 1
                if progress is not None:
                    progress(done, total, f"{t}, micro-batch {n}, layer {members[0]}")
    prof = BlockProfile(layers, meta={
        "torch": torch.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "budget_s": budget_s,
        "spent_s": round(time.perf_counter() - t_start, 2), "microbatch_sizes": sizes, "repeats": repeats,
        "devices": {t: str(d) for t, d in devices.items()}, "not_profiled": missing, "skipped": skipped,
        "tensor_parallel": "degree 1 measured; higher degrees priced analytically"}, name="autopar profile")
    for t, dev in devices.items():
        for members in classes.values():
            pts = points.get((t, members[0]), [])
            stepped, elements = steps.get((t, members[0]), ([], 0))
            step_s = statistics.median(stepped) if stepped else None
            for i in members:
                prof.add(Entry(t, i, 1, precision, list(pts), f"measured by autopar profile on {dev} ({day})",
                               step_s, opt_name, elements if step_s is not None else None))
    return prof


__all__ = ["default_sizes", "local_devices", "profile_blocks"]
