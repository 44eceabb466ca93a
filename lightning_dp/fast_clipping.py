"""Per-example gradient norms and clipped sums straight from (layer inputs, output gradients).

Flat clipping needs only each example's squared gradient norm and the weighted sum Σ_i w_i g_i, so
for the layers below both are computed from the activations ``a`` and backprops ``δ`` (the gradient
of the layer's output, already scaled to per-example) without materialising the [B, *param.shape]
per-example gradients ("ghost clipping", Li et al. ICLR 2022; "book-keeping", Bu et al. ICML 2023):

* Linear / Conv (unfolded patches as a sequence of length T): ‖Σ_t δ_t a_tᵀ‖²_F equals
  Σ_{t,s} (a_t·a_s)(δ_t·δ_s) (Gram trick, O(T²) memory) and is used when T² < d_in·d_out;
  otherwise that layer's per-example gradient is materialised for the norm only.
* Embedding: the per-example gradient is a sparse row sum, squared norm Σ_{t,s} [i_t = i_s] δ_t·δ_s.
* LayerNorm / GroupNorm: per-example gradients are tiny and materialised (Opacus's formulas).

``weighted_grad`` is one ordinary reduction over the batch with the weights folded into the
backprops: a matmul (Linear), the layer's own weight-gradient convolution (Conv, equal to the
matmul of the unfolded patches but without unfolding) or ``index_add_`` (Embedding). All results
are fp32 whatever the input dtype. Each layer's formula assumes the layer is called once per forward
pass: a shared layer's norm is not the sum of its calls' norms, so the engine must materialise those.

Norms never understate (:func:`certified_sq_norms`): every norm formed from sums over positions (Gram
identities, per-example gradients summed over positions, bias sums) comes with a bound on its fp32
rounding error from the magnitudes of its terms; where the terms cancel so much that the bound exceeds
:data:`GUARD_FRACTION` of the value (crafted inputs), that example is recomputed exactly in fp64,
elsewhere the value plus its bound is returned. DP is a worst case over data sets: one example whose
per-position gradients nearly cancel must not pass as a small norm and be summed unclipped.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn import grad as nn_grad

__all__ = [
    "CONV_METHODS",
    "FAST_CLIPPERS",
    "GUARD_FRACTION",
    "Cache",
    "ConvMethod",
    "FastClipper",
    "certified_sq_norms",
    "embedding_use_gram",
    "force_conv_method",
    "is_supported",
    "materialized_sq_norm",
    "materialized_sq_norms",
    "materialized_weighted",
    "materialized_weighted_grad",
    "register_fast_clipper",
    "rounding_gamma",
    "sq_norms",
    "use_gram",
    "weighted_grad",
]

Cache = dict[nn.Parameter, Tensor]
"""Per-example gradients [B, *param.shape] a kernel materialised for the norms anyway; ``weighted_grad``
reuses them (a B-term weighted sum) instead of a second reduction over the layer's inputs."""
SqNormsFn = Callable[[nn.Module, list[Tensor], Tensor, Cache | None], dict[nn.Parameter, Tensor]]
WeightedGradFn = Callable[[nn.Module, list[Tensor], Tensor, Tensor, Cache | None], dict[nn.Parameter, Tensor]]


class FastClipper(NamedTuple):
    """The two per-layer kernels: per-example squared norms, and the weighted sum over the batch."""

    sq_norms: SqNormsFn
    weighted_grad: WeightedGradFn


FAST_CLIPPERS: dict[type[nn.Module], FastClipper] = {}
"""Registry keyed by exact layer type (subclasses may change ``forward``, so they are not matched)."""


def register_fast_clipper(
    *layer_types: type[nn.Module],
) -> Callable[[type[_Kernels]], type[_Kernels]]:
    """Class decorator registering a kernel pair (static ``sq_norms``/``weighted_grad``) for layer types."""

    def wrap(kernels: type[_Kernels]) -> type[_Kernels]:
        for layer_type in layer_types:
            FAST_CLIPPERS[layer_type] = FastClipper(kernels.sq_norms, kernels.weighted_grad)
        return kernels

    return wrap


class _Kernels:
    """Base of the registered kernel pairs (static methods with the registry's signatures)."""

    @staticmethod
    def sq_norms(
        layer: nn.Module, activations: list[Tensor], backprops: Tensor, cache: Cache | None = None
    ) -> dict[nn.Parameter, Tensor]:
        raise NotImplementedError

    @staticmethod
    def weighted_grad(
        layer: nn.Module,
        activations: list[Tensor],
        backprops: Tensor,
        weights: Tensor,
        cache: Cache | None = None,
    ) -> dict[nn.Parameter, Tensor]:
        raise NotImplementedError


# --------------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------------


def is_supported(layer: nn.Module) -> bool:
    """Whether ``layer`` has fast kernels (exact type registered and no option that breaks them)."""
    if type(layer) not in FAST_CLIPPERS:
        return False
    if isinstance(layer, nn.Embedding):
        # scale_grad_by_freq rescales by counts over the whole batch: not a per-example gradient.
        return not layer.scale_grad_by_freq
    return True


def sq_norms(
    layer: nn.Module, activations: list[Tensor], backprops: Tensor, cache: Cache | None = None
) -> dict[nn.Parameter, Tensor]:
    """Per-example squared L2 norm [B] (fp32) of the gradient of each trainable parameter of ``layer``.

    Pass the same ``cache`` dict to :func:`weighted_grad` so per-example gradients materialised
    here are reused there.
    """
    return _kernels(layer).sq_norms(layer, activations, backprops, cache)


