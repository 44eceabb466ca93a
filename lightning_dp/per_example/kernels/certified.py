"""What every kernel shares: trainable weight/bias, weight folding, and the guard that keeps norms from
understating (a rounding-error bound per example, fp64 recompute where terms cancel)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from lightning_dp.per_example.kernels.registry import Cache
from lightning_dp.per_example.materialized import materialized_sq_norm, materialized_weighted


def weight_bias(layer: nn.Module) -> tuple[nn.Parameter | None, nn.Parameter | None]:
    """The layer's trainable ``weight`` and ``bias`` (None where absent or frozen)."""
    found = (getattr(layer, "weight", None), getattr(layer, "bias", None))
    weight, bias = (p if isinstance(p, nn.Parameter) and p.requires_grad else None for p in found)
    return weight, bias


def fold_weights(weights: Tensor, backprops: Tensor) -> tuple[Tensor, Tensor]:
    """(w_i·δ_i in fp32, keep mask [B]); weight-0 examples become exact zeros (NaN-safe)."""
    w = weights.to(device=backprops.device, dtype=torch.float32)
    keep = w != 0
    shape = (-1, *([1] * (backprops.dim() - 1)))
    if bool(keep.all()):  # the usual case: no example dropped, no mask pass needed
        return w.view(shape) * backprops.float(), keep
    folded = torch.where(keep.view(shape), w.view(shape) * backprops.float(), 0.0)
    return folded, keep


def mask_rows(x: Tensor, keep: Tensor) -> Tensor:
    """Zero the examples of ``x`` (batch first) that are not kept, so 0·NaN never enters a matmul."""
    if bool(keep.all()):
        return x
    return torch.where(
        keep.view(-1, *([1] * (x.dim() - 1))), x, torch.zeros((), device=x.device, dtype=x.dtype)
    )


# --------------------------------------------------------------------------------------------------
# The guard: norms that never understate
# --------------------------------------------------------------------------------------------------

KEEP_FACTOR = 2
"""A layer keeps its materialised per-example gradients for the clipped sum (dropping its inputs and
output gradient) while they take at most this many times the floats of what its record held: the sum is
then a B-term weighted sum instead of a second reduction over every position, for a small rise in the
step's peak (the records are a fraction of it: plain's own weight gradients are not kept)."""

GUARD_FRACTION = 1e-2
"""Largest rounding-error bound, as a fraction of the computed squared norm, that is accepted (and added
to it); beyond it the terms cancel and the example is recomputed exactly in fp64. Typical data sit far
below (a transformer's Linear at T = 128, d = 768: about 5e-4), crafted cancelling data far above."""
_U32 = 2.0**-24
_SLACK = 1.125
"""Covers second-order terms and the fp32 rounding of the bound itself (every γ used is ≤ 1/64)."""


def rounding_gamma(n: int) -> float:
    """γ_n = n·u/(1 − n·u), u = 2⁻²⁴: bound on the relative error of an fp32 sum or dot product of n
    terms in ANY order (blocked, pairwise, FMA), relative to the sum of the terms' magnitudes (Higham,
    *Accuracy and Stability of Numerical Algorithms*, §3.1). ∞ past n·u = 1/64, so the caller recomputes."""
    nu = n * _U32
    return nu / (1 - nu) if nu <= 1 / 64 else math.inf


def certified_sq_norms(
    values: Tensor,
    bound: Tensor,
    exact: Callable[[Tensor], Tensor],
    spread: Tensor | None = None,
    fold_terms: int = 0,
) -> Tensor:
    """Squared norms [B] (fp32) that never understate the exact ones, from fp32 ``values`` and a bound
    on their rounding error: ``values + bound`` where the bound is at most :data:`GUARD_FRACTION` of the
    value, else (cancellation, non-finite, negative) ``exact(index)``, the fp64 norms of those examples.

    With ``spread`` (Σ_t ‖a_t‖‖δ_t‖ per example) the clipped sum is recomputed from (a, δ) in fp32 by
    sums of at most ``fold_terms`` terms, so a recomputed example also gets that sum's rounding bound
    γ·spread added to its norm: a crafted example whose huge terms cancel still contributes at most C.
    """
    flagged = ~(bound <= GUARD_FRACTION * values)  # NaN-safe: a NaN value or bound is flagged
    out = values + bound
    if not bool(flagged.any()):
        return out
    index = flagged.nonzero().squeeze(1)
    exact_values = exact(index).double()
    if spread is not None:
        exact_values = (exact_values.sqrt() + rounding_gamma(fold_terms) * spread[index].double()).square()
    return out.index_put((index,), exact_values.float())


