"""Noise slot: the noise multiplier of each step."""

from lightning_dp.noise.constant import ConstantNoise
from lightning_dp.noise.noise_dividing import NoiseDividing

__all__ = ["ConstantNoise", "NoiseDividing"]
