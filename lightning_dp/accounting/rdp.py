"""Rényi-DP helpers: the order grids, cached per-event RDP vectors and bounds, and the RDP → (ε, δ) conversion."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
from opacus.accountants import RDPAccountant

from .events import PoissonGaussian, PrivacyEvent
from .sgm import sgm_rdp_bound

__all__ = [
    "DEFAULT_ORDERS",
    "EXACT_RUN",
    "SPARSE_ORDERS",
    "check_delta",
    "check_orders",
    "epsilon_from_rdp",
    "event_rdp",
    "event_rdp_bound",
    "segment_rdp",
]


class _Orders(tuple[float, ...]):
    """A tuple of orders that hashes once: the RDP caches are keyed by it, and a 300-float tuple
    would otherwise be re-hashed (microseconds) on every lookup. Equal, and hashes equal, to the tuple."""

    _hash: int

    def __hash__(self) -> int:
        """The plain tuple's hash, computed on first use."""
        try:
            return self._hash
        except AttributeError:
            self._hash = tuple.__hash__(self)
            return self._hash


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
    return _Orders(out)


def _geometric_orders(start: int, stop: int, ratio: float) -> tuple[float, ...]:
    """Integer orders from ``start`` to ``stop`` (both included), each about ``ratio`` times the last."""
    out, x = [start], float(start)
    while out[-1] < stop:
        x *= ratio
        out.append(min(stop, max(out[-1] + 1, round(x))))
    return tuple(float(a) for a in out)


#: The RDP orders of lightning-dp up to 0.1.x: Opacus's ``DEFAULT_ALPHAS`` (1.1 … 10.9, 12 … 63) plus
#: 64, 80, 96, 128, 192, 256, 512, 1024. Kept as the privacy filter's default, whose strict rule pays
#: ln|Λ| (a dense grid would cost it more than it gains), and for comparisons with Opacus.
SPARSE_ORDERS: tuple[float, ...] = check_orders(
    (*RDPAccountant.DEFAULT_ALPHAS, 64.0, 80.0, 96.0, 128.0, 192.0, 256.0, 512.0, 1024.0)
)

#: Opacus's orders 1.1 … 10.9 (by 0.1), every integer 11 … 128, then integers about 3 % apart up to
#: 2048, and every sparse order. At small ε the optimal order sits on a sharp bend of the subsampled Gaussian's RDP curve, so
#: SPARSE_ORDERS over-reported ε by up to ~100 % (σ = 5, q = 1e-4); this grid is within ~1 % of every
#: order up to 20,000. Reading ε stays a few vector operations over these ~310 orders.
DEFAULT_ORDERS: tuple[float, ...] = check_orders(
    sorted(
        {
            *SPARSE_ORDERS,  # so ε is never above the sparse grid's
            *(float(a) for a in range(11, 129)),
            *_geometric_orders(128, 2048, 1.03),
        }
    )
)

#: A run of at least this many equal consecutive events is priced with its exact RDP; shorter runs of a
#: subsampled Gaussian use the cached grid bound (:func:`~lightning_dp.accounting.sgm.sgm_rdp_bound`),
#: so an exact evaluation (~1-5 ms) is paid at most once per EXACT_RUN events.
EXACT_RUN = 64


def check_delta(delta: object, name: str = "delta") -> float:
    """Validate δ ∈ (0, 1) and return it as a float."""
    try:
        value = float(delta)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number in (0, 1), got {delta!r}") from None
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {delta!r}")
    return value


def _validated(event: PrivacyEvent, orders: tuple[float, ...], values: np.ndarray) -> np.ndarray:
    """Check an RDP vector's shape and values and freeze it (it is shared through the caches)."""
    if values.shape != (len(orders),):
        raise ValueError(
            f"{type(event).__name__}.rdp returned shape {values.shape}, expected ({len(orders)},)"
        )
    bad = np.isnan(values) | (values < 0)
    if bad.any():
        bad_orders = [orders[i] for i in np.flatnonzero(bad)[:5]]
        raise ValueError(f"{event!r} has NaN or negative RDP at orders {bad_orders}; drop those orders")
    values.flags.writeable = False
    return values


