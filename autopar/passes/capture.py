"""Capture: model + example batch -> TrainingGraph (forward and loss as aten ops, shapes on every node).

torch.export (non-strict) traces real models (Hugging Face included) that torch.fx.symbolic_trace cannot,
and works on meta tensors, so a 175B-parameter model is captured without allocating it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

from ..collector import collector_paused
from ..errors import CaptureError
from ..ir.graph import OpNode, ParamInfo, TensorMeta, TrainingGraph
from .blocks import group_layers

LossFn = Callable[[Any, Any], torch.Tensor]


class LossWrapper(nn.Module):
    """forward(*inputs[, target]) -> scalar loss, the function autopar trains."""

    def __init__(self, model: nn.Module, loss_fn: LossFn | None) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args: Any) -> torch.Tensor:
        if self.loss_fn is None:
            return model_loss(self.model(*args))
        *inputs, target = args
        return self.loss_fn(self.model(*inputs), target)


def model_loss(out: Any) -> torch.Tensor:
    """The scalar loss a model returns itself: a 0-d tensor or an output object with `.loss`."""
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None and isinstance(out, torch.Tensor):
        loss = out
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise CaptureError(
            f"with loss_fn=None the model must return a scalar loss (or an object with .loss), "
            f"but it returned {shape}. Pass loss_fn=(output, target) -> loss and example_target=."
        )
    return loss.reshape(())


def capture(
    model: nn.Module,
    example_inputs: tuple | list | torch.Tensor,
    loss_fn: LossFn | None = None,
    example_target: Any = None,
    *,
    sources: bool = True,
) -> TrainingGraph:
    """Capture the training graph of `loss_fn(model(*example_inputs), example_target)`.

    `example_inputs` is one global batch (the first dimension of the first tensor input is the batch);
    meta tensors and a model on the meta device are fine. `sources=False` leaves each node's user source line
    (`OpNode.source`) empty: torch then records no stack trace per node (`torch.fx.config.
    do_not_emit_stack_traces`), a fifth to a half of a small model's export, for captures nobody is shown
    (a rank's capture at its micro-batch size).
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"capture() needs a torch.nn.Module, got {type(model).__name__}.")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)) or not example_inputs:
        raise CaptureError("example_inputs must be a non-empty tuple of the model's inputs, e.g. (x,).")
    if loss_fn is not None and example_target is None:
        raise CaptureError("loss_fn was given without example_target: pass the target of the example batch.")
    args = tuple(example_inputs) + ((example_target,) if loss_fn is not None else ())
    on_meta = is_on_meta(model)
    wrapper = LossWrapper(model, loss_fn)
    with collector_paused():  # export builds many long-lived objects (collector.py)
        ep = _export(wrapper, to_meta(args) if on_meta else args, sources)
        if on_meta and any(v.is_meta for v in ep.constants.values() if isinstance(v, torch.Tensor)):
            _fill_lifted_constants(ep, wrapper, args)
        return graph_from_export(ep, type(model).__name__, batch_size=_batch_size(example_inputs))


class Captures:
    """One model's captures, each made once: a memo keyed by the batch a capture was made on (the shapes,
    dtypes and devices of its inputs and target, the loss function, whether source lines were kept).

    A program rebuilt for the same model (a re-route's, a re-plan's or a shed share's program, each rank's
    program in a device audit) takes its micro-batch captures from here instead of capturing again; a capture
    is a pure function of the model and its batch's shapes, so a hit gives the graph a capture would. Whoever
    holds the memo keeps it to one model in one state (or models built identically: the key does not look at
    the model); a capture of a model whose forward was swapped for a program (expert dispatch) is not kept."""

    def __init__(self) -> None:
        self._graphs: dict[tuple, TrainingGraph] = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def capture(self, model: nn.Module, example_inputs: tuple | list | torch.Tensor, loss_fn: LossFn | None = None,
                example_target: Any = None, *, sources: bool = True) -> TrainingGraph:
        """`capture(...)`'s graph for these arguments: the kept one when this batch was captured before."""
        key = _memo_key(example_inputs, loss_fn, example_target, sources)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = capture(model, example_inputs, loss_fn, example_target, sources=sources)
        return graph

    def kept(self, example_inputs: tuple | list | torch.Tensor, loss_fn: LossFn | None = None,
             example_target: Any = None, *, sources: bool = True) -> TrainingGraph | None:
        """The kept capture for these arguments, or None when this batch was not captured (nothing is captured)."""
        return self._graphs.get(_memo_key(example_inputs, loss_fn, example_target, sources))


