"""The math of DP matrix factorization (correlated noise), in numpy float64 on the CPU.

The strategy C is lower-triangular Toeplitz; the released gradients are S + σ·C_clip·κ·C⁻¹w, so the
noise in the prefix sums (what SGD's iterates post-process) is B·w with B = A·C⁻¹ (A: all-ones lower
triangle). Two families (spec ``correlated_noise.md`` §1.2-1.3):

* banded Toeplitz (BandMF): coefficients c₀..c_{b−1}, normalised to ‖c‖₂ = 1 (κ = 1), optimised for the
  mean prefix-sum error by L-BFGS from the banded square root (Choquette-Choo et al. 2023);
* buffered linear Toeplitz (BLT): t₀ = 1, t_k = Σ_i ω_i θ_i^{k−1} (Dvijotham et al. 2024), whose inverse is
  again a BLT (McMahan & Pillutla 2025).

Ports of jax_privacy 2.0.0's ``matrix_factorization.toeplitz`` / ``buffered_toeplitz`` formulas; the
digits are checked against that library's outputs in ``tests/noise/test_correlated.py``. No torch or JAX.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize, signal

__all__ = [
    "BLTParams",
    "BandChoice",
    "blt_coefficients",
    "blt_inverse",
    "blt_inverse_coefficients",
    "blt_prefix_sensitivities",
    "blt_sensitivity_squared",
    "bsr_coefficients",
    "check_blt",
    "dpsgd_rmse",
    "inverse_coefficients",
    "loss",
    "mean_error",
    "minsep_sensitivity_squared",
    "noise_std_factors",
    "optimize_banded_toeplitz",
    "optimize_blt",
    "per_query_error",
    "suggest_bands",
]


def _coefficients(coef: Sequence[float] | np.ndarray) -> np.ndarray:
    c = np.asarray(coef, dtype=np.float64).ravel()
    if c.size == 0 or not np.isfinite(c).all():
        raise ValueError(
            f"strategy coefficients must be a non-empty sequence of finite numbers, got {coef!r}"
        )
    if c[0] <= 0:
        raise ValueError(f"the first strategy coefficient must be > 0 (C must be invertible), got {c[0]!r}")
    return c


# -- banded Toeplitz ---------------------------------------------------------------------------------
def bsr_coefficients(bands: int) -> np.ndarray:
    """The banded square root c_k = ∏_{j=1..k} (2j−1)/(2j) (jax_privacy ``optimal_max_error_strategy_coefs``)."""
    ratios = (2.0 * np.arange(1, bands) - 1.0) / (2.0 * np.arange(1, bands))
    return np.concatenate([[1.0], np.cumprod(ratios)])


def inverse_coefficients(coef: Sequence[float] | np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` coefficients of C⁻¹ (Toeplitz too): c̄₀ = 1/c₀, c̄_t = −(1/c₀)·Σ_{j≥1} c_j c̄_{t−j}."""
    c = _coefficients(coef)
    impulse = np.zeros(n)
    impulse[0] = 1.0
    return np.asarray(signal.lfilter([1.0], c, impulse), dtype=np.float64)


def per_query_error(coef: Sequence[float] | np.ndarray, n: int) -> np.ndarray:
    """err_t = Σ_{s≤t} β_s² with β = cumsum(C⁻¹'s coefficients): the variance of the t-th prefix sum's noise."""
    beta = np.cumsum(inverse_coefficients(coef, n))
    return np.cumsum(beta**2)


def mean_error(coef: Sequence[float] | np.ndarray, n: int) -> float:
    """mean_t err_t (the prefix-sum MSE per unit noise), for coefficients as given (not normalised)."""
    return float(np.mean(per_query_error(coef, n)))


def noise_std_factors(coef: Sequence[float] | np.ndarray, n: int) -> np.ndarray:
    """‖row_t(C⁻¹)‖: the per-step noise std relative to i.i.d. noise of the same σ (spec pitfall P8)."""
    return np.sqrt(np.cumsum(inverse_coefficients(coef, n) ** 2))


