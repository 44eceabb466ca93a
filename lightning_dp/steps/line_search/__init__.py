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

Layout: ``config.py`` holds the settings (``LineSearchConfig``) and the checkpointed state
(``LineSearchState``); ``svt.py`` the search and its direction, ``cheb.py`` CHEB, ``budget.py`` the
planner's solver and what an iteration costs, ``noise.py`` the noise slot. This module is the one class that
drives them per step (about 500 lines: the wiring, the budget's sizing and the step read and write the same
state, so they stay together).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from lightning_dp.accounting import PrivacyEvent, PrivacyFilter
from lightning_dp.accounting.line_search_events import LineSearchGradient, LineSearchJoint, LineSearchSVT
from lightning_dp.core.batches import EmptyBatch
from lightning_dp.core.draws import poisson_share
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.core.rng import make_generator, saved_states
from lightning_dp.slots import Sampler, Step, StepContext, StepHost, StepPlan, StepSetup, takes_config
from lightning_dp.steps.line_search.advice import warn_if_capped_by_eta0
from lightning_dp.steps.line_search.budget import (
    LINE_SEARCH_ORDERS,
    iteration_cost,
    plan_budget,
    split_budget,
)
from lightning_dp.steps.line_search.cheb import (
    angle_degrees,
    angle_ema,
    cheb_decision,
    reset_eta0,
    shrink_clips,
)
from lightning_dp.steps.line_search.config import PAPER_ETA0, LineSearchConfig, LineSearchState, eta0_for_clip
from lightning_dp.steps.line_search.noise import LineSearchNoise
from lightning_dp.steps.line_search.svt import (
    SearchResult,
    candidate_steps,
    noisy_backtracking,
    search_direction,
    svt_calibration,
)
from lightning_dp.steps.loss_queries import USER_LEVEL_REFUSAL, LossProbe

__all__ = ["PAPER_ETA0", "LineSearch", "LineSearchConfig", "LineSearchState", "eta0_for_clip"]


