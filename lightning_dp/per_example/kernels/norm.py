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
    weight_bias,
)
from lightning_dp.per_example.kernels.registry import Cache, KernelPair, register_fast_clipper
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


@register_fast_clipper(nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
class _NormKernels(KernelPair):
    """LayerNorm / GroupNorm / eval-mode BatchNorm: norms and weighted sums of the (small) materialised affine gradients."""

    @staticmethod
    def sq_norms(
        layer: nn.Module, activations: list[Tensor], backprops: Tensor, cache: Cache | None = None
    ) -> dict[nn.Parameter, Tensor]:
        terms, positions, dim = _norm_layer_terms(layer, activations, backprops)
        if positions == 1:  # one position per example: nothing summed, nothing cancels
            return {p: cache_samples(cache, p, t.select(dim, 0)) for p, t in terms.items()}

        def exact(p: nn.Parameter) -> Callable[[Tensor], Tensor]:
            return lambda i: _norm_layer_grad_samples(
                layer, [activations[0][i]], backprops[i], torch.float64
            )[p]

        return {
            p: certified_cached(cache, p, t.sum(dim), position_norms_err(t, positions, dim), exact(p))
            for p, t in terms.items()
        }

    @staticmethod
    def weighted_grad(
        layer: nn.Module,
        activations: list[Tensor],
        backprops: Tensor,
        weights: Tensor,
        cache: Cache | None = None,
    ) -> dict[nn.Parameter, Tensor]:
        params = [p for p in weight_bias(layer) if p is not None]
        out = {p: g for p in params if (g := reuse_cached(cache, p, weights)) is not None}
        if len(out) < len(params):
            samples = _norm_layer_grad_samples(layer, activations, backprops)
            out.update(materialized_weighted_grad({p: samples[p] for p in params if p not in out}, weights))
        return out