_UNSTABLE = 1e30


def _loss_and_grad(c: np.ndarray, n: int) -> tuple[float, np.ndarray]:
    """L(c) = mean_t err_t(c)·‖c‖² (scale-free) and its gradient, from ∂c̄/∂c_j = −x^j·c̄².

    With w_s = (n − s)/n, L₁ = Σ_s w_s β_s², ∂L₁/∂c̄_u = 2 Σ_{s≥u} w_s β_s and ∂L₁/∂c_j = −Σ_t g_t (c̄*c̄)_{t−j}.
    """
    with np.errstate(all="ignore"):
        cbar = signal.lfilter([1.0], c, np.eye(1, n).ravel())
        beta = np.cumsum(cbar)
        if not (c[0] > 0 and np.isfinite(beta).all() and np.abs(beta).max() < 1e100):
            return _UNSTABLE, -c * _UNSTABLE  # C⁻¹ blows up (c(x) has a root in the unit disc): step back
    weights = (n - np.arange(n)) / n
    l1 = float(np.dot(weights, beta**2))
    g = 2.0 * np.cumsum((weights * beta)[::-1])[::-1]
    square = signal.lfilter([1.0], c, cbar)  # (c̄ * c̄) truncated to n
    grad1 = np.array([-np.dot(g[j:], square[: n - j]) for j in range(len(c))])
    norm2 = float(np.dot(c, c))
    return l1 * norm2, grad1 * norm2 + 2.0 * l1 * c


def _log_loss_and_grad(c: np.ndarray, n: int) -> tuple[float, np.ndarray]:
    """log L(c) and its gradient: the loss spans orders of magnitude, its log is far better conditioned."""
    loss, grad = _loss_and_grad(c, n)
    return math.log(loss), grad / loss


def loss(coef: Sequence[float] | np.ndarray, n: int) -> float:
    """mean_t err_t(c)·‖c‖²: the mean prefix-sum error at unit max column norm (jax_privacy's ``loss``)."""
    c = _coefficients(coef)
    return mean_error(c, n) * float(np.dot(c, c))


def optimize_banded_toeplitz(n: int, bands: int, max_steps: int = 250) -> np.ndarray:
    """Coefficients of the b-banded Toeplitz strategy with the smallest mean prefix-sum error over ``n`` steps.

    L-BFGS on L(c) = mean_t err_t(c)·‖c‖² from the banded square root, then normalised to ‖c‖₂ = 1 (the
    max column norm, κ = 1). ``bands=1`` is the identity: DP-SGD.
    """
    if bands < 1 or n < 1:
        raise ValueError(f"need bands >= 1 and n >= 1, got bands={bands}, n={n}")
    bands = min(bands, n)
    start = bsr_coefficients(bands)
    start = start / np.linalg.norm(start)
    if bands > 1 and max_steps > 0:
        result = optimize.minimize(
            _log_loss_and_grad, start, args=(n,), jac=True, method="L-BFGS-B",
            options={"maxiter": max_steps, "ftol": 1e-15, "gtol": 1e-12},
        )  # fmt: skip
        best = np.asarray(result.x, dtype=np.float64)
        if best[0] > 0 and _loss_and_grad(best, n)[0] <= _loss_and_grad(start, n)[0]:
            start = best
    return start / np.linalg.norm(start)


def minsep_sensitivity_squared(
    coef: Sequence[float] | np.ndarray, min_sep: int, n: int, max_participations: int | None = None
) -> float:
    """‖Σ_j col_{j·b}(C)‖² over the first n rows: the L2² sensitivity of C·x when an example joins at most
    k = min(max_participations, ⌈n/b⌉) steps at least b apart (exact for coefficients ≥ 0 and non-increasing,
    whose worst pattern is 0, b, 2b, …; Kalinin & Lampert 2024, Thm 2)."""
    c = _coefficients(coef)
    k = math.ceil(n / min_sep)
    if max_participations is not None:
        k = min(k, max_participations)
    v = np.zeros(n)
    col = np.zeros(n)
    col[: min(n, len(c))] = c[:n]
    for j in range(k):
        start = j * min_sep
        v[start:] += col[: n - start]
    return float(np.dot(v, v))


