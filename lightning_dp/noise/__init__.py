"""Noise slot: the noise multiplier of each step."""

from lightning_dp.noise.constant import ConstantNoise

__all__ = ["ConstantNoise"]
