"""Kept for users' imports: re-exports :mod:`lightning_dp.core.validation`, this module's new home."""

from lightning_dp.core.validation import ArgumentError, flag, number, seed

__all__ = ["ArgumentError", "flag", "number", "seed"]
