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

* strategy: an `autopar.Strategy` forcing the plan under a process group (dp or tp over the group).
* time_limit_s: the planner's time limit per captured graph under a process group (default 20).

Under an initialized process group with several ranks every rank passes its own slice of the global batch
(like DDP) and each captured graph is planned for the group's devices (backend_dist.py): rank 0 plans,
every rank runs the broadcast plan, data parallel (the compiled graph on the rank's slice) or tensor
parallel over the group (DTensor-sharded parameters); rank 0's parameters are broadcast when first seen,
and after each backward the gradients are summed over ranks weighted by slice size (one flat all-reduce).
Each rank dumps into dump_dir/rank<r>/ (graph_<i>/plan.json: the plan it ran).
"""

from __future__ import annotations

import inspect
import re
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils.weak import WeakIdKeyDictionary

from .errors import PlanError, PlanFallbackWarning, close_matches
from .passes.fusion_pricing import check_mode
from .runtime.dist import all_reduce, broadcast

OPTIONS = ("cluster", "dump_dir", "kernels", "recompute", "strategy", "time_limit_s")
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
    parallel: str = ""  # under a process group: the plan it runs and why
    plan: Any = None  # the Plan (under a process group)

    def line(self) -> str:
        k = "; ".join(f"{w}: {len(r.fused)}/{len(r.regions)} regions fused" for w, r in self.kernels.items())
        where = f" ({self.first} .. {self.last})" if self.first else ""
        k = k or "no aten graph (AOT autograd compiled nothing)"
        par = f"\n    {self.parallel}" if self.parallel else ""
        return f"graph {self.index}: {self.ops} ops{where}, {self.params} parameters; {k}\n    {self.memory}{par}"


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
    dp = f"; rank {dist.get_rank()} of {_world()}" if _world() > 1 else ""
    lines = [f'torch.compile(backend="autopar"): {len(log)} graph(s) captured; {breaks} '
             f"(recompiles also add graphs){dp}"]
    for prev, r in zip([None, *log], log, strict=False):
        if prev is not None and prev.last and r.first:
            lines.append(f"-- break: graph {prev.index} stops after {prev.last}, graph {r.index} starts at {r.first}")
        lines.append(r.line())
    (dump / "graphs.txt").write_text("\n".join(lines) + "\n")
    for r in log:
        if r.plan is not None:
            (dump / f"graph_{r.index}").mkdir(exist_ok=True)
            (dump / f"graph_{r.index}" / "plan.json").write_text(r.plan.to_json())


def _source(node: fx.Node) -> str:
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    return f"{Path(frames[-1][0]).name}:{frames[-1][1]}" if frames else ""


def _options(options: dict | None) -> dict[str, Any]:
    opts = dict(options or {})
    for k in opts:
        if k not in OPTIONS:
            raise PlanError(f"unknown autopar backend option {k!r}; valid options: {', '.join(OPTIONS)}."
                            + close_matches(k, OPTIONS))
    check_mode(opts.setdefault("kernels", "auto"))
    if opts.setdefault("recompute", "auto") not in ("auto", True, False):
        raise PlanError(f"recompute must be 'auto', True or False, not {opts['recompute']!r}.")
    if opts.get("cluster") is not None:
        from .cluster import Cluster

        opts["cluster"] = Cluster.load(opts["cluster"])  # a bad cluster fails here, not mid-compile
    if opts.get("strategy") is not None:
        from .backend_dist import check_strategy

        check_strategy(opts["strategy"], _world())
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
    """Sums gradients over the process group, weighted by batch slice, at the end of every backward (like
    DDP's average, unbucketed; tensor-parallel graphs give every rank the full gradient already, which the
    weighted sum keeps)."""

    def __init__(self) -> None:
        self.params: list[weakref.ref] = []
        self.seen: weakref.WeakSet = weakref.WeakSet()
        self.pending: list[nn.Parameter] = []
        # per parameter: this rank's slice of its graph's global batch, b_r / B (unknown: 1 / world); kept
        # per parameter so models compiled with different batch sizes each get their own
        self.weights: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def watch(self, params: list[nn.Parameter]) -> None:
        new = [p for p in params if p.requires_grad and p not in self.seen]
        with torch.no_grad():
            for p in new:  # replicas start from rank 0's weights; every rank compiles the same graphs
                broadcast(p.data, 0, "broadcasting parameters from rank 0 (autopar backend)")
        for p in new:
            self.seen.add(p)
            self.params.append(weakref.ref(p))
            p.register_post_accumulate_grad_hook(self._accumulated)

    def weigh(self, params: list[nn.Parameter], weight: float) -> None:
        for p in params:
            self.weights[p] = weight

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
        even = 1 / dist.get_world_size()
        flat = torch.cat([p.grad.reshape(-1) * self.weights.get(p, even) for p in ps])
        all_reduce(flat, dist.group.WORLD, "gradient all-reduce (autopar backend)")
        offset = 0
        for p in ps:
            p.grad.copy_(flat[offset:offset + p.grad.numel()].view_as(p.grad))
            offset += p.grad.numel()


_AVERAGER = _GradAverager()  # one per process, like the hooks it installs on the parameters


def _parameters(gm: fx.GraphModule, example_inputs: list[Any]) -> list[nn.Parameter]:
    """The graph's parameters: lifted ones arrive among the inputs, the rest are the module's own."""
    return [x for x in example_inputs if isinstance(x, nn.Parameter)] + list(gm.parameters())


# ---------------------------------------------------------------------------------------------- process group
def _plan_for_group(gm: fx.GraphModule, example_inputs: list[Any], opts: dict,
                    record: GraphRecord) -> Callable[..., Any] | None:
    """Plan the graph for the group (backend_dist.py); returns the tensor-parallel runner, or None when the
    graph runs data parallel through the normal path."""
    from . import backend_dist as bd

    world, rank = _world(), dist.get_rank()
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    state = [i for i, (n, x) in enumerate(zip(phs, example_inputs, strict=True))
             if isinstance(x, torch.Tensor) and bd.is_state(n, x)]
    user = [x for i, x in enumerate(example_inputs) if i not in state]
    b = next((int(x.shape[0]) for x in user if isinstance(x, torch.Tensor) and x.dim() > 0), 0)
    sizes = bd.gather_sizes(b)
    if not all(sizes):  # e.g. the scalar pieces around a .item() break: nothing to split or to train
        record.parallel = "parallel: no batched tensor input: the graph runs as is on every rank"
        return None
    _AVERAGER.weigh(_parameters(gm, example_inputs), sizes[rank] / sum(sizes))
    cluster = bd.group_cluster(opts.get("cluster"), world)
    lifted = bd.Lifted(gm, list(example_inputs), state)
    plan, why, err = None, "", None
    if rank == 0:
        try:
            plan, why = bd.make_plan(lifted, user, cluster, world, sizes, opts)
        except PlanError:
            raise
        except Exception as e:  # a graph the planner cannot capture still trains, data parallel
            err = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    plan, why = bd.agree(plan, why, err)
    shares = f"batch slices {sizes} (weights b_r / {sum(sizes)})"
    if plan is None:
        record.parallel = f"parallel: data parallel over {world} ranks, {shares}: planning failed ({why})"
        _warn_fallback(f"planning graph {record.index} failed ({why}); it trains data parallel over {world} "
                       f"ranks, {shares}")
        return None
    record.plan = plan
    kind = bd.plan_kind(plan, world)
    head = f"parallel: plan for {cluster.name} ({why}): "
    if kind == "tp":
        try:
            device = next((x.device.type for x in example_inputs if isinstance(x, torch.Tensor)), "cpu")
            runner = bd.TPGraph(lifted, user, state, device, sizes)
        except PlanError:
            raise
        except Exception as e:
            record.parallel = (head + f"tensor parallel over {world} ranks could not be built "
                               f"({type(e).__name__}: {str(e)[:200]}); ran data parallel, {shares}")
            _warn_fallback(f"graph {record.index}: the tensor-parallel plan could not be built ({type(e).__name__}: "
                           f"{str(e)[:200]}); it trains data parallel over {world} ranks, {shares}")
            return None
        record.parallel = (head + f"tensor parallel over {world} ranks, DTensor-sharded parameters "
                           f"{sorted(runner.placements)} (input indices), every rank runs every slice; {shares}; "
                           f"torch ops (no fused kernels, no memory planning under DTensor)")
        record.memory = "memory: not planned (tensor-parallel graph)"
        return runner
    planned = [p.batch_share for p in plan.pipelines]
    note = "" if sorted(planned) == sorted(sizes) else \
        f"; the plan's slices {planned} differ from the ranks' ({sizes}): each rank trains on what it is given"
    ignored = sorted({f"ZeRO-{s.zero}" for p in plan.pipelines for s in p.stages if s.zero}
                     | {f"offload {o}" for p in plan.pipelines for s in p.stages for o in s.offload})
    record.parallel = (head + f"data parallel over {world} ranks, {shares}{note}"
                       + (f"; not applied by the backend: {', '.join(ignored)} (the optimizer is the user's)"
                          if ignored else ""))
    return None


def _warn_fallback(what: str) -> None:
    warnings.warn(PlanFallbackWarning(f"autopar backend: {what}. The math is unchanged (data parallelism trains "
                                      f"like one device); the speed and memory are not the plan's."), stacklevel=3)


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
    if dump is not None and _world() > 1:
        dump = dump / f"rank{dist.get_rank()}"
    log = _LOGS.setdefault(str(dump) if dump is not None else "", [])
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    params = _parameters(gm, example_inputs)
    record = GraphRecord(len(log), len(calls), _source(calls[0]) if calls else "",
                         _source(calls[-1]) if calls else "", sum(p.numel() for p in params))
    log.append(record)
    if _world() > 1:
        _AVERAGER.watch(params)
        tp = _plan_for_group(gm, example_inputs, opts, record)
        if tp is not None:
            _write_log(dump, log)
            return tp

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
