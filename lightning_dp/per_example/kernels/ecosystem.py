"""Fast kernels and formulas for common layers of timm and Hugging Face transformers.

Without them these layers hold parameters but have no formula, so they are recomputed per example
(functorch) and put the whole model in materialize mode. Each is registered by exact type, and only
when its library is already imported (a model using it has imported it): importing lightning_dp never
imports timm or transformers.

* timm ``LayerNorm`` (``nn.LayerNorm``'s computation) and ``LayerNorm2d`` (LayerNorm over the channels
  of [B, C, H, W]: the LayerNorm kernels on the channels-last view);
* transformers ``Conv1D`` (GPT-2's Linear with a transposed [in, out] weight): the Linear kernels,
  per-example gradients transposed back;
* transformers ``LlamaRMSNorm``: per-example gradient Σ_t normed_t · δ_t, materialised ([B, D], small).
* timm ``LayerScale``/``LayerScale2d`` (y = x · γ over the channels; not the in-place variant) and the
  layer scale of timm's ``ConvNeXtBlock`` (``gamma``, a parameter of the block itself): per-example
  gradient Σ_positions x ⊙ δ ([B, C], small). The block is swapped in place (as ``recurrent`` swaps RNNs)
  for a subclass whose training forward applies ``gamma`` through a :class:`ChannelScale` part, so the
  block is no longer recomputed per example for that one vector.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import torch
from opacus.grad_sample import GradSampleHooks
from torch import Tensor, nn

from lightning_dp.per_example import kernels as fast_kernels
from lightning_dp.per_example.kernels.certified import certified_cached, rounding_gamma
from lightning_dp.per_example.kernels.registry import Cache, FastClipper, Grads, KernelCall
from lightning_dp.per_example.materialized import materialized_sq_norm, materialized_weighted_grad

Samples = dict[nn.Parameter, Tensor]
Formula = Callable[[nn.Module, list[Tensor], Tensor], Samples]


def _trainable(p: Any) -> bool:
    return isinstance(p, nn.Parameter) and p.requires_grad


def _weight_bias(layer: nn.Module) -> tuple[nn.Parameter, nn.Parameter | None]:
    return cast(nn.Parameter, layer.weight), cast("nn.Parameter | None", getattr(layer, "bias", None))


def _materialising(formula: Formula) -> FastClipper:
    """Kernels for a layer with small parameters: per-example gradients materialised, kept for the sum."""

    def sq_norms(call: KernelCall) -> Grads:
        samples = formula(call.layer, call.activations, call.backprops)
        if call.cache is not None:
            call.cache.update(samples)
        return {p: materialized_sq_norm(g) for p, g in samples.items()}

    def weighted_grad(call: KernelCall, weights: Tensor) -> Grads:
        cache = call.cache
        params = [p for p in call.layer.parameters(recurse=False) if p.requires_grad]
        samples = {p: cache[p] for p in params if cache and p in cache}
        if len(samples) < len(params):
            samples.update(formula(call.layer, call.activations, call.backprops))
        return materialized_weighted_grad(samples, weights)

    return FastClipper(sq_norms, weighted_grad)


def _channels_last_layer_norm(layer: nn.Module, acts: list[Tensor], bp: Tensor) -> Samples:
    """timm's LayerNorm2d: LayerNorm over dim 1, computed on the [B, H, W, C] view."""
    formula = GradSampleHooks.GRAD_SAMPLERS[nn.LayerNorm]
    x = acts[0].permute(0, 2, 3, 1).contiguous()
    return dict(formula(layer, [x], bp.permute(0, 2, 3, 1).contiguous()))


def _rms_norm(layer: nn.Module, acts: list[Tensor], bp: Tensor) -> Samples:
    """LlamaRMSNorm: y = w · (x / rms(x)) (normalised in fp32, cast back before the weight)."""
    weight, _ = _weight_bias(layer)
    if not _trainable(weight):
        return {}
    x = acts[0].float()
    eps = float(cast(float, layer.variance_epsilon))
    normed = (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)).to(acts[0].dtype)
    per = (normed.float() * bp.float()).reshape(bp.shape[0], -1, bp.shape[-1]).sum(1)
    return {weight: per}


def _conv1d_samples(layer: nn.Module, acts: list[Tensor], bp: Tensor) -> Samples:
    """transformers' Conv1D, y = x W + b with W [in, out]: per-example Σ_t x_tᵀ δ_t and Σ_t δ_t."""
    weight, bias = _weight_bias(layer)
    B = bp.shape[0]
    x = acts[0].reshape(B, -1, weight.shape[0]).to(bp.dtype)
    d = bp.reshape(B, -1, bp.shape[-1])
    out: Samples = {}
    if _trainable(weight):
        out[weight] = torch.bmm(x.transpose(1, 2), d)
    if bias is not None and _trainable(bias):
        out[bias] = d.sum(1)
    return out


