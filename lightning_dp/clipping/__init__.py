"""Clipping slot: how each per-example gradient is bounded."""

from lightning_dp.clipping.flat import FlatClipping, clip_factors, per_sample_norms, weighted_sum

__all__ = ["FlatClipping", "clip_factors", "per_sample_norms", "weighted_sum"]