def _memo_key(example_inputs: Any, loss_fn: LossFn | None, example_target: Any, sources: bool) -> tuple:
    # a loss function that compares by value but cannot be hashed (a dataclass with eq) is keyed by identity
    fn = loss_fn if isinstance(loss_fn, Hashable) else ("id", id(loss_fn))
    return (_batch_key(example_inputs), _batch_key(example_target), fn, sources)


def _batch_key(tree: Any) -> tuple:
    """What a capture reads of a batch: each tensor's shape, dtype, device and whether it requires a gradient,
    every other leaf's value."""
    leaves, spec = torch.utils._pytree.tree_flatten(tree)
    return (str(spec), *((tuple(x.shape), x.dtype, x.device.type, x.requires_grad) if isinstance(x, torch.Tensor)
                         else repr(x) for x in leaves))


def _export(wrapper: nn.Module, args: tuple, sources: bool = True) -> torch.export.ExportedProgram:
    import torch.fx.config as fx_config

    before = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = before or not sources
    try:
        return torch.export.export(wrapper, args, strict=False)
    except CaptureError:
        raise
    except Exception as e:  # torch raises many types here; turn each into one clear message
        raise CaptureError(explain_export_failure(e)) from e
    finally:
        fx_config.do_not_emit_stack_traces = before


def is_on_meta(model: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])


def to_meta(tree: Any) -> Any:
    """Every tensor of `tree` as a meta tensor of the same shape (a capture needs one device)."""
    return torch.utils._pytree.tree_map(
        lambda x: torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x, tree)


def _fill_lifted_constants(ep: torch.export.ExportedProgram, wrapper: nn.Module, args: tuple) -> None:
    """The values of the tensors a meta model's forward makes from Python data (torch.tensor([-2],
    device=x.device): export lifts them out of the graph as constants), which a capture on meta leaves
    without data. A second capture over fake CPU tensors (no memory) makes them on the CPU with their
    values; same model, same order, so the same names."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    saved: list[tuple[dict, str, torch.Tensor]] = []
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu")
        for mod in wrapper.modules():
            for slots, make in ((mod._parameters, lambda p: nn.Parameter(fake(p), p.requires_grad)),
                                (mod._buffers, fake)):
                for k, t in list(slots.items()):
                    if t is not None and t.is_meta:
                        saved.append((slots, k, t))
                        slots[k] = make(t)
        fake_args = torch.utils._pytree.tree_map(lambda x: fake(x) if isinstance(x, torch.Tensor) else x, args)
    try:
        cpu_ep = _export(wrapper, fake_args)
    finally:
        for slots, k, t in reversed(saved):
            slots[k] = t
    for name, value in cpu_ep.constants.items():
        old = ep.constants.get(name)
        if isinstance(old, torch.Tensor) and old.is_meta and isinstance(value, torch.Tensor) \
                and not value.is_meta and value.shape == old.shape:
            ep.constants[name] = value


def _batch_size(inputs: tuple | list) -> int:
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    raise CaptureError("no tensor input with a batch dimension among example_inputs.")


_USER_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)\n\s*(.+)')


def explain_export_failure(e: Exception) -> str:
    """Name the op and the user's source line that broke capture, and suggest the fix."""
    text = str(e)
    frames = [
        m
        for m in _USER_FRAME.finditer(text)
        if "site-packages/torch" not in m.group(1) and "/autopar/" not in m.group(1)
    ]
    where = ""
    if frames:
        f = frames[-1]
        where = f" at {f.group(1)}:{f.group(2)} in {f.group(3)}(): `{f.group(4).strip()}`"
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    if (
        "data-dependent" in text
        or "GuardOnDataDependentSymNode" in type(e).__name__
        or "Could not guard" in text
    ):
        fix = (
            "the model branches on tensor values (data-dependent control flow). Rewrite the branch with "
            "torch.where / torch.cond, or move it out of forward()."
        )
    elif "not implemented for 'Meta'" in text or "NotImplementedError" in type(e).__name__:
        fix = (
            "an op has no meta/fake implementation. Capture with real tensors on CPU instead of meta, or "
            "register a fake kernel for it (torch.library.register_fake)."
        )
    else:
        fix = (
            "make forward() traceable by torch.export(strict=False): avoid Python side effects on tensor "
            "values, .item()/.tolist() in forward, and unsupported ops."
        )
    return f"cannot capture the model{where}: {type(e).__name__}: {first[:300]}. Fix: {fix}"