def weighted_grad(
    layer: nn.Module,
    activations: list[Tensor],
    backprops: Tensor,
    weights: Tensor,
    cache: Cache | None = None,
) -> dict[nn.Parameter, Tensor]:
    """Σ_i w_i g_i (fp32, shape of the parameter) for each trainable parameter of ``layer``.

    Examples with weight 0 contribute exactly nothing, even if their inputs or gradients are not
    finite (clipping gives weight 0 to examples with non-finite norms).
    """
    return _kernels(layer).weighted_grad(layer, activations, backprops, weights, cache)


def use_gram(T: int, d_in: int, d_out: int) -> bool:
    """Gram trick when it needs fewer FLOPs than materialising the layer's per-example gradient.

    Per example the Gram route costs T²·(d_in + d_out), materialising T·d_in·d_out; the FLOP rule
    also implies T² < d_in·d_out, so the Gram matrices never take more memory either.
    """
    return T * (d_in + d_out) < d_in * d_out


def embedding_use_gram(T: int, embedding_dim: int) -> bool:
    """Embedding: [T,T] index-equality Gram for short sequences, else a sparse row sum per example."""
    return 4 * embedding_dim >= T * T


def materialized_sq_norm(g: Tensor) -> Tensor:
    """Per-example squared norms [B] in fp32 of one materialised [B, *shape] per-example gradient
    (any memory layout: the reduction runs over the dims as stored, no copy)."""
    if g.numel() == 0:
        return torch.zeros(g.shape[0], dtype=torch.float32, device=g.device)
    dims = tuple(range(1, g.dim()))
    if not dims:  # one scalar per example
        return g.float().square()
    dtype = torch.promote_types(g.dtype, torch.float32)
    return torch.linalg.vector_norm(g, dim=dims, dtype=dtype).square().float()


def materialized_weighted(g: Tensor, weights: Tensor) -> Tensor:
    """Σ_i w_i g_i in fp32 of one materialised per-example gradient; weight-0 examples masked out.

    A per-example gradient stored in another layout (a permuted view, e.g. the convolution kernels'
    channel-last one) is summed in its memory order and only the small result is permuted back.
    """
    w = weights.float()
    g32 = g.float()
    keep = w != 0
    if not bool(keep.all()):
        g32 = torch.where(keep.view(-1, *([1] * (g32.dim() - 1))), g32, 0.0)
    order = sorted(range(1, g32.dim()), key=lambda i: -g32.stride()[i])
    stored = g32.permute(0, *order)
    if order == sorted(order) or not stored.is_contiguous():
        return torch.tensordot(w, g32, dims=1)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return torch.tensordot(w, stored, dims=1).permute(*inverse).contiguous()


