"""Pricing and choosing context parallelism (cp) for the planner.

A stage at cp > 1 runs on cp tensor-parallel groups of t devices (`Stage.devices`, tp fastest): cp rank c computes
the stage on its zigzag share of every sequence (T / cp tokens of each of the micro-batch's n samples, the same
samples as its siblings), its attentions exchanging keys and values around the group (cost_models/context.py has
the bytes). A cost model at degree cp (`CostModel.with_context`) prices groups the same way everywhere: a stage's
`tp_group` argument is its whole device list, cp tensor-parallel groups, and `CostModel.tp_part` the first of
them (t = len(group) / cp). What changes against cp = 1 (pricing.py's docstring, "Context parallelism"):

compute      every layer at n / cp samples' worth of tokens (`closed_form`: kernels re-priced at n / (B t cp) of
             the captured batch; token-local ops do 1/cp of the work, and the load-balanced causal attention 1/cp
             of the attention's). With t > 1 tensor parallelism is Megatron's closed form (its all-reduces move
             T / cp tokens), not the intra-op ILP, so the runtime runs Megatron's placements (`Stage.sharding`
             None). Measured blocks (`plan(..., profile=)`) were measured on whole sequences: not used at cp > 1.
ring         per attention call the rank computes cp blocks of 1/cp of its attention each (the call's kernels at
             1/cp of its FLOPs and all of its bytes: each block reads the local queries and one K/V block of the
             same size), and the cp - 1 forward ring steps (2 blk each) and cp - 1 backward ones (4 blk) overlap
             the block computations: each costs max(block, transfer), the transfer over the slowest link between
             cp neighbours at one tensor-parallel index (`p2p_time`, the t indices sending at once), plus the final
             dK/dV send home (2 blk), exposed. The exposed excess is the stage's communication
             (`StageBase.fwd_comm`, `bwd_comm`); recomputed blocks run their forward exchange again.
ulysses      the attention runs on all T tokens and 1/cp of the local heads (compute as above), plus 2 all-to-alls
             in forward and 2 in backward over the cp ranks at one tensor-parallel index (`collective_time`).
memory       saved activations at T / cp tokens; ring attention keeps its output and an fp32 log-sum-exp per call,
             of which what the captured attention already saves is not counted again; the K/V blocks in flight
             (and the dK/dV accumulators in backward), or Ulysses' all-to-all buffers, are a transient of the
             stage (`StageBase.cp_work`, beside the other ops' backward transients: one op at a time).
sends        a stage boundary carries T / cp tokens (`StageBase.out_bytes`), each cp rank to its own peer.
sync         cp siblings hold the same parameters (per tensor-parallel shard), so a parameter's replicas are its
             dp x cp holders: the data-parallel group of a stage is the first device of every tensor-parallel
             group of the stage in every pipeline, and ZeRO partitions over it (`price`, `search`).

Which models (`ContextParallel.blocker`): every attention is torch's scaled_dot_product_attention, self-attention
(queries and keys of one length T) that is causal or unmasked, or whose mask is the causal one built from the
token positions alone (what Hugging Face models pass; passes/sequence_split.py `causal_mask_problem`); T divisible
by 2 cp; the first input (batch, T, ...); no random op in training (dropout > 0, bernoulli, rand...: the runtime's
keyed masks would not be the one-device program's); no expert parallelism. Ulysses also needs the local query heads
divisible by cp (k and v are repeated to lcm(Hkv, cp) heads where cp does not divide Hkv). One cp and one mode per
plan. What the runtime checks beyond these when it captures the stages at T / cp tokens (passes/sequence_split.py:
no other op mixes tokens; the loss is a mean over tokens) needs a second capture or the loss function, which the
cost model has not: a model failing them is refused at compile time.

Choice: solver/search/context.py (`choose`, around every search): cp = 1 first, cp > 1 only where one sample is what
limits the plan. `candidates` are the degrees tried.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ...cost_models.comm import p2p_time
from ...cost_models.compute import kernel_flops
from ...cost_models.context import (
    LSE_BYTES,
    MODES,
    RING,
    ULYSSES,
    ExchangeSteps,
    attention_memory,
    exchange_steps,
    ring_call_seconds,
)
from ...errors import PlanError
from ...ir.graph import DTYPE_BYTES, TrainingGraph
from ...ir.precision import ELEMENT_BYTES
from ...passes.sequence_split import causal_mask_problem
from ...passes.tp_patterns import SDPA, attention_cores
from ..intra_op.pricing import LayerCost, closed_form

if TYPE_CHECKING:
    from .model import CostModel

_MASK, _DROPOUT, _CAUSAL = 3, 4, 5  # positions in scaled_dot_product_attention's schema


@dataclass(frozen=True)
class AttentionCall:
    """One scaled_dot_product_attention of the captured graph, at the captured (global) batch."""

    layer: int
    node: str
    batch: int
    heads_q: int
    heads_kv: int
    seq: int  # query length T
    kv_seq: int
    head_dim: int
    dtype: str  # the output's dtype in the graph
    causal: bool | None  # None: the captured program is not at hand to say
    mask: bool
    dropout: float | None
    out_saved: bool  # the captured attention saves its output for the backward
    internal_saved: int  # and these bytes of its own (its log-sum-exp), at the captured batch
    kernels_fwd: tuple[tuple[str, float, float], ...]  # (kind, flops, bytes) as `CostModel.kernels` prices them
    kernels_bwd: tuple[tuple[str, float, float], ...]


def _fx_args(fx: Any) -> list[Any]:
    """An fx call's arguments by schema position (kwargs placed where the schema names them)."""
    names = [a.name for a in fx.target._schema.arguments]
    args = list(fx.args) + [None] * (len(names) - len(fx.args))
    for k, v in fx.kwargs.items():
        if k in names:
            args[names.index(k)] = v
    return args


