"""`torch.compile(model, backend="autopar")`: kernel fusion and memory planning for the local device.

Registered through the `torch_dynamo_backends` entry point (pyproject.toml), so the name works right after
`pip install` without importing autopar. Each graph dynamo captures (graph breaks give several) goes
through AOT autograd: the partitioner keeps the saved activations within the device's memory (switching to
torch's min-cut recomputation partitioner when they do not fit), and `apply_kernels` fuses the forward and
backward graphs. Options (`torch.compile(..., options={...})`):

* cluster: a cluster (anything `Cluster.load` takes); this process's device (its rank's) gives the memory
  budget. Without it the budget is the CUDA device's memory, or none on CPU.
* dump_dir: writes graphs.txt (captured graphs, op counts, where breaks split the model, memory
  decisions) and graph_<i>/{forward,backward}/ with regions.txt and the kernels.
* kernels: "auto" (Triton on CUDA, torch on CPU), "triton" or "torch".
* recompute: "auto" (by the memory budget), True or False.

Under an initialized process group with several ranks the backend trains data-parallel: every rank runs
its captured graphs on its own batch, rank 0's parameters are broadcast when first seen, and gradients
are averaged over all ranks at the end of each backward (one flat all-reduce). Pipeline and tensor
parallel plans are `autopar.compile`'s job, not this backend's.
"""

from __future__ import annotations

import inspect
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from .errors import PlanError, close_matches
from .runtime.dist import all_reduce, broadcast

OPTIONS = ("cluster", "dump_dir", "kernels", "recompute")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


@dataclass
class GraphRecord:
    """What the backend did with one captured graph."""

    index: int
    ops: int
    first: str = ""  # user source line of its first and last op
    last: str = ""
    params: int = 0
    memory: str = "memory: not planned (no budget: pass options={'cluster': ...})"
    recompute: bool = False
    saved_bytes: int = 0
    kernels: dict[str, Any] = field(default_factory=dict)  # "forward"/"backward" -> KernelReport

    def line(self) -> str:
        k = "; ".join(f"{w}: {len(r.fused)}/{len(r.regions)} regions fused" for w, r in self.kernels.items())
        where = f" ({self.first} .. {self.last})" if self.first else ""
        k = k or "no aten graph (AOT autograd compiled nothing)"
        return f"graph {self.index}: {self.ops} ops{where}, {self.params} parameters; {k}\n    {self.memory}"


_LOGS: dict[str, list[GraphRecord]] = {}


def graphs(dump_dir: str | Path | None = None) -> list[GraphRecord]:
    """Records of the graphs compiled with this dump_dir (None: compiled without one), oldest first."""
    return _LOGS.get(str(dump_dir) if dump_dir is not None else "", [])


def _write_log(dump: Path | None, log: list[GraphRecord]) -> None:
    if dump is None:
        return
    dump.mkdir(parents=True, exist_ok=True)
    breaks = f"{len(log) - 1} graph break(s) split the model between them" if len(log) > 1 else \
        "no graph breaks"
    dp = f"; data-parallel over {_world()} ranks, gradients averaged after each backward" \
        if _world() > 1 else ""
    lines = [f'torch.compile(backend="autopar"): {len(log)} graph(s) captured; {breaks} '
             f"(recompiles also add graphs){dp}"] + [r.line() for r in log]
    (dump / "graphs.txt").write_text("\n".join(lines) + "\n")


def _source(node: fx.Node) -> str:
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    return f"{Path(frames[-1][0]).name}:{frames[-1][1]}" if frames else ""


def _options(options: dict | None) -> dict[str, Any]:
    opts = dict(options or {})
    for k in opts:
        if k not in OPTIONS:
            raise PlanError(f"unknown autopar backend option {k!r}; valid options: {', '.join(OPTIONS)}."
                            + close_matches(k, OPTIONS))
    kernels = opts.setdefault("kernels", "auto")
    from .codegen.kernels import MODES

    if kernels not in MODES:
        raise PlanError(f"unknown kernels mode {kernels!r}: use one of {', '.join(repr(m) for m in MODES)}.")
    if opts.setdefault("recompute", "auto") not in ("auto", True, False):
        raise PlanError(f"recompute must be 'auto', True or False, not {opts['recompute']!r}.")
    if opts.get("cluster") is not None:
        from .cluster import Cluster

        opts["cluster"] = Cluster.load(opts["cluster"])  # a bad cluster fails here, not mid-compile
    return opts


# ---------------------------------------------------------------------------------------------- memory
def _saved_bytes(fw: fx.GraphModule, num_fwd_outputs: int) -> int:
    out = next(n for n in fw.graph.nodes if n.op == "output").args[0]
    total = 0
    for n in out[num_fwd_outputs:]:
        v = n.meta.get("val") if isinstance(n, fx.Node) and n.op != "placeholder" else None
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


def _budget(opts: dict, params: list[torch.Tensor]) -> tuple[int, str] | None:
    """Bytes left for saved activations on this process's device after the training state, and why."""
    from .cost_models.memory import state_bytes_per_param

    if opts.get("cluster") is not None:
        cluster = opts["cluster"]
        rank = dist.get_rank() if _world() > 1 else 0
        spec = cluster.devices[rank % cluster.world_size].spec
        memory, name = spec.memory, f"{spec.name} (rank {rank} of the cluster)"
    elif params and params[0].is_cuda:
        memory = torch.cuda.get_device_properties(params[0].device).total_memory
        name = torch.cuda.get_device_name(params[0].device)
    else:
        return None
    state = sum(p.numel() for p in params) * state_bytes_per_param("adamw").total
    return memory - state, (f"{name}: {memory / 2**20:.1f} MiB minus {state / 2**20:.2f} MiB of weights, "
                            f"gradients and AdamW state")


