"""Clipping slot: how each per-example gradient is bounded."""

from lightning_dp.clipping.adaclip import AdaCliP, adaclip_scale
from lightning_dp.clipping.flat import FlatClipping, clip_factors, per_sample_norms, weighted_sum
from lightning_dp.clipping.integer_grid import GridClipping, IntegerGrid
from lightning_dp.clipping.l1 import L1Clipping

__all__ = [
    "AdaCliP",
    "FlatClipping",
    "GridClipping",
    "IntegerGrid",
    "L1Clipping",
    "adaclip_scale",
    "clip_factors",
    "per_sample_norms",
    "weighted_sum",
]
