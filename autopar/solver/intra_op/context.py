"""What the intra-op problem of one (graph, tensor-parallel mesh, device type) is priced with: `Context`, the
tensors' metadata and bytes at the micro-batch, the collectives and reshardings over the mesh (memoised), the
ops' re-priced compute and their strategies (`intra_op.strategies`), and the key identical blocks share.

`intra_op.build` builds the problems with it; `intra_op.pricing.LayerPricer` keeps one per group.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Container, Sequence

from ...cluster import Cluster
from ...cost_models.comm import collective_time
from ...cost_models.compute import ComputeModel, Profile, kernel_flops
from ...cost_models.memory import state_bytes_per_param
from ...ir.graph import Layer, OpNode, TensorMeta, TrainingGraph
from ...ir.precision import ELEMENT_BYTES
from ...passes.tp_patterns import attention_cores
from .problem import NodeStrategy
from .strategies import OpSpec, P, R, enumerate_strategies, op_spec

FORBIDDEN = 1.0  # seconds: the price of a resharding the runtime would not do (runtime mode)


class Context:
    """Everything one (graph, mesh, device type) needs, with memo tables for op strategies and collectives."""

    def __init__(self, graph: TrainingGraph, tp: int, device_type: str, cluster: Cluster,
                 group: Sequence[int], frac: float = 1.0, runtime: bool = False, profile: Profile | None = None
                 ) -> None:
        self.graph, self.tp, self.device_type = graph, tp, device_type
        self.runtime = runtime  # only what the DTensor runtime runs as priced (`reshard`, `strategies`)
        self.forbid = runtime  # price the reshardings the runtime would not do FORBIDDEN (off: a known answer)
        self.frac = frac  # micro-batch / captured batch: activations, FLOPs and their bytes scale by it
        self.cluster, self.group = cluster, tuple(group)
        self.model = ComputeModel(cluster.spec(device_type), profile, dtype=graph.dtype)  # None: the saved one
        self.scale = ELEMENT_BYTES.get(graph.dtype, 4) / 4
        self.state = state_bytes_per_param("adamw", graph.dtype)
        self.fx = {n.name: n for n in graph.gm.graph.nodes} if graph.gm is not None else {}
        self.consumers: dict[str, list[str]] = {}
        self.saved_by_layer: dict[int, set[str]] = {}
        for n in graph.nodes.values():
            for a in n.args:
                self.consumers.setdefault(a, []).append(n.name)
            for r in n.saved:
                base = r.split("#")[0]
                if base in graph.params:
                    continue
                home = graph.nodes[base].layer if base in graph.nodes else 0
                self.saved_by_layer.setdefault(home, set()).add(r)
        self._strategies: dict[str, list[NodeStrategy]] = {}
        self._comm: dict[tuple, float] = {}
        # what does not depend on the micro-batch (`frac`), shared with copies at other sizes as the tables above:
        # per layer, `layer_key` but its frac; per list of ops, their groups (`merged`)
        self._layer_keys: dict[int, tuple] = {}
        self._merged: dict[tuple[str, ...], list] = {}
        # node -> the attention core it belongs to (SDPA, or the two matmuls of matmul + softmax attention)
        self.cores = {m: c for c in attention_cores(graph, graph.nodes) for m in c.nodes}

    # -- tensors
    def meta(self, name: str) -> TensorMeta:
        g = self.graph
        if name in g.nodes:
            return g.nodes[name].outputs[0]
        return g.params[name].meta if name in g.params else g.input_meta[name]

    def tensor_bytes(self, meta: TensorMeta) -> float:
        """Bytes of an activation (never called on parameters) at the micro-batch."""
        return meta.nbytes * self.frac * (self.scale if meta.dtype.startswith(("float", "bfloat")) else 1.0)

    def needs_grad(self, name: str) -> bool:
        return name in self.graph.nodes and self.graph.nodes[name].requires_grad

    def boundary_layout(self, name: str, boundary: int) -> int:
        meta = self.meta(name)
        ok = (boundary != R and len(meta.shape) > boundary and meta.shape[0] == self.graph.batch_size
              and meta.shape[boundary] % self.tp == 0 and meta.dtype.startswith(("float", "bfloat")))
        return boundary if ok else R

    # -- costs
    def collective(self, kind: str, nbytes: float) -> float:
        key = (kind, nbytes)
        if key not in self._comm:
            self._comm[key] = float(collective_time(kind, nbytes, self.group, self.cluster))
        return self._comm[key]

    def reshard(self, src: int, dst: int, nbytes: float, forced: bool | None = None,
                takes: Container[int] = ()) -> float:
        """Seconds to turn layout `src` into `dst`. For an op's input (`forced` given) in runtime mode, the
        transitions DTensor does not make before an op cost FORBIDDEN: a partial sum or a shard into another
        shard (it replicates them), a slice of a replicated input unless the op needs it (`_forced`), and
        gathering a shard or partial sum the op can take as it is (`takes`)."""
        if self.forbid and forced is not None and src != dst and (
                (dst >= 0 and (src != R or not forced)) or (dst == R and src != R and src in takes)):
            return FORBIDDEN
        if src == dst or src == R or dst == P:
            return 0.0
        if src == P:
            return self.collective("all_reduce" if dst == R else "reduce_scatter", nbytes)
        if dst == R:
            return self.collective("all_gather", nbytes)
        return self.collective("all_to_all", nbytes / self.tp)  # each rank sends its slice

    def compute(self, node: OpNode, split_fwd: int, split_bwd: int) -> tuple[float, float]:
        def priced(kernels: list, base: dict[str, float], split: int) -> float:
            if split == 1 and self.frac == 1:
                return base.get(self.device_type, 0.0)
            scale = self.frac / split
            return sum(self.model.op_time(k.kind, kernel_flops(k) * scale, k.nbytes * scale) for k in kernels)

        return (priced(node.kernels_fwd, node.time_fwd, split_fwd),
                priced(node.kernels_bwd, node.time_bwd, split_bwd))

    # -- strategies
    def strategies(self, name: str) -> list[NodeStrategy]:
        if name not in self._strategies:
            spec, names = self.op_spec(name)
            found = []
            for s in enumerate_strategies(spec, self.tp, self.runtime):
                ins: dict[str, int] = {}
                grads: dict[str, int] = {}
                if all(ins.setdefault(a, x) == x for a, x in zip(names, s.ins, strict=True)):
                    for a, gl in zip(names, s.in_grads, strict=True):
                        grads[a] = P if P in (gl, grads.get(a)) else gl
                    found.append(NodeStrategy(s, ins, grads))
            self._strategies[name] = found
        return self._strategies[name]

    def op_spec(self, name: str) -> tuple[OpSpec, list[str]]:
        return op_spec(self.graph.nodes[name], self.fx.get(name), self.meta, set(self.graph.params))

    def layer_key(self, layer: Layer) -> tuple:
        """Everything the layer's problem depends on but the boundary layout, positionally (node names
        differ between identical blocks)."""
        key = self._layer_keys.get(layer.index)
        if key is None:
            key = self._layer_keys[layer.index] = self._layer_key(layer)
        return key[:2] + (self.frac,) + key[2:]

    def _layer_key(self, layer: Layer) -> tuple:
        """`layer_key` without `frac` (the only part a copy at another micro-batch size changes)."""
        g, pos = self.graph, {n: i for i, n in enumerate(layer.nodes)}
        h = hashlib.sha1()
        for name in layer.nodes:
            n = g.nodes[name]
            args = []
            for a in n.args:
                if a in pos:
                    args.append(("L", pos[a]))
                elif a in g.params:
                    p = g.params[a]
                    args.append(("W", p.meta, p.is_buffer, (p.tied_to or a) in layer.params))
                else:
                    args.append(("X", self.meta(a), self.needs_grad(a), a in g.nodes))
            spec = self.op_spec(name)[0] if n.outputs else None
            h.update(repr((n.target, n.outputs, args, spec and (spec.args, spec.kwargs),
                           n.time_fwd.get(self.device_type), n.time_bwd.get(self.device_type),
                           n.requires_grad, n.saved_internal_bytes, self.leaves(name, pos))).encode())
        saved = sorted((pos[r.split("#")[0]], r.partition("#")[2]) if r.split("#")[0] in pos else (-1, r)
                       for r in self.saved_by_layer.get(layer.index, ()))
        h.update(repr(saved).encode())
        spec = self.cluster.spec(self.device_type)
        ring = zip(self.group, self.group[1:] + self.group[:1], strict=True)
        links = tuple(self.cluster.link(a, b) for a, b in ring)
        nodes = [self.cluster.devices[i].node for i in self.group]
        return (h.hexdigest(), self.tp, self.runtime, self.graph.dtype, repr(spec), links, tuple(nodes),
                tuple(self.cluster.nodes[i].intra_node for i in nodes), self.cluster.network)

    def merged(self, members: list[str], merge: Callable[[Context, list[str]], list]) -> list:
        """`merge(self, members)` (build.py `merge_followers`: it reads the strategies only), memoised; the groups
        are shared, never changed after they are built."""
        key = tuple(members)
        hit = self._merged.get(key)
        if hit is None:
            hit = self._merged[key] = merge(self, members)
        return hit

    def leaves(self, name: str, inside: Container[str]) -> bool:
        """Whether a node's output is read outside `inside` (so it is written in the boundary layout)."""
        return any(c not in inside and self.graph.nodes[c].outputs for c in self.consumers.get(name, ()))

    def boundary_key(self, layer: Layer, boundary: int) -> tuple[int, ...]:
        """Layouts of the tensors crossing the layer's boundary, in node order."""
        inside = set(layer.nodes)
        ext = [a for n in layer.nodes for a in self.graph.nodes[n].args
               if a not in inside and a in self.graph.nodes]
        out = [n for n in layer.nodes if self.graph.nodes[n].outputs and self.leaves(n, inside)]
        return tuple(self.boundary_layout(a, boundary) for a in ext + out)


__all__ = ["FORBIDDEN", "Context"]
