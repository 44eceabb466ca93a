"""PRV accountant (Gopi et al. 2021) for histories of subsampled-Gaussian events, via Opacus's PRV code.

Tighter than RDP for DP-SGD, but each evaluation costs a discretisation + FFT (~0.1-1 s), so the ledger
caches it. Only events that are subsampled Gaussians (``PrivacyEvent.poisson_gaussian_params``) can be
priced; anything else must use ``accountant="rdp"``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

import numpy as np
from opacus.accountants.analysis.prv import (
    Domain,
    PoissonSubsampledGaussianPRV,
    TruncatedPrivacyRandomVariable,
    compose_heterogeneous,
    compute_safe_domain_size,
    discretize,
)

from .analytic_gaussian import unsampled_epsilon
from .events import PrivacyEvent
from .rdp import check_delta

__all__ = [
    "MAX_DOMAIN_SIZE",
    "PRVNumericalError",
    "closed_form_epsilon",
    "prv_epsilon",
    "prv_segments",
    "valid_epsilon",
]

#: Largest discretisation grid we allow (float64 points); beyond it memory/time explode (~1 GB).
MAX_DOMAIN_SIZE = 2**24


class PRVNumericalError(ArithmeticError):
    """The PRV computation failed or is out of its numerical range; use ``accountant='rdp'`` instead."""


def prv_segments(
    history: Iterable[tuple[PrivacyEvent, int]], accountant: str = "prv"
) -> list[tuple[float, float, int]]:
    """Collapse a history into ``(σ, q, count)`` segments the PRV (or PLD) accountant can price.

    Composition is commutative, so equal (σ, q) pairs are merged wherever they occur; events with
    q = 0 or count = 0 cost nothing and are dropped. Raises ValueError for events PRV cannot price.
    """
    merged: dict[tuple[float, float], int] = {}
    for event, count in history:
        params = event.poisson_gaussian_params()
        if params is None:
            raise ValueError(
                f"the {accountant.upper()} accountant cannot price {event.kind!r} events ({event!r}); "
                "use accountant='rdp'"
            )
        sigma, q = params
        if q == 0.0 or count == 0:
            continue
        merged[(sigma, q)] = merged.get((sigma, q), 0) + int(count)
    return [(sigma, q, n) for (sigma, q), n in merged.items()]


def prv_epsilon(
    history: Iterable[tuple[PrivacyEvent, int]],
    delta: float,
    *,
    eps_error: float = 0.01,
    delta_error: float | None = None,
) -> float:
    """Upper bound on ε at ``delta`` for a history of ``(event, count)`` (the bound Opacus reports).

    Defaults match ``opacus.accountants.PRVAccountant.get_epsilon``: ``eps_error=0.01``,
    ``delta_error=delta/1000``. Returns 0 for an empty history and ``inf`` if any event has σ = 0.
    Raises :class:`PRVNumericalError` instead of returning NaN or a negative/garbage value.
    """
    delta = check_delta(delta)
    if not (math.isfinite(eps_error) and eps_error > 0):
        raise ValueError(f"eps_error must be a positive number, got {eps_error!r}")
    if delta_error is None:
        delta_error = delta / 1000.0
    if not 0.0 < delta_error < delta:
        raise ValueError(f"delta_error must be in (0, delta={delta}), got {delta_error!r}")

    segments = prv_segments(history)
    closed = closed_form_epsilon(segments, delta)
    if closed is not None:
        return closed
    try:
        eps_upper = _discretised_epsilon(segments, delta, eps_error, delta_error)
    except PRVNumericalError:
        raise
    except (
        RuntimeError,
        ValueError,
        FloatingPointError,
        OverflowError,
        ZeroDivisionError,
        MemoryError,
    ) as exc:
        raise PRVNumericalError(
            f"PRV accounting failed for segments {segments} at delta={delta}: {exc}; "
            "use accountant='rdp' for this history"
        ) from exc
    return valid_epsilon(float(eps_upper), segments, delta, PRVNumericalError, "PRV")


def closed_form_epsilon(segments: list[tuple[float, float, int]], delta: float) -> float | None:
    """ε of ``(σ, q, count)`` segments where no numerical accountant is needed: 0 for none, ``inf`` when an
    event has σ = 0, the exact ε when all are unsampled Gaussians (q = 1: one Gaussian); None otherwise."""
    if not segments:
        return 0.0
    if any(sigma == 0.0 for sigma, _, _ in segments):
        return math.inf
    return unsampled_epsilon(segments, delta)  # only q = 1 Gaussians: one Gaussian, read exactly


def valid_epsilon(
    eps: float,
    segments: list[tuple[float, float, int]],
    delta: float,
    error: type[PRVNumericalError],
    accountant: str,
) -> float:
    """``eps`` as a numerical accountant returned it, refused (``error``) when it is NaN or negative."""
    if math.isnan(eps) or eps < 0:
        raise error(
            f"{accountant} accounting returned an invalid epsilon ({eps}) for segments {segments} at delta={delta}; "
            "use accountant='rdp' for this history"
        )
    return eps


def _discretised_epsilon(
    segments: list[tuple[float, float, int]], delta: float, eps_error: float, delta_error: float
) -> float:
    """The PRVs of the segments discretised on one grid (Gopi et al. 2021), composed, and ε's upper bound read."""
    total = sum(n for _, _, n in segments)
    counts = [n for _, _, n in segments]
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        prvs = [PoissonSubsampledGaussianPRV(q, sigma) for sigma, q, _ in segments]
        half_width = compute_safe_domain_size(
            prvs=prvs, max_self_compositions=counts, eps_error=eps_error, delta_error=delta_error
        )
        if not math.isfinite(half_width):
            raise PRVNumericalError(f"PRV domain is unbounded (L={half_width})")
        # Mesh from Gopi et al. 2021 (Thm 5.5): error eps_error after `total` compositions.
        mesh = eps_error / math.sqrt(total * math.log(12.0 / delta_error) / 2.0)
        size = 2.0 * half_width / mesh
        if size > MAX_DOMAIN_SIZE:
            raise PRVNumericalError(
                f"PRV discretisation needs ~{size:.3g} points (> {MAX_DOMAIN_SIZE}) for {total} steps "
                f"at eps_error={eps_error}; use accountant='rdp' or a larger eps_error"
            )
        domain = Domain.create_aligned(-half_width, half_width, mesh)
        dprvs = [
            discretize(TruncatedPrivacyRandomVariable(prv, domain.t_min, domain.t_max), domain)
            for prv in prvs
        ]
        composed = compose_heterogeneous(dprvs=dprvs, num_self_compositions=counts)
        _, _, eps_upper = composed.compute_epsilon(delta, delta_error, eps_error)
    return eps_upper
