"""Step slot: how the private gradient moves the weights (default: the user's own optimizer)."""

from lightning_dp.slots import Step as OptimizerStep
from lightning_dp.steps.dp_accelerated import HeavyBall, MultiStageNesterov, Nesterov
from lightning_dp.steps.dp_agd import AdaptiveGD

__all__ = ["AdaptiveGD", "HeavyBall", "MultiStageNesterov", "Nesterov", "OptimizerStep"]
