"""Secure noise: discrete Gaussian shares (Canonne, Kamath & Steinke 2020) from the OS's CSPRNG, on integer sums.

The float Gaussian of DP-SGD can be attacked through its floating-point representation (which low-order bits
a sample can have: Mironov 2012, Jin et al. 2022). Here the clipped per-example gradients are rounded onto an
integer grid and summed exactly (:class:`~lightning_dp.clipping.integer_grid.GridClipping`), each rank adds
N_Z(0, σ₀²) to every coordinate, and only the released integers are turned back into floats. A released value
is an integer whatever the data, so there is no floating-point residue to read.

The sampler is CKS's Algorithm 3 (discrete Laplace proposal of scale t, accept with
exp(−(|y| − σ²/t)²/2σ²)), made vectorised and constant-structure:

* every random bit comes from :func:`~lightning_dp.core.rng.secure_words` (``os.urandom``): no torch generator;
* one candidate costs four 63-bit words: U (uniform on [0, t), t a power of two ≥ σ) with the sign, V
  (geometric, P[V ≥ v] = e^{−v}, by comparison with the integer thresholds ⌊e^{−v}·2⁶³⌋), and a 126-bit
  uniform for the one Bernoulli(exp(−U/t − (|Y| − σ²/t)²/2σ²)) that replaces CKS's two acceptance tests;
* a call draws a fixed number of candidates for the values it needs (Hoeffding: short with probability
  below 2⁻⁶⁴, then it draws a fixed block more). The accepted candidates are i.i.d. draws whose values are
  independent of how many were accepted, so the running time, a function of those counts, carries no
  information about the noise (the timing channel of Jin et al. 2022). Exponents are clamped at 700, so no
  subnormal number (slow on x86) is ever formed.

Floating point remains in the acceptance probabilities; its effect is bounded, not ignored: on the bulk
(|y| − σ²/t ≤ 10σ) every output's probability is within a factor e^{±η} of the exact pmf
(:attr:`CKSSampler.relative_error`, about 2e-13), which the ledger adds to the RDP
(:class:`~lightning_dp.accounting.discrete_gaussian.PoissonDiscreteGaussian`); the tail beyond it (probability
:attr:`CKSSampler.tail` ≈ 1e-23 per value) is a δ term the report states.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_dp.accounting import PrivacyEvent
from lightning_dp.accounting.discrete_gaussian import IntegerGrid, PoissonDiscreteGaussian, sampler_delta
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.core.rng import SECURE_WORD, secure_words
from lightning_dp.core.validation import number
from lightning_dp.noise.constant import FixedSigma
from lightning_dp.slots import Sampler

__all__ = ["BULK_EXPONENT", "CKSSampler", "DiscreteGaussian"]

BULK_EXPONENT = 50.0
"""The bulk: outputs with (|y| − σ²/t)²/(2σ²) ≤ this. There every acceptance probability is at least
e^{−51} > 2⁻⁷⁴, which a 126-bit comparison resolves exactly; beyond it is the tail."""
_EXP_CLAMP = 700.0
_FAIL_LOG = 64 * math.log(2)  # a call is short of accepted candidates with probability ≤ 2⁻⁶⁴
_BLOCK = 1 << 18
"""Values drawn per block (about 2.5 candidates each, four words per candidate: ~20 MiB of words)."""
_MAX_SCALE = 2.0**46
"""σ₀ ≤ 2⁴⁶ keeps t·(V + 1) < 2⁵³: every candidate is exact as a float64 and as an int64."""
_EXP_ULPS = 4
"""The relative error assumed of float64 ``exp`` (Sleef's and CUDA's are within 1 ulp; 4 leaves room)."""
_U = 2.0**-53


def _geometric_thresholds() -> list[int]:
    """⌊e^{−v}·2⁶³⌋ for v = 1, 2, … while positive: V = #{v : word < T_v} has P[V ≥ v] = T_v / 2⁶³."""
    out, v = [], 1
    while (value := math.floor(math.exp(-v) * SECURE_WORD)) > 0:
        out.append(value)
        v += 1
    return out


_THRESHOLDS = _geometric_thresholds()


