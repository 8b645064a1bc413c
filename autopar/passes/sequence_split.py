"""Which ops of a model see the whole sequence: what context parallelism must exchange, and what it cannot split.

Context parallelism runs every op on a rank's share of the tokens. That is the single-device program only
when each op either works token by token (embeddings, norms, linears, pointwise ops, the loss's per-token
terms) or is one the runtime replaces: scaled-dot-product attention (its keys and values travel around the
cp group, runtime/ring_attention.py) and the `arange` that numbers the tokens (it becomes the rank's global
positions). Anything else that mixes tokens (an unfused attention with a [T, T] mask, a pooling over the
sequence feeding a parameter, a sequence-length buffer sliced by T) would silently compute something else, so
it is found here and refused.

The method compares two captures of the same model that differ only in the sequence length, the full one
(T tokens) and a rank's (T / cp): an op's output that does not change is token-free, one whose shape scales
by T / (T / cp) in exactly one dimension carries tokens (a flattened (batch * seq, hidden) view too), and
anything else (two dimensions scaling: a [T, T] score or mask) mixes tokens. A token-free op reading a
token-carrying value reduces over tokens: allowed only where nothing downstream reads a parameter (the
loss's reduction), which `loss_is_token_mean` then checks numerically.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from ..errors import PlanError
from ..ir.graph import TrainingGraph

ATTENTION = "aten.scaled_dot_product_attention.default"
# a mask passed to SDPA is computed once, on the host, to check that it is the causal one: up to 2^30 elements
# (B x T^2: 32K tokens of one sample), about 1 GiB of booleans and a few temporaries of that size
MASK_CHECK_ELEMENTS = 1 << 30
ARANGES = ("aten.arange.default", "aten.arange.start", "aten.arange.start_step")


@dataclass
class SequenceRoles:
    """What context parallelism replaces in a capture at the local sequence length (node names)."""

    positions: list[str] = field(default_factory=list)  # aranges numbering the tokens
    attentions: list[str] = field(default_factory=list)  # SDPA calls (causal or unmasked) to run across the group
    reductions: list[str] = field(default_factory=list)  # the loss's reductions over tokens
    causal_masks: list[str] = field(default_factory=list)  # attentions whose mask is the causal one: run is_causal


def _where(n: object) -> str:
    module = getattr(n, "module", "") or "the model's top level"
    source = getattr(n, "source", "")
    return f"node {n.name} ({n.target}) in {module}" + (f" at {source}" if source else "")  # type: ignore[attr-defined]


def _token_dim(full: tuple[int, ...], local: tuple[int, ...], seq: int, seq_local: int) -> int | None | str:
    """None: the same shape (token-free); d: the one dimension scaling from seq_local to seq (times a constant);
    "mixed": any other change."""
    if tuple(full) == tuple(local):
        return None
    if len(full) != len(local):
        return "mixed"
    diff = [d for d, (a, b) in enumerate(zip(full, local, strict=True)) if a != b]
    if len(diff) == 1:
        d = diff[0]
        if local[d] and full[d] * seq_local == local[d] * seq:
            return d
    return "mixed"


# ops that only move or relabel dimensions: acting on the sequence dimension they keep every token whole
MOVEMENT = {f"aten.{op}" for op in (
    "transpose.int", "permute.default", "squeeze.dim", "squeeze.dims", "squeeze.default", "unsqueeze.default",
    "view.default", "reshape.default", "_unsafe_view.default", "expand.default", "clone.default", "contiguous.default",
    "t.default", "alias.default", "detach.default", "flatten.using_ints", "unflatten.int", "_to_copy.default",
    "to.dtype", "to.dtype_layout", "to.device", "type_as.default", "_assert_tensor_metadata.default")}
DIM_ARGS = ("dim", "dims", "dim0", "dim1")


def _dims_of(node: fx.Node, ndim: int) -> set[int]:
    """The dimensions an fx call acts along (its `dim`-like arguments), normalised to [0, ndim)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or ndim == 0:
        return set()
    out: set[int] = set()
    for i, a in enumerate(schema.arguments):
        if a.name not in DIM_ARGS:
            continue
        v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value)
        for d in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(d, int):
                out.add(d % ndim)
    return out


