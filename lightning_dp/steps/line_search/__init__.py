"""DP stochastic backtracking line search (DP-BLSGD; Chen & Lee 2022) in the step slot.

The step asks the data, privately, how far to move along the released noisy gradient ``d``: Armijo
backtracking over ``η0, βη0, …, β^(max_it−1)η0`` where every sufficient-decrease test is a threshold
query answered by the sparse vector technique (AboveThreshold), so one whole search costs about one
query's budget. Adaptive mode (convex models) adds CHEB: when a search fails, a second noisy gradient
on a fresh batch is compared by angle with the first, and either the gradient budget ρ_grad or the
search budget ε_BT grows by (1+ξ); DP-BLSGD-AC also shrinks both clip thresholds. NN mode (Sec. 5.7)
has a fixed per-iteration budget and falls back to the smallest step instead of failing.

Accounting (see docs/mechanisms.md): by default every data access reads its own Poisson batch and is
amplified separately, SVT is priced with the bounds that are proven (Zhu & Wang 2020 terms, pure-DP
conversions) and every amplification takes the minimum of valid bounds. ``accounting="paper"``
reproduces the paper literally: Thms 2/3 for SVT, Lemma 4 (general) amplification without the minimum,
one batch shared by the gradient and its searches, and the ln(1/δ) multi-order stopping rule.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from lightning_dp.accounting import PrivacyEvent, PrivacyFilter
from lightning_dp.accounting.line_search_events import LineSearchGradient, LineSearchJoint, LineSearchSVT
from lightning_dp.accounting.rdp import event_rdp
from lightning_dp.core import validation
from lightning_dp.core.batches import EmptyBatch
from lightning_dp.core.draws import poisson_share
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.core.rng import make_generator, saved_states
from lightning_dp.core.validation import flag, number
from lightning_dp.slots import Sampler, Step, StepContext, StepHost, StepPlan, StepSetup
from lightning_dp.steps.line_search.advice import warn_if_capped_by_eta0
from lightning_dp.steps.line_search.budget import LINE_SEARCH_ORDERS, plan_budget
from lightning_dp.steps.line_search.cheb import (
    angle_degrees,
    angle_ema,
    cheb_decision,
    reset_eta0,
    shrink_clips,
)
from lightning_dp.steps.line_search.noise import LineSearchNoise
from lightning_dp.steps.line_search.svt import (
    SearchResult,
    SVTNoise,
    candidate_steps,
    noisy_backtracking,
    svt_calibration,
)
from lightning_dp.steps.loss_queries import LossProbe

Accounting = Literal["safe", "paper"]
Mode = Literal["nn", "adaptive"]
BatchRule = Literal["fresh", "same"]


PAPER_ETA0 = 1.0
"""The paper's first candidate step size (adaptive mode's default, and NN mode's when C is infinite)."""


def eta0_for_clip(max_grad_norm: float) -> float:
    """NN mode's default first candidate, 1/C: the private gradient's signal part has norm at most C, so
    the largest candidate moves the weights about one unit along it whatever C is. Measured with
    bench/mechanisms.py (3 epochs, ε = 3, seed 0): on the MNIST CNN (C = 0.1) η0 = 1 reached 0.736 test
    accuracy, η0 = 4 0.910 and η0 = 1/C = 10 0.951, against DP-SGD's 0.847; on the digits MLP and the
    text GRU (C = 1) 1/C is the paper's η0 = 1, and η0 = 2 lost 3-16 points; with the paper's C = 3 it
    is 0.33, next to the 0.3 that bench/line_search_mnist.py found best."""
    return 1.0 / max_grad_norm if math.isfinite(max_grad_norm) and max_grad_norm > 0 else PAPER_ETA0