# -- buffered linear Toeplitz ------------------------------------------------------------------------
@dataclass(frozen=True)
class BLTParams:
    """A BLT strategy: t₀ = 1, t_k = Σ_i ω_i θ_i^{k−1} (``buf_decay`` θ, ``output_scale`` ω)."""

    buf_decay: tuple[float, ...]
    output_scale: tuple[float, ...]

    @property
    def pillutla_score(self) -> float:
        return float(sum(w / t for w, t in zip(self.output_scale, self.buf_decay, strict=True)))


def check_blt(buf_decay: Sequence[float], output_scale: Sequence[float]) -> BLTParams:
    """Validate a BLT inside the region where its coefficients are positive and non-increasing (so the
    min-separation sensitivity is exact): 0 < θ_i < 1, ω_i > 0, Σω_i ≤ 1 (spec §1.3, pitfall P9)."""
    theta = tuple(float(t) for t in buf_decay)
    omega = tuple(float(w) for w in output_scale)
    if not theta or len(theta) != len(omega):
        raise ValueError(
            f"buf_decay and output_scale must be non-empty and of equal length, got {len(theta)} and {len(omega)}"
        )
    if not all(0.0 < t < 1.0 for t in theta):
        raise ValueError(f"every buf_decay θ must be in (0, 1), got {list(theta)}")
    if not all(w > 0.0 and math.isfinite(w) for w in omega):
        raise ValueError(f"every output_scale ω must be > 0, got {list(omega)}")
    if sum(omega) > 1.0:
        raise ValueError(
            f"Σ output_scale = {sum(omega):.6g} > 1: the BLT's coefficients would increase after t₀ = 1, and "
            "its min-separation sensitivity would no longer be exact"
        )
    return BLTParams(theta, omega)


def _blt_polynomials(blt: BLTParams) -> tuple[np.ndarray, np.ndarray]:
    """(P, Q) with C(x) = P(x)/Q(x): Q = Π(1 − θ_i x), P = Q + Σ_i ω_i x Π_{j≠i}(1 − θ_j x) (ascending powers)."""
    q = np.array([1.0])
    for t in blt.buf_decay:
        q = np.convolve(q, [1.0, -t])
    p = np.concatenate([q, [0.0]])
    for i, w in enumerate(blt.output_scale):
        rest = np.array([1.0])
        for j, t in enumerate(blt.buf_decay):
            if j != i:
                rest = np.convolve(rest, [1.0, -t])
        p[1 : 1 + len(rest)] += w * rest
    return p[: len(q)], q


def blt_coefficients(blt: BLTParams, n: int) -> np.ndarray:
    """The first ``n`` Toeplitz coefficients of the BLT: [1, Σω, Σωθ, Σωθ², …]."""
    k = np.arange(max(n - 1, 0), dtype=np.float64)
    theta = np.asarray(blt.buf_decay)[:, None]
    omega = np.asarray(blt.output_scale)[:, None]
    return np.concatenate([[1.0], (omega * theta**k).sum(axis=0)])[:n]


def blt_inverse_coefficients(blt: BLTParams, n: int) -> np.ndarray:
    """The first ``n`` coefficients of C⁻¹ = Q/P (a rational function, so O(n·m) with a recursive filter)."""
    p, q = _blt_polynomials(blt)
    return np.asarray(signal.lfilter(q, p, np.eye(1, n).ravel()), dtype=np.float64)


