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

from ..errors import PlanError
from ..ir.graph import TrainingGraph

ATTENTION = "aten.scaled_dot_product_attention.default"
ARANGES = ("aten.arange.default", "aten.arange.start", "aten.arange.start_step")


@dataclass
class SequenceRoles:
    """What context parallelism replaces in a capture at the local sequence length (node names)."""

    positions: list[str] = field(default_factory=list)  # aranges numbering the tokens
    attentions: list[str] = field(default_factory=list)  # SDPA calls (causal or unmasked) to run across the group
    reductions: list[str] = field(default_factory=list)  # the loss's reductions over tokens


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


def sequence_roles(full: TrainingGraph, local: TrainingGraph, seq: int, seq_local: int, cp: int,
                   model_outputs: list[str] | None = None) -> SequenceRoles:
    """The aranges and attentions to replace in `local` (the capture at `seq_local` tokens per sequence) and
    the loss's reductions; PlanError naming the op when the model mixes tokens any other way. `model_outputs`:
    the nodes the model hands to its loss, which must each carry tokens on dimension 1 (a reduction over tokens
    belongs to the loss, after them)."""
    if set(full.nodes) != set(local.nodes) or any(full.nodes[k].target != local.nodes[k].target for k in full.nodes):
        raise PlanError(f"the model's graph at {seq_local} tokens per sequence differs from its graph at {seq}: its "
                        f"structure depends on the sequence length, so context parallelism (cp={cp}) cannot split "
                        f"it. Use cp=1.")
    roles = SequenceRoles()
    carries: dict[str, bool] = {k: _token_dim(full.input_meta[k].shape, m.shape, seq, seq_local) is not None
                                for k, m in local.input_meta.items() if k in full.input_meta}
    order = list(local.nodes)
    for name in order:
        n, g = local.nodes[name], full.nodes[name]
        kinds = [_token_dim(a.shape, b.shape, seq, seq_local) for a, b in zip(g.outputs, n.outputs, strict=True)]
        carries[name] = any(k is not None for k in kinds)
        reads_tokens = any(carries.get(a, False) for a in n.args)
        if n.target in ARANGES and carries[name]:
            roles.positions.append(name)
            continue
        if n.target == ATTENTION:
            roles.attentions.append(name)
            continue
        if "mixed" in kinds:
            shapes = f"{list(g.outputs[0].shape)} at {seq} tokens, {list(n.outputs[0].shape)} at {seq_local}"
            raise PlanError(f"context parallelism (cp={cp}) cannot split {_where(n)}: its output ({shapes}) mixes "
                            f"tokens, which only torch's scaled_dot_product_attention (is_causal or no mask) may do "
                            f"under cp. Write attention with F.scaled_dot_product_attention(..., is_causal=True) "
                            f"instead of a mask built from the sequence, or use cp=1.")
        if reads_tokens and not carries[name] and not n.is_view and n.outputs:
            roles.reductions.append(name)
    users: dict[str, list[str]] = {}
    for name in order:
        for a in local.nodes[name].args:
            users.setdefault(a, []).append(name)
    params = set(local.params)
    in_model: set[str] = set()
    todo = [m for m in model_outputs or () if m in local.nodes]
    while todo:
        x = todo.pop()
        if x not in in_model:
            in_model.add(x)
            todo += [a for a in local.nodes[x].args if a in local.nodes]
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
    for name in roles.attentions:
        n = local.nodes[name]
        if len(n.args) > 3:  # q, k, v and a mask tensor
            raise PlanError(f"context parallelism (cp={cp}) cannot split {_where(n)}: it passes an attention mask; "
                            f"ring attention builds the causal mask from the tokens' global positions. Use "
                            f"is_causal=True without attn_mask, or cp=1.")
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


__all__ = ["ATTENTION", "SequenceRoles", "loss_is_token_mean", "sequence_roles"]
