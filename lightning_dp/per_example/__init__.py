"""Per-example gradients from one ordinary backward: what the hooks capture (:class:`GradientCapture`),
what one batch left (:class:`PerExampleGradients`, one :class:`LayerCall` per layer call) and the
per-layer kernels that compute norms and clipped sums from it (:mod:`.kernels`)."""

from lightning_dp.core.errors import BatchDimensionError
from lightning_dp.per_example.capture import GradientCapture, GradMode
from lightning_dp.per_example.gradients import PerExampleGradients
from lightning_dp.per_example.layer_calls import LayerCall

__all__ = ["BatchDimensionError", "GradMode", "GradientCapture", "LayerCall", "PerExampleGradients"]