def blt_inverse(blt: BLTParams) -> tuple[np.ndarray, np.ndarray]:
    """(θ̂, ω̂) of C⁻¹ = 1 + Σ ω̂_i x/(1 − θ̂_i x): θ̂ are the reciprocal roots of P, ω̂ its partial fractions."""
    p, _ = _blt_polynomials(blt)
    # P(x) = Π(1 − θ̂ x): the θ̂ are the roots of x^m P(1/x) = Σ p_k x^{m−k}.
    theta_hat = np.sort(np.roots(p).real)[::-1]
    omega_hat = np.empty_like(theta_hat)
    for k, th in enumerate(theta_hat):
        x = 1.0 / th
        residue = -sum(
            w * np.prod([1.0 - t * x for j, t in enumerate(blt.buf_decay) if j != i])
            for i, w in enumerate(blt.output_scale)
        )
        others = np.prod([1.0 - t / th for j, t in enumerate(theta_hat) if j != k])
        omega_hat[k] = residue / others
    return theta_hat, omega_hat


def blt_sensitivity_squared(blt: BLTParams, n: int) -> float:
    """Single-participation sensitivity² over n steps, in closed form (Dvijotham et al. 2024, Lemma 5.3):
    1 + Σ_{i,j} ω_iω_j (1 − (θ_iθ_j)^{n−1})/(1 − θ_iθ_j) = ‖column 0 of C‖² = κ²."""
    theta = np.asarray(blt.buf_decay)
    omega = np.asarray(blt.output_scale)
    prod = np.outer(theta, theta)
    terms = np.outer(omega, omega) * (1.0 - prod ** max(n - 1, 0)) / (1.0 - prod)
    return float(1.0 + terms.sum())


def blt_prefix_sensitivities(blt: BLTParams, min_sep: int, n: int) -> np.ndarray:
    """s(t) for t = 1..n: the min-separation sensitivity² of the first t steps, k_t = ⌈t/b⌉ participations.

    s(t) = Σ_{r<t} V_{k_t}(r)² with V_k(r) = Σ_{j<k} c_{r−jb}: one cumulative sum per participation count.
    """
    c = blt_coefficients(blt, n)
    out = np.empty(n)
    v = np.zeros(n)
    for k in range(1, math.ceil(n / min_sep) + 1):
        start = (k - 1) * min_sep
        v[start:] += c[: n - start]
        cumulative = np.cumsum(v**2)
        lo, hi = (k - 1) * min_sep, min(n, k * min_sep)  # t in (lo, hi] has k_t = k
        out[lo:hi] = cumulative[lo:hi]
    return out


def _blt_loss(params: np.ndarray, m: int, n: int, min_sep: int) -> float:
    """log(s(n)·mean_err(C⁻¹)) with a barrier outside 0 < θ < 1, ω > 0, Σω < 1, Σω/θ < 1."""
    theta, omega = params[:m], params[m:]
    if (theta <= 0).any() or (theta >= 1).any() or (omega <= 0).any():
        return 1e10
    if omega.sum() >= 1.0 or (omega / theta).sum() >= 1.0:
        return 1e10
    blt = BLTParams(tuple(theta), tuple(omega))
    sens = minsep_sensitivity_squared(blt_coefficients(blt, n), min_sep, n)
    err = float(np.mean(np.cumsum(np.cumsum(blt_inverse_coefficients(blt, n)) ** 2)))
    return math.log(sens * err)