class LineSearch(Step):
    """DP-BLSGD: the step size of every iteration comes from a private Armijo backtracking search.

    ``DPStrategy(target_epsilon=..., step=LineSearch(...))``; the LightningModule must implement
    ``dp_per_sample_loss(batch) -> Tensor[B]``. The user's optimizer is not stepped (its lr is unused):
    the update is ``w ← w − η·(d + μw)`` with ``d`` the private gradient and η from the search.

    Takes the fields of :class:`LineSearchConfig` as keywords (``LineSearch(mode="adaptive",
    budget_increase=0.5)``), or a config (``LineSearch.from_config(LineSearchConfig(...))``); the settings
    are ``self.config`` (frozen), what a checkpoint carries ``self.state`` (:class:`LineSearchState`).
    """

    tracks_parameters = True  # its search state follows the parameters by position
    queries_losses = True  # the sparse-vector search over clipped per-row losses
    refuses_user_level = USER_LEVEL_REFUSAL

    @takes_config(LineSearchConfig)
    def __init__(self, **options: Any) -> None:
        self.config = LineSearchConfig(**options)
        self.seed = self.config.seed
        self.state = LineSearchState.initial(self.config)
        self._host: StepHost | None = None
        self._filter: PrivacyFilter | None = None
        self._target_epsilon: float | None = None
        self._given_sigma: float | None = None
        self._generators: dict[str, torch.Generator] = {}
        """The SVT noise ("svt") and the extra Poisson batches ("batches"), created on first use."""
        self._pending_generators: dict[str, Tensor] = {}
        self._probe: LossProbe | None = None

    @classmethod
    def from_config(cls, config: LineSearchConfig) -> LineSearch:
        """The step of these settings (the same as ``LineSearch(**fields)``)."""
        return cls(**config.options())

    # -- the state, as read by callers (metrics, tests, the advice) ------------------------------------
    @property
    def eta0(self) -> float | None:
        """The current first candidate (None until ``plan`` knows C in NN mode)."""
        return self.state.eta0

    @property
    def stats(self) -> dict[str, int]:
        """The searches, failures, CHEB rounds and raises so far (released counts)."""
        return self.state.stats

    @property
    def last(self) -> dict[str, float]:
        """The last search's accepted step size and its index."""
        return self.state.last

    @property
    def accepted(self) -> list[float]:
        """The step sizes accepted since η0 was last reset."""
        return self.state.accepted

    @property
    def iteration(self) -> int:
        """Iterations taken."""
        return self.state.iteration

    @property
    def c_grad(self) -> float | None:
        """C_grad, the gradient's clip bound now."""
        return self.state.c_grad

    @property
    def c_obj(self) -> float:
        """C_obj, the loss clip now."""
        return self.state.c_obj

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
        if self.config.mode == "adaptive" and setup.target_epsilon is None:
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
                mode="rdp_paper" if self.config.accounting == "paper" else "rdp",
                orders=LINE_SEARCH_ORDERS,
            )
        self.state.c_grad = float(setup.max_grad_norm)
        if self.state.eta0 is None:
            self.state.eta0 = eta0_for_clip(self.state.c_grad)
        return StepPlan(noise=LineSearchNoise(self), ledger=self._filter)

    def bind(self, host: StepHost) -> None:
        self._host = host

    @property
    def host(self) -> StepHost:
        assert self._host is not None, "LineSearch is not bound to an engine"
        return self._host

    def clip_bound(self, configured: float) -> float:
        """C_grad: the configured max_grad_norm, shrunk by DP-BLSGD-AC (eq. 9) after ρ_grad raises."""
        return configured if self.state.c_grad is None else self.state.c_grad

    @property
    def spends_until_budget(self) -> bool:  # type: ignore[override]
        """Adaptive mode raises its budget after failed searches and runs until the filter is spent."""
        return self.config.mode == "adaptive"

    def _set_from_rho(self, rho: float) -> None:
        """ρ_grad and the search budget of ρ (:func:`~.budget.split_budget`)."""
        self.state.rho_grad, self.state.search_budget = split_budget(self.config, rho)

    @property
    def _q(self) -> float:
        return float(self.host.sampler.sample_rate)

    @property
    def _joint(self) -> bool:
        return self.config.mode == "nn" and self.config.line_search_batch == "same"

    def svt_event(self, search_budget: float | None = None) -> LineSearchSVT:
        budget = self.state.search_budget if search_budget is None else search_budget
        assert budget is not None
        return LineSearchSVT(self.config.noise, budget, self._q, self.config.max_it, self.config.accounting)

    def gradient_event(self, sampler: Sampler, noise_multiplier: float) -> PrivacyEvent:
        rho = 1.0 / (2.0 * noise_multiplier**2)
        if self._joint:
            assert self.state.search_budget is not None
            return LineSearchJoint(
                rho,
                self.config.noise,
                self.state.search_budget,
                sampler.sample_rate,
                self.config.max_it,
                self.config.accounting,
            )
        return LineSearchGradient(rho, sampler.sample_rate, self.config.accounting)

    def _refresh_reserve(self) -> None:
        """The filter admits a gradient only if a search at the current budget still fits with it."""
        if self._filter is not None:
            self._filter.reserve = (
                None if self._joint or self.state.search_budget is None else self.svt_event()
            )

    def size_budget(self, sample_rate: float, steps: int) -> None:
        """Budget planner (§3.9): size the per-iteration budget so the planned iterations fit the filter."""
        ledger = self._filter
        if ledger is None or self._target_epsilon is None:
            raise DPConfigurationError(
                "LineSearch needs target_epsilon (or noise_multiplier) to set its budget."
            )
        budgets = ledger.rdp_budgets()
        cost = iteration_cost(self.config, sample_rate, ledger.orders)
        if self.config.mode == "adaptive":
            iterations = self.config.planned_iterations or 50
            if self.config.accounting == "paper":  # the paper's heuristic: ε_iter = ε / (2·T)
                self._set_from_rho((self._target_epsilon / (2 * iterations)) ** 2 / 2)
                self._refresh_reserve()
                return
            eps_iter = plan_budget(cost, budgets, iterations)
            self._set_from_rho(eps_iter**2 / 2)
        else:
            iterations = self.config.planned_iterations or steps
            self._set_from_rho(plan_budget(cost, budgets, iterations))
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
        return self.host.batch if self.config.line_search_batch == "same" else self._fresh_batch()

    # -- one search ------------------------------------------------------------------------------
    def _search(self, data: list[Tensor], on_fail: Literal["zero", "smallest"]) -> float | None:
        """NOISYBTLS along d = data + μw on the search batch; None when the search is unaffordable."""
        host = self.host
        releases = host.releases
        assert self.state.search_budget is not None
        event = None if self._joint else self.svt_event()
        if event is not None:
            if not releases.can_afford(event):
                return None
            # Priced before the search reads the data: check-before-spend, then the release.
            releases.spend(event, mechanism="LineSearch's sparse-vector search")
        params = host.params
        direction, d_sq, reg = search_direction(data, params, self.config.weight_decay)
        m = float(host.sampler.expected_batch_size)
        probe = self._loss_probe()
        probe.clip = self.state.c_obj
        batch = self._search_batch()
        calibration = svt_calibration(self.config.noise, self.state.search_budget, self.state.c_obj / m)
        eta0 = self.state.eta0
        assert eta0 is not None, "η0 is set by the first step"
        assert self.config.armijo is not None, "filled in from the mode"
        grid = candidate_steps(eta0, self.config.beta, self.config.max_it)
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
            beta=self.config.beta,
            max_it=self.config.max_it,
            c=self.config.armijo,
            calibration=calibration,
            generator=self._generator("svt"),
            on_fail=on_fail,
        )
        if releases.world_size > 1:
            eta, index = releases.broadcast([result.eta, float(result.index)], params[0].device)
            result = SearchResult(eta, int(index), self.config.max_it + 1)
        self._record(result)
        self._move(direction, result.eta)
        return result.eta

    def _record(self, result: SearchResult) -> None:
        """The search's released outcome in the counters, the accepted steps and ``last``."""
        self.state.stats["searches"] += 1
        if result.index == 0:
            self.state.stats["failures"] += 1
        else:
            self.state.stats["at_eta0"] += int(result.index == 1)
            self.state.accepted.append(result.eta)
        self.state.last = {"eta": result.eta, "index": result.index}

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
                self.state.c_obj,
                chunk_size=self.config.chunk_size,
                algorithm="LineSearch",
            )
        return self._probe

    def _cheb_gradient(self) -> list[Tensor] | None:
        """CHEB's second noisy gradient at the current ρ_grad on a fresh batch (None: unaffordable)."""
        host = self.host
        assert self.state.rho_grad is not None
        event = self.gradient_event(host.sampler, 1.0 / math.sqrt(2.0 * self.state.rho_grad))
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
        assert self.state.rho_grad is not None, "LineSearch has no budget yet"
        data = [
            (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)).float()
            for p in self.host.params
        ]
        if self.config.mode == "nn":
            eta = self._search(data, on_fail="smallest")
            stepped = eta is not None and eta > 0
        else:
            stepped = self._adaptive_iteration(data)
        if stepped:
            flat = torch.cat([g.reshape(-1) for g in data])
            if self.state.d_prev is not None and self.state.iteration > 0:
                prev = torch.cat([g.reshape(-1) for g in self.state.d_prev])
                self.state.theta_bar = angle_ema(
                    self.state.theta_bar, angle_degrees(flat, prev), self.config.angle_decay
                )
            self.state.d_prev = [g.detach().clone() for g in data]
        self.state.iteration += 1
        if (
            self.config.reset_every > 0
            and self.state.iteration % self.config.reset_every == 0
            and self.state.eta0 is not None
        ):
            self.state.eta0 = reset_eta0(
                self.state.eta0, self.state.accepted, self.config.reset_factor, self.config.eta0_growth
            )
            self.state.accepted = []
        self._refresh_reserve()

    def _adaptive_iteration(self, data: list[Tensor]) -> bool:
        """Alg. 2 lines 8-19: search; on failure CHEB (second gradient, angle test, average) and retry."""
        shrunk = False
        for _ in range(self.config.max_cheb_per_step + 1):
            eta = self._search(data, on_fail="zero")
            if eta is None:
                return False
            if eta > 0:
                return True
            second = self._cheb_gradient()
            if second is None:
                return False
            self.state.stats["cheb"] += 1
            assert self.state.rho_grad is not None
            assert self.state.search_budget is not None
            decision = cheb_decision(
                torch.cat([g.reshape(-1) for g in data]),
                torch.cat([g.reshape(-1) for g in second]),
                theta_bar=self.state.theta_bar,
                rho_grad=self.state.rho_grad,
                eps_bt=self.state.search_budget,
                xi=self.config.budget_increase,
                phi_max=self.config.angle_high,
                phi_min=self.config.angle_low,
            )
            self.state.rho_grad, self.state.search_budget = decision.rho_grad, decision.eps_bt
            self.state.stats["rho_raises"] += int(decision.raised_rho)
            self.state.stats["search_raises"] += int(decision.raised_search)
            for g, h in zip(data, second, strict=True):
                g.add_(h.to(g.dtype)).mul_(0.5)
            if self.config.adapt_clip and decision.raised_rho and not shrunk:  # eq. (9), once per iteration
                assert self.state.c_grad is not None
                self.state.c_grad, self.state.c_obj = shrink_clips(
                    self.state.c_grad, self.state.c_obj, self.config.clip_decay
                )
                self.state.stats["clip_shrinks"] += 1
                shrunk = True
        return False

    def finalize(self, optimizer: torch.optim.Optimizer) -> None:
        """At the end of training: advise a larger η0 when most searches accepted it and the optimizer's
        (unused) learning rate, tuned for DP-SGD, steps further (NN mode)."""
        if self.config.mode == "nn" and self.state.eta0 is not None:
            lr = max(float(group.get("lr", 0.0)) for group in optimizer.param_groups)
            warn_if_capped_by_eta0(self.state.stats, self.state.eta0, lr)

    # -- released values and state ----------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Only released (or post-processed) quantities: safe to log."""
        return {
            "ls/eta": float(self.state.last["eta"]),
            "ls/accepted_index": float(self.state.last["index"]),
            "ls/eta0": float("nan") if self.state.eta0 is None else self.state.eta0,
            "ls/rho_grad": float(self.state.rho_grad or 0.0),
            "ls/search_budget": float(self.state.search_budget or 0.0),
            "ls/max_grad_norm": float(self.state.c_grad or 0.0),
            "ls/loss_clip": self.state.c_obj,
            "ls/theta_bar": self.state.theta_bar,
            **{f"ls/{k}": float(v) for k, v in self.state.stats.items()},
        }

    def state_dict(self) -> dict[str, Any]:
        """The state's fields (:class:`LineSearchState`) and the generators' states (seeded runs only)."""
        return {**self.state.to_dict(), "generators": saved_states(self._generators, self.seed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict``'s keys (the layout before the state was a dataclass is the same)."""
        self.state = LineSearchState.from_dict(state)
        saved = self.state.d_prev
        if saved is not None and self._host is not None and self._host.attached:
            self.state.d_prev = [g.to(p.device) for g, p in zip(saved, self._host.params, strict=True)]
        self._generators = {}
        self._pending_generators = dict(state.get("generators", {}))
        if self._host is not None and self.state.c_grad is not None:
            self._refresh_reserve()