def materialized_sq_norms(grad_samples: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
    """Per-example squared norms [B] in fp32 from materialised [B, *shape] per-example gradients."""
    return {p: materialized_sq_norm(g) for p, g in grad_samples.items()}


def materialized_weighted_grad(
    grad_samples: dict[nn.Parameter, Tensor], weights: Tensor
) -> dict[nn.Parameter, Tensor]:
    """Σ_i w_i g_i in fp32 from materialised per-example gradients (weight-0 examples masked out)."""
    return {p: materialized_weighted(g, weights) for p, g in grad_samples.items()}


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def _kernels(layer: nn.Module) -> FastClipper:
    if not is_supported(layer):
        raise TypeError(f"No fast clipping kernels for {type(layer).__name__}; materialise its gradients.")
    return FAST_CLIPPERS[type(layer)]


def _weight_bias(layer: nn.Module) -> tuple[nn.Parameter | None, nn.Parameter | None]:
    """The layer's trainable ``weight`` and ``bias`` (None where absent or frozen)."""
    found = (getattr(layer, "weight", None), getattr(layer, "bias", None))
    weight, bias = (p if isinstance(p, nn.Parameter) and p.requires_grad else None for p in found)
    return weight, bias


def _fold(weights: Tensor, backprops: Tensor) -> tuple[Tensor, Tensor]:
    """(w_i·δ_i in fp32, keep mask [B]); weight-0 examples become exact zeros (NaN-safe)."""
    w = weights.to(device=backprops.device, dtype=torch.float32)
    keep = w != 0
    shape = (-1, *([1] * (backprops.dim() - 1)))
    if bool(keep.all()):  # the usual case: no example dropped, no mask pass needed
        return w.view(shape) * backprops.float(), keep
    folded = torch.where(keep.view(shape), w.view(shape) * backprops.float(), 0.0)
    return folded, keep


def _mask(x: Tensor, keep: Tensor) -> Tensor:
    """Zero the examples of ``x`` (batch first) that are not kept, so 0·NaN never enters a matmul."""
    if bool(keep.all()):
        return x
    return torch.where(
        keep.view(-1, *([1] * (x.dim() - 1))), x, torch.zeros((), device=x.device, dtype=x.dtype)
    )


# --------------------------------------------------------------------------------------------------
# The guard: norms that never understate
# --------------------------------------------------------------------------------------------------

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


def _gram_certified(aa: Tensor, dd: Tensor, p_len: int, o_len: int) -> tuple[Tensor, Tensor, Tensor]:
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


def _gram_sq_norm(a: Tensor, d: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """‖Σ_t d_t a_tᵀ‖²_F per example for a [B, T, p] and d [B, T, o] by the Gram trick (fp32), with its
    rounding bound and spread (see :func:`_gram_certified`)."""
    aa = torch.bmm(a, a.transpose(1, 2))
    dd = torch.bmm(d, d.transpose(1, 2))
    return _gram_certified(aa, dd, a.shape[2], d.shape[2])


def _sum_bound(values: Tensor, err: Tensor) -> Tensor:
    """Bound on ‖g‖² − ‖ĝ‖² given ‖ĝ‖² = ``values`` and ‖g − ĝ‖ ≤ ``err``: (‖ĝ‖ + err)² − ‖ĝ‖²."""
    return err * (2 * values.clamp(min=0).sqrt() + err) * _SLACK


def _certified_cached(
    cache: Cache | None,
    param: nn.Parameter,
    samples: Tensor,
    err: Tensor,
    exact: Callable[[Tensor], Tensor],
) -> Tensor:
    """:func:`_cached` for per-example gradients summed over positions in fp32, ``err`` bounding each
    example's rounding error (Frobenius): norms that never understate; the examples the guard flags are
    recomputed in fp64 by ``exact(index)`` ([k, *shape]) and replaced in ``samples`` too, so the clipped
    sum that reuses them adds the exact gradient."""
    values = materialized_sq_norm(samples)
    bound = _sum_bound(values, err)

    def recompute(index: Tensor) -> Tensor:
        exact_samples = exact(index)
        samples[index] = exact_samples.to(samples.dtype)
        return exact_samples.flatten(1).square().sum(1)

    norms = certified_sq_norms(values, bound, recompute)
    if cache is not None:
        cache[param] = samples
    return norms


def _position_sum_err(terms_abs_sum: Tensor, positions: int) -> Tensor:
    """γ_T‖Σ_t |term_t|‖ per example: the rounding bound of a per-example gradient summed over T
    positions, from the entrywise sums of the terms' magnitudes [B, ...]."""
    return rounding_gamma(positions) * terms_abs_sum.flatten(1).norm(dim=1)


def _outer_sum_err(a: Tensor, d: Tensor) -> Tensor:
    """γ_T Σ_t ‖a_t‖‖δ_t‖ per example: the rounding bound of Σ_t δ_t a_tᵀ for a [B, T, p], d [B, T, o]."""
    return rounding_gamma(a.shape[1]) * (a.norm(dim=2) * d.norm(dim=2)).sum(1)


def _cached(cache: Cache | None, param: nn.Parameter, samples: Tensor) -> Tensor:
    """Keep a materialised per-example gradient for ``weighted_grad``; return its squared norms."""
    if cache is not None:
        cache[param] = samples
    return materialized_sq_norm(samples)


def _reuse(cache: Cache | None, param: nn.Parameter | None, weights: Tensor) -> Tensor | None:
    """Σ_i w_i g_i from a per-example gradient ``sq_norms`` materialised, if it did."""
    if cache is None or param is None or param not in cache:
        return None
    samples = cache[param]
    return materialized_weighted(samples, weights.to(samples.device))


def _bias_sum(
    cache: Cache | None, bias: nn.Parameter, weights: Tensor, samples: Callable[[], Tensor]
) -> Tensor:
    """Σ_i w_i g_i of a bias whose per-example gradients [B, O] ``sq_norms`` cached, else ``samples()``."""
    reused = _reuse(cache, bias, weights)
    return materialized_weighted(samples(), weights) if reused is None else reused


# --------------------------------------------------------------------------------------------------
# Linear
# --------------------------------------------------------------------------------------------------


def _linear_inputs(layer: nn.Linear, activations: list[Tensor], backprops: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 activations [B, T, d_in] and backprops [B, T, d_out], extra leading dims flattened into T."""
    a, d = activations[0], backprops
    B = d.shape[0]
    T = math.prod(d.shape[1:-1])
    return a.float().reshape(B, T, layer.in_features), d.float().reshape(B, T, layer.out_features)


@register_fast_clipper(nn.Linear)
class _LinearKernels(_Kernels):
    """y = W a + b: ‖g_W‖² = ‖δ‖²‖a‖² for 2-D input, Gram trick or materialise for sequences."""

    @staticmethod
    def sq_norms(
        layer: nn.Module, activations: list[Tensor], backprops: Tensor, cache: Cache | None = None
    ) -> dict[nn.Parameter, Tensor]:
        assert isinstance(layer, nn.Linear)
        a, d = _linear_inputs(layer, activations, backprops)
        weight, bias = _weight_bias(layer)
        out: dict[nn.Parameter, Tensor] = {}
        B, T = d.shape[0], d.shape[1]
        if weight is not None:
            if T == 1:  # ‖δ aᵀ‖² = ‖δ‖²‖a‖², reduced without a squared copy of either: nothing cancels
                out[weight] = materialized_sq_norm(d) * materialized_sq_norm(a)
            elif use_gram(T, layer.in_features, layer.out_features):
                values, bound, spread = _gram_sq_norm(a, d)
                out[weight] = certified_sq_norms(
                    values,
                    bound,
                    lambda i: _outer_samples(a[i], d[i]).flatten(1).square().sum(1),
                    spread,
                    B * T,
                )
            else:  # materialise this layer's per-example gradients [B, o, p], kept for the sum
                samples = torch.bmm(d.transpose(1, 2), a)
                out[weight] = _certified_cached(
                    cache, weight, samples, _outer_sum_err(a, d), lambda i: _outer_samples(a[i], d[i])
                )
        if bias is not None:  # per-example bias gradients [B, O]: position sums, kept for the sum
            if T == 1:
                out[bias] = _cached(cache, bias, d[:, 0])  # a view
            else:
                out[bias] = _certified_cached(
                    cache,
                    bias,
                    d.sum(1),
                    _position_sum_err(d.abs().sum(1), T),
                    lambda i: d[i].double().sum(1),
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
        assert isinstance(layer, nn.Linear)
        weight, bias = _weight_bias(layer)
        out: dict[nn.Parameter, Tensor] = {}
        if bias is not None:  # per-example bias gradients are small: sum over positions, then weight
            out[bias] = _bias_sum(
                cache, bias, weights, lambda: _linear_inputs(layer, activations, backprops)[1].sum(1)
            )
        if weight is not None:
            reused = _reuse(cache, weight, weights)
            out[weight] = (
                _linear_folded_matmul(layer, activations[0], backprops, weights) if reused is None else reused
            )
        return out


def _outer_samples(a: Tensor, d: Tensor) -> Tensor:
    """Exact per-example gradients Σ_t δ_t a_tᵀ [k, o, p] in fp64 of a few examples (the guard's recompute)."""
    return torch.bmm(d.double().transpose(1, 2), a.double())


FOLD_FLOATS = 1 << 17
"""Most floats of w_i·δ_i a Linear's clipped sum folds at a time (512 KiB): the product is accumulated
chunk by chunk, so no batch-sized copy of the output gradients is made (MLP: a 0.5 MB copy instead of
1 MB at the step's peak, for about 0.07 ms)."""


def _linear_folded_matmul(layer: nn.Linear, a: Tensor, backprops: Tensor, weights: Tensor) -> Tensor:
    """Σ_i w_i Σ_t δ_it a_itᵀ as matmuls of the weight-folded output gradients, a chunk of examples
    at a time (at least one chunk, so an empty batch gives zeros)."""
    B = backprops.shape[0]
    step = max(1, FOLD_FLOATS // max(1, backprops[:1].numel()))
    total: Tensor | None = None
    for start in range(0, max(B, 1), step):
        rows = slice(start, start + step)
        wd, keep = _fold(weights[rows], backprops[rows])
        x, wd = _linear_inputs(layer, [_mask(a[rows], keep)], wd)
        x, wd = x.reshape(-1, layer.in_features), wd.reshape(-1, layer.out_features)
        total = wd.t() @ x if total is None else total.addmm_(wd.t(), x)
    assert total is not None
    return total


# --------------------------------------------------------------------------------------------------
# Conv1d / Conv2d
# --------------------------------------------------------------------------------------------------

_Conv = nn.Conv1d | nn.Conv2d


def _conv_padded_input(layer: _Conv, x: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Input in ``dtype`` (fp32) padded exactly as the layer pads it (zeros, reflect, ..., 'same' possibly
    asymmetric)."""
    x = x.to(dtype)
    pad = list(layer._reversed_padding_repeated_twice)
    if not any(pad):
        return x
    return F.pad(x, pad, mode="constant" if layer.padding_mode == "zeros" else layer.padding_mode)


def _channel_last(layer: _Conv, x: Tensor) -> Tensor:
    """The fp32 input [B, *spatial, C], contiguous, padded exactly as the layer pads it."""
    pad = list(layer._reversed_padding_repeated_twice)
    if any(pad) and layer.padding_mode == "zeros":  # one copy: pad the channel-last view directly
        return F.pad(x.float().movedim(1, -1), [0, 0, *pad]).contiguous()
    return _conv_padded_input(layer, x).movedim(1, -1).contiguous()


def _conv_patches(layer: _Conv, x: Tensor) -> Tensor:
    """Unfolded input patches [B, G, L, prod(kernel)·C_in/G] in fp32, columns in (kernel, channel) order.

    Gathered from strided ``Tensor.unfold`` views of the channel-last input with one copy: each
    kernel row is then a contiguous run of k·C floats, 2–3× faster than ``F.unfold``'s (channel,
    kernel) order on CPU. Dilation is a window of span (k-1)·d+1 sampled every d.
    """
    n, G = len(layer.kernel_size), layer.groups
    x = _channel_last(layer, x)
    for i, (k, s, d) in enumerate(zip(layer.kernel_size, layer.stride, layer.dilation)):
        x = x.unfold(1 + i, (k - 1) * d + 1, s)  # [B, *out, C, *window]
    if any(d > 1 for d in layer.dilation):
        every_d: tuple[Any, ...] = (Ellipsis, *(slice(None, None, d) for d in layer.dilation))
        x = x[every_d]
    B, out, C = x.shape[0], x.shape[1 : 1 + n], x.shape[1 + n]
    # [B, *out, G, C/G, *kernel] -> [B, G, *out, *kernel, C/G] -> [B, G, L, prod(kernel)·C/G]
    x = x.unflatten(1 + n, (G, C // G))
    x = x.permute(0, 1 + n, *range(1, 1 + n), *range(3 + n, 3 + 2 * n), 2 + n)
    return x.reshape(B, G, math.prod(out), math.prod(layer.kernel_size) * (C // G))


def _conv_inputs(layer: _Conv, x: Tensor, backprops: Tensor) -> tuple[Tensor, Tensor]:
    """Patches [B, G, L, p/G] (see :func:`_conv_patches`) and backprops [B, G, L, o/G] per group, fp32."""
    B, G, L = backprops.shape[0], layer.groups, math.prod(backprops.shape[2:])
    d = backprops.float().reshape(B, G, layer.out_channels // G, L)
    return _conv_patches(layer, x), d.transpose(2, 3)


ConvMethod = Literal["gram", "position-gram", "unfold", "grouped", "correlate"]
CONV_METHODS: tuple[ConvMethod, ...] = ("gram", "position-gram", "unfold", "grouped", "correlate")
_conv_choice: dict[tuple[Any, ...], ConvMethod] = {}
_forced_conv_method: ConvMethod | None = None


@contextlib.contextmanager
def force_conv_method(method: ConvMethod | None) -> Iterator[None]:
    """Use one convolution norm method everywhere inside the block (tests, benchmarks)."""
    global _forced_conv_method
    if method is not None and method not in CONV_METHODS:
        raise ValueError(f"conv method must be one of {CONV_METHODS}, got {method!r}")
    previous, _forced_conv_method = _forced_conv_method, method
    try:
        yield
    finally:
        _forced_conv_method = previous


def _conv_weight_grad(
    layer: _Conv, x: Tensor, grad_output: Tensor, groups: int, shape: Any, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The layer's weight-gradient convolution on its input in ``dtype`` (fp32; zero padding done by the
    convolution itself, other padding modes and 'same' padded here first)."""
    conv_weight = nn_grad.conv1d_weight if isinstance(layer, nn.Conv1d) else nn_grad.conv2d_weight
    padding: Any = layer.padding
    if layer.padding_mode == "zeros" and not isinstance(padding, str):
        x = x.to(dtype)
    else:
        x, padding = _conv_padded_input(layer, x, dtype), 0
    return conv_weight(
        x, shape, grad_output, stride=layer.stride, padding=padding, dilation=layer.dilation, groups=groups
    )


def _conv_samples_grouped(
    layer: _Conv, x: Tensor, backprops: Tensor, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Per-example weight gradients [B, *weight.shape] in ``dtype`` (fp32; fp64 for the guard's exact
    recompute) from ONE weight-gradient convolution with the batch folded into the channels (B·groups
    groups): no unfolded patches, no per-example bmm."""
    B = backprops.shape[0]
    if B == 0:
        return backprops.new_zeros((0, *layer.weight.shape), dtype=dtype)
    xb = x.reshape(1, B * x.shape[1], *x.shape[2:])
    db = backprops.to(dtype).reshape(1, B * backprops.shape[1], *backprops.shape[2:])
    shape = (B * layer.out_channels, *layer.weight.shape[1:])
    return _conv_weight_grad(layer, xb, db, B * layer.groups, shape, dtype).view(B, *layer.weight.shape)


def _conv_exact_sq_norms(layer: _Conv, x: Tensor, backprops: Tensor) -> Tensor:
    """Exact squared weight-gradient norms (fp64) of a few examples: the guard's recompute."""
    return _conv_samples_grouped(layer, x, backprops, torch.float64).flatten(1).square().sum(1)


def _conv_sum_err(layer: _Conv, x: Tensor, backprops: Tensor) -> Tensor:
    """Rounding bound of per-example weight gradients summed over the L output positions in fp32:
    γ_L Σ_t ‖a_t‖‖δ_t‖ ≤ γ_L √K ‖x_padded‖‖δ‖ (Cauchy–Schwarz; an input position lies in at most K =
    prod(kernel) patches), from two norms per example instead of the patches."""
    xp = x.float() if layer.padding_mode == "zeros" else _conv_padded_input(layer, x)
    K = math.prod(layer.kernel_size)
    L = math.prod(backprops.shape[2:])
    return (
        rounding_gamma(L)
        * math.sqrt(K)
        * xp.flatten(1).norm(dim=1)
        * backprops.float().flatten(1).norm(dim=1)
    )


def _conv_samples_correlate(layer: _Conv, x: Tensor, backprops: Tensor) -> Tensor:
    """Per-example weight gradients [B, *weight.shape] from ONE forward convolution: each example's
    padded input channel correlated with that example's output gradients as the kernel.

    g[b, o, c, k] = Σ_t δ[b, o, t] · x[b, c, stride·t + dilation·k], a correlation over x whose kernel
    δ is dilated by the layer's stride and which steps by the layer's dilation; one group per (example,
    input channel). oneDNN runs this forward convolution 2× faster than the batch-grouped
    weight-gradient one for a first layer on grey images (CNN conv1: 2.5 vs 5.9 ms). With C/G > 1
    input channels per group the output gradients are repeated C/G times, so it pays for few channels.
    """
    B, G = backprops.shape[0], layer.groups
    if B == 0:
        return backprops.new_zeros((0, *layer.weight.shape), dtype=torch.float32)
    C, K = layer.in_channels, layer.kernel_size
    cg, og, out = C // G, layer.out_channels // G, backprops.shape[2:]
    xp = _conv_padded_input(layer, x)
    kernels = (
        backprops.float().reshape(B, G, 1, og, *out).expand(B, G, cg, og, *out).reshape(B * C * og, 1, *out)
    )
    conv = F.conv1d if isinstance(layer, nn.Conv1d) else F.conv2d
    full = conv(
        xp.reshape(1, B * C, *xp.shape[2:]),
        kernels,
        stride=layer.dilation,
        dilation=layer.stride,
        groups=B * C,
    )
    first_k: tuple[Any, ...] = (0, slice(None), *(slice(0, k) for k in K))
    g = full[first_k]  # [B·C·og, *kernel] in (example, group, input channel, output channel) order
    return g.reshape(B, G, cg, og, *K).transpose(2, 3).reshape(B, *layer.weight.shape)


def _conv_samples_unfold(layer: _Conv, x: Tensor, backprops: Tensor) -> Tensor:
    """Per-example weight gradients [B, *weight.shape] as bmms of unfolded patches and backprops.

    Written into one channel-last buffer [B, O, *kernel, C/G] and returned as a permuted view of it:
    the norm and the weighted sum read it in that order, so it is never copied into the weight's layout.
    The patches are unfolded a chunk of examples at a time (see :func:`_chunks`).
    """
    B, G, n = backprops.shape[0], layer.groups, len(layer.kernel_size)
    o, c = layer.out_channels, layer.in_channels // G
    out = backprops.new_empty((B, o, *layer.kernel_size, c), dtype=torch.float32)
    for rows in _chunks(layer, x, backprops):
        a, d = _conv_inputs(layer, x[rows], backprops[rows])
        b = a.shape[0] * G
        torch.bmm(
            d.reshape(b, *d.shape[2:]).transpose(1, 2),
            a.reshape(b, *a.shape[2:]),
            out=out[rows].view(b, o // G, -1),
        )
    return out.permute(0, 1, 2 + n, *range(2, 2 + n))


def _conv_gram(layer: _Conv, x: Tensor, backprops: Tensor) -> Tensor:
    """Per-example squared weight-gradient norms by the Gram trick over output positions, per group."""
    terms = backprops.new_zeros((3, backprops.shape[0]), dtype=torch.float32)  # value, bound, spread
    for rows in _chunks(layer, x, backprops, gram=True):
        a, d = _conv_inputs(layer, x[rows], backprops[rows])
        b, G = a.shape[0], a.shape[1]
        found = _gram_sq_norm(a.reshape(b * G, *a.shape[2:]), d.reshape(b * G, *d.shape[2:]))
        terms[:, rows] = _sum_groups(found, b, G)
    return _conv_certified(layer, x, backprops, terms)


def _conv_position_gram(layer: _Conv, x: Tensor, backprops: Tensor) -> Tensor:
    """Per-example squared weight-gradient norms by the Gram trick, without unfolding any patch.

    Two patches overlap kernel offset by kernel offset: a_t·a_s = Σ_k M[P_t + k·dil, P_s + k·dil], with
    M = XᵀX the channel-contracted Gram matrix of the padded input positions and P_t the corner of
    output t. So the [L, L] patch Gram is a sum of prod(kernel) strided views of M. It costs
    (H·W)²·C/G per group instead of L²·C·k²/G plus the patch copy: far cheaper on small, deep inputs
    (ResNet's last stage, ScatterNet features), far dearer on large ones (the timer decides).
    """
    G = layer.groups
    zero_padded = layer.padding_mode == "zeros"
    out = backprops.shape[2:]
    L = math.prod(out)
    terms = backprops.new_zeros((3, backprops.shape[0]), dtype=torch.float32)  # value, bound, spread
    offsets = list(itertools.product(*(range(k) for k in layer.kernel_size)))
    for rows in _chunks(layer, x, backprops, gram=True, positions=True):
        xs = x[rows].float() if zero_padded else _conv_padded_input(layer, x[rows])
        b, spatial = xs.shape[0], xs.shape[2:]
        X = xs.reshape(b * G, xs.shape[1] // G, math.prod(spatial))
        M = torch.bmm(X.transpose(1, 2), X).view(b * G, *spatial, *spatial)
        if zero_padded and any(layer._reversed_padding_repeated_twice):
            M = F.pad(M, list(layer._reversed_padding_repeated_twice) * 2)  # zero rows/columns
        aa = M.new_zeros((b * G, *out, *out))
        for offset in offsets:
            window = tuple(
                slice(k * d, k * d + s * (o - 1) + 1, s)
                for k, d, s, o in zip(offset, layer.dilation, layer.stride, out, strict=True)
            )
            aa += M[(slice(None), *window, *window)]
        d = backprops[rows].float().reshape(b * G, layer.out_channels // G, L)
        dd = torch.bmm(d.transpose(1, 2), d)
        # each entry of aa is a dot product of length C/G·K: C/G for M, K windows added
        found = _gram_certified(aa.view(b * G, L, L), dd, X.shape[1] + len(offsets), d.shape[1])
        terms[:, rows] = _sum_groups(found, b, G)
    return _conv_certified(layer, x, backprops, terms)


def _sum_groups(found: tuple[Tensor, Tensor, Tensor], b: int, G: int) -> Tensor:
    """(value, bound, spread) per example [3, b] from those per (example, group); the bound covers the
    sum over the groups too."""
    value, bound, spread = (t.view(b, G) for t in found)
    total = value.sum(1)
    return torch.stack([total, bound.sum(1) + rounding_gamma(G) * value.abs().sum(1), spread.sum(1)])


def _conv_certified(layer: _Conv, x: Tensor, backprops: Tensor, terms: Tensor) -> Tensor:
    """The Gram methods' norms through the guard (exact recompute by a fp64 weight-gradient convolution;
    the clipped sum's convolution adds at most B·L terms per entry)."""
    B, L = backprops.shape[0], math.prod(backprops.shape[2:])
    return certified_sq_norms(
        terms[0], terms[1], lambda i: _conv_exact_sq_norms(layer, x[i], backprops[i]), terms[2], B * L
    )


def _saved_per_example(x: Tensor, backprops: Tensor) -> int:
    """Floats per example the layer's record holds (its input and output gradient): the memory budget
    of its norm method. Per-example gradients within it are kept instead of the record (released in
    the backward hook, see ``grad_sample.Record``), so the clipping pass's peak stays near a plain step's."""
    return max(1, (x.numel() + backprops.numel()) // max(1, backprops.shape[0]))


CHUNK_FLOATS = 1 << 20
"""Most floats of temporaries per chunk of examples (4 MiB): bigger chunks fall out of the CPU caches
and ran 2× slower on ScatterNet's first convolution at 3,072 candidates."""


def _chunks(
    layer: _Conv, x: Tensor, backprops: Tensor, gram: bool = False, positions: bool = False
) -> Iterator[slice]:
    """Slices of the batch whose temporaries fit in the layer's budget and in :data:`CHUNK_FLOATS`
    (at least one example per slice): unfolded patches, or with ``positions`` the (padded)
    input-position Gram matrix; plus the two [L, L] Gram matrices with ``gram``."""
    B, L, G = backprops.shape[0], math.prod(backprops.shape[2:]), layer.groups
    if positions:
        temporary = G * _padded_positions(layer, x) ** 2
    else:
        temporary = L * G * layer.weight[0].numel()
    temporary += 2 * G * L * L if gram else 0
    step = max(1, min(_saved_per_example(x, backprops) * B, CHUNK_FLOATS) // temporary)
    for start in range(0, B, step):
        yield slice(start, min(B, start + step))


def _padded_positions(layer: _Conv, x: Tensor) -> int:
    """Number of input positions after the layer's padding."""
    pad = layer._reversed_padding_repeated_twice
    return math.prod(size + pad[2 * i] + pad[2 * i + 1] for i, size in enumerate(reversed(x.shape[2:])))


COPY_COST = 40
"""Multiply-adds one copied or gathered float costs, roughly (CPU, one thread: a ``bmm`` does about
40 multiply-adds in the time a patch copy moves one float)."""
STRIDED_ADD_COST = 100
"""Same for one element of the position Gram's strided accumulation (small inner dimensions)."""


def _conv_costs(layer: _Conv, x: Tensor, backprops: Tensor) -> dict[ConvMethod, int]:
    """Rough cost per example of each norm method, in multiply-adds (copies weighted as above)."""
    G, L, K = layer.groups, math.prod(backprops.shape[2:]), math.prod(layer.kernel_size)
    p, o = layer.weight[0].numel(), layer.out_channels // G
    per_example = G * L * p * o
    patches = COPY_COST * G * L * p
    # XᵀX over the unpadded input when zero padding is added to M afterwards
    positions = math.prod(x.shape[2:]) if layer.padding_mode == "zeros" else _padded_positions(layer, x)
    cg = layer.in_channels // G
    return {
        "grouped": per_example,
        "correlate": per_example + (COPY_COST * cg * G * L * o if cg > 1 else 0),  # repeated δ
        "unfold": per_example + patches,
        "gram": G * L * L * (p + o) + patches,
        "position-gram": positions**2 * layer.in_channels + G * L * L * (STRIDED_ADD_COST * K + o),
    }


def _conv_method(layer: _Conv, x: Tensor, backprops: Tensor) -> ConvMethod:
    """The fastest norm method for this layer and input shape within its memory budget, timed once.

    The methods give the same norms (up to fp32 rounding), so the choice is a speed decision under a
    memory cap: the methods that keep B·O·p per-example gradients for the sum ("grouped", "unfold",
    "correlate") are allowed only when those fit in what the layer's record already holds
    (:func:`_saved_per_example`), and "correlate" only when its C/G-fold copy of the output gradients
    does too; the two Gram methods work a chunk of examples at a time and are always allowed. Of the allowed methods, those within 3× of the cheapest by the rough estimate of
    :func:`_conv_costs` are timed; which wins depends on the hardware (unfold copies are cheap on
    GPUs, grouped convolutions with many groups are not always), hence measured rather than
    modelled. Cached per shape excluding the batch size, which Poisson sampling changes every step.
    """
    if _forced_conv_method is not None:
        return _forced_conv_method
    if backprops.shape[0] == 0:  # nothing to time on an empty batch
        return "unfold"
    key = (
        type(layer), layer.weight.shape, layer.stride, layer.padding, layer.dilation, layer.groups,
        tuple(x.shape[1:]), x.device.type, x.dtype,
    )  # fmt: skip
    choice = _conv_choice.get(key)
    if choice is None:
        costs = _conv_costs(layer, x, backprops)
        budget = _saved_per_example(x, backprops)
        if layer.weight.numel() > budget:
            for method in _MATERIALISING:
                del costs[method]
        # correlate repeats the output gradients once per input channel of a group
        if "correlate" in costs and layer.in_channels // layer.groups * backprops[0].numel() > budget:
            del costs["correlate"]
        cheapest = min(costs.values())
        runs = {
            m: functools.partial(_CONV_NORMS[m], layer, x, backprops)
            for m, cost in costs.items()
            if cost <= 3 * cheapest
        }
        choice = _conv_choice[key] = runs.popitem()[0] if len(runs) == 1 else _fastest(runs, x.device)
    return choice


_MATERIALISING: tuple[ConvMethod, ...] = ("unfold", "grouped", "correlate")
"""Methods returning per-example gradients [B, *weight.shape] (kept for the sum); the others return norms."""
_CONV_NORMS: dict[ConvMethod, Callable[[_Conv, Tensor, Tensor], Tensor]] = {
    "gram": _conv_gram,
    "position-gram": _conv_position_gram,
    "unfold": _conv_samples_unfold,
    "grouped": _conv_samples_grouped,
    "correlate": _conv_samples_correlate,
}


def _fastest(
    runs: Mapping[ConvMethod, Callable[[], Any]], device: torch.device, rounds: int = 3
) -> ConvMethod:
    """The run with the best wall-clock time: each warmed up once, then timed in interleaved rounds
    (so a slow moment of the machine does not decide the choice for the whole training)."""
    best = dict.fromkeys(runs, math.inf)
    for fn in runs.values():
        fn()
    for _ in range(rounds):
        for method, fn in runs.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best[method] = min(best[method], time.perf_counter() - start)
    return min(best, key=best.__getitem__)


@register_fast_clipper(nn.Conv1d, nn.Conv2d)
class _ConvKernels(_Kernels):
    """Convolution as a Linear layer over unfolded patches (T = output positions), per group.

    Norms by the Gram trick, or from per-example gradients materialised (by unfolding, or by one
    batch-grouped weight-gradient convolution) and then reused for the clipped sum.
    """

    @staticmethod
    def sq_norms(
        layer: nn.Module, activations: list[Tensor], backprops: Tensor, cache: Cache | None = None
    ) -> dict[nn.Parameter, Tensor]:
        assert isinstance(layer, nn.Conv1d | nn.Conv2d)
        weight, bias = _weight_bias(layer)
        out: dict[nn.Parameter, Tensor] = {}
        x = activations[0]
        if weight is not None:
            method = _conv_method(layer, x, backprops)
            result = _CONV_NORMS[method](layer, x, backprops)  # per-example gradients or certified norms
            if method in _MATERIALISING:
                result = _certified_cached(
                    cache,
                    weight,
                    result,
                    _conv_sum_err(layer, x, backprops),
                    lambda i: _conv_samples_grouped(layer, x[i], backprops[i], torch.float64),
                )
            out[weight] = result
        if bias is not None:  # per-example bias gradients [B, O]: position sums, kept for the sum
            flat = backprops.float().flatten(2)
            out[bias] = _certified_cached(
                cache,
                bias,
                flat.sum(2),
                _position_sum_err(flat.abs().sum(2), flat.shape[2]),
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
        weight, bias = _weight_bias(layer)
        out: dict[nn.Parameter, Tensor] = {}
        if bias is not None:  # per-example bias gradients are small: sum over positions, then weight
            out[bias] = _bias_sum(cache, bias, weights, lambda: backprops.float().flatten(2).sum(2))
        if weight is not None:
            reused = _reuse(cache, weight, weights)
            if reused is None:
                # The layer's own weight-gradient convolution with w_i·δ_i as output gradient: one
                # reduction over batch and positions, the same as a matmul of the unfolded patches.
                wd, keep = _fold(weights, backprops)
                x = _mask(activations[0], keep)
                reused = _conv_weight_grad(layer, x, wd, layer.groups, layer.weight.shape)
            out[weight] = reused
        return out


# --------------------------------------------------------------------------------------------------
# Embedding
# --------------------------------------------------------------------------------------------------


def _embedding_inputs(
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


@register_fast_clipper(nn.Embedding)
class _EmbeddingKernels(_Kernels):
    """Rows gathered by index: the per-example gradient is a sparse sum of δ_t into rows i_t."""

    @staticmethod
    def sq_norms(
        layer: nn.Module, activations: list[Tensor], backprops: Tensor, cache: Cache | None = None
    ) -> dict[nn.Parameter, Tensor]:
        assert isinstance(layer, nn.Embedding)
        weight, _ = _weight_bias(layer)
        if weight is None:
            return {}
        idx, d = _embedding_inputs(layer, activations, backprops)
        B, T = idx.shape

        def exact(i: Tensor) -> Tensor:
            return _embedding_rows_sq_norms(layer, idx[i], d[i].double())

        if embedding_use_gram(T, layer.embedding_dim):
            same = (idx.unsqueeze(2) == idx.unsqueeze(1)).float()  # the exact Gram of one-hot inputs
            dd = torch.bmm(d, d.transpose(1, 2))
            values, bound, spread = _gram_certified(same, dd, 0, layer.embedding_dim)
        else:
            # the rows are sums of up to T output gradients each: γ_T Σ_t ‖δ_t‖ bounds their error
            values = _embedding_rows_sq_norms(layer, idx, d)
            spread = d.norm(dim=2).sum(1)
            bound = _sum_bound(values, rounding_gamma(T) * spread)
        # the clipped sum index-adds w_i·δ_t of the whole batch into the table: B·T terms at most
        return {weight: certified_sq_norms(values, bound, exact, spread, B * T)}

    @staticmethod
    def weighted_grad(
        layer: nn.Module,
        activations: list[Tensor],
        backprops: Tensor,
        weights: Tensor,
        cache: Cache | None = None,
    ) -> dict[nn.Parameter, Tensor]:
        assert isinstance(layer, nn.Embedding)
        weight, _ = _weight_bias(layer)
        if weight is None:
            return {}
        wd, _ = _fold(weights, backprops)
        idx, wd = _embedding_inputs(layer, activations, wd)
        grad = wd.new_zeros(layer.num_embeddings, layer.embedding_dim)
        return {weight: grad.index_add_(0, idx.reshape(-1), wd.reshape(-1, layer.embedding_dim))}


# --------------------------------------------------------------------------------------------------
# LayerNorm / GroupNorm: small parameters, per-example gradients materialised (Opacus's formulas)
# --------------------------------------------------------------------------------------------------


def _norm_layer_terms(
    layer: nn.Module, activations: list[Tensor], backprops: Tensor, dtype: torch.dtype = torch.float32
) -> tuple[dict[nn.Parameter, Tensor], int, int]:
    """Per-position terms in ``dtype`` of a LayerNorm or GroupNorm layer's per-example affine gradients
    (their sum over the P positions), P, and the positions' dim: [B, P, *shape] (LayerNorm, dim 1) or
    [B, C, P] (GroupNorm, dim 2, the layout as stored)."""
    x, d = activations[0].to(dtype), backprops.to(dtype)
    B = d.shape[0]
    out: dict[nn.Parameter, Tensor] = {}
    weight, bias = _weight_bias(layer)
    if isinstance(layer, nn.LayerNorm):
        shape = tuple(layer.normalized_shape)
        normed = F.layer_norm(x, layer.normalized_shape, eps=layer.eps) if weight is not None else x
    else:
        assert isinstance(layer, nn.GroupNorm)
        shape = (layer.num_channels,)
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


@register_fast_clipper(nn.LayerNorm, nn.GroupNorm)
class _NormKernels(_Kernels):
    """LayerNorm / GroupNorm: norms and weighted sums of the (small) materialised affine gradients."""

    @staticmethod
    def sq_norms(
        layer: nn.Module, activations: list[Tensor], backprops: Tensor, cache: Cache | None = None
    ) -> dict[nn.Parameter, Tensor]:
        terms, positions, dim = _norm_layer_terms(layer, activations, backprops)
        if positions == 1:  # one position per example: nothing summed, nothing cancels
            return {p: _cached(cache, p, t.select(dim, 0)) for p, t in terms.items()}

        def exact(p: nn.Parameter) -> Callable[[Tensor], Tensor]:
            return lambda i: _norm_layer_grad_samples(
                layer, [activations[0][i]], backprops[i], torch.float64
            )[p]

        return {
            p: _certified_cached(
                cache, p, t.sum(dim), _position_sum_err(t.abs().sum(dim), positions), exact(p)
            )
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
        params = [p for p in _weight_bias(layer) if p is not None]
        out = {p: g for p in params if (g := _reuse(cache, p, weights)) is not None}
        if len(out) < len(params):
            samples = _norm_layer_grad_samples(layer, activations, backprops)
            out.update(materialized_weighted_grad({p: samples[p] for p in params if p not in out}, weights))
        return out