def optimize_blt(n: int, min_sep: int, num_buffers: int | None = None, max_buffers: int = 4) -> BLTParams:
    """The BLT with the smallest s(n)·mean prefix-sum error under min-separation ``min_sep``.

    Nelder-Mead from several starts in the valid region; ``num_buffers=None`` adds buffers while the loss
    improves by at least 1 % (jax_privacy's rule), up to ``max_buffers``.
    """
    counts = [num_buffers] if num_buffers is not None else list(range(1, max_buffers + 1))
    best: tuple[float, BLTParams] | None = None
    for m in counts:
        found: tuple[float, BLTParams] | None = None
        for decay in (0.99, 0.9, 0.7):
            theta0 = np.array([decay ** (2.0**i) for i in range(m)])
            omega0 = np.full(m, 0.4 / m) * theta0
            start = np.concatenate([theta0, omega0])
            result = optimize.minimize(
                _blt_loss, start, args=(m, n, min_sep), method="Nelder-Mead",
                options={"maxiter": 600 * m, "xatol": 1e-7, "fatol": 1e-10},
            )  # fmt: skip
            if found is None or result.fun < found[0]:
                x = result.x
                found = (float(result.fun), BLTParams(tuple(map(float, x[:m])), tuple(map(float, x[m:]))))
        assert found is not None
        if best is not None and num_buffers is None and found[0] > best[0] + math.log(0.99):
            break
        if best is None or found[0] < best[0]:
            best = found
    assert best is not None
    return check_blt(best[1].buf_decay, best[1].output_scale)


# -- choosing b --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BandChoice:
    """One candidate b at the run's ε, steps and batch: its calibrated σ and predicted prefix-sum error."""

    bands: int
    noise_multiplier: float
    mean_error: float
    """mean_t err_t of the optimised, normalised coefficients."""
    rmse: float
    """σ·√mean_error: the prefix-sum noise RMSE in units of the clipping bound."""
    ratio: float
    """rmse over DP-SGD's at the same ε, steps and batch (b = 1 is DP-SGD: 1.0)."""


def dpsgd_rmse(noise_multiplier: float, n: int) -> float:
    """Prefix-sum noise RMSE of DP-SGD over n steps: σ·√((n + 1)/2) (err_t = t + 1)."""
    return noise_multiplier * math.sqrt((n + 1) / 2.0)


def suggest_bands(
    num_samples: int,
    batch_size: int,
    steps: int,
    target_epsilon: float,
    delta: float,
    accountant: str = "rdp",
    max_bands: int | None = None,
    optimize_steps: int = 250,
) -> list[BandChoice]:
    """Every candidate b ∈ {1, 2, 4, …} ≤ min(N/B, steps, max_bands) with its predicted error; pick the min.

    Each candidate costs one coefficient fit and one calibration over ⌈T/b⌉ rounds at q_b = B·b/N. The
    search ranks with RDP (cheap); with ``accountant="pld"``/``"prv"`` the three best are calibrated again
    with that accountant, so the chosen b and its σ are the run's own.
    """
    from .calibrate import calibrate_noise

    limit = min(num_samples // batch_size, steps, max_bands if max_bands is not None else steps)
    candidates = [1]
    while candidates[-1] * 2 <= max(1, limit):
        candidates.append(candidates[-1] * 2)

    def choice(bands: int, acct: str, err: float) -> BandChoice:
        sigma = calibrate_noise(
            target_epsilon=target_epsilon, delta=delta, sample_rate=batch_size * bands / num_samples,
            steps=math.ceil(steps / bands), accountant=acct, tol=1e-3,
        )  # fmt: skip
        return BandChoice(bands, sigma, err, sigma * math.sqrt(err), math.nan)

    errors = {b: loss(optimize_banded_toeplitz(steps, b, optimize_steps), steps) for b in candidates}
    ranked = sorted((choice(b, "rdp", errors[b]) for b in candidates), key=lambda c: c.rmse)
    if accountant != "rdp":
        exact = {c.bands: choice(c.bands, accountant, c.mean_error) for c in ranked[:3]}
        exact.setdefault(1, choice(1, accountant, errors[1]))
        ranked = sorted(exact.values(), key=lambda c: c.rmse)
    baseline = next(c for c in ranked if c.bands == 1).rmse
    out = [
        BandChoice(c.bands, c.noise_multiplier, c.mean_error, c.rmse, c.rmse / baseline)
        for c in sorted(ranked, key=lambda c: c.bands)
    ]
    return out
