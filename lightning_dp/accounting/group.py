"""User-level ε of an example-level run whose users each own at most k examples (the ELS statement).

Example-level DP-SGD over data where every user holds at most k examples protects a user only as a group
of k. Two valid bounds, both as TF Privacy states them (``docs/user-level.md``; spec ``user_level.md``
§1.6, §4.2):

* :func:`mog_user_epsilon`: the tight one. One user's examples join a Poisson step J ~ Binomial(k, q) at a
  time, each moving the clipped sum by at most C, so each step is dominated by the pair
  P = Σ_j Binom(j; k, q)·N(j, σ²) vs Q = N(0, σ²) (Ganesh 2024, Thm 3.1), composed by dp-accounting's PLD
  accountant (optional dependency: ``None`` without it). Seconds to a minute per evaluation: compute it
  once, at the end of fit, never per step.
* :func:`group_rdp_user_epsilon`: group privacy on the ledger's own RDP (ε, δ) curve (Vadhan 2017, Lemma
  2.2, the tighter form): find δ_e with δ_e·(e^{kε_e} − 1)/(e^{ε_e} − 1) = δ and report k·ε_e(δ_e); ∞ when
  no δ_e > 0 solves it (it never raises for that).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Iterable

from scipy import optimize, stats

from .events import PoissonGaussian, PrivacyEvent
from .ledger import PrivacyLedger
from .pld import VALUE_DISCRETIZATION_INTERVAL
from .rdp import check_delta, epsilon_from_rdp

__all__ = ["group_rdp_user_epsilon", "mog_user_epsilon", "mog_user_epsilon_of_history"]

METHOD = "Ganesh 2024 MoG dominating pair; Vadhan 2017 Lemma 2.2 group privacy"
"""How the two user-level ε of an example-level run are computed, as the report names them."""


def _check_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"the bound on examples per user must be an integer >= 1, got {k!r}")
    return k


def mog_user_epsilon(
    noise_multiplier: float,
    sample_rate: float,
    k: int,
    steps: int,
    delta: float,
    *,
    value_discretization_interval: float = VALUE_DISCRETIZATION_INTERVAL,
) -> float | None:
    """User-level ε of ``steps`` Poisson-Gaussian steps when a user owns at most ``k`` examples (tight PLD).

    ``None`` when dp-accounting is not installed (the group-RDP bound is always available).
    """
    history = [(PoissonGaussian(noise_multiplier, sample_rate), int(steps))]
    return mog_user_epsilon_of_history(
        history, k, delta, value_discretization_interval=value_discretization_interval
    )


def mog_user_epsilon_of_history(
    history: Iterable[tuple[PrivacyEvent, int]],
    k: int,
    delta: float,
    *,
    value_discretization_interval: float = VALUE_DISCRETIZATION_INTERVAL,
) -> float | None:
    """:func:`mog_user_epsilon` for a ledger history: one mixture-of-Gaussians event per (σ, q) segment.

    Only Poisson-subsampled Gaussian events have this bound; any other event raises ``ValueError`` (use
    :func:`group_rdp_user_epsilon`, which prices every event the ledger can).
    """
    k, delta = _check_k(k), check_delta(delta)
    segments: list[tuple[float, float, int]] = []
    for event, count in history:
        params = event.poisson_gaussian_params()
        if params is None:
            raise ValueError(
                f"the mixture-of-Gaussians user-level bound covers Poisson-subsampled Gaussian steps only, "
                f"not {type(event).__name__}; use group_rdp_user_epsilon"
            )
        if count > 0:
            segments.append((params[0], params[1], int(count)))
    if not segments:
        return 0.0
    if any(sigma == 0.0 for sigma, _, _ in segments):
        return math.inf
    if importlib.util.find_spec("dp_accounting") is None:
        return None
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    accountant = pld_privacy_accountant.PLDAccountant(
        value_discretization_interval=value_discretization_interval
    )
    sensitivities = list(range(k + 1))
    for sigma, q, count in segments:
        probabilities = stats.binom.pmf(sensitivities, k, q)
        event = dp_accounting.dp_event.MixtureOfGaussiansDpEvent(sigma, sensitivities, probabilities)
        accountant.compose(event, count)
    return float(accountant.get_epsilon(delta))


def _log_expm1(x: float) -> float:
    """log(e^x − 1) for x > 0 without overflow."""
    return x + math.log(-math.expm1(-x))


def group_rdp_user_epsilon(ledger: PrivacyLedger, k: int, delta: float) -> float:
    """User-level ε at ``delta`` by group privacy on the ledger's RDP curve, for users of ≤ ``k`` examples.

    Returns ``math.inf`` when no example-level δ_e solves the group equation (δ_e would underflow).
    """
    k, delta = _check_k(k), check_delta(delta)
    rdp, orders = ledger.rdp, ledger.orders
    if not rdp.any():
        return 0.0

    @functools.cache
    def example_epsilon(log_delta: float) -> float:
        d = math.exp(log_delta)
        if not 0.0 < d < 1.0:
            return math.nan  # δ_e underflowed: no solution at this depth
        return float(epsilon_from_rdp(rdp, orders, d)[0])

    target = math.log(delta)

    def gap(log_delta: float) -> float:
        eps = example_epsilon(log_delta)
        if not math.isfinite(eps):
            return math.nan
        if eps <= 0.0:  # ε_e = 0: the group factor (e^{kε} − 1)/(e^ε − 1) is its limit, k
            return log_delta + math.log(k) - target
        return log_delta + _log_expm1(k * eps) - _log_expm1(eps) - target

    hi = target
    lo = hi - math.log(10)
    g = gap(lo)
    while not (g <= 0.0):
        if not math.isfinite(g):
            return math.inf
        hi = lo - g
        lo = hi - math.log(10)
        g = gap(lo)
    lo -= g  # one Newton-like step up from the last bracket end, as TF Privacy does
    return k * example_epsilon(optimize.brentq(gap, lo, hi))
