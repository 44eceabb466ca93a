"""Quantile-adaptive clipping (Andrew, Thakkar, McMahan & Ramaswamy, NeurIPS 2021).

The bound C_t follows a target quantile γ of the per-example gradient norms, with no norm to tune: each step
releases, besides the clipped sum, a noisy count of the examples it did not clip, b = Σ_i (1[‖g_i‖ ≤ C_t] − ½)
+ N(0, σ_b²), and moves C geometrically, C_{t+1} = C_t·exp(−η (b̃ − γ)) with b̃ = (b + m/2)/m (m: the public
expected batch size). The two releases are one Gaussian query (Thm 1): sensitivities 1 (the sum over C_t) and ½
(the shifted count), noised at z_Δ and σ_b, cost what one release at z costs, z⁻² = z_Δ⁻² + (2σ_b)⁻². The run's
σ is that combined z (calibrated from target_epsilon exactly as for DP-SGD: one subsampled Gaussian per step,
ε digit for digit DP-SGD's), and the gradient is noised at z_Δ > z. Spec: shared/specs/adaptive_clipping.md §1.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_dp.clipping.flat import clip_factors, per_sample_norms, weighted_sum
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.core.rng import make_generator, saved_state
from lightning_dp.core.validation import number
from lightning_dp.core.validation import seed as check_seed
from lightning_dp.per_example import PerExampleGradients
from lightning_dp.slots import Clipping, StepContext, sums_once
from lightning_dp.slots.release import Releases

COUNT_NOISE_FRACTION = 1 / 20
"""The paper's default count noise σ_b = m/20 (m: the expected batch size)."""


def gradient_noise_multiplier(noise_multiplier: float, count_noise: float) -> float:
    """z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2): the gradient's σ when the count at σ_b shares the step's σ = z (Thm 1).

    Needs 2σ_b > z (else the count alone would cost more than the whole step); σ = 0 stays 0.
    """
    if noise_multiplier == 0:
        return 0.0
    ratio = noise_multiplier / (2 * count_noise)
    if not ratio < 1:
        raise ValueError(
            f"2σ_b = {2 * count_noise:.6g} must exceed the step's noise multiplier {noise_multiplier:.6g}"
        )
    return noise_multiplier / math.sqrt((1 - ratio) * (1 + ratio))


def geometric_update(
    norm: float, unclipped_fraction: float, target_quantile: float, learning_rate: float
) -> float:
    """C_{t+1} = C_t·exp(−η (b̃_t − γ)): shrink C when more than the target fraction γ went unclipped."""
    return norm * math.exp(-learning_rate * (unclipped_fraction - target_quantile))


