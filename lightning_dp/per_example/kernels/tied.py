"""One weight used by an Embedding call and by a Linear call (a language model whose output layer is tied
to its input embeddings: GPT-2, nanoGPT): per-example norms of the summed gradient without materialising.

Example i's gradient of the shared [V, D] table is E_i + L_i: the embedding's rows Σ_s e_{k_s} u_sᵀ (tokens
k_s, output gradients u_s) and the Linear's Σ_t δ_t a_tᵀ (inputs a_t, output gradients δ_t over the
vocabulary). ‖E_i + L_i‖² = ‖E_i‖² + ‖L_i‖² + 2⟨E_i, L_i⟩ with the cross term
⟨E_i, L_i⟩ = Σ_{t,s} δ_t[k_s] (a_t · u_s): a gather of the output gradients at the tokens and one small
batched matmul, next to the Gram trick for ‖L_i‖² (no [B, V, D] tensor, where materialising the two
calls took two of them plus their sum: 2.5 GB for GPT-2's 50,257-token table at B = 16). Where the
sequence is too long for the Gram trick, each example's E_i + L_i is formed alone for its norm and
dropped. Norms are certified like every kernel's (a rounding bound, fp64 recompute of flagged examples).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_dp.per_example.kernels.certified import (
    _SLACK,
    _U32,
    certified_sq_norms,
    fold_weights,
    rounding_gamma,
    sum_bound,
)
from lightning_dp.per_example.kernels.embedding import embedding_inputs, embedding_terms, embedding_weighted
from lightning_dp.per_example.kernels.linear import _linear_folded_matmul, _linear_inputs, use_gram
from lightning_dp.per_example.kernels.registry import KernelCall
from lightning_dp.per_example.materialized import materialized_sq_norm


def tied_sq_norms(embedding: KernelCall, linear: KernelCall) -> Tensor:
    """Certified per-example ‖E_i + L_i‖² [B] (fp32) of the weight an Embedding call and a Linear call
    share (their caches are not read)."""
    emb, lin = _layers(embedding, linear)
    idx, u = embedding_inputs(emb, embedding.activations, embedding.backprops)  # [B, S], [B, S, D]
    a, d = _linear_inputs(lin, linear.activations, linear.backprops)  # [B, T, D], [B, T, V]
    B, T, S = d.shape[0], d.shape[1], idx.shape[1]
    spread = _spread(a, d, u)
    terms = B * (T + S) + 1  # the clipped sum: a B·T-term matmul, a B·S-term index_add, their sum
    if not use_gram(T, lin.in_features, lin.out_features):  # long sequences: one example at a time
        values = a.new_zeros(B)
        for i in range(B):
            values[i] = materialized_sq_norm(
                _joint(emb, idx[i], u[i], a[i], d[i], torch.float32).unsqueeze(0)
            )[0]
        bound = sum_bound(values, rounding_gamma(max(T, S) + 1) * spread)
    else:
        v_lin, b_lin = _output_gram_sq_norm(a, d)
        v_emb, b_emb, _ = embedding_terms(emb, idx, u)
        cross, b_cross = _cross(idx, u, a, d)
        values = v_lin + v_emb + 2 * cross
        bound = (
            b_lin + b_emb + 2 * b_cross + 3 * _U32 * (v_lin.abs() + v_emb.abs() + 2 * cross.abs())
        ) * _SLACK

    def exact(index: Tensor) -> Tensor:  # fp64, one example at a time (a [V, D] table each)
        return torch.stack(
            [_joint(emb, idx[i], u[i], a[i], d[i], torch.float64).square().sum() for i in index]
        )

    return certified_sq_norms(values, bound, exact, spread, terms)


def tied_weighted(embedding: KernelCall, linear: KernelCall, weights: Tensor) -> Tensor:
    """Σ_i w_i (E_i + L_i) in fp32: the Linear's weight-folded matmul, the embedding's rows added into it
    (weight-0 examples contribute exactly nothing, even if not finite)."""
    emb, lin = _layers(embedding, linear)
    total = _linear_folded_matmul(lin, linear.activations[0], linear.backprops, weights)
    wu, _ = fold_weights(weights, embedding.backprops)
    idx, wu = embedding_inputs(emb, embedding.activations, wu)
    return embedding_weighted(emb, idx, wu, total)


def _layers(embedding: KernelCall, linear: KernelCall) -> tuple[nn.Embedding, nn.Linear]:
    emb, lin = embedding.layer, linear.layer
    assert isinstance(emb, nn.Embedding)
    assert isinstance(lin, nn.Linear)
    return emb, lin


def _joint(emb: nn.Embedding, idx: Tensor, u: Tensor, a: Tensor, d: Tensor, dtype: torch.dtype) -> Tensor:
    """E + L [V, D] in ``dtype`` of one example (idx [S], u [S, D], a [T, D], d [T, V]): the norm route for
    long sequences, and the exact recompute."""
    del emb
    return torch.mm(d.to(dtype).t(), a.to(dtype)).index_add_(0, idx, u.to(dtype))


REACH_BLOCK = 64
"""Width of the vocabulary blocks :func:`magnitude_gram` bounds Σ_v |δ_tv||δ_sv| over."""


def magnitude_gram(d: Tensor, block: int = REACH_BLOCK) -> Tensor:
    """An upper bound on Σ_v |d_tv||d_sv| for every pair of rows of d [B, T, V] ([B, T, T], fp32).

    Per block of ``block`` columns Σ_{v∈b} |d_tv||d_sv| ≤ ‖d_t,b‖‖d_s,b‖ (Cauchy–Schwarz), so the Gram of
    the rows' block norms bounds it, at 1/block of the cost of the Gram of |d|: a language model's output
    gradient puts its mass on the target token, and two positions rarely share a block of targets. The
    block norms are rounded up by γ of their length, their Gram (non-negative terms) by γ of its length.
    """
    B, T, V = d.shape
    full = V // block * block
    norms = [d[..., :full].reshape(B, T, V // block, block).norm(dim=3)] if full else []
    if full < V:
        norms.append(d[..., full:].norm(dim=2, keepdim=True))
    n = torch.cat(norms, dim=2).mul_(1 + rounding_gamma(block + 2))
    return torch.bmm(n, n.transpose(1, 2)).mul_(1 + rounding_gamma(n.shape[2]))


def _output_gram_sq_norm(a: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    """‖L_i‖² = Σ_ts (a_t·a_s)(δ_t·δ_s) per example (fp32) and a bound on its rounding error.

    The δ_t·δ_s run over the vocabulary (V = 50,257 for GPT-2): the usual bound γ_V‖δ_t‖‖δ_s‖ per entry
    (γ_V ≈ 3e-3) would flag almost every example for the exact recompute (a [V, D] table each in fp64),
    because a language model's output gradients are nearly orthogonal across positions while that bound
    is not (2.5 % of the norm for softmax gradients at T = 128, above the guard's 1 %). A dot product is
    off by at most γ_V Σ_v |δ_tv||δ_sv|, bounded by :func:`magnitude_gram` (0.3 % there).
    """
    D, V = a.shape[2], d.shape[2]
    aa = torch.bmm(a, a.transpose(1, 2))
    dd = torch.bmm(d, d.transpose(1, 2))
    reach = magnitude_gram(d)  # ≥ Σ_v |δ_tv||δ_sv|
    g_v, g_d = rounding_gamma(V), rounding_gamma(D)
    value = torch.linalg.vecdot(aa.double().flatten(1), dd.double().flatten(1)).float()
    n = aa.diagonal(dim1=1, dim2=2).clamp(min=0).sqrt()  # ‖a_t‖
    nn_ = n.unsqueeze(2) * n.unsqueeze(1)
    bound = (
        _U32 * value.abs()
        + g_d * (nn_ * dd.abs()).flatten(1).sum(1)
        + g_v * (aa.abs() * reach).flatten(1).sum(1)
        + g_d * g_v * (nn_ * reach).flatten(1).sum(1)
    )
    if not (g_v < 1 and g_d < 1):  # past the bound's range: every example is recomputed
        bound = torch.full_like(value, float("inf"))
    return value, bound * _SLACK


def _cross(idx: Tensor, u: Tensor, a: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    """⟨E_i, L_i⟩ = Σ_{t,s} δ_t[k_s] (a_t·u_s) per example (fp32) and a bound on its rounding error: each
    a_t·u_s is off by at most γ_D‖a_t‖‖u_s‖; the gathered δ_t[k_s] are exact and the T·S products are
    summed in fp64 (negligible rounding next to that bound; then rounded to fp32)."""
    B, T, S = d.shape[0], d.shape[1], idx.shape[1]
    gathered = d.gather(2, idx.unsqueeze(1).expand(B, T, S)).double()  # [B, T, S]: δ_t[k_s]
    au = torch.bmm(a, u.transpose(1, 2)).double()  # [B, T, S]: a_t·u_s
    cross = (gathered * au).sum((1, 2))
    na, nu = a.double().norm(dim=2), u.double().norm(dim=2)  # [B, T], [B, S]
    reach = torch.bmm(gathered.abs(), nu.unsqueeze(2)).squeeze(2)  # Σ_s |δ_t[k_s]| ‖u_s‖
    bound = rounding_gamma(a.shape[2]) * (reach * na).sum(1) + _U32 * cross.abs()
    return cross.float(), bound.float()


def _spread(a: Tensor, d: Tensor, u: Tensor) -> Tensor:
    """Σ_t ‖a_t‖‖δ_t‖ + Σ_s ‖u_s‖ per example: what the clipped sum's rounding scales with."""
    return (a.norm(dim=2) * d.norm(dim=2)).sum(1) + u.norm(dim=2).sum(1)


__all__ = ["tied_sq_norms", "tied_weighted"]
