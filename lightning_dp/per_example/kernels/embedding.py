"""Embedding kernels: a per-example gradient is a sparse row sum (index-equality Gram for short sequences)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lightning_dp.per_example.kernels.certified import (
    certified_sq_norms,
    fold_weights,
    gram_certified,
    rounding_gamma,
    sum_bound,
    weight_bias,
)
from lightning_dp.per_example.kernels.registry import Grads, KernelCall, KernelPair, register_fast_clipper


def embedding_use_gram(T: int, embedding_dim: int) -> bool:
    """Embedding: [T,T] index-equality Gram for short sequences, else a sparse row sum per example."""
    return 4 * embedding_dim >= T * T


def embedding_inputs(
    layer: nn.Embedding, activations: list[Tensor], backprops: Tensor
) -> tuple[Tensor, Tensor]:
    """Indices [B, T] and fp32 backprops [B, T, D], the padding row's positions zeroed (no gradient)."""
    idx = activations[0]
    B = backprops.shape[0]
    T = math.prod(idx.shape[1:])
    idx = idx.reshape(B, T).long()  # int64: the (example, row) keys below can exceed int32
    d = backprops.float().reshape(B, T, layer.embedding_dim)
    if layer.padding_idx is not None:
        d = d * (idx != layer.padding_idx).unsqueeze(-1)
    return idx, d


def _embedding_rows_sq_norms(layer: nn.Embedding, idx: Tensor, d: Tensor) -> Tensor:
    """Per-example squared norms in d's dtype: δ_t summed per distinct (example, row) pair, then squared
    (O(B·T·D), no [B, T, T] tensor)."""
    B = idx.shape[0]
    key = idx + layer.num_embeddings * torch.arange(B, device=idx.device).unsqueeze(1)
    unique, inverse = torch.unique(key.reshape(-1), return_inverse=True)
    rows = d.new_zeros(unique.numel(), layer.embedding_dim).index_add_(0, inverse, d.reshape(-1, d.shape[2]))
    return d.new_zeros(B).index_add_(0, unique // layer.num_embeddings, rows.square().sum(1))


def embedding_terms(layer: nn.Embedding, idx: Tensor, d: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(fp32 squared norms, a bound on their rounding error, Σ_t ‖δ_t‖) per example, from indices [B, T]
    and fp32 output gradients [B, T, D] (:func:`embedding_inputs`): the index-equality Gram for short
    sequences, else the rows summed per distinct (example, row)."""
    T = idx.shape[1]
    if embedding_use_gram(T, layer.embedding_dim):
        same = (idx.unsqueeze(2) == idx.unsqueeze(1)).float()  # the exact Gram of one-hot inputs
        dd = torch.bmm(d, d.transpose(1, 2))
        return gram_certified(same, dd, 0, layer.embedding_dim)
    # the rows are sums of up to T output gradients each: γ_T Σ_t ‖δ_t‖ bounds their error
    values = _embedding_rows_sq_norms(layer, idx, d)
    spread = d.norm(dim=2).sum(1)
    return values, sum_bound(values, rounding_gamma(T) * spread), spread


def embedding_weighted(layer: nn.Embedding, idx: Tensor, wd: Tensor, into: Tensor) -> Tensor:
    """Index-add the weight-folded output gradients ``wd`` [B, T, D] (fp32) into the table ``into``."""
    return into.index_add_(0, idx.reshape(-1), wd.reshape(-1, layer.embedding_dim))


@register_fast_clipper(nn.Embedding)
class _EmbeddingKernels(KernelPair):
    """Rows gathered by index: the per-example gradient is a sparse sum of δ_t into rows i_t."""

    @staticmethod
    def sq_norms(call: KernelCall) -> Grads:
        layer = call.layer
        assert isinstance(layer, nn.Embedding)
        weight, _ = weight_bias(layer)
        if weight is None:
            return {}
        idx, d = embedding_inputs(layer, call.activations, call.backprops)
        B, T = idx.shape

        def exact(i: Tensor) -> Tensor:
            return _embedding_rows_sq_norms(layer, idx[i], d[i].double())

        values, bound, spread = embedding_terms(layer, idx, d)
        # the clipped sum index-adds w_i·δ_t of the whole batch into the table: B·T terms at most
        return {weight: certified_sq_norms(values, bound, exact, spread, B * T)}

    @staticmethod
    def weighted_grad(call: KernelCall, weights: Tensor) -> Grads:
        layer = call.layer
        assert isinstance(layer, nn.Embedding)
        weight, _ = weight_bias(layer)
        if weight is None:
            return {}
        wd, _ = fold_weights(weights, call.backprops)
        idx, wd = embedding_inputs(layer, call.activations, wd)
        grad = wd.new_zeros(layer.num_embeddings, layer.embedding_dim)
        return {weight: embedding_weighted(layer, idx, wd, grad)}
