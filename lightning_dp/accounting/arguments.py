"""Argument checks shared by the ledger and the privacy filter: counts, targets and events, refused with
a message that names the argument."""

from __future__ import annotations

import math
import operator
from typing import Any

from .events import PrivacyEvent

__all__ = ["MAX_COUNT", "check_count", "check_event", "check_target"]

#: Upper end of the search in ``affordable_count``; an event that stays under target this many times
#: is treated as affordable "forever".
MAX_COUNT = 2**62


def check_count(count: Any) -> int:
    """Validate an event count: a non-negative integer (bools rejected)."""
    if isinstance(count, bool):
        raise ValueError(f"count must be a non-negative integer, got {count!r}")
    try:
        value = operator.index(count)
    except TypeError:
        raise ValueError(f"count must be a non-negative integer, got {count!r}") from None
    if value < 0:
        raise ValueError(f"count must be a non-negative integer, got {count!r}")
    return value


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
