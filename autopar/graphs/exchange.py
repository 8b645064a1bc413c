"""The halo exchange of a partitioned graph (halo.py `Partition`): before every message-passing layer a rank
sends the owned rows its peers need and receives its halo rows, one `all_to_all_single`; autograd-aware."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..runtime.dist import all_to_all, release
from .halo import Partition


class _HaloExchange(torch.autograd.Function):
    """Forward: [h; rows received from their owners]. Backward: the halo rows' gradients go back to their
    owners and are added into the rows they were sent from. The send and receive buffers are freed on this
    thread as soon as they are read (`release`), so a rank holds one exchange's buffers at a time, as priced
    (graphs/cost.py `graph_bytes`), on a loaded host too."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, part: Partition, group: object) -> torch.Tensor:
        ctx.part, ctx.group, ctx.rows = part, group, h.shape[0]
        send = h[part.send_index]
        recv = all_to_all(send, part.recv_counts, part.send_counts, group, "halo exchange")
        release(send)
        out = torch.cat([h, recv])
        release(recv)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        part, rows = ctx.part, ctx.rows
        halo = grad[rows:]
        send = halo.contiguous()
        back = all_to_all(send, part.send_counts, part.recv_counts, ctx.group, "halo exchange (backward)")
        if send.untyped_storage().data_ptr() != grad.untyped_storage().data_ptr():
            release(send)
        grad_h = grad[:rows].index_add(0, part.send_index, back)
        release(back)
        return grad_h, None, None


def halo_exchange(h: torch.Tensor, part: Partition, group: object | None = None) -> torch.Tensor:
    """[owned rows; halo rows]: sends the owned rows peers need, receives this rank's halo rows. Autograd-aware:
    the backward sends the halo rows' gradients back to their owners, where they are summed."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return h
    return _HaloExchange.apply(h, part, group or dist.group.WORLD)


__all__ = ["halo_exchange"]
