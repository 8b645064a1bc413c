"""Expert parallelism (MoE) in the per-rank program.

Groups. With `Layout.ep` = ep > 1, consecutive data-parallel replicas (pipelines 0..ep-1, ep..2ep-1, ...)
form expert-parallel groups: for every stage and tensor-parallel index, the ranks at that index of the
stage's group in the ep replicas of a chunk. Position i of a group (the i-th smallest rank, its rank in
the process group) owns experts [i E/ep, (i+1) E/ep) of every MoE layer on that stage and holds only
their parameters. The replicas of a group must run identical pipelines (stage bounds, micro-batch count,
schedule, recompute, tp per stage) so that their all-to-alls meet in one order.

Tensor parallelism. Experts are not split over a tp group: every rank of it holds the same whole experts
(same position in its group; the tp groups must order their ranks alike across the replicas) and runs
the op on the group's replicated tokens as plain local tensors (`adapt_tp`: the op's nodes run
replicated, expert parameters stay out of the TP spec, Replicate DTensors). Each tp index thus runs the
same dispatch with its own ranks; the router and the rest of the block stay under the TP spec. Gradients
of expert parameters are then identical inside a tp group and are summed over the tp groups holding the
expert (their first ranks, then broadcast in the group: `ZeroRuntime`'s usual path), never over the tp
group itself. ZeRO partitions each expert among the replicas holding it; offload needs nothing special.

Dispatch. Before the stage capture, each supported MoE module's forward is swapped (for the capture only;
the user's model is restored afterwards) for one that computes the router exactly as the original and
hands the tokens, their top-k expert ids and the expert parameters to one custom op,
`autopar::moe_experts`, which torch.export keeps as a single node. Its implementation sorts the
(token, k) slots by expert, exchanges per-expert counts, sends every slot's token to the rank owning its
expert (`all_to_all_single` with variable splits), runs the local experts on what it received, and sends
the results back; the combine with the gate weights stays in the traced graph, so autograd derives the
router's gradient. The backward re-sends each slot's token together with its output gradient (one
all-to-all of 2x the bytes instead of keeping the received tokens alive between forward and backward),
recomputes the local experts' forward on them, and returns the token gradients with a second all-to-all.

Gradients. An expert's parameters are held by the ranks at the same group position in every group, so
`restrict_holders` narrows `Program.holders` to them and the ordinary gradient sync sums over exactly
those ranks. Mixtral stores its experts stacked in one (E, ...) tensor: a rank holds its dim-0 shard, and
its view of the holders is the ranks holding the same shard. `state_dict()` gathers full tensors.

Supported modules: autopar's `models.MoE` and transformers' `MixtralExperts` (under its sparse MoE block).
Any other module holding experts trains replicated (plain data parallelism); `unsupported_moe` names them.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import PlanError
from ..ir.graph import TrainingGraph
from ..ir.lowered import Layout
from .dist import DEFAULT_TIMEOUT_S, Groups, all_to_all
from .tensor_parallel import TPStage

_CONTEXTS: dict[str, _Context] = {}  # op key -> the rank's context; the op can only carry a string
_KEYS = itertools.count()


def _forget(keys: list[str]) -> None:
    for key in keys:
        _CONTEXTS.pop(key, None)
SHARD_TAG = "@expert-shard"
_OP = "autopar.moe_experts.default"  # the op's node target in a captured graph


@dataclass
class _Context:
    experts: int
    ranks: tuple[int, ...]  # the expert-parallel group, by position
    index: int  # this rank's position
    group: object
    run_expert: Callable[[list[torch.Tensor], int, int, torch.Tensor], torch.Tensor]  # (params, e, local e, x)
    timeout_s: float

    @property
    def degree(self) -> int:
        return len(self.ranks)

    @property
    def per_rank(self) -> int:
        return self.experts // self.degree


# ---- the op ------------------------------------------------------------------------------------------


def _a2a(c: _Context, t: torch.Tensor, send: list[int], recv: list[int], what: str) -> torch.Tensor:
    return all_to_all(t, recv, send, c.group, f"expert all-to-all ({what}) over ranks {list(c.ranks)}", c.timeout_s)


@dataclass
class _Routes:
    """One dispatch's routing: the (token, k) slots sorted by expert (`order`), the all-to-all's split sizes
    (`send`, `recv`: per rank of the group), and the received slots grouped by local expert (`by_expert`, a
    stable sort of the slots' local expert ids, with `per_expert` slots each)."""

    order: torch.Tensor
    send: list[int]
    recv: list[int]
    by_expert: torch.Tensor
    per_expert: list[int]


def _route(c: _Context, index: torch.Tensor) -> _Routes:
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # a bincount on the device (sized by a host read of the max on CUDA) done as a scatter: no sync
    counts = torch.zeros(c.experts, dtype=torch.int64, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int64))
    per, d = c.per_rank, c.degree
    got = _a2a(c, counts, [per] * d, [per] * d, "counts")  # per source, counts for my local experts
    # the all-to-all takes its split sizes on the host: the dispatch's one host read, both count tables at once
    both = torch.cat([counts, got]).tolist()
    mine, theirs = both[:c.experts], both[c.experts:]
    send = [sum(mine[r * per:(r + 1) * per]) for r in range(d)]
    recv = [sum(theirs[r * per:(r + 1) * per]) for r in range(d)]
    per_expert = [sum(theirs[r * per + le] for r in range(d)) for le in range(per)]
    ids = torch.arange(per, device=index.device).repeat(d).repeat_interleave(got, output_size=sum(recv))
    return _Routes(order, send, recv, torch.argsort(ids, stable=True), per_expert)


