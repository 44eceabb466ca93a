"""Step slot: how the private gradient moves the weights (default, :class:`~lightning_dp.slots.Step`: the
user's own optimizer)."""

from lightning_dp.steps.dp_accelerated import HeavyBall, MultiStageNesterov, Nesterov
from lightning_dp.steps.dp_agd import AdaptiveGD

__all__ = ["AdaptiveGD", "HeavyBall", "MultiStageNesterov", "Nesterov"]
