"""Which slot combinations the ledger can price, checked at construction.

Decided by what the slots declare (``mechanism``, ``joint_statistic``, ``correlated``, ``integer_grid``,
``bands``, and the steps' ``releases_one_gradient``, ``brings_own_rules``, ``adapts_clip_bound``, see
``slots.py``), never by their classes: a new slot declares what it does and gets the same decisions.
"""

from __future__ import annotations

import warnings

from lightning_dp.accounting import PoissonGaussian
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.slots import Clipping, Noise, Sampler, Step


def check_mechanisms(
    sampler: Sampler, clipping: Clipping, noise: Noise, accountant: str, step: Step | None = None
) -> None:
    """Refuse slot combinations the ledger cannot price (e.g. Laplace noise with Poisson/RDP events).

    Slots declare ``mechanism`` ("gaussian" unless set): Laplace needs all of fixed-size sampling,
    L1 clipping, Laplace noise and the pure-ε accountant (basic composition); Gaussian needs none
    (its accountant is "rdp", "prv" or "pld"). Correlated noise has its own table
    (:func:`check_correlated_noise`).
    """
    kinds = {
        name: slot.mechanism
        for name, slot in (("sampler", sampler), ("clipping", clipping), ("noise", noise))
    }
    kinds["accountant"] = "laplace" if accountant == "pure" else "gaussian"
    if len(set(kinds.values())) > 1:
        described = ", ".join(f"{name}: {kind}" for name, kind in kinds.items())
        raise DPConfigurationError(
            f"These slots release different mechanisms ({described}), which the ledger cannot price together. "
            "Pure ε-DP Laplace steps (privacy='paper') need FixedSize(), L1Clipping(), a Laplace noise slot "
            "and accountant='pure'; Gaussian steps need none of these."
        )
    if clipping.joint_statistic:
        check_joint_statistic(sampler, clipping, noise, step)
    check_secure_noise(sampler, clipping, noise, accountant, step)
    if noise.correlated:
        check_correlated_noise(sampler, clipping, noise, step)
    elif sampler.bands not in (None, 1):
        raise DPConfigurationError(
            f"{sampler.name}(bands={sampler.bands!r}) is for correlated noise (BandMF, BLT): with noise={noise.name} "
            "every step would be priced as a subsampled Gaussian at q_b = B·b/N, b times DP-SGD's rate, which "
            "overstates ε and gains nothing. Use noise=BandMF() with it, or Poisson() for DP-SGD."
        )


def check_correlated_noise(sampler: Sampler, clipping: Clipping, noise: Noise, step: Step | None) -> None:
    """Correlated noise (BandMF, BLT) is priced only with cyclic participation and a gradient-only step.

    The banded reduction (Choquette-Choo et al. 2023, Thm 4) and the min-separation sensitivity both need
    every example's steps at least b apart, which ordinary Poisson sampling (b > 1), importance sampling
    and fixed-size sampling do not give; every noisy release advances the noise recursion, so a step that
    releases more than the gradient, or reads the noise as i.i.d. of std σ·C, cannot use it.
    """
    name = noise.name
    if sampler.bands is None or sampler.schedules_noise:
        raise DPConfigurationError(
            f"{name} needs cyclic Poisson sampling, got sampler={sampler.name}: its accounting requires every "
            "example's steps to be at least b apart (one group per example, Choquette-Choo et al. 2023 Thm 4), "
            f"which {sampler.name} does not guarantee. Use sampler=CyclicPoisson(bands=...) (or bands='auto')."
        )
    if type(clipping).finalize is not Clipping.finalize:
        raise DPConfigurationError(
            f"{name} cannot be combined with clipping={clipping.name}: its finalize post-processes the released "
            "sums assuming i.i.d. noise of std σ·C per step (AdaCliP's mean and variance estimates), while "
            f"{name}'s noise is correlated across steps and larger per step. Use FlatClipping() with {name}."
        )
    if step is None:
        return
    if not step.releases_one_gradient:
        raise DPConfigurationError(
            f"{name} cannot be combined with step={step.name}: that step brings its own noise or ledger rule, "
            "or releases more than one noisy gradient per step (a search, a re-measurement), and every noisy "
            f"release would advance {name}'s correlated noise. Use the default step (your optimizer) with "
            f"{name}, or ConstantNoise with {step.name}."
        )
    if type(step) is not Step:
        warnings.warn(
            f"{name}'s coefficients are optimised for the prefix sums of plain SGD; with step={step.name} the "
            "released gradients are still private (post-processing), but the error reduction is not "
            "guaranteed.",
            stacklevel=4,
        )


