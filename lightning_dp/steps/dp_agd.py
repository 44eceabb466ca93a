"""DP-AGD (Lee & Kifer, KDD 2018): gradient descent whose step size and noise level adapt at run time.

Each iteration measures the clipped gradient sum with Gaussian noise at a zCDP cost ρ_ng (the engine's
ordinary private step), normalises it to a direction d, and picks a step from the grid
Φ = {k·α_max/m : k = 0..m} privately with NoisyMin over the clipped loss sums F(w − α_k·d) (cost ρ_nmax).
If NoisyMin picks α = 0 the direction was too noisy: ρ_ng grows by (1 + γ) for good, the SAME gradient is
measured again at cost ρ_new − ρ_old and averaged with the first measurement (GradAvg: the result is
distributed exactly like one measurement at ρ_new), and the line search repeats. Every τ iterations
α_max ← (1 + η)·max(recent steps). There is no preset number of steps: the run ends when the zCDP budget
ρ = (√(ln(1/δ) + ε) − √ln(1/δ))² cannot pay for the next release. Every release is checked before it is
spent by a :class:`~lightning_dp.accounting.PrivacyFilter`, so the run is ρ-zCDP and (ε, δ)-DP.

Deviations from the authors' code (spec ../shared/specs/dp_agd.md §7): NoisyMin SUBTRACTS its exponential
noise from the losses (the code adds it, which leaks up to m·ε); GradAvg keeps a running estimate; the
chosen step is applied (no off-by-one); no double charge. A mini-batch (batch_size < N) is charged as if
it were the full data (sub-sampling amplification is not claimed; spec §5.4).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_dp.accounting import NoisyMin, PrivacyFilter, rho_from_epsilon
from lightning_dp.accounting.zcdp import ZCDPConversion
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.core.validation import number
from lightning_dp.slots import Clipping, Noise, Sampler, Step, StepContext, StepHost, StepPlan, StepSetup
from lightning_dp.steps.loss_queries import USER_LEVEL_REFUSAL, LossProbe

__all__ = ["AdaptiveGD", "grad_avg", "initial_budgets", "noisy_min", "step_grid"]

NoiseKind = Literal["exponential", "laplace", "gumbel"]


def initial_budgets(
    epsilon: float, delta: float, splits: int = 60, conversion: ZCDPConversion = "cks"
) -> tuple[float, float, float]:
    """(ρ_tot, ρ_ng, ρ_nmax) of DP-AGD §2.3: ε_s = ε/(2·splits), ρ_nmax = ε_s²/2 (Lemma 3.7) and
    ρ_ng = ε_s²/(4·ln(1.25/δ)) (classic Gaussian σ, then Lemma 3.6). ρ_tot is the largest ρ whose zCDP
    implies (ε, δ)-DP under ``conversion`` (the paper's Lemma 3.8 is ``"bun_steinke"``; ``"cks"`` is tight)."""
    eps_s = epsilon / (2.0 * splits)
    return (
        rho_from_epsilon(epsilon, delta, conversion),
        eps_s**2 / (4.0 * math.log(1.25 / delta)),
        eps_s**2 / 2.0,
    )


def step_grid(alpha_max: float, m: int) -> list[float]:
    """Φ = {k·α_max/m : k = 0..m}: m + 1 candidates, 0 first."""
    return [k * alpha_max / m for k in range(m + 1)]


def noisy_min(scores: Tensor, scale: float, noise: str, generator: torch.Generator | None) -> int:
    """Index of the privately smallest score (scores are monotone, sensitivity Δ, ``scale`` = Δ/ε).

    ``"exponential"``: argmin(Ω − E), E ~ Exp(scale) — report-noisy-max on −Ω, i.e. permute-and-flip. The
    noise must *improve* scores, so it is subtracted; adding it (the authors' code) is not ε-DP.
    ``"laplace"``: argmin(Ω + Lap(scale)) (paper Alg. 1). ``"gumbel"``: argmin(Ω − scale·Gumbel), the
    exponential mechanism.
    """
    scores = scores.detach().to(torch.float64)
    k = scores.numel()
    if scale == 0.0:
        return int(torch.argmin(scores))
    draw = torch.empty(k, dtype=torch.float64, device=scores.device)
    if noise == "exponential":
        noisy = scores - scale * draw.exponential_(generator=generator)
    elif noise == "laplace":
        e1 = draw.exponential_(generator=generator).clone()
        e2 = draw.exponential_(generator=generator)
        noisy = scores + scale * (e1 - e2)
    elif noise == "gumbel":
        noisy = scores - scale * (-torch.log(draw.exponential_(generator=generator)))
    else:
        raise ValueError(f"noise must be 'exponential', 'laplace' or 'gumbel', got {noise!r}")
    return int(torch.argmin(noisy))


def grad_avg(estimate: list[Tensor], precision: float, again: list[Tensor], rho_new: float) -> list[Tensor]:
    """GradAvg: combine a running estimate of cost ``precision`` with a new measurement of cost
    ρ_new − precision by inverse-variance weights; the result is distributed as ONE measurement at ρ_new."""
    extra = rho_new - precision
    return [(precision * s + extra * a) / rho_new for s, a in zip(estimate, again, strict=True)]


class _AdaptiveNoise(Noise):
    """The noise slot DP-AGD installs: σ = 1/√(2ρ_ng) (std σ·C_grad), ρ_ng read from the step."""

    def __init__(self, owner: AdaptiveGD) -> None:
        self.owner = owner

    def noise_multiplier(self, step: int) -> float:
        return 1.0 / math.sqrt(2.0 * self.owner.rho_ng)

    def calibrate(
        self, target_epsilon: float, delta: float, sampler: Sampler, steps: int, accountant: str
    ) -> None:
        """Nothing to calibrate: the budget, not a step count, ends the run."""


class AdaptiveGD(Step):
    """DP-AGD in the step slot: ``DPStrategy(step=AdaptiveGD(), target_epsilon=..., delta=...)``.

    The LightningModule must implement ``dp_per_sample_loss(batch) -> Tensor[B]``. The train DataLoader's
    ``batch_size`` = N gives the paper's full-batch algorithm (use ``max_physical_batch_size`` to split it
    in memory); a smaller batch is a mini-batch run charged conservatively. ``max_grad_norm`` is C_grad.
    The user's optimizer is not used: the step moves the weights itself. Set ``max_epochs=-1`` (or large):
    training stops when the budget cannot pay for the next iteration.

    Args:
        loss_clip: C_obj; per-example losses are clamped to [0, C_obj] before NoisyMin.
        splits: sets the initial budgets, ε_s = ε/(2·splits).
        gamma: growth of ρ_ng after a rejected direction.
        grid_size: m, the number of non-zero candidates.
        alpha_max: initial largest step length (Euclidean length of the update).
        tau: τ, in iterations: every τ iterations α_max ← (1 + η)·max(steps chosen in the window)
            (default 10).
        eta: η of that update (default 0.1).
        alpha_max_cap: optional upper bound on α_max (the authors' code uses 2.0).
        noise: NoisyMin noise: ``"exponential"`` (default), ``"laplace"`` or ``"gumbel"`` (ε²/8-zCDP).
        rho_ng: override the initial gradient budget, in zCDP ρ (default: from ``splits``).
        rho_nmax: override the initial NoisyMin budget, in zCDP ρ (default: from ``splits``).
        weight_decay: λ of a data-independent ``λ/2·||w||²`` added to every candidate score (free).
        conversion: ρ_tot ↔ (ε, δ): ``"cks"`` (Canonne, Kamath & Steinke 2020, tight; the default) or
            ``"bun_steinke"`` (the paper's Lemma 3.8: 17-100 % less ρ for the same ε; reproduces its tables).
    """

    tracks_parameters = True  # its direction follows the parameters by position

    needs_sums = True

    spends_until_budget = True
    charges_unsampled = True
    queries_losses = True  # the noisy-min grid search over clipped per-row losses
    refuses_user_level = USER_LEVEL_REFUSAL

    def __init__(
        self,
        loss_clip: float = 3.0,
        splits: int = 60,
        gamma: float = 0.1,
        grid_size: int = 20,
        alpha_max: float = 2.0,
        tau: int = 10,
        eta: float = 0.1,
        alpha_max_cap: float | None = None,
        noise: NoiseKind = "exponential",
        rho_ng: float | None = None,
        rho_nmax: float | None = None,
        weight_decay: float = 0.0,
        conversion: ZCDPConversion = "cks",
    ) -> None:
        owner = "AdaptiveGD"
        if conversion not in ("cks", "bun_steinke"):
            raise DPConfigurationError(
                f"AdaptiveGD: conversion must be 'cks' or 'bun_steinke', got {conversion!r}."
            )
        self.conversion: ZCDPConversion = conversion
        for name, positive in (("loss_clip", loss_clip), ("gamma", gamma), ("alpha_max", alpha_max)):
            number(positive, name, owner=owner, low=0, low_open=True)
        for name, count in (("splits", splits), ("grid_size", grid_size), ("tau", tau)):
            number(count, name, owner=owner, low=1, integer=True)
        for name, rate in (("eta", eta), ("weight_decay", weight_decay)):
            number(rate, name, owner=owner, low=0)
        for name, given in (("alpha_max_cap", alpha_max_cap), ("rho_ng", rho_ng), ("rho_nmax", rho_nmax)):
            number(given, name, owner=owner, low=0, low_open=True, optional=True)
        if noise not in ("exponential", "laplace", "gumbel"):
            raise DPConfigurationError(f"noise must be 'exponential', 'laplace' or 'gumbel', got {noise!r}.")
        self.loss_clip, self.splits, self.gamma, self.grid_size = float(loss_clip), splits, gamma, grid_size
        self.alpha_max, self.tau, self.eta, self.alpha_max_cap = float(alpha_max), tau, eta, alpha_max_cap
        self.noise_kind: NoiseKind = noise
        self.weight_decay = weight_decay
        self._rho_ng_override, self._rho_nmax_override = rho_ng, rho_nmax
        self.rho_ng = rho_ng if rho_ng is not None else math.nan
        self.rho_nmax = rho_nmax if rho_nmax is not None else math.nan
        self.rho_total = math.nan
        self.iterations = 0
        self.rejections = 0
        self.noisy_min_calls = 0
        self.window: list[float] = []
        self.exhausted = False
        self.last: dict[str, float] = {}
        self._host: StepHost | None = None
        self._filter: PrivacyFilter | None = None
        self._clipping: Clipping | None = None

    # -- wiring --------------------------------------------------------------------------------------
    def plan(self, setup: StepSetup) -> StepPlan:
        """The ρ_ng-driven noise slot and the zCDP privacy filter that prices every release of the run."""
        if setup.target_epsilon is None:
            raise DPConfigurationError(
                "AdaptiveGD spends a budget, so it needs target_epsilon (and delta); it has no fixed step count."
            )
        if setup.accountant != "rdp":
            raise DPConfigurationError(
                "AdaptiveGD accounts in zCDP through a privacy filter: use accountant='rdp'."
            )
        if not setup.noise.is_constant or setup.noise.is_set:
            raise DPConfigurationError(
                "AdaptiveGD sets the noise of every measurement itself: do not pass noise or noise_multiplier."
            )
        if not setup.clipping.is_flat_l2:
            raise DPConfigurationError("AdaptiveGD needs flat L2 clipping (the default FlatClipping).")
        rho_tot, rho_ng, rho_nmax = initial_budgets(
            setup.target_epsilon, setup.delta, self.splits, self.conversion
        )
        self.rho_total = rho_tot
        if math.isnan(self.rho_ng):
            self.rho_ng = rho_ng
        if math.isnan(self.rho_nmax):
            self.rho_nmax = rho_nmax
        self._clipping = setup.clipping
        self._filter = PrivacyFilter(
            setup.target_epsilon,
            setup.delta,
            mode="zcdp",
            reserve=self._noisy_min_event(),
            conversion=self.conversion,
        )
        return StepPlan(noise=_AdaptiveNoise(self), ledger=self._filter)

    def bind(self, host: StepHost) -> None:
        self._host = host

    def _noisy_min_event(self) -> NoisyMin:
        return NoisyMin(NoisyMin.epsilon_for_rho(self.rho_nmax, self.noise_kind), self.noise_kind)

    @property
    def noisy_min_scale(self) -> float:
        """b = C_obj/ε_nm, the NoisyMin noise scale."""
        return self.loss_clip / NoisyMin.epsilon_for_rho(self.rho_nmax, self.noise_kind)

    # -- one iteration ----------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, ctx: StepContext) -> None:
        """Line search on the released gradient; refine it on rejection; move the weights (or not)."""
        del optimizer  # the step is exact: w ← w − α·d
        host, ledger = self._host, self._filter
        assert host is not None, "AdaptiveGD.bind() was not called"
        assert ledger is not None, "AdaptiveGD.plan() was not called"
        assert ctx.clipped_sums is not None, "AdaptiveGD needs the clipped sums (needs_sums)"
        assert ctx.noisy_sums is not None, "AdaptiveGD needs the noisy sums (needs_sums)"
        releases = host.releases
        sums, estimate = ctx.clipped_sums, [s.double() for s in ctx.noisy_sums]
        ctx.clipped_sums = ctx.noisy_sums = None
        precision = self.rho_ng  # the measurement just released cost exactly ρ_ng
        params = host.params
        assert host.module is not None
        probe = LossProbe(
            host.module, params, self.loss_clip, host.max_physical_batch_size, algorithm="AdaptiveGD"
        )
        grid = step_grid(self.alpha_max, self.grid_size)
        rejected = 0
        chosen = 0.0
        while True:
            norm = math.sqrt(sum(float((s * s).sum()) for s in estimate))
            direction = [s / norm if norm > 0 else torch.zeros_like(s) for s in estimate]
            event = self._noisy_min_event()
            if not releases.can_afford(event):
                self.exhausted = True
                break
            scores = releases.all_reduce([probe.along(host.batch, direction, grid)])[0]
            scores = scores + self._penalty(params, direction, grid, ctx)
            releases.spend(event, mechanism="AdaptiveGD's NoisyMin step-size selection")
            self.noisy_min_calls += 1
            index = self._select(scores, ctx.generator)
            if index > 0:
                chosen = grid[index]
                with torch.no_grad():
                    for p, d in zip(params, direction, strict=True):
                        p.sub_((chosen * d).to(p.dtype))
                break
            rejected += 1
            rho_new = (1.0 + self.gamma) * self.rho_ng
            extra = host.sampler.event(1.0 / math.sqrt(2.0 * (rho_new - precision)))
            if not releases.can_afford(extra):
                self.exhausted = True
                break
            releases.spend(extra, mechanism="AdaptiveGD's gradient re-measurement")
            again = self._measure(sums, rho_new - precision, ctx)
            estimate = grad_avg(estimate, precision, again, rho_new)
            precision = self.rho_ng = rho_new
            ledger.reserve = self._noisy_min_event()
        self._record(chosen, rejected)

    def _record(self, chosen: float, rejected: int) -> None:
        """The iteration's released outcome: the counters, ``last``, and α_max grown every τ accepted steps."""
        self.rejections += rejected
        self.last = {
            "alpha": chosen,
            "rejections": float(rejected),
            "rho_ng": self.rho_ng,
            "alpha_max": self.alpha_max,
        }
        if chosen > 0:
            self.iterations += 1
            self.window.append(chosen)
            if self.iterations % self.tau == 0:
                self.alpha_max = (1.0 + self.eta) * max(self.window)
                if self.alpha_max_cap is not None:
                    self.alpha_max = min(self.alpha_max, self.alpha_max_cap)
                self.window = []

    def _penalty(
        self, params: Sequence[Tensor], direction: list[Tensor], grid: list[float], ctx: StepContext
    ) -> Tensor:
        """n·λ/2·||w − α·d||² per candidate (data-independent: n is the public expected batch size)."""
        device = params[0].device
        if self.weight_decay == 0:
            return torch.zeros(len(grid), dtype=torch.float64, device=device)
        ww = sum(float((p.double() ** 2).sum()) for p in params)
        wd = sum(float((p.double() * d).sum()) for p, d in zip(params, direction, strict=True))
        dd = sum(float((d * d).sum()) for d in direction)
        values = [
            ctx.expected_batch_size * self.weight_decay / 2 * (ww - 2 * a * wd + a * a * dd) for a in grid
        ]
        return torch.tensor(values, dtype=torch.float64, device=device)

    def _select(self, scores: Tensor, generator: torch.Generator) -> int:
        """NoisyMin with noise drawn once (rank 0) and the index broadcast to every rank."""
        assert self._host is not None
        releases = self._host.releases
        index = (
            noisy_min(scores, self.noisy_min_scale, self.noise_kind, generator) if releases.rank == 0 else 0
        )
        return int(releases.broadcast([index], scores.device)[0])

    def _measure(self, sums: list[Tensor], rho: float, ctx: StepContext) -> list[Tensor]:
        """One more Gaussian measurement of the same clipped sum at cost ρ (priced by the caller)."""
        assert self._host is not None
        assert self._clipping is not None
        std = self._clipping.sensitivity(ctx) / math.sqrt(2.0 * rho)
        # The noise is added in place, and a rejected step measures the same clipped sums again: copy them.
        noisy = self._host.releases.noisy([s.clone() for s in sums], std, ctx.generator)
        return [n.double() for n in noisy]

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "rho_ng": self.rho_ng,
            "rho_nmax": self.rho_nmax,
            "alpha_max": self.alpha_max,
            "window": list(self.window),
            "iterations": self.iterations,
            "rejections": self.rejections,
            "noisy_min_calls": self.noisy_min_calls,
            "exhausted": self.exhausted,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rho_ng = float(state["rho_ng"])
        self.rho_nmax = float(state["rho_nmax"])
        self.alpha_max = float(state["alpha_max"])
        self.window = [float(a) for a in state["window"]]
        self.iterations = int(state["iterations"])
        self.rejections = int(state["rejections"])
        self.noisy_min_calls = int(state["noisy_min_calls"])
        self.exhausted = bool(state["exhausted"])
        if self._filter is not None:
            self._filter.reserve = self._noisy_min_event()
