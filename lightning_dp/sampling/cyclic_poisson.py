"""Cyclic Poisson sampling (Choquette-Choo et al. 2023): the sampler that banded correlated noise needs.

Every example gets one independent, uniform group g(i) ∈ {0..b−1} (jax_privacy's ``INDEPENDENT``
partition, the one valid under add/remove adjacency). Step t samples only group t mod b, each member
with probability q_b = B·b/N, so every example's steps are at least b apart and a b-banded strategy
costs ⌈T/b⌉ Poisson-subsampled Gaussians of rate q_b (their Thm 4). The expected batch is still B.

Under DDP every rank uses rank 0's partition seed (broadcast at ``bind``) and samples its own share of
the step's group. The group of step t follows the engine's step count, not the loader's position: each batch carries the
step it was drawn for, a release checks it (``weigh``), and a new pass over the data (a new epoch, a
resume) restarts from the steps released so far. The partition seed is checkpointed, so a resumed run
keeps every example in its group.

Nothing of size N is built: g(i) is a keyed hash of i, and step t draws a Poisson sample at q_b over the
rank's share and keeps group t mod b (about b·B candidates, whatever N).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_dp.accounting import PoissonGaussian, PrivacyEvent
from lightning_dp.core.batches import IndicesWithInfo
from lightning_dp.core.draws import poisson_share
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.core.rng import make_generator
from lightning_dp.core.validation import number
from lightning_dp.per_example import PerExampleGradients
from lightning_dp.sampling.seeded import SeededSampler, check_sizes
from lightning_dp.slots import SamplerRuntime, StepContext
from lightning_dp.slots.release import Releases

__all__ = ["CyclicBatchSampler", "CyclicPoisson", "partition_labels"]

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's finaliser


def _signed(value: int) -> int:
    """``value`` modulo 2⁶⁴ as a signed int64 (what torch's int64 arithmetic wraps to)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def partition_labels(indices: Tensor, seed: int, bands: int) -> Tensor:
    """An independent uniform label in {0..bands−1} for each index: SplitMix64 of (seed, index), keyed by seed.

    A function of the index alone, so an example keeps its group when others are added or removed (the
    add/remove neighbour of a data set has the same partition of the examples they share).
    """
    z = indices.to(torch.long) * _signed(_GOLDEN) + _signed(seed * _GOLDEN + _GOLDEN)
    z = (z ^ _shift_right(z, 30)) * _signed(_MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed(_MIX2)
    z = z ^ _shift_right(z, 31)
    uniform = _shift_right(z, 11).to(torch.float64) * 2.0**-53  # 53 uniform bits in [0, 1)
    return (uniform * bands).floor().to(torch.long).clamp_(max=bands - 1)  # float rounding never gives b


class CyclicBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Yields ``num_batches`` index batches per pass, step t drawing from group t mod b."""

    def __init__(self, sampler: CyclicPoisson, num_batches: int) -> None:
        self.sampler = sampler
        self.num_batches = num_batches

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[int]]:
        step = (
            self.sampler.steps_released
        )  # read at the first draw of a pass: every earlier batch is released
        for _ in range(self.num_batches):
            yield IndicesWithInfo(self.sampler.draw(step), info=step)
            step += 1


class CyclicPoisson(SeededSampler):
    """Cyclic Poisson sampling: step t takes each member of group t mod b with probability q_b = B·b/N.

    Args:
        bands: b, the number of groups and the minimum separation between an example's steps; ``"auto"``
            lets the correlated noise slot choose it at fit start from the predicted error at the run's ε
            (needs ``target_epsilon``). ``bands=1`` is DP-SGD's Poisson sampling (the same batches for the
            same seed).
        seed: the sampling streams' seed (None: ``os.urandom``); the partition is drawn from it too.

    Under DDP rank r samples the members of the step's group with index ≡ r (mod world size).
    """

    carries_batch_info = True
    takes_public_size = True  # q_b = B·b/N and the groups hold whatever the real N is

    def __init__(self, bands: int | Literal["auto"] = "auto", seed: int | None = None) -> None:
        super().__init__(seed)
        if bands != "auto":
            number(bands, "bands", owner="CyclicPoisson", low=1, integer=True)
        self.bands: int | str = bands
        self.batch_size = 0
        self.rank, self.world_size = 0, 1
        self.partition_seed: int | None = None
        self.steps_released = 0
        """Private steps released so far (the engine's step count): the next pass starts its groups there."""
        self._batch_step: int | None = None
        self._releases: Releases | None = None

    # -- set-up ---------------------------------------------------------------------------------------
    def bind(self, num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1) -> None:
        check_sizes(num_samples, batch_size)
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank, self.world_size = rank, world_size
        self._start_stream(f"poisson/{rank}")  # bands=1 draws exactly Poisson()'s batches
        if self.partition_seed is None:
            seed = int(torch.randint(0, 2**52, (1,), generator=make_generator(self.seed, "partition")))
            if world_size > 1 and self._releases is not None:  # one partition: rank 0's (exact in float64)
                anchor = self._releases.anchor
                device = anchor.device if anchor is not None else torch.device("cpu")
                seed = int(self._releases.broadcast([float(seed)], device)[0])
            self.partition_seed = seed
        if self.bands != "auto":
            self._set_rate()

    def use_releases(self, releases: Releases) -> None:
        """Kept for one collective: rank 0's partition seed is broadcast to every rank at ``bind``."""
        self._releases = releases

    def attach_runtime(self, runtime: SamplerRuntime) -> None:
        """Keep the planned steps (the noise slot fits its strategy to them); "auto" needs a target ε."""
        self.horizon = runtime.planned_steps
        if self.bands == "auto" and runtime.target_epsilon is None:
            raise DPConfigurationError(
                "CyclicPoisson(bands='auto') chooses b from the predicted error at the run's target ε, but this "
                "run gives a noise multiplier instead of target_epsilon. Give target_epsilon, or a fixed "
                "CyclicPoisson(bands=b)."
            )

    def choose_bands(self, bands: int) -> None:
        """Resolve ``bands="auto"`` to ``bands`` (the noise slot's choice) and fix q_b."""
        number(bands, "bands", owner="CyclicPoisson", low=1, integer=True)
        self.bands = int(bands)
        self._set_rate()

    def _set_rate(self) -> None:
        bands, size = self.resolved_bands, self.size_for_releases
        rate = self.batch_size * bands / size
        if rate > 1.0:
            raise ValueError(
                f"CyclicPoisson(bands={bands}) with batch_size={self.batch_size} on N={size} examples "
                f"needs q_b = B·b/N = {rate:.4g} > 1: each group has about N/b examples and must fill a batch of "
                f"B. Use bands ≤ N/B = {size // self.batch_size}, or a smaller batch_size."
            )
        self.sample_rate = rate

    @property
    def resolved_bands(self) -> int:
        if not isinstance(self.bands, int):
            raise RuntimeError(
                "CyclicPoisson(bands='auto') has not been resolved yet (the noise slot chooses b)."
            )
        return self.bands

    @property
    def expected_batch_size(self) -> float:
        """B = q_b·N/b: one group of about N/b examples at rate q_b (not q_b·N, which is b times B)."""
        return float(self.batch_size)

    # -- sampling -------------------------------------------------------------------------------------
    def group_of(self, indices: Tensor) -> Tensor:
        """g(i) for the examples ``indices``: independent and uniform on {0..b−1}, a keyed hash of the
        checkpointed partition seed and i, so nothing of size N is ever held and g(i) does not depend on N."""
        assert self.partition_seed is not None, "bind() first"
        return partition_labels(indices, self.partition_seed, self.resolved_bands)

    def groups(self) -> Tensor:
        """g(i) for every example (O(N): for inspection and tests; sampling never builds it)."""
        return self.group_of(torch.arange(self.num_samples))

    def draw(self, step: int) -> list[int]:
        """The indices of step ``step``: each member of group ``step mod b`` (this rank's share) w.p. q_b.

        A Poisson draw at q_b over the whole share, thinned to the group: each member of the group joins
        w.p. q_b, every other example never. O(b·B / world size) per step, whatever N.
        """
        assert self.generator is not None, "bind() first"
        drawn = poisson_share(self.num_samples, self.sample_rate, self.generator, self.rank, self.world_size)
        bands = self.resolved_bands
        if bands > 1:
            drawn = drawn[self.group_of(drawn) == step % bands]
        return list(drawn.tolist())

    def batch_sampler(self, num_batches: int) -> CyclicBatchSampler:
        assert self.generator is not None, "bind() first"
        return CyclicBatchSampler(self, num_batches)

    def begin_step(self, info: Any) -> None:
        """The step the batch about to run was drawn for."""
        self._batch_step = int(info)

    def weigh(self, grad_samples: PerExampleGradients, ctx: StepContext) -> None:
        """Called at every release: the batch must be the one drawn for this step's group; counts the step."""
        del grad_samples
        if self._batch_step is not None and self._batch_step != ctx.step:
            raise DPConfigurationError(
                f"CyclicPoisson drew this batch for step {self._batch_step} (group {self._batch_step % self.resolved_bands}) "
                f"but it is released as step {ctx.step}: an example could then join two steps less than b apart, "
                "which the ledger does not price. Batches must reach the strategy in the order they were drawn, one "
                "optimizer step each."
            )
        self.steps_released = ctx.step + 1
        return None

    def resume_at(self, steps: int) -> None:
        """``weigh`` counts a step before its release: an interrupted step's batch is drawn again for it."""
        self.steps_released, self._batch_step = steps, None

    def event(self, noise_multiplier: float) -> PrivacyEvent:
        """One round's event: a Poisson-subsampled Gaussian at the within-group rate q_b."""
        return PoissonGaussian(noise_multiplier=noise_multiplier, sample_rate=self.sample_rate)

    # -- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(bands=self.bands, partition_seed=self.partition_seed, steps_released=self.steps_released)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("bands")
        if isinstance(saved, int):
            if self.bands not in ("auto", saved):
                raise ValueError(
                    f"The checkpoint was trained with CyclicPoisson(bands={saved}), this run uses bands={self.bands}: "
                    "the rounds already charged and the groups would no longer line up. Resume with the same bands."
                )
            self.bands = saved
        if state.get("partition_seed") is not None:
            self.partition_seed = int(state["partition_seed"])
        self.steps_released = int(state.get("steps_released", 0))
        super().load_state_dict(state)