def _indexed_dims(node: fx.Node) -> set[int]:
    """The dimensions `aten.index.Tensor` indexes with a tensor."""
    if str(node.target) != "aten.index.Tensor" or len(node.args) < 2:
        return set()
    return {d for d, ix in enumerate(node.args[1]) if ix is not None}


def _ancestors(graph: TrainingGraph, names: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = [n for n in names if n in graph.nodes]
    while todo:
        x = todo.pop()
        if x not in seen:
            seen.add(x)
            todo += [a for a in graph.nodes[x].args if a in graph.nodes]
    return seen


def _evaluate(gm: fx.GraphModule, name: str, needed: set[str]) -> torch.Tensor | None:
    """The value of node `name` of `gm`, computing only `needed` (its ancestors); None when one is a placeholder
    (an input, a parameter or a buffer)."""
    env: dict[str, object] = {}
    for node in gm.graph.nodes:
        if node.name not in needed and node.name != name:
            continue
        if node.op == "placeholder":
            return None
        if node.op == "get_attr":
            env[node.name] = getattr(gm, str(node.target))
        elif node.op == "call_function":
            if any(a.name not in env for a in node.all_input_nodes):
                return None  # it reads a placeholder (an input, a parameter or a buffer)
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: env[a.name])
            if "device" in kwargs:  # a model built on meta: positions and masks are computed here, on the host
                kwargs = {**kwargs, "device": torch.device("cpu")}
            env[node.name] = node.target(*args, **kwargs)
        if node.name == name:
            value = env[name]
            return value if isinstance(value, torch.Tensor) else None
    return None


def _is_causal(mask: torch.Tensor | None, seq: int) -> bool:
    """Whether an attention mask (boolean: True attends; or additive) at `seq` tokens is the causal one."""
    if mask is None or mask.dim() < 2 or tuple(mask.shape[-2:]) != (seq, seq):
        return False
    allowed = mask if mask.dtype == torch.bool else mask == 0
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
        return False
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return bool((allowed.to(torch.bool).cpu() == causal).all())


def causal_mask_problem(graph: TrainingGraph, sdpa: str, seq: int) -> str | None:
    """Why the mask SDPA node `sdpa` of `graph` (captured at `seq` tokens) passes cannot run as is_causal under
    context parallelism (None: it has none, or it is the causal mask built from the token positions alone).
    Computed once per capture (`TrainingGraph.mask_checks`): the planner's check is the runtime's when `compile`
    hands the planner's capture to the program, so a rank does not hold the whole mask while it builds."""
    if sdpa not in graph.mask_checks:
        graph.mask_checks[sdpa] = _mask_problem(graph, sdpa, seq)
    return graph.mask_checks[sdpa]


def _mask_problem(graph: TrainingGraph, sdpa: str, seq: int) -> str | None:
    node = graph.nodes[sdpa]
    if len(node.args) <= 3:
        return None
    mask = node.args[3]
    size = graph.nodes[mask].outputs[0].numel if mask in graph.nodes else 0
    if size > MASK_CHECK_ELEMENTS:
        return (f"its mask ({size:.3g} elements at {seq} tokens) is too large to check that it is the causal one "
                f"(at most {MASK_CHECK_ELEMENTS:.3g}); a model calling scaled_dot_product_attention with "
                f"is_causal=True and no mask needs no check")
    needed = _ancestors(graph, [mask])
    leaves = {a for x in needed for a in graph.nodes[x].args if a not in graph.nodes}
    if leaves & set(graph.params):
        return "it depends on the model's parameters or buffers (a learned bias)"
    if leaves & set(graph.input_meta):
        return "it depends on the inputs (a padding mask)"
    if graph.gm is None or not _is_causal(_evaluate(graph.gm, mask, needed), seq):
        return "its mask is not the causal one (a sliding window, padding or another pattern)"
    return None


def check_masks(graph: TrainingGraph) -> None:
    """`causal_mask_problem` for every SDPA of `graph` that passes a mask (memoised on the graph), at the
    sequence length of its first input (batch, seq, ...)."""
    first = next((m for m in graph.input_meta.values() if len(m.shape) >= 2), None)
    if first is None:
        return
    for name, n in graph.nodes.items():
        if n.target == ATTENTION and len(n.args) > 3:
            causal_mask_problem(graph, name, first.shape[1])