class LineSearch(Step):
    """DP-BLSGD: the step size of every iteration comes from a private Armijo backtracking search.

    ``DPStrategy(target_epsilon=..., step=LineSearch(...))``; the LightningModule must implement
    ``dp_per_sample_loss(batch) -> Tensor[B]``. The user's optimizer is not stepped (its lr is unused):
    the update is ``w ← w − η·(d + μw)`` with ``d`` the private gradient and η from the search.

    Args:
        mode: ``"nn"`` (Sec. 5.7: fixed per-iteration budget split ``grad_fraction`` / rest between the
            gradient and one search; a failed search takes the smallest step) or ``"adaptive"`` (Alg. 2:
            a failed search calls CHEB, which draws a second gradient and raises ρ_grad or the search
            budget by (1+ξ), and retries).
        noise: ``"laplace"`` (pure-DP SVT; default, the tighter one) or ``"gaussian"`` SVT.
        accounting: ``"safe"`` (default: proven bounds, see docs/mechanisms.md) or ``"paper"`` (Thms 2/3,
            Lemma 4 without the minimum, one batch per iteration, ln(1/δ) filter; reproduction only).
        line_search_batch: ``"fresh"`` (every data access draws its own Poisson batch; default) or
            ``"same"`` (the search reads the gradient's batch: priced jointly in NN mode; in adaptive
            mode only with ``accounting="paper"``).
        loss_clip: C_obj; each per-example loss is clamped to [0, C_obj]. Default 3 (NN), 1 (adaptive).
        armijo: the sufficient-decrease constant c. Default 0.001 (NN), 0.5 (adaptive).
        beta: β, the ratio between successive candidate step sizes η0·β^i (default 0.8).
        max_it: the number of candidates, i < max_it (default 10).
        eta0: η0, the largest candidate step size. Defaults in NN mode to 1/C (C = ``max_grad_norm``), so
            the largest candidate moves the weights about one unit along the clipped gradient whatever C
            is (:func:`eta0_for_clip`); in adaptive mode to the paper's 1.
        reset_every: τ, in iterations: every τ iterations η0 ← min(ς·max accepted η, η0) (default 10).
        reset_factor: ς of that reset (default 1.2).
        eta0_growth: drop the min of that reset, so η0 may grow (default False).
        grad_fraction: NN mode: share of the per-iteration zCDP budget spent on the gradient.
        planned_iterations: adaptive mode: the planner sizes ε_iter so this many nominal iterations use
            the budget (default 50, the paper's heuristic); NN mode: default the Trainer's planned steps.
        budget_increase: CHEB's ξ: a failed search raises ρ_grad or the search budget by (1+ξ) (default 0.3).
        angle_high: CHEB's φ_max (default 1.1).
        angle_low: CHEB's φ_min (default 0.5).
        angle_decay: ψ, the EMA factor of CHEB's angle (default 0.8).
        adapt_clip: DP-BLSGD-AC: shrink C_grad and C_obj by (1−ζ) when CHEB raises ρ_grad (default False).
        clip_decay: ζ of that shrink (default 0.05).
        weight_decay: μ of the data-independent regulariser (μ/2)‖w‖² added to the objective.
        max_cheb_per_step: adaptive mode: at most this many CHEB rounds per iteration (compute cap; a
            decision on released values only, so it changes no privacy cost).
        seed: seeds the SVT noise and the extra Poisson batches (default: ``os.urandom``).
        chunk_size: evaluate the candidates on at most this many examples per forward.
    """

    tracks_parameters = True  # its search state follows the parameters by position

    def __init__(
        self,
        mode: Mode = "nn",
        noise: SVTNoise = "laplace",
        accounting: Accounting = "safe",
        line_search_batch: BatchRule = "fresh",
        loss_clip: float | None = None,
        armijo: float | None = None,
        beta: float = 0.8,
        max_it: int = 10,
        eta0: float | None = None,
        reset_every: int = 10,
        reset_factor: float = 1.2,
        eta0_growth: bool = False,
        grad_fraction: float = 0.9,
        planned_iterations: int | None = None,
        budget_increase: float = 0.3,
        angle_high: float = 1.1,
        angle_low: float = 0.5,
        angle_decay: float = 0.8,
        adapt_clip: bool = False,
        clip_decay: float = 0.05,
        weight_decay: float = 0.0,
        max_cheb_per_step: int = 20,
        seed: int | None = None,
        chunk_size: int | None = None,
    ) -> None:
        if mode not in ("nn", "adaptive"):
            raise DPConfigurationError(f"LineSearch mode must be 'nn' or 'adaptive', got {mode!r}.")
        if noise not in ("laplace", "gaussian"):
            raise DPConfigurationError(f"LineSearch noise must be 'laplace' or 'gaussian', got {noise!r}.")
        if accounting not in ("safe", "paper"):
            raise DPConfigurationError(
                f"LineSearch accounting must be 'safe' or 'paper', got {accounting!r}."
            )
        if line_search_batch not in ("fresh", "same"):
            raise DPConfigurationError(
                f"line_search_batch must be 'fresh' or 'same', got {line_search_batch!r}."
            )
        if line_search_batch == "same" and mode == "adaptive" and accounting == "safe":
            raise DPConfigurationError(
                "LineSearch(mode='adaptive', line_search_batch='same') retries the search on the gradient's "
                "batch an adaptive number of times; no theorem prices that jointly. Use "
                "line_search_batch='fresh' (default), or accounting='paper' to reproduce the paper."
            )
        positive: dict[str, Any] = {"low": 0, "low_open": True}
        unit: dict[str, Any] = {"low": 0, "high": 1, "low_open": True, "high_open": True}
        count: dict[str, Any] = {"low": 1, "integer": True}
        for name, value, bounds in (
            ("loss_clip", loss_clip, {**positive, "optional": True}),
            ("armijo", armijo, {**unit, "optional": True}),
            ("beta", beta, unit),
            ("max_it", max_it, count),
            ("eta0", eta0, {**positive, "optional": True}),
            ("reset_every", reset_every, {"low": 0, "integer": True}),
            ("reset_factor", reset_factor, positive),
            ("grad_fraction", grad_fraction, unit),
            ("planned_iterations", planned_iterations, {**count, "optional": True}),
            ("budget_increase", budget_increase, {"low": 0}),
            ("angle_high", angle_high, positive),
            ("angle_low", angle_low, positive),
            ("angle_decay", angle_decay, {"low": 0, "high": 1}),
            ("clip_decay", clip_decay, {"low": 0}),
            ("weight_decay", weight_decay, {"low": 0}),
            ("max_cheb_per_step", max_cheb_per_step, count),
            ("chunk_size", chunk_size, {**count, "optional": True}),
        ):
            number(value, name, owner="LineSearch", **bounds)
        for name, switch in (("eta0_growth", eta0_growth), ("adapt_clip", adapt_clip)):
            flag(switch, name, owner="LineSearch")
        validation.seed(seed, owner="LineSearch")
        self.mode: Mode = mode
        self.noise: SVTNoise = noise
        self.accounting: Accounting = accounting
        self.line_search_batch: BatchRule = line_search_batch
        self.loss_clip = float(loss_clip if loss_clip is not None else (3.0 if mode == "nn" else 1.0))
        self.armijo = float(armijo if armijo is not None else (0.001 if mode == "nn" else 0.5))
        self.beta, self.max_it = float(beta), int(max_it)
        self.reset_every, self.reset_factor, self.eta0_growth = (
            int(reset_every),
            float(reset_factor),
            eta0_growth,
        )
        self.grad_fraction = float(grad_fraction)
        self.planned_iterations = planned_iterations
        self.xi, self.phi_max, self.phi_min, self.psi = budget_increase, angle_high, angle_low, angle_decay
        self.adapt_clip, self.zeta = adapt_clip, float(clip_decay)
        self.weight_decay = float(weight_decay)
        self.max_cheb_per_step = int(max_cheb_per_step)
        self.seed, self.chunk_size = seed, chunk_size
        self._host: StepHost | None = None
        self._filter: PrivacyFilter | None = None
        self._target_epsilon: float | None = None
        self._given_sigma: float | None = None
        # -- state (checkpointed) --
        self.rho_grad: float | None = None
        self.search_budget: float | None = None  # ε_BT (Laplace) or ρ_BT (Gaussian)
        self.c_obj = self.loss_clip
        self.c_grad: float | None = None
        self.eta0: float | None = float(eta0) if eta0 is not None else (None if mode == "nn" else PAPER_ETA0)
        """The first candidate; None until ``plan`` knows C (NN mode's default, 1/C)."""
        self.accepted: list[float] = []
        self.iteration = 0
        self.theta_bar = 90.0
        self.d_prev: list[Tensor] | None = None
        self.stats = {
            "searches": 0,
            "failures": 0,
            "at_eta0": 0,
            "cheb": 0,
            "rho_raises": 0,
            "search_raises": 0,
            "clip_shrinks": 0,
        }
        self.last = {"eta": 0.0, "index": 0}
        self._generators: dict[str, torch.Generator] = {}
        """The SVT noise ("svt") and the extra Poisson batches ("batches"), created on first use."""
        self._pending_generators: dict[str, Tensor] = {}
        self._probe: LossProbe | None = None

    # -- wiring -------------------------------------------------------------------------------
    def plan(self, setup: StepSetup) -> StepPlan:
        """Bring the noise slot (σ follows ρ_grad) and, under a target, the RDP privacy filter."""
        noise = setup.noise
        if noise.is_constant:
            self._given_sigma = noise.noise_multiplier(0) if noise.is_set else None
        elif not isinstance(noise, LineSearchNoise):
            raise DPConfigurationError(
                f"LineSearch sets the gradient noise itself (σ = 1/√(2ρ_grad)); remove noise={type(noise).__name__}."
            )
        if setup.accountant != "rdp":
            raise DPConfigurationError(
                "LineSearch prices sparse-vector searches in RDP: use accountant='rdp'."
            )
        if self.mode == "adaptive" and setup.target_epsilon is None:
            raise DPConfigurationError(
                "LineSearch(mode='adaptive') chooses its releases from earlier noisy results (CHEB raises ρ_grad "
                "and the search budget after a failed search), so the composition of what it happened to release "
                "is not a privacy guarantee: only a budget fixed in advance is (a privacy filter, Feldman & Zrnic "
                "2021). Give target_epsilon=... (noise_multiplier may stay as the starting σ), or use "
                "LineSearch(mode='nn'), whose per-iteration cost is fixed."
            )
        if self._given_sigma is not None:
            if self._given_sigma <= 0:
                raise DPConfigurationError("LineSearch needs noise_multiplier > 0.")
            self._set_from_rho(1.0 / (2.0 * self._given_sigma**2))
        self._target_epsilon = setup.target_epsilon
        if setup.target_epsilon is not None:
            self._filter = PrivacyFilter(
                setup.target_epsilon,
                setup.delta,
                mode="rdp_paper" if self.accounting == "paper" else "rdp",
                orders=LINE_SEARCH_ORDERS,
            )
        self.c_grad = float(setup.max_grad_norm)
        if self.eta0 is None:
            self.eta0 = eta0_for_clip(self.c_grad)
        return StepPlan(noise=LineSearchNoise(self), ledger=self._filter)

    def bind(self, host: StepHost) -> None:
        self._host = host

    @property
    def host(self) -> StepHost:
        assert self._host is not None, "LineSearch is not bound to an engine"
        return self._host

    def clip_bound(self, configured: float) -> float:
        """C_grad: the configured max_grad_norm, shrunk by DP-BLSGD-AC (eq. 9) after ρ_grad raises."""
        return configured if self.c_grad is None else self.c_grad

    @property
    def spends_until_budget(self) -> bool:  # type: ignore[override]
        """Adaptive mode raises its budget after failed searches and runs until the filter is spent."""
        return self.mode == "adaptive"

    def _set_from_rho(self, rho: float) -> None:
        """NN mode: ρ is the per-iteration budget ρ_iter; adaptive: ρ is ρ_grad (ε_iter = √(2ρ), A22)."""
        if self.mode == "nn":
            self.rho_grad = self.grad_fraction * rho
            rho_bt = (1 - self.grad_fraction) * rho
            self.search_budget = math.sqrt(2 * rho_bt) if self.noise == "laplace" else rho_bt
        else:
            self.rho_grad = rho
            eps_iter = math.sqrt(2 * rho)
            self.search_budget = eps_iter if self.noise == "laplace" else eps_iter**2 / 2

    @property
    def _q(self) -> float:
        return float(self.host.sampler.sample_rate)

    @property
    def _joint(self) -> bool:
        return self.mode == "nn" and self.line_search_batch == "same"

    def svt_event(self, search_budget: float | None = None) -> LineSearchSVT:
        budget = self.search_budget if search_budget is None else search_budget
        assert budget is not None
        return LineSearchSVT(self.noise, budget, self._q, self.max_it, self.accounting)

    def gradient_event(self, sampler: Sampler, noise_multiplier: float) -> PrivacyEvent:
        rho = 1.0 / (2.0 * noise_multiplier**2)
        if self._joint:
            assert self.search_budget is not None
            return LineSearchJoint(
                rho, self.noise, self.search_budget, sampler.sample_rate, self.max_it, self.accounting
            )
        return LineSearchGradient(rho, sampler.sample_rate, self.accounting)

    def _refresh_reserve(self) -> None:
        """The filter admits a gradient only if a search at the current budget still fits with it."""
        if self._filter is not None:
            self._filter.reserve = None if self._joint or self.search_budget is None else self.svt_event()

    def size_budget(self, sample_rate: float, steps: int) -> None:
        """Budget planner (§3.9): size the per-iteration budget so the planned iterations fit the filter."""
        ledger = self._filter
        if ledger is None or self._target_epsilon is None:
            raise DPConfigurationError(
                "LineSearch needs target_epsilon (or noise_multiplier) to set its budget."
            )
        budgets = ledger.rdp_budgets()
        orders = ledger.orders
        k = self.max_it
        if self.mode == "adaptive":
            iterations = self.planned_iterations or 50
            if self.accounting == "paper":  # the paper's heuristic: ε_iter = ε / (2·T)
                self._set_from_rho((self._target_epsilon / (2 * iterations)) ** 2 / 2)
                self._refresh_reserve()
                return

            def adaptive_cost(eps_iter: float) -> np.ndarray:
                budget = eps_iter if self.noise == "laplace" else eps_iter**2 / 2
                grad = LineSearchGradient(eps_iter**2 / 2, sample_rate, self.accounting)
                svt = LineSearchSVT(self.noise, budget, sample_rate, k, self.accounting)
                return event_rdp(grad, orders) + event_rdp(svt, orders)

            eps_iter = plan_budget(adaptive_cost, budgets, iterations)
            self._set_from_rho(eps_iter**2 / 2)
        else:
            iterations = self.planned_iterations or steps

            def nn_cost(rho_iter: float) -> np.ndarray:
                rho_grad = self.grad_fraction * rho_iter
                rho_bt = (1 - self.grad_fraction) * rho_iter
                budget = math.sqrt(2 * rho_bt) if self.noise == "laplace" else rho_bt
                if self._joint:
                    return event_rdp(
                        LineSearchJoint(rho_grad, self.noise, budget, sample_rate, k, self.accounting), orders
                    )
                grad = LineSearchGradient(rho_grad, sample_rate, self.accounting)
                svt = LineSearchSVT(self.noise, budget, sample_rate, k, self.accounting)
                return event_rdp(grad, orders) + event_rdp(svt, orders)

            self._set_from_rho(plan_budget(nn_cost, budgets, iterations))
        self._refresh_reserve()

    # -- helpers -----------------------------------------------------------------------------------
    def _generator(self, which: str) -> torch.Generator:
        gen = self._generators.get(which)
        if gen is None:
            gen = make_generator(self.seed, stream=f"line_search/{which}/{self.host.releases.rank}")
            pending = self._pending_generators.pop(which, None)
            if pending is not None:
                gen.set_state(pending)
            self._generators[which] = gen
        return gen

    def _fresh_batch(self) -> Any:
        """One more Poisson batch (rate q) of this rank's share, on the model's device."""
        from lightning.fabric.utilities.apply_func import move_data_to_device

        host = self.host
        if host.train_data is None:
            raise DPConfigurationError("LineSearch draws extra batches: train through DPStrategy.")

        dataset, collate = host.train_data
        rank, world = host.releases.rank, host.releases.world_size
        chosen = poisson_share(len(dataset), self._q, self._generator("batches"), rank, world)  # O(batch)
        if len(chosen) == 0:
            return EmptyBatch()
        if isinstance(dataset, TensorDataset):  # index the tensors at once (tabular data, no Python loop)
            batch = [t[chosen] for t in dataset.tensors]
        else:
            batch = collate([dataset[i] for i in chosen.tolist()])
        return move_data_to_device(batch, host.params[0].device)

    def _search_batch(self) -> Any:
        return self.host.batch if self.line_search_batch == "same" else self._fresh_batch()

    # -- one search ------------------------------------------------------------------------------
    def _search(self, data: list[Tensor], on_fail: Literal["zero", "smallest"]) -> float | None:
        """NOISYBTLS along d = data + μw on the search batch; None when the search is unaffordable."""
        host = self.host
        releases = host.releases
        assert self.search_budget is not None
        event = None if self._joint else self.svt_event()
        if event is not None:
            if not releases.can_afford(event):
                return None
            # Priced before the search reads the data: check-before-spend, then the release.
            releases.spend(event, mechanism="LineSearch's sparse-vector search")
        params = host.params
        mu = self.weight_decay
        with torch.no_grad():
            direction = [g + mu * p.detach().to(g.dtype) for g, p in zip(data, params, strict=True)]
            d_sq = math.fsum(float((x.double() ** 2).sum()) for x in direction)
            w_sq = math.fsum(float((p.detach().double() ** 2).sum()) for p in params)
            w_d = math.fsum(
                float((p.detach().double() * x.double()).sum())
                for p, x in zip(params, direction, strict=True)
            )
        m = float(host.sampler.expected_batch_size)

        def reg(eta: float) -> float:
            return 0.5 * mu * (w_sq - 2 * eta * w_d + eta * eta * d_sq) if mu else 0.0

        probe = self._loss_probe()
        probe.clip = self.c_obj
        batch = self._search_batch()
        calibration = svt_calibration(self.noise, self.search_budget, self.c_obj / m)
        eta0 = self.eta0
        assert eta0 is not None, "η0 is set by the first step"
        grid = candidate_steps(eta0, self.beta, self.max_it)
        if releases.world_size > 1:
            # One collective: F at w and at every candidate, summed over ranks; rank 0 runs the SVT.
            sums = releases.all_reduce([probe.along(batch, direction, [0.0, *grid])])[0]
            values = [float(v) / m + reg(eta) for v, eta in zip(sums.tolist(), [0.0, *grid], strict=True)]
            f0 = values[0]

            def loss_at(i: int, eta: float) -> float:
                return values[i + 1]
        else:
            f0 = float(probe.along(batch, direction, [0.0])[0]) / m + reg(0.0)

            def loss_at(i: int, eta: float) -> float:  # one forward per candidate the search asks for
                return float(probe.along(batch, direction, [eta])[0]) / m + reg(eta)

        result = noisy_backtracking(
            f0,
            loss_at,
            d_sq,
            eta0=eta0,
            beta=self.beta,
            max_it=self.max_it,
            c=self.armijo,
            calibration=calibration,
            generator=self._generator("svt"),
            on_fail=on_fail,
        )
        if releases.world_size > 1:
            eta, index = releases.broadcast([result.eta, float(result.index)], params[0].device)
            result = SearchResult(eta, int(index), self.max_it + 1)
        self.stats["searches"] += 1
        if result.index == 0:
            self.stats["failures"] += 1
        else:
            self.stats["at_eta0"] += int(result.index == 1)
            self.accepted.append(result.eta)
        self.last = {"eta": result.eta, "index": result.index}
        self._move(direction, result.eta)
        return result.eta

    def _move(self, direction: list[Tensor], eta: float) -> None:
        if eta == 0:
            return
        with torch.no_grad():
            for p, d in zip(self.host.params, direction, strict=True):
                p.sub_(eta * d.to(p.dtype))

    def _loss_probe(self) -> LossProbe:
        if self._probe is None:
            host = self.host
            assert host.module is not None
            self._probe = LossProbe(
                host.module,
                host.params,
                self.c_obj,
                chunk_size=self.chunk_size,
                algorithm="LineSearch",
            )
        return self._probe

    def _cheb_gradient(self) -> list[Tensor] | None:
        """CHEB's second noisy gradient at the current ρ_grad on a fresh batch (None: unaffordable)."""
        host = self.host
        assert self.rho_grad is not None
        event = self.gradient_event(host.sampler, 1.0 / math.sqrt(2.0 * self.rho_grad))
        if isinstance(event, LineSearchJoint) or not host.releases.can_afford(event, reserve=True):
            return None
        batch = self._fresh_batch()

        for p in host.params:
            p.grad = None
        host.clear_gradients()
        if not isinstance(batch, EmptyBatch):
            loss_fn = self._loss_probe().loss_fn
            with torch.enable_grad():
                losses = loss_fn(batch)
                loss = losses.mean() if host.loss_reduction == "mean" else losses.sum()
                loss.backward()
        released = host.private_gradient(event)
        for p in host.params:
            p.grad = None
        return [g.detach() for g in released]

    # -- the step ----------------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, ctx: StepContext) -> None:
        del optimizer, ctx
        assert self.rho_grad is not None, "LineSearch has no budget yet"
        data = [
            (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)).float()
            for p in self.host.params
        ]
        if self.mode == "nn":
            eta = self._search(data, on_fail="smallest")
            stepped = eta is not None and eta > 0
        else:
            stepped = self._adaptive_iteration(data)
        if stepped:
            flat = torch.cat([g.reshape(-1) for g in data])
            if self.d_prev is not None and self.iteration > 0:
                prev = torch.cat([g.reshape(-1) for g in self.d_prev])
                self.theta_bar = angle_ema(self.theta_bar, angle_degrees(flat, prev), self.psi)
            self.d_prev = [g.detach().clone() for g in data]
        self.iteration += 1
        if self.reset_every > 0 and self.iteration % self.reset_every == 0 and self.eta0 is not None:
            self.eta0 = reset_eta0(self.eta0, self.accepted, self.reset_factor, self.eta0_growth)
            self.accepted = []
        self._refresh_reserve()

    def _adaptive_iteration(self, data: list[Tensor]) -> bool:
        """Alg. 2 lines 8-19: search; on failure CHEB (second gradient, angle test, average) and retry."""
        shrunk = False
        for _ in range(self.max_cheb_per_step + 1):
            eta = self._search(data, on_fail="zero")
            if eta is None:
                return False
            if eta > 0:
                return True
            second = self._cheb_gradient()
            if second is None:
                return False
            self.stats["cheb"] += 1
            assert self.rho_grad is not None
            assert self.search_budget is not None
            decision = cheb_decision(
                torch.cat([g.reshape(-1) for g in data]),
                torch.cat([g.reshape(-1) for g in second]),
                theta_bar=self.theta_bar,
                rho_grad=self.rho_grad,
                eps_bt=self.search_budget,
                xi=self.xi,
                phi_max=self.phi_max,
                phi_min=self.phi_min,
            )
            self.rho_grad, self.search_budget = decision.rho_grad, decision.eps_bt
            self.stats["rho_raises"] += int(decision.raised_rho)
            self.stats["search_raises"] += int(decision.raised_search)
            for g, h in zip(data, second, strict=True):
                g.add_(h.to(g.dtype)).mul_(0.5)
            if self.adapt_clip and decision.raised_rho and not shrunk:  # eq. (9), once per iteration
                assert self.c_grad is not None
                self.c_grad, self.c_obj = shrink_clips(self.c_grad, self.c_obj, self.zeta)
                self.stats["clip_shrinks"] += 1
                shrunk = True
        return False

    def finalize(self, optimizer: torch.optim.Optimizer) -> None:
        """At the end of training: advise a larger η0 when most searches accepted it and the optimizer's
        (unused) learning rate, tuned for DP-SGD, steps further (NN mode)."""
        if self.mode == "nn" and self.eta0 is not None:
            lr = max(float(group.get("lr", 0.0)) for group in optimizer.param_groups)
            warn_if_capped_by_eta0(self.stats, self.eta0, lr)

    # -- released values and state ----------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Only released (or post-processed) quantities: safe to log."""
        return {
            "ls/eta": float(self.last["eta"]),
            "ls/accepted_index": float(self.last["index"]),
            "ls/eta0": float("nan") if self.eta0 is None else self.eta0,
            "ls/rho_grad": float(self.rho_grad or 0.0),
            "ls/search_budget": float(self.search_budget or 0.0),
            "ls/max_grad_norm": float(self.c_grad or 0.0),
            "ls/loss_clip": self.c_obj,
            "ls/theta_bar": self.theta_bar,
            **{f"ls/{k}": float(v) for k, v in self.stats.items()},
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "rho_grad": self.rho_grad,
            "search_budget": self.search_budget,
            "c_obj": self.c_obj,
            "c_grad": self.c_grad,
            "eta0": self.eta0,
            "accepted": list(self.accepted),
            "iteration": self.iteration,
            "theta_bar": self.theta_bar,
            "d_prev": None if self.d_prev is None else [g.detach().cpu().clone() for g in self.d_prev],
            "stats": dict(self.stats),
            "last": dict(self.last),
            "generators": saved_states(self._generators, self.seed),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rho_grad, self.search_budget = state["rho_grad"], state["search_budget"]
        self.c_obj, self.c_grad = float(state["c_obj"]), state["c_grad"]
        self.eta0 = None if state["eta0"] is None else float(state["eta0"])
        self.accepted = list(state["accepted"])
        self.iteration, self.theta_bar = int(state["iteration"]), float(state["theta_bar"])
        self.stats, self.last = {**self.stats, **state["stats"]}, dict(state["last"])
        saved = state["d_prev"]
        if saved is None or self._host is None or not self._host.attached:
            self.d_prev = saved
        else:
            self.d_prev = [g.to(p.device) for g, p in zip(saved, self._host.params, strict=True)]
        self._generators = {}
        self._pending_generators = dict(state.get("generators", {}))
        if self._host is not None and self.c_grad is not None:
            self._refresh_reserve()
