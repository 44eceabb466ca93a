"""Kept for users' imports: re-exports :mod:`lightning_dp.core.losses`, this module's new home."""

from lightning_dp.core.losses import per_example_token_loss

__all__ = ["per_example_token_loss"]
