"""Noise slot: the noise multiplier of each step."""

from lightning_dp.noise.band_mf import BandMF
from lightning_dp.noise.blt import BLT
from lightning_dp.noise.constant import ConstantNoise
from lightning_dp.noise.discrete_gaussian import DiscreteGaussian
from lightning_dp.noise.noise_dividing import NoiseDividing

__all__ = ["BLT", "BandMF", "ConstantNoise", "DiscreteGaussian", "NoiseDividing"]
