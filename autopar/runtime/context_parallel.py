"""Context parallelism at run time: a rank computes its stages on its share of every sequence's tokens.

The lowering gives each cp rank a pipeline of its own (`PipelineLayout.seq_part` = (c, cp)) taking the same
samples as its siblings; this module makes the rank's stage programs work on its tokens:

- the stage programs are captured at the local sequence length (T / cp tokens), after
  `passes/sequence_split.sequence_roles` has checked, against the capture at T, that only scaled-dot-product
  attention and the `arange` numbering the tokens see the whole sequence;
- those aranges become the rank's global token positions (the zigzag share of runtime/ring_attention.py:
  chunks c and 2cp-1-c of 2cp), so position embeddings and rotary angles are those of the tokens it holds;
- each attention runs across the cp group (`ring_attention`, or `ulysses_attention` by all-to-all over heads),
  shard by shard under tensor parallelism (heads are independent);
- the step's inputs and target are cut to the rank's tokens (`tokens`), and the executor weighs the rank's
  loss by its share of the tokens (1 / cp, equal shares), so the summed gradients and the reported loss are
  the single-device ones for a loss that is a mean over tokens (checked on the example batch:
  `sequence_split.loss_is_token_mean`).

Parameters are replicated over the cp group like over data-parallel replicas: the lowering lists cp siblings
among a parameter's holders, so the gradient sync and ZeRO span data- and context-parallel ranks alike.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.distributed.tensor import DTensor, Replicate

from ..errors import PlanError
from ..passes.sequence_split import SequenceRoles
from .ring_attention import ring_attention, ulysses_attention, zigzag_positions
from .tensor_parallel import full_tensor, shard_local_layout


class ContextParallel:
    """One rank's place in a context-parallel group: its token positions and the attention across the group."""

    def __init__(self, seq: int, cp: int, index: int, group: Any, mode: str, device: torch.device) -> None:
        if seq % (2 * cp):
            raise PlanError(f"context parallelism cp={cp} cuts each sequence into 2 * cp = {2 * cp} equal chunks (the "
                            f"causal load balance), but the sequence has {seq} tokens: use a sequence length "
                            f"divisible by {2 * cp} or another cp.")
        self.seq, self.cp, self.index, self.group, self.mode = seq, cp, index, group, mode
        self.positions = zigzag_positions(seq, cp, index).to(device)
        self.seq_local = seq // cp

    @staticmethod
    def parts(seq: int, cp: int) -> list[torch.Tensor]:
        """Every cp rank's token positions, in cp order."""
        return [zigzag_positions(seq, cp, c) for c in range(cp)]

    def tokens(self, x: Any) -> Any:
        """The rank's tokens of a step input or target (dimension 1 of length `seq`); other values as they are."""
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == self.seq:
            return x.index_select(1, self.positions.to(x.device))
        return x

    # ---- what replaces the ops that see the whole sequence ----------------------------------------------
    def _arange(self, start: Any = 0, end: Any = None, step: Any = 1, *, dtype: Any = None, **_: Any) -> torch.Tensor:
        pos = self.positions
        out = pos * step + start if (start, step) != (0, 1) else pos
        return out.to(dtype if dtype is not None else torch.int64)

    def _attention(self, q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                   is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Any:
        if attn_mask is not None or dropout_p:
            raise PlanError("context parallelism runs scaled_dot_product_attention without a mask or dropout only "
                            "(sequence_split refuses the others); this call has one.")
        run = ring_attention if self.mode == "ring" else ulysses_attention
        if not isinstance(q, DTensor):
            return run(q, k, v, group=self.group, causal=is_causal, scale=scale)
        placement = shard_local_layout(q, k, v, None)
        if placement is None or not (isinstance(placement, Replicate) or placement.dim == 1):
            out = run(full_tensor(q), full_tensor(k), full_tensor(v), group=self.group, causal=is_causal, scale=scale)
            return DTensor.from_local(out, q.device_mesh, [Replicate()], run_check=False)
        out = run(q.to_local(), k.to_local(), v.to_local(), group=self.group, causal=is_causal, scale=scale)
        return DTensor.from_local(out, q.device_mesh, [placement], run_check=False)

    def rewrite(self, gm: fx.GraphModule, roles: SequenceRoles) -> fx.GraphModule:
        """`gm` (a stage program captured at `seq_local` tokens) with its token aranges and attentions replaced
        (in place; returned)."""
        changed = False
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if node.name in roles.positions:
                a = list(node.args)
                start, end, step = (0, a[0], 1) if len(a) == 1 else (a[0], a[1], a[2] if len(a) > 2 else 1)
                node.target, node.args = self._arange, (start, end, step)
                node.kwargs = {"dtype": node.kwargs.get("dtype")}
                changed = True
            elif node.name in roles.attentions:
                node.target = self._attention
                if node.name in roles.causal_masks:  # its mask is the causal one, built from positions
                    kwargs = {k: v for k, v in node.kwargs.items() if k in ("scale", "enable_gqa")}
                    node.args, node.kwargs = tuple(node.args[:3]), {**kwargs, "is_causal": True}
                changed = True
        if changed:
            gm.graph.eliminate_dead_code()  # what only built causal masks
            gm.recompile()
        return gm


__all__ = ["ContextParallel"]
