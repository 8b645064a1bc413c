"""The torch.compile backend under a process group: plan each captured graph for the group's devices.

Contract (like DDP): every rank calls the compiled model on its own slice of the global batch (the
slices may differ in size; the loss each rank computes is taken as the mean over its slice, so rank r's
gradients weigh b_r / B in the step's gradient, B the sum of the slices).

Per captured graph, rank 0 plans it and broadcasts the plan, so every rank runs the same one. The cluster
is the `cluster` option (its size must equal the world size) or `Cluster.local()` repeated to the world
size. The graph is planned as the group would run it: a module that runs the captured graph once per
rank's slice (the graph dynamo hands over has the slice's shapes baked in), with a stand-in loss (the sum
of its outputs: the real loss is computed outside the graph).

A backend only sees forward graphs (autograd runs the backward), so it runs the plans it can run inside
one forward: data parallel (each rank its slice, gradients summed with the weights above after each
backward) and tensor parallel over the whole group (every rank runs every slice with DTensor-sharded
parameters: `runtime/tensor_parallel.py`). When the planner picks anything else (pipelines, dp x tp),
the graph is re-planned among dp=world and tp=world and the dump says why. `options["strategy"]` (an
`autopar.Strategy`) forces one.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from .cluster import Cluster
from .errors import PlanError
from .ir.plan import Plan, Strategy
from .runtime.dist import DEFAULT_TIMEOUT_S, wait

_PARAM = re.compile(r"p(\d+)$")


def group_cluster(cluster: Cluster | None, world: int) -> Cluster:
    """The cluster the group's graphs are planned for."""
    if cluster is not None:
        if cluster.world_size != world:
            raise PlanError(
                f"the 'cluster' option has {cluster.world_size} devices but the process group has {world} "
                f"ranks: pass a cluster with one device per rank (e.g. '1x{world}x{cluster.devices[0].spec.name}')."
            )
        return cluster
    local = Cluster.local()
    if local.world_size == world:
        return local
    k = local.world_size if world % local.world_size == 0 else 1
    return Cluster.load(f"{world // k}x{k}x{local.devices[0].spec.name}")


def is_state(node: fx.Node, x: Any) -> bool:
    """A parameter or buffer of the user's module (dynamo passes them as graph inputs)."""
    if isinstance(x, nn.Parameter):
        return True
    src = getattr(node.meta.get("grapharg"), "source", None)
    name = src.name() if callable(getattr(src, "name", None)) else getattr(src, "name", "")
    return "._parameters[" in str(name) or "._buffers[" in str(name)


class Lifted(nn.Module):
    """A dynamo graph as a module: its parameters and buffers registered as p<i> / b<i> (i: input index)."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any], state: list[int]) -> None:
        super().__init__()
        self.gm, self.n, self.state = gm, len(example_inputs), state
        for i in state:
            x = example_inputs[i]
            if isinstance(x, nn.Parameter):
                self.register_parameter(f"p{i}", x)
            else:
                self.register_buffer(f"b{i}", x)

    def forward(self, *user: Any) -> Any:
        it = iter(user)
        args = [getattr(self, f"p{i}", None) if i in self.state else next(it) for i in range(self.n)]
        args = [a if a is not None else getattr(self, f"b{i}") for i, a in enumerate(args)]
        return self.gm(*args)


class _Group(nn.Module):
    """What the group computes, for planning: the graph once per rank's slice, and a stand-in loss."""

    def __init__(self, lifted: Lifted, world: int, batch: int) -> None:
        super().__init__()
        self.lifted, self.world, self.batch = lifted, world, batch

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        total = None
        for j in range(self.world):
            part = [x[j * self.batch:(j + 1) * self.batch] if _batched(x, self.batch * self.world) else x
                    for x in inputs]
            for o in torch.utils._pytree.tree_leaves(self.lifted(*part)):
                if isinstance(o, torch.Tensor) and o.is_floating_point():
                    s = o.float().sum()
                    total = s if total is None else total + s
        if total is None:
            raise PlanError("the captured graph has no floating-point output to plan training for.")
        return total


def _batched(x: Any, batch: int) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch


