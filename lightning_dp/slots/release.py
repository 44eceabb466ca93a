"""The one door to the privacy budget: check before spend → record → noise → all-reduce → finalize.

Every release a run makes goes through one :class:`Releases` object: the engine's noisy gradients, a
step's second gradient or re-measurement, and the statistics that are not gradients (DPIS's K~, a line
search's sparse-vector queries, DP-AGD's NoisyMin). It owns the ledger (or privacy filter), the
collective of a distributed run and the release hooks, so the rule "price it, then release it" is
written once, and a refusal names the mechanism that would have overspent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from lightning_dp.accounting import BudgetExceededError, PrivacyEvent, PrivacyLedger, charge
from lightning_dp.core.rng import NoisePrefetch
from lightning_dp.slots.context import StepContext

AllReduce = Callable[[list[Tensor]], list[Tensor]]
"""Sums a list of tensors over all ranks (same shapes and devices back)."""

ReduceScatter = Callable[[list[Tensor]], list[Tensor]]
"""Sums a list of tensors over all ranks, each rank getting back only its shard of each (``dp_fsdp``)."""


class NoiseDraw(Protocol):
    """The part of the noise slot a release uses (``slots.Noise.add_noise``)."""

    def add_noise(self, sums: list[Tensor], std: float, generator: torch.Generator) -> list[Tensor]: ...


class SumBound(Protocol):
    """The part of the clipping slot a release uses (``slots.Clipping``): the sum's sensitivity, finalize."""

    def sensitivity(self, ctx: StepContext) -> float: ...

    def finalize(self, noisy_sums: list[Tensor], ctx: StepContext) -> list[Tensor]: ...


class ReleaseHook:
    """Sees each gradient release: may add contributions before the noise, reads the noisy sums after.

    The privacy audit's gradient canaries use it (lightning_dp/commands/audit.py); the default does nothing.
    """

    def before_noise(self, sums: list[Tensor], ctx: StepContext) -> list[Tensor]:
        """The clipped sums the noise is added to (extra tensors may be appended; return them all)."""
        return sums

    def after_release(self, noisy: list[Tensor], ctx: StepContext) -> list[Tensor]:
        """The released noisy sums; return those of the parameters (drop anything appended above)."""
        return noisy


