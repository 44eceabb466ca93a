"""In-place checks and fixes that make a LightningModule trainable with per-example clipping.

They run before ``configure_optimizers`` so the optimizer sees the final parameters, and in place
(Opacus's ``ModuleValidator.fix`` clones the module, which a Trainer cannot use). The train loader's
sampler is checked here too, and ``load_from_checkpoint`` reloads a model whose BatchNorm was replaced.
"""

from __future__ import annotations

import itertools
import math
from os import PathLike
from typing import IO, Any, Literal, TypeVar

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.parameter import UninitializedParameter
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from lightning_dp.core.errors import DPConfigurationError

OnBatchNorm = Literal["raise", "replace"]


def trains_privately(strategy: object) -> bool:
    """Whether a Trainer's strategy is one of lightning-dp's (``DPStrategyBase.trains_privately``); asked
    by code below the strategies (module hooks, the callback), which must not import them."""
    return getattr(strategy, "trains_privately", False) is True


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
    """Swap every BatchNorm for GroupNorm in place (see ``_group_norm_for``); returns the names replaced.

    This is exactly what ``DPStrategy(on_batchnorm="replace")`` does at fit start; call it on a fresh
    instance (or use :func:`load_from_checkpoint`) to load the weights of a model trained that way.

    Args:
        module: the model, changed in place.
    """
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


def check_stateful_layers(module: nn.Module) -> None:
    """Refuse trainable layers known to keep running statistics of the batch (saved with the model
    unprotected). Any other buffer written during training is caught by the run-time checks
    (``lightning_dp.checks.state``): refused between steps, verified against the batch in the forward."""
    from lightning_dp.per_example.layers import trainable_layers

    for name, layer in trainable_layers(module):
        if isinstance(layer, _InstanceNorm) and layer.track_running_stats:
            raise DPConfigurationError(
                f"Layer {name} ({type(layer).__name__}) has track_running_stats=True: its running statistics are "
                "computed from the private batch and saved with the model. Use track_running_stats=False."
            )


M = TypeVar("M", bound=nn.Module)


MODEL_HISTORY_ATTR = "lightning_dp_history"
"""The LightningModule attribute that carries the model's privacy history (its ledger) between strategies."""


def load_from_checkpoint(cls: type[M], checkpoint_path: str | PathLike[str] | IO[bytes], **kwargs: Any) -> M:
    """``cls.load_from_checkpoint(checkpoint_path, **kwargs)`` for a model trained with
    ``DPStrategy(on_batchnorm="replace")``: its BatchNorm layers are swapped for the same GroupNorm
    (:func:`replace_batchnorm`) after construction and before the weights load, through Lightning's
    ``on_load_checkpoint`` hook. The model carries the checkpoint's privacy ledger, so a later private fit
    continues it (ε counts every release the weights have had). Returns an instance of ``cls`` itself.

    Args:
        cls: the LightningModule class that was trained.
        checkpoint_path: the checkpoint file (a path or an open binary file).
        **kwargs: passed to ``cls.load_from_checkpoint`` (``map_location``, hyperparameter overrides).
    """

    def on_load_checkpoint(self: Any, checkpoint: dict[str, Any]) -> None:
        replace_batchnorm(self)
        if isinstance(checkpoint.get("lightning_dp"), dict):  # the ledger a later private fit continues
            setattr(self, MODEL_HISTORY_ATTR, checkpoint["lightning_dp"])
        cls.on_load_checkpoint(self, checkpoint)  # type: ignore[attr-defined]

    loading = type(
        cls.__name__, (cls,), {"on_load_checkpoint": on_load_checkpoint, "__module__": cls.__module__}
    )
    model: M = loading.load_from_checkpoint(checkpoint_path, **kwargs)  # type: ignore[attr-defined]
    model.__class__ = cls  # the subclass only existed to hook the load; pickling needs the real class
    return model


def check_train_sampler(loader: DataLoader) -> None:
    """Refuse a train loader with its own ``sampler=``: DP-SGD draws its own (Poisson) batches, and its
    accounting holds only for that sampling, so a weighted or custom sampler would be dropped silently.

    ``shuffle=True``/``False`` (RandomSampler, SequentialSampler) and the DistributedSampler Lightning
    inserts under DDP stay silent. A custom ``batch_sampler`` is refused by the strategy (no batch_size).
    """
    sampler: Any = loader.sampler
    if loader.batch_size is None:
        return
    if type(sampler) is DistributedSampler:
        return
    inner = getattr(
        getattr(sampler, "dataset", None), "_sampler", None
    )  # Lightning's DistributedSamplerWrapper
    if isinstance(sampler, DistributedSampler) and inner is not None:
        sampler = inner
    if type(sampler) is SequentialSampler:
        return
    if type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:
        return
    raise DPConfigurationError(
        f"The train DataLoader has its own sampler ({type(sampler).__name__}), which DP training would replace: "
        "the privacy accounting holds only for the strategy's sampling (each example joins a batch "
        "independently, with probability batch_size / N), so class rebalancing by sampling cannot be kept. "
        "Remove sampler=... and weight the loss per example instead (a per-example weight times the "
        "per-example loss keeps per-example clipping valid; see docs/troubleshooting.md)."
    )


def materialize_lazy_layers(module: nn.Module) -> list[str]:
    """Lazy layers (``nn.LazyLinear``, ``nn.LazyConv2d``) have no weights until their first forward, and
    per-example hooks need the layers' final shapes: run the module once on its ``example_input_array``
    (forward only, no gradient), as Lightning's model summary does, or refuse with the fix."""
    lazy = [name for name, p in module.named_parameters() if isinstance(p, UninitializedParameter)]
    if not lazy:
        return []
    example = getattr(module, "example_input_array", None)
    if example is None:
        raise DPConfigurationError(
            f"The parameters {lazy[:8]} are not initialised yet (a lazy layer such as nn.LazyLinear gets its "
            "shape at its first forward), so no per-example gradient path can be set up for them. Set "
            "self.example_input_array to an example batch in the LightningModule's __init__ (lightning-dp "
            "then runs the module once on it before training), call the module once yourself before fit, "
            "or give the layer its input size (nn.Linear)."
        )
    with torch.no_grad():
        if isinstance(example, tuple):
            module(*example)
        elif isinstance(example, dict):
            module(**example)
        else:
            module(example)
    return [f"initialised the lazy layers' parameters {lazy[:8]} from example_input_array"]


def prepare_module(module: nn.Module, on_batchnorm: OnBatchNorm = "raise") -> list[str]:
    """Run every check and fix; returns a list of human-readable notes about what was changed.

    BatchNorm is kept under ``on_batchnorm="raise"``: frozen in eval mode (set at any time before a step, by
    the user or a ``BaseFinetuning`` callback) it is an affine map of each example alone; every step that
    calls it with the batch's statistics is refused before its release (:func:`~lightning_dp.checks.batch_rows.batch_statistics_message`).
    Parameters on the LightningModule itself are covered by their uses (``per_example.capture``)."""
    notes = materialize_lazy_layers(module)
    if on_batchnorm == "replace" and batchnorm_layers(module):
        notes.append(f"replaced BatchNorm with GroupNorm: {replace_batchnorm(module)}")
    if not any(p.requires_grad for p in module.parameters()):
        raise DPConfigurationError("The model has no trainable parameters.")
    check_stateful_layers(module)
    return notes
