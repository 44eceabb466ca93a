"""Rényi-DP helpers: the default orders, cached per-event RDP vectors and the RDP → (ε, δ) conversion."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
from opacus.accountants import RDPAccountant

from .events import PrivacyEvent

__all__ = ["DEFAULT_ORDERS", "check_delta", "check_orders", "epsilon_from_rdp", "event_rdp"]

#: Opacus's ``DEFAULT_ALPHAS`` (1.1 … 10.9, 12 … 63) plus larger orders, which the optimum moves to
#: for small targets (ε ≈ 0.1 at δ = 1e-5). 1024 is the largest order at which Opacus's integer-order
#: series stays finite in double precision (binom(1024, 512) ≈ 4e306).
DEFAULT_ORDERS: tuple[float, ...] = (
    *(float(a) for a in RDPAccountant.DEFAULT_ALPHAS),
    *(64.0, 80.0, 96.0, 128.0, 192.0, 256.0, 512.0, 1024.0),
)


def check_orders(orders: Sequence[float]) -> tuple[float, ...]:
    """Validate RDP orders (non-empty, finite, all > 1) and return them as a hashable tuple of floats."""
    try:
        out = tuple(float(a) for a in orders)
    except (TypeError, ValueError):
        raise ValueError(f"orders must be a sequence of numbers, got {orders!r}") from None
    if not out:
        raise ValueError("orders must not be empty")
    bad = [a for a in out if not (math.isfinite(a) and a > 1.0)]
    if bad:
        raise ValueError(f"orders must all be finite and > 1, got {bad[:5]}")
    return out


def check_delta(delta: object, name: str = "delta") -> float:
    """Validate δ ∈ (0, 1) and return it as a float."""
    try:
        value = float(delta)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number in (0, 1), got {delta!r}") from None
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {delta!r}")
    return value


@functools.lru_cache(maxsize=4096)
def event_rdp(event: PrivacyEvent, orders: tuple[float, ...]) -> np.ndarray:
    """Cached, read-only RDP vector of one occurrence of ``event`` (Opacus recomputes it on every call)."""
    values = np.array(event.rdp(orders), dtype=np.float64)
    if values.shape != (len(orders),):
        raise ValueError(
            f"{type(event).__name__}.rdp returned shape {values.shape}, expected ({len(orders)},)"
        )
    bad = np.isnan(values) | (values < 0)
    if bad.any():
        bad_orders = [orders[i] for i in np.flatnonzero(bad)[:5]]
        raise ValueError(
            f"{event!r} has NaN or negative RDP at orders {bad_orders} (Opacus's subsampled-Gaussian RDP "
            "overflows above order 1024); drop those orders"
        )
    values.flags.writeable = False
    return values


def epsilon_from_rdp(
    rdp: Sequence[float] | np.ndarray, orders: Sequence[float], delta: float
) -> tuple[float, float]:
    """Convert RDP values to (ε, best order) at ``delta``, exactly as Opacus ≥ 1.0 ``get_privacy_spent``.

    Uses Balle et al. 2020, Thm 21: ε = rdp − (ln δ + ln α)/(α − 1) + ln((α − 1)/α), minimised over α.
    Two clean-ups: ε is clamped at 0 (a negative value is still a valid (0, δ) bound), and when every
    order is infinite the result is ``(inf, nan)`` without warnings. No warning is emitted when the
    optimum is at the edge of ``orders`` (it is cheap enough to call every step).
    """
    delta = check_delta(delta)
    orders_vec = np.asarray(orders, dtype=np.float64)
    rdp_vec = np.asarray(rdp, dtype=np.float64)
    if orders_vec.ndim != 1 or orders_vec.shape != rdp_vec.shape:
        raise ValueError(
            f"rdp and orders must be 1-D and the same length, got shapes {rdp_vec.shape} and {orders_vec.shape}"
        )
    if orders_vec.size == 0:
        raise ValueError("orders must not be empty")
    eps = (
        rdp_vec
        - (math.log(delta) + np.log(orders_vec)) / (orders_vec - 1.0)
        + np.log((orders_vec - 1.0) / orders_vec)
    )
    finite = np.isfinite(eps)
    if not finite.any():
        return math.inf, math.nan
    idx = int(np.argmin(np.where(finite, eps, np.inf)))
    return max(0.0, float(eps[idx])), float(orders_vec[idx])