def _fx_nodes(graph: TrainingGraph) -> dict[str, Any] | None:
    gm = graph.gm
    g = getattr(gm, "graph", None)
    return None if g is None else {n.name: n for n in g.nodes}


def find_attention(graph: TrainingGraph) -> list[AttentionCall]:
    """The graph's scaled_dot_product_attention calls, in node order."""
    fx = _fx_nodes(graph)
    out = []
    for node in graph.nodes.values():
        if node.target != SDPA or len(node.args) < 3 or not node.outputs:
            continue
        q, k = (graph.nodes[a].outputs[0] if a in graph.nodes else graph.input_meta.get(a) for a in node.args[:2])
        o = node.outputs[0]
        if q is None or k is None or len(q.shape) != 4 or len(k.shape) != 4:
            continue
        causal = dropout = None
        mask = len(node.args) > 3
        if fx is not None and node.name in fx:
            args = _fx_args(fx[node.name])
            mask = args[_MASK] is not None
            dropout = float(args[_DROPOUT] or 0.0)
            causal = bool(args[_CAUSAL])
        elif not any("flash" in kern.op for kern in node.kernels_fwd):
            dropout = math.nan  # priced as the keyed math formulation: attention with dropout
        kern = lambda ks: tuple((x.kind, kernel_flops(x), x.nbytes) for x in ks)  # noqa: E731
        out.append(AttentionCall(node.layer, node.name, q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2],
                                 q.shape[3], o.dtype, causal, mask, dropout, node.name in node.saved,
                                 node.saved_internal_bytes, kern(node.kernels_fwd), kern(node.kernels_bwd)))
    return out


def random_ops(graph: TrainingGraph) -> list[str] | None:
    """Names of the graph's ops that draw random numbers in training (dropout with p > 0, bernoulli, rand...);
    None when the captured program is not at hand to say."""
    fx = _fx_nodes(graph)
    if fx is None:
        return None
    out = []
    for n in fx.values():
        t = n.target
        if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload) \
                or torch.Tag.nondeterministic_seeded not in t.tags:
            continue
        args = dict(zip([a.name for a in t._schema.arguments], _fx_args(n), strict=True))
        p = args.get("p", args.get("dropout_p"))
        if ("p" in args or "dropout_p" in args) and not p:
            continue  # dropout with p = 0 draws nothing
        if "train" in args and args["train"] is False:
            continue
        out.append(n.name)
    return out