def gram_certified(aa: Tensor, dd: Tensor, p_len: int, o_len: int) -> tuple[Tensor, Tensor, Tensor]:
    """(Σ_ts aa_ts·dd_ts, a bound on its fp32 rounding error, Σ_t ‖a_t‖‖δ_t‖) per row of the [N, T, T]
    Gram matrices aa = AAᵀ (dot products of length ``p_len``) and dd = DDᵀ (``o_len``).

    Each aa_ts is off by at most γ_p‖a_t‖‖a_s‖ (‖a_t‖² = aa_tt), each dd_ts by γ_o‖δ_t‖‖δ_s‖; the T²
    products and their sum are formed in fp64 (exact products, negligible rounding; O(T²) next to the
    Gram matrices' O(T²(p + o))), so cancellation among them costs nothing. A few O(T²) ops on matrices
    already made. Takes ``aa`` and ``dd`` over (their absolute values are taken in place).
    """
    value = torch.linalg.vecdot(
        aa.double().flatten(1), dd.double().flatten(1)
    ).float()  # 15× faster than mul-sum
    n = aa.diagonal(dim1=1, dim2=2).clamp(min=0).sqrt()
    m = dd.diagonal(dim1=1, dim2=2).clamp(min=0).sqrt()
    spread = (n * m).sum(1)
    gp, go = rounding_gamma(p_len), rounding_gamma(o_len)
    if math.inf in (gp, go):
        return value, torch.full_like(value, math.inf), spread
    # rounding the fp64 sum to fp32 (u·|value|); the fp64 sum's own error, ≤ T²·2⁻⁵³ Σ|aa∘dd|, is below
    # u·Σ|aa∘dd| ≤ the entry terms below (|aa_ts| ≤ n_t n_s, |dd_ts| ≤ m_t m_s) while T² < 2²⁹
    bound = _U32 * value.abs() + gp * go * spread.square()
    if gp:
        bound += gp * (torch.bmm(dd.abs_(), n.unsqueeze(2)).squeeze(2) * n).sum(1)
    if go:
        bound += go * (torch.bmm(aa.abs_(), m.unsqueeze(2)).squeeze(2) * m).sum(1)
    return value, bound * _SLACK, spread


def gram_sq_norm(a: Tensor, d: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """‖Σ_t d_t a_tᵀ‖²_F per example for a [B, T, p] and d [B, T, o] by the Gram trick (fp32), with its
    rounding bound and spread (see :func:`gram_certified`)."""
    aa = torch.bmm(a, a.transpose(1, 2))
    dd = torch.bmm(d, d.transpose(1, 2))
    return gram_certified(aa, dd, a.shape[2], d.shape[2])


def sum_bound(values: Tensor, err: Tensor) -> Tensor:
    """Bound on ‖g‖² − ‖ĝ‖² given ‖ĝ‖² = ``values`` and ‖g − ĝ‖ ≤ ``err``: (‖ĝ‖ + err)² − ‖ĝ‖²."""
    return err * (2 * values.clamp(min=0).sqrt() + err) * _SLACK


def certified_cached(
    cache: Cache | None,
    param: nn.Parameter,
    samples: Tensor,
    err: Tensor,
    exact: Callable[[Tensor], Tensor],
) -> Tensor:
    """:func:`cache_samples` for per-example gradients summed over positions in fp32, ``err`` bounding each
    example's rounding error (Frobenius): norms that never understate; the examples the guard flags are
    recomputed in fp64 by ``exact(index)`` ([k, *shape]) and replaced in ``samples`` too, so the clipped
    sum that reuses them adds the exact gradient."""
    values = materialized_sq_norm(samples)
    bound = sum_bound(values, err)

    def recompute(index: Tensor) -> Tensor:
        exact_samples = exact(index)
        samples[index] = exact_samples.to(samples.dtype)
        return exact_samples.flatten(1).square().sum(1)

    norms = certified_sq_norms(values, bound, recompute)
    if cache is not None:
        cache[param] = samples
    return norms


def position_sum_err(terms_abs_sum: Tensor, positions: int) -> Tensor:
    """γ_T‖Σ_t |term_t|‖ per example: the rounding bound of a per-example gradient summed over T
    positions, from the entrywise sums of the terms' magnitudes [B, ...]."""
    return rounding_gamma(positions) * terms_abs_sum.flatten(1).norm(dim=1)


def position_norms_err(terms: Tensor, positions: int, dim: int = 1) -> Tensor:
    """A bound on the rounding of ``terms`` [B, ...] summed in fp32 over the T positions of dim ``dim``.

    With the positions outermost (a sequence's [B, T, features]) it is γ_T Σ_t ‖term_t‖ (‖Σ_t |term_t|‖
    ≤ Σ_t ‖term_t‖, triangle inequality): one fused norm pass over the innermost dimensions, without the
    |terms| copy (about as tight: within √(π/2) on Gaussian terms). With the positions innermost
    ([B, C, P] maps) torch reduces a middle dimension ten times slower than that copy, so it is
    :func:`position_sum_err` of the summed magnitudes there."""
    if dim == terms.dim() - 1:
        return position_sum_err(terms.abs().sum(dim), positions)
    norms = torch.linalg.vector_norm(terms.flatten(dim + 1), dim=dim + 1)
    return rounding_gamma(positions) * norms.flatten(1).sum(1)


def outer_sum_err(a: Tensor, d: Tensor) -> Tensor:
    """γ_T Σ_t ‖a_t‖‖δ_t‖ per example: the rounding bound of Σ_t δ_t a_tᵀ for a [B, T, p], d [B, T, o]."""
    return rounding_gamma(a.shape[1]) * (a.norm(dim=2) * d.norm(dim=2)).sum(1)


def cache_samples(cache: Cache | None, param: nn.Parameter, samples: Tensor) -> Tensor:
    """Keep a materialised per-example gradient for ``weighted_grad``; return its squared norms."""
    if cache is not None:
        cache[param] = samples
    return materialized_sq_norm(samples)


def reuse_cached(cache: Cache | None, param: nn.Parameter | None, weights: Tensor) -> Tensor | None:
    """Σ_i w_i g_i from a per-example gradient ``sq_norms`` materialised, if it did."""
    if cache is None or param is None or param not in cache:
        return None
    samples = cache[param]
    return materialized_weighted(samples, weights.to(samples.device))


def bias_sum(
    cache: Cache | None, bias: nn.Parameter, weights: Tensor, samples: Callable[[], Tensor]
) -> Tensor:
    """Σ_i w_i g_i of a bias whose per-example gradients [B, O] ``sq_norms`` cached, else ``samples()``."""
    reused = reuse_cached(cache, bias, weights)
    return materialized_weighted(samples(), weights) if reused is None else reused
