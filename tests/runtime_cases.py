"""Shared by the multi-process runtime tests: build a case, train it in parallel or as a reference."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from autopar import models
from autopar.cluster import Cluster
from autopar.ir.graph import TrainingGraph
from autopar.ir.lowered import Layout
from autopar.ir.plan import Pipeline, Plan, Stage, Strategy, plan_from_strategy
from autopar.lowering import layout_of
from autopar.passes.capture import Captures, capture
from autopar.runtime.program import Program

STEPS = 3
LR = 1e-3
RTOL, ATOL = 1e-4, 1e-5  # fp32: parallel training matches one process to reduction-order noise


def assert_matches_reference(losses: list[float], params: dict, ref_losses: list[float], ref_params: dict,
                             who: str) -> None:
    """Every step's loss and every final parameter (or state entry) equal the single-process run's."""
    assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL), f"{who} losses"
    assert params.keys() == ref_params.keys()
    for k, v in ref_params.items():
        torch.testing.assert_close(params[k], v, rtol=RTOL, atol=ATOL, msg=f"{who} param {k}")


def build(name: str, **kwargs: Any) -> models.ModelCase:
    return models.CASES[name](seed=0, **kwargs)


@functools.cache
def captured_case(make: Callable[..., models.ModelCase], *args: Any, **kwargs: Any
                  ) -> tuple[models.ModelCase, TrainingGraph]:
    """The case `make(*args, **kwargs)` builds and its capture, made once per test process and arguments: the
    planning tests price one case on many clusters, and each cost model, estimate or plan annotates its own copy
    of the graph (`captured=`)."""
    case = make(*args, **kwargs)
    return case, capture(case.model, case.example_inputs, case.loss_fn, case.example_target, sources=False)


def optimizer(params: list) -> torch.optim.Optimizer:
    # eps=1e-6 rather than 1e-8: Adam's normalized update turns fp32 reduction-order noise in entries
    # whose gradient is ~0 into lr-sized differences; a larger eps keeps the comparison about the math.
    return torch.optim.AdamW(params, lr=LR, eps=1e-6)


def reference(name: str, kwargs: dict, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training of the original model: per-step losses and final parameters."""
    return models.train_reference(build(name, **kwargs), optimizer, steps)


def conditioning(name: str, kwargs: dict, micro: tuple[int, ...] = (1, 4), steps: int = STEPS) -> float:
    """How far fp32 noise alone moves the case's trained state, in units of the comparison's tolerance: the
    largest, over parameters and over single-process fp32 runs that accumulate the batch in `micro` equal
    micro-batches, of |fp32 - fp64| / (ATOL + RTOL |fp64|). A case near 1 cannot tell a parallel program's
    bug from the reduction order (Adam turns rounding in near-zero gradients into lr-sized steps, and some
    models amplify those); parallel comparisons want it well below 1."""

    def train(dtype: torch.dtype, k: int) -> dict[str, torch.Tensor]:
        case = build(name, **kwargs)
        case.model.to(dtype)
        inputs = [x.to(dtype) if x.is_floating_point() else x for x in case.example_inputs]
        target = case.example_target
        opt = optimizer(list(case.model.parameters()))
        n = inputs[0].shape[0] // k
        for _ in range(steps):
            for i in range(k):
                part = slice(i * n, (i + 1) * n)
                (models.loss_of(case, *(x[part] for x in inputs), target=target[part]) / k).backward()
            opt.step()
            opt.zero_grad()
        return {key: v.detach().double() for key, v in case.model.state_dict().items()}

    exact = train(torch.float64, 1)
    runs = [train(torch.float32, k) for k in micro]  # once per k (not once per parameter)
    return max(((run[key] - v).abs() / (ATOL + RTOL * v.abs())).max().item()
               for run in runs for key, v in exact.items())


