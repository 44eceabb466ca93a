"""Per-example gradients from one ordinary backward pass, using Opacus's per-layer formulas.

A forward hook keeps each layer's input; a hook on the layer's *output tensor* receives the gradient
of that output during backward, and Opacus's registered grad sampler (or its functorch fallback for
unknown layers) turns the pair into per-example gradients. Tensor hooks, unlike module full-backward
hooks, survive in-place operations on a layer's output (torchvision's ResNet ``out += identity`` and
``ReLU(inplace=True)``), and leave ``state_dict`` keys untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from opacus.grad_sample import GradSampleHooks
from opacus.grad_sample.functorch import ft_compute_per_sample_gradient
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

GradSampler = Callable[[nn.Module, list[Tensor], Tensor], dict[nn.Parameter, Tensor]]


def _has_own_trainable_params(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters(recurse=False))


def trainable_layers(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Layers that own trainable parameters; a layer with no known formula covers its whole subtree."""

    def visit(prefix: str, module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        if _has_own_trainable_params(module):
            yield prefix, module
            if type(module) not in GradSampleHooks.GRAD_SAMPLERS:
                return
        for name, child in module.named_children():
            yield from visit(f"{prefix}.{name}" if prefix else name, child)

    yield from visit("", root)


def layer_method(module: nn.Module) -> str:
    """How a layer's per-example gradients are computed: 'formula' (Opacus sampler) or 'functorch'."""
    return "formula" if type(module) in GradSampleHooks.GRAD_SAMPLERS else "functorch"


class PerSampleGradients:
    """Hooks on every trainable layer of ``root`` that collect per-example gradients per parameter.

    ``loss_reduction='mean'`` means the loss the user backpropagates is a mean over the batch, so
    each layer's output gradient is multiplied by the batch size to get per-example gradients.
    """

    def __init__(self, root: nn.Module, loss_reduction: str = "mean") -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}.")
        self.loss_reduction = loss_reduction
        self.enabled = True
        self.grad_samples: dict[nn.Parameter, Tensor] = {}
        self.batch_size: int | None = None
        self.layers = list(trainable_layers(root))
        self._handles: list[RemovableHandle] = [
            module.register_forward_hook(self._capture) for _, module in self.layers
        ]
        self.params = [p for _, m in self.layers for p in m.parameters() if p.requires_grad]

    def _capture(self, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        if not (self.enabled and module.training and torch.is_grad_enabled()):
            return
        if not isinstance(output, Tensor) or not output.requires_grad:
            return
        activations = [t.detach() if isinstance(t, Tensor) else t for t in inputs]
        output.register_hook(lambda grad: self._accumulate(module, activations, grad))

    def _accumulate(self, module: nn.Module, activations: list[Any], grad: Tensor) -> None:
        batch = grad.shape[0]
        backprops = grad.detach() * batch if self.loss_reduction == "mean" else grad.detach()
        sampler: GradSampler = GradSampleHooks.GRAD_SAMPLERS.get(type(module), ft_compute_per_sample_gradient)
        for param, sample in sampler(module, activations, backprops).items():
            if not param.requires_grad:
                continue
            previous = self.grad_samples.get(param)
            self.grad_samples[param] = sample if previous is None else previous + sample
        self.batch_size = batch

    def collect(self) -> tuple[list[Tensor], int]:
        """Per-example gradients in ``self.params`` order (zeros for unused params) and the batch size."""
        batch = self.batch_size or 0
        out = []
        for p in self.params:
            sample = self.grad_samples.get(p)
            if sample is None:
                sample = torch.zeros((batch, *p.shape), device=p.device, dtype=torch.float32)
            elif sample.shape[0] != batch:
                raise RuntimeError(
                    "Per-example gradients disagree on the batch size "
                    f"({sample.shape[0]} vs {batch}): every layer must see the batch on dimension 0."
                )
            out.append(sample)
        return out, batch

    def clear(self) -> None:
        self.grad_samples = {}
        self.batch_size = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.clear()
