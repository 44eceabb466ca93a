"""The fast-kernel registry and its entry points: ``register_fast_clipper``, ``is_supported``,
``sq_norms``, ``weighted_grad`` (the package docstring says what the kernels compute)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor, nn

from lightning_dp.per_example.precision import ieee_fp32
from lightning_dp.per_example.reparametrized import reparametrized

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
    if type(layer) not in FAST_CLIPPERS or reparametrized(layer):
        return False
    if isinstance(layer, nn.Embedding):
        # scale_grad_by_freq rescales by counts over the whole batch: not a per-example gradient.
        return not layer.scale_grad_by_freq
    # an in-place layer (timm's LayerScale(inplace=True)) overwrites the input its kernels read
    return getattr(layer, "inplace", False) is not True


def sq_norms(
    layer: nn.Module, activations: list[Tensor], backprops: Tensor, cache: Cache | None = None
) -> dict[nn.Parameter, Tensor]:
    """Per-example squared L2 norm [B] (fp32) of the gradient of each trainable parameter of ``layer``.

    Pass the same ``cache`` dict to :func:`weighted_grad` so per-example gradients materialised
    here are reused there.
    """
    with ieee_fp32():  # the certified bounds assume fp32 products (not TF32, not bf16)
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
    with ieee_fp32():
        return _kernels(layer).weighted_grad(layer, activations, backprops, weights, cache)


def _kernels(layer: nn.Module) -> FastClipper:
    if not is_supported(layer):
        raise TypeError(f"No fast clipping kernels for {type(layer).__name__}; materialise its gradients.")
    return FAST_CLIPPERS[type(layer)]