def plan_kind(plan: Plan, world: int) -> str | None:
    """'dp' (one device per replica), 'tp' (one stage over the whole group) or None (not runnable here)."""
    stages = [s for p in plan.pipelines for s in p.stages]
    if len(stages) == len(plan.pipelines) and all(len(s.devices) == 1 for s in stages):
        return "dp"
    if len(plan.pipelines) == 1 and len(stages) == 1 and len(stages[0].devices) == world:
        return "tp"
    return None


def check_strategy(strategy: Any, world: int) -> Strategy:
    if not isinstance(strategy, Strategy):
        raise PlanError(f"options['strategy'] must be an autopar.Strategy, not {type(strategy).__name__}.")
    if strategy.pp != 1 or sorted((strategy.dp, strategy.tp)) != [1, world]:
        raise PlanError(
            f"options['strategy'] dp={strategy.dp} tp={strategy.tp} pp={strategy.pp} does not fit: the process "
            f"group has {world} rank(s) and the autopar torch.compile backend runs data parallel (dp={world}) "
            f"or tensor parallel (tp={world}) over the whole group; use autopar.compile for pipelines and "
            f"mixed dp x tp."
        )
    return strategy


def make_plan(lifted: Lifted, user: list[Any], cluster: Cluster, world: int, sizes: list[int],
              opts: dict) -> tuple[Plan, str]:
    """(plan, how it was chosen) for one graph; runs on rank 0."""
    from .api import cost_model
    from .solver.pricing.pricing import price_strategy
    from .solver.search.search import search

    b = sizes[0]
    inputs = tuple(x.detach().repeat(world, *[1] * (x.dim() - 1)) if _batched(x, b) else x for x in user)
    cm = cost_model(_Group(lifted, world, b), cluster, inputs, kernels=opts["kernels"])
    strategy = opts.get("strategy")
    if strategy is not None:
        return price_strategy(cm, strategy).plan, f"strategy {_describe(strategy)} forced by options"
    plan = search(cm, time_limit_s=float(opts.get("time_limit_s", 20)))
    if plan_kind(plan, world) is not None:
        return plan, "chosen by the planner"
    why = (f"the planner chose {len(plan.pipelines)} pipeline(s) of {[len(p.stages) for p in plan.pipelines]} "
           f"stage(s) with tp {[s.tp for p in plan.pipelines for s in p.stages]}; a torch.compile backend "
           f"sees forward graphs only (autograd runs the backward), so it re-planned among dp={world} and "
           f"tp={world}")
    ests = [price_strategy(cm, Strategy(dp=world)), price_strategy(cm, Strategy(tp=world))]
    best = min(ests, key=lambda e: (not e.fits, e.predicted["step_time_s"]))
    return best.plan, why


def _describe(s: Strategy) -> str:
    return f"dp={s.dp} tp={s.tp} pp={s.pp}"


def agree(plan: Plan | None, why: str, error: str | None) -> tuple[Plan | None, str]:
    """Rank 0's plan and how it was chosen, or (None, rank 0's planning error), on every rank."""
    box = [(plan.to_json() if plan is not None else None, why, error)]
    dist.broadcast_object_list(box, src=0)
    text, why, error = box[0]
    return (None, error) if text is None else (Plan.from_json(text), why)


def gather_sizes(b: int) -> list[int]:
    sizes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, b)
    return [int(s) for s in sizes]


# ---------------------------------------------------------------------------------------------- tensor parallel
class TPGraph:
    """Runs a captured graph tensor-parallel over the whole group (see _TPRun)."""

    def __init__(self, lifted: Lifted, user: list[Any], state: list[int], device_type: str,
                 sizes: list[int]) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        from .passes.capture import capture
        from .runtime.tensor_parallel import TPStage, megatron_spec

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if len(set(sizes)) > 1:
            raise PlanError(f"tensor parallelism needs equal batch slices on every rank, got {sizes}: give "
                            f"every rank the same number of samples.")
        self.b, self.sizes, self.state = sizes[0], sizes, state
        self.ep = torch.export.export(lifted, tuple(user), strict=False)
        graph = capture(_Group(lifted, 1, self.b), tuple(user))
        spec = megatron_spec(graph, (0, len(graph.layers)))
        # the stand-in capture names parameters <prefix>.p<i>: key them by input index
        self.placements = {int(m.group(1)): v for k, v in spec.params.items() if (m := _PARAM.search(k))}
        spec.params = {}
        self.mesh = DeviceMesh.from_group(dist.group.WORLD, device_type)
        self.stage = TPStage(self.mesh, spec)
        # the exported graph's non-user inputs, in placeholder order: input index (parameters and buffers)
        # or a lifted constant
        self.order: list[int | torch.Tensor] = []
        for s in self.ep.graph_signature.input_specs:
            if s.kind.name in ("PARAMETER", "BUFFER"):
                self.order.append(int(s.target.rsplit(".", 1)[-1][1:]))
            elif s.kind.name != "USER_INPUT":
                self.order.append(self.ep.constants[s.target])

    def __call__(self, *args: Any) -> tuple[torch.Tensor, ...]:
        state = [args[i] if isinstance(i, int) else i for i in self.order]
        user = [a for i, a in enumerate(args) if i not in self.state]
        return _TPRun.apply(self, len(state), *state, *user)