def _conv1d_as_linear(layer: nn.Module) -> nn.Linear:
    """A Linear view (not registered anywhere) that the Linear kernels accept: same parameters, keyed
    as the layer's; only per-example gradients they materialise come out transposed."""
    from lightning_dp.per_example.recurrent import LinearPart

    weight, bias = _weight_bias(layer)
    part = LinearPart.borrow(weight, bias)
    part.in_features, part.out_features = weight.shape  # Conv1D's weight is [in, out], a Linear's [out, in]
    return part


def _conv1d_kernels() -> FastClipper:
    linear = fast_kernels.FAST_CLIPPERS[nn.Linear]

    def sq_norms(call: KernelCall) -> Grads:
        inner: Cache = {}
        norms = linear.sq_norms(replace(call, layer=_conv1d_as_linear(call.layer), cache=inner))
        if call.cache is not None:
            weight = _weight_bias(call.layer)[0]
            call.cache.update({p: g.transpose(1, 2) if p is weight else g for p, g in inner.items()})
        return norms

    def weighted_grad(call: KernelCall, weights: Tensor) -> Grads:
        cache = call.cache
        weight, bias = _weight_bias(call.layer)
        params = [p for p in (weight, bias) if p is not None and _trainable(p)]
        if cache and all(p in cache for p in params):
            return materialized_weighted_grad({p: cache[p] for p in params}, weights)
        sums = linear.weighted_grad(replace(call, layer=_conv1d_as_linear(call.layer), cache=None), weights)
        return {p: g.t() if p is weight else g for p, g in sums.items()}

    return FastClipper(sq_norms, weighted_grad)


class ChannelScale(nn.Module):
    """y = x · γ with γ [C] on the channel dimension ``dim`` of x: a "part" carrying a layer scale that
    is a parameter of a larger block (its ``weight`` is the block's own parameter, borrowed)."""

    def __init__(self, weight: nn.Parameter, dim: int = 1) -> None:
        super().__init__()
        self.weight = weight
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        shape = [1] * x.dim()
        shape[self.dim] = -1
        return x.mul(self.weight.view(shape))


def _scale_param(layer: nn.Module) -> tuple[nn.Parameter | None, int]:
    """(γ if trainable, its channel dim) of a ChannelScale part or a timm LayerScale/LayerScale2d."""
    p: Any = layer.weight if isinstance(layer, ChannelScale) else getattr(layer, "gamma", None)
    dim = (
        layer.dim
        if isinstance(layer, ChannelScale)
        else (1 if type(layer).__name__ == "LayerScale2d" else -1)
    )
    return (p if _trainable(p) else None), dim


def _scale_terms(x: Tensor, d: Tensor, dim: int, dtype: torch.dtype) -> tuple[Tensor, int]:
    """x ⊙ δ in ``dtype`` with the channels moved last ([B, ..., C], in the memory order it has) and the
    number of positions summed per channel."""
    prod = x.to(dtype) * d.to(dtype)
    prod = prod.movedim(dim, -1)
    return prod, math.prod(prod.shape[1:-1])


def _scale_samples(layer: nn.Module, acts: list[Tensor], bp: Tensor) -> Samples:
    """Per-example γ gradients [B, C]: Σ over positions of x ⊙ δ (fp32)."""
    gamma, dim = _scale_param(layer)
    if gamma is None:
        return {}
    prod, positions = _scale_terms(acts[0], bp, dim, torch.float32)
    return {gamma: prod.reshape(prod.shape[0], positions, prod.shape[-1]).sum(1)}


