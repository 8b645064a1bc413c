"""Checks of the numbers users pass in (time limits, timeouts, counts, sizes, fractions).

Every public entry point runs its numeric arguments through `check_number`, so nonsense (a negative time
limit, a zero device count, a memory reserve of 1) is refused where it enters with one PlanError naming the
argument, the bad value and the valid range, instead of misbehaving somewhere deep inside.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from .errors import PlanError


def describe_range(*, integer: bool = False, low: float | None = None, high: float | None = None,
                   low_open: bool = False, high_open: bool = False) -> str:
    """'an integer >= 1', 'a number > 0', 'a number in [0, 1)', ..."""
    what = "an integer" if integer else "a number"
    if low is not None and high is not None:
        return f"{what} in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{what} {'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{what} {'<' if high_open else '<='} {high:g}"
    return what


def in_range(value: Any, *, integer: bool = False, low: float | None = None, high: float | None = None,
             low_open: bool = False, high_open: bool = False) -> bool:
    """Whether `value` is a number (an integer if `integer`; never a bool or NaN) inside the range."""
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or math.isnan(value):
        return False
    if low is not None and (value <= low if low_open else value < low):
        return False
    return high is None or (value < high if high_open else value <= high)


def check_number(name: str, value: Any, *, integer: bool = False, low: float | None = None,
                 high: float | None = None, low_open: bool = False, high_open: bool = False,
                 optional: bool = False, hint: str = "") -> Any:
    """`value` unchanged when it is in range (or None with `optional`), else PlanError naming `name`, the
    value and the range; `hint` says what the argument means or how to fix it."""
    if optional and value is None:
        return value
    bounds = dict(integer=integer, low=low, high=high, low_open=low_open, high_open=high_open)
    if not in_range(value, **bounds):
        raise PlanError(f"{name} must be {describe_range(**bounds)}{' or None' if optional else ''}, got "
                        f"{value!r}{f' ({hint})' if hint else ''}.")
    return value


def check_memory_reserve(value: Any) -> float:
    return check_number("memory_reserve", value, low=0, high=1, high_open=True,
                        hint="the fraction of each device's memory kept free")


def check_seconds(name: str, value: Any) -> float:
    """A time limit or timeout: seconds, > 0 (float('inf') for none)."""
    return check_number(name, value, low=0, low_open=True, hint="seconds")


__all__ = ["check_memory_reserve", "check_number", "check_seconds", "describe_range", "in_range"]
