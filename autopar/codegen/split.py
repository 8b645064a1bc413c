"""Split a captured training graph into per-stage forward programs along the coarse layer chain.

Stage s runs layers [start, end). Its program takes, in this order, its parameters (by fully qualified
name), the user inputs it reads, and the values it receives from stage s-1; it returns the values that
stage s+1 needs (values that later stages read are relayed through every stage in between), or the loss
on the last stage. Backward is autograd's: the runtime calls backward on the outputs with the gradients
it receives, and sends the gradients of its received inputs back.

For evaluation the last stage also gets `eval_gm`: the same program returning the model's output (the
values the loss reads, found by the `nn_module_stack` of the captured `LossWrapper`: nodes under `model`
read by nodes outside it) instead of the loss, so `Program.eval_step` needs no second capture.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from ..errors import PlanError
from ..ir.graph import TensorMeta, TrainingGraph


@dataclass
class StageProgram:
    index: int
    layers: tuple[int, int]
    gm: fx.GraphModule
    params: list[str]  # canonical parameter names (tied duplicates map to the parameter they share)
    buffers: list[str]
    inputs: list[int]  # indices into the user's (inputs..., target) tuple
    recv: list[str]  # value names received from the previous stage, in placeholder order
    send: list[str]  # value names sent to the next stage, in output order (empty on the last stage)
    value_meta: dict[str, TensorMeta]  # shape/dtype of every received or sent value
    is_last: bool
    eval_gm: fx.GraphModule | None = None  # last stage: the model output instead of the loss
    # buffers that are tensors the forward makes from Python data (export's lifted constants): the program's
    # own, by name, in no weights file and not in the model's state_dict
    constants: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def code(self) -> str:
        return self.gm.code


def _in_model(node: fx.Node) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    return any(v[0] == "model" or v[0].startswith("model.") for v in stack.values())


def model_outputs(ep: torch.export.ExportedProgram) -> list[str]:
    """Names of the values the captured model hands to the loss (in order of first use by the loss).

    Empty when the model computes its own loss (no loss_fn): then there is no separate model output."""
    out: list[str] = []
    for n in ep.graph.nodes:
        if n.op != "call_function" or _in_model(n):
            continue
        for a in n.all_input_nodes:
            if a.op == "call_function" and _in_model(a) and a.name not in out:
                out.append(a.name)
    return out


def split_stages(graph: TrainingGraph, bounds: list[tuple[int, int]]) -> list[StageProgram]:
    """One StageProgram per [start, end) layer range; the ranges must tile the chain in order."""
    n_layers = len(graph.layers)
    if (
        not bounds
        or bounds[0][0] != 0
        or bounds[-1][1] != n_layers
        or any(
            a[1] != b[0] or a[0] >= a[1]
            for a, b in zip(bounds, bounds[1:] + [(n_layers, n_layers + 1)], strict=True)
        )
    ):
        raise PlanError(
            f"stage layer ranges {bounds} must tile the {n_layers} layers [0, {n_layers}) in order."
        )
    ep = graph.gm
    if ep is None:
        raise PlanError(
            "this graph has no captured program (it was loaded from JSON); capture the model again."
        )
    fx_nodes = {n.name: n for n in ep.graph.nodes}
    stage_of = {}
    for s, (a, b) in enumerate(bounds):
        for layer in graph.layers[a:b]:
            for name in layer.nodes:
                stage_of[name] = s
    user_inputs = [n.name for n in ep.graph.nodes if n.op == "placeholder" and n.name not in graph.params]
    # values crossing each boundary: produced at stage <= s (op nodes), read at a stage > s
    crossing: list[list[str]] = [[] for _ in bounds]
    for name in graph.nodes:
        consumers = {stage_of[u.name] for u in fx_nodes[name].users if u.op == "call_function"}
        last_use = max(consumers, default=stage_of[name])
        for s in range(stage_of[name], last_use):
            crossing[s].append(name)
    stages = []
    for s, (a, b) in enumerate(bounds):
        recv = crossing[s - 1] if s > 0 else []
        send = crossing[s] if s < len(bounds) - 1 else []
        stages.append(
            _build_stage(
                graph, ep, s, (a, b), stage_of, user_inputs, recv, send, is_last=s == len(bounds) - 1
            )
        )
    return stages


def _build_stage(
    graph: TrainingGraph,
    ep: torch.export.ExportedProgram,
    s: int,
    layers: tuple[int, int],
    stage_of: dict[str, int],
    user_inputs: list[str],
    recv: list[str],
    send: list[str],
    is_last: bool,
) -> StageProgram:
    mine = [n for n in ep.graph.nodes if n.op == "call_function" and stage_of.get(n.name) == s]
    needed = {a.name for n in mine for a in n.all_input_nodes}
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    params, buffers, inputs = [], [], []
    constants: dict[str, torch.Tensor] = {}
    lifted = ep.graph_signature.inputs_to_lifted_tensor_constants
    for n in ep.graph.nodes:
        if n.op != "placeholder" or n.name not in needed:
            continue
        if n.name in graph.params:
            info = graph.params[n.name]
            (buffers if info.is_buffer else params).append(graph.canonical(n.name))
            if n.name in lifted:
                constants[graph.canonical(n.name)] = ep.constants[lifted[n.name]]
    # placeholders: parameters, buffers, user inputs, received values (deterministic order)
    for name in dict.fromkeys(params + buffers):
        env_key = [p for p, i in graph.params.items() if graph.canonical(p) == name and p in needed]
        ph = g.placeholder(_safe(name))
        for k in env_key:
            env[k] = ph
    for i, name in enumerate(user_inputs):
        if name in needed:
            env[name] = g.placeholder(name)
            inputs.append(i)
    for name in recv:
        env[name] = g.placeholder(f"recv_{name}")
    for n in mine:
        env[n.name] = g.node_copy(n, lambda a: env[a.name])
    eval_gm, eval_outputs = None, None
    if is_last:
        eval_outputs = model_outputs(ep)
        if eval_outputs:
            eval_gm = _with_output(g, [env[name] for name in eval_outputs], f"Stage{s}Eval")
        out_node = next(n for n in ep.graph.nodes if n.op == "output").args[0]
        out_node = out_node[0] if isinstance(out_node, (tuple, list)) else out_node
        g.output(env[out_node.name])
    else:
        g.output(tuple(env[name] for name in send))
    g.lint()
    gm = fx.GraphModule(torch.nn.Module(), g, class_name=f"Stage{s}")
    meta = {}
    for name in recv + send:
        outs = graph.nodes[name].outputs
        meta[name] = outs[0]
    return StageProgram(
        index=s,
        layers=layers,
        gm=gm,
        params=list(dict.fromkeys(params)),
        buffers=list(dict.fromkeys(buffers)),
        inputs=inputs,
        recv=list(recv),
        send=list(send),
        value_meta=meta,
        is_last=is_last,
        eval_gm=eval_gm,
        constants=constants,
    )


def _with_output(g: fx.Graph, outputs: list[fx.Node], class_name: str) -> fx.GraphModule:
    """A copy of `g` (not yet closed by an output) returning `outputs`, unused ops removed."""
    out = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in g.nodes:
        env[n] = out.node_copy(n, lambda a: env[a])
    out.output(tuple(env[n] for n in outputs))
    out.eliminate_dead_code()
    out.lint()
    return fx.GraphModule(torch.nn.Module(), out, class_name=class_name)


def _safe(fqn: str) -> str:
    return "p_" + fqn.replace(".", "_")