def _meta(val: Any) -> list[TensorMeta]:
    if isinstance(val, torch.Tensor):
        return [TensorMeta(tuple(int(s) for s in val.shape), str(val.dtype).removeprefix("torch."))]
    if isinstance(val, (tuple, list)):
        return [m for v in val for m in _meta(v)]
    return []


def _source(node: torch.fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    frames = [
        m
        for m in _USER_FRAME.finditer(trace)
        if "/autopar/passes/" not in m.group(1) and "site-packages/torch/" not in m.group(1)
    ]
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.group(1)}:{f.group(2)}"


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['self'\]\.?", "", path)
    return path.removeprefix("model.").removeprefix("model") if path.startswith("model") else path


def _is_view(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    info = schema.returns[0].alias_info
    return info is not None and not info.is_write


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def graph_from_export(ep: torch.export.ExportedProgram, model_name: str, batch_size: int) -> TrainingGraph:
    """Turn an ExportedProgram of a LossWrapper into a TrainingGraph with its coarse layer chain."""
    sig = ep.graph_signature
    param_names = {**sig.inputs_to_parameters}
    buffer_names = {**sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
    user_inputs = list(sig.user_inputs)
    params: dict[str, ParamInfo] = {}
    nodes: dict[str, OpNode] = {}
    input_meta: dict[str, TensorMeta] = {}
    grad: dict[str, bool] = {}
    loss_node = ""
    first_owner: dict[int, str] = {}  # storage of a parameter -> first placeholder holding it
    state = {**ep.state_dict, **ep.constants}
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            metas = _meta(node.meta.get("val"))
            if node.name in param_names or node.name in buffer_names:
                is_buffer = node.name in buffer_names
                fqn = (buffer_names if is_buffer else param_names)[node.name].removeprefix("model.")
                tensor = state.get((buffer_names if is_buffer else param_names)[node.name])
                key = _storage_key(tensor) if tensor is not None else id(node)
                tied = first_owner.setdefault(key, node.name)
                params[node.name] = ParamInfo(
                    fqn, node.name, metas[0], is_buffer=is_buffer, tied_to="" if tied == node.name else tied
                )
                grad[node.name] = not is_buffer
            elif metas:
                input_meta[node.name] = metas[0]
                grad[node.name] = False
            continue
        if node.op == "output":
            out = node.args[0]
            out = out[0] if isinstance(out, (tuple, list)) else out
            loss_node = out.name
            continue
        if node.op != "call_function":
            raise CaptureError(f"unexpected {node.op} node {node.name} in the exported graph.")
        deps = [a.name for a in node.all_input_nodes]
        outs = _meta(node.meta.get("val"))
        floating = any(t.dtype.startswith(("float", "bfloat", "complex")) for t in outs)
        rg = floating and any(grad.get(a, False) for a in deps)
        grad[node.name] = rg
        nodes[node.name] = OpNode(
            name=node.name,
            target=str(node.target),
            args=deps,
            outputs=outs,
            module=_module_path(node),
            source=_source(node),
            requires_grad=rg,
            is_view=_is_view(node.target),
        )
    inputs = [n for n in user_inputs if n in input_meta]
    g = TrainingGraph(
        nodes=nodes,
        params=params,
        inputs=inputs,
        layers=[],
        batch_size=batch_size,
        loss_node=loss_node,
        model_name=model_name,
        input_meta=input_meta,
        gm=ep,
    )
    return group_layers(g)
