"""Clipping slot: how each per-example gradient is bounded."""

from lightning_dp.clipping.adaclip import AdaCliP, adaclip_scale
from lightning_dp.clipping.flat import FlatClipping, clip_factors, per_sample_norms, weighted_sum

__all__ = ["AdaCliP", "FlatClipping", "adaclip_scale", "clip_factors", "per_sample_norms", "weighted_sum"]