class _Planner:
    def __init__(self, opts: dict, record: GraphRecord, params: list[torch.Tensor]) -> None:
        self.opts, self.record, self.params = opts, record, params

    def __call__(self, joint: fx.GraphModule, joint_inputs: Any, **kw: Any) -> tuple[fx.GraphModule, ...]:
        from functorch.compile import default_partition, min_cut_rematerialization_partition

        n_out = kw["num_fwd_outputs"]
        fw, bw = default_partition(joint, joint_inputs, **kw)
        saved = _saved_bytes(fw, n_out)
        budget = _budget(self.opts, self.params)
        rec = self.opts["recompute"]
        want = rec is True or (rec == "auto" and budget is not None and saved > budget[0])
        text = f"saved activations {saved / 2**20:.3f} MiB"
        if budget is not None:
            text += f"; budget {budget[0] / 2**20:.3f} MiB on {budget[1]}"
        if want:
            takes = inspect.signature(min_cut_rematerialization_partition).parameters
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **{k: v for k, v in kw.items()
                                                                                  if k in takes})
            after = _saved_bytes(fw, n_out)
            why = "forced by recompute=True" if rec is True else "they do not fit"
            text += (f" -> activation recomputation ON ({why}; min-cut partition): "
                     f"saved {after / 2**20:.3f} MiB"
                     + (" -- still over budget" if budget is not None and after > budget[0] else ""))
            saved = after
        else:
            text += " -> recomputation off" + (" (recompute=False)" if rec is False else
                                               "" if budget is not None else " (no budget known)")
        self.record.memory, self.record.recompute, self.record.saved_bytes = f"memory: {text}", want, saved
        return fw, bw


# ---------------------------------------------------------------------------------------------- data parallel
class _GradAverager:
    """Averages gradients over the process group at the end of every backward, like DDP (unbucketed)."""

    def __init__(self) -> None:
        self.params: list[weakref.ref] = []
        self.seen: weakref.WeakSet = weakref.WeakSet()
        self.pending: list[nn.Parameter] = []

    def watch(self, params: list[nn.Parameter]) -> None:
        new = [p for p in params if p.requires_grad and p not in self.seen]
        with torch.no_grad():
            for p in new:  # replicas start from rank 0's weights; every rank compiles the same graphs
                broadcast(p.data, 0, "broadcasting parameters from rank 0 (autopar backend)")
        for p in new:
            self.seen.add(p)
            self.params.append(weakref.ref(p))
            p.register_post_accumulate_grad_hook(self._accumulated)

    def _accumulated(self, p: nn.Parameter) -> None:
        if not self.pending:
            torch.autograd.Variable._execution_engine.queue_callback(self._sync)
        self.pending.append(p)

    def _sync(self) -> None:
        mine = {id(p) for p in self.pending}
        self.pending = []
        ps = [p for r in self.params if (p := r()) is not None and id(p) in mine and p.grad is not None]
        if not ps:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in ps])
        all_reduce(flat, dist.group.WORLD, "gradient all-reduce (autopar backend)")
        flat /= dist.get_world_size()
        offset = 0
        for p in ps:
            p.grad.copy_(flat[offset:offset + p.grad.numel()].view_as(p.grad))
            offset += p.grad.numel()


_AVERAGER = _GradAverager()


# ---------------------------------------------------------------------------------------------- backend
def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def autopar_backend(gm: fx.GraphModule, example_inputs: list[Any], *, options: dict | None = None,
                    mode: str | None = None) -> Callable[..., Any]:
    """The torch.compile backend (see the module docstring). `mode` (torch.compile's) is not used."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from .codegen.kernels import apply_kernels

    opts = _options(options)
    dump = Path(opts["dump_dir"]) if opts.get("dump_dir") is not None else None
    log = _LOGS.setdefault(str(dump) if dump is not None else "", [])
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    params = [x for x in example_inputs if isinstance(x, nn.Parameter)] + list(gm.parameters())
    record = GraphRecord(len(log), len(calls), _source(calls[0]) if calls else "",
                         _source(calls[-1]) if calls else "", sum(p.numel() for p in params))
    log.append(record)
    if _world() > 1:
        _AVERAGER.watch([p for p in params if isinstance(p, nn.Parameter)])

    def compiler(which: str) -> Callable[[fx.GraphModule, list], Callable]:
        def compile_graph(g: fx.GraphModule, _inputs: list) -> Callable:
            sub = dump / f"graph_{record.index}" / which if dump is not None else None
            new, report = apply_kernels(g, opts["kernels"], sub)
            record.kernels[which] = report
            _write_log(dump, log)
            return make_boxed_func(new)
        return compile_graph

    backend = aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                           inference_compiler=compiler("inference"),
                           partition_fn=_Planner(opts, record, params))
    compiled = backend(gm, example_inputs)
    _write_log(dump, log)
    return compiled


__all__ = ["autopar_backend", "graphs", "GraphRecord", "OPTIONS"]
