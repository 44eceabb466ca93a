"""One-line entry points: ε of a DP-SGD run, and the smallest σ that meets a target ε (conservatively)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, cast

from .arguments import check_integer
from .events import PoissonGaussian
from .ledger import Accountant, PrivacyLedger
from .prv import PRVNumericalError
from .rdp import DEFAULT_ORDERS, check_delta

__all__ = ["MAX_NOISE_MULTIPLIER", "calibrate_noise", "compute_epsilon"]

#: Largest σ ``calibrate_noise`` tries before declaring the target unreachable.
MAX_NOISE_MULTIPLIER = 1e4
#: Smallest σ it tries before giving up on finding a lower bracket (the target is then met by almost no noise).
_MIN_NOISE_MULTIPLIER = 1e-6


def _check_steps(steps: Any, *, minimum: int) -> int:
    """Validate a step count: an integer ≥ ``minimum`` (bools rejected)."""
    return check_integer(steps, minimum, f"steps must be an integer >= {minimum}, got {steps!r}")


def _check_accountant(accountant: str) -> Accountant:
    """Accept the accountant as a plain string (config/CLI values): ``"rdp"``, ``"prv"`` or ``"pld"``."""
    if accountant not in ("rdp", "prv", "pld"):
        raise ValueError(f"accountant must be 'rdp', 'prv' or 'pld', got {accountant!r}")
    return cast(Accountant, accountant)


def compute_epsilon(
    *,
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: str = "rdp",
    orders: Sequence[float] = DEFAULT_ORDERS,
) -> float:
    """ε after ``steps`` DP-SGD steps with noise ``noise_multiplier`` and Poisson rate ``sample_rate``.

    Identical (bit-for-bit) to a :class:`PrivacyLedger` that recorded the same constant event.
    """
    event = PoissonGaussian(noise_multiplier, sample_rate)
    count = _check_steps(steps, minimum=0)
    ledger = PrivacyLedger(delta, _check_accountant(accountant), orders)
    ledger.record(event, count)
    return ledger.epsilon()


def calibrate_noise(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    tol: float = 0.01,
    orders: Sequence[float] = DEFAULT_ORDERS,
) -> float:
    """Smallest σ (to relative ``tol``) whose ε after ``steps`` steps is ≤ ``target_epsilon``.

    Conservative: brackets σ, bisects, and returns the upper end, whose ε was actually computed and is
    never above target (a PRV or PLD evaluation that fails counts as "above target").
    """
    target, delta, q, n, rel_tol = _calibration_arguments(target_epsilon, delta, sample_rate, steps, tol)
    PrivacyLedger(delta, _check_accountant(accountant), orders)  # validates accountant and orders up front

    def eps_at(sigma: float) -> float:
        try:
            return compute_epsilon(
                noise_multiplier=sigma,
                sample_rate=q,
                steps=n,
                delta=delta,
                accountant=accountant,
                orders=orders,
            )
        except PRVNumericalError:
            return math.inf

    def fits(sigma: float) -> bool:
        return eps_at(sigma) <= target

    # Bracket: lo does not meet the target (or is ~0), hi does. PRV and PLD are tighter than RDP, so the
    # (cheap) RDP answer meets the target for them too: start just below it and step down.
    if accountant in ("prv", "pld"):
        try:
            rdp_sigma = calibrate_noise(
                target_epsilon=target, delta=delta, sample_rate=q, steps=n, tol=rel_tol, orders=orders
            )
        except ValueError:  # out of RDP's reach: the general search below may still find one
            rdp_sigma = math.inf
        if rdp_sigma < math.inf and fits(rdp_sigma):
            return _down_from(fits, rdp_sigma, 0.85, rel_tol)
    if fits(1.0):
        return _down_from(fits, 1.0, 0.5, rel_tol)
    lo = 1.0
    while True:
        hi = min(2.0 * lo, MAX_NOISE_MULTIPLIER)
        if fits(hi):
            break
        if hi >= MAX_NOISE_MULTIPLIER:
            raise ValueError(
                f"cannot reach target_epsilon={target:g} at delta={delta:g} with sample_rate={q:g} and "
                f"steps={n} ({accountant} accountant): even noise_multiplier={MAX_NOISE_MULTIPLIER:g} gives "
                f"ε={eps_at(MAX_NOISE_MULTIPLIER):.4g}. Use fewer steps, a smaller batch (lower sample_rate) "
                "or a larger target_epsilon."
            )
        lo = hi
    return _bisect(fits, lo, hi, rel_tol)


def _calibration_arguments(
    target_epsilon: Any, delta: Any, sample_rate: Any, steps: Any, tol: Any
) -> tuple[float, float, float, int, float]:
    """``calibrate_noise``'s arguments checked, in its order: (target ε, δ, q, steps, relative tolerance)."""
    try:
        target = float(target_epsilon)
    except (TypeError, ValueError):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}") from None
    if not (math.isfinite(target) and target > 0):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    delta = check_delta(delta)
    try:
        q = float(sample_rate)
    except (TypeError, ValueError):
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}") from None
    if not 0.0 < q <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    n = _check_steps(steps, minimum=1)
    try:
        rel_tol = float(tol)
    except (TypeError, ValueError):
        raise ValueError(f"tol must be in (0, 1), got {tol!r}") from None
    if not 0.0 < rel_tol < 1.0:
        raise ValueError(f"tol must be in (0, 1), got {tol!r}")
    return target, delta, q, n, rel_tol


def _bisect(fits: Callable[[float], bool], lo: float, hi: float, rel_tol: float) -> float:
    """The upper end of [lo, hi] once it is within ``rel_tol`` of the lower (lo does not fit, hi does)."""
    while hi - lo > rel_tol * hi:  # invariant: not fits(lo), fits(hi)
        mid = 0.5 * (lo + hi)
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _down_from(fits: Callable[[float], bool], hi: float, factor: float, rel_tol: float) -> float:
    """From a σ that fits, ``factor`` times smaller until one does not (or σ is ~0), then bisect."""
    lo = factor * hi
    while fits(lo):
        hi, lo = lo, factor * lo
        if lo < _MIN_NOISE_MULTIPLIER:
            return hi
    return _bisect(fits, lo, hi, rel_tol)