@functools.lru_cache(maxsize=4096)
def event_rdp(event: PrivacyEvent, orders: tuple[float, ...]) -> np.ndarray:
    """Cached, read-only RDP vector of one occurrence of ``event`` (Opacus recomputes it on every call)."""
    return _validated(event, orders, np.array(event.rdp(orders), dtype=np.float64))


@functools.lru_cache(maxsize=256)
def event_rdp_bound(event: PrivacyEvent, orders: tuple[float, ...]) -> np.ndarray:
    """A cheap upper bound on :func:`event_rdp`: a subsampled Gaussian's exact RDP at a nearby grid point
    with less noise and a higher rate (cached across events, and per event: the ledger prices, records
    and reads each new event, three lookups); the exact vector for every other event."""
    params = event.poisson_gaussian_params()
    if params is None or type(event).rdp is not PoissonGaussian.rdp:
        return event_rdp(event, orders)
    sigma, q = params
    if sigma == 0.0 or q in (0.0, 1.0):
        return event_rdp(event, orders)
    return sgm_rdp_bound(sigma, q, orders)


def segment_rdp(event: PrivacyEvent, count: int, orders: tuple[float, ...]) -> np.ndarray:
    """RDP of ``count`` consecutive ``event`` s: exact from EXACT_RUN on, the grid bound below.

    ``min(count·bound, max((EXACT_RUN − 1)·bound, count·exact))`` for long runs: never below the exact
    value, and non-decreasing in ``count`` at every order, so ε never drops when a run grows.
    """
    bound = event_rdp_bound(event, orders)
    if count == 1:
        return bound  # read-only, shared: callers add to it, never into it
    if count < EXACT_RUN:
        return count * bound
    exact = event_rdp(event, orders)
    if exact is bound:
        return count * exact
    out: np.ndarray = np.minimum(count * bound, np.maximum((EXACT_RUN - 1) * bound, count * exact))
    return out


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
    if isinstance(orders, _Orders) and isinstance(rdp, np.ndarray) and rdp.shape == (len(orders),):
        # The ledger's path, every step: no conversion of the 300-float orders tuple.
        return _min_epsilon(rdp.astype(np.float64, copy=False) + _conversion_offset(orders, delta), orders)
    orders_vec = np.asarray(orders, dtype=np.float64)
    rdp_vec = np.asarray(rdp, dtype=np.float64)
    if orders_vec.ndim != 1 or orders_vec.shape != rdp_vec.shape:
        raise ValueError(
            f"rdp and orders must be 1-D and the same length, got shapes {rdp_vec.shape} and {orders_vec.shape}"
        )
    if orders_vec.size == 0:
        raise ValueError("orders must not be empty")
    return _min_epsilon(rdp_vec + _offset(orders_vec, delta), orders)


def _offset(orders: np.ndarray, delta: float) -> np.ndarray:
    """ε(α) − rdp(α) of the conversion: −(ln δ + ln α)/(α − 1) + ln((α − 1)/α)."""
    out: np.ndarray = -(math.log(delta) + np.log(orders)) / (orders - 1.0) + np.log((orders - 1.0) / orders)
    return out


@functools.lru_cache(maxsize=64)
def _conversion_offset(orders: tuple[float, ...], delta: float) -> np.ndarray:
    """:func:`_offset` for a hashed orders tuple, cached (the ledger converts at the same δ every step)."""
    out = _offset(np.asarray(orders, dtype=np.float64), delta)
    out.flags.writeable = False
    return out


def _min_epsilon(eps: np.ndarray, orders: Sequence[float]) -> tuple[float, float]:
    """(ε, order) at the smallest finite ε over the orders, ε clamped at 0; (inf, nan) if none is finite."""
    finite = np.isfinite(eps)
    if not finite.all():
        if not finite.any():
            return math.inf, math.nan
        eps = np.where(finite, eps, np.inf)
    idx = int(np.argmin(eps))
    return max(0.0, float(eps[idx])), float(orders[idx])
