"""Step slot: how the private gradient moves the weights (default: the user's own optimizer)."""

from lightning_dp.slots import Step as OptimizerStep

__all__ = ["OptimizerStep"]
