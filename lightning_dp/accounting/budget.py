"""Check-before-spend for one release, shared by every mechanism: price it, record it, or refuse it by name.

Every noisy release of every mechanism (the gradient steps, DPIS's epoch statistics, a line search's
sparse-vector search, DP-AGD's NoisyMin, a recipe's DP-PCA) goes through :func:`charge` *before* the
release is computed, so nothing is released that the budget cannot pay for, and a refusal names the
mechanism that would have overspent.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from .events import PrivacyEvent
from .ledger import BudgetExceededError, PrivacyLedger

__all__ = ["affordable_after", "charge"]


def charge(
    ledger: PrivacyLedger,
    event: PrivacyEvent,
    target_epsilon: float | None,
    *,
    mechanism: str,
    count: int = 1,
) -> float:
    """Record ``count`` × ``event`` if ε stays within ``target_epsilon`` and return ε; else refuse, recording nothing.

    ``target_epsilon=None`` means the run has no budget (σ given, ε only reported): the event is recorded.
    A privacy filter applies its own rule (its target) either way. The refusal is a
    :class:`BudgetExceededError` whose message and ``mechanism`` name the mechanism.
    """
    if target_epsilon is None and not hasattr(ledger, "rdp_budgets"):  # a filter always has a budget
        ledger.record(event, count)
        return ledger.epsilon()
    try:
        if target_epsilon is None:
            return ledger.spend(event, count=count)  # type: ignore[call-arg]
        return ledger.spend(event, target_epsilon, count)
    except BudgetExceededError as err:
        raise BudgetExceededError(
            f"{mechanism} would overspend the privacy budget: {err}",
            spent=err.spent,
            target=err.target,
            would_be=err.would_be,
            event=err.event,
            count=err.count,
            mechanism=mechanism,
        ) from err


def affordable_after(
    ledger: PrivacyLedger, first: Sequence[PrivacyEvent], event: PrivacyEvent, target_epsilon: float
) -> int:
    """How many ``event`` s fit under the target after the releases ``first`` (0 if ``first`` alone does not fit).

    Prices on a copy of the ledger: for a mechanism whose next step is preceded by other releases
    (DPIS's statistics at an epoch start), so a budget stop can come before them, not after.
    """
    if not first:
        return ledger.affordable_count(event, target_epsilon)
    shadow = copy.deepcopy(ledger)
    for release in first:
        if not shadow.can_afford(release, target_epsilon):
            return 0
        shadow.record(release)
    return shadow.affordable_count(event, target_epsilon)
