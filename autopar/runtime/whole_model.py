"""Programs whose every rank holds the whole model and optimizer (the replicated fallback, the graph programs):
the protocol members they share (protocol.py) on `self.model`, `self.optimizer`, `self.step_count`.

- `state_dict` / `load_state_dict`: the model's and optimizer's own state dicts and the step;
- `save` / `load`: the same torch.distributed.checkpoint layout as `Program.save` (checkpoint.py: ``model.<fqn>``,
  ``optim.state.<fqn>.<key>``, ``step``), written by one training rank alone (rank 0 unless the program says;
  every training rank holds the same values) and read
  by every rank, so a checkpoint moves between these programs, a `Program` and the plain model
  (`checkpoint.load_into_model`);
- `report`: each rank's predicted peak and step time from the plan against its measured step times. Their
  memory is not measured (only `Program`s open `compile(check_plan=)`'s window); the report says so.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import checkpoint
from .plan_check import RankFigures, RunReport, gathered_report, of_rank

NOT_MEASURED = "not measured: only pipeline programs measure their memory (compile(check_plan=))"


class WholeModelState:
    """The protocol's state, checkpoint and report members of a program whose ranks each hold the whole model."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    step_count: int
    rank: int
    world_size: int
    plan: Any

    def state_dict(self) -> dict:
        return {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "optimizer": self.optimizer.state_dict(), "step": self.step_count}

    def load_state_dict(self, sd: dict) -> None:
        self.model.load_state_dict(sd["model"])
        if isinstance(sd.get("optimizer"), dict) and "param_groups" in sd["optimizer"]:
            self.optimizer.load_state_dict(sd["optimizer"])
        self.step_count = int(sd.get("step", self.step_count))

    # ---- checkpoints ------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write the model, optimizer state and step to checkpoint directory `path` (checkpoint.py's layout;
        each rank writes its `checkpoint_entries()`). Collective."""
        entries = self.checkpoint_entries()
        distributed = self.world_size > 1 and dist.is_initialized()
        with checkpoint.quiet_dcp() as dcp:
            dcp.save(entries, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=not distributed)

    def checkpoint_writer(self) -> int:
        """The rank whose model and optimizer state `save` writes (one that trains)."""
        return 0

    def checkpoint_entries(self) -> dict[str, Any]:
        """What this rank writes into a checkpoint: every entry on `checkpoint_writer()`, nothing elsewhere."""
        return self.state_entries(with_step=True) if self.rank == self.checkpoint_writer() else {}

    def state_entries(self, with_step: bool) -> dict[str, Any]:
        """The checkpoint entries of the parameters and buffers this rank holds (a meta tensor is one it does
        not: another rank holds it) and their optimizer state; the step and the plan when `with_step`."""
        entries: dict[str, Any] = {}
        names: dict[int, str] = {}  # a tied weight once, under its first name
        for fqn, t in self.model.state_dict(keep_vars=True).items():
            if id(t) not in names:
                names[id(t)] = fqn
                if not t.is_meta:
                    entries[checkpoint.MODEL + fqn] = t.detach()
        for p, state in self.optimizer.state.items():
            for key, v in state.items():
                if v is not None:
                    entries[f"{checkpoint.OPTIM}{names[id(p)]}.{key}"] = \
                        v.detach() if isinstance(v, torch.Tensor) else v
        if with_step:
            entries[checkpoint.STEP] = torch.tensor(self.step_count, dtype=torch.int64)
            if self.plan is not None:
                entries[checkpoint.PLAN] = self.plan.to_json(indent=None)
        return entries

    def load(self, path: str | os.PathLike) -> None:
        """Load a checkpoint written by any program's `save` (every rank reads the whole model). Collective."""
        self.step_count = checkpoint.load_into_model(self.model, path, self.optimizer)
        if self.world_size > 1 and dist.is_initialized():
            dist.barrier()

    # ---- report -----------------------------------------------------------------------------------------
    @contextmanager
    def timed_step(self) -> Iterator[None]:
        """Around one `step`: its wall seconds, for `report` (the latest 64 kept)."""
        start = time.perf_counter()
        yield
        steps = self.__dict__.setdefault("_step_seconds", [])
        steps.append(time.perf_counter() - start)
        del steps[:-64]

    def report(self) -> RunReport:
        """Every rank's predicted peak and step time against its measured step time (memory not measured).
        Collective: call it on every rank; `print(prog.report())` shows the table."""
        plan = self.plan
        predicted = (plan.predicted or {}) if plan is not None else {}
        device = plan.device_names().get(self.rank, "?") if plan is not None else "?"
        mine = RankFigures(self.rank, device, [self.what_runs()],
                           of_rank(predicted.get("peak_memory_bytes") or {}, self.rank),
                           of_rank(predicted.get("memory_capacity_bytes") or {}, self.rank), None,
                           float(predicted.get("step_time_s") or 0.0),
                           list(self.__dict__.get("_step_seconds", [])), not_measured=NOT_MEASURED)
        return gathered_report(mine, self.world_size if dist.is_initialized() else 1)

    def what_runs(self) -> str:
        """The report's "stages" cell of this rank."""
        return "the whole model"


__all__ = ["NOT_MEASURED", "WholeModelState"]