def _run_local(c: _Context, params: list[torch.Tensor], x: torch.Tensor, routes: _Routes) -> torch.Tensor:
    """The local experts on the received slots `x`, each on its slots in arrival order (one gather by the
    sorted order, contiguous slices per expert, one scatter back)."""
    if not x.shape[0]:
        return x.new_zeros(x.shape)
    grouped = x[routes.by_expert]
    parts, start = [], 0
    for le, n in enumerate(routes.per_expert):
        if n:
            parts.append(c.run_expert(params, c.index * c.per_rank + le, le, grouped[start:start + n]))
        start += n
    out = torch.empty((x.shape[0], *parts[0].shape[1:]), dtype=parts[0].dtype, device=parts[0].device)
    out[routes.by_expert] = torch.cat(parts)
    return out


@torch.library.custom_op("autopar::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, index: torch.Tensor, params: list[torch.Tensor], key: str) -> torch.Tensor:
    """(tokens, hidden) x (tokens, k) expert ids -> (tokens, k, hidden): each slot's expert output."""
    c = _CONTEXTS[key]
    routes = _route(c, index)
    order, send, recv = routes.order, routes.send, routes.recv
    k = index.shape[1]
    xr = _a2a(c, x[order // k], send, recv, "tokens")
    with torch.no_grad():
        yr = _run_local(c, params, xr, routes)
    ys = _a2a(c, yr, recv, send, "expert outputs")
    y = torch.empty_like(ys)
    y[order] = ys
    return y.view(*index.shape, x.shape[-1])


@moe_experts.register_fake
def _(x: torch.Tensor, index: torch.Tensor, params: list[torch.Tensor], key: str) -> torch.Tensor:
    return x.new_empty((*index.shape, x.shape[-1]))


def _setup(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    x, index, params, key = inputs
    ctx.save_for_backward(x, index, *params)  # type: ignore[attr-defined]
    ctx.key = key  # type: ignore[attr-defined]


def _backward(ctx: object, grad: torch.Tensor) -> tuple:
    x, index, *params = ctx.saved_tensors  # type: ignore[attr-defined]
    c = _CONTEXTS[ctx.key]  # type: ignore[attr-defined]
    routes = _route(c, index)
    order, send, recv = routes.order, routes.send, routes.recv
    k, h = index.shape[1], x.shape[-1]
    tokens = order // k
    both = _a2a(c, torch.cat([x[tokens], grad.reshape(-1, h)[order]], dim=1), send, recv,
                "tokens and output gradients")
    held = [i for i, p in enumerate(params) if p.numel()]
    leaves = [p.detach().requires_grad_(i in held) for i, p in enumerate(params)]
    with torch.enable_grad():
        xr = both[:, :h].detach().requires_grad_(True)
        yr = _run_local(c, leaves, xr, routes)
        grads = torch.autograd.grad(yr, [xr] + [leaves[i] for i in held], both[:, h:], allow_unused=True)
    gx = _a2a(c, grads[0], recv, send, "token gradients")
    grad_x = torch.zeros_like(x).index_add_(0, tokens, gx)
    grad_params: list[torch.Tensor | None] = [None] * len(params)
    for i, g in zip(held, grads[1:], strict=True):
        grad_params[i] = g if g is not None else torch.zeros_like(params[i])
    return grad_x, None, grad_params, None


moe_experts.register_autograd(_backward, setup_context=_setup)


# ---- adapters ------------------------------------------------------------------------------------------


class _OwnMoE:
    """autopar.models.MoE: experts are FeedForward modules (fc, gelu, proj); 4 parameters per expert."""

    stacked = False

    @staticmethod
    def matches(module: nn.Module) -> bool:
        from ..models import MoE

        return isinstance(module, MoE)

    @staticmethod
    def num_experts(module: nn.Module) -> int:
        return len(module.experts)

    @staticmethod
    def params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return [(f"experts.{e}.{lin}.{kind}", getattr(getattr(ex, lin), kind))
                for e, ex in enumerate(module.experts) for lin in ("fc", "proj") for kind in ("weight", "bias")]

    @staticmethod
    def expert_of(rel: str) -> int:
        return int(rel.split(".")[1])

    @staticmethod
    def run_expert(module: nn.Module) -> Callable:
        def run(params: list[torch.Tensor], e: int, _le: int, x: torch.Tensor) -> torch.Tensor:
            w1, b1, w2, b2 = params[4 * e:4 * e + 4]
            return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
        return run

    @staticmethod
    def forward(module: nn.Module, key: str) -> Callable:
        def forward(x: torch.Tensor) -> torch.Tensor:
            params = [p for _, p in _OwnMoE.params(module)]  # looked up per call: export swaps them
            probs = module.router(x).softmax(dim=-1)
            weight, index = probs.topk(module.top_k, dim=-1)
            weight = weight / weight.sum(dim=-1, keepdim=True)
            flat = x.reshape(-1, x.shape[-1])
            y = torch.ops.autopar.moe_experts(flat, index.reshape(flat.shape[0], -1), params, key)
            return (y * weight.reshape(*y.shape[:2], 1)).sum(dim=1).reshape(x.shape)
        return forward


class _Mixtral:
    """transformers' MixtralExperts: stacked (E, 2F, H) gate_up_proj and (E, H, F) down_proj."""

    stacked = True

    @staticmethod
    def matches(module: nn.Module) -> bool:
        return type(module).__name__ == "MixtralExperts" and hasattr(module, "gate_up_proj")

    @staticmethod
    def num_experts(module: nn.Module) -> int:
        return int(module.num_experts)

    @staticmethod
    def params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return [("gate_up_proj", module.gate_up_proj), ("down_proj", module.down_proj)]

    @staticmethod
    def run_expert(module: nn.Module) -> Callable:
        act = module.act_fn

        def run(params: list[torch.Tensor], _e: int, le: int, x: torch.Tensor) -> torch.Tensor:
            gate, up = F.linear(x, params[0][le]).chunk(2, dim=-1)
            return F.linear(act(gate) * up, params[1][le])
        return run

    @staticmethod
    def forward(module: nn.Module, key: str) -> Callable:
        def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
            y = torch.ops.autopar.moe_experts(hidden, top_k_index, [module.gate_up_proj, module.down_proj], key)
            return (y * top_k_weights.unsqueeze(-1)).sum(dim=1).to(hidden.dtype)
        return forward


ADAPTERS = (_OwnMoE, _Mixtral)


def supported_moe(model: nn.Module) -> list[tuple[str, nn.Module, type]]:
    """(path, module, adapter) of every MoE module the runtime can spread over ranks."""
    out = []
    for path, m in model.named_modules():
        for a in ADAPTERS:
            if a.matches(m):
                out.append((path, m, a))
    return out


def unsupported_moe(model: nn.Module) -> list[str]:
    """Paths of modules that look like MoE (hold `experts`) but have no adapter: they train replicated."""
    known = {path for path, _, _ in supported_moe(model)}
    known |= {f"{p}.experts" if p else "experts" for p in known}
    out = []
    for path, m in model.named_modules():
        inner = getattr(m, "experts", None)
        if isinstance(inner, nn.Module) and path not in known and f"{path}.experts" not in known \
                and not any(a.matches(inner) for a in ADAPTERS):
            out.append(path)
    return out


# ---- layout -------------------------------------------------------------------------------------------


def expert_groups(layout: Layout) -> list[tuple[int, ...]]:
    """Every expert-parallel group (module docstring); PlanError when the layout cannot have them."""
    ep, pipes = layout.ep, sorted(layout.pipelines, key=lambda p: p.index)
    if ep < 1 or len(pipes) % ep:
        raise PlanError(f"expert-parallel degree {ep} must divide the {len(pipes)} data-parallel replicas; "
                        f"choose ep among the divisors of the replica count.")
    groups = []
    for c in range(0, len(pipes), ep):
        chunk = pipes[c:c + ep]
        first = chunk[0]
        for p in chunk:
            same = (p.bounds() == first.bounds() and p.num_microbatches == first.num_microbatches
                    and p.schedule == first.schedule and p.chunks == first.chunks
                    and [s.recompute for s in p.stages] == [s.recompute for s in first.stages])
            if not same:
                raise PlanError(f"pipelines {first.index} and {p.index} share experts (ep={ep}) but differ in "
                                f"stage bounds, micro-batch count, schedule or recompute; expert-parallel "
                                f"replicas must run identical pipelines.")
            for s, st in enumerate(p.stages):
                if len(st.ranks) != len(first.stages[s].ranks):
                    raise PlanError(f"pipelines {first.index} and {p.index} share experts (ep={ep}) but stage {s} "
                                    f"has tensor-parallel degrees {len(first.stages[s].ranks)} and {len(st.ranks)}; "
                                    f"expert-parallel replicas must use the same tp per stage.")
        for s in range(first.num_groups):
            tp_groups = [p.stages[s].ranks for p in chunk]
            per_index = [tuple(g[t] for g in tp_groups) for t in range(len(tp_groups[0]))]
            # a tensor-parallel group computes on the same tokens, so all its ranks must own the same experts:
            # the same position (process-group rank order) in their per-index groups
            order = {tuple(sorted(range(ep), key=lambda i, g=g: g[i])) for g in per_index}
            if len(order) > 1:
                raise PlanError(f"pipelines {[p.index for p in chunk]} stage {s}: the tensor-parallel groups "
                                f"{tp_groups} do not order their ranks alike, so a group's ranks would own "
                                f"different experts; number the ranks of every group in the same replica order.")
            groups += per_index
    return groups


class ExpertRuntime:
    """One rank's expert placement: which expert parameters it holds, whom it syncs them with, and the
    capture-time swap of MoE forwards for the dispatching op."""

    def __init__(self, model: nn.Module, layout: Layout, rank: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.degree, self.rank, self.timeout_s = layout.ep, rank, timeout_s
        self.groups = expert_groups(layout)
        # a rank's position is its rank within its (sorted) process group: all_to_all_single's chunk order
        self.position_of = {r: sorted(g).index(r) for g in self.groups for r in g}
        self.modules = supported_moe(model)
        if not self.modules:
            raise PlanError(f"the plan asks for expert parallelism (ep={self.degree}) but the model has no MoE "
                            f"module the runtime supports (autopar.models.MoE, transformers MixtralExperts).")
        self.names: dict[str, tuple[type, int, int]] = {}  # param name -> (adapter, experts, expert or -1)
        for path, m, a in self.modules:
            n = a.num_experts(m)
            if n % self.degree:
                raise PlanError(f"{path} has {n} experts, not divisible by ep={self.degree}; choose ep among "
                                f"the divisors of {n}.")
            for rel, _ in a.params(m):
                self.names[f"{path}.{rel}" if path else rel] = (a, n, -1 if a.stacked else a.expert_of(rel))
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.placeholder = torch.empty(0, device=device)  # stands in for other ranks' expert parameters
        self.keys: dict[str, str] = {}

    @property
    def index(self) -> int:
        return self.position_of.get(self.rank, 0)

    def _owner_index(self, name: str) -> int | None:
        a, n, e = self.names[name]
        return None if e < 0 else e // (n // self.degree)

    def restrict_holders(self, holders: dict[str, tuple[tuple[int, ...], ...]]
                         ) -> dict[str, tuple[tuple[int, ...], ...]]:
        """This rank's view: an expert's parameters are held by the ranks at its owning group position; a
        stacked (sharded) expert tensor by the ranks holding the same shard as this rank."""
        out = dict(holders)
        for name in self.names:
            if name in holders:
                out[name] = self._holders_at(holders[name], self._owner_index(name) if
                                             self._owner_index(name) is not None else self.index)
        return out

    def _holders_at(self, groups: tuple[tuple[int, ...], ...], i: int) -> tuple[tuple[int, ...], ...]:
        return tuple(g for g in groups if self.position_of.get(g[0]) == i)

    def group_sets(self, holders: dict[str, tuple[tuple[int, ...], ...]]) -> set[tuple[int, ...]]:
        """Rank sets needing process groups on every rank: the expert-parallel groups and every rank's
        view of the expert parameters' holders (views differ between ranks for sharded tensors)."""
        out = set(self.groups)
        for name in self.names:
            for i in range(self.degree):
                reps = self._holders_at(holders.get(name, ()), i)
                if reps:
                    out.add(tuple(g[0] for g in reps))
        return out

    def bind(self, groups: Groups) -> None:
        """Register this rank's op contexts (one per MoE module) on its expert-parallel group."""
        mine = next((tuple(sorted(g)) for g in self.groups if self.rank in g), None)
        if mine is None:
            return
        for path, m, a in self.modules:
            key = f"{next(_KEYS)}:{path}"
            _CONTEXTS[key] = _Context(a.num_experts(m), mine, self.index, groups.get(mine), a.run_expert(m),
                                      self.timeout_s)
            self.keys[path] = key
        # the contexts hold the expert modules and the group: they go with the program, not with the process
        weakref.finalize(self, _forget, list(self.keys.values()))

    @contextlib.contextmanager
    def swapped(self, model: nn.Module) -> Iterator[None]:
        """During the stage capture: supported MoE modules dispatch through `autopar::moe_experts`."""
        done = []
        try:
            for path, m, a in self.modules:
                if path in self.keys:
                    m.forward = a.forward(m, self.keys[path])
                    done.append(m)
            yield
        finally:
            for m in done:
                del m.forward

    def capture(self, model: nn.Module, inputs: tuple, loss_fn: object, target: object, sources: bool = True
                ) -> TrainingGraph:
        """The model captured as its stages run: supported MoE modules dispatching through the op."""
        from ..passes.capture import capture

        with self.swapped(model):
            return capture(model, inputs, loss_fn, target, sources=sources)

    def adapt_tp(self, tp: TPStage, graph: TrainingGraph) -> None:
        """Tensor parallelism on a stage with experts (`graph` from `capture`): the experts stay whole and
        replicated in the tensor-parallel group (every rank of it holds the same experts and sees the same
        tokens), and the dispatching op runs on local tensors, each rank exchanging with the ranks at its
        tensor-parallel index in the other replicas (its expert-parallel group)."""
        for name in self.names:
            tp.spec.params.pop(name, None)
        tp.replicated.update(n for n, node in graph.nodes.items() if node.target == _OP)

    def zero_levels(self, levels: dict[str, int]) -> dict[str, int]:
        """ZeRO levels with stacked expert tensors at 0: ranks at different group positions hold different
        shards under one name (their holder views differ), so ZeRO's owner choice, which must come out the
        same on every rank, leaves them out; they are partitioned by expert parallelism already."""
        return {k: 0 if k in self.names and self.names[k][2] < 0 else v for k, v in levels.items()}

    def check_checkpoint(self) -> None:
        """DCP checkpoints name one tensor per parameter; stacked expert shards are not written as such."""
        stacked = sorted(n for n, (_, _, e) in self.names.items() if e < 0)
        if stacked:
            raise PlanError(f"save()/load() do not support expert-sharded stacked tensors yet ({stacked[0]}, ...); "
                            f"use prog.state_dict() / prog.load_state_dict(), which gather and re-shard them.")

    def local_value(self, name: str, full: torch.Tensor) -> torch.Tensor | None:
        """This rank's part of an expert parameter (None when it holds none of it); others unchanged."""
        if name not in self.names:
            return full
        a, n, e = self.names[name]
        if e >= 0:
            return full if self._owner_index(name) == self.index else None
        per = n // self.degree
        return full[self.index * per:(self.index + 1) * per].clone()

    def local_state(self, name: str, state: dict) -> dict:
        """The optimizer state entries of a parameter, cut like `local_value`."""
        if name not in self.names or self.names[name][2] >= 0:
            return state
        return {k: self.local_value(name, v) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                for k, v in state.items()}

    def tag(self, values: dict[str, object]) -> dict[str, object]:
        """Name shards of stacked expert tensors apart before gathering them (see `untag`)."""
        return {f"{k}{SHARD_TAG}{self.index}" if k in self.names and self.names[k][2] < 0 else k: v
                for k, v in values.items()}

    @staticmethod
    def untag(values: dict[str, object]) -> dict[str, object]:
        """Concatenate gathered shards (dim 0, in shard order) back into full tensors."""
        out: dict[str, object] = {}
        shards: dict[str, dict[int, object]] = {}
        for k, v in values.items():
            if SHARD_TAG in k:
                name, i = k.split(SHARD_TAG)
                shards.setdefault(name, {})[int(i)] = v
            else:
                out[k] = v
        for name, parts in shards.items():
            ordered = [parts[i] for i in sorted(parts)]
            if isinstance(ordered[0], dict):  # optimizer state
                out[name] = {k: torch.cat([p[k] for p in ordered]) if isinstance(v, torch.Tensor) and v.dim() > 0
                             else v for k, v in ordered[0].items()}
            else:
                out[name] = torch.cat(ordered)  # type: ignore[arg-type]
        return out


def expert_runtime(model: nn.Module, layout: Layout, rank: int, timeout_s: float) -> ExpertRuntime | None:
    """The rank's ExpertRuntime, or None when the layout has no expert parallelism."""
    return ExpertRuntime(model, layout, rank, timeout_s) if layout.ep > 1 else None


__all__ = ["ADAPTERS", "ExpertRuntime", "expert_groups", "expert_runtime", "moe_experts", "supported_moe",
           "unsupported_moe"]