def _gather(x: torch.Tensor, world: int) -> list[torch.Tensor]:
    out = [torch.empty_like(x) for _ in range(world)]
    wait(dist.all_gather(out, x.contiguous(), async_op=True), "all-gather of batch slices (autopar backend)",
         "in the group", DEFAULT_TIMEOUT_S, device=x.device)
    return out


class _TPRun(torch.autograd.Function):
    """Forward: gather every rank's slice and run the graph on each, tensor-parallel (all ranks together);
    return this rank's outputs. Backward: gather every rank's output gradients, weigh slice j by b_j / B,
    and run the inner backward on all ranks: every rank gets the full parameter gradient."""

    @staticmethod
    def forward(ctx: Any, g: TPGraph, n_state: int, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from torch.distributed.tensor import DTensor, Replicate
        from torch.distributed.tensor.experimental import implicit_replication

        state, user = flat[:n_state], flat[n_state:]
        parts = [_gather(x, g.world) if _batched(x, g.b) else [x] * g.world for x in user]
        with torch.enable_grad():
            leaves = [s.detach().requires_grad_(s.requires_grad) for s in state]
            dstate = []
            for i, leaf in zip(g.order, leaves, strict=True):
                d = DTensor.from_local(leaf, g.mesh, [Replicate()], run_check=False)
                place = g.placements.get(i) if isinstance(i, int) else None
                dstate.append(d.redistribute(g.mesh, [place]) if place is not None else d)
            xs_all, outs_all = [], []
            for j in range(g.world):
                xs = [p[j].detach().requires_grad_(p[j].is_floating_point() and x.requires_grad)
                      for p, x in zip(parts, user, strict=True)]
                with implicit_replication():
                    out = g.stage.run(g.ep.graph_module, dstate, xs)
                xs_all.append(xs)
                outs_all.append(list(out) if isinstance(out, (tuple, list)) else [out])
        ctx.g, ctx.leaves, ctx.xs_all, ctx.outs_all, ctx.n_user = g, leaves, xs_all, outs_all, len(user)
        mine = outs_all[g.rank]
        ctx.mark_non_differentiable(*[o for o in mine if not o.is_floating_point()])
        return tuple(o.detach() for o in mine)

    @staticmethod
    def backward(ctx: Any, *gouts: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        from torch.distributed.tensor.experimental import implicit_replication

        g = ctx.g
        total = sum(g.sizes)
        outs, grads = [], []
        for k, o in enumerate(ctx.outs_all[g.rank]):
            if not (o.is_floating_point() and o.requires_grad):
                continue
            mine = gouts[k] if gouts[k] is not None else torch.zeros_like(o)
            for j, gj in enumerate(_gather(mine, g.world)):
                outs.append(ctx.outs_all[j][k])
                grads.append(gj * (g.sizes[j] / total))
        with torch.enable_grad(), implicit_replication():
            torch.autograd.backward(outs, grads)
        w = g.sizes[g.rank] / total
        state_grads = [leaf.grad if leaf.requires_grad else None for leaf in ctx.leaves]
        user_grads = [x.grad / w if x.grad is not None else None for x in ctx.xs_all[g.rank]]
        return (None, None, *state_grads, *user_grads)


__all__ = ["group_cluster", "is_state", "Lifted", "make_plan", "plan_kind", "check_strategy", "agree",
           "gather_sizes", "TPGraph"]
