"""The fast-kernel registry, the kernels' contract (``KernelPair``: ``sq_norms(call)`` and
``weighted_grad(call, weights)`` on one :class:`KernelCall`) and the entry points: ``register_fast_clipper``,
``is_supported``, ``sq_norms``, ``weighted_grad`` (the package docstring says what the kernels compute)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor, nn

from lightning_dp.per_example.precision import ieee_fp32
from lightning_dp.per_example.reparametrized import reparametrized

Grads = dict[nn.Parameter, Tensor]
"""What a kernel returns: a tensor for each trainable parameter of the layer (per-example squared norms
[B] from ``sq_norms``, the weighted sum in the parameter's shape from ``weighted_grad``)."""
Cache = dict[nn.Parameter, Tensor]
"""Per-example gradients [B, *param.shape] a kernel materialised for the norms anyway; ``weighted_grad``
reuses them (a B-term weighted sum) instead of a second reduction over the layer's inputs."""


@dataclass(frozen=True, eq=False)
class KernelCall:
    """One recorded call of a layer, as its two kernels read it: the layer, what its forward saw, the
    gradient of its output (raw, batch first) and the per-example gradients the kernels share (``sq_norms``
    may fill ``cache``, ``weighted_grad`` reuses what it finds there; None: nothing kept)."""

    layer: nn.Module
    activations: list[Tensor]
    backprops: Tensor
    cache: Cache | None = None


SqNormsFn = Callable[[KernelCall], Grads]
WeightedGradFn = Callable[[KernelCall, Tensor], Grads]


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
    """Base of a registered kernel pair (subclass it and decorate with :func:`register_fast_clipper`):
    ``sq_norms(call)``, the per-example squared norms [B] (fp32) of each trainable parameter of
    ``call.layer``, and ``weighted_grad(call, weights)``, Σ_i w_i g_i (fp32) of each, both static."""

    @staticmethod
    def sq_norms(call: KernelCall) -> Grads:
        raise NotImplementedError

    @staticmethod
    def weighted_grad(call: KernelCall, weights: Tensor) -> Grads:
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
) -> Grads:
    """Per-example squared L2 norm [B] (fp32) of the gradient of each trainable parameter of ``layer``.

    Pass the same ``cache`` dict to :func:`weighted_grad` so per-example gradients materialised
    here are reused there.
    """
    with ieee_fp32():  # the certified bounds assume fp32 products (not TF32, not bf16)
        return _kernels(layer).sq_norms(KernelCall(layer, activations, backprops, cache))


def weighted_grad(
    layer: nn.Module,
    activations: list[Tensor],
    backprops: Tensor,
    weights: Tensor,
    cache: Cache | None = None,
) -> Grads:
    """Σ_i w_i g_i (fp32, shape of the parameter) for each trainable parameter of ``layer``.

    Examples with weight 0 contribute exactly nothing, even if their inputs or gradients are not
    finite (clipping gives weight 0 to examples with non-finite norms).
    """
    with ieee_fp32():
        return _kernels(layer).weighted_grad(KernelCall(layer, activations, backprops, cache), weights)


def _kernels(layer: nn.Module) -> FastClipper:
    if not is_supported(layer):
        raise TypeError(f"No fast clipping kernels for {type(layer).__name__}; materialise its gradients.")
    return FAST_CLIPPERS[type(layer)]
