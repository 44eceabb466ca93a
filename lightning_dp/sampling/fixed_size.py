"""Fixed-size sampling without replacement: every step draws an independent uniform m-subset of the n examples.

This is the sampling of Kuru et al. (2020), whose amplification theorem (Balle et al. 2018, Thm 9) needs a
fresh uniform subset every step (epoch-wise shuffling does not qualify). It releases Laplace steps only
(:class:`~lightning_dp.accounting.subsampled_laplace.SubsampledLaplace`), priced with ``accountant="pure"``.
"""

from __future__ import annotations

import torch

from lightning_dp.accounting import PrivacyEvent
from lightning_dp.accounting.subsampled_laplace import SubsampledLaplace
from lightning_dp.core.draws import check_population, uniform_subset
from lightning_dp.sampling.seeded import DrawnBatches, SeededSampler


class FixedSize(SeededSampler):
    """A uniform subset of exactly ``batch_size`` examples per step, drawn without replacement (paper mode).

    The sample rate q = m/n is exact and the batch size is public, so the mean divides by m.
    Single-process only: the Laplace noise cannot be split into per-rank shares.

    Args:
        seed: seeds the sampling stream (default None: ``os.urandom``, so batches are unpredictable).
    """

    mechanism = "laplace"

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(seed)
        self.batch_size = 0

    def bind(self, num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1) -> None:
        if world_size != 1:
            raise ValueError(
                "FixedSize sampling with Laplace noise runs in one process: a sum of per-rank Laplace shares "
                "is not Laplace. Use DPStrategy (one device)."
            )
        if num_samples <= 0:
            raise ValueError("The training set is empty: DP training needs at least one example.")
        check_population(num_samples)
        if not 0 < batch_size <= num_samples:
            raise ValueError(f"batch_size must be in [1, N={num_samples}], got {batch_size}.")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.sample_rate = batch_size / num_samples
        self._start_stream("fixed_size/0")

    def sample_indices(self) -> torch.Tensor:
        """One step's batch: ``batch_size`` distinct indices, uniformly at random (sorted; O(m), not O(n))."""
        assert self.generator is not None, "bind() first"
        return uniform_subset(self.num_samples, self.batch_size, self.generator)

    def draw(self) -> list[int]:
        """One batch: a uniform m-subset of range(n), as a list."""
        return self.sample_indices().tolist()

    def batch_sampler(self, num_batches: int) -> DrawnBatches:
        return DrawnBatches(self.draw, num_batches)

    def event(self, noise_multiplier: float) -> PrivacyEvent:
        return SubsampledLaplace(noise_multiplier=noise_multiplier, sample_rate=self.sample_rate)
