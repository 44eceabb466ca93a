"""BLT: buffered linear Toeplitz noise (Dvijotham et al., FOCS 2024; McMahan & Pillutla 2025), unamplified.

The strategy C is Toeplitz with t₀ = 1 and t_k = Σ_i ω_i θ_i^{k−1}; its inverse runs online on m
parameter-sized buffers, with C's own (θ, ω) (McMahan et al. 2024, Algorithm 3):

    z_t = w_t − Σ_i ω_i S_i ;   S_i ← θ_i S_i + z_t

and the noise of step t is σ·C_clip·κ·z_t, κ = max column norm of C over the planned steps. No
amplification by sampling is claimed: with ``CyclicPoisson(bands=b)`` every example's steps are at least
b apart, so the first t steps have sensitivity² s(t) = ‖Σ_j col_{jb}‖² (exact for the positive,
non-increasing coefficients the valid region gives; Kalinin & Lampert 2024, Thm 2). Step t records
``Gaussian(σκ/√(s(t+1) − s(t)))``: the Gaussians compose to μ = √s(T)/(σκ) exactly, under every accountant.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from lightning_dp.accounting import Gaussian, PrivacyEvent, calibrate_noise
from lightning_dp.accounting import matrix_factorization as mf
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.core.validation import number
from lightning_dp.noise.correlated import CONVENTION, CorrelatedNoise, coefficient_list
from lightning_dp.slots import Sampler

__all__ = ["BLT"]

#: Relative margin on s(T) when calibrating σ: the per-step increments add up to s(T) only up to rounding.
_SUM_MARGIN = 1e-9


class BLT(CorrelatedNoise):
    """Buffered-linear-Toeplitz noise: m parameter-sized buffers, priced as an unamplified Gaussian.

    Args:
        noise_multiplier: σ relative to unit max column norm (std σ·C·κ·z_t); None: calibrated from
            ``target_epsilon``.
        buf_decay: θ, one decay per buffer (0 < θ < 1); None (default): optimised at fit start for the
            planned steps and the sampler's bands, together with ``output_scale``.
        output_scale: ω, one scale per buffer (ω > 0, Σω ≤ 1); None (default): optimised with ``buf_decay``.
        num_buffers: m when optimising ("auto": add buffers while the error improves by 1 %, up to 4).

    BLT claims no amplification by sampling, so at small ε it is predicted to lose to DP-SGD (a warning at
    fit start says so); BandMF with ``CyclicPoisson(bands="auto")`` never does. Choose BLT only when b−1
    model-sized buffers do not fit. ``CyclicPoisson(bands="auto")`` takes b = ⌊N/B⌋, the widest separation.
    """

    def __init__(
        self,
        noise_multiplier: float | None = None,
        buf_decay: Sequence[float] | None = None,
        output_scale: Sequence[float] | None = None,
        num_buffers: int | Literal["auto"] = "auto",
    ) -> None:
        super().__init__(noise_multiplier)
        if (buf_decay is None) != (output_scale is None):
            raise ValueError(
                "BLT needs both buf_decay and output_scale, or neither (then they are optimised)."
            )
        self.blt: mf.BLTParams | None = None
        if buf_decay is not None and output_scale is not None:
            self.blt = mf.check_blt(buf_decay, output_scale)
        if num_buffers != "auto":
            number(num_buffers, "num_buffers", owner="BLT", low=1, integer=True)
        self.num_buffers = num_buffers
        self.given = self.blt is not None
        self.horizon: int | None = None
        self.kappa: float | None = None
        self._prefix = np.zeros(0)
        self._theta: Tensor | None = None
        self._omega: Tensor | None = None

    # -- fitting ----------------------------------------------------------------------------------------
    def _fit(self, steps: int) -> None:
        self.horizon = steps
        if self.blt is None:
            count = None if self.num_buffers == "auto" else int(self.num_buffers)
            self.blt = mf.optimize_blt(steps, self._bands(), num_buffers=count)
        self.kappa = math.sqrt(mf.blt_sensitivity_squared(self.blt, steps))
        self._prefix = np.zeros(0)

    def _params(self) -> mf.BLTParams:
        if self.blt is None or self.kappa is None:
            self._fit(self._horizon())
        assert self.blt is not None
        return self.blt

    def _scale(self) -> float:
        self._params()
        assert self.kappa is not None
        return self.kappa

    def sensitivity_squared(self, steps: int) -> float:
        """s(t): the min-separation sensitivity² of the first ``steps`` steps (0 for none)."""
        if steps <= 0:
            return 0.0
        if len(self._prefix) < steps:
            self._prefix = mf.blt_prefix_sensitivities(
                self._params(), self._bands(), max(steps, 2 * len(self._prefix), self.horizon or 0)
            )
        return float(self._prefix[steps - 1])

    # -- accounting -------------------------------------------------------------------------------------
    def step_event(self, step: int, sampler: Sampler, noise_multiplier: float) -> PrivacyEvent | None:
        """Gaussian(σκ/√Δ_t), Δ_t = s(t+1) − s(t): what step t adds to the unamplified Gaussian's μ²."""
        del sampler
        increment = self.sensitivity_squared(step + 1) - self.sensitivity_squared(step)
        return Gaussian(noise_multiplier * self._scale() / math.sqrt(increment))

    def calibrate(
        self, target_epsilon: float, delta: float, sampler: Sampler, steps: int, accountant: str
    ) -> None:
        """b = ⌊N/B⌋ if "auto"; then the σ whose Gaussian of μ = √s(T)/(σκ) spends at most the target."""
        if sampler.bands == "auto":
            sampler.choose_bands(
                max(1, min(sampler.size_for_releases // int(sampler.expected_batch_size), steps))
            )
        self._fit(steps)
        # One Gaussian with the whole run's sensitivity: the same ε the ledger reads from the T increments.
        unit = calibrate_noise(
            target_epsilon=target_epsilon,
            delta=delta,
            sample_rate=1.0,
            steps=1,
            accountant=accountant,
            tol=1e-4,
        )
        assert self.kappa is not None
        self.sigma = unit * math.sqrt(self.sensitivity_squared(steps) * (1 + _SUM_MARGIN)) / self.kappa
        self.dpsgd_sigma = self._dpsgd_reference(target_epsilon, steps, delta, accountant)
        ratio = self._ratio()
        if ratio is not None and ratio > 1.0:
            warnings.warn(
                f"BLT is predicted to add {ratio:.2f}× DP-SGD's prefix-sum noise at ε={target_epsilon:g} over {steps} "
                "steps: it claims no amplification by sampling. BandMF with CyclicPoisson(bands='auto') is never "
                "predicted worse than DP-SGD; use BLT only when BandMF's b−1 model-sized buffers do not fit.",
                stacklevel=2,
            )

    # -- the recursion ------------------------------------------------------------------------------------
    def _buffer_count(self) -> int:
        return len(self._params().buf_decay)

    def _begin_step(self) -> None:
        blt = self._params()
        self._theta = torch.tensor(blt.buf_decay, dtype=torch.float32)
        self._omega = torch.tensor(blt.output_scale, dtype=torch.float32)

    def _correlate(self, index: int, part: slice, w: Tensor) -> Tensor:
        assert self.buffers is not None
        assert self._theta is not None
        assert self._omega is not None
        window = self.buffers[index][:, part]
        z = torch.addmv(w, window.t(), self._omega.to(w.device), alpha=-1.0)  # w − Σ ω_i S_i, fused
        window.mul_(self._theta.to(w.device)[:, None]).add_(z)
        return z

    # -- state --------------------------------------------------------------------------------------------
    def _strategy_state(self) -> dict[str, Any]:
        blt = self.blt
        return {
            "buf_decay": None if blt is None else list(blt.buf_decay),
            "output_scale": None if blt is None else list(blt.output_scale),
            "horizon": self.horizon,
            "bands": self.sampler.bands if self.sampler is not None else None,
        }

    def _load_strategy(self, state: dict[str, Any]) -> None:
        theta, omega = state.get("buf_decay"), state.get("output_scale")
        if theta is None or omega is None:
            return
        saved = mf.check_blt(theta, omega)
        if (
            self.given
            and self.blt is not None
            and not (
                np.allclose(saved.buf_decay, self.blt.buf_decay, rtol=1e-12, atol=0)
                and np.allclose(saved.output_scale, self.blt.output_scale, rtol=1e-12, atol=0)
            )
        ):
            raise ValueError(
                "The checkpoint was trained with another BLT (buf_decay, output_scale): a run has one strategy "
                "matrix. Resume with BLT() (the checkpoint's) or the same parameters."
            )
        self.blt = saved
        horizon = state.get("horizon")
        if horizon is not None:
            self.horizon = int(horizon)
            self.kappa = math.sqrt(mf.blt_sensitivity_squared(saved, self.horizon))
        self._prefix = np.zeros(0)

    def link_sampler(self, sampler: Sampler) -> None:
        super().link_sampler(sampler)
        if sampler.bands == 1:
            raise DPConfigurationError(
                f"BLT with {sampler.name}(bands=1): an example may join every step, so the unamplified BLT would pay "
                "for all T participations. Use CyclicPoisson(bands=b) with b > 1 (bands='auto' takes b = ⌊N/B⌋)."
            )

    # -- reporting ----------------------------------------------------------------------------------------
    def _ratio(self) -> float | None:
        if self.sigma is None or self.horizon is None or self.kappa is None:
            return None
        inverse = mf.blt_inverse_coefficients(self._params(), self.horizon)
        err = float(np.mean(np.cumsum(np.cumsum(inverse) ** 2)))
        return self._predicted_ratio(self.sigma * self.kappa * math.sqrt(err), self.horizon)

    def _mu(self, steps: int) -> float:
        if self.sigma is None or self.sigma == 0:
            return math.inf
        return math.sqrt(self.sensitivity_squared(steps)) / (self.sigma * self._scale())

    def describe(self) -> str | None:
        blt, sampler = self._params(), self._sampler()
        steps = self.horizon or self._horizon()
        sigma = f"{self.sigma:.4g}" if self.sigma is not None else "?"
        line = (
            f"BLT m={len(blt.buf_decay)}, σ={sigma} (κ={self.kappa:.4g}), min separation b={self._bands()} "
            f"(q_b={sampler.sample_rate:.4g}), unamplified: μ={self._mu(steps):.4g} over {steps} steps"
        )
        ratio = self._ratio()
        if ratio is not None:
            line += f"; predicted RMSE {ratio:.2f}× DP-SGD"
        return line

    def report(self) -> dict[str, Any] | None:
        blt = self._params()
        steps = self.horizon or self._horizon()
        done = max(self.steps_taken, 1)
        theta_hat, omega_hat = mf.blt_inverse(blt)
        return {
            "strategy": "blt",
            "bands": self._bands(),
            "steps_per_event": 1,
            "buf_decay": coefficient_list(blt.buf_decay),
            "output_scale": coefficient_list(blt.output_scale),
            "inverse_buf_decay": coefficient_list(theta_hat),
            "inverse_output_scale": coefficient_list(omega_hat),
            "column_norm": self.kappa,
            "noise_multiplier_convention": CONVENTION,
            "participation": "cyclic_poisson(independent groups)",
            "planned_steps": steps,
            "accounting": "unamplified Gaussian, b-min-sep, ceil(t/b) participations",
            "sensitivity_squared": self.sensitivity_squared(done),
            "mu": self._mu(done),
            "realized_noise_std_factor": self._row_norms(mf.blt_inverse_coefficients(blt, max(steps, 1))),
            "predicted_rmse_vs_dpsgd": self._ratio(),
            "resets": list(self.resets),
            "buffer_bytes": 4 * len(blt.buf_decay) * self.num_params,
        }
