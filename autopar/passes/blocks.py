"""Group the fine op graph into a coarse chain of layers, detecting repeated blocks.

Repeated blocks are the children of the module container (nn.ModuleList / nn.Sequential) that covers the
most ops: `transformer.h.0`, `transformer.h.1`, ... for GPT-2; `layers.0` ... for Llama. Ops before the
first block form the "pre" layer (embeddings), ops after the last form the "post" layer (final norm,
head, loss). Ops outside any block that run between two blocks stay with the block before them.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from dataclasses import replace

from ..ir.graph import Layer, OpNode, TrainingGraph

_INDEXED = re.compile(r"^(.*?)\.?(\d+)$")


def _containers(path: str) -> list[tuple[str, int]]:
    """Every (container, child index) pair along a module path: 'a.h.3.mlp' -> [('a.h', 3)]."""
    parts = path.split(".") if path else []
    found = []
    for i, p in enumerate(parts):
        if p.isdigit():
            found.append((".".join(parts[:i]), int(p)))
    return found


def find_repeated_container(nodes: list[OpNode]) -> str | None:
    """The container whose indexed children cover the most ops (ties: the outermost)."""
    cover: dict[str, int] = defaultdict(int)
    children: dict[str, set[int]] = defaultdict(set)
    for n in nodes:
        for container, idx in _containers(n.module):
            cover[container] += 1
            children[container].add(idx)
    candidates = [c for c in cover if len(children[c]) >= 2]
    if not candidates:
        return None
    return max(candidates, key=lambda c: (cover[c], -c.count(".")))


def _block_of(path: str, container: str) -> int | None:
    prefix = container + "." if container else ""
    if not path.startswith(prefix):
        return None
    rest = path[len(prefix) :].split(".", 1)[0]
    return int(rest) if rest.isdigit() else None


def _signature(layer_nodes: list[OpNode], param_shapes: list[tuple]) -> str:
    h = hashlib.sha1()
    for n in layer_nodes:
        h.update(n.target.encode())
        h.update(repr([(t.shape, t.dtype) for t in n.outputs]).encode())
    h.update(repr(param_shapes).encode())
    return h.hexdigest()[:16]


def group_layers(g: TrainingGraph) -> TrainingGraph:
    """Return a copy of `g` with `layers` set and every node/param tagged with its layer index."""
    ordered = list(g.nodes.values())
    container = find_repeated_container(ordered)
    assignment: dict[str, str] = {}  # node -> layer key
    keys: list[str] = []
    if container is None:
        # No repeated blocks: one layer per top-level submodule, in execution order.
        for n in ordered:
            top = n.module.split(".", 1)[0] if n.module else ""
            key = keys[-1] if (not top and keys) else (top or "pre")
            if not keys or keys[-1] != key:
                keys.append(key if key not in keys else f"{key}#{len(keys)}")
            assignment[n.name] = keys[-1]
    else:
        last_block: str | None = None
        seen_block = False
        for n in ordered:
            b = _block_of(n.module, container)
            if b is not None:
                key = f"{container}.{b}" if container else str(b)
                seen_block, last_block = True, key
            elif not seen_block:
                key = "pre"
            else:
                key = last_block  # type: ignore[assignment]
            if key not in keys:
                keys.append(key)
            assignment[n.name] = key
        # Un-owned ops between two blocks (an activation applied by the parent's loop) stay with the block
        # before them. After the last block, the same pattern of un-owned ops stays with it too, so the
        # last block looks like the others; everything after that is the epilogue (norm, pooling, head).
        last = max(i for i, n in enumerate(ordered) if _block_of(n.module, container) is not None)
        tail = ordered[last + 1 :]
        first_key = next(k for k in keys if k != "pre")
        first_members = [n for n in ordered if assignment[n.name] == first_key]
        suffix: list[str] = []
        for n in reversed(first_members):
            if _block_of(n.module, container) is not None:
                break
            suffix.insert(0, n.target)
        keep = len(suffix) if [n.target for n in tail[: len(suffix)]] == suffix else 0
        if keep < len(tail):
            keys.append("post")
            for n in tail[keep:]:
                assignment[n.name] = "post"
    index = {k: i for i, k in enumerate(keys)}
    nodes = {name: replace(n, layer=index[assignment[name]]) for name, n in g.nodes.items()}
    params = {}
    for pname, p in g.params.items():
        users = [n.layer for n in nodes.values() if pname in n.args]
        params[pname] = replace(p, layer=min(users) if users else 0)
    layers = []
    for k, key in enumerate(keys):
        members = [n for n in nodes.values() if n.layer == k]
        lparams = [p for p, info in params.items() if info.layer == k]
        kind = (
            "pre"
            if key == "pre"
            else "post"
            if key == "post"
            else ("block" if container is not None else "pre")
        )
        if container is None:
            kind = "block"
        sig = _signature(members, [params[p].meta.shape for p in lparams])
        layers.append(
            Layer(
                index=k, name=key, kind=kind, nodes=[n.name for n in members], params=lparams, signature=sig
            )
        )
    return replace(g, nodes=nodes, params=params, layers=layers)
