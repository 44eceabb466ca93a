"""Type and range checks for constructor arguments, with messages that name the argument and its owner.

Every numeric argument of the strategies, the slots and the callback goes through :func:`number` (or
:func:`flag` for switches) at construction, so a string such as ``"3"``, a bool, a NaN or an
infinity is refused before anything is priced, instead of failing later with a bare TypeError or
silently training with NaN weights. YAML values reach these constructors already converted by
jsonargparse, so the CLI is unaffected.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from lightning_dp.core.errors import DPConfigurationError


class ArgumentError(DPConfigurationError, ValueError):
    """An argument of the wrong type or out of its range (a DPConfigurationError, and a ValueError)."""


def _range_text(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    """``"> 0"``, ``"≥ 1"``, ``"in (0, 1)"``, ``"in [0, 1)"`` … for the bounds given ("" for none)."""
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '≥'} {low:g}"
    if high is not None:
        return f"{'<' if high_open else '≤'} {high:g}"
    return ""


def _fail(owner: str, message: str) -> ArgumentError:
    return ArgumentError(f"{owner}: {message}" if owner else message)


def number(
    value: Any,
    name: str,
    *,
    owner: str = "",
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
    optional: bool = False,
    allow_inf: bool = False,
    hint: str = "",
) -> Any:
    """Return ``value`` if it is a (finite, unless ``allow_inf``) number within the bounds, else raise.

    ``optional`` lets None through; ``integer`` asks for an int (a float such as 2.5 is refused);
    ``hint`` (a sentence) follows a range failure, e.g. typical values. Bools and strings are refused.
    """
    if value is None and optional:
        return value
    bounds = _range_text(low, high, low_open, high_open)
    wanted = ("an integer" if integer else "a number") + (f" {bounds}" if bounds else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
        got = f"{value!r} ({type(value).__name__})"
        if isinstance(value, str):
            raise _fail(
                owner,
                f"{name} must be {wanted}, got {got}. Pass it as a number ({name}={value}), not a string.",
            )
        raise _fail(
            owner,
            f"{name} must be {wanted}{' or None' if optional else ''}, got {got}. Pass a value of that type.",
        )
    as_float = float(value)
    if math.isnan(as_float) or (math.isinf(as_float) and not allow_inf):
        raise _fail(
            owner,
            f"{name} must be {wanted}, got {value!r}. NaN and infinity are refused: pass a finite value.",
        )
    too_low = low is not None and (as_float <= low if low_open else as_float < low)
    too_high = high is not None and (as_float >= high if high_open else as_float > high)
    if too_low or too_high:
        raise _fail(owner, f"{name} must be {bounds}, got {value!r}. Pass a value in that range.{hint}")
    return value


def flag(value: Any, name: str, *, owner: str = "") -> bool:
    """Return ``value`` if it is a bool, else raise (``"false"`` would otherwise be truthy)."""
    if not isinstance(value, bool):
        raise _fail(
            owner, f"{name} must be True or False, got {value!r} ({type(value).__name__}). Pass a bool."
        )
    return value


def seed(value: Any, *, owner: str = "") -> int | None:
    """A seed: None (streams from ``os.urandom``) or an integer."""
    result: int | None = number(value, "seed", owner=owner, integer=True, optional=True)
    return result
