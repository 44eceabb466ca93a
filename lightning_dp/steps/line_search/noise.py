"""The noise slot a :class:`~lightning_dp.steps.line_search.LineSearch` installs, and its advice.

σ of the gradient is 1/√(2ρ_grad), where ρ_grad is the line search's own state (the budget planner and
CHEB change it), so the slot reads it from its owner instead of keeping a σ.
"""

from __future__ import annotations

import math
import warnings
from typing import Protocol

from lightning_dp.accounting import calibrate_noise
from lightning_dp.slots import Noise, Sampler
from lightning_dp.steps.line_search.config import LineSearchConfig, LineSearchState


class BudgetOwner(Protocol):
    """What the noise slot reads from its line search: ρ_grad in its state, the mode in its config."""

    @property
    def state(self) -> LineSearchState: ...
    @property
    def config(self) -> LineSearchConfig: ...

    def size_budget(self, sample_rate: float, steps: int) -> None: ...


class LineSearchNoise(Noise):
    """The noise slot a :class:`LineSearch` installs: σ of the gradient is 1/√(2ρ_grad), ρ_grad its state.

    ``calibrate`` runs the line search's budget planner (the per-iteration budget, not a fixed σ).
    """

    def __init__(self, owner: BudgetOwner) -> None:
        self.owner = owner

    @property
    def is_set(self) -> bool:
        return self.owner.state.rho_grad is not None

    def noise_multiplier(self, step: int) -> float:
        del step
        if self.owner.state.rho_grad is None:
            raise RuntimeError("The line search budget is not set: give noise_multiplier or target_epsilon.")
        return 1.0 / math.sqrt(2.0 * self.owner.state.rho_grad)

    def calibrate(
        self, target_epsilon: float, delta: float, sampler: Sampler, steps: int, accountant: str
    ) -> None:
        del accountant
        self.owner.size_budget(sampler.sample_rate, steps)
        if self.owner.config.mode == "nn" and self.owner.state.rho_grad is not None:
            _warn_if_gradients_get_much_more_noise(
                self.noise_multiplier(0),
                calibrate_noise(
                    target_epsilon=target_epsilon, delta=delta, sample_rate=sampler.sample_rate, steps=steps
                ),
            )


#: LineSearch's gradient σ over DP-SGD's for the same budget above which the run is warned: measured on
#: the digits MLP (bench/mechanisms.py), 1.32 cost 1.6 points of accuracy at ε = 3, 1.44 cost 13 at ε = 1.
NOISE_RATIO_WARNING = 1.25


def _warn_if_gradients_get_much_more_noise(sigma: float, dp_sgd_sigma: float) -> None:
    """Say so when the searches and the privacy filter leave the gradients much noisier than DP-SGD's."""
    ratio = sigma / dp_sgd_sigma
    if ratio > NOISE_RATIO_WARNING:
        warnings.warn(
            f"LineSearch's gradients get noise σ = {sigma:.3g}, {ratio:.2f}× the σ = {dp_sgd_sigma:.3g} DP-SGD "
            "gets from the same budget and steps: its privacy filter prices each subsampled release more "
            "conservatively than DP-SGD's RDP ledger, and the step-size searches take a share. Where "
            "training is noise-limited (small ε, a CNN) that costs accuracy: compare with DP-SGD (drop "
            "step=LineSearch()) or raise target_epsilon.",
            stacklevel=2,
        )
