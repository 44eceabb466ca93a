"""Materialised per-example gradients [B, *param.shape]: which rule computes them for a layer (Opacus's
formula, a container's own parameters, or a functorch recompute, see :mod:`.vmap`), and their norms and
weighted sums."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from opacus.grad_sample import GradSampleHooks
from torch import Tensor, nn

from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.per_example import vmap
from lightning_dp.per_example.reparametrized import is_parametrized, reparametrized

GradSampler = Callable[[nn.Module, list[Tensor], Tensor], dict[nn.Parameter, Tensor]]


def direct_params(module: nn.Module, trainable: bool = True) -> list[tuple[str, nn.Parameter]]:
    """Parameters registered on ``module`` itself and on none of its descendants (aliases such as Opacus's
    DPLSTM renaming its cells' weights belong to the cells); only trainable ones unless ``trainable=False``.

    A layer with parametrized tensors (``torch.nn.utils.parametrize``: weight_norm, spectral_norm) owns the
    parametrizations' original tensors too, under the names ``functional_call`` takes
    (``parametrizations.weight.original``): its forward computes the weight from them."""
    children = [
        c for n, c in module.named_children() if not (n == "parametrizations" and is_parametrized(module))
    ]
    below = {id(p) for child in children for p in child.parameters()}
    own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in below]
    if is_parametrized(module):
        parametrizations = cast(nn.Module, module.parametrizations)
        own += [(f"parametrizations.{n}", p) for n, p in parametrizations.named_parameters()]
    return [(n, p) for n, p in own if p.requires_grad or not trainable]


def _has_trainable_children(module: nn.Module) -> bool:
    children = [
        c for n, c in module.named_children() if not (n == "parametrizations" and is_parametrized(module))
    ]
    return any(p.requires_grad for child in children for p in child.parameters())


def layer_method(module: nn.Module) -> str:
    """How a layer's per-example gradients are computed when materialised: 'formula' (Opacus's per-layer
    formula), 'direct' (a container's own parameters, see ``direct_path``) or 'functorch' (recomputed
    per example, ``vmap``)."""
    if reparametrized(module):  # the weight is a function of other parameters: recomputed per example
        return "functorch"
    if type(module) in GradSampleHooks.GRAD_SAMPLERS:
        return "formula"
    return "direct" if _has_trainable_children(module) else "functorch"


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


def grad_sampler(module: nn.Module) -> GradSampler:
    if isinstance(module, nn.Embedding) and module.padding_idx is not None:
        return _embedding_with_padding
    if type(module) is nn.EmbeddingBag:
        return _embedding_bag
    formula = GradSampleHooks.GRAD_SAMPLERS.get(type(module))
    return _recompute if formula is None else functools.partial(_dense, formula)


def _dense(
    formula: GradSampler, module: nn.Module, activations: list[Any], backprops: Tensor
) -> dict[nn.Parameter, Tensor]:
    """Opacus's formulas assume standard strides (its convolution one is wrong on channels_last, and on
    a [B, C, 1, 1] tensor whose size-1 dimensions carry other strides, which ``contiguous`` keeps)."""
    dense = [_standard(a) if isinstance(a, Tensor) else a for a in activations]
    if isinstance(module, NORMS) and any(
        module._parameters.get(n, module) is None for n in ("weight", "bias")
    ):
        module = cast(nn.Module, _AffineParts(module))
    return formula(module, dense, _standard(backprops))


NORMS = (nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.RMSNorm)
"""Norm layers whose Opacus formula reads ``layer.weight`` and ``layer.bias`` unconditionally."""


class _AffineParts:
    """A norm layer as its Opacus formula reads it, with a missing affine part (``LayerNorm(bias=False)``,
    a weight set to None) shown as a frozen placeholder: the formula skips it instead of failing on None."""

    def __init__(self, layer: nn.Module) -> None:
        self._layer = layer

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._layer, name)
        if value is None and name in ("weight", "bias"):
            return torch.empty(0)  # requires_grad=False: no per-example gradient asked of it
        return value


def _standard(t: Tensor) -> Tensor:
    """``t`` with row-major strides on every dimension (copied only where they differ)."""
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= size
    if t.stride() == tuple(reversed(strides)):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _recompute(module: nn.Module, activations: list[Tensor], backprops: Tensor) -> dict[nn.Parameter, Tensor]:
    """A layer without a formula, from its positional inputs and single output (``vmap``)."""
    return vmap.per_example_grads(
        vmap.RecomputedCall(module, dict(direct_params(module)), (activations, {}), [0], [backprops])
    )


def _embedding_with_padding(
    module: nn.Module, activations: list[Tensor], backprops: Tensor
) -> dict[nn.Parameter, Tensor]:
    """Opacus's embedding formula gives the ``padding_idx`` row a gradient; torch gives it none."""
    assert isinstance(module, nn.Embedding)
    assert module.padding_idx is not None
    samples = _dense(GradSampleHooks.GRAD_SAMPLERS[nn.Embedding], module, activations, backprops)
    samples[cast(nn.Parameter, module.weight)][:, module.padding_idx] = 0
    return samples