def check_secure_noise(
    sampler: Sampler, clipping: Clipping, noise: Noise, accountant: str, step: Step | None
) -> None:
    """Secure noise (``DiscreteGaussian`` with ``GridClipping``, ``secure=True``) is priced only as the
    Poisson-subsampled discrete Gaussian of an integer sum made by its own grid, with the RDP accountant and a
    step that releases the one gradient (the ledger event is the noise slot's, not the step's)."""
    noise_grid, clipping_grid = noise.integer_grid, clipping.integer_grid
    if noise_grid is None and clipping_grid is None:
        return
    if noise_grid is None or noise_grid is not clipping_grid:
        raise DPConfigurationError(
            f"noise={noise.name} with clipping={clipping.name}: secure noise needs both, sharing one grid "
            "(the integer sums of GridClipping carry DiscreteGaussian's noise). Pass secure=True, or "
            "noise=DiscreteGaussian(...) and no clipping: the strategy builds the grid clipping from it."
        )
    if accountant != "rdp":
        raise DPConfigurationError(
            f"secure=True with accountant={accountant!r}: the discrete Gaussian steps are priced by their RDP "
            "curve (the PRV and PLD accountants price continuous Gaussians only). Use accountant='rdp'."
        )
    if (
        sampler.schedules_noise
        or sampler.bands not in (None, 1)
        or type(sampler.event(1.0)) is not PoissonGaussian
    ):
        raise DPConfigurationError(
            f"secure=True with sampler={sampler.name}: secure noise is priced as a Poisson-subsampled discrete "
            "Gaussian, which this sampler's steps are not. Use the default sampler (Poisson, or UserPoisson for "
            "users)."
        )
    if step is None:
        return
    if not step.releases_one_gradient:
        raise DPConfigurationError(
            f"secure=True with step={step.name}: that step brings its own noise or ledger rule, or reads the "
            "clipped sums (a search, a re-measurement), which secure noise does not release or price. Use the "
            "default step (your optimizer), HeavyBall or Nesterov with secure=True."
        )


def check_joint_statistic(sampler: Sampler, clipping: Clipping, noise: Noise, step: Step | None) -> None:
    """A clipping whose count is priced inside the step's one Gaussian event (quantile clipping) needs that
    event to be the subsampled Gaussian at the noise slot's σ, released once per step with i.i.d. noise.

    The combined σ (Andrew et al. 2021, Thm 1) covers the gradient and the count only together: a noise rule,
    ledger rule or clipping bound of the step's own, correlated noise or a sampler that bounds the
    contributions itself would leave the count unpriced or price it at a σ it was not noised for. (Each
    gradient release releases its own count, so a step that reads the noisy sums or prices a second gradient
    at the same kind of event combines.)
    """
    name = clipping.name
    if noise.correlated:
        raise DPConfigurationError(
            f"{name} cannot be combined with noise={noise.name}: its unclipped count is priced with the gradient "
            f"as one Gaussian release per step at the step's σ, while {noise.name}'s noise is correlated across "
            "steps and priced over the whole run, which does not cover the count. Use ConstantNoise (or leave "
            f"noise unset) with {name}, or FlatClipping with {noise.name}."
        )
    if sampler.schedules_noise or type(sampler).weigh is not Sampler.weigh:
        raise DPConfigurationError(
            f"{name} cannot be combined with sampler={sampler.name}: that sampler sets each step's σ or bounds "
            f"each contribution itself, so the count {name} releases would not be part of the event it prices. "
            f"Use Poisson (or UserPoisson) sampling with {name}."
        )
    if step is None:
        return
    own_rules = step.brings_own_rules or step.adapts_clip_bound
    if own_rules or step.spends_until_budget or step.charges_unsampled:
        raise DPConfigurationError(
            f"{name} cannot be combined with step={step.name}: that step brings its own noise, ledger or "
            f"clipping-bound rule, and {name}'s unclipped count is priced only inside the subsampled Gaussian "
            f"gradient release at the noise slot's σ. Use the default step (your optimizer) or HeavyBall/Nesterov "
            f"with {name}, or FlatClipping with {step.name}."
        )
