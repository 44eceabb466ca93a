"""Private selection: run a random number K of trials, release only the best, priced as one ledger event.

Papernot & Steinke (ICLR 2022, arXiv 2110.03620v2, "PS22") bound the RDP of that release from the RDP
curve of one trial: Theorem 2 when K follows a truncated negative binomial D_{η,γ} (η = 0 logarithmic,
η = 1 geometric), Theorem 6 when K ~ Poisson(μ). The formulas are implemented as Google's
``dp_accounting`` does (``_compute_rdp_repeat_and_select``) and cross-checked against it in the tests.
The theorems hold only if K is drawn once, kept secret, every one of the K trials runs, and only the
best output (model, score, hyperparameters) is released.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from .events import PrivacyEvent
from .rdp import event_rdp

__all__ = [
    "FAMILIES",
    "RepeatAndSelect",
    "Repetitions",
    "delta_from_rdp",
    "max_history_rdp",
    "repeat_and_select_rdp",
    "threshold_rdp",
    "tnb_mean",
]

#: Distributions of the number of trials K. ``tnb`` is D_{η,γ} with a free η ≥ 0; ``logarithmic`` is
#: η = 0 and ``geometric`` η = 1.
FAMILIES = ("poisson", "logarithmic", "geometric", "tnb")
_ETA = {"logarithmic": 0.0, "geometric": 1.0}


def tnb_mean(gamma: float, eta: float) -> float:
    """E[K] of the truncated negative binomial D_{η,γ} (PS22 Definition 1), computed without cancellation."""
    if eta == 1.0:
        return 1.0 / gamma
    log_gamma = math.log(gamma)
    if eta == 0.0:
        return (1.0 - gamma) / (gamma * -log_gamma)
    return eta * (1.0 - gamma) / (gamma * -math.expm1(eta * log_gamma))


def _solve_gamma(mean: float, eta: float) -> float:
    """γ with E[K](γ) = mean (E[K] decreases in γ): 1/mean for the geometric, else Brent's method."""
    if eta == 1.0:
        return 1.0 / mean
    from scipy.optimize import brentq  # imported here: `import lightning_dp` stays free of scipy.optimize

    lo, hi = 1e-15, 1.0 - 1e-15
    return float(brentq(lambda g: tnb_mean(g, eta) - mean, lo, hi, rtol=4 * np.finfo(float).eps, xtol=1e-300))


