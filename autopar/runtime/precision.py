"""Mixed precision at run time: what a plan's `precision` does on every rank.

| plan | forward compute | parameters, optimizer state, gradients, gradient reduction | backward |
|---|---|---|---|
| fp32 | fp32 (on CUDA: TF32 off for matmuls and cuDNN) | fp32 (the model's dtype) | loss as is |
| tf32 | fp32 storage, TF32 tensor-core matmuls/convolutions on CUDA; on CPU the same as fp32 | fp32 | as is |
| bf16 | `torch.autocast(device_type, torch.bfloat16)` around each stage forward | fp32 | as is |
| fp16 | `torch.autocast(device_type, torch.float16)` | fp32 | loss-scaled |

Autocast runs the ops on its lower-precision list (linear, matmul, convolution, attention) in bf16/fp16 on
low-precision copies of their fp32 inputs and weights, and the ops on its fp32 list (softmax, log-softmax,
cross-entropy, norms on CUDA, ...) in fp32; other ops follow type promotion, so e.g. a residual add of an fp32
stream and a bf16 matmul output stays fp32 and some activations stay fp32. The parameters stay fp32 leaves:
their gradients come back in fp32 through the casts' backward, are reduced in fp32, and the optimizer updates
the fp32 weights, which are therefore the master weights (no second copy). Each micro-batch's forward casts a
weight once (autocast's cache lives for one stage forward) and the matmul keeps that 2-byte copy for its
backward. What the planner prices for this is `cost_models/memory.py`'s docstring.

Stage transfers: in bf16/fp16 plans the floating values a stage sends (activations forward, their gradients
back) travel in the plan's dtype unless the stage's `compress` names another (the planner prices 2-byte
activation elements), and are cast back on arrival to the dtype the captured graph has there (fp32).

fp16 loss scaling follows torch.amp.GradScaler (same defaults): the loss is multiplied by `scale` before
backward, so every gradient (those sent between stages too) carries it; before the optimizer step each rank
unscales its parameter gradients once with `torch._amp_foreach_non_finite_check_and_unscale_` (GradScaler's
kernel), and the found-inf flags are max-reduced over all ranks in one all-reduce, so every rank skips the
same steps: a skipped step drops the gradients and multiplies the scale by 0.5; 2000 good steps in a row
multiply it by 2. (GradScaler itself cannot be used as is: its flags are per optimizer and device, and ranks
that update nothing or hold gradients on other devices would issue different collectives.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PlanError
from ..ir.lowered import COMPRESS_DTYPES
from ..ir.precision import check_name, compute_description
from .dist import DEFAULT_TIMEOUT_S, on_comm_device, wait

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaler:
    """Dynamic loss scale (torch.amp.GradScaler's defaults and update rule)."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        self.scale = init_scale
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0


class PrecisionPolicy:
    """A rank's precision policy for one plan precision (module docstring)."""

    def __init__(self, precision: str = "fp32", device: torch.device | str = "cpu",
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        check_name(precision)
        self.precision = precision
        self.device = torch.device(device)
        self.dtype = AUTOCAST_DTYPES.get(precision)  # the autocast dtype; None: fp32 math
        self.scaler = LossScaler() if precision == "fp16" else None
        self.timeout_s = timeout_s
        self.skipped_steps = 0
        if self.device.type == "cuda":
            if precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
                raise PlanError(f"the plan computes in bf16 but {torch.cuda.get_device_name(self.device)} has no "
                                f"bf16 tensor cores; plan with precision='fp16' (or 'fp32') for this device.")
            if precision in ("fp32", "tf32"):
                torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
                torch.backends.cudnn.allow_tf32 = precision == "tf32"

    @staticmethod
    def of_plan(plan: Any, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> PrecisionPolicy:
        """The policy of `plan.precision`."""
        return PrecisionPolicy(getattr(plan, "precision", None) or "fp32", device, timeout_s)

    def describe(self) -> str:
        return compute_description(self.precision, self.device.type)

    # ---- the hooks Program calls -------------------------------------------------------------------------
    def prepare(self, st: Any) -> Any:
        """A stage program to run under autocast: without torch.export's dtype assertions
        (`aten._assert_tensor_metadata`, recorded in the fp32 capture, e.g. before a `.float()`), which fail
        on the lower-precision values autocast produces. The casts themselves stay."""
        if self.dtype is None:
            return st
        asserts = [n for n in st.gm.graph.nodes
                   if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default]
        for n in asserts:
            st.gm.graph.erase_node(n)
        if asserts:
            st.gm.recompile()
        return st

    def forward(self) -> AbstractContextManager:
        """Around a stage's forward: autocast to the plan's dtype (nothing for fp32/tf32)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on (scaled under fp16)."""
        return loss * self.scaler.scale if self.scaler is not None else loss

    def wire(self, compress: str | None) -> torch.dtype | None:
        """Dtype floating stage transfers travel in: the stage's `compress`, else the autocast dtype."""
        return COMPRESS_DTYPES[compress] or self.dtype

    def unscale(self, params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None,
                world_size: int, comm: torch.device | None = None) -> bool:
        """Before the optimizer step, on every rank (collective under fp16): unscale the gradients of `params`
        and agree with every rank whether any is inf/nan. Returns whether to step; when not, the gradients are
        dropped and the scale lowered. `comm`: the world group's comm device (devices.CommDevices; None:
        this rank's)."""
        if self.scaler is None:
            return True
        params = list(params)
        grads: dict[torch.device, list[torch.Tensor]] = {}
        for p in params:
            g = p.grad
            if g is not None:
                g = g._local_tensor if hasattr(g, "_local_tensor") else g  # DTensor: unscale the local shard
                grads.setdefault(g.device, []).append(g)
        found = torch.zeros(1, device=self.device)
        for dev, gs in grads.items():
            flag = torch.zeros(1, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(gs, flag, torch.full((1,), 1.0 / self.scaler.scale,
                                                                               device=dev))
            found += flag.to(self.device)
        if world_size > 1:
            work = on_comm_device(dist.all_reduce, comm or found.device, found, op=dist.ReduceOp.MAX, async_op=True)
            wait(work, "loss-scaling inf/nan check (all-reduce)", "in its group", self.timeout_s, device=found.device)
        found_inf = bool(found.item() > 0)
        self.scaler.update(found_inf)
        if found_inf:
            self.skipped_steps += 1
            for p in params:
                p.grad = None
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
        return not found_inf


__all__ = ["AUTOCAST_DTYPES", "LossScaler", "PrecisionPolicy"]