def _scale_kernels() -> FastClipper:
    """Certified norms of the per-example γ gradients (summed over positions in fp32: the rounding bound
    γ_P Σ_t ‖x_t ⊙ δ_t‖, flagged examples recomputed in fp64), kept for the clipped sum."""

    def sq_norms(call: KernelCall) -> Grads:
        gamma, dim = _scale_param(call.layer)
        if gamma is None:
            return {}
        x, bp = call.activations[0], call.backprops
        prod, positions = _scale_terms(x, bp, dim, torch.float32)
        B = prod.shape[0]
        flat = prod.reshape(B, positions, prod.shape[-1])  # a view unless the channels are not innermost
        err = rounding_gamma(positions) * torch.linalg.vector_norm(flat, dim=2).sum(1)

        def exact(i: Tensor) -> Tensor:
            terms, _ = _scale_terms(x[i], bp[i], dim, torch.float64)
            return terms.reshape(len(i), positions, terms.shape[-1]).sum(1)

        return {gamma: certified_cached(call.cache, gamma, flat.sum(1), err, exact)}

    def weighted_grad(call: KernelCall, weights: Tensor) -> Grads:
        cache = call.cache
        gamma, _ = _scale_param(call.layer)
        if gamma is None:
            return {}
        if cache and gamma in cache:
            samples = {gamma: cache[gamma]}
        else:
            samples = _scale_samples(call.layer, call.activations, call.backprops)
        return materialized_weighted_grad(samples, weights)

    return FastClipper(sq_norms, weighted_grad)


def _layer_scaled_convnext_block(base: type[nn.Module]) -> type[nn.Module]:
    """timm's ConvNeXtBlock with its layer scale ``gamma`` applied through a :class:`ChannelScale` part
    in training forwards (the same computation as timm's forward); everything else runs the original."""

    class DPConvNeXtBlock(base):  # type: ignore[valid-type,misc]
        def dp_parts(self) -> list[tuple[str, nn.Module]]:
            parts: list[tuple[str, nn.Module]] | None = self.__dict__.get("_dp_parts")
            if parts is None:
                gamma = self.gamma
                parts = [] if gamma is None else [("gamma", ChannelScale(gamma, dim=1))]
                self.__dict__["_dp_parts"] = parts
            for _, part in parts:
                part.training = self.training
            return parts

        def forward(self, x: Tensor) -> Tensor:
            parts = self.dp_parts()
            if not (self.training and torch.is_grad_enabled() and parts):
                return cast(Tensor, super().forward(x))
            shortcut = x
            x = self.conv_dw(x)
            if self.use_conv_mlp:
                x = self.mlp(self.norm(x))
            else:
                x = self.mlp(self.norm(x.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)
            x = parts[0][1](x)
            return cast(Tensor, self.drop_path(x) + self.shortcut(shortcut))

    DPConvNeXtBlock.__name__ = DPConvNeXtBlock.__qualname__ = f"DP{base.__name__}"
    return DPConvNeXtBlock


def _register(layer_type: type[nn.Module], kernels: FastClipper, formula: Formula) -> None:
    fast_kernels.FAST_CLIPPERS.setdefault(layer_type, kernels)
    GradSampleHooks.GRAD_SAMPLERS.setdefault(layer_type, formula)


_register(ChannelScale, _scale_kernels(), _scale_samples)


def register_loaded() -> None:
    """Register the kernels of every supported layer type whose library is already imported."""
    timm_norm = sys.modules.get("timm.layers.norm")
    if timm_norm is not None:
        if isinstance(getattr(timm_norm, "LayerNorm", None), type):
            norm = fast_kernels.FAST_CLIPPERS[nn.LayerNorm]
            _register(timm_norm.LayerNorm, norm, GradSampleHooks.GRAD_SAMPLERS[nn.LayerNorm])
        if isinstance(getattr(timm_norm, "LayerNorm2d", None), type):
            _register(
                timm_norm.LayerNorm2d, _materialising(_channels_last_layer_norm), _channels_last_layer_norm
            )
    hf_utils = sys.modules.get("transformers.pytorch_utils")
    if hf_utils is not None and isinstance(getattr(hf_utils, "Conv1D", None), type):
        _register(hf_utils.Conv1D, _conv1d_kernels(), _conv1d_samples)
    timm_scale = sys.modules.get("timm.layers.layer_scale")
    if timm_scale is not None:
        for name in ("LayerScale", "LayerScale2d"):
            if isinstance(getattr(timm_scale, name, None), type):
                _register(getattr(timm_scale, name), _scale_kernels(), _scale_samples)
    convnext = sys.modules.get("timm.models.convnext")
    if convnext is not None and isinstance(getattr(convnext, "ConvNeXtBlock", None), type):
        from lightning_dp.per_example.recurrent import SWAPS

        if convnext.ConvNeXtBlock not in SWAPS:
            SWAPS[convnext.ConvNeXtBlock] = _layer_scaled_convnext_block(convnext.ConvNeXtBlock)
    llama = sys.modules.get("transformers.models.llama.modeling_llama")
    if llama is not None and isinstance(getattr(llama, "LlamaRMSNorm", None), type):
        _register(llama.LlamaRMSNorm, _materialising(_rms_norm), _rms_norm)
