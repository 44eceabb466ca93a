"""Linear kernels: ‖δ‖²‖a‖² per position, the Gram trick over positions, and a folded matmul for the sum."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lightning_dp.per_example.kernels.certified import (
    KEEP_FACTOR,
    bias_sum,
    cache_samples,
    certified_cached,
    certified_sq_norms,
    fold_weights,
    gram_sq_norm,
    mask_rows,
    outer_sum_err,
    position_norms_err,
    reuse_cached,
    weight_bias,
)
from lightning_dp.per_example.kernels.registry import Grads, KernelCall, KernelPair, register_fast_clipper
from lightning_dp.per_example.materialized import materialized_sq_norm


def use_gram(T: int, d_in: int, d_out: int) -> bool:
    """Gram trick when it needs fewer FLOPs than materialising the layer's per-example gradient.

    Per example the Gram route costs T²·(d_in + d_out), materialising T·d_in·d_out; the FLOP rule
    also implies T² < d_in·d_out, so the Gram matrices never take more memory either.
    """
    return T * (d_in + d_out) < d_in * d_out


KEEP_MIN_WEIGHT = 1 << 16
"""A Linear's per-example gradients are materialised and kept although the Gram trick is cheaper for the
norm only for weights of at least this many entries, where the clipped sum's reduction is a large matmul
(BERT's 256×1024 FFN layers: 10 ms of it a layer at B = 16, T = 128), and within :data:`KEEP_FACTOR`."""


def keeps(T: int, d_in: int, d_out: int) -> bool:
    """Materialise and keep the per-example gradients although the Gram trick is cheaper for the norm:
    kept, they make the clipped sum a B-term weighted sum instead of a reduction over all B·T positions,
    which saves more than the Gram trick does (B·T·d_in·d_out for the sum against B·T²·(d_in + d_out)
    for the norm), as long as they do not take much more memory than the inputs and output gradients
    they replace (the record is released once they are kept)."""
    return d_in * d_out >= KEEP_MIN_WEIGHT and d_in * d_out <= KEEP_FACTOR * T * (d_in + d_out)


def _linear_inputs(layer: nn.Linear, activations: list[Tensor], backprops: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 activations [B, T, d_in] and backprops [B, T, d_out], extra leading dims flattened into T."""
    a, d = activations[0], backprops
    B = d.shape[0]
    T = math.prod(d.shape[1:-1])
    return a.float().reshape(B, T, layer.in_features), d.float().reshape(B, T, layer.out_features)


@register_fast_clipper(nn.Linear)
class _LinearKernels(KernelPair):
    """y = W a + b: ‖g_W‖² = ‖δ‖²‖a‖² for 2-D input, Gram trick or materialise for sequences."""

    @staticmethod
    def sq_norms(call: KernelCall) -> Grads:
        layer, cache = call.layer, call.cache
        assert isinstance(layer, nn.Linear)
        a, d = _linear_inputs(layer, call.activations, call.backprops)
        weight, bias = weight_bias(layer)
        out: Grads = {}
        B, T = d.shape[0], d.shape[1]
        if weight is not None:
            if T == 1:  # ‖δ aᵀ‖² = ‖δ‖²‖a‖², reduced without a squared copy of either: nothing cancels
                out[weight] = materialized_sq_norm(d) * materialized_sq_norm(a)
            elif use_gram(T, layer.in_features, layer.out_features) and not keeps(
                T, layer.in_features, layer.out_features
            ):
                values, bound, spread = gram_sq_norm(a, d)
                out[weight] = certified_sq_norms(
                    values,
                    bound,
                    lambda i: _outer_samples(a[i], d[i]).flatten(1).square().sum(1),
                    spread,
                    B * T,
                )
            else:  # materialise this layer's per-example gradients [B, o, p], kept for the sum
                # as the transpose of aᵀδ: MKL's batched GEMM runs that twice as fast at p = o = 256
                samples = torch.bmm(a.transpose(1, 2), d).transpose(1, 2)
                out[weight] = certified_cached(
                    cache, weight, samples, outer_sum_err(a, d), lambda i: _outer_samples(a[i], d[i])
                )
        if bias is not None:  # per-example bias gradients [B, O]: position sums, kept for the sum
            if T == 1:
                out[bias] = cache_samples(cache, bias, d[:, 0])  # a view
            else:
                out[bias] = certified_cached(
                    cache, bias, d.sum(1), position_norms_err(d, T), lambda i: d[i].double().sum(1)
                )
        return out

    @staticmethod
    def weighted_grad(call: KernelCall, weights: Tensor) -> Grads:
        layer, cache = call.layer, call.cache
        assert isinstance(layer, nn.Linear)
        weight, bias = weight_bias(layer)
        out: Grads = {}
        if bias is not None:  # per-example bias gradients are small: sum over positions, then weight
            out[bias] = bias_sum(
                cache,
                bias,
                weights,
                lambda: _linear_inputs(layer, call.activations, call.backprops)[1].sum(1),
            )
        if weight is not None:
            reused = reuse_cached(cache, weight, weights)
            out[weight] = (
                _linear_folded_matmul(layer, call.activations[0], call.backprops, weights)
                if reused is None
                else reused
            )
        return out


def _outer_samples(a: Tensor, d: Tensor) -> Tensor:
    """Exact per-example gradients Σ_t δ_t a_tᵀ [k, o, p] in fp64 of a few examples (the guard's recompute)."""
    return torch.bmm(d.double().transpose(1, 2), a.double())


FOLD_FLOATS = 1 << 17
"""Most floats of the weight-folded copy a Linear's clipped sum makes at a time (512 KiB): the product
is accumulated chunk by chunk, so no batch-sized copy is made (MLP: a 0.5 MB copy instead of 1 MB at
the step's peak, for about 0.07 ms)."""


def _linear_folded_matmul(layer: nn.Linear, a: Tensor, backprops: Tensor, weights: Tensor) -> Tensor:
    """Σ_i w_i Σ_t δ_it a_itᵀ as matmuls with the weights folded into the smaller of a and δ, a chunk of
    examples at a time (at least one chunk, so an empty batch gives zeros): the folded copy stays within
    :data:`FOLD_FLOATS` while the chunks stay long (a BERT FFN layer: 4 examples, 512 rows, not 1)."""
    B = backprops.shape[0]
    into_inputs = a[:1].numel() < backprops[:1].numel()
    step = max(1, FOLD_FLOATS // max(1, (a if into_inputs else backprops)[:1].numel()))
    total: Tensor | None = None
    for start in range(0, max(B, 1), step):
        rows = slice(start, start + step)
        if into_inputs:
            x, keep = fold_weights(weights[rows], a[rows])
            x, wd = _linear_inputs(layer, [x], mask_rows(backprops[rows], keep))
        else:
            wd, keep = fold_weights(weights[rows], backprops[rows])
            x, wd = _linear_inputs(layer, [mask_rows(a[rows], keep)], wd)
        x, wd = x.reshape(-1, layer.in_features), wd.reshape(-1, layer.out_features)
        total = wd.t() @ x if total is None else total.addmm_(wd.t(), x)
    assert total is not None
    return total