class CKSSampler:
    """Draws N_Z(0, σ²) values (σ ≥ 1/2, in grid units) from ``os.urandom``; see the module docstring."""

    def __init__(self, scale: float) -> None:
        if not (0.5 <= scale <= _MAX_SCALE and math.isfinite(scale)):
            raise ValueError(f"the discrete Gaussian's scale must be in [0.5, 2^46], got {scale!r}")
        self.scale = float(scale)
        self.t = 2 ** max(0, math.ceil(math.log2(scale)))  # a power of two ≥ σ: U/t and σ²/t are exact
        self.variance = self.scale**2
        self.shift = self.variance / self.t
        self.acceptance = self._acceptance()
        self.tail = self._tail()
        self.relative_error = self._relative_error()
        self._thresholds: dict[torch.device, Tensor] = {}

    def _acceptance(self) -> float:
        """P[a candidate is accepted] = (1 − e⁻¹)/(2t)·e^{−σ²/2t²}·Σ_x e^{−x²/2σ²} (the CKS proposal's algebra)."""
        s = self.scale
        if s < 64:
            span = math.ceil(40 * s) + 1
            theta = 1 + 2 * sum(math.exp(-(x * x) / (2 * self.variance)) for x in range(1, span))
        else:  # Poisson summation: Σ_x e^{−x²/2σ²} = σ√(2π)(1 + 2e^{−2π²σ²} + …), the rest below 1e-300
            theta = s * math.sqrt(2 * math.pi)
        return (1 - math.exp(-1)) / (2 * self.t) * math.exp(-self.variance / (2 * self.t**2)) * theta

    def _relative_error(self) -> float:
        """η: on the bulk, every value's probability is within e^{±η} of the exact discrete Gaussian pmf.

        Per candidate: V's mass, from integer thresholds of 63 bits, is off by at most
        2⁻⁵²(1 + e⁻¹)/(1 − e⁻¹) + 2·2⁻⁶³e^v/(1 − e⁻¹) for the largest bulk v; the acceptance probability by
        the rounding of its exponent g ≤ 51 (8 units of 2⁻⁵³ relative) and of ``exp``; the comparison with
        a 126-bit uniform is exact there. Normalising doubles it.
        """
        v = math.ceil((self.shift + math.sqrt(2 * BULK_EXPONENT) * self.scale) / self.t) + 1
        geometric = 2 * _U * (1 + math.exp(-1)) / (1 - math.exp(-1)) + 2 * 2.0**-63 * math.exp(v) / (
            1 - math.exp(-1)
        )
        acceptance = 8 * _U * (BULK_EXPONENT + 2) + _EXP_ULPS * 2 * _U
        return 2 * (geometric + acceptance) * (1 + 1e-3) + 4 * self.tail

    def _tail(self) -> float:
        """β: the probability, under the exact pmf and under this sampler alike (3× covers both), of a value
        outside the bulk, which ends at h = σ²/t + 10σ: P[|X| > h] ≤ erfc((h − 1)/(σ√2)) (the lattice sum is at
        most the integral and the normaliser at least σ√(2π)), plus the 2⁻¹²⁰ the thresholds leave."""
        z = (self.shift + math.sqrt(2 * BULK_EXPONENT) * self.scale - 1) / self.scale
        return 3 * math.erfc(z / math.sqrt(2)) + 2.0**-120

    def candidates(self, count: int) -> int:
        """Candidates to draw for ``count`` values: M with M·a − count = √(M·ln(2⁶⁴)/2) (Hoeffding)."""
        a, half_log = self.acceptance, math.sqrt(_FAIL_LOG / 2)
        root = (half_log + math.sqrt(half_log**2 + 4 * a * count)) / (2 * a)
        return math.ceil(root * root) + 1

    def sample(self, count: int, device: torch.device | str = "cpu") -> Tensor:
        """``count`` i.i.d. N_Z(0, σ²) values as an int64 tensor on ``device``."""
        device = torch.device(device)
        parts, need = [], count
        while need > 0:
            block = min(need, _BLOCK)
            values, accepted = self._candidates(self.candidates(block), device)
            kept = values[accepted][:block]  # the count, not the values, decides how many are taken
            parts.append(kept)
            need -= kept.numel()
        if not parts:
            return torch.zeros(0, dtype=torch.int64, device=device)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _candidates(self, m: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """m CKS candidates and whether each is accepted; the same operations whatever the words are."""
        words = secure_words(4 * m, device).view(4, m)
        first, geometric_word, high, low = words[0], words[1], words[2], words[3]
        u = first & (self.t - 1)
        negative = (first >> 62) & 1
        thresholds = self._thresholds.get(device)
        if thresholds is None:
            thresholds = torch.tensor(sorted(_THRESHOLDS), dtype=torch.int64, device=device)
            self._thresholds[device] = thresholds
        v = len(_THRESHOLDS) - torch.searchsorted(thresholds, geometric_word, right=True)
        x = u + self.t * v
        centred = x.to(torch.float64) - self.shift
        exponent = u.to(torch.float64) / self.t + centred * centred / (2 * self.variance)
        p = torch.exp(-exponent.clamp_(max=_EXP_CLAMP)).clamp_(max=1 - _U)
        scaled = p * float(SECURE_WORD)
        top = scaled.floor()
        bottom = ((scaled - top) * float(SECURE_WORD)).floor()
        top_i, bottom_i = top.to(torch.int64), bottom.to(torch.int64)
        accepted = (high < top_i) | ((high == top_i) & (low < bottom_i))
        accepted &= ~((negative == 1) & (x == 0))
        return torch.where(negative == 1, -x, x), accepted


class DiscreteGaussian(FixedSigma):
    """Secure noise for DP-SGD (``DPStrategy(secure=True)`` selects it): integer sums, discrete Gaussian
    shares from ``os.urandom``, priced as a Poisson-subsampled discrete Gaussian.

    Args:
        noise_multiplier: σ relative to the rounded sensitivity Δ (each rank adds N_Z(0, σ²Δ²/W) to every
            coordinate in grid units); None (default): calibrated from ``target_epsilon``.
        rounding_slack: s, how much the rounding may add to an example's contribution, relative to C: the grid
            step is γ = 2sC/√d, so the rounded sum's sensitivity is C(1 + s + 1e-4) and the noise std σ times it
            (default 1e-3: with the 1e-4 arithmetic margin, 0.11 % more noise than the float path at the same σ).

    The integer pipeline itself is :class:`~lightning_dp.clipping.integer_grid.GridClipping`, which the
    strategy builds from :attr:`grid`; every other slot must be the default one (see
    ``docs/guarantees.md``, "Secure noise").
    """

    is_constant = True

    def __init__(self, noise_multiplier: float | None = None, rounding_slack: float = 1e-3) -> None:
        number(noise_multiplier, "noise_multiplier", owner="DiscreteGaussian", low=0, optional=True)
        number(rounding_slack, "rounding_slack", owner="DiscreteGaussian", low=0, high=1, low_open=True)
        self.sigma = noise_multiplier
        self.grid = IntegerGrid(float(rounding_slack))
        self.ranks = 1
        self._sampler: Sampler | None = None
        self._cks: CKSSampler | None = None
        self._checked_capacity = False

    # -- the run --------------------------------------------------------------------------------------
    @property
    def integer_grid(self) -> IntegerGrid:
        return self.grid

    def link_sampler(self, sampler: Sampler) -> None:
        self._sampler = sampler

    def link_ranks(self, world_size: int) -> None:
        self.ranks = int(world_size)

    def setup(self, params: Any) -> None:
        self.grid.setup(params)

    def share_scale(self, sigma: float) -> float:
        """σ₀ of one rank's share, in grid units: σΔ/√W."""
        return sigma * self.grid.sensitivity / math.sqrt(self.ranks)

    def _share_sampler(self, scale: float) -> CKSSampler:
        if self._cks is None or self._cks.scale != scale:
            self._cks = CKSSampler(scale)
        return self._cks

    # -- accounting -----------------------------------------------------------------------------------
    def step_event(self, step: int, sampler: Sampler, noise_multiplier: float) -> PrivacyEvent | None:
        """The ledger event of a secure step: the sampler's q, W shares of the discrete Gaussian."""
        del step
        return self._event(noise_multiplier, sampler.sample_rate)

    def _event(self, sigma: float, rate: float) -> PoissonDiscreteGaussian:
        scale = self.share_scale(sigma)
        error = self._share_sampler(scale).relative_error if scale >= 0.5 else 0.0
        return PoissonDiscreteGaussian(sigma, rate, self.ranks, max(1, self.grid.dimension), scale, error)

    def calibrate(
        self, target_epsilon: float, delta: float, sampler: Sampler, steps: int, accountant: str
    ) -> None:
        """The smallest σ (to 1 %) whose ``steps`` secure steps spend at most ``target_epsilon``."""
        from lightning_dp.accounting import PrivacyLedger, calibrate_noise

        del accountant  # "rdp" (the config refuses the others)
        rate = sampler.sample_rate

        def fits(sigma: float) -> bool:
            ledger = PrivacyLedger(delta)
            ledger.record(self._event(sigma, rate), steps)
            return ledger.epsilon() <= target_epsilon

        hi = calibrate_noise(target_epsilon=target_epsilon, delta=delta, sample_rate=rate, steps=steps)
        while not fits(hi):
            hi *= 1.05
            if hi > 1e4:
                raise ValueError(f"even noise_multiplier=1e4 does not meet target_epsilon={target_epsilon:g}")
        lo = hi / 1.25
        while fits(lo):
            hi, lo = lo, lo / 1.25
        while hi - lo > 0.01 * hi:
            mid = (lo + hi) / 2
            hi, lo = (mid, lo) if fits(mid) else (hi, mid)
        self.sigma = hi

    def sampler_delta(self, steps: int, epsilon: float) -> float:
        """The δ its tail adds to ``steps`` releases (report): (1 + e^ε)·steps·W·d·β."""
        if self.sigma is None or self.sigma == 0 or self.grid.dimension == 0:
            return 0.0
        tail = self._share_sampler(self.share_scale(self.sigma)).tail
        return sampler_delta(tail, self.ranks * self.grid.dimension, steps, epsilon)

    # -- the draw -------------------------------------------------------------------------------------
    def add_noise(self, sums: list[Tensor], std: float, generator: torch.Generator) -> list[Tensor]:
        """N_Z(0, std²) on every coordinate of the integer sums, in place; ``generator`` is not used."""
        del generator
        if any(s.dtype != torch.int64 for s in sums):
            raise DPConfigurationError(
                "DiscreteGaussian adds noise to integer sums only, and got floating-point ones: a release hook "
                "(the privacy audit's canaries) or a clipping other than GridClipping put them there. Secure "
                "noise runs with the default clipping and no release hooks; drop the audit or secure=True."
            )
        self._check_capacity(std)
        if std == 0.0:
            return sums
        cks = self._share_sampler(std)
        for s in sums:
            s.view(-1).add_(cks.sample(s.numel(), s.device))
        return sums

    def _check_capacity(self, std: float) -> None:
        """Once: no int64 sum can overflow, for every example of the data set on every rank plus the noise."""
        if self._checked_capacity:
            return
        self._checked_capacity = True
        units = self._sampler.num_samples if self._sampler is not None else 0
        noise = 0 if std == 0.0 else self._share_sampler(std).t * (len(_THRESHOLDS) + 1)
        if units * self.grid.max_coordinate + self.ranks * noise >= 2**63:
            raise DPConfigurationError(
                "secure=True: the integer sums could overflow int64 on this data set and model (every example's "
                "rounded gradient adds up to √d/(2·rounding_slack) per coordinate). Raise rounding_slack (a "
                "coarser grid) or train with secure=False."
            )

    # -- report ---------------------------------------------------------------------------------------
    def describe(self) -> str | None:
        grid = self.grid
        return (
            f"secure noise: discrete Gaussian shares from os.urandom on an integer grid (γ = 2·{grid.rounding_slack:g}·C/√d, "
            f"d = {grid.dimension}); the rounded sensitivity is C·(1 + {grid.rounding_slack:g} + 1e-4)"
        )

    def report(self) -> dict[str, Any] | None:
        grid = self.grid
        scale = self.share_scale(self.sigma) if self.sigma else 0.0
        cks = self._share_sampler(scale) if scale >= 0.5 else None
        return {
            "mechanism": "discrete Gaussian (Canonne, Kamath & Steinke 2020) on an integer grid",
            "generator": "os.urandom (the operating system's CSPRNG); no torch generator, no seed",
            "rounding": "clip to C, scale by 1/γ, round to nearest (deterministic)",
            "rounding_slack": grid.rounding_slack,
            "grid_dimension": grid.dimension,
            "grid_units_per_clip_bound": grid.unit,
            "sensitivity_grid_units": grid.sensitivity,
            "share_scale_grid_units": scale,
            "ranks": self.ranks,
            "accounting": (
                "Poisson-subsampled RDP at integer orders for symmetric noise (Zhu & Wang 2019 Thm 6 without "
                "its factor 3; removal ≤ addition by the involution y ↦ v − y); shares summed over ranks: "
                "Kairouz, Liu & Steinke 2021 Thm 1"
            ),
            "sampler_relative_error": cks.relative_error if cks is not None else 0.0,
            "sampler_tail": cks.tail if cks is not None else 0.0,
        }

    # -- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"sigma": self.sigma, "rounding_slack": self.grid.rounding_slack}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resumed run keeps the checkpoint's σ; a different grid is refused (another mechanism)."""
        slack = state.get("rounding_slack")
        if slack is not None and slack != self.grid.rounding_slack:
            raise ValueError(
                f"The checkpoint was trained with DiscreteGaussian(rounding_slack={slack}), this run uses "
                f"{self.grid.rounding_slack}: resume with the same grid."
            )
        if state.get("sigma") is not None:
            self.sigma = state["sigma"]
