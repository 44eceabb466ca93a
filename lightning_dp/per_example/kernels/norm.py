"""LayerNorm/GroupNorm kernels (and BatchNorm frozen in eval mode, an affine map per channel): small
parameters, per-example gradients materialised (Opacus's formulas)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_dp.per_example.kernels.certified import (
    cache_samples,
    certified_cached,
    position_norms_err,
    reuse_cached,
    rounding_gamma,
    weight_bias,
)
from lightning_dp.per_example.kernels.registry import Grads, KernelCall, KernelPair, register_fast_clipper
from lightning_dp.per_example.materialized import materialized_weighted_grad


def _norm_layer_terms(
    layer: nn.Module, activations: list[Tensor], backprops: Tensor, dtype: torch.dtype = torch.float32
) -> tuple[dict[nn.Parameter, Tensor], int, int]:
    """Per-position terms in ``dtype`` of a LayerNorm or GroupNorm layer's per-example affine gradients
    (their sum over the P positions), P, and the positions' dim: [B, P, *shape] (LayerNorm, dim 1) or
    [B, C, P] (GroupNorm, dim 2, the layout as stored)."""
    x, d = activations[0].to(dtype), backprops.to(dtype)
    B = d.shape[0]
    out: dict[nn.Parameter, Tensor] = {}
    weight, bias = weight_bias(layer)
    if isinstance(layer, nn.LayerNorm):
        shape = tuple(layer.normalized_shape)
        normed = F.layer_norm(x, layer.normalized_shape, eps=layer.eps) if weight is not None else x
    else:
        if isinstance(layer, _BatchNorm):  # eval mode (a step in train mode is refused before its release)
            normed = x
            if weight is not None:
                mean, var = layer.running_mean, layer.running_var
                assert mean is not None
                assert var is not None
                normed = F.batch_norm(x, mean.to(dtype), var.to(dtype), eps=layer.eps, training=False)
        else:
            assert isinstance(layer, nn.GroupNorm)
            normed = F.group_norm(x, layer.num_groups, eps=layer.eps) if weight is not None else x
        # [B, C] (GroupNorm after a BatchNorm1d swap) has one position per channel
        d = d.flatten(2) if d.dim() > 2 else d.unsqueeze(-1)
        if weight is not None:
            out[weight] = (normed.flatten(2) if normed.dim() > 2 else normed.unsqueeze(-1)) * d
        if bias is not None:
            out[bias] = d
        return out, d.shape[2], 2
    positions = math.prod(d.shape[1 : d.dim() - len(shape)])
    d = d.reshape(B, positions, *shape)
    if weight is not None:
        out[weight] = normed.reshape(B, positions, *shape) * d
    if bias is not None:
        out[bias] = d
    return out, positions, 1


def _norm_layer_grad_samples(
    layer: nn.Module, activations: list[Tensor], backprops: Tensor, dtype: torch.dtype = torch.float32
) -> dict[nn.Parameter, Tensor]:
    """Per-example affine gradients [B, *shape] in ``dtype`` (fp32) of a LayerNorm or GroupNorm layer."""
    terms, _, dim = _norm_layer_terms(layer, activations, backprops, dtype)
    return {p: t.sum(dim) for p, t in terms.items()}


GROUP_CHUNK_FLOATS = 1 << 19
"""Floats of input per chunk of examples in :func:`_group_norm_samples` (2 MiB: the chunk's normalised
copy stays in the CPU's cache between the two passes)."""


def _group_norm_samples(
    layer: nn.GroupNorm, x: Tensor, d: Tensor
) -> tuple[dict[nn.Parameter, Tensor], dict[nn.Parameter, Tensor]]:
    """GroupNorm's per-example affine gradients [B, C] (fp32) and a bound on each one's rounding error
    (Frobenius), from torch's own GroupNorm backward with the batch folded into the channels.

    With N = 1, B·C channels and B·G groups, ``native_group_norm_backward``'s weight and bias gradients
    are Σ_p x̂ δ and Σ_p δ per (example, channel): the per-example gradients, in the fused passes plain
    training runs, instead of a normalised copy, a product and two sums over [B, C, P] (5× faster at
    WRN-16-4's 64 × 32 × 32). The statistics come from the forward kernel, a chunk of examples at a time.
    However that kernel orders its sums, Σ_p x̂_p δ_p is off by at most γ_{P+2}·rstd·(Σ|x||δ| + |μ| Σ|δ|)
    ≤ γ_{P+2}·rstd·(‖x_c‖ + |μ|√P)‖δ_c‖ and Σ_p δ_p by γ_P √P ‖δ_c‖ (Cauchy–Schwarz)."""
    weight, bias = weight_bias(layer)
    B, C, G = x.shape[0], layer.num_channels, layer.num_groups
    xs, ds = x.float().reshape(B, C, -1), d.float().reshape(B, C, -1)
    P = xs.shape[2]
    gw, gb, err_w, err_b = (xs.new_empty(B, C) for _ in range(4))
    step = max(1, GROUP_CHUNK_FLOATS // max(1, C * P))
    for start in range(0, B, step):
        rows = slice(start, min(B, start + step))
        xc, dc = xs[rows].contiguous(), ds[rows].contiguous()
        b = xc.shape[0]
        _, mean, rstd = torch.ops.aten.native_group_norm(xc, None, None, b, C, P, G, layer.eps)
        _, w_rows, b_rows = torch.ops.aten.native_group_norm_backward(
            dc.view(1, b * C, P), xc.view(1, b * C, P), mean.view(1, -1), rstd.view(1, -1), None,
            1, b * C, P, b * G, [False, True, True],
        )  # fmt: skip
        gw[rows], gb[rows] = w_rows.view(b, C), b_rows.view(b, C)
        x_norm, d_norm = torch.linalg.vector_norm(xc, dim=2), torch.linalg.vector_norm(dc, dim=2)
        spread = (x_norm + mean.abs().repeat_interleave(C // G, dim=1) * math.sqrt(P)) * d_norm
        err_w[rows] = spread * rstd.repeat_interleave(C // G, dim=1)
        err_b[rows] = d_norm
    samples, errors = {}, {}
    if weight is not None:
        samples[weight] = gw
        errors[weight] = rounding_gamma(P + 2) * torch.linalg.vector_norm(err_w, dim=1)
    if bias is not None:
        samples[bias] = gb
        errors[bias] = rounding_gamma(P) * math.sqrt(P) * torch.linalg.vector_norm(err_b, dim=1)
    return samples, errors


@register_fast_clipper(nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
class _NormKernels(KernelPair):
    """LayerNorm / GroupNorm / eval-mode BatchNorm: norms and weighted sums of the (small) materialised affine gradients."""

    @staticmethod
    def sq_norms(call: KernelCall) -> Grads:
        layer, backprops = call.layer, call.backprops
        if isinstance(layer, nn.GroupNorm) and backprops.dim() > 2 and backprops.shape[0] > 0:
            return _group_norm_sq_norms(layer, call)
        terms, positions, dim = _norm_layer_terms(layer, call.activations, backprops)
        if positions == 1:  # one position per example: nothing summed, nothing cancels
            return {p: cache_samples(call.cache, p, t.select(dim, 0)) for p, t in terms.items()}
        return {
            p: certified_cached(
                call.cache, p, t.sum(dim), position_norms_err(t, positions, dim), _exact_samples(call, p)
            )
            for p, t in terms.items()
        }

    @staticmethod
    def weighted_grad(call: KernelCall, weights: Tensor) -> Grads:
        params = [p for p in weight_bias(call.layer) if p is not None]
        out = {p: g for p in params if (g := reuse_cached(call.cache, p, weights)) is not None}
        if len(out) < len(params):
            samples = _norm_layer_grad_samples(call.layer, call.activations, call.backprops)
            out.update(materialized_weighted_grad({p: samples[p] for p in params if p not in out}, weights))
        return out


def _exact_samples(call: KernelCall, p: nn.Parameter) -> Callable[[Tensor], Tensor]:
    """The guard's recompute: the per-example gradients of ``p`` in fp64 of the examples ``i``."""
    return lambda i: _norm_layer_grad_samples(
        call.layer, [call.activations[0][i]], call.backprops[i], torch.float64
    )[p]


def _group_norm_sq_norms(layer: nn.GroupNorm, call: KernelCall) -> Grads:
    """Certified squared norms of GroupNorm's per-example affine gradients (``layer`` is ``call.layer``)
    from :func:`_group_norm_samples`; flagged examples are recomputed in fp64 from the normalised input."""
    samples, errors = _group_norm_samples(layer, call.activations[0], call.backprops)
    return {
        p: certified_cached(call.cache, p, g, errors[p], _exact_samples(call, p)) for p, g in samples.items()
    }
