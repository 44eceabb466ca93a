"""Argument checks shared by the ledger, the privacy filter and the events: counts, targets, events,
positive reals and δ, refused with a message that names the argument."""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from .events import PrivacyEvent

__all__ = ["MAX_COUNT", "check_count", "check_event", "check_integer", "check_target"]

#: Upper end of the search in ``affordable_count``; an event that stays under target this many times
#: is treated as affordable "forever".
MAX_COUNT = 2**62


def check_integer(value: Any, minimum: int, message: str) -> int:
    """``value`` as an integer ≥ ``minimum`` (bools rejected); anything else raises ``ValueError(message)``."""
    if isinstance(value, bool):
        raise ValueError(message)
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(message) from None
    if number < minimum:
        raise ValueError(message)
    return number


def check_count(count: Any) -> int:
    """Validate an event count: a non-negative integer (bools rejected)."""
    return check_integer(count, 0, f"count must be a non-negative integer, got {count!r}")


def check_target(target_epsilon: Any) -> float:
    """Validate a target ε for budget checks: a number ≥ 0 (inf allowed, NaN not)."""
    try:
        value = float(target_epsilon)
    except (TypeError, ValueError):
        raise ValueError(f"target_epsilon must be a number >= 0, got {target_epsilon!r}") from None
    if math.isnan(value) or value < 0:
        raise ValueError(f"target_epsilon must be a number >= 0, got {target_epsilon!r}")
    return value


def check_event(event: Any) -> PrivacyEvent:
    """Reject anything that is not a PrivacyEvent (e.g. a bare σ) with a clear message."""
    if not isinstance(event, PrivacyEvent):
        raise ValueError(f"event must be a PrivacyEvent (e.g. PoissonGaussian(σ, q)), got {event!r}")
    return event


def _check_positive(name: str, value: object, allow_zero: bool = False) -> float:
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number, got {value!r}") from None
    if math.isnan(x) or math.isinf(x) or x < 0 or (x == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite number {'>=' if allow_zero else '>'} 0, got {value!r}")
    return x


def _check_delta(delta: object) -> float:
    d = _check_positive("delta", delta)
    if not d < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return d


def _orders(orders: tuple[float, ...]) -> np.ndarray:
    return np.asarray(orders, dtype=np.float64)
