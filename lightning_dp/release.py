"""Kept for users' imports: re-exports :mod:`lightning_dp.slots.release`, this module's new home."""

from lightning_dp.slots.release import AllReduce, NoiseDraw, ReduceScatter, ReleaseHook, Releases, SumBound

__all__ = ["AllReduce", "NoiseDraw", "ReduceScatter", "ReleaseHook", "Releases", "SumBound"]
