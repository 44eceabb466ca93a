"""Unit norms (grouped clipping): ‖Σ_{r∈u} w_r g_r‖² per unit u of rows, never understated.

A unit's rows (a user's examples, an example's augmented views) are clipped as one. For a Linear layer
g_r = Σ_t δ_{r,t} a_{r,t}ᵀ, so Σ_{r∈u} w_r g_r is the gradient of ONE example whose sequence is the unit's
rows concatenated (length n_u·T, zero-padded to k·T, with w_r folded into δ): :func:`regroup` builds
that batch of units and the per-example sequence kernels apply unchanged (Gram or materialise, chosen
again for the longer sequence; their certified rounding bounds then cover rows of one unit that cancel).
Embedding is the same with indices; a convolution is a Linear over its unfolded patches (per group).
Every other layer materialises its per-row gradients and index-adds them per unit
(:func:`unit_sums_sq_norms`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_dp.per_example.kernels.certified import (
    certified_sq_norms,
    gram_sq_norm,
    outer_sum_err,
    position_norms_err,
    rounding_gamma,
    sum_bound,
    weight_bias,
)
from lightning_dp.per_example.kernels.conv_methods import _conv_inputs
from lightning_dp.per_example.kernels.embedding import (
    _embedding_rows_sq_norms,
    embedding_inputs,
    embedding_terms,
)
from lightning_dp.per_example.kernels.linear import _linear_inputs, use_gram
from lightning_dp.per_example.kernels.registry import is_supported
from lightning_dp.per_example.materialized import materialized_sq_norm
from lightning_dp.per_example.precision import ieee_fp32


def regroup(x: Tensor, unit_of_row: Tensor, num_units: int) -> Tensor:
    """Rows [R, T, ...] as units [U, k·T, ...]: each unit's rows one after another, zero-padded to the
    largest unit's k rows (``unit_of_row`` non-decreasing, rows of a unit contiguous)."""
    rows = x.shape[0]
    counts = unit_of_row.bincount(minlength=num_units)
    k = int(counts.max()) if rows else 1
    starts = counts.cumsum(0) - counts
    position = torch.arange(rows, device=x.device) - starts[unit_of_row]
    out = x.new_zeros((num_units * k, *x.shape[1:]))
    out.index_copy_(0, unit_of_row * k + position, x)
    return out.reshape(num_units, k * x.shape[1], *x.shape[2:])


def has_unit_kernel(layer: nn.Module) -> bool:
    """Whether ``layer``'s unit norms come from its regrouped inputs (else: materialise and index-add)."""
    if not is_supported(layer):
        return False
    if type(layer) in (nn.Linear, nn.Embedding):
        return True
    return type(layer) in (nn.Conv1d, nn.Conv2d)


def unit_sq_norms(
    layer: nn.Module,
    activations: list[Tensor],
    backprops: Tensor,
    unit_of_row: Tensor,
    weights: Tensor,
    num_units: int,
) -> dict[nn.Parameter, Tensor]:
    """Per-unit squared norms [U] (fp32, raw scale) of each trainable parameter of a fast-path layer call:
    the norms of Σ_{r∈u} w_r g_r, from the layer's inputs and output gradients regrouped by unit."""
    with ieee_fp32():
        w = weights.to(device=backprops.device, dtype=torch.float32)
        rows = backprops.shape[0]
        if isinstance(layer, nn.Embedding):
            return _embedding(layer, activations, backprops, unit_of_row, w, num_units)
        if isinstance(layer, nn.Linear):
            a, d = _linear_inputs(layer, activations, backprops)
            d = d * w.view(-1, 1, 1)
            weight, bias = weight_bias(layer)
            return _sequence(weight, bias, a, d, unit_of_row, num_units, rows)
        assert isinstance(layer, nn.Conv1d | nn.Conv2d)
        return _conv(layer, activations[0], backprops, unit_of_row, w, num_units)


def _sequence(
    weight: nn.Parameter | None,
    bias: nn.Parameter | None,
    a: Tensor,
    d: Tensor,
    unit_of_row: Tensor,
    num_units: int,
    rows: int,
) -> dict[nn.Parameter, Tensor]:
    """Linear unit norms from a [R, T, p] and weight-folded d [R, T, o] (fp32): one sequence per unit."""
    out: dict[nn.Parameter, Tensor] = {}
    T = a.shape[1]
    ua, ud = regroup(a, unit_of_row, num_units), regroup(d, unit_of_row, num_units)
    # the clipped sum reduces over every row and position of the batch: R·T terms at most
    terms = rows * T
    if weight is not None:
        out[weight] = _outer_norms(ua, ud, terms)
    if bias is not None:
        out[bias] = _position_sum_norms(ud, terms)
    return out