class Releases:
    """Check-before-spend, the noisy release and the collectives of one run, shared by every slot.

    ``ledger`` is fixed at construction (a :class:`~lightning_dp.accounting.PrivacyFilter` when the step's
    plan brings one); ``connect`` sets the rank, the world size and the all-reduce once the processes exist.
    """

    def __init__(
        self,
        ledger: PrivacyLedger,
        *,
        target_epsilon: float | None,
        noise: NoiseDraw,
        clipping: SumBound,
        gradient_name: str,
    ) -> None:
        self.ledger = ledger
        self.target_epsilon = target_epsilon
        self._noise, self._clipping = noise, clipping
        self.gradient_name = gradient_name
        """How budget errors name the gradient release (the slots that make it)."""
        self.hooks: list[ReleaseHook] = []
        self.rank = 0
        self.world_size = 1
        self.all_reduce_fn: AllReduce | None = None
        self.reduce_scatter_fn: ReduceScatter | None = None
        """Set by ``dp_fsdp``: the gradient's sums are reduce-scattered first and each rank adds the whole
        noise to the shard it owns (each coordinate noised once, by one rank); None: shares + all-reduce."""
        self.anchor: Tensor | None = None
        """A model parameter, set when the engine attaches: collectives run on its current device (the
        strategy may move the model after attaching); None: on the CPU."""
        self.prefetch_slice = 1
        """How many values the noise slot draws at a time (``slots.NOISE_SLICE``, set with ``prefetch_draw``)."""
        self.prefetch_draw: Callable[..., list[Tensor]] | None = None
        """Set by the engine when no slot but the noise slot draws from the noise generator (the default
        step): ``Noise.add_noise`` as defined. While the noise slot's ``add_noise`` is that function, each
        gradient release's noise is drawn ahead, on a background thread, right after the previous release
        (:class:`~lightning_dp.core.rng.NoisePrefetch`)."""
        self.prefetch = NoisePrefetch()

    def connect(self, rank: int, world_size: int, all_reduce: AllReduce | None) -> None:
        """This process's rank, the number of processes, and the sum over them (None on one process)."""
        self.rank, self.world_size, self.all_reduce_fn = rank, world_size, all_reduce

    # -- check before spend ------------------------------------------------------------------------
    def can_afford(self, event: PrivacyEvent, *, reserve: bool = False) -> bool:
        """Whether one more ``event`` fits the budget (always, without a target or filter).

        ``reserve=True``: a privacy filter must still fit its reserve afterwards (the rule for gradients,
        so a step's own follow-up query is never starved); an ordinary ledger ignores it.
        """
        target = self.target_epsilon
        if target is None:
            return True
        if reserve:
            return bool(self.ledger.affordable_count(event, target) >= 1)
        return bool(self.ledger.can_afford(event, target))

    def check(self, event: PrivacyEvent) -> None:
        """Refuse a gradient release the budget cannot pay for, before anything is computed (O(1))."""
        if self.can_afford(event, reserve=True):
            return
        assert self.target_epsilon is not None
        spent = self.ledger.epsilon()
        raise BudgetExceededError(
            f"Privacy budget exhausted: ε={spent:.4g} spent of target {self.target_epsilon:g}; one more "
            f"release of {self.gradient_name} would exceed it.",
            spent=spent,
            target=self.target_epsilon,
            would_be=self.ledger.epsilon_if(event),
            event=event,
            count=1,
            mechanism=self.gradient_name,
        )

    def spend(self, event: PrivacyEvent, *, mechanism: str) -> None:
        """Check and record a release that is not the gradient (a statistic, a query), before it is
        computed; a refusal is a BudgetExceededError naming ``mechanism`` and records nothing."""
        charge(self.ledger, event, self.target_epsilon, mechanism=mechanism)

    # -- the release -------------------------------------------------------------------------------
    def noisy(self, sums: list[Tensor], std: float, generator: torch.Generator) -> list[Tensor]:
        """Add Gaussian noise of std ``std`` once over all ranks (in place) and all-reduce the sums.

        Under DDP each rank adds an independent share std/√W, so the all-reduced sum carries noise of
        std ``std`` exactly once; one collective, the same result on every rank. Prices nothing: the
        caller has recorded the release (:meth:`release_gradient` or :meth:`spend`).
        """
        return self.all_reduce(self._add_noise(sums, std / math.sqrt(self.world_size), generator))

    def _add_noise(self, sums: list[Tensor], std: float, generator: torch.Generator) -> list[Tensor]:
        """Gaussian noise of std ``std`` added to ``sums`` in place, drawn ahead where it was."""
        drawn = (
            self.prefetch.take(generator, NoisePrefetch.layout(sums)) if self._draws_ahead() and std else None
        )
        if drawn is None:  # nothing drawn ahead for these sums (a σ = 0 release rewinds what was)
            self.prefetch.cancel()
            return self._noise.add_noise(sums, std, generator)
        size = self.prefetch_slice  # the same draws, made while the step's backward ran, slice by slice
        for s, z in zip(sums, drawn, strict=True):
            for part, noise in zip(s.view(-1).split(size), z.view(-1).split(size), strict=True):
                part.add_(noise, alpha=std)
        return sums

    def _draws_ahead(self) -> bool:
        """Whether the noise slot draws as ``prefetch_draw`` does (not overridden, not patched)."""
        return self.prefetch_draw is not None and type(self._noise).add_noise is self.prefetch_draw

    def release_gradient(
        self, sums: list[Tensor], ctx: StepContext, event: PrivacyEvent | None, *, keep_sums: bool = False
    ) -> list[Tensor]:
        """Record ``event``, add the noise once over all ranks and finalize: the released gradient.

        ``event=None``: a step an earlier event already paid for (BandMF records one event per round of
        b steps, at its first step), so nothing is recorded.

        ``keep_sums``: copies of the clipped sums and of the released noisy sums go to
        ``ctx.clipped_sums`` / ``ctx.noisy_sums`` (steps that re-measure or rescale them).
        """
        if event is not None:
            self.ledger.record(event)
        for hook in self.hooks:
            sums = hook.before_noise(sums, ctx)
        if keep_sums:  # the noise is added in place: keep the clipped sums apart
            ctx.clipped_sums = [s.clone() for s in sums]
        sigma = ctx.noise_multiplier
        sensitivity = ctx.sensitivity if ctx.sensitivity is not None else self._clipping.sensitivity(ctx)
        ahead = self._draws_ahead() and not self.hooks
        std = 0.0 if sigma == 0 else sigma * sensitivity
        if self.reduce_scatter_fn is not None and self.world_size > 1:
            noisy = self._add_noise(self.reduce_scatter_fn(sums), std, ctx.generator)  # this rank's rows only
        else:
            noisy = self.noisy(sums, std, ctx.generator)
        layout = NoisePrefetch.layout(noisy) if ahead else None
        if layout is not None and std != 0.0:  # the next release's noise, drawn while its step runs
            self.prefetch.start(ctx.generator, layout, self.prefetch_slice)
        for hook in reversed(self.hooks):
            noisy = hook.after_release(noisy, ctx)
        if keep_sums:  # finalize may scale in place
            ctx.noisy_sums = [s.clone() for s in noisy]
        return self._clipping.finalize(noisy, ctx)

    def noisy_statistic(
        self, local_sum: float, std: float, generator: torch.Generator, *, shares: bool = False
    ) -> float:
        """Σ over all ranks of a scalar plus one Gaussian draw of std ``std``: the same value everywhere.

        The draw is rank 0's (every rank draws, so the streams stay aligned); fp64 on the CPU. ``shares``:
        each rank adds its own draw of std ``std``/√W instead, as the gradient's noise is added (a count
        over the ranks' shares of the batch). Prices nothing: the caller has spent the statistic's event
        (:meth:`spend`), or it is part of the gradient's (quantile clipping's count).
        """
        scale = std / math.sqrt(self.world_size) if shares else std
        noise = float(torch.randn(1, generator=generator, dtype=torch.float64)) * scale
        value = torch.tensor([local_sum + (noise if shares or self.rank == 0 else 0.0)], dtype=torch.float64)
        if self.world_size > 1:
            if self.all_reduce_fn is None:
                raise RuntimeError(
                    "A statistic over several ranks needs the strategy's all-reduce (connect())."
                )
            device = self.anchor.device if self.anchor is not None else torch.device("cpu")
            value = self.all_reduce_fn([value.to(device)])[0].cpu()
        return float(value)

    # -- collectives -------------------------------------------------------------------------------
    def all_reduce(self, tensors: list[Tensor]) -> list[Tensor]:
        """Sum over all ranks (the tensors themselves on one process)."""
        return tensors if self.all_reduce_fn is None else self.all_reduce_fn(tensors)

    def broadcast(self, values: Sequence[float], device: torch.device) -> list[float]:
        """Rank 0's values on every rank (noise drawn once, on rank 0, for a released choice)."""
        if self.world_size == 1:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(list(values), dtype=torch.float64, device=device)
        dist.broadcast(t, src=0)
        return [float(x) for x in t.tolist()]
