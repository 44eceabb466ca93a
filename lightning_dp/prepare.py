"""In-place checks and fixes that make a LightningModule trainable with per-example clipping.

They run before ``configure_optimizers`` so the optimizer sees the final parameters, and in place
(Opacus's ``ModuleValidator.fix`` clones the module, which a Trainer cannot use).
"""

from __future__ import annotations

import itertools
import math
from typing import Literal

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from lightning_dp.errors import DPConfigurationError

OnBatchNorm = Literal["raise", "replace"]


def batchnorm_layers(module: nn.Module) -> list[str]:
    """Names of every BatchNorm layer, including ``affine=False`` ones that Opacus's validator misses."""
    return [name for name, m in module.named_modules() if isinstance(m, _BatchNorm)]


def _group_norm_for(bn: _BatchNorm) -> nn.GroupNorm:
    """GroupNorm(gcd(32, C), C) for image BatchNorm; one group for BatchNorm1d, whose (B, C) input
    has no spatial extent, so one channel per group would normalise every value to zero."""
    channels = bn.num_features
    groups = 1 if isinstance(bn, nn.BatchNorm1d) else math.gcd(32, channels)
    return nn.GroupNorm(groups, channels, eps=bn.eps, affine=bn.affine)


def replace_batchnorm(module: nn.Module) -> list[str]:
    """Swap every BatchNorm for GroupNorm in place (see ``_group_norm_for``); returns the names replaced."""
    replaced = []
    for name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, _BatchNorm):
                reference = next(itertools.chain(child.parameters(), child.buffers()), None)
                group_norm = _group_norm_for(child)
                if reference is not None:
                    group_norm = group_norm.to(reference.device)
                setattr(parent, child_name, group_norm)
                replaced.append(f"{name}.{child_name}" if name else child_name)
    return replaced


def check_no_direct_parameters(module: nn.Module) -> None:
    """Refuse trainable parameters registered on the LightningModule itself (no layer formula covers them)."""
    direct = [name for name, p in module.named_parameters(recurse=False) if p.requires_grad]
    if direct:
        raise DPConfigurationError(
            f"Parameters registered directly on the LightningModule ({', '.join(direct)}) cannot get "
            "per-example gradients. Move them into a submodule (e.g. an nn.Module held as self.net)."
        )


def check_stateful_layers(module: nn.Module) -> None:
    """Refuse trainable layers whose buffers are updated from the batch: running statistics mix examples
    (and store unprotected data in the model), and no per-example formula exists for them."""
    from opacus.grad_sample import GradSampleHooks

    from lightning_dp.grad_sample import trainable_layers

    for name, layer in trainable_layers(module):
        if isinstance(layer, _InstanceNorm) and layer.track_running_stats:
            raise DPConfigurationError(
                f"Layer {name} ({type(layer).__name__}) has track_running_stats=True: its running statistics are "
                "computed from the private batch and saved with the model. Use track_running_stats=False."
            )
        if type(layer) not in GradSampleHooks.GRAD_SAMPLERS and any(True for _ in layer.buffers()):
            raise DPConfigurationError(
                f"Layer {name} ({type(layer).__name__}) has buffers and no per-example gradient formula: buffers "
                "updated from the batch mix examples. Remove the buffers, or compute the layer from parameters only."
            )


def prepare_module(module: nn.Module, on_batchnorm: OnBatchNorm = "raise") -> list[str]:
    """Run every check and fix; returns a list of human-readable notes about what was changed."""
    check_no_direct_parameters(module)
    notes = []
    bns = batchnorm_layers(module)
    if bns:
        if on_batchnorm != "replace":
            raise DPConfigurationError(
                "DP training cannot use BatchNorm: it mixes the examples of a batch, so one example's "
                f"gradient depends on the others. Layers: {bns}. Replace them with GroupNorm yourself, or "
                "pass DPStrategy(on_batchnorm='replace') to swap them for GroupNorm automatically."
            )
        notes.append(f"replaced BatchNorm with GroupNorm: {replace_batchnorm(module)}")
    if not any(p.requires_grad for p in module.parameters()):
        raise DPConfigurationError("The model has no trainable parameters.")
    check_stateful_layers(module)
    return notes
