"""Poisson sampling for DP-SGD: every example joins each batch independently with probability q.

The batch sampler always yields, including empty batches (skipping one would reveal it was empty,
and under DDP would put ranks out of step). It owns its generator, so ``seed_everything`` does not
make the batches predictable and every rank draws its own stream.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from lightning_dp.accounting import PoissonGaussian, PrivacyEvent
from lightning_dp.core.draws import poisson_share
from lightning_dp.sampling.seeded import SeededSampler, check_sizes


class PoissonBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Yields ``num_batches`` index lists per epoch, each a Bernoulli(q) draw over this rank's share
    (the indices ≡ ``rank`` mod ``world_size``), in O(batch) time and memory per batch."""

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        num_batches: int,
        generator: torch.Generator,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.num_batches = num_batches
        self.generator = generator
        self.rank, self.world_size = rank, world_size

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.num_batches):
            drawn = poisson_share(
                self.num_samples, self.sample_rate, self.generator, self.rank, self.world_size
            )
            yield drawn.tolist()


class Poisson(SeededSampler):
    """DP-SGD's default sampler: q = batch_size / N, one subsampled Gaussian per step in the ledger.

    ``seed`` makes the batches reproducible (tests, debugging); by default the stream is seeded from
    ``os.urandom``. Under DDP, rank r samples the examples with index ≡ r (mod world size), so the
    union over ranks is one Poisson sample of the whole data set.

    Args:
        seed: seeds the sampling stream (default None: ``os.urandom``, so batches are unpredictable).
    """

    bands = 1  # one group that joins every step: cyclic Poisson sampling with b = 1
    takes_public_size = True  # each example joins w.p. q whatever N is: q may come from a declared N

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(seed)
        self.rank = 0
        self.world_size = 1

    def bind(self, num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1) -> None:
        check_sizes(num_samples, batch_size)
        size = num_samples if self.public_size is None else self.public_size
        if batch_size > size:
            raise ValueError(
                f"The expected batch size ({batch_size}) is larger than the training set ({size}"
                f"{'' if self.public_size is None else ', as declared by dataset_size'}): the sample rate "
                "q = batch_size / N would exceed 1. Use a smaller batch_size."
            )
        self.num_samples = num_samples
        self.sample_rate = batch_size / size
        self.rank, self.world_size = rank, world_size
        self._start_stream(f"poisson/{rank}")

    def batch_sampler(self, num_batches: int) -> PoissonBatchSampler:
        assert self.generator is not None, "bind() first"
        return PoissonBatchSampler(
            self.num_samples, self.sample_rate, num_batches, self.generator, self.rank, self.world_size
        )

    def event(self, noise_multiplier: float) -> PrivacyEvent:
        return PoissonGaussian(noise_multiplier=noise_multiplier, sample_rate=self.sample_rate)
