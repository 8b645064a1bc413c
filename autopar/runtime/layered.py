"""A stage program run layer by layer, so that memory actions happen at the granularity the plan prices.

`layered(gm, layer_of, hooks, recompute)` cuts a stage's fx program along the layer chain
(`torch.fx.passes.split_module`, one submodule per layer, in layer order) and wraps each layer's call:

    forward    hooks.before_forward(l); run layer l (under `torch.utils.checkpoint` when l is a recomputed
               block); hooks.after_forward(l)
    backward   the layer's outputs pass through an identity autograd Function whose backward runs
               hooks.before_backward(l) once the gradients of all of them are ready, i.e. just before
               autograd enters layer l's own backward (and its recomputation)

This is what lets ZeRO-3 gather a layer's parameters right before its forward and its backward and free
them after (zero_layers.py), and recompute one block at a time (the planner prices recompute per block:
only each block's input is kept, plus one block's activations while it is recomputed). The math is the
stage program's: the same aten ops in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from ..passes.randomness import remembering

Runner = Callable[[nn.Module, tuple], Any]


class LayerHooks(Protocol):
    def before_forward(self, layer: int) -> None: ...
    def after_forward(self, layer: int) -> None: ...
    def before_backward(self, layer: int) -> None: ...


class NoHooks:
    """Layers without memory actions (recompute per block only)."""

    def __bool__(self) -> bool:
        return False

    def layers(self) -> set[int]:
        return set()

    def before_forward(self, layer: int) -> None:
        pass

    def after_forward(self, layer: int) -> None:
        pass

    def before_backward(self, layer: int) -> None:
        pass


class _Boundary(torch.autograd.Function):
    """Identity on a layer's outputs; its backward tells the hooks that layer's backward is next."""

    @staticmethod
    def forward(ctx: Any, hooks: LayerHooks, layer: int, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hooks, ctx.layer = hooks, layer
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        ctx.hooks.before_backward(ctx.layer)
        return (None, None, *grads)


def _mark(hooks: LayerHooks, layer: int, out: Any) -> Any:
    flat = list(out) if isinstance(out, (tuple, list)) else [out]
    idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not idx:
        return out
    marked = _Boundary.apply(hooks, layer, *(flat[i] for i in idx))
    for i, m in zip(idx, marked, strict=True):
        flat[i] = m
    return type(out)(flat) if isinstance(out, (tuple, list)) else flat[0]


class _LayerCall(nn.Module):
    def __init__(self, inner: nn.Module, layer: int, hooks: LayerHooks, checkpointed: bool,
                 run: Runner | None) -> None:
        super().__init__()
        self.inner, self.layer, self.hooks, self.checkpointed, self.run = inner, layer, hooks, checkpointed, run

    def forward(self, *args: Any) -> Any:
        self.hooks.before_forward(self.layer)
        call = self.inner if self.run is None else (lambda *a: self.run(self.inner, a))  # type: ignore[misc]
        if self.checkpointed and torch.is_grad_enabled():
            out = torch.utils.checkpoint.checkpoint(remembering(call), *args, use_reentrant=False)
        else:
            out = call(*args)
        self.hooks.after_forward(self.layer)
        if isinstance(self.hooks, NoHooks) or not torch.is_grad_enabled():
            return out
        return _mark(self.hooks, self.layer, out)


def layer_calls(top: fx.GraphModule) -> list[_LayerCall]:
    """The wrapped per-layer calls of a `layered` program, in layer order."""
    return [m for m in top.children() if isinstance(m, _LayerCall)]


def node_layers(gm: fx.GraphModule, known: dict[str, int], default: int) -> dict[str, int]:
    """Layer of every op node of `gm`: the captured graph's for nodes it has, else (nodes added after
    capture, e.g. fused kernel calls) the latest layer among the node's inputs."""
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            if n.name in known:
                out[n.name] = known[n.name]
            else:
                out[n.name] = max((out[a.name] for a in n.all_input_nodes if a.name in out), default=default)
    return out


def layered(gm: fx.GraphModule, layer_of: dict[str, int], hooks: LayerHooks, recompute: set[int],
            run: Runner | None = None) -> fx.GraphModule:
    """`gm` with one wrapped submodule per layer (module docstring). `layer_of` maps op node names to
    layers (`node_layers`); `recompute` holds the layers run under activation checkpointing; `run(module,
    args)` executes a layer's program (default: call it; tensor parallelism: its DTensor interpreter)."""
    first = min(layer_of.values(), default=0)
    top = split_module(gm, None, lambda n: layer_of.get(n.name, first), keep_original_order=True,
                       keep_original_node_name=True)
    for node in top.graph.nodes:
        if node.op == "call_module":
            layer = int(str(node.target).removeprefix("submod_"))
            setattr(top, str(node.target), _LayerCall(getattr(top, str(node.target)), layer, hooks,
                                                       layer in recompute, run))
    return top
