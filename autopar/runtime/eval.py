"""Forward-only evaluation of a compiled program: the model's full output for one global batch on every rank.

Each rank runs the forward actions of its training action list (`RankProgram.eval_actions`) through the
training executor (`Program._run`), under `torch.no_grad`, so nothing is saved for backward. The last stage runs
its `eval_gm` (codegen/split.py), which returns the values the model hands to the loss instead of the
loss. Tensor-parallel stages return full (un-sharded) tensors. The last stage's first rank of each
pipeline then broadcasts its share, and every rank concatenates the shares in batch order.

This runs the captured forward, i.e. training-mode semantics (dropout, batch statistics) as captured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..errors import PlanError
from .devices import comm_device
from .dist import broadcast
from .elastic import naming_lost_ranks

if TYPE_CHECKING:
    from .program import Program


def eval_step(prog: Program, inputs: tuple) -> Any:
    """The model output for the global batch `inputs` (a tensor, or a tuple when the loss reads several
    model outputs), equal on every rank. Collective: every rank must call it."""
    if not prog._has_target or not _has_model_output(prog):
        raise PlanError("eval_step needs the model output, but this model computes its own loss "
                        "(loss_fn=None); compile with loss_fn=(output, target) -> loss to evaluate it.")
    first = next((x for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0), None)
    if first is None or first.shape[0] != prog.layout.global_batch:
        got = None if first is None else first.shape[0]
        raise PlanError(f"eval_step takes one global batch of {prog.layout.global_batch} samples (the "
                        f"compiled batch size), got {got}.")
    with naming_lost_ranks(prog.rank, f"eval after step {prog.step_count}"), torch.no_grad():
        local = None
        if prog.position is not None:
            prog.zero.prepare(whole=True)
            local = _forward(prog, inputs)
            prog.zero.release()
        pipes = sorted(prog.layout.pipelines, key=lambda p: (p.batch_offset, p.seq_part[0]))
        sources = [p.stages[-1].ranks[0] for p in pipes]
        mine = local if prog.rank in sources else None
        out = concat_from(mine, sources, prog.world_size, prog.timeout_s, prog.device, prog.comm.world)
        if any(p.seq_part[1] > 1 for p in pipes):
            out = [_join_tokens(t, pipes, int(inputs[0].shape[1])) for t in out]
    return out[0] if len(out) == 1 else tuple(out)


def _join_tokens(t: torch.Tensor, pipes: list, seq: int) -> torch.Tensor:
    """The whole batch's output from the concatenated parts of every pipeline (in `pipes` order): a
    context-parallel group's parts each hold their rank's tokens on dimension 1, put back in sequence order."""
    from .context_parallel import ContextParallel

    parts, at = [], 0
    for p in pipes:
        if p.seq_part[0] == 0:
            parts.append([])
        parts[-1].append(t[at:at + p.batch_size])
        at += p.batch_size
    joined = []
    for group in parts:
        if len(group) == 1:
            joined.append(group[0])
            continue
        whole = group[0].new_empty((group[0].shape[0], seq, *group[0].shape[2:]))
        for piece, pos in zip(group, ContextParallel.parts(seq, len(group)), strict=True):
            whole[:, pos.to(whole.device)] = piece
        joined.append(whole)
    return torch.cat(joined)


def _has_model_output(prog: Program) -> bool:
    from ..codegen.split import model_outputs

    return bool(model_outputs(prog.graph.gm))


def _forward(prog: Program, inputs: tuple) -> list[torch.Tensor] | None:
    """This rank's forward-only actions (`RankProgram.eval_actions`) run by the training executor; the last
    stage's outputs concatenated over micro-batches."""
    inputs, _ = prog.to_rank_device(inputs, None)
    per_mb = prog._run(prog.lowered.eval_actions, inputs, None, train=False)
    if not per_mb:
        return None
    for t in per_mb[0]:
        if t.dim() == 0:
            raise PlanError("eval_step concatenates the model output along the batch dimension, but the "
                            "model returns a 0-d tensor to its loss.")
    return [torch.cat([mb[k] for mb in per_mb]) for k in range(len(per_mb[0]))]


def concat_from(local: list[torch.Tensor] | None, sources: list[int], world_size: int,
                timeout_s: float, device: torch.device | None = None, comm: torch.device | None = None
                ) -> list[torch.Tensor]:
    """Every rank gets, per tensor index, the concatenation (dim 0) of `local` of each source rank in order.
    `local` is None on ranks that are not sources. Collective over the world; received parts land on
    `device` (the rank's; None: its GPU under NCCL, else the CPU), travelling on `comm` (the world's comm
    device, devices.CommDevices; None: `device`)."""
    if world_size == 1:
        assert local is not None
        return local
    meta = None if local is None else [(tuple(t.shape), t.dtype) for t in local]
    metas: list[Any] = [None] * world_size
    dist.all_gather_object(metas, meta)
    device = device or comm_device()
    parts: list[list[torch.Tensor]] = []
    for src in sources:
        mine = dist.get_rank() == src
        got = []
        for k, (shape, dtype) in enumerate(metas[src]):
            t = local[k].contiguous() if mine else torch.empty(shape, dtype=dtype, device=device)
            broadcast(t, src, f"eval output broadcast from rank {src}", timeout_s, comm)
            got.append(t)
        parts.append(got)
    return [torch.cat([p[k] for p in parts]) for k in range(len(parts[0]))]
