"""Conv1d/Conv2d kernels: norms by the method the autotuner picks, the clipped sum by the layer's own
weight-gradient convolution with the weights folded into the output gradients."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_dp.per_example.kernels.certified import (
    bias_sum,
    certified_cached,
    fold_weights,
    mask_rows,
    position_sum_err,
    reuse_cached,
    weight_bias,
)
from lightning_dp.per_example.kernels.conv_autotune import conv_method
from lightning_dp.per_example.kernels.conv_methods import (
    CONV_NORMS,
    MATERIALISING,
    conv_samples_grouped,
    conv_sum_err,
    conv_weight_grad,
)
from lightning_dp.per_example.kernels.registry import Cache, KernelPair, register_fast_clipper


@register_fast_clipper(nn.Conv1d, nn.Conv2d)
class _ConvKernels(KernelPair):
    """Convolution as a Linear layer over unfolded patches (T = output positions), per group.

    Norms by the Gram trick, or from per-example gradients materialised (by unfolding, or by one
    batch-grouped weight-gradient convolution) and then reused for the clipped sum.
    """

    @staticmethod
    def sq_norms(
        layer: nn.Module, activations: list[Tensor], backprops: Tensor, cache: Cache | None = None
    ) -> dict[nn.Parameter, Tensor]:
        assert isinstance(layer, nn.Conv1d | nn.Conv2d)
        weight, bias = weight_bias(layer)
        out: dict[nn.Parameter, Tensor] = {}
        x = activations[0]
        if weight is not None:
            method = conv_method(layer, x, backprops)
            result = CONV_NORMS[method](layer, x, backprops)  # per-example gradients or certified norms
            if method in MATERIALISING:
                result = certified_cached(
                    cache,
                    weight,
                    result,
                    conv_sum_err(layer, x, backprops),
                    lambda i: conv_samples_grouped(layer, x[i], backprops[i], torch.float64),
                )
            out[weight] = result
        if bias is not None:  # per-example bias gradients [B, O]: position sums, kept for the sum
            flat = backprops.float().flatten(2)
            out[bias] = certified_cached(
                cache,
                bias,
                flat.sum(2),
                position_sum_err(flat.abs().sum(2), flat.shape[2]),
                lambda i: backprops[i].double().flatten(2).sum(2),
            )
        return out

    @staticmethod
    def weighted_grad(
        layer: nn.Module,
        activations: list[Tensor],
        backprops: Tensor,
        weights: Tensor,
        cache: Cache | None = None,
    ) -> dict[nn.Parameter, Tensor]:
        assert isinstance(layer, nn.Conv1d | nn.Conv2d)
        weight, bias = weight_bias(layer)
        out: dict[nn.Parameter, Tensor] = {}
        if bias is not None:  # per-example bias gradients are small: sum over positions, then weight
            out[bias] = bias_sum(cache, bias, weights, lambda: backprops.float().flatten(2).sum(2))
        if weight is not None:
            reused = reuse_cached(cache, weight, weights)
            if reused is None:
                # The layer's own weight-gradient convolution with w_i·δ_i as output gradient: one
                # reduction over batch and positions, the same as a matmul of the unfolded patches.
                wd, keep = fold_weights(weights, backprops)
                x = mask_rows(activations[0], keep)
                reused = conv_weight_grad(layer, x, wd, layer.groups, layer.weight.shape)
            out[weight] = reused
        return out