def sequence_roles(full: TrainingGraph, local: TrainingGraph, seq: int, seq_local: int, cp: int,
                   model_outputs: list[str] | None = None, masks_of: TrainingGraph | None = None) -> SequenceRoles:
    """The aranges and attentions to replace in `local` (the capture at `seq_local` tokens per sequence) and
    the loss's reductions; PlanError naming the op when the model mixes tokens any other way. `model_outputs`:
    the nodes the model hands to its loss, which must each carry tokens on dimension 1 (a reduction over tokens
    belongs to the loss, after them). `masks_of`: the capture whose mask checks to use (the same model at another
    batch size, with the same nodes; default `full`).

    Beyond shapes, an op acting along a token-carrying value's sequence dimension (a `dim` argument on it: a
    softmax, cumsum, sort, flip, cat or split there; tensor indexing along it; a convolution over it) mixes
    tokens and is refused, unless it only builds a causal attention mask: a mask made from the token positions
    alone that, at the full length, is the causal one (checked by computing it) runs as `is_causal` (what
    Hugging Face models pass to SDPA)."""
    if set(full.nodes) != set(local.nodes) or any(full.nodes[k].target != local.nodes[k].target for k in full.nodes):
        raise PlanError(f"the model's graph at {seq_local} tokens per sequence differs from its graph at {seq}: its "
                        f"structure depends on the sequence length, so context parallelism (cp={cp}) cannot split "
                        f"it. Use cp=1.")
    roles = SequenceRoles()
    tokdim: dict[str, int | None | str] = {k: _token_dim(full.input_meta[k].shape, m.shape, seq, seq_local)
                                           for k, m in local.input_meta.items() if k in full.input_meta}
    order = list(local.nodes)
    for name in order:
        n, g = local.nodes[name], full.nodes[name]
        kinds = [_token_dim(a.shape, b.shape, seq, seq_local) for a, b in zip(g.outputs, n.outputs, strict=True)]
        tokdim[name] = "mixed" if "mixed" in kinds else next((k for k in kinds if k is not None), None)
    carries = {k: v is not None for k, v in tokdim.items()}
    users: dict[str, list[str]] = {}  # (a capture-time check that outputs nothing is nobody's user)
    for name in order:
        for a in local.nodes[name].args if local.nodes[name].outputs else ():
            users.setdefault(a, []).append(name)
    attentions = [k for k in order if local.nodes[k].target == ATTENTION]
    # masks passed to SDPA (its fourth tensor argument), and what only builds them
    masks = {k: local.nodes[k].args[3] for k in attentions if len(local.nodes[k].args) > 3}
    builds = _ancestors(local, list(masks.values()))
    only_masks: set[str] = set()
    for name in reversed(order):
        if name in builds and all(u in only_masks or u in masks for u in users.get(name, [])):
            only_masks.add(name)
    params = set(local.params)
    fx_nodes = {n.name: n for n in local.gm.graph.nodes} if local.gm is not None else {}
    for sdpa, mask in masks.items():
        why = causal_mask_problem(masks_of or full, sdpa, seq)
        if why is None and mask not in only_masks:
            why = "its mask is used elsewhere too"
        if why is not None:
            raise PlanError(f"context parallelism (cp={cp}) cannot split {_where(local.nodes[sdpa])}: it passes an "
                            f"attention mask and {why}; ring attention builds the causal mask from the tokens' "
                            f"global positions. Use is_causal=True without attn_mask, or cp=1.")
        roles.causal_masks.append(sdpa)
    # the model's part (what its outputs are made from): the loss after it may reduce over tokens, which
    # `loss_is_token_mean` checks numerically
    in_model = _ancestors(local, list(model_outputs)) if model_outputs else set()
    checked = in_model if model_outputs else set(order)  # a model computing its own loss: every op
    for name in order:
        n, g = local.nodes[name], full.nodes[name]
        if name in only_masks:
            continue
        if n.target in ARANGES and carries[name]:
            roles.positions.append(name)
            continue
        if n.target == ATTENTION:
            roles.attentions.append(name)
            continue
        if tokdim[name] == "mixed":
            shapes = f"{list(g.outputs[0].shape)} at {seq} tokens, {list(n.outputs[0].shape)} at {seq_local}"
            raise PlanError(f"context parallelism (cp={cp}) cannot split {_where(n)}: its output ({shapes}) mixes "
                            f"tokens, which only torch's scaled_dot_product_attention (is_causal or no mask) may do "
                            f"under cp. Write attention with F.scaled_dot_product_attention(..., is_causal=True) "
                            f"instead of a mask built from the sequence, or use cp=1.")
        first = next((a for a in n.args if carries.get(a)), None)
        node = fx_nodes.get(name)
        if first is not None and node is not None and n.target not in MOVEMENT and name in checked:
            t = tokdim[first]
            ndim = len(local.nodes[first].outputs[0].shape) if first in local.nodes else \
                len(local.input_meta[first].shape)
            along = isinstance(t, int) and (t in _dims_of(node, ndim) or t in _indexed_dims(node)
                                            or (n.target == "aten.convolution.default" and t >= 2))
            keeps = tokdim[name] is not None and n.outputs and first in local.nodes and \
                n.outputs[0].shape == local.nodes[first].outputs[0].shape and g.outputs[0].shape == \
                full.nodes[first].outputs[0].shape
            if along and not (n.target in ("aten.slice.Tensor", "aten.narrow.default") and keeps):
                raise PlanError(f"context parallelism (cp={cp}) cannot split {_where(n)}: it works along the "
                                f"sequence dimension ({t}) of {first}, so a rank's share of the tokens would not "
                                f"give its part of the result. Only scaled_dot_product_attention may look across "
                                f"tokens under cp; use cp=1 for this model.")
        if any(carries.get(a, False) for a in n.args) and not carries[name] and not n.is_view and n.outputs:
            roles.reductions.append(name)
    for r in roles.reductions:
        why = "the model reduces over the sequence before its output" if r in in_model else None
        seen, todo = set(), [r]
        while todo and why is None:
            x = todo.pop()
            for u in users.get(x, []):
                if u in seen:
                    continue
                seen.add(u)
                reads_param = bool(params & set(local.nodes[u].args))
                if reads_param or carries.get(u):
                    why = f"{_where(local.nodes[u])} reads {'a parameter' if reads_param else 'tokens'} after it"
                    break
                todo.append(u)
        if why is not None:
            raise PlanError(f"context parallelism (cp={cp}) cannot split {_where(local.nodes[r])}: it reduces over "
                            f"the sequence and {why}, so each rank's part would not add up to the whole. Use cp=1.")
    for name in model_outputs or ():
        n, g = local.nodes.get(name), full.nodes.get(name)
        if n is None or g is None:
            continue
        if any(_token_dim(a.shape, b.shape, seq, seq_local) != 1 for a, b in zip(g.outputs, n.outputs, strict=True)):
            raise PlanError(f"context parallelism (cp={cp}) needs the model's output to hold its tokens on dimension "
                            f"1 (batch, seq, ...), but {_where(n)} is {list(g.outputs[0].shape)} at {seq} tokens: "
                            f"the loss could not be split by tokens. Use cp=1.")
    return roles


def loss_is_token_mean(loss_fn: object, output: torch.Tensor, target: torch.Tensor, parts: list[torch.Tensor],
                       ) -> bool:
    """Whether `loss_fn(output, target)` equals the mean over cp parts of the loss on each part's tokens (dim
    1): what the runtime computes when it weighs each rank's loss by its share of the tokens. `output` is a
    stand-in for the model's output (random values of its shape), `parts` the token positions of each rank."""
    with torch.no_grad():
        whole = loss_fn(output, target)  # type: ignore[operator]
        summed = sum(loss_fn(output.index_select(1, p), target.index_select(1, p)) for p in parts) / len(parts)  # type: ignore[operator]
    return bool(torch.allclose(whole.double(), summed.double(), rtol=1e-5, atol=1e-6))


__all__ = ["ATTENTION", "SequenceRoles", "causal_mask_problem", "check_masks", "loss_is_token_mean", "sequence_roles"]