@dataclass(frozen=True)
class ContextParallel:
    """What a cost model prices of context parallelism (`CostModel.context`): the degree, the attention mode, the
    graph's attention calls by layer, and why the model cannot run cp > 1 ("" when it can)."""

    degree: int
    mode: str
    calls: dict[int, tuple[AttentionCall, ...]]
    blocker: str
    seq: int  # the attentions' sequence length (0 without attention)

    @classmethod
    def of(cls, graph: TrainingGraph) -> ContextParallel:
        calls = find_attention(graph)
        by_layer: dict[int, tuple[AttentionCall, ...]] = {}
        for c in calls:
            by_layer[c.layer] = by_layer.get(c.layer, ()) + (c,)
        return cls(1, RING, by_layer, _blocker(graph, calls), calls[0].seq if calls else 0)

    @property
    def has_attention(self) -> bool:
        return bool(self.calls)


def _blocker(graph: TrainingGraph, calls: list[AttentionCall]) -> str:
    """Why the model cannot be split by context parallelism, or "" (module docstring, "Which models")."""
    written = [c for layer in graph.layers for c in attention_cores(graph, layer.nodes) if len(c.nodes) > 1]
    if written:
        return (f"its attention is written out as matmuls ({written[0].output}); context parallelism splits "
                f"torch's scaled_dot_product_attention only")
    if not calls:
        return "the model has no scaled_dot_product_attention"
    for c in calls:
        if c.causal is None:
            return "the captured program is not at hand to check its attention's masking and randomness"
        if c.dropout:
            return f"its attention {c.node} has dropout in training (the ring would not draw the one-device masks)"
        if c.seq != c.kv_seq:
            return f"its attention {c.node} attends to another sequence (only self-attention splits)"
        problem = causal_mask_problem(graph, c.node, c.seq) if c.mask else None
        if problem:  # (a mask built from the token positions alone that is the causal one runs as is_causal)
            return f"its attention {c.node} has a mask that cp cannot split: {problem}"
    if len({c.seq for c in calls}) > 1:
        return "its attentions run on sequences of different lengths"
    rnd = random_ops(graph)
    if rnd is None:
        return "the captured program is not at hand to check its randomness"
    if rnd:
        return f"it draws random numbers in training ({', '.join(rnd[:3])}): set dropout to 0 for cp"
    first = graph.input_meta.get(graph.inputs[0]) if graph.inputs else None
    if first is None or len(first.shape) < 2 or first.shape[1] != calls[0].seq:
        return (f"its first input is not (batch, {calls[0].seq}, ...): the runtime splits inputs along dimension 1 "
                f"into the attention's tokens")
    return ""


# ---- the cost model at a degree -------------------------------------------------------------------------


def degree(cm: Any) -> int:
    ctx = getattr(cm, "context", None)
    return 1 if ctx is None else ctx.degree


def mode(cm: Any) -> str:
    ctx = getattr(cm, "context", None)
    return RING if ctx is None else ctx.mode


def with_degree(cm: CostModel, cp: int, attention: str = RING) -> CostModel:
    """The cost model pricing cp (and attention mode `attention`): itself where it already does, else
    `CostModel.with_context`'s copy. PlanError when the model cannot run it (`check`)."""
    if cp == degree(cm) and attention == mode(cm):
        return cm
    check(cm, cp, attention)
    return cm.with_context(cp, attention)


