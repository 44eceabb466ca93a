"""BandMF: banded matrix factorization noise with cyclic Poisson sampling (Choquette-Choo et al., NeurIPS 2023).

The strategy C is b-banded lower-triangular Toeplitz with coefficients c₀..c_{b−1}, ‖c‖₂ = 1; the noise
of step t is σ·C_clip·z_t with z = C⁻¹w computed online from the last b−1 outputs (their Algorithm 9):

    z_t = (w_t − Σ_{j=1}^{b−1} c_j z_{t−j}) / c₀

With ``CyclicPoisson(bands=b)`` every example's steps are b apart, and the run costs exactly ⌈T/b⌉
Poisson-subsampled Gaussians of rate q_b = B·b/N (their Thm 4): the ledger records the existing
``PoissonGaussian(σ, q_b)`` once per round of b steps, at its first step, after checking the budget. b = 1
is DP-SGD. The coefficients minimise the mean prefix-sum error over the planned steps (L-BFGS from the
banded square root, ``accounting/matrix_factorization.py``), fitted at fit start.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_dp.accounting import calibrate_noise
from lightning_dp.accounting import matrix_factorization as mf
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.core.validation import number
from lightning_dp.noise.correlated import CONVENTION, CorrelatedNoise, coefficient_list
from lightning_dp.slots import Sampler

__all__ = ["BandMF"]

#: Default cap on the b−1 parameter-sized fp32 buffers when ``bands="auto"`` chooses b (1 GiB).
MAX_BUFFER_BYTES = 1 << 30


class BandMF(CorrelatedNoise):
    """Banded matrix-factorization noise: b−1 parameter-sized buffers, ⌈T/b⌉ ledger events, never worse than DP-SGD.

    Args:
        noise_multiplier: σ relative to unit max column norm (the noise std is σ·C·‖row of C⁻¹‖ per step);
            None: calibrated from ``target_epsilon`` over ⌈T/b⌉ rounds.
        coefficients: c₀..c_{b−1} (normalised to ‖c‖₂ = 1); their number must equal the sampler's bands.
            None: optimised for the planned steps at fit start.
        optimize_steps: L-BFGS iterations of that fit.
        max_buffer_bytes: the largest (b−1)·d·4 bytes ``CyclicPoisson(bands="auto")`` may choose.

    Use with ``CyclicPoisson(bands=b)`` (or ``"auto"``): b comes from the sampler, one source of truth.
    """

    def __init__(
        self,
        noise_multiplier: float | None = None,
        coefficients: Sequence[float] | None = None,
        optimize_steps: int = 250,
        max_buffer_bytes: int = MAX_BUFFER_BYTES,
    ) -> None:
        super().__init__(noise_multiplier)
        number(optimize_steps, "optimize_steps", owner="BandMF", low=0, integer=True)
        number(max_buffer_bytes, "max_buffer_bytes", owner="BandMF", low=0, integer=True)
        self.given = coefficients is not None
        self.coefficients: np.ndarray | None = None
        if coefficients is not None:
            c = np.asarray(coefficients, dtype=np.float64).ravel()
            if c.size == 0 or not np.isfinite(c).all() or c[0] <= 0:
                raise ValueError(f"BandMF coefficients must be finite with c₀ > 0, got {list(coefficients)}")
            self.coefficients = c / np.linalg.norm(c)
        self.optimize_steps, self.max_buffer_bytes = optimize_steps, max_buffer_bytes
        self.horizon: int | None = None
        self.choices: list[mf.BandChoice] = []
        self.target_epsilon: float | None = None
        self._weights: Tensor | None = None

    # -- wiring ---------------------------------------------------------------------------------------
    def link_sampler(self, sampler: Sampler) -> None:
        super().link_sampler(sampler)
        if self.coefficients is None:
            return
        if sampler.bands == "auto":
            raise DPConfigurationError(
                f"BandMF was given {len(self.coefficients)} coefficients, so b = {len(self.coefficients)} is fixed; "
                f"CyclicPoisson(bands='auto') would choose another. Use CyclicPoisson(bands={len(self.coefficients)})."
            )
        if sampler.bands != len(self.coefficients):
            raise DPConfigurationError(
                f"BandMF was given {len(self.coefficients)} coefficients (a {len(self.coefficients)}-banded strategy) but "
                f"the sampler {sampler.name} has bands={sampler.bands}: the ledger prices ⌈T/b⌉ rounds of the sampler's "
                "b, which is exact only when the strategy has exactly b bands. Give as many coefficients as bands "
                "(CyclicPoisson(bands=len(coefficients)))."
            )

    @property
    def steps_per_event(self) -> int:
        bands = self._sampler().bands
        return bands if isinstance(bands, int) else 1

    # -- calibration and fitting ----------------------------------------------------------------------
    def calibrate(
        self, target_epsilon: float, delta: float, sampler: Sampler, steps: int, accountant: str
    ) -> None:
        """Choose b if "auto", then the smallest σ whose ⌈T/b⌉ rounds at q_b spend at most the target."""
        self.target_epsilon = target_epsilon
        if sampler.bands == "auto":
            self._choose_bands(target_epsilon, delta, sampler, steps, accountant)
        bands = self._bands()
        self.sigma = calibrate_noise(
            target_epsilon=target_epsilon, delta=delta, sample_rate=sampler.sample_rate,
            steps=math.ceil(steps / bands), accountant=accountant,
        )  # fmt: skip
        self._fit(steps)
        self.dpsgd_sigma = self._dpsgd_reference(target_epsilon, steps, delta, accountant)

    def _choose_bands(
        self, target: float, delta: float, sampler: Sampler, steps: int, accountant: str
    ) -> None:
        cap = None
        if self.num_params > 0:
            cap = 1 + self.max_buffer_bytes // (4 * self.num_params)
        self.choices = mf.suggest_bands(
            sampler.size_for_releases, int(sampler.expected_batch_size), steps, target, delta, accountant,
            max_bands=cap, optimize_steps=self.optimize_steps,
        )  # fmt: skip
        best = min(self.choices, key=lambda c: c.rmse)
        sampler.choose_bands(best.bands)

    def _fit(self, steps: int) -> None:
        """The coefficients for ``steps`` steps and the sampler's b (kept when given)."""
        self.horizon = steps
        if self.coefficients is None or (not self.given and len(self.coefficients) != self._bands()):
            self.coefficients = mf.optimize_banded_toeplitz(steps, self._bands(), self.optimize_steps)

    def _coefficients(self) -> np.ndarray:
        if self.coefficients is None and self._bands() == 1:
            self.coefficients = np.ones(1)  # b = 1 is DP-SGD whatever the horizon (Poisson has none)
        if self.coefficients is None:
            self._fit(self._horizon())
        assert self.coefficients is not None
        return self.coefficients

    # -- the recursion --------------------------------------------------------------------------------
    def _buffer_count(self) -> int:
        return len(self._coefficients()) - 1

    def _begin_step(self) -> None:
        """The ring's weights this step: row (t − j) mod (b − 1) holds z_{t−j}, weighted by c_j."""
        c = self._coefficients()
        rows = len(c) - 1
        weights = torch.zeros(rows, dtype=torch.float32)
        for j in range(1, rows + 1):
            weights[(self.local_step - j) % rows] = float(c[j] / c[0])
        self._weights = weights

    def _correlate(self, index: int, part: slice, w: Tensor) -> Tensor:
        c0 = float(self._coefficients()[0])
        assert self.buffers is not None
        assert self._weights is not None
        buf = self.buffers[index]
        if buf.shape[0] == 0:
            return w / c0 if c0 != 1.0 else w
        window = buf[:, part]
        # z = w/c₀ − Σ_j (c_j/c₀) z_{t−j}: one fused matrix-vector product over the ring
        z = torch.addmv(w, window.t(), self._weights.to(w.device), beta=1.0 / c0, alpha=-1.0)
        window[self.local_step % buf.shape[0]].copy_(z)
        return z

    # -- state ----------------------------------------------------------------------------------------
    def _strategy_state(self) -> dict[str, Any]:
        coef = self.coefficients
        return {"coefficients": None if coef is None else coefficient_list(coef), "horizon": self.horizon}

    def _load_strategy(self, state: dict[str, Any]) -> None:
        saved = state.get("coefficients")
        if saved is None:
            return
        saved_c = np.asarray(saved, dtype=np.float64)
        if self.given and (
            self.coefficients is None
            or len(saved_c) != len(self.coefficients)
            or not np.allclose(saved_c, self.coefficients, rtol=1e-12, atol=0)
        ):
            raise ValueError(
                "The checkpoint was trained with other BandMF coefficients: a run has one strategy matrix. "
                "Resume with BandMF() (the checkpoint's coefficients) or the same coefficients."
            )
        self.coefficients = saved_c
        self.horizon = state.get("horizon")

    # -- reporting ------------------------------------------------------------------------------------
    def _ratio(self) -> float | None:
        if self.coefficients is None or self.sigma is None or self.horizon is None:
            return None
        rmse = self.sigma * math.sqrt(mf.loss(self.coefficients, self.horizon))
        return self._predicted_ratio(rmse, self.horizon)

    def describe(self) -> str | None:
        bands, sampler = self._bands(), self._sampler()
        steps = self.horizon or sampler.horizon
        sigma = f"{self.sigma:.4g}" if self.sigma is not None else "?"
        rounds = f"{math.ceil(steps / bands)} rounds" if steps else "rounds"
        line = f"BandMF b={bands}, σ={sigma} over {rounds} of {bands} steps (q_b={sampler.sample_rate:.4g})"
        ratio = self._ratio()
        if ratio is not None:
            line += f"; predicted RMSE {ratio:.2f}× DP-SGD"
        if self.choices:
            line += (
                " (bands='auto' from " + ", ".join(f"b={c.bands}: {c.ratio:.3f}" for c in self.choices) + ")"
            )
        return line

    def report(self) -> dict[str, Any] | None:
        bands = self._bands()
        coef = self._coefficients()
        steps = self.horizon or self._sampler().horizon or max(self.steps_taken, 1)
        return {
            "strategy": "banded_toeplitz",
            "bands": bands,
            "steps_per_event": bands,
            "coefficients": coefficient_list(coef),
            "column_norm": float(np.linalg.norm(coef)),
            "noise_multiplier_convention": CONVENTION,
            "participation": "cyclic_poisson(independent groups)",
            "planned_steps": steps,
            "rounds": math.ceil(max(self.steps_taken, 1) / bands),
            "accounting": "Choquette-Choo et al. 2023 Thm 4: ceil(T/b) x PoissonGaussian(sigma, q_b)",
            "realized_noise_std_factor": self._row_norms(mf.inverse_coefficients(coef, max(steps, 1))),
            "predicted_rmse_vs_dpsgd": self._ratio(),
            "bands_search": [
                {"bands": c.bands, "noise_multiplier": c.noise_multiplier, "ratio": c.ratio}
                for c in self.choices
            ],
            "resets": list(self.resets),
            "buffer_bytes": 4 * (bands - 1) * self.num_params,
        }