def _embedding_bag(
    module: nn.Module, activations: list[Any], backprops: Tensor
) -> dict[nn.Parameter, Tensor]:
    """``nn.EmbeddingBag``, exactly: bags from a 2-D input's rows or from ``offsets`` (``include_last_offset``
    too), a token repeated in a bag counted each time, ``per_sample_weights``, ``padding_idx`` left out,
    modes sum, mean and max (the gradient of each output coordinate goes to the row that attained it)."""
    assert isinstance(module, nn.EmbeddingBag)
    index, offsets, weights = [*activations, None, None][:3]
    batch, dim = backprops.shape
    vocab = module.num_embeddings
    if index.dim() == 2:
        length = index.shape[1]
        bag = torch.arange(index.shape[0], device=index.device).repeat_interleave(length)
        index = index.reshape(-1)
        weights = None if weights is None else weights.reshape(-1)
    else:
        starts = offsets[:-1] if module.include_last_offset else offsets
        tokens = torch.arange(index.shape[0], device=index.device)
        bag = torch.searchsorted(starts.contiguous(), tokens, right=True) - 1
    keep = (
        torch.ones_like(index, dtype=torch.bool)
        if module.padding_idx is None
        else index != module.padding_idx
    )
    out = torch.zeros(batch * vocab, dim, dtype=backprops.dtype, device=backprops.device)
    flat = bag * vocab + index
    if module.mode == "max":
        values = module.weight.detach()[index].to(backprops.dtype)
        best = torch.full((batch, dim), -torch.inf, dtype=values.dtype, device=values.device)
        best = best.scatter_reduce(0, bag[keep, None].expand(-1, dim), values[keep], "amax")
        hits = (values == best[bag]) & keep[:, None]
        position = torch.where(
            hits, torch.arange(index.shape[0], device=index.device)[:, None], index.shape[0]
        )
        first = torch.full((batch, dim), index.shape[0], dtype=position.dtype, device=position.device)
        first = first.scatter_reduce(0, bag[:, None].expand(-1, dim), position, "amin")
        found = first < index.shape[0]
        rows = flat[first.clamp(max=index.shape[0] - 1)]
        out.view(-1).index_add_(
            0,
            (rows * dim + torch.arange(dim, device=rows.device))[found],
            backprops[found],
        )
    else:
        coef = keep.to(backprops.dtype) if weights is None else weights.to(backprops.dtype) * keep
        if module.mode == "mean":
            counts = torch.zeros(batch, dtype=backprops.dtype, device=backprops.device)
            counts.index_add_(0, bag, keep.to(backprops.dtype))
            coef = coef / counts.clamp(min=1)[bag]
        out.index_add_(0, flat, coef[:, None] * backprops[bag])
    return {cast(nn.Parameter, module.weight): out.view(batch, vocab, dim)}


def add_samples(into: dict[nn.Parameter, Tensor], samples: dict[nn.Parameter, Tensor]) -> None:
    """Sum each parameter's per-example gradients over the calls (and tied layers) that use it."""
    for param, sample in samples.items():
        if param.requires_grad:
            previous = into.get(param)
            if previous is not None and previous.shape != sample.shape:
                raise DPConfigurationError(
                    f"A parameter of shape {tuple(param.shape)} is used by layer calls that see batches of "
                    "different sizes: every call must see the whole batch on dimension 0 (a PackedSequence through Opacus's DPLSTM does not; use nn.LSTM)."
                )
            into[param] = sample if previous is None else previous + sample