def _outer_norms(ua: Tensor, ud: Tensor, terms: int) -> Tensor:
    """‖Σ_t δ_t a_tᵀ‖² per unit sequence (Gram trick or materialised, whichever costs fewer FLOPs at this
    length), certified; a unit whose rows cancel is recomputed in fp64 with the clipped sum's rounding added."""
    L, p, o = ua.shape[1], ua.shape[2], ud.shape[2]

    def exact(i: Tensor) -> Tensor:
        return torch.bmm(ud[i].double().transpose(1, 2), ua[i].double()).flatten(1).square().sum(1)

    spread = (ua.norm(dim=2) * ud.norm(dim=2)).sum(1)
    if use_gram(L, p, o):
        values, bound, spread = gram_sq_norm(ua, ud)
    else:
        values = materialized_sq_norm(torch.bmm(ud.transpose(1, 2), ua))
        bound = sum_bound(values, outer_sum_err(ua, ud))
    return certified_sq_norms(values, bound, exact, spread, terms)


def _position_sum_norms(ud: Tensor, terms: int) -> Tensor:
    """‖Σ_t δ_t‖² per unit sequence (a bias), certified as :func:`_outer_norms`."""
    values = materialized_sq_norm(ud.sum(1))
    bound = sum_bound(values, position_norms_err(ud, ud.shape[1]))
    spread = ud.norm(dim=2).sum(1)
    return certified_sq_norms(values, bound, lambda i: ud[i].double().sum(1).square().sum(1), spread, terms)


def _embedding(
    layer: nn.Embedding,
    activations: list[Tensor],
    backprops: Tensor,
    unit_of_row: Tensor,
    w: Tensor,
    num_units: int,
) -> dict[nn.Parameter, Tensor]:
    weight, _ = weight_bias(layer)
    if weight is None:
        return {}
    idx, d = embedding_inputs(layer, activations, backprops)  # padding_idx positions zeroed
    d = d * w.view(-1, 1, 1)
    terms = idx.numel()
    uidx, ud = regroup(idx, unit_of_row, num_units), regroup(d, unit_of_row, num_units)

    def exact(i: Tensor) -> Tensor:
        return _embedding_rows_sq_norms(layer, uidx[i], ud[i].double())

    values, bound, spread = embedding_terms(layer, uidx, ud)
    return {weight: certified_sq_norms(values, bound, exact, spread, terms)}


def _conv(
    layer: nn.Conv1d | nn.Conv2d, x: Tensor, backprops: Tensor, unit_of_row: Tensor, w: Tensor, num_units: int
) -> dict[nn.Parameter, Tensor]:
    """A convolution as a Linear over its unfolded patches, one per group: the groups' norms add up."""
    weight, bias = weight_bias(layer)
    patches, d = _conv_inputs(layer, x, backprops)  # [R, G, L, p/G], [R, G, L, o/G]
    d = d * w.view(-1, 1, 1, 1)
    rows, G, L = d.shape[0], d.shape[1], d.shape[2]
    out: dict[nn.Parameter, Tensor] = {}
    terms = rows * L
    if weight is not None:
        total = torch.zeros(num_units, dtype=torch.float32, device=d.device)
        for g in range(G):
            ua = regroup(patches[:, g].contiguous(), unit_of_row, num_units)
            ud = regroup(d[:, g].contiguous(), unit_of_row, num_units)
            total += _outer_norms(ua, ud, terms)
        out[weight] = total
    if bias is not None:
        out[bias] = _position_sum_norms(regroup(d.transpose(1, 2).flatten(2), unit_of_row, num_units), terms)
    return out


def unit_sums_sq_norms(samples: Tensor, unit_of_row: Tensor, weights: Tensor, num_units: int) -> Tensor:
    """Per-unit squared norms [U] (fp32) of Σ_{r∈u} w_r g_r from materialised per-row gradients [R, ...]:
    the sums in fp64 (rows that cancel lose nothing), plus the rounding of the fp32 clipped sum that adds
    the rows back up (γ_R Σ_{r∈u} |w_r|‖g_r‖), so a unit of huge cancelling rows still contributes ≤ C."""
    g = samples.double().flatten(1)
    w = weights.to(device=g.device, dtype=torch.float64)
    index = unit_of_row.to(g.device)
    sums = g.new_zeros(num_units, g.shape[1]).index_add_(0, index, g * w.unsqueeze(1))
    spread = g.new_zeros(num_units).index_add_(0, index, w.abs() * g.norm(dim=1))
    norms = sums.norm(dim=1) + rounding_gamma(max(samples.shape[0], 1)) * spread
    return norms.square().float()


def single_row_units(unit_of_row: Tensor, num_units: int) -> tuple[Tensor, Tensor]:
    """(mask [U] of units with exactly one row, the first row of every unit [U])."""
    counts = unit_of_row.bincount(minlength=num_units)
    return counts == 1, counts.cumsum(0) - counts
