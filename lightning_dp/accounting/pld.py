"""PLD accountant for histories of subsampled-Gaussian events, backed by Google's ``dp-accounting``.

The privacy-loss-distribution accountant (``dp_accounting.pld.PLDAccountant``, pessimistic
discretisation) gives an upper bound on ε that is tighter than RDP and close to PRV. It is optional:
``dp-accounting`` is imported only when a PLD ε is computed, and a ledger with ``accountant="pld"``
checks at construction that it is installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

from .events import PrivacyEvent
from .prv import PRVNumericalError, closed_form_epsilon, prv_segments, valid_epsilon
from .rdp import check_delta

__all__ = ["PLDNumericalError", "pld_epsilon", "require_dp_accounting"]

#: Width of the privacy-loss grid (dp-accounting's default); ε is accurate to about this much.
VALUE_DISCRETIZATION_INTERVAL = 1e-4

_MISSING = (
    "accountant='pld' needs Google's dp-accounting package, which is not installed; "
    "run `pip install dp-accounting` (or `pip install lightning-dp[pld]`), or use accountant='prv' or 'rdp'"
)


class PLDNumericalError(PRVNumericalError):
    """The PLD computation failed (a subclass of PRVNumericalError, so callers treat both alike)."""


def require_dp_accounting() -> None:
    """Raise ImportError naming ``pip install dp-accounting`` when the package is missing (no import)."""
    if importlib.util.find_spec("dp_accounting") is None:
        raise ImportError(_MISSING)


def pld_epsilon(
    history: Iterable[tuple[PrivacyEvent, int]],
    delta: float,
    *,
    value_discretization_interval: float = VALUE_DISCRETIZATION_INTERVAL,
) -> float:
    """Upper bound on ε at ``delta`` for a history of ``(event, count)`` of (subsampled) Gaussians.

    Equal (σ, q) runs are merged (composition is commutative). Returns 0 for an empty history and
    ``inf`` if any event has σ = 0; raises :class:`PLDNumericalError` instead of a NaN or negative ε.
    """
    delta = check_delta(delta)
    segments = prv_segments(history, accountant="pld")
    closed = closed_form_epsilon(segments, delta)
    if closed is not None:
        return closed
    require_dp_accounting()
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    accountant = pld_privacy_accountant.PLDAccountant(
        value_discretization_interval=value_discretization_interval
    )
    try:
        for sigma, q, count in segments:
            gaussian = dp_accounting.GaussianDpEvent(sigma)
            event = gaussian if q == 1.0 else dp_accounting.PoissonSampledDpEvent(q, gaussian)
            accountant.compose(event, count)
        eps = float(accountant.get_epsilon(delta))
    except (ValueError, ArithmeticError, MemoryError) as exc:
        raise PLDNumericalError(
            f"PLD accounting failed for segments {segments} at delta={delta}: {exc}; "
            "use accountant='rdp' for this history"
        ) from exc
    return valid_epsilon(eps, segments, delta, PLDNumericalError, "PLD")
