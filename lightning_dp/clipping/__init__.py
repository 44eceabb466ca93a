"""Clipping slot: how each per-example gradient is bounded."""

from lightning_dp.clipping.adaclip import AdaCliP, adaclip_scale
from lightning_dp.clipping.automatic import AutoClipping
from lightning_dp.clipping.flat import FlatClipping, clip_factors, per_sample_norms, weighted_sum
from lightning_dp.clipping.integer_grid import GridClipping, IntegerGrid
from lightning_dp.clipping.l1 import L1Clipping
from lightning_dp.clipping.quantile import QuantileClipping

__all__ = [
    "AdaCliP",
    "AutoClipping",
    "FlatClipping",
    "GridClipping",
    "IntegerGrid",
    "L1Clipping",
    "QuantileClipping",
    "adaclip_scale",
    "clip_factors",
    "per_sample_norms",
    "weighted_sum",
]
