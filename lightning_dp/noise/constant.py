"""Constant noise multiplier: given directly, or calibrated from a target ε over the planned steps."""

from __future__ import annotations

import warnings
from typing import Any

from lightning_dp.accounting import calibrate_noise
from lightning_dp.core.validation import number
from lightning_dp.slots import Noise, Sampler


class FixedSigma(Noise):
    """A noise slot whose σ is one number for every step (``sigma``), None until it is given or calibrated:
    DP-SGD's constant noise, correlated noise (its correlation is in the draws, not in σ), secure noise."""

    sigma: float | None

    @property
    def is_set(self) -> bool:
        return self.sigma is not None

    def noise_multiplier(self, step: int) -> float:
        if self.sigma is None:
            raise RuntimeError("The noise multiplier is not set: give noise_multiplier or target_epsilon.")
        return self.sigma


class ConstantNoise(FixedSigma):
    """The same σ at every step (DP-SGD). ``calibrate`` picks the smallest σ that stays under target.

    Args:
        noise_multiplier: σ, the noise std relative to the clipping's sensitivity C (≥ 0); None (default):
            calibrated from the strategy's ``target_epsilon`` over the planned steps.
    """

    is_constant = True

    def __init__(self, noise_multiplier: float | None = None) -> None:
        number(noise_multiplier, "noise_multiplier", owner="ConstantNoise", low=0, optional=True)
        self.sigma = noise_multiplier

    def calibrate(
        self, target_epsilon: float, delta: float, sampler: Sampler, steps: int, accountant: str
    ) -> None:
        self.sigma = calibrate_noise(
            target_epsilon=target_epsilon,
            delta=delta,
            sample_rate=sampler.sample_rate,
            steps=steps,
            accountant=accountant,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"sigma": self.sigma}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resumed run keeps the checkpoint's σ: its noise is the one planned before any data was seen.

        A σ chosen on resume, after part of the run's output was seen, would be a privacy parameter chosen
        adaptively, which plain composition in the ledger does not cover (a privacy filter would)."""
        saved = state.get("sigma")
        if saved is not None and self.sigma is not None and saved != self.sigma:
            warnings.warn(
                f"Resuming with noise_multiplier={self.sigma} while the checkpoint used {saved}: the checkpoint's "
                "σ is kept, so the whole run has the noise it was planned with (a σ picked after part of the run "
                "was seen is not covered by the ledger's composition). To train with another σ, start a new run "
                "without ckpt_path; its ε adds to this one's.",
                stacklevel=2,
            )
        if saved is not None:
            self.sigma = saved
