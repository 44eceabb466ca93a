"""The mixing check's tolerance model: how far rounding alone moves what the check compares.

A correct model's two passes (over different rows) still differ by rounding: the fp32 summation of the
kept sum, each example's recomputation over other rows, the compute dtype's precision. This module says
how much of a move that explains (:func:`move_tolerance`, :func:`relative_tolerance`), takes the kept
sums in chunks small enough that rounding can never hide a move of C (:func:`summation_chunk`,
:func:`_kept_sums`), and measures the distances compared against it. ``checks/mixing.py`` judges by it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from lightning_dp.checks.mixing_rows import _Items
from lightning_dp.checks.pass_precision import FullPrecision

if TYPE_CHECKING:
    from lightning_dp.per_example import PerExampleGradients


class _Summed(Protocol):
    """A pass whose per-example gradients :func:`_kept_sums` adds up and lets go (``mixing_passes._Pass``)."""

    samples: PerExampleGradients | None


RELATIVE_FLOOR = 1e-2
"""The smallest relative change of one example's gradient norm refused (the per-example test). The norms
compared are the certified ones, which may exceed the exact norm by up to ``GUARD_FRACTION`` (1 %) of its
square, by an amount that depends on the kernel a batch size selects."""
NEGLIGIBLE_MOVE = 1e-5
"""A move of the released sum below this many C is rounding, not a leak (the noise's std is σ·C)."""

FP32_EXAMPLE_ROUNDING = 2.0**-13
"""How much one example's fp32 gradient may differ, relatively, between passes over different rows: GEMM
blocking and the convolution algorithm a batch size selects (Winograd and FFT ones differ by ~1e-5 to
1e-4) change the rounding, not the value."""
_U32 = 2.0**-24


def _compute_eps(precision: str, device: torch.device) -> float:
    """Machine epsilon of the dtype the forward computes in (IEEE fp32 in the check's own passes,
    :data:`~lightning_dp.checks.pass_precision.FullPrecision`)."""
    if precision == FullPrecision.precision:
        return torch.finfo(torch.float32).eps
    if "bf16" in precision:
        return torch.finfo(torch.bfloat16).eps
    if "16" in precision:
        return torch.finfo(torch.float16).eps
    if device.type == "cuda":
        return 2.0**-10  # TF32 keeps a 10-bit mantissa (cuDNN convolutions use it by default)
    return torch.finfo(torch.float32).eps


def relative_tolerance(precision: str, device: torch.device) -> float:
    """The largest relative change of one example's gradient norm a correct model shows between the two
    passes: 16 units in the last place of the compute dtype, never below ``RELATIVE_FLOOR``."""
    return max(RELATIVE_FLOOR, 16 * _compute_eps(precision, device))


def example_rounding(precision: str, device: torch.device) -> float:
    """ρ: how much one example's gradient may differ, relatively, between two passes over different rows
    when nothing mixes (:data:`FP32_EXAMPLE_ROUNDING` in fp32, 4 ulps of a reduced compute dtype: each
    entry of a reduced-precision result rounds to one of its two neighbours, rarely differently)."""
    return max(FP32_EXAMPLE_ROUNDING, 4 * _compute_eps(precision, device))


def move_tolerance(
    clipped_norms: Tensor, max_grad_norm: float, rho: float, terms: int | None = None
) -> float:
    """The largest move of the kept examples' clipped sum (in units of C) that rounding explains.

    Two parts, from the kept examples' clipped norms c_j = f_j‖g_j‖ (each ≤ C): the fp32 summation of the
    K terms, certified in any order (2·γ_K·Σ_j c_j, γ_K = K·u/(1 − K·u), Higham §3.1, for both passes);
    and each example's own recomputation over other rows, ρ·c_j, whose errors come from different inputs
    and do not align (ρ·√Σ_j c_j², where a batch dependence moves the examples together: Σ_j). Plus
    :data:`NEGLIGIBLE_MOVE`. The size of the sum itself plays no part. For units, ``clipped_norms`` are
    the clipped magnitudes f_u·Σ_{r∈u} w_r‖g_r‖ (the rows' terms as the sums add them) and ``terms`` the
    kept rows (K in γ_K).
    """
    c = max_grad_norm if math.isfinite(max_grad_norm) and max_grad_norm > 0 else 1.0
    finite = clipped_norms[torch.isfinite(clipped_norms)].double()
    k = int(finite.numel()) if terms is None else terms
    gamma = k * _U32 / max(1 - k * _U32, 0.5)
    summed = 2 * gamma * float(finite.sum())
    recomputed = rho * float(finite.square().sum().sqrt())
    return NEGLIGIBLE_MOVE + (summed + recomputed) / c


SUMMATION_SHARE = 1 / 16
"""The share of C the fp32 summation of the kept sum may add to the tolerance at most (each item ≤ C)."""


def summation_chunk(items: int) -> int:
    """How many items one fp32 partial sum of a kept sum adds at most (the partial sums are added in fp64):
    with m items per partial sum, the summation's share of :func:`move_tolerance` is 2·γ_m·Σ_j c_j ≤ 2·m·u·K·C,
    kept at most :data:`SUMMATION_SHARE`·C for K items, so at no batch size can rounding hide a move of C
    (one fp32 sum of K = 2048 items would allow 0.5·C, of 8192 items 2·C)."""
    return max(1, int(SUMMATION_SHARE / (2 * _U32 * max(items, 1))))


def _kept_sums(run: _Summed, weights: list[Tensor], kept: list[int], count: int) -> list[list[Tensor]]:
    """For each weight vector (per item, as the readings give them), Σ over the ``kept`` rows (units) of the
    pass's per-example (per-unit) gradients times it, in fp64 on the CPU: fp32 partial sums of at most
    :func:`summation_chunk` items, added in fp64; the pass's gradients are let go."""
    samples, run.samples = run.samples, None
    assert samples is not None
    device = samples.params[0].device if samples.params else torch.device("cpu")
    chunk = summation_chunk(len(kept))
    masks = []
    for start in range(0, max(len(kept), 1), chunk):
        mask = torch.zeros(count, dtype=torch.float64)
        mask[kept[start : start + chunk]] = 1
        masks.append(mask)
    totals: list[list[Tensor]] = []
    for w in weights:
        parts = [
            [s.double().cpu() for s in samples.weighted_sum((w[:count] * mask).float().to(device))]
            for mask in masks
        ]
        totals.append([sum(terms[1:], terms[0]) for terms in zip(*parts, strict=True)])
    return totals


def _summation_terms(items: _Items, kept: list[int]) -> int:
    """The most terms one fp32 partial sum of :func:`_kept_sums` adds (γ's n in :func:`move_tolerance`): the
    kept rows, at most :func:`summation_chunk` of them; with units, a chunk of units, each a sum of its rows."""
    chunk = summation_chunk(len(kept))
    if items.units is None:
        return max(1, min(len(kept), chunk))
    rows = len(items.rows_of(kept))
    counts = torch.bincount(items.units.unit_of_row.cpu(), minlength=items.count)[kept] if kept else None
    largest = int(counts.max()) if counts is not None and counts.numel() else 1
    return max(1, min(rows, chunk + largest))


def _distance(a: list[Tensor], b: list[Tensor]) -> float:
    """‖a − b‖ over all tensors (fp64); equal non-finite entries (the same ±inf, NaN and NaN) count as 0."""
    total = 0.0
    for x, y in zip(a, b, strict=True):
        finite = torch.isfinite(x) & torch.isfinite(y)
        same = (x == y) | (x.isnan() & y.isnan())
        if not bool((finite | same).all()):
            return math.inf
        total += float((x - y).where(finite, 0.0).square().sum())
    return math.sqrt(total)


def _worst_norm_change(
    a: Tensor, b: Tensor, max_grad_norm: float, magnitudes: Tensor | None = None
) -> tuple[float, int]:
    """The largest relative change between the norms ``a`` and ``b`` (and its position), each measured
    against at least :func:`_change_floor`, and against a unit's magnitude (Σ_r w_r‖g_r‖, ``magnitudes``)
    when given: rows of one unit that cancel leave a small norm with the rounding of the large rows."""
    floor = _change_floor(torch.maximum(a, b), max_grad_norm)
    sizes = [0.0] * len(a) if magnitudes is None else magnitudes.nan_to_num(0.0, 0.0, 0.0).tolist()
    worst, position = 0.0, 0
    for i, (x, y, size) in enumerate(zip(a.tolist(), b.tolist(), sizes, strict=True)):
        if not (math.isfinite(x) and math.isfinite(y)):
            change = 0.0 if math.isfinite(x) == math.isfinite(y) else math.inf
        else:
            scale = max(x, y, floor, size)
            change = abs(x - y) / scale if scale > 0 else 0.0
        if change > worst:
            worst, position = change, i
    return worst, position


def _change_floor(norms: Tensor, max_grad_norm: float) -> float:
    """The smallest gradient norm a relative change is measured against.

    A near-zero gradient has no relative precision: a saturated softmax rounds p − 1 to a few ulps (or to 0
    for most rows of an overshooting model, so the batch's median can be 0), and passes over B and B − 1 rows
    round differently. A change is measured against at least a hundredth of the typical nonzero norm, and
    against at least ``NEGLIGIBLE_MOVE·C``, a movement of the released sum far below any leak.
    """
    nonzero = norms[torch.isfinite(norms) & (norms > 0)]
    typical = float(nonzero.median()) if nonzero.numel() else 0.0
    return max(1e-2 * typical, _negligible(max_grad_norm))


def _negligible(max_grad_norm: float) -> float:
    """A gradient change too small to matter: ``NEGLIGIBLE_MOVE·C`` (0 without a finite C)."""
    return NEGLIGIBLE_MOVE * max_grad_norm if math.isfinite(max_grad_norm) else 0.0