def plan_for(graph: Any, world: int, spec: dict) -> Plan:
    """The Plan a test spec describes, as `autopar.plan` would write it (no predictions): Megatron rank order
    from `plan_from_strategy` (dp, tp, cp, cp_attention, pp, layer_split, batch_split, zero, recompute, chunks,
    offload,
    compress; "m": micro-batches per replica, at most its share, sizes as even as possible), or explicit
    replicas (`"pipelines": [{"batch": n, "m": k, "stages": [(blocks, ranks), ...]}]`: the first stage also
    takes the layers before the blocks, the last those after); "ep": expert-parallel degree, "sharding": an
    ILP-style `Stage.sharding` on every stage; "precision": the plan's (default fp32); "cluster": the plan's cluster
(default 1x{world}xcpu). The program then lowers
    it (`autopar.lowering.lower`)."""
    batch = graph.batch_size
    n_layers = len(graph.layers)
    blocks = sum(1 for layer in graph.layers if layer.kind == "block")
    fields = dict(precision=spec.get("precision", "fp32"), optimizer="adamw",
                  cluster=Cluster.load(spec.get("cluster", f"1x{world}xcpu")).to_dict(),
                  model={"num_layers": n_layers})
    if "pipelines" in spec:
        pipes = []
        for p in spec["pipelines"]:
            stages, start = [], 0
            for k, (n_blocks, ranks) in enumerate(p["stages"]):
                end = n_layers if k == len(p["stages"]) - 1 else (1 if k == 0 else start) + n_blocks
                stages.append(Stage([start, end], list(ranks), spec.get("zero", 0), spec.get("recompute", False),
                                    compress=spec.get("compress") if k + 1 < len(p["stages"]) else None))
                start = end
            m = p.get("m", 1)
            pipes.append(Pipeline(p["batch"], -(-p["batch"] // m), m, stages))
        plan = Plan(global_batch=batch, schedule=spec["pipelines"][0].get("schedule", "1f1b"), chunks=1,
                    pipelines=pipes, **fields)
    else:
        schedule = spec.get("schedule", "1f1b")
        strategy = Strategy(dp=spec.get("dp", 1), tp=spec.get("tp", 1), pp=spec.get("pp", 1), schedule=schedule,
                            zero=spec.get("zero", 0), recompute=spec.get("recompute", False),
                            layer_split=spec.get("layer_split"), batch_split=spec.get("batch_split"),
                            chunks=spec.get("chunks") if schedule == "interleaved_1f1b" else None,
                            offload=tuple(spec.get("offload", ())), compress=spec.get("compress"),
                            cp=spec.get("cp", 1), cp_attention=spec.get("cp_attention", "ring"),
                            microbatch_size=1)  # micro-batch counts are set below from "m"
        plan = plan_from_strategy(strategy, world_size=world, global_batch=batch, num_layers=n_layers,
                                  first_block=1, num_blocks=blocks, **fields)
        for p in plan.pipelines:
            p.num_microbatches = min(spec.get("m", 1), p.batch_share)
            p.microbatch_size = -(-p.batch_share // p.num_microbatches)
    if "sharding" in spec:
        for p in plan.pipelines:
            for st in p.stages:
                st.sharding = dict(spec["sharding"])
    if spec.get("ep", 1) > 1:
        plan.experts = {"degree": spec["ep"]}
    return plan


def chain(batch: int, blocks: int) -> Any:
    """The shape `plan_for` reads of a graph, for layout-only tests: a batch and a layer chain of one layer
    before `blocks` repeated blocks and one after."""
    kinds = ["pre"] + ["block"] * blocks + ["post"]
    return SimpleNamespace(batch_size=batch, layers=[SimpleNamespace(kind=k) for k in kinds])


def layout_for(graph: Any, world: int, spec: dict) -> Layout:
    """The rank-level layout the lowering derives from `plan_for`'s plan."""
    return layout_of(plan_for(graph, world, spec), len(graph.layers))


def model_output(case: models.ModelCase, *inputs: Any) -> torch.Tensor:
    """The tensor the case's loss reads from the model output (logits of Hugging Face models)."""
    with torch.no_grad():
        out = case.model(*(inputs or case.example_inputs))
    return out.logits if hasattr(out, "logits") else out


def reference_eval(name: str, kwargs: dict, steps: int = STEPS) -> tuple[torch.Tensor, list[float], torch.Tensor]:
    """Single process: model output before training, per-step losses, model output after `steps` steps."""
    case = build(name, **kwargs)
    before = model_output(case)
    losses, _ = models.train_reference(case, optimizer, steps)
    return before, losses, model_output(case)


# the captures of each (name, kwargs) model this process made, kept for every later case (in this job or a later
# one the pooled process runs) that builds the same model, built alike from the same seed: compile shares them
# between the programs of one model the same way (`Captures`). A capture is a function of the model and the
# batch's shapes, and no case's check measures one (their memory windows open after compile_case)
KEPT_CAPTURES: dict[tuple[str, str], Captures] = {}


def compile_case(name: str, kwargs: dict, spec: dict, rank: int, world: int, program: type = Program,
                 **options: Any) -> tuple[models.ModelCase, Program]:
    """Case `name` built afresh and its Program for `spec` (or another `program` class, with its `options`); the
    model's captures are kept in KEPT_CAPTURES."""
    case = build(name, **kwargs)
    captures = KEPT_CAPTURES.setdefault((name, repr(sorted(kwargs.items()))), Captures())
    # no per-node source lines: a rank's program shows none (a fifth of a small model's capture, 308 captures a run)
    g = captures.capture(case.model, case.example_inputs, case.loss_fn, case.example_target, sources=False)
    prog = program(case.model, plan_for(g, world, spec), case.example_inputs, case.example_target,
                   case.loss_fn, optimizer, rank, world, timeout_s=60, kernels=spec.get("kernels", "auto"), graph=g,
                   captures=captures, **options)
    return case, prog


def run_eval_cases(rank: int, world: int, cases: list[tuple[str, dict, dict]]) -> list[tuple]:
    """Worker body: eval_step output before training, the training losses, eval_step output after."""
    out = []
    for name, kwargs, spec in cases:
        case, prog = compile_case(name, kwargs, spec, rank, world)
        before = prog.eval_step(*case.example_inputs)
        losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(STEPS)]
        out.append((before, losses, prog.eval_step(*case.example_inputs), work_of(prog)))
    return out


def work_of(prog: Program) -> dict:
    """What this rank was given: its batch slice, its layers, and each parameter it holds with its local
    shape (a tensor-parallel shard's is smaller than the full one)."""
    if prog.position is None:
        return {"batch": (0, 0), "layers": [], "params": {}}
    pipe = prog.pipeline
    return {"batch": (pipe.batch_offset, pipe.batch_size),
            "layers": [tuple(pipe.stages[s].layers) for s in prog.position.stages],
            "params": {k: tuple(getattr(v, "_local_tensor", v).shape) for k, v in prog.params.items()}}


def run_cases(rank: int, world: int, cases: list[tuple[str, dict, dict]]) -> list[tuple[list[float], dict, dict]]:
    """Worker body: train every case on this process group; return losses, the full final state and what
    this rank was given (`work_of`)."""
    out = []
    for name, kwargs, spec in cases:
        case, prog = compile_case(name, kwargs, spec, rank, world)
        losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(STEPS)]
        out.append((losses, prog.state_dict()["model"], work_of(prog)))
    return out


def assert_ranks_match_reference(results: list, index: int, name: str, kwargs: dict, who: str = ""
                                 ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Case `index` of `run_cases`' per-rank results: every rank's losses and final state equal the
    single-process run's (returned, for further checks)."""
    ref_losses, ref_params = reference(name, kwargs)
    for rank, per_rank in enumerate(results):
        losses, params, _ = per_rank[index]
        assert_matches_reference(losses, params, ref_losses, ref_params, f"{who}rank {rank}")
    return ref_losses, ref_params


def assert_work_split(works: list[dict], spec: dict, batch: int, full: dict[str, torch.Tensor]) -> None:
    """The ranks' shares follow the strategy: dp replicas take disjoint batch slices that tile the batch,
    pp stages hold different layers (no rank holds every parameter), tp ranks hold shards, not whole matrices."""
    custom = spec.get("pipelines")  # explicit replicas (`plan_for`): each its own stages and tp groups
    if custom:
        dp, pp = len(custom), max(len(p["stages"]) for p in custom)
        tp = max(len(ranks) for p in custom for _, ranks in p["stages"])
    else:
        dp, pp, tp = spec.get("dp", 1), spec.get("pp", 1), spec.get("tp", 1)
    slices = sorted({w["batch"] for w in works})
    assert len(slices) == dp and sum(size for _, size in slices) == batch, slices
    assert [off for off, _ in slices] == [sum(size for _, size in slices[:i]) for i in range(dp)], slices
    layer_sets = {tuple(w["layers"]) for w in works}
    assert len(layer_sets) >= pp if custom else len(layer_sets) == pp, layer_sets
    if pp > 1 and not custom:  # every rank holds a strict part of the parameters the ranks hold together
        union = set().union(*(w["params"] for w in works))
        assert all(set(w["params"]) < union for w in works), "a pipeline rank holds every parameter"
    if tp > 1:
        sharded = [any(shape != tuple(full[k].shape) for k, shape in w["params"].items() if k in full) for w in works]
        assert any(sharded) if custom else all(sharded), "no parameter is sharded on a tensor-parallel rank"


def run_sharding_cases(rank: int, world: int, cases: list[tuple[str, dict, dict]]) -> list[tuple]:
    """Worker body: like `run_cases`, plus this rank's local parameter shapes, the ops that fell back to
    running replicated under tensor parallelism, and how many losses ran vocabulary-parallel."""
    from autopar.runtime import tensor_parallel

    rules = tensor_parallel._VOCAB_PARALLEL
    loss_op = torch.ops.aten.cross_entropy_loss.default
    original = rules[loss_op]
    out = []
    for name, kwargs, spec in cases:
        counted = [0]

        def counting(*a: Any, counted: list = counted) -> Any:
            result = original(*a)
            counted[0] += result is not None
            return result

        rules[loss_op] = counting
        try:
            case, prog = compile_case(name, kwargs, spec, rank, world)
            shapes = {k: tuple(getattr(v, "_local_tensor", v).shape) for k, v in prog.params.items()}
            losses = [prog.step(*case.example_inputs, target=case.example_target) for _ in range(STEPS)]
        finally:
            rules[loss_op] = original
        replicated = sorted(prog.tp.replicated) if prog.tp else []
        out.append((losses, prog.state_dict()["model"], shapes, replicated, counted[0]))
    return out


def train_observing(prog: Program, case: models.ModelCase, run_node: Any) -> list[float]:
    """STEPS steps of `prog`, the first with `run_node` in place of the tensor-parallel interpreter's (to
    record the placements each node runs with); the interpreter is restored whatever happens."""
    from autopar.runtime import tensor_parallel

    original = tensor_parallel._TPInterpreter.run_node
    tensor_parallel._TPInterpreter.run_node = run_node
    try:
        losses = [prog.step(*case.example_inputs, target=case.example_target)]
    finally:
        tensor_parallel._TPInterpreter.run_node = original
    return losses + [prog.step(*case.example_inputs, target=case.example_target) for _ in range(STEPS - 1)]
