"""Tensor-parallel patterns of a captured graph, as pure functions of the TrainingGraph.

Which linears pair up column-/row-parallel (Megatron), which ops form an attention core and which linear
projects its output, the LM head and the vocabulary-sized embedding tables. Placements are dim indices
(a parameter or node -> the dim it is sharded on). Shared by the planner's pricing
(solver/intra_op/pricing.py) and the runtime (runtime/tensor_parallel.py turns them into DTensor
placements), so that the two agree and the solver never imports the runtime.

Attention cores (`attention_core`): scaled_dot_product_attention, or attention written out as matmuls, the
way Megatron-LM computes it: scores = Q @ K^T, then scaling / masking / softmax / dropout, then scores @ V,
with 4-d (batch, heads, seq, head_dim) operands. Head-parallel, the core's Q, K and V inputs are re-laid out
by heads (a local slice of replicated values) and every op of the core runs on its heads only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..ir.graph import TrainingGraph

SDPA = "aten.scaled_dot_product_attention.default"
ELEMENTWISE_FOLLOW = {
    "aten.gelu.default",
    "aten.relu.default",
    "aten.silu.default",
    "aten.dropout.default",
    "aten.mul.Tensor",
    "aten.tanh.default",
    "aten.add.Tensor",
    "aten.pow.Tensor_Scalar",
    "aten.sigmoid.default",
    "aten.clone.default",
    "aten.contiguous.default",
}
VIEWS = {
    "aten.view.default",
    "aten.reshape.default",
    "aten.transpose.int",
    "aten.permute.default",
    "aten._unsafe_view.default",
    "aten.contiguous.default",
    "aten.clone.default",
    "aten.flatten.using_ints",
}
TO_LOSS = VIEWS | {"aten.to.dtype", "aten._to_copy.default", "aten.alias.default", "aten.slice.Tensor",
                   "aten._assert_tensor_metadata.default"}
_MATMULS = {"aten.matmul.default", "aten.bmm.default"}
# ops between the two matmuls of an attention written out (scaling, masking, softmax, dropout, casts)
_SCORE_OPS = {"div", "mul", "add", "sub", "masked_fill", "softmax", "_softmax", "_safe_softmax", "dropout",
              "native_dropout", "to", "_to_copy", "where", "clone", "contiguous", "alias", "type_as"}
_SOFTMAX = {"softmax", "_softmax", "_safe_softmax"}


def _base(target: str) -> str:
    parts = target.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "aten" else target


# linear-like ops: (index of the activation argument, of the weight, the weight's output-feature dim): linear's
# weight is (out, in); addmm's and mm's mat2 a Conv1D-style weight (in, out)
LINEAR_ARGS = {"aten.linear.default": (0, 1, 0), "aten.addmm.default": (1, 2, 1), "aten.mm.default": (0, 1, 1)}


def weight_of(graph: TrainingGraph, node_name: str) -> tuple[str, int] | None:
    """(parameter placeholder, index of its output-feature dim) for a linear-like node with a weight param."""
    n = graph.nodes[node_name]
    spec = LINEAR_ARGS.get(n.target)
    if spec is None or len(n.args) <= spec[1] or n.args[spec[1]] not in graph.params:
        return None
    w = n.args[spec[1]]
    if n.target != "aten.linear.default" and len(graph.params[w].meta.shape) != 2:
        return None
    return w, spec[2]


def users(graph: TrainingGraph, names: Iterable[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name in names:
        for a in graph.nodes[name].args:
            out.setdefault(a, []).append(name)
    return out


def next_linear(graph: TrainingGraph, readers: dict[str, list[str]], start: str, through: set[str]) -> str | None:
    """The first linear-like node reading `start`'s value through ops in `through`."""
    frontier, seen = [start], set()
    while frontier:
        cur = frontier.pop()
        for u in readers.get(cur, []):
            if u in seen:
                continue
            seen.add(u)
            if weight_of(graph, u) and graph.nodes[u].args[LINEAR_ARGS[graph.nodes[u].target][0]] \
                    in ({cur} | seen | {start}):
                return u
            if graph.nodes[u].target in through:
                frontier.append(u)
    return None


