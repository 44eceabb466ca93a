"""Layers whose weight is computed from other parameters before each forward.

``torch.nn.utils.parametrize`` (``parametrizations.weight_norm``/``spectral_norm``) and the older hook-based
``weight_norm``/``spectral_norm`` (``weight_g``/``weight_v``, ``weight_orig``) make ``layer.weight`` a
function of the trainable tensors. A layer formula sees that computed weight, not the parameters, so such a
layer is recomputed per example instead (``vmap``: the chain rule through the weight's function), with its
function in eval mode so that a power iteration is not run again (the forward already ran it).
"""

from __future__ import annotations

from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm


def is_parametrized(module: nn.Module) -> bool:
    return parametrize.is_parametrized(module)


def reparametrized(module: nn.Module) -> bool:
    """Whether ``module``'s weight is computed from other parameters (see the module docstring)."""
    if is_parametrized(module):
        return True
    return any(isinstance(h, SpectralNorm | WeightNorm) for h in module._forward_pre_hooks.values())
