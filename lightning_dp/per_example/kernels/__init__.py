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

Norms never understate (:func:`.certified.certified_sq_norms`): every norm formed from sums over positions (Gram
identities, per-example gradients summed over positions, bias sums) comes with a bound on its fp32
rounding error from the magnitudes of its terms; where the terms cancel so much that the bound exceeds
:data:`.certified.GUARD_FRACTION` of the value (crafted inputs), that example is recomputed exactly in fp64,
elsewhere the value plus its bound is returned. DP is a worst case over data sets: one example whose
per-position gradients nearly cancel must not pass as a small norm and be summed unclipped.

This module is the registry and the entry points; one module per family registers its pair on import
(``linear``, ``conv`` with ``conv_methods`` and ``conv_autotune``, ``embedding``, ``norm``; ``ecosystem``
for timm/Hugging Face layers once their library is loaded).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor, nn

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
) -> Callable[[type[KernelPair]], type[KernelPair]]:
    """Class decorator registering a kernel pair (static ``sq_norms``/``weighted_grad``) for layer types."""

    def wrap(kernels: type[KernelPair]) -> type[KernelPair]:
        for layer_type in layer_types:
            FAST_CLIPPERS[layer_type] = FastClipper(kernels.sq_norms, kernels.weighted_grad)
        return kernels

    return wrap


class KernelPair:
    """Base of a registered kernel pair: static ``sq_norms`` and ``weighted_grad`` with the registry's
    signatures (subclass it and decorate with :func:`register_fast_clipper`)."""

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


def _kernels(layer: nn.Module) -> FastClipper:
    if not is_supported(layer):
        raise TypeError(f"No fast clipping kernels for {type(layer).__name__}; materialise its gradients.")
    return FAST_CLIPPERS[type(layer)]


# The kernel families register themselves on import.
from lightning_dp.per_example.kernels import conv, embedding, linear, norm  # noqa: E402, F401
