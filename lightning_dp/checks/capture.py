"""The per-example capture's obligations, judged on what its hooks observed (``per_example.observations``).

The hooks sit floors below the checks, so they are handed this object (the package installs it at import)
and call it at set-up, when the trainable parameters change, and at each ``collect``: before the step's
per-example gradients are clipped, summed or released. The first obligation broken is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_dp.checks import batch_rows, coverage
from lightning_dp.core.errors import BatchDimensionError, DPConfigurationError
from lightning_dp.per_example.observations import Observed


class CaptureObligations:
    """:class:`~lightning_dp.per_example.observations.CaptureChecks` as the privacy proof needs them."""

    def coverage(self, root: nn.Module, covered: Sequence[nn.Parameter]) -> None:
        coverage.refuse_uncovered(root, covered)

    def missed_use_message(self, names: list[str]) -> str:
        return coverage.missed_use_message(names)

    def collected(self, seen: Observed) -> None:
        """In this order: examples mixed by a BatchNorm, untraceable uses, a batch split over backward passes,
        a second-order loss (exact only for one example), uses outside the layers, reordered rows, the batch
        dimension, time-major calls, disagreeing row counts, and (first batch) parameters no path reached."""
        refusal = _mixed_or_untraced(seen)
        if refusal is not None:
            seen.drop()
            raise refusal
        if seen.second_order:  # per-example gradients are autograd's own, for one example alone
            if seen.expected > 1:
                seen.drop()
                raise DPConfigurationError(coverage.second_order_message())
            return
        if seen.outside:
            seen.drop()
            raise DPConfigurationError(coverage.missed_use_message(seen.outside))
        if seen.reordered:
            seen.drop()
            raise DPConfigurationError(batch_rows.reordered_message(seen.reordered))
        batch_rows.check_batch_dimension(seen.calls, seen.expected, seen.layers)
        if seen.time_major:  # also when the time length equals the batch size, which no size shows
            seen.drop()
            raise BatchDimensionError(batch_rows.time_major_message(seen.time_major))
        if seen.disagreeing:
            seen.drop()
            raise BatchDimensionError(batch_rows.DISAGREEING_MESSAGE)
        if seen.unreached is not None:
            coverage.refuse_unreached(seen.unreached)


def _mixed_or_untraced(seen: Observed) -> DPConfigurationError | None:
    """The refusals that come before anything else is read of the step's gradients."""
    if seen.batch_statistics:
        return DPConfigurationError(batch_rows.batch_statistics_message(seen.batch_statistics))
    if seen.tracer_refusals:
        return DPConfigurationError(seen.tracer_refusals[0])
    if seen.partial_backwards:
        return BatchDimensionError(batch_rows.partial_backwards_message())
    return None
