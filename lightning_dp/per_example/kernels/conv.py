"""Conv1d/Conv2d kernels: norms by the method the cost model picks (:mod:`.conv_autotune`), the clipped sum
from the per-example gradients the norms kept, else by the cheapest reduction over batch and positions
(the layer's own weight-gradient convolution with the weights folded into the output gradients, a matmul
of unfolded patches, or per-example gradients formed a chunk at a time). A kernel whose offsets partly
never touch the input (small maps) works on the live offsets only (:class:`.conv_methods.LiveTaps`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_dp.per_example.kernels.certified import (
    bias_sum,
    certified_cached,
    position_norms_err,
    reuse_cached,
    weight_bias,
)
from lightning_dp.per_example.kernels.conv_autotune import conv_plan
from lightning_dp.per_example.kernels.conv_methods import (
    CONV_NORMS,
    CONV_SUMS,
    MATERIALISING,
    conv_samples_grouped,
    conv_sum_err,
)
from lightning_dp.per_example.kernels.registry import Grads, KernelCall, KernelPair, register_fast_clipper


@register_fast_clipper(nn.Conv1d, nn.Conv2d)
class _ConvKernels(KernelPair):
    """Convolution as a Linear layer over unfolded patches (T = output positions), per group.

    Norms by the Gram trick, or from per-example gradients materialised (by unfolding, by one
    batch-grouped weight-gradient convolution or by a correlation) and then reused for the clipped sum.
    """

    @staticmethod
    def sq_norms(call: KernelCall) -> Grads:
        layer, backprops, cache = call.layer, call.backprops, call.cache
        assert isinstance(layer, nn.Conv1d | nn.Conv2d)
        weight, bias = weight_bias(layer)
        out: Grads = {}
        x = call.activations[0]
        if weight is not None:
            plan = conv_plan(layer, x, backprops)
            if plan.live is not None:  # the dead offsets' gradients are exactly 0: the core's norms
                out[weight] = CONV_NORMS[plan.norms](plan.live.core, plan.live.input(x), backprops)
            else:
                result = CONV_NORMS[plan.norms](layer, x, backprops)  # per-example gradients or norms
                if plan.norms in MATERIALISING:
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
                position_norms_err(flat, flat.shape[2], dim=2),
                lambda i: backprops[i].double().flatten(2).sum(2),
            )
        return out

    @staticmethod
    def weighted_grad(call: KernelCall, weights: Tensor) -> Grads:
        layer, backprops, cache = call.layer, call.backprops, call.cache
        assert isinstance(layer, nn.Conv1d | nn.Conv2d)
        weight, bias = weight_bias(layer)
        out: Grads = {}
        if bias is not None:  # per-example bias gradients are small: sum over positions, then weight
            out[bias] = bias_sum(cache, bias, weights, lambda: backprops.float().flatten(2).sum(2))
        if weight is not None:
            reused = reuse_cached(cache, weight, weights)
            if reused is None:  # one reduction over batch and positions, by the cheapest method for the shape
                x = call.activations[0]
                plan = conv_plan(layer, x, backprops)
                if plan.live is not None:
                    core = CONV_SUMS[plan.sum](plan.live.core, plan.live.input(x), backprops, weights)
                    reused = plan.live.embed(core, layer)
                else:
                    reused = CONV_SUMS[plan.sum](layer, x, backprops, weights)
            out[weight] = reused
        return out