def check(cm: CostModel, cp: int, attention: str = RING, tp: int | None = None) -> None:
    """PlanError unless the model can run context-parallel degree cp with `attention` (and tensor-parallel degree
    tp, for Ulysses' heads)."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise PlanError(f"the context-parallel degree must be a positive integer, got {cp!r}.")
    if attention not in MODES:
        raise PlanError(f"cp_attention={attention!r}; choose one of {list(MODES)}.")
    if cp == 1:
        return
    ctx = cm.context
    if ctx.blocker:
        raise PlanError(f"context parallelism (cp={cp}) was asked for, but {ctx.blocker}; use cp=1.")
    if ctx.seq % (2 * cp):
        raise PlanError(f"cp={cp} cuts each sequence into 2 cp = {2 * cp} chunks, which must divide its "
                        f"{ctx.seq} tokens; choose one of {candidates(cm) or 'none (use cp=1)'}.")
    if cm.expert_parallel.degree > 1:
        raise PlanError("context parallelism with expert parallelism is not supported: use cp=1 or ep=1.")
    if attention == ULYSSES and tp is not None:
        for calls in ctx.calls.values():
            for c in calls:
                if c.heads_q % tp or (c.heads_q // tp) % cp:
                    raise PlanError(f"Ulysses attention moves whole heads: cp={cp} must divide the local query heads "
                                    f"of {c.node} ({c.heads_q} over tp={tp}); use cp_attention='ring'.")


def candidates(cm: Any) -> list[int]:
    """The degrees cp > 1 the search tries: powers of two dividing the world size with 2 cp dividing T."""
    ctx = cm.context
    if ctx.blocker or not ctx.seq:
        return []
    world = cm.cluster.world_size
    return [c for c in (1 << k for k in range(1, world.bit_length())) if world % c == 0 and ctx.seq % (2 * c) == 0]


def plan_degree(plan: Any) -> tuple[int, str]:
    """(cp, attention) of a plan: one for all its stages, else PlanError."""
    seen = {(st.cp, st.cp_attention) for p in plan.pipelines for st in p.stages}
    if len(seen) != 1:
        raise PlanError(f"the plan's stages have context-parallel degrees and modes {sorted(seen)}; the planner "
                        f"prices one cp and one cp_attention for a whole plan.")
    cp, attention = seen.pop()
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise PlanError(f"Stage.cp must be an integer >= 1, got {cp!r}.")
    for i, p in enumerate(plan.pipelines):
        for j, st in enumerate(p.stages):
            if len(st.devices) % cp:
                raise PlanError(f"pipeline {i} stage {j}: {len(st.devices)} devices are not cp={cp} tensor-parallel "
                                f"groups of equal size.")
    return cp, attention


def for_plan(cm: CostModel, plan: Any) -> CostModel:
    """The cost model at the plan's cp and attention mode, after checking the model and plan can run them."""
    cp, attention = plan_degree(plan)
    out = with_degree(cm, cp, attention)
    if cp > 1 and attention == ULYSSES:
        for p in plan.pipelines:
            for st in p.stages:
                check(out, cp, attention, st.tp)
    return out


# ---- prices ---------------------------------------------------------------------------------------------------


class CpLayer(NamedTuple):
    """One layer at cp > 1 (`layer_cost`): its LayerCost (act explicit), and per micro-batch and rank the
    exchange's bytes and exposed seconds, forward and backward, its transient bytes and attention calls."""

    cost: LayerCost
    bytes_f: float
    bytes_b: float
    exposed_f: float
    exposed_b: float
    work: float
    calls: int


def itemsize(cm: CostModel, dtype: str) -> int:
    """Bytes of an attention element in the compute dtype (fp32 graphs trained in bf16/fp16: 2)."""
    own = DTYPE_BYTES.get(dtype, 4)
    return min(own, ELEMENT_BYTES[cm.precision]) if dtype == "float32" else own


def ring_link_seconds(cm: CostModel, group: tuple[int, ...], nbytes: int) -> float:
    """Seconds of one ring step sending `nbytes` per rank: the slowest link between cp neighbours (cp rank c's
    device at tensor-parallel index k to rank c+1's), the t indices sending at once (`p2p_time`)."""
    cp = degree(cm)
    t = len(group) // cp

    def compute() -> float:
        return max(float(p2p_time(nbytes, group[c * t + k], group[(c + 1) % cp * t + k], cm.cluster, concurrent=t))
                   for c in range(cp) for k in range(t))

    return cm.memoised(("cp-link", nbytes, group), compute)