@dataclass(frozen=True)
class Repetitions:
    """The public law of the number of trials K: its family, mean, η and γ (γ stored, never re-solved).

    Build it with :meth:`poisson`, :meth:`logarithmic`, :meth:`geometric` or :meth:`tnb`. The sampler
    and the bound use the same stored γ, so a resumed search prices exactly what it sampled.
    """

    family: str
    mean: float
    eta: float = 0.0
    gamma: float = 0.0

    def __post_init__(self) -> None:
        """Validate (I12: mean ≤ 1, μ < 1 and η < 0 are refused) and fill in η and γ for the D_{η,γ} family."""
        if self.family not in FAMILIES:
            raise ValueError(
                f"repetitions distribution must be one of {FAMILIES}, got {self.family!r}; there is no default "
                "(see `lightning-dp tune --plan_only` for the ε of each)"
            )
        try:
            mean, eta, gamma = float(self.mean), float(self.eta), float(self.gamma)
        except (TypeError, ValueError):
            raise ValueError(f"repetitions mean, eta and gamma must be numbers, got {self!r}") from None
        if self.family == "poisson":
            if not (math.isfinite(mean) and mean >= 1.0):
                raise ValueError(
                    f"a Poisson number of trials needs mean >= 1 (ln μ < 0 would make the bound negative), got "
                    f"{self.mean!r}; raise the mean"
                )
            eta = gamma = 0.0
        else:
            eta = _ETA.get(self.family, eta)
            if not (math.isfinite(eta) and eta >= 0.0):
                raise ValueError(f"eta must be a finite number >= 0, got {self.eta!r}; use eta >= 0")
            if not (math.isfinite(mean) and mean > 1.0):
                raise ValueError(
                    f"a {self.family} number of trials needs mean > 1, got {self.mean!r}; raise the mean"
                )
            if gamma == 0.0:
                gamma = _solve_gamma(mean, eta)
            if not 0.0 < gamma < 1.0:
                raise ValueError(f"gamma must be in (0, 1), got {self.gamma!r}")
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "eta", eta)
        object.__setattr__(self, "gamma", gamma)

    @classmethod
    def poisson(cls, mean: float) -> Repetitions:
        """K ~ Poisson(mean) (PS22 Theorem 6); K = 0 happens and then nothing is released."""
        return cls("poisson", mean)

    @classmethod
    def logarithmic(cls, mean: float) -> Repetitions:
        """K ~ D_{0,γ}, the logarithmic distribution: the smallest ε at a given mean, but a heavy tail."""
        return cls("logarithmic", mean)

    @classmethod
    def geometric(cls, mean: float) -> Repetitions:
        """K ~ D_{1,γ} = Geometric(γ = 1/mean) on {1, 2, ...}."""
        return cls("geometric", mean)

    @classmethod
    def tnb(cls, mean: float, eta: float) -> Repetitions:
        """K ~ D_{η,γ}, the truncated negative binomial with shape η ≥ 0 (γ solved from the mean)."""
        return cls("tnb", mean, eta)

    @property
    def expected_trials(self) -> float:
        """E[K] recomputed from the stored γ (the bound's ln E[K] term)."""
        return self.mean if self.family == "poisson" else tnb_mean(self.gamma, self.eta)

    @property
    def theorem(self) -> str:
        """The result that prices this law, for reports."""
        if self.family == "poisson":
            return "PS22 Thm 6 (Poisson), formula as dp_accounting"
        return "PS22 Thm 2 (truncated negative binomial), formula as dp_accounting"

    def pmf(self, k: int) -> float:
        """P[K = k]."""
        if self.family == "poisson":
            if k < 0:
                return 0.0
            return math.exp(k * math.log(self.mean) - self.mean - math.lgamma(k + 1))
        if k < 1:
            return 0.0
        g, eta = self.gamma, self.eta
        if eta == 0.0:
            return math.exp(k * math.log1p(-g) - math.log(k) - math.log(-math.log(g)))
        # (1-γ)^k ∏_{l<k} (l+η)/(l+1) / (γ^{-η} - 1), in logs: lgamma(k+η) - lgamma(η) - lgamma(k+1).
        log_prod = math.lgamma(k + eta) - math.lgamma(eta) - math.lgamma(k + 1)
        return math.exp(k * math.log1p(-g) + log_prod - math.log(math.expm1(-eta * math.log(g))))

    @overload
    def sample(self, rng: np.random.Generator, size: None = None) -> int: ...
    @overload
    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray: ...
    def sample(self, rng: np.random.Generator, size: int | None = None) -> int | np.ndarray:
        """Draw K from ``rng`` (the tuner seeds it from os.urandom); never capped, never redrawn at 0.

        ``size``: that many independent draws as an array (for tests of the law).
        """
        n = 1 if size is None else int(size)
        if self.family == "poisson":
            draws = rng.poisson(self.mean, n)
        elif self.eta == 1.0:
            draws = rng.geometric(self.gamma, n)
        elif self.eta == 0.0:
            draws = rng.logseries(1.0 - self.gamma, n)
        else:  # NB(η, γ) conditioned on K > 0 is D_{η,γ}: redraw the zeros
            draws = rng.negative_binomial(self.eta, self.gamma, n)
            while (zeros := np.flatnonzero(draws == 0)).size:
                draws[zeros] = rng.negative_binomial(self.eta, self.gamma, zeros.size)
        draws = np.asarray(draws, dtype=np.int64)
        return int(draws[0]) if size is None else draws

    def to_dict(self) -> dict[str, Any]:
        """JSON-able description; γ is also given as a hex float so a reader can rebuild it bit for bit."""
        return {
            "distribution": self.family,
            "mean": self.mean,
            "eta": self.eta,
            "gamma": self.gamma,
            "gamma_hex": float(self.gamma).hex(),
        }


