"""Sampler slot: which examples form each batch."""

from lightning_dp.sampling.cyclic_poisson import CyclicPoisson
from lightning_dp.sampling.dpis import DPIS
from lightning_dp.sampling.fixed_size import FixedSize
from lightning_dp.sampling.poisson import Poisson, PoissonBatchSampler
from lightning_dp.sampling.user_poisson import UserPoisson

__all__ = ["DPIS", "CyclicPoisson", "FixedSize", "Poisson", "PoissonBatchSampler", "UserPoisson"]
