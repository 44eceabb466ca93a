"""Kept for users' imports: re-exports :mod:`lightning_dp.run.callbacks`, this module's new home."""

from lightning_dp.run.callbacks import (
    HasPrivacyEngine,
    PrivacyCallback,
    dp_strategy_of,
    private_monitors,
    training_metric_names,
)

__all__ = [
    "HasPrivacyEngine",
    "PrivacyCallback",
    "dp_strategy_of",
    "private_monitors",
    "training_metric_names",
]
