"""Constant noise multiplier: given directly, or calibrated from a target ε over the planned steps."""

from __future__ import annotations

import warnings
from typing import Any

from lightning_dp.accounting import calibrate_noise
from lightning_dp.slots import Noise, Sampler
from lightning_dp.validation import number


class ConstantNoise(Noise):
    """The same σ at every step (DP-SGD). ``calibrate`` picks the smallest σ that stays under target."""

    is_constant = True

    def __init__(self, noise_multiplier: float | None = None) -> None:
        number(noise_multiplier, "noise_multiplier", owner="ConstantNoise", low=0, optional=True)
        self.sigma = noise_multiplier

    @property
    def is_set(self) -> bool:
        return self.sigma is not None

    def noise_multiplier(self, step: int) -> float:
        if self.sigma is None:
            raise RuntimeError("The noise multiplier is not set: give noise_multiplier or target_epsilon.")
        return self.sigma

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
        saved = state.get("sigma")
        if self.sigma is None:
            self.sigma = saved
        elif saved is not None and saved != self.sigma:
            warnings.warn(
                f"Resuming with noise_multiplier={self.sigma} while the checkpoint used {saved}: the new value "
                "is used from now on, and the ledger prices every step with the σ it actually had.",
                stacklevel=2,
            )
