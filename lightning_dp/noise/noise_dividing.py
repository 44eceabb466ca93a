"""Noise dividing (Kuru et al. 2020, Prop. 4.2): a per-step noise schedule that spends more budget late.

The error bound of noisy NAG/MASG weighs step k's noise variance by a_{T,k}, which grows with k (later
noise has less time to contract). Minimising Σ a_{T,k}·Var_k under the budget gives, per mode:

- ``privacy="paper"`` (pure ε-DP, Laplace, fixed-size sampling, basic composition): ε_k = π_k ε with
  π_k ∝ a_{T,k}^{1/3}, each step's Laplace scale the exact inverse of eq. 11, so Σ ε_k = ε.
- ``privacy="gaussian_rdp"`` (default; Poisson sampling, RDP ledger): σ_k = z̄ · a_{T,k}^{−1/4} (the zCDP
  optimum, spec §3.6), with the global scale z̄ found by bisection so the ledger's ε meets the target
  from below.

``uniform=True`` gives every step the same share (DP-SGD calibration; DP-GD, DP-HB and uniform DP-NAG).
The weights come from the step slot (:class:`~lightning_dp.steps.dp_accelerated.Nesterov` or
``MultiStageNesterov``) or, for any step, from ``momentum`` (a_{T,k} ∝ q^{T−k}, q = 2β/(1+β)). The
horizon T is the trainer's planned number of steps; the schedule cannot be built without it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from lightning_dp.accounting import PoissonGaussian, PrivacyLedger
from lightning_dp.accounting.subsampled_laplace import laplace_multiplier, subsampled_laplace_epsilon
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.core.validation import flag, number
from lightning_dp.slots import Noise, Sampler, Step

__all__ = ["NoiseDividing", "allocation_shares", "gaussian_schedule", "laplace_schedule", "select_horizon"]

Privacy = Literal["gaussian_rdp", "paper"]
_GRID_LOG = math.log(1.01)


def allocation_shares(log_weights: np.ndarray, exponent: float = 1.0 / 3.0) -> np.ndarray:
    """π_k = a_k^{exponent} / Σ_j a_j^{exponent}, in log space (a_{T,k} underflows for large T)."""
    z = exponent * np.asarray(log_weights, dtype=np.float64)
    z = z - z.max()
    w = np.exp(z)
    return w / w.sum()


def laplace_schedule(shares: np.ndarray, target_epsilon: float, sample_rate: float) -> np.ndarray:
    """Per-step Laplace multipliers σ_k (scale = σ_k × L1 sensitivity) with Σ_k ε_k = target, never above.

    ε_k = π_k·ε, inverted exactly through eq. 11; the budget is shrunk by a few ulps when floating-point
    rounding would put the recomputed sum above the target.
    """
    budget = float(target_epsilon)
    for _ in range(60):
        sigmas = np.array([laplace_multiplier(budget * pi, sample_rate) for pi in shares])
        spent = math.fsum(subsampled_laplace_epsilon(float(s), sample_rate) for s in sigmas)
        if spent <= target_epsilon:
            return sigmas
        budget *= 1 - 4e-16 * len(shares)
    raise RuntimeError("could not fit the Laplace schedule under the target")  # pragma: no cover


def _ledger_epsilon(sigmas: np.ndarray, sample_rate: float, delta: float, accountant: str) -> float:
    ledger = PrivacyLedger(delta, accountant)  # type: ignore[arg-type]
    for sigma in sigmas:
        ledger.record(PoissonGaussian(float(sigma), sample_rate))
    return ledger.epsilon()


def gaussian_schedule(
    shape: np.ndarray,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    accountant: str = "rdp",
    rel_tol: float = 2e-4,
) -> np.ndarray:
    """σ_k = z̄·shape_k with the global scale z̄ bisected so the ledger's ε is ≤ target and within ~``rel_tol``.

    Every trial prices the whole heterogeneous schedule with the library's ledger, so what is planned
    is what the ledger records. Each new σ costs one subsampled-Gaussian RDP evaluation (~50 ms), so the
    search first runs on σ rounded down to a 1 % geometric grid (values shared between trials), then
    refines z̄ on the exact schedule inside the bracket that this leaves (a few regula-falsi steps in
    log z̄). The returned schedule was priced and never exceeds the target.
    """
    shape = np.asarray(shape, dtype=np.float64)
    target = float(target_epsilon)

    def snapped(scale: float) -> np.ndarray:
        return np.exp(np.floor(np.log(scale * shape) / _GRID_LOG) * _GRID_LOG)

    def eps(sigmas: np.ndarray) -> float:
        return _ledger_epsilon(sigmas, sample_rate, delta, accountant)

    lo, hi = 0.5, 1.0
    while eps(snapped(hi)) > target:
        lo, hi = hi, hi * 2
        if hi > 1e5:
            raise ValueError(
                f"target_epsilon={target:g} cannot be met with {len(shape)} steps at sample rate "
                f"{sample_rate:g}: use fewer steps, a smaller batch or a larger target."
            )
    while eps(snapped(lo)) <= target:
        lo, hi = lo / 2, lo
        if hi < 1e-6:
            return snapped(hi)
    while hi / lo > math.exp(_GRID_LOG):
        mid = math.sqrt(lo * hi)
        if eps(snapped(mid)) <= target:
            hi = mid
        else:
            lo = mid
    return _refined(shape, snapped, eps, lo, hi, target, rel_tol)


def _refined(
    shape: np.ndarray,
    snapped: Callable[[float], np.ndarray],
    eps: Callable[[np.ndarray], float],
    lo: float,
    hi: float,
    target: float,
    rel_tol: float,
) -> np.ndarray:
    """The exact schedule z̄·shape refined inside the grid's bracket [lo, hi] by a few regula-falsi steps in
    log z̄: the best one priced that fits (the snapped schedule at ``hi`` if none is closer to the target)."""
    # Exact schedule: σ ≥ snapped at hi (fits); at lo/1.01 σ ≤ snapped(lo) (does not fit).
    best = snapped(hi)
    best_eps = eps(best)
    x_lo, x_hi = math.log(lo) - _GRID_LOG, math.log(hi)
    f_lo, f_hi = eps(snapped(lo)) - target, best_eps - target
    for _ in range(4):
        if target - best_eps <= rel_tol * target or f_lo <= f_hi:
            break
        x = x_hi - f_hi * (x_hi - x_lo) / (f_hi - f_lo)
        x = min(max(x, x_lo + 0.05 * (x_hi - x_lo)), x_hi - 0.05 * (x_hi - x_lo))
        candidate = math.exp(x) * shape
        f = eps(candidate) - target
        if f <= 0:
            x_hi, f_hi = x, f
            if f + target > best_eps:
                best, best_eps = candidate, f + target
        else:
            x_lo, f_lo = x, f
    return best


def select_horizon(
    log_weights: Callable[[int], np.ndarray],
    log_a0: Callable[[int], float],
    max_horizon: int,
    initial_error: float,
    dim: int,
    l1_sensitivity: float,
    num_samples: int,
    epsilon: float,
) -> int:
    """Remark 4.1 (eq. 32): T* = argmin_{T' ≤ T} a_{T',0} E_0 + d (S1/(nε))² (Σ_k a_{T',k}^{1/3})³.

    An offline planning utility for convex problems with known μ, L (the "-opt" variants); the
    full-batch bound is used for every batch size, as in the authors' code.
    """
    best, best_value = 1, math.inf
    for horizon in range(1, max_horizon + 1):
        logs = log_weights(horizon) / 3.0
        top = logs.max()
        log_sum = top + math.log(np.exp(logs - top).sum())
        value = math.exp(log_a0(horizon)) * initial_error + dim * (
            l1_sensitivity / (num_samples * epsilon)
        ) ** 2 * math.exp(3 * log_sum)
        if value < best_value:
            best, best_value = horizon, value
    return best


class NoiseDividing(Noise):
    """Per-step noise σ_k from the noise-dividing allocation, calibrated over the planned horizon T.

    Args:
        privacy: ``"gaussian_rdp"`` (Gaussian noise, Poisson sampling, RDP/PRV ledger) or ``"paper"``
            (Laplace noise of scale σ_k·S1, fixed-size sampling without replacement, L1 clipping, pure
            ε-DP by basic composition: use ``FixedSize()``, ``L1Clipping()`` and ``accountant="pure"``).
        uniform: the same share at every step (DP-SGD/DP-GD/DP-HB calibration) instead of a_{T,k}.
        momentum: take the weights a_{T,k} ∝ q^{T−k}, q = 2β/(1+β), from this β instead of the step slot.
        exponent: allocation exponent; default 1/3 (Laplace, on ε_k) or 1/4 (Gaussian, σ_k ∝ a^{−1/4}).
    """

    def __init__(
        self,
        privacy: Privacy = "gaussian_rdp",
        uniform: bool = False,
        momentum: float | None = None,
        exponent: float | None = None,
    ) -> None:
        if privacy not in ("gaussian_rdp", "paper"):
            raise ValueError(f"privacy must be 'gaussian_rdp' or 'paper', got {privacy!r}")
        flag(uniform, "uniform", owner="NoiseDividing")
        number(
            momentum,
            "momentum",
            owner="NoiseDividing",
            low=0,
            high=1,
            low_open=True,
            high_open=True,
            optional=True,
        )
        number(exponent, "exponent", owner="NoiseDividing", low=0, low_open=True, optional=True)
        self.privacy: Privacy = privacy
        self.mechanism = "laplace" if privacy == "paper" else "gaussian"
        self.uniform = uniform
        self.momentum = momentum
        self.exponent = exponent if exponent is not None else (1 / 3 if privacy == "paper" else 1 / 4)
        self.sigmas: list[float] | None = None
        self.horizon: int | None = None
        self._saved: dict[str, Any] | None = None
        self._step_slot: Step | None = None

    # -- wiring --------------------------------------------------------------------------------
    def link_step(self, step: Step) -> None:
        """The engine hands over the step slot, whose error bound gives the weights a_{T,k}."""
        self._step_slot = step

    def log_weights(self, horizon: int) -> np.ndarray:
        """log a_{T,k}, k = 1..T (zeros when uniform)."""
        if self.uniform:
            return np.zeros(horizon)
        if self.momentum is not None:
            q = 2 * self.momentum / (1 + self.momentum)
            return (horizon - np.arange(1, horizon + 1)) * math.log(q)
        logs = self._step_slot.noise_log_weights(horizon) if self._step_slot is not None else None
        if logs is None:
            raise DPConfigurationError(
                f"NoiseDividing needs the weights a_T,k of a Nesterov or MultiStageNesterov step; the step slot "
                f"is {type(self._step_slot).__name__}. Give NoiseDividing(momentum=β) or uniform=True."
            )
        return np.asarray(logs, dtype=np.float64)

    # -- the Noise slot --------------------------------------------------------------------------
    @property
    def is_set(self) -> bool:
        return self.sigmas is not None

    def noise_multiplier(self, step: int) -> float:
        if self.sigmas is None:
            raise RuntimeError(
                "NoiseDividing is calibrated at fit start from target_epsilon and the horizon."
            )
        return self.sigmas[min(step, len(self.sigmas) - 1)]

    def calibrate(
        self, target_epsilon: float, delta: float, sampler: Sampler, steps: int, accountant: str
    ) -> None:
        expected = "pure" if self.privacy == "paper" else None
        if (accountant == "pure") != (expected == "pure"):
            raise ValueError(
                f"privacy={self.privacy!r} is priced with accountant={'pure' if expected else 'rdp or prv'}, "
                f"got accountant={accountant!r}"
            )
        shares = allocation_shares(self.log_weights(steps), self.exponent)
        if self.privacy == "paper":
            sigmas = laplace_schedule(shares, target_epsilon, sampler.sample_rate)
        else:
            # zCDP optimum: σ_k ∝ a_k^{-1/4}; with the shares π ∝ a^{1/4} that is σ_k ∝ π_k^{-1}·(const)
            shape = (shares / shares.max()) ** -1.0 if not self.uniform else np.ones(steps)
            sigmas = gaussian_schedule(shape, target_epsilon, delta, sampler.sample_rate, accountant)
        planned = [float(s) for s in sigmas]
        if self._saved is not None and self._saved.get("sigmas") is not None:
            saved = self._saved["sigmas"]
            if len(saved) != len(planned) or not np.allclose(saved, planned, rtol=1e-9):
                raise ValueError(
                    f"the checkpoint's noise schedule was planned for T={len(saved)} steps and differs from this "
                    f"run's (T={len(planned)}); resume with the same horizon, batch size and target_epsilon"
                )
            planned = list(saved)
        self.sigmas, self.horizon = planned, steps
        _warn_if_early_steps_drown(planned)

    def add_noise(self, sums: list[Tensor], std: float, generator: torch.Generator) -> list[Tensor]:
        """Gaussian of std ``std``, or in paper mode Laplace of **scale** ``std`` (variance 2·scale²)."""
        if self.privacy != "paper":
            return super().add_noise(sums, std, generator)
        return [s + laplace_noise(s.shape, std, generator, s.device, s.dtype) for s in sums]

    def state_dict(self) -> dict[str, Any]:
        return {"sigmas": self.sigmas, "horizon": self.horizon, "privacy": self.privacy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("privacy", self.privacy) != self.privacy:
            raise ValueError(f"the checkpoint used privacy={state['privacy']!r}, this run {self.privacy!r}")
        self._saved = dict(state)


def _warn_if_early_steps_drown(sigmas: list[float], max_spread: float = 3.0) -> None:
    """The allocation is optimal for the error bound of a strongly convex loss; elsewhere say what it costs."""
    spread = max(sigmas) / min(sigmas) if sigmas and min(sigmas) > 0 else 1.0
    if spread > max_spread:
        warnings.warn(
            f"NoiseDividing's schedule gives the noisiest step σ = {max(sigmas):.3g}, {spread:.3g}× the "
            f"quietest ({min(sigmas):.3g}) over T = {len(sigmas)} steps: it spends the budget where the error "
            "bound of a strongly convex loss weighs noise most (late steps). On other losses, neural networks "
            "included, the noisy steps are mostly noise. Use NoiseDividing(uniform=True), a smaller momentum, "
            "or fewer steps.",
            stacklevel=3,
        )


def laplace_noise(
    shape: torch.Size | tuple[int, ...],
    scale: float,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Zero-mean Laplace noise of scale b (density e^{−|u|/b}/(2b), std √2·b), by inverse CDF.

    The authors' MATLAB ``laprnd(d, 1, b)`` treats b as the standard deviation (√2 less noise than the
    privacy proof assumes); here b is the scale, as in the proof.
    """
    if scale == 0.0:
        return torch.zeros(shape, device=device, dtype=dtype)
    u = torch.rand(shape, generator=generator, device=device, dtype=torch.float64) - 0.5
    tail = (1.0 - 2.0 * u.abs()).clamp(min=torch.finfo(torch.float64).tiny)  # u = -0.5 would give -inf
    sample = -scale * torch.sign(u) * torch.log(tail)
    return sample.to(dtype)