@dataclass(frozen=True)
class AttentionCore:
    """One attention: `nodes` run head-parallel on `inputs` re-laid out by heads; `output` is the value the
    output projection reads (through views)."""

    nodes: tuple[str, ...]
    output: str
    inputs: tuple[tuple[str, int], ...]  # (node, its heads dim)

    def heads(self, reads: dict[str, int]) -> bool:
        """Whether an op of the core reading its inputs in layouts `reads` (name -> dim, < 0 not sharded)
        runs head-parallel: every core input it reads arrives sharded on its heads dim."""
        mine = [(a, d) for a, d in self.inputs if a in reads]
        return bool(mine) and all(reads[a] == d for a, d in mine)


def attention_core(graph: TrainingGraph, name: str) -> AttentionCore | None:
    """The attention core whose output node is `name` (an SDPA, or the scores @ V matmul), else None."""
    n = graph.nodes[name]
    if n.target == SDPA:
        qkv = tuple((a, 1) for a in n.args[:3] if a in graph.nodes)
        return AttentionCore((name,), name, qkv)
    if n.target not in _MATMULS or len(n.args) != 2 or not all(a in graph.nodes for a in n.args):
        return None
    rank = len(n.outputs[0].shape) if n.outputs else 0
    if rank != 4:
        return None
    frontier, seen, softmax = [n.args[0]], set(), False
    while frontier:  # back from the probabilities to the Q @ K^T matmul, through score ops only
        cur = frontier.pop()
        if cur in seen or cur not in graph.nodes:
            continue
        seen.add(cur)
        node = graph.nodes[cur]
        if node.target in _MATMULS:
            if not softmax or len(node.args) != 2 or not all(a in graph.nodes for a in node.args) \
                    or len(node.outputs[0].shape) != rank:
                return None
            ins = (node.args[0], node.args[1], n.args[1])
            return AttentionCore((cur, name), name, tuple((a, rank - 3) for a in ins))
        if _base(node.target) in _SCORE_OPS or _base(node.target) in _SOFTMAX:
            softmax |= _base(node.target) in _SOFTMAX
            frontier += [a for a in node.args if a in graph.nodes]
    return None


def attention_cores(graph: TrainingGraph, names: Iterable[str]) -> list[AttentionCore]:
    return [c for c in map(lambda m: attention_core(graph, m), names) if c is not None]


def attention_projection(graph: TrainingGraph, attention: str, names: list[str]) -> tuple[str, int] | None:
    """(weight placeholder, its row-parallel shard dim) of the linear projecting attention output node
    `attention`'s value (through views, within `names`): attention runs head-parallel when that weight is
    so placed."""
    proj = next_linear(graph, users(graph, names), attention, VIEWS)
    if proj is None:
        return None
    w, out_dim = weight_of(graph, proj)  # type: ignore[misc]
    return w, 1 - out_dim


def source_linear(graph: TrainingGraph, name: str) -> str | None:
    """The linear-like node whose output `name` is, through single-input views, getitems and unbinds."""
    while name in graph.nodes and not weight_of(graph, name):
        n = graph.nodes[name]
        ins = [a for a in n.args if a in graph.nodes]
        if len(ins) != 1 or not (n.target in VIEWS or n.target == "<built-in function getitem>"
                                 or _base(n.target) in ("unbind", "split", "split_with_sizes", "chunk", "select")):
            return None
        name = ins[0]
    return name if name in graph.nodes else None


def fused_qkv(graph: TrainingGraph, core: AttentionCore) -> bool:
    """Whether the core's Q, K and V come out of one linear (split by a view the runtime cannot shard)."""
    found = {source_linear(graph, a) for a, _ in core.inputs}
    return len(core.inputs) > 1 and len(found) == 1 and None not in found


@dataclass
class Placements:
    """Shard dims: model parameter name -> dim; node -> dim its output is re-laid out to (by heads)."""

    params: dict[str, int] = field(default_factory=dict)
    relayout: dict[str, int] = field(default_factory=dict)


def bias_of(graph: TrainingGraph, node_name: str) -> str | None:
    n = graph.nodes[node_name]
    if n.target == "aten.linear.default" and len(n.args) == 3 and n.args[2] in graph.params:
        return n.args[2]
    if n.target == "aten.addmm.default" and n.args[0] in graph.params:
        return n.args[0]
    return None


