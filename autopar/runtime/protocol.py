"""The one protocol of every program `autopar.compile` returns (`TrainingProgram`), and the delegation the
programs that wrap another one share (`Wrapping`).

Every program, whatever the plan and the training mode (the pipeline `Program`; `AsyncProgram` and
`FlushlessProgram` for delayed updates; `ReplicatedProgram` for a model autopar could not capture;
`GraphProgram` and `TemporalProgram` for graph workloads; `ReroutingProgram` and `AdaptiveProgram`, which wrap
one of these to survive a lost rank or adapt to a straggler) has:

- `plan`: the `Plan` it trains (None only for `ReplicatedProgram`, which trains the model as written);
- `step_count`: the optimizer steps taken (a loaded state's "step" included);
- `step(*inputs, target=None)`: one optimizer step on one global batch; the global mean loss, the same on
  every rank;
- `eval_step(*inputs)`: forward only on one global batch, no gradient and no update: the model's full
  output, the same on every rank;
- `state_dict()` / `load_state_dict(sd)`: the full, unsharded training state ({"model", "optimizer",
  "step"}), the same on every rank / loaded under any plan;
- `save(path)` / `load(path)`: a torch.distributed.checkpoint directory of that state (checkpoint.py's
  layout), loadable under any plan, world size or program kind, and into the plain model
  (`checkpoint.load_into_model`);
- `report()`: every rank's predicted vs measured peak memory and step time (`RunReport`;
  `print(prog.report())`).

All but `plan` and `step_count` are collective: every rank calls them, in the same order. Wrappers forward what
they do not change to the program they hold (`Wrapping`): explicitly, member by member, never through
`__getattr__`.
"""

from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable

from ..ir.plan import Plan
from .plan_check import RunReport


@runtime_checkable
class TrainingProgram(Protocol):
    """What every program `autopar.compile` returns does (the module docstring has the table)."""

    @property
    def plan(self) -> Plan | None: ...

    @property
    def step_count(self) -> int: ...

    def step(self, *inputs: Any, target: Any = None) -> float: ...

    def eval_step(self, *inputs: Any) -> Any: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...

    def save(self, path: str | os.PathLike) -> None: ...

    def load(self, path: str | os.PathLike) -> None: ...

    def report(self) -> RunReport: ...


class Wrapping:
    """The protocol's members a wrapper does not change, forwarded to the program it wraps (`self.program`),
    with that program's rank and world size. A wrapper overrides `step` (and whatever else it changes)."""

    program: Any

    @property
    def plan(self) -> Plan | None:
        return self.program.plan

    @property
    def step_count(self) -> int:
        return self.program.step_count

    @property
    def rank(self) -> int:
        return self.program.rank

    @property
    def world_size(self) -> int:
        return self.program.world_size

    def step(self, *inputs: Any, target: Any = None) -> float:
        return self.program.step(*inputs, target=target)

    def eval_step(self, *inputs: Any) -> Any:
        return self.program.eval_step(*inputs)

    def state_dict(self) -> dict:
        return self.program.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.program.load_state_dict(sd)

    def save(self, path: str | os.PathLike) -> None:
        self.program.save(path)

    def load(self, path: str | os.PathLike) -> None:
        self.program.load(path)

    def report(self) -> RunReport:
        return self.program.report()

    def straggler_report(self, window: int | None = None, threshold: float = 1.5) -> Any:
        return self.program.straggler_report(window, threshold)


__all__ = ["TrainingProgram", "Wrapping"]
