"""Sampler slot: which examples form each batch."""

from lightning_dp.sampling.fixed_size import FixedSize
from lightning_dp.sampling.poisson import Poisson, PoissonBatchSampler

__all__ = ["FixedSize", "Poisson", "PoissonBatchSampler"]
