"""Float tolerances that scale with the dtype and the magnitude of what was summed.

Results computed by different kernels (AVX2, AVX-512, the default ATen paths; Gram, unfold, grouped
convolutions) round differently; the difference is a few units in the last place of the *terms'*
magnitude per √(number of terms), not of the result's, so an absolute fp32 tolerance fails on entries
that nearly cancel. Every comparison of two fp32 computations goes through these helpers.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def rtol_for(dtype: torch.dtype, terms: int = 1) -> float:
    """Relative tolerance for a value summed in ``dtype`` from ``terms`` terms: 16 ulps · √terms.

    16 ulps cover the few roundings per term of any blocked or vectorised order; √terms is the
    growth of independent rounding errors (the worst case, ``terms`` ulps, is never approached).
    """
    return 16 * torch.finfo(dtype).eps * math.sqrt(max(1, terms))


def assert_close_scaled(
    got: Tensor,
    want: Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    terms: int = 1,
    scale: float | Tensor | None = None,
    rtol: float | None = None,
) -> None:
    """``got`` ≈ ``want`` within ``rtol`` (default :func:`rtol_for`) relative to each entry, and absolutely
    within the same tolerance times ``scale`` (default: the largest |want|), the magnitude the entries were
    summed from; ``rtol`` for results of many steps (trained weights), where rounding compounds."""
    tol = rtol_for(dtype, terms) if rtol is None else rtol
    if scale is None:
        scale = float(want.abs().max()) if want.numel() else 0.0
    scale = float(scale)
    torch.testing.assert_close(got, want.to(got.dtype), rtol=tol, atol=tol * scale + torch.finfo(dtype).tiny)


UNDERSTATE = 1e-6
"""Most a norm may fall below the exact one, relative: sums of squares of fp32 values (no cancellation)
are that accurate, and clip_factors' 1e-5 margin absorbs it, so a clipped contribution stays ≤ C."""


def assert_certified(value: Tensor, exact: Tensor, overstate: float) -> None:
    """``value`` (a squared norm from the fast path) is never below ``exact`` by more than
    :data:`UNDERSTATE` and above it by at most the fraction ``overstate`` (the guard's rounding bound)."""
    exact, v = exact.double(), value.double()
    tiny = torch.finfo(value.dtype).tiny
    assert bool((v >= exact * (1 - UNDERSTATE) - tiny).all()), ((v - exact) / exact).min().item()
    assert bool((v <= exact * (1 + overstate) + tiny).all()), ((v - exact) / exact).max().item()