class QuantileClipping(Clipping):
    """Flat L2 clipping at a bound that tracks the ``target_quantile`` of the per-example norms (Andrew et al.).

    Each step's sum is clipped at C_t (sensitivity C_t, noised at z_Δ·C_t) and the count of unclipped
    examples (users, in a user-level run; counted over every physical chunk and every rank) is released
    with it; C_t is a function of released values only, so it is public, logged (``dp/clip_norm``) and
    checkpointed. ``max_grad_norm`` is not used: C starts at ``initial_norm``.

    Args:
        target_quantile: γ, the fraction of examples C should leave unclipped (paper: 0.5).
        learning_rate: η of the geometric update (paper: 0.2).
        initial_norm: C_0 (paper: 0.1).
        count_noise: σ_b, the count's noise std in examples; None: m/20 (m the expected batch size), the
            paper's. The step's σ must stay below 2σ_b.
        min_norm: optional public lower clamp of C_t (None: none).
        max_norm: optional public upper clamp of C_t (None: none).
        seed: the count noise's stream (default ``os.urandom``; a seed makes the trajectory of C repeat,
            and a resumed run continue it exactly).
    """

    joint_statistic = True

    def __init__(
        self,
        target_quantile: float = 0.5,
        learning_rate: float = 0.2,
        initial_norm: float = 0.1,
        count_noise: float | None = None,
        min_norm: float | None = None,
        max_norm: float | None = None,
        seed: int | None = None,
    ) -> None:
        owner = "QuantileClipping"
        number(target_quantile, "target_quantile", owner=owner, low=0, high=1)
        number(learning_rate, "learning_rate", owner=owner, low=0)
        number(initial_norm, "initial_norm", owner=owner, low=0, low_open=True)
        number(count_noise, "count_noise", owner=owner, low=0, low_open=True, optional=True)
        number(min_norm, "min_norm", owner=owner, low=0, low_open=True, optional=True)
        number(max_norm, "max_norm", owner=owner, low=0, low_open=True, optional=True, allow_inf=True)
        check_seed(seed, owner=owner)
        low, high = min_norm or 0.0, math.inf if max_norm is None else max_norm
        if not low <= initial_norm <= high:
            raise DPConfigurationError(
                f"{owner}: initial_norm={initial_norm:g} must lie in [min_norm, max_norm] = [{low:g}, {high:g}]."
            )
        self.target_quantile, self.learning_rate = float(target_quantile), float(learning_rate)
        self.initial_norm, self.count_noise_arg = float(initial_norm), count_noise
        self.min_norm, self.max_norm = low, high
        self.seed = seed
        self.norm = self.initial_norm
        """C of the next release (a function of released counts only)."""
        self.last_norm = self.initial_norm
        """C of the latest release (what ``dp/clip_norm`` shows)."""
        self.norm_range = (self.initial_norm, self.initial_norm)
        self.last_noise = (math.nan, math.nan)
        """(z_Δ, σ_b) of the latest release: the gradient's noise multiplier and the count's noise std."""
        self.releases: Releases | None = None
        self.generator: torch.Generator | None = None
        self._pending_state: Tensor | None = None
        self._count: tuple[int, float, int] | None = None
        """(step, unclipped units, units) of the chunks of the step being clipped, released in ``finalize``."""

    # -- the joint release ------------------------------------------------------------------------------
    def use_releases(self, releases: Releases) -> None:
        self.releases = releases

    def count_noise(self, expected_batch_size: float) -> float:
        """σ_b of a step of this expected batch size: the given one, else m/20."""
        if self.count_noise_arg is not None:
            return float(self.count_noise_arg)
        return COUNT_NOISE_FRACTION * expected_batch_size

    def gradient_noise_multiplier(self, noise_multiplier: float, expected_batch_size: float) -> float:
        count_noise = self.count_noise(expected_batch_size)
        try:
            return gradient_noise_multiplier(noise_multiplier, count_noise)
        except ValueError as err:
            raise DPConfigurationError(
                f"QuantileClipping cannot split the step's noise multiplier {noise_multiplier:.4g} between the "
                f"gradient and the unclipped count: its count noise σ_b = {count_noise:.4g} (count_noise="
                f"{self.count_noise_arg!r}, default m/20 of the expected batch {expected_batch_size:g}) needs "
                "2σ_b > σ (Andrew et al. 2021, Thm 1), or the count alone would cost more than the step. Raise "
                "count_noise (or the batch size), or lower the noise multiplier (a larger target_epsilon)."
            ) from err

    def clip_bound(self, configured: float) -> float:
        del configured  # C starts at initial_norm and moves with the released counts
        return self.norm

    @sums_once
    def clip_and_sum(self, grad_samples: PerExampleGradients, ctx: StepContext) -> list[Tensor]:
        """Σ clip_C(g_i), and this chunk's unclipped count kept for the step's release (in ``finalize``)."""
        norms = per_sample_norms(grad_samples)
        ctx.extras["per_sample_norms"] = norms
        unclipped = float((norms <= ctx.max_grad_norm).sum())  # a NaN/inf norm counts as clipped
        units = int(norms.numel())
        if self._count is not None and self._count[0] == ctx.step:  # a further physical chunk of this step
            unclipped, units = unclipped + self._count[1], units + self._count[2]
        self._count = (ctx.step, unclipped, units)
        return weighted_sum(grad_samples, clip_factors(norms, ctx.max_grad_norm))

    def finalize(self, noisy_sums: list[Tensor], ctx: StepContext) -> list[Tensor]:
        """Release the noisy unclipped count (each rank its share), move C, then DP-SGD's ÷ m."""
        self._release_count(ctx)
        return super().finalize(noisy_sums, ctx)

    def _release_count(self, ctx: StepContext) -> None:
        step, unclipped, units = self._count if self._count is not None else (ctx.step, 0.0, 0)
        self._count = None
        if step != ctx.step:  # chunks of an earlier step that never released: none of this step's
            unclipped, units = 0.0, 0
        m = ctx.expected_batch_size
        std = self.count_noise(m) if ctx.noise_multiplier > 0 else 0.0  # σ = 0: no privacy, no noise
        local = unclipped - units / 2  # Σ (b_i − ½): sensitivity ½ under adding or removing one unit
        if self.releases is None:  # driven without an engine (unit tests): one process
            noisy = local + std * float(torch.randn(1, generator=self._generator(0), dtype=torch.float64))
        else:
            noisy = self.releases.noisy_statistic(
                local, std, self._generator(self.releases.rank), shares=True
            )
        self.last_norm, self.last_noise = ctx.max_grad_norm, (ctx.noise_multiplier, std)
        updated = geometric_update(
            ctx.max_grad_norm, (noisy + m / 2) / m, self.target_quantile, self.learning_rate
        )
        self.norm = min(max(updated, self.min_norm), self.max_norm)
        self.norm_range = (min(self.norm_range[0], self.norm), max(self.norm_range[1], self.norm))

    def _generator(self, rank: int) -> torch.Generator:
        if self.generator is None:
            self.generator = make_generator(self.seed, stream=f"quantile-count/{rank}")
            if self._pending_state is not None:
                self.generator.set_state(self._pending_state)
                self._pending_state = None
        return self.generator

    # -- what is logged, reported and checkpointed ---------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        return {"dp/clip_norm": self.last_norm}

    def report(self) -> dict[str, Any]:
        return {
            "kind": "quantile-adaptive (Andrew et al. 2021)",
            "initial": self.initial_norm,
            "last_used": self.last_norm,
            "next": self.norm,
            "min": self.norm_range[0],
            "max": self.norm_range[1],
            "target_quantile": self.target_quantile,
            "learning_rate": self.learning_rate,
            "count_noise": "m/20" if self.count_noise_arg is None else self.count_noise_arg,
            "last_gradient_noise_multiplier": self.last_noise[0],
            "last_count_noise_std": self.last_noise[1],
        }

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "norm": self.norm,
            "last_norm": self.last_norm,
            "norm_range": list(self.norm_range),
        }
        generator = saved_state(self.generator, self.seed)
        if generator is None and self.seed is not None:
            generator = self._pending_state
        if generator is not None:
            state["generator"] = generator
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.norm, self.last_norm = float(state["norm"]), float(state["last_norm"])
        low, high = state["norm_range"]
        self.norm_range = (float(low), float(high))
        self.generator, self._pending_state = None, state.get("generator")
        self._count = None