def _check_curve(rdp: Sequence[float] | np.ndarray, orders: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """RDP curve and orders as float arrays of the same 1-D shape, orders all > 1."""
    rdp_vec = np.asarray(rdp, dtype=np.float64)
    orders_vec = np.asarray(orders, dtype=np.float64)
    if rdp_vec.ndim != 1 or rdp_vec.shape != orders_vec.shape or rdp_vec.size == 0:
        raise ValueError(
            f"rdp and orders must be 1-D, non-empty and the same length, got {rdp_vec.shape} and {orders_vec.shape}"
        )
    if not (orders_vec > 1.0).all():
        raise ValueError(f"RDP orders must all be > 1, got {orders_vec.min()}")
    return rdp_vec, orders_vec


def _monotone(values: np.ndarray, orders: np.ndarray) -> np.ndarray:
    """ε′(λ_i) ← min_{λ_j ≥ λ_i} ε′(λ_j): valid because RDP is nondecreasing in the order."""
    idx = np.argsort(orders, kind="stable")
    out = np.empty_like(values)
    out[idx] = np.minimum.accumulate(values[idx][::-1])[::-1]
    return out


def delta_from_rdp(rdp: Sequence[float] | np.ndarray, orders: Sequence[float], epsilon: float) -> float:
    """Smallest δ with (ε, δ)-DP from an RDP curve (arXiv 2004.00010 Prop. 12, and the KL bound), as dp_accounting.

    δ = min_α min( exp((α−1)(ε(α) − ε + ln(1 − 1/α)) − ln α), sqrt(1 − e^{−ε(α)}) ), capped at 1.
    """
    rdp_vec, orders_vec = _check_curve(rdp, orders)
    return float(np.exp(_log_deltas(rdp_vec, orders_vec, np.array([float(epsilon)]))[0]))


def _log_deltas(rdp: np.ndarray, orders: np.ndarray, epsilons: np.ndarray) -> np.ndarray:
    """ln δ(ε) for each ε in ``epsilons`` (vectorised :func:`delta_from_rdp`)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        kl = np.where(rdp > 0, 0.5 * np.log1p(-np.exp(-rdp)), -np.inf)
        prop12 = (orders - 1.0)[None, :] * (
            rdp[None, :] - epsilons[:, None] + np.log1p(-1.0 / orders)[None, :]
        ) - np.log(orders)[None, :]
        prop12 = np.where(np.isnan(prop12), np.inf, prop12)
    log_delta = np.minimum(prop12, kl[None, :]).min(axis=1)
    return np.minimum(log_delta, 0.0)


def repeat_and_select_rdp(
    rdp: Sequence[float] | np.ndarray, orders: Sequence[float], repetitions: Repetitions
) -> np.ndarray:
    """RDP of "run K ~ ``repetitions`` trials, release the best" from ONE trial's curve ``rdp`` on ``orders``.

    Theorem 2 (D_{η,γ}): ε′(λ) = ε(λ) + (1+η)·min_λ̂[(1−1/λ̂)ε(λ̂) + ln(1/γ)/λ̂] + ln E[K]/(λ−1).
    Theorem 6 (Poisson): ε′(λ) = ε(λ) + μ·δ̂_λ + ln μ/(λ−1), with δ̂_λ = δ(ε̂ = ln(1 + 1/(λ−1))).
    Then ε′ is made nondecreasing in λ (ε′(λ_i) = min over λ_j ≥ λ_i), for both families.
    """
    eps, lam = _check_curve(rdp, orders)
    reps = repetitions
    if reps.family == "poisson":
        eps_hat = np.log1p(1.0 / (lam - 1.0))
        delta_hat = np.exp(_log_deltas(eps, lam, eps_hat))
        with np.errstate(invalid="ignore"):
            out = eps + reps.mean * delta_hat + math.log(reps.mean) / (lam - 1.0)
    else:
        with np.errstate(invalid="ignore"):
            c = (1.0 + reps.eta) * float(np.min((1.0 - 1.0 / lam) * eps - math.log(reps.gamma) / lam))
        out = eps + c + math.log(reps.expected_trials) / (lam - 1.0)
    out = np.where(np.isnan(out), np.inf, out)
    return _monotone(out, lam)


def threshold_rdp(rdp: Sequence[float] | np.ndarray, orders: Sequence[float], gamma: float) -> np.ndarray:
    """PS22 Corollary 16 (threshold mode, K ~ Geometric(γ), release the first score ≥ a fixed public τ).

    ε′(λ) = ε(λ) + ((λ−2)/(λ−1))·ε(λ−1) + 2·ln(1/γ)/(λ−1) for λ > 2, where ε(λ−1) is read at the smallest
    order ≥ λ−1 (RDP is nondecreasing); orders ≤ 2 get ∞ before the monotone step.
    """
    eps, lam = _check_curve(rdp, orders)
    if not 0.0 < gamma < 1.0:
        raise ValueError(f"gamma must be in (0, 1), got {gamma!r}")
    idx = np.argsort(lam, kind="stable")
    sorted_lam, sorted_eps = lam[idx], eps[idx]
    out = np.full_like(eps, np.inf)
    for i, order in enumerate(lam):
        if order <= 2.0:
            continue
        j = int(np.searchsorted(sorted_lam, order - 1.0, side="left"))
        prev = sorted_eps[j]
        out[i] = eps[i] + (order - 2.0) / (order - 1.0) * prev + 2.0 * math.log(1.0 / gamma) / (order - 1.0)
    return _monotone(out, lam)


History = Sequence[tuple[PrivacyEvent, int]]


def max_history_rdp(histories: Sequence[History], orders: tuple[float, ...]) -> np.ndarray:
    """RDP of one trial whose history is any of ``histories``: the pointwise max of Σ count·ε_event(λ) (§1.4)."""
    if not histories:
        raise ValueError("at least one candidate history is needed")
    curves = [
        sum((count * event_rdp(event, orders) for event, count in history), np.zeros(len(orders)))
        for history in histories
    ]
    return np.max(np.stack(curves), axis=0)


@dataclass(frozen=True)
class RepeatAndSelect(PrivacyEvent, kind="repeat_and_select"):
    """One release of the best of K trials, K ~ ``Repetitions(family, mean, eta, gamma)`` drawn in secret.

    ``candidates`` is JSON: one planned history ``[{"event": e.to_dict(), "count": n}, ...]`` per
    privacy-relevant combination of hyperparameters (the score's own release included). The trial curve
    is the pointwise maximum over them (PS22 §3.3: a uniform RDP bound over all candidates), then
    :func:`repeat_and_select_rdp` applies. Plain ``str``/``float`` fields keep ``to_dict`` checkpoint-safe.
    """

    candidates: str
    family: str
    mean: float
    eta: float
    gamma: float

    def __post_init__(self) -> None:
        """Validate the law of K and the candidate histories now, not at the first ε readout."""
        reps = Repetitions(self.family, self.mean, self.eta, self.gamma)
        object.__setattr__(self, "mean", reps.mean)
        object.__setattr__(self, "eta", reps.eta)
        object.__setattr__(self, "gamma", reps.gamma)
        if not self.histories():
            raise ValueError("RepeatAndSelect needs at least one candidate history")

    @classmethod
    def of(cls, histories: Sequence[History], repetitions: Repetitions) -> RepeatAndSelect:
        """Build the event from planned histories ``[[(event, count), ...], ...]`` and the law of K."""
        payload = [
            [{"event": event.to_dict(), "count": int(count)} for event, count in history]
            for history in histories
        ]
        return cls(
            json.dumps(payload, sort_keys=True),
            repetitions.family,
            repetitions.mean,
            repetitions.eta,
            repetitions.gamma,
        )

    @property
    def repetitions(self) -> Repetitions:
        """The law of K."""
        return Repetitions(self.family, self.mean, self.eta, self.gamma)

    def histories(self) -> list[list[tuple[PrivacyEvent, int]]]:
        """The candidate histories as ``(event, count)`` lists."""
        try:
            payload = json.loads(self.candidates)
            return [
                [(PrivacyEvent.from_dict(item["event"]), int(item["count"])) for item in history]
                for history in payload
            ]
        except (TypeError, KeyError, json.JSONDecodeError) as err:
            raise ValueError(
                f"RepeatAndSelect.candidates must be JSON [[{{'event': ..., 'count': n}}, ...], ...]: {err}"
            ) from None

    def trial_rdp(self, orders: tuple[float, ...]) -> np.ndarray:
        """RDP of one trial: the pointwise maximum over the candidate histories of Σ count·ε_event(λ)."""
        return max_history_rdp(self.histories(), orders)

    def rdp(self, orders: tuple[float, ...]) -> np.ndarray:
        """RDP of the released best trial (PS22 Theorem 2 or 6 applied to :meth:`trial_rdp`)."""
        return repeat_and_select_rdp(self.trial_rdp(orders), orders, self.repetitions)

    def pure_epsilon(self) -> float | None:
        """(2+η)·ε₀ for ε₀-DP trials under D_{η,γ} (PS22 Corollary 3); None for Poisson or non-pure trials."""
        if self.family == "poisson":
            return None
        worst = 0.0
        for history in self.histories():
            total = 0.0
            for event, count in history:
                eps = event.pure_epsilon()
                if eps is None:
                    return None
                total += count * eps
            worst = max(worst, total)
        return (2.0 + self.eta) * worst