def _local(heads: int, t: int) -> int:
    """Heads a tensor-parallel rank of t holds (Megatron splits them; at least one)."""
    return max(1, -(-heads // t))


def call_steps(cm: CostModel, call: AttentionCall, n: int, t: int) -> ExchangeSteps:
    """The exchange steps of one attention call for a micro-batch of n samples on one cp rank of t devices."""
    cp = degree(cm)
    return exchange_steps(n, _local(call.heads_kv, t), call.seq // cp, call.head_dim, cp,
                          itemsize(cm, call.dtype), mode(cm), heads_q=_local(call.heads_q, t))


def block_seconds(cm: CostModel, call: AttentionCall, dtype: str, n: int, t: int) -> tuple[float, float, float, float]:
    """(forward, backward) seconds of the whole call on one rank as one kernel, then of one ring block (1/cp of its
    FLOPs, all of its bytes: the local queries against one K/V block of the same size): (one_f, one_b, block_f,
    block_b), for a micro-batch of n samples on t devices."""
    cp, op_time = degree(cm), cm.models[dtype].op_time
    s = n / (cm.B * t * cp)  # the rank's share of the captured call
    one = [sum(op_time(k, f * s, b * s) for k, f, b in ks) for ks in (call.kernels_fwd, call.kernels_bwd)]
    block = [sum(op_time(k, f * s / cp, b * s) for k, f, b in ks) for ks in (call.kernels_fwd, call.kernels_bwd)]
    return one[0], one[1], block[0], block[1]


def layer_cost(cm: CostModel, layer: int, dtype: str, n: int, group: tuple[int, ...]) -> CpLayer:
    """Layer `layer` for a micro-batch of n samples on one cp rank of `group` (module docstring)."""
    return cm.memoised(("cp-layer", cm.cls[layer], dtype, n, group), lambda: _layer_cost(cm, layer, dtype, n, group))


def _layer_cost(cm: CostModel, layer: int, dtype: str, n: int, group: tuple[int, ...]) -> CpLayer:
    cp, attention = degree(cm), mode(cm)
    tp_group = cm.tp_part(group)
    t = len(tp_group)
    frac = n / (cm.B * cp)
    c = closed_form(cm, layer, dtype, n / cp, tp_group)
    fwd, bwd, fc, bc = c.fwd, c.bwd, c.fwd_comm, c.bwd_comm
    act = cm.saved[layer] * frac / t
    bytes_f = bytes_b = exp_f = exp_b = work = 0.0
    calls = cm.context.calls.get(layer, ())
    ring0 = tuple(group[k * t] for k in range(cp))  # the cp ranks at tensor-parallel index 0
    for call in calls:
        internal = call.internal_saved
        if call.mask:  # run is_causal without its mask (sequence_split): the fused kernel's fp32 log-sum-exp is
            # what it saves of its own, not the captured masked form's
            fused = call.batch * call.heads_q * call.seq * LSE_BYTES
            act += (fused - internal) * frac / t
            internal = fused
        steps = call_steps(cm, call, n, t)
        handed = steps.totals()
        bytes_f, bytes_b = bytes_f + handed["forward"], bytes_b + handed["backward"]
        size = itemsize(cm, call.dtype)
        hq, hkv = _local(call.heads_q, t), _local(call.heads_kv, t)
        mem = attention_memory(n, hkv, call.seq // cp, call.head_dim, cp, size, attention, heads_q=hq,
                               fused=cm.cluster.devices[group[0]].spec.kind == "cpu")  # ring_attention._fused
        work = max(work, mem["forward"], mem["backward"])
        if attention == RING:
            one_f, one_b, step_f, step_b = block_seconds(cm, call, dtype, n, t)
            secs = {x: ring_link_seconds(cm, group, x) for x in set(steps.forward) | set(steps.backward)}
            cf, xf, cb, xb = ring_call_seconds(step_f, step_b, steps, secs)
            fwd, bwd = fwd + cf - one_f, bwd + cb - one_b
            exp_f, exp_b = exp_f + xf, exp_b + xb
            # what ring attention keeps beyond what the captured attention saves (its output, its log-sum-exp)
            out = call.batch * call.heads_q * call.seq * call.head_dim
            keeps = out * size + out // call.head_dim * 4
            already = (out * size if call.out_saved else 0) + internal
            act += max(0.0, keeps - already) * frac / t
        else:
            a2a = lambda sizes: sum(cm.collective("all_to_all", float(x), ring0, t) for x in sizes)  # noqa: E731
            exp_f, exp_b = exp_f + a2a(steps.buffers_forward), exp_b + a2a(steps.buffers_backward)
    cost = LayerCost(fwd, bwd, fc + exp_f, bc + exp_b, c.param_frac, act)
    return CpLayer(cost, bytes_f, bytes_b, exp_f, exp_b, work, len(calls))


# ---- what a plan says ------------------------------------------------------------------------------------------


def stage_predictions(cm: CostModel, base: Any) -> dict[str, Any]:
    """A cp > 1 stage's predictions: its exchange per full micro-batch and rank (bytes and exposed seconds)."""
    if degree(cm) == 1:
        return {}
    return {"cp_calls": base.cp_calls, "cp_exchange_bytes": {"forward": base.cp_bytes[0], "backward": base.cp_bytes[1]},
            "cp_exchange_s": base.cp_exposed[0] + base.cp_exposed[1]}


def plan_prediction(cm: CostModel, plan: Any) -> dict[str, Any] | None:
    """`predicted["cp"]` of a priced plan at cp > 1: the degree and mode, and its exchange (per attention call: the
    bytes each rank sends and the ring step's transfer against its block computation; per training step: the bytes
    each rank of the busiest stage sends and the exposed seconds)."""
    cp = degree(cm)
    if cp == 1:
        return None
    attention = mode(cm)
    pipe = max(plan.pipelines, key=lambda p: sum(st.predicted.get("cp_exchange_s", 0.0) for st in p.stages))
    st = max(pipe.stages, key=lambda s: s.predicted.get("cp_calls", 0))
    out: dict[str, Any] = {"chosen": cp, "attention": attention}
    calls = [c for i in range(*st.layers) for c in cm.context.calls.get(i, ())]
    if not calls:
        return out
    call, n, t = calls[0], pipe.microbatch_size, st.tp
    steps = call_steps(cm, call, n, t)
    per_call = steps.totals()
    # per step, on the busiest device group: the bytes scale with the samples (share / full micro-batch), the
    # exposed seconds are taken at the full size for every micro-batch (an upper figure for a smaller last one)
    ranks = len(pipe.stages) // plan.chunks
    m = pipe.num_microbatches
    per_rank = [pipe.stages[r::ranks] for r in range(ranks)]
    step_bytes = max(sum(s.predicted["cp_exchange_bytes"]["forward"] + s.predicted["cp_exchange_bytes"]["backward"]
                         for s in held) for held in per_rank) * pipe.batch_share / n
    exposed = max(sum(s.predicted.get("cp_exchange_s", 0.0) for s in held) for held in per_rank) * m
    ex: dict[str, Any] = {"calls_per_microbatch": sum(len(v) for v in cm.context.calls.values()),
                          "bytes_per_call": per_call, "microbatch_size": n, "tokens_per_rank": call.seq // cp,
                          "bytes_per_step": step_bytes, "exposed_s_per_step": exposed}
    group = tuple(st.devices)
    if attention == RING and steps.forward:
        blocks = block_seconds(cm, call, cm.cluster.devices[group[0]].spec.name, n, t)[2:]
        ex["ring_step"] = {"steps": len(steps.forward), **{
            way: {"bytes": x, "transfer_s": ring_link_seconds(cm, group, x), "block_compute_s": block}
            for way, x, block in (("forward", steps.forward[0], blocks[0]),
                                  ("backward", steps.backward[0], blocks[1]))},
            # the dK/dV accumulators' send home after the last backward step, exposed
            "home": {"bytes": steps.backward[-1], "transfer_s": ring_link_seconds(cm, group, steps.backward[-1])}}
    out["exchange"] = ex
    return out


__all__ = ["AttentionCall", "ContextParallel", "CpLayer", "call_steps", "candidates", "check", "degree",
           "find_attention", "for_plan", "itemsize", "layer_cost", "mode", "plan_degree",
           "plan_prediction", "random_ops", "ring_link_seconds", "stage_predictions", "with_degree"]