def megatron_placements(graph: TrainingGraph, layers: tuple[int, int], heads: list[str] | None = None) -> Placements:
    """Megatron-style placements derived from the graph: an MLP's first linear column-parallel and its
    second row-parallel; attention head-parallel with its output projection row-parallel. Fused QKV
    projections stay replicated (their output is split by a view DTensor cannot shard evenly). `heads`:
    `loss_heads(graph)` where the caller has it (it reads the whole graph; a planner asks per layer)."""
    spec = Placements()
    names = [n for layer in graph.layers[layers[0] : layers[1]] for n in layer.nodes]
    readers = users(graph, names)
    row_done: set[str] = set()
    for core in attention_cores(graph, names):
        spec.relayout.update(core.inputs)
        proj = next_linear(graph, readers, core.output, VIEWS)
        if proj:
            w, out_dim = weight_of(graph, proj)  # type: ignore[misc]
            spec.params[graph.canonical(w)] = 1 - out_dim
            row_done.add(proj)
    for name in names:
        if name in row_done or not weight_of(graph, name):
            continue
        second = next_linear(graph, readers, name, ELEMENTWISE_FOLLOW | VIEWS)
        if second is None or second in row_done or len(readers.get(name, [])) != 1:
            continue
        w1, d1 = weight_of(graph, name)  # type: ignore[misc]
        w2, d2 = weight_of(graph, second)  # type: ignore[misc]
        if graph.canonical(w1) in spec.params or graph.canonical(w2) in spec.params:
            continue
        spec.params[graph.canonical(w1)] = d1
        b1 = bias_of(graph, name)
        if b1:
            spec.params[graph.canonical(b1)] = 0
        spec.params[graph.canonical(w2)] = 1 - d2
        row_done.update({name, second})
    _vocab_parallel(graph, names, spec, row_done, loss_heads(graph) if heads is None else heads)
    return spec


def loss_heads(graph: TrainingGraph) -> list[str]:
    """Linear-like nodes whose output reaches a cross-entropy through views and casts only (LM heads)."""
    readers = users(graph, list(graph.nodes))
    heads = []
    for start in graph.nodes:
        if not weight_of(graph, start):
            continue
        frontier, seen = [start], {start}
        while frontier:
            for u in readers.get(frontier.pop(), []):
                if u in seen:
                    continue
                seen.add(u)
                node = graph.nodes[u]
                if node.target == "aten.cross_entropy_loss.default" and node.args[0] in seen:
                    heads.append(start)
                elif node.target in TO_LOSS:
                    frontier.append(u)
    return heads


def _vocab_parallel(graph: TrainingGraph, names: list[str], spec: Placements, done: set[str], heads: list[str]
                    ) -> None:
    """The LM head (a linear feeding a cross-entropy) column-parallel along the vocabulary, and embedding
    tables with as many rows as a head has classes shard(0) (see runtime/vocab_parallel.py); position and
    other small tables stay replicated. A tied head and embedding get the same placement; a parameter
    already placed otherwise is left alone. `heads`: `loss_heads(graph)`."""
    vocab = {graph.params[w].meta.shape[d] for w, d in (weight_of(graph, h) for h in heads)}  # type: ignore[misc]
    mine = set(names)
    for name in names:
        n = graph.nodes[name]
        if n.target == "aten.embedding.default" and n.args and n.args[0] in graph.params \
                and graph.params[n.args[0]].meta.shape[0] in vocab:
            spec.params.setdefault(graph.canonical(n.args[0]), 0)
    for name in heads:
        if name not in mine or name in done:
            continue
        w, out_dim = weight_of(graph, name)  # type: ignore[misc]
        if spec.params.setdefault(graph.canonical(w), out_dim) != out_dim:
            continue
        bias = bias_of(graph, name)
        if bias:
            spec.params.setdefault(graph.canonical(bias), 0)


__all__ = ["ELEMENTWISE_FOLLOW", "LINEAR_ARGS", "SDPA", "TO_LOSS", "VIEWS", "AttentionCore", "Placements",
           "attention_core", "attention_cores", "attention_projection", "bias_of", "fused_qkv", "loss_heads",
           "megatron_placements", "next_linear", "source_linear", "users", "weight_of"]
