"""DPIS (Wei et al., CCS 2022): DP-SGD with importance sampling by clipped gradient norm.

Each example joins a step with probability ``b·c_i/K~`` (``c_i`` its clipped norm, ``K~`` a noisy sum
of clipped norms released once per epoch) and contributes ``(K~/N~)·u_i`` (its unit gradient direction
scaled to the sensitivity). Selection is two-round rejection sampling: candidates are drawn from
stale envelopes ``ghat_i`` (so per-example gradients are computed for about ``k·b`` examples), then
each is accepted with probability ``c_i/ghat_i``. One step is exactly a Poisson-subsampled Gaussian
with ``q = b/(N~·r)`` and noise multiplier ``σ_G/r``, ``r = K~/(N~·C)`` (Eq. 13 reparametrised), so
the ordinary ledger prices it. Follows ``specs/dpis.md``; the paper's weight (off by ``b``) and its
lower clamp ``b·C`` (which lets first-round probabilities saturate) are corrected, see §7 A1/A4.

A little over 500 lines, one file per paper (CONTRIBUTING.md): the paper's equations and the sampler slot
that applies them at each epoch (the released K~ and N~, σ's schedule) and step (the two rounds, the weights).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_dp.accounting import Gaussian, PoissonGaussian, PrivacyEvent
from lightning_dp.accounting.rdp import epsilon_from_rdp, segment_rdp
from lightning_dp.core import validation
from lightning_dp.core.batches import IndicesWithInfo
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.core.rng import make_generator, saved_states
from lightning_dp.core.validation import flag, number
from lightning_dp.per_example import PerExampleGradients
from lightning_dp.slots import Sampler, SamplerRuntime, StepContext
from lightning_dp.slots.release import Releases

__all__ = [
    "DPIS",
    "DPISEpoch",
    "acceptance_probabilities",
    "dpis_step_event",
    "first_round_probabilities",
    "schedule_sigma",
]


def first_round_probabilities(ghat: Tensor, batch_size: float, k_tilde: float) -> Tensor:
    """``q_i = min(1, b·ghat_i/K~)``; the clamp never binds when ``K~ ≥ k·b·C`` (spec §7 A4)."""
    return (batch_size * ghat / k_tilde).clamp(max=1.0)


def acceptance_probabilities(norms: Tensor, ghat: Tensor, clip: float) -> tuple[Tensor, Tensor]:
    """Second round: ``c_i = min(n_i, ghat_i, C)`` and ``p_i = c_i/ghat_i`` (so ``q_i p_i = b c_i/K~``)."""
    c = torch.minimum(norms, ghat.clamp(max=clip))
    return c, c / ghat


def dpis_step_event(sigma_g: float, r: float, batch_size: float, n_tilde: float) -> PoissonGaussian:
    """Eq. (13) as a sampled Gaussian: rate ``min(1, b/(N~ r))``, noise multiplier ``σ_G/r``."""
    return PoissonGaussian(noise_multiplier=sigma_g / r, sample_rate=min(1.0, batch_size / (n_tilde * r)))


def schedule_sigma(
    *,
    base_rdp: np.ndarray,
    r_now: float,
    steps_now: int,
    r_future: float,
    steps_future: int,
    batch_size: float,
    n_tilde: float,
    target_epsilon: float,
    delta: float,
    orders: tuple[float, ...],
    lo: float = 0.05,
    hi: float = 200.0,
    tol: float = 1e-4,
    start: float = 1.0,
) -> float:
    """Smallest σ_G (to ``tol``, feasible end) with which the planned run stays within ``target_epsilon``.

    ``base_rdp`` is everything already spent or reserved (released statistics, earlier epochs); the
    current epoch runs ``steps_now`` steps at ``r_now`` and the future ``steps_future`` at ``r_future``.
    """

    def eps(sigma: float) -> float:
        total = np.asarray(base_rdp, dtype=np.float64).copy()
        if steps_now:
            total += segment_rdp(dpis_step_event(sigma, r_now, batch_size, n_tilde), steps_now, orders)
        if steps_future:
            total += segment_rdp(dpis_step_event(sigma, r_future, batch_size, n_tilde), steps_future, orders)
        return epsilon_from_rdp(total, orders, delta)[0]

    if eps(hi) > target_epsilon:
        raise DPConfigurationError(
            f"DPIS cannot meet target_epsilon={target_epsilon:g}: even σ_G={hi:g} exceeds it (the released "
            "statistics N~, K~ alone cost too much, or the budget is already spent). Raise sigma_N/sigma_K, "
            "the budget, or train for fewer steps."
        )
    # Bracket around ``start`` by doubling/halving (fewer accountant calls than bisecting all of [lo, hi]).
    guess = min(max(start, lo), hi)
    if eps(guess) <= target_epsilon:
        hi = guess
        while hi / 2 > lo and eps(hi / 2) <= target_epsilon:
            hi /= 2
        lo = max(lo, hi / 2)
    else:
        lo = guess
        while lo * 2 < hi and eps(lo * 2) > target_epsilon:
            lo *= 2
        hi = min(hi, lo * 2)
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if eps(mid) <= target_epsilon else (mid, hi)
    return hi


@dataclass(frozen=True)
class DPISEpoch:
    """The public parameters of one epoch (released or derived from released values)."""

    epoch: int
    n_tilde: float
    k_tilde: float
    clip: float
    sigma_g: float

    @property
    def r(self) -> float:
        """Norm ratio ``K~/(N~·C)`` in (0, 1]: the only data-dependent input of the accountant."""
        return self.k_tilde / (self.n_tilde * self.clip)


@dataclass
class _StepInfo:
    """What one candidate batch carries: its indices, their envelopes at draw time, the epoch."""

    indices: Tensor
    ghat: Tensor
    epoch: DPISEpoch


class _DPISBatchSampler(torch.utils.data.Sampler[list[int]]):
    def __init__(self, dpis: DPIS, num_batches: int) -> None:
        self.dpis, self.num_batches = dpis, num_batches

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.dpis._epoch_batches(self.num_batches)


class DPIS(Sampler):
    """Importance sampling by clipped gradient norm (DPIS), with its own σ schedule.

    Args:
        k: over-sampling factor of the first round (candidates ≈ ``k·b`` per step); needs ``k·b < N``.
        a_E: budget scheduler: during the first ``floor(a_E·E)`` epochs σ_G is planned for worst-case
            future epochs (r = 1), afterwards for future epochs like the current one.
        sigma_N: noise multiplier of the released count N~ (sensitivity 1 example); default ``0.02·N`` as
            in the paper.
        sigma_K: noise multiplier of the released norm sums K~, K~* (sensitivity C); default ``0.02·N``.
        adaptive_clipping: DPIS+AC: ``C_{e+1} = lam·K~*_e/N~`` (K~* = noisy sum of norms clipped at C_star).
        lam: AC multiplier of the noisy mean norm.
        C_star: external clip of the AC statistic (default ``4·C_1``).
        g_L: envelope floor of the K~ lower clamp, as a fraction of C (spec §7 A5).
        xi: slack of the K~ lower clamp, as a fraction of C (spec §7 A5).
        seed: makes selection, acceptance and the statistics' noise reproducible (default: os.urandom).

    σ_G,e is solved at each epoch start from ``target_epsilon`` (or fixed when ``noise_multiplier`` is
    given). Clipping is built in (flat, at ``max_grad_norm``): use it with the default clipping slot.
    """

    schedules_noise = True
    carries_batch_info = True
    weighs_examples = True  # w_i and the bound from each example's own norm

    def __init__(
        self,
        k: float = 3,
        a_E: float = 0.8,
        sigma_N: float | None = None,
        sigma_K: float | None = None,
        adaptive_clipping: bool = False,
        lam: float = 1.0,
        C_star: float | None = None,
        g_L: float = 0.01,
        xi: float = 1e-6,
        seed: int | None = None,
    ) -> None:
        number(k, "k", owner="DPIS", low=1)
        number(a_E, "a_E", owner="DPIS", low=0, high=1)
        for name, value in (("sigma_N", sigma_N), ("sigma_K", sigma_K), ("C_star", C_star)):
            number(value, name, owner="DPIS", low=0, low_open=True, optional=True)
        number(lam, "lam", owner="DPIS", low=0, low_open=True)
        number(g_L, "g_L", owner="DPIS", low=0, high=1, low_open=True, high_open=True)
        number(xi, "xi", owner="DPIS", low=0)
        flag(adaptive_clipping, "adaptive_clipping", owner="DPIS")
        validation.seed(seed, owner="DPIS")
        self.k, self.a_E, self.lam, self.g_L, self.xi, self.seed = float(k), float(a_E), lam, g_L, xi, seed
        self.sigma_N_arg, self.sigma_K_arg, self.C_star_arg = sigma_N, sigma_K, C_star
        self.adaptive_clipping = adaptive_clipping
        self.runtime: SamplerRuntime | None = None
        self.releases: Releases | None = None
        self.batch_size = 0
        self.generators: dict[str, torch.Generator] = {}
        self._pending_generators: dict[str, Tensor] = {}
        # run state (all in state_dict)
        self.n_tilde: float | None = None
        self.clip: float | None = None
        self.current: DPISEpoch | None = None
        self.epochs: list[DPISEpoch] = []
        self.consumed = 0
        """Steps run in the current epoch (a mid-epoch resume continues the epoch after them)."""
        self.steps_taken = 0
        self.ghat = torch.zeros(0, dtype=torch.float64)
        self.gstar = torch.zeros(0, dtype=torch.float64)
        self._active: _StepInfo | None = None
        self._cursor = 0
        self._resume_mid_epoch = False
        self._envelopes_lost = False
        """A checkpoint without the envelopes was loaded: the next pass recomputes them (norm pass)."""
        self.restored_shape: tuple[int | None, float | None] = (None, None)
        self.rank, self.world_size = 0, 1
        self.share = torch.zeros(0, dtype=torch.long)

    # -- set-up ------------------------------------------------------------------------------------
    @property
    def sigma_n(self) -> float:
        return self.sigma_N_arg if self.sigma_N_arg is not None else 0.02 * self.num_samples

    @property
    def sigma_k(self) -> float:
        return self.sigma_K_arg if self.sigma_K_arg is not None else 0.02 * self.num_samples

    def bind(self, num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1) -> None:
        if num_samples <= 0 or batch_size <= 0:
            raise ValueError(f"DPIS needs N > 0 and batch_size > 0, got {num_samples}, {batch_size}.")
        if self.k * batch_size >= num_samples:
            raise ValueError(
                f"DPIS needs k·batch_size < N (k={self.k:g}, batch_size={batch_size}, N={num_samples}): the "
                "first round would sample every example. Lower k or batch_size."
            )
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank, self.world_size = rank, world_size
        self.share = torch.arange(rank, num_samples, world_size)  # this rank's candidates (DDP)
        if self.ghat.numel() != num_samples:
            self.ghat = torch.zeros(num_samples, dtype=torch.float64)
            self.gstar = torch.zeros(num_samples, dtype=torch.float64)
        for stream in ("select", "accept", "stats"):
            if stream not in self.generators:
                self.generators[stream] = make_generator(self.seed, stream=f"dpis/{stream}/{rank}")
            if stream in self._pending_generators:
                self.generators[stream].set_state(self._pending_generators.pop(stream))
        self._update_rate()

    def use_releases(self, releases: Releases) -> None:
        self.releases = releases

    def attach_runtime(self, runtime: SamplerRuntime) -> None:
        if not runtime.clipping.is_flat_l2:
            raise DPConfigurationError(
                f"DPIS bounds each contribution itself (norm K~/N~); it cannot be combined with "
                f"{type(runtime.clipping).__name__}. Use the default clipping slot."
            )
        self.runtime = runtime
        if self.clip is None:
            self.clip = runtime.max_grad_norm

    def batch_sampler(self, num_batches: int) -> _DPISBatchSampler:
        return _DPISBatchSampler(self, num_batches)

    @property
    def expected_batch_size(self) -> float:
        return float(self.batch_size)

    def _update_rate(self) -> None:
        """``sample_rate`` reports the current epoch's effective rate b/(N~ r) (worst case b/N before)."""
        if self.current is not None:
            self.sample_rate = min(1.0, self.batch_size / (self.current.n_tilde * self.current.r))
        elif self.num_samples:
            self.sample_rate = self.batch_size / self.num_samples

    # -- epochs ------------------------------------------------------------------------------------
    def _epoch_batches(self, num_batches: int) -> Iterator[list[int]]:
        if self._envelopes_lost and self.current is not None:
            self._envelopes(self.current.clip)  # resumed without ghat/gstar: recompute, release nothing
        self._envelopes_lost = False
        remaining = num_batches - self.consumed
        if not (self._resume_mid_epoch and remaining > 0):
            self._start_epoch()
            remaining = num_batches
        self._resume_mid_epoch = False
        assert self.current is not None
        select = self.generators["select"]
        for _ in range(remaining):
            q = first_round_probabilities(self.ghat[self.share], self.batch_size, self.current.k_tilde)
            indices = self.share[torch.rand(len(self.share), generator=select, dtype=torch.float64) < q]
            yield IndicesWithInfo(
                indices.tolist(), _StepInfo(indices, self.ghat[indices].clone(), self.current)
            )

    def _release(self, local_sum: float, std: float) -> float:
        """Σ over all ranks of ``local_sum`` plus one Gaussian draw (rank 0's): the same value everywhere."""
        if self.releases is None:
            raise RuntimeError("DPIS releases statistics only inside a private run (PrivateStepEngine).")
        return self.releases.noisy_statistic(local_sum, std, self.generators["stats"])

    def _start_epoch(self) -> None:
        """Full norm pass, release K~ (and N~ once, K~* with AC), then solve σ_G for this epoch."""
        runtime = self.runtime
        if runtime is None:
            raise RuntimeError("DPIS needs the strategy's runtime (use it as DPStrategy(sampler=DPIS(...))).")
        n = self.num_samples
        if self.n_tilde is None:
            self._check_aux_affordable()
            self._charge(Gaussian(self.sigma_n), "N~")
            n_tilde = self._release(float(n) if self.rank == 0 else 0.0, self.sigma_n)
            self.n_tilde = max(n_tilde, self.k * self.batch_size + 1.0)
        assert self.clip is not None
        c_star = self.c_star
        if self.adaptive_clipping and self.epochs:
            self._charge(Gaussian(self.sigma_k), "K~*")
            k_star = self._release(float(self.gstar[self.share].sum()), self.sigma_k * c_star)
            k_star = min(max(k_star, 0.0), self.n_tilde * c_star)
            self.clip = max(self.lam * k_star / self.n_tilde, 1e-3 * runtime.max_grad_norm)
        clip = self.clip
        c = self._envelopes(clip)
        self._charge(Gaussian(self.sigma_k), "K~")
        k_noisy = self._release(float(c.sum()), self.sigma_k * clip)
        lower = self.k * self.batch_size * clip + self.xi * clip
        k_tilde = min(max(k_noisy, lower), self.n_tilde * clip)
        epoch = len(self.epochs) + 1
        r = k_tilde / (self.n_tilde * clip)
        sigma = self._solve_sigma(epoch, r)
        self.current = DPISEpoch(epoch=epoch, n_tilde=self.n_tilde, k_tilde=k_tilde, clip=clip, sigma_g=sigma)
        self.epochs.append(self.current)
        self.consumed = 0
        self._update_rate()

    def _envelopes(self, clip: float) -> Tensor:
        """The norm pass over this rank's share (all of D on one process) at the current weights: sets the
        envelopes ghat and the AC norms gstar, releases nothing, and returns the clipped norms c_i."""
        assert self.runtime is not None
        norms = self.runtime.norms(self.share)
        norms = torch.where(torch.isfinite(norms), norms, torch.zeros_like(norms))
        c = norms.clamp(max=clip)
        self.ghat[self.share] = self.k * c.clamp(min=self.g_L * clip)
        self.gstar[self.share] = norms.clamp(max=self.c_star)
        return c

    @property
    def c_star(self) -> float:
        """C*, the clipping bound of the AC statistic K~* (default 4·C)."""
        return self.C_star_arg if self.C_star_arg is not None else 4 * self.clip_1

    def _charge(self, event: Gaussian, statistic: str) -> None:
        """Check-before-spend for one released statistic (before it is computed); a refusal names it."""
        if self.releases is None:
            raise RuntimeError("DPIS releases statistics only inside a private run (PrivateStepEngine).")
        self.releases.spend(event, mechanism=f"DPIS's {statistic} statistic")

    def pending_events(self) -> list[PrivacyEvent]:
        """At an epoch boundary the next step first needs this epoch's statistics (N~ once, K~*, K~)."""
        if self.runtime is None or (
            self.current is not None and self.consumed < self.runtime.steps_per_epoch
        ):
            return []
        events: list[PrivacyEvent] = [] if self.n_tilde is not None else [Gaussian(self.sigma_n)]
        if self.adaptive_clipping and self.epochs:
            events.append(Gaussian(self.sigma_k))
        return [*events, Gaussian(self.sigma_k)]

    def _plan(self) -> tuple[int, int]:
        """(steps per epoch T, planned epochs E) from the Trainer's plan."""
        assert self.runtime is not None
        per_epoch = max(1, self.runtime.steps_per_epoch)
        return per_epoch, max(1, math.ceil(self.runtime.planned_steps / per_epoch))

    def _aux_per_epoch(self) -> int:
        return 2 if self.adaptive_clipping else 1

    def _check_aux_affordable(self) -> None:
        """Before anything is released: the statistics of the whole run must fit in the target."""
        runtime = self.runtime
        assert runtime is not None
        if runtime.target_epsilon is None:
            return
        _, epochs = self._plan()
        ledger = runtime.ledger
        rdp = ledger.rdp + Gaussian(self.sigma_n).rdp(ledger.orders)
        rdp += epochs * self._aux_per_epoch() * Gaussian(self.sigma_k).rdp(ledger.orders)
        if epsilon_from_rdp(rdp, ledger.orders, ledger.delta)[0] >= runtime.target_epsilon:
            raise DPConfigurationError(
                f"DPIS's released statistics (N~ with sigma_N={self.sigma_n:g}, K~ with sigma_K={self.sigma_k:g} "
                f"over {epochs} epochs) alone exceed target_epsilon={runtime.target_epsilon:g}."
            )

    def _solve_sigma(self, epoch: int, r: float) -> float:
        runtime = self.runtime
        assert runtime is not None
        assert self.n_tilde is not None
        if runtime.fixed_noise_multiplier is not None or runtime.target_epsilon is None:
            if runtime.fixed_noise_multiplier is None:
                raise DPConfigurationError("DPIS needs target_epsilon or noise_multiplier.")
            return runtime.fixed_noise_multiplier
        per_epoch, epochs = self._plan()
        ledger = runtime.ledger
        done = self.steps_taken
        steps_now = max(0, min(per_epoch, runtime.planned_steps - done))
        steps_future = max(0, runtime.planned_steps - done - steps_now)
        future_epochs = max(0, epochs - epoch)
        base = ledger.rdp + future_epochs * self._aux_per_epoch() * Gaussian(self.sigma_k).rdp(ledger.orders)
        phase_one = epoch <= math.floor(self.a_E * epochs + 1e-9)
        return schedule_sigma(
            base_rdp=base,
            r_now=r,
            steps_now=steps_now,
            r_future=1.0 if phase_one else r,
            steps_future=steps_future,
            batch_size=self.batch_size,
            n_tilde=self.n_tilde,
            target_epsilon=runtime.target_epsilon,
            delta=ledger.delta,
            orders=ledger.orders,
            start=self.epochs[-1].sigma_g if self.epochs else 1.0,
        )

    # -- the step ---------------------------------------------------------------------------------
    def begin_step(self, info: Any) -> None:
        if not isinstance(info, _StepInfo):
            raise RuntimeError("DPIS got a batch without its envelope snapshot.")
        self._active, self._cursor = info, 0
        if info.epoch == self.current:
            self.consumed += 1
        self.steps_taken += 1

    def step_noise_multiplier(self) -> float | None:
        epoch = self._active.epoch if self._active is not None else self.current
        return None if epoch is None else epoch.sigma_g / epoch.r

    def event(self, noise_multiplier: float) -> PrivacyEvent:
        epoch = self._active.epoch if self._active is not None else self.current
        if epoch is None:  # no step can run before the first epoch start; plan at the worst case r = 1
            return PoissonGaussian(noise_multiplier, self.batch_size / self.num_samples)
        return PoissonGaussian(noise_multiplier, min(1.0, self.batch_size / (epoch.n_tilde * epoch.r)))

    def weigh(self, grad_samples: PerExampleGradients, ctx: StepContext) -> tuple[Tensor, float]:
        """Second round: accept candidate i with probability min(n_i, ghat_i, C)/ghat_i; an accepted
        example's weight makes its contribution (K~/N~)·u_i. Refreshes the envelopes it saw."""
        info = self._active
        if info is None:
            raise RuntimeError("DPIS: a private step ran without a DPIS batch.")
        epoch = info.epoch
        sensitivity = epoch.k_tilde / epoch.n_tilde
        norms = grad_samples.sq_norms().sqrt() if ctx.batch_size else None
        count = 0 if norms is None else len(norms)
        part = slice(self._cursor, self._cursor + count)
        if self._cursor + count > len(info.indices):
            raise RuntimeError("DPIS: the step saw more examples than its candidate batch.")
        self._cursor += count
        if norms is None:
            device = ctx.generator.device
            return torch.zeros(0, device=device), sensitivity
        raw = norms.detach().double().cpu()
        finite = torch.isfinite(raw)
        raw = torch.where(finite, raw, torch.zeros_like(raw))
        ghat = info.ghat[part]
        c, p = acceptance_probabilities(raw, ghat, epoch.clip)
        accept = torch.rand(count, generator=self.generators["accept"], dtype=torch.float64) < p
        accept &= finite & (raw > 0)
        weights = torch.where(
            accept, sensitivity / (raw * (1 + 1e-5)).clamp(min=1e-30), torch.zeros_like(raw)
        )
        indices = info.indices[part]
        self.ghat[indices] = self.k * c.clamp(min=self.g_L * epoch.clip)
        if self.adaptive_clipping:
            self.gstar[indices] = raw.clamp(max=self.c_star)
        return weights.to(device=norms.device, dtype=torch.float32), sensitivity

    @property
    def clip_1(self) -> float:
        return self.runtime.max_grad_norm if self.runtime is not None else float(self.clip or 1.0)

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Public settings and released statistics (N~, K~, the epochs' C and σ_G), the step counts and, in a
        seeded run only, the envelopes ghat/gstar (un-noised per-example norms) and the generator states.

        An unseeded run's resume recomputes the envelopes with one norm pass at the resumed weights (no
        release: the inclusion probability b·min(n_i, ghat_i, C)/K~ stays at most b·C/K~ whatever ghat is).
        """
        state: dict[str, Any] = {
            "num_samples": self.num_samples,
            "sample_rate": self.sample_rate,
            "batch_size": self.batch_size,
            "n_tilde": self.n_tilde,
            "clip": self.clip,
            "epochs": [asdict(e) for e in self.epochs],
            "consumed": self.consumed,
            "steps_taken": self.steps_taken,
            "generators": saved_states(self.generators, self.seed),
        }
        if self.seed is not None:
            state.update(ghat=self.ghat.clone(), gstar=self.gstar.clone())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n_tilde, self.clip = state["n_tilde"], state["clip"]
        self.epochs = [DPISEpoch(**e) for e in state["epochs"]]
        self.current = self.epochs[-1] if self.epochs else None
        self.consumed, self.steps_taken = int(state["consumed"]), int(state["steps_taken"])
        self._envelopes_lost = "ghat" not in state
        if self._envelopes_lost:
            self.ghat = torch.zeros(self.num_samples or 0, dtype=torch.float64)
            self.gstar = torch.zeros(self.num_samples or 0, dtype=torch.float64)
        else:
            self.ghat, self.gstar = state["ghat"].clone(), state["gstar"].clone()
        for name, saved in state.get("generators", {}).items():
            if name in self.generators:
                self.generators[name].set_state(saved)
            else:
                self._pending_generators[name] = saved
        self.restored_shape = (state.get("num_samples"), state.get("sample_rate"))
        self._resume_mid_epoch = self.current is not None
