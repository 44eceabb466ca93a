"""Which modules the capture hooks, and how a hooked call's inputs are read.

A module is hooked when it holds parameters directly (each covers only its own), so that every parameter
has exactly one holder whose calls give its per-example gradients; a call's inputs are put in the order of
the layer's ``forward`` so that the per-layer formulas read them whichever way the user passed them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.per_example import recurrent
from lightning_dp.per_example.materialized import direct_params
from lightning_dp.per_example.reparametrized import is_parametrized


def trainable_layers(root: nn.Module, trainable: bool = True) -> Iterator[tuple[str, nn.Module]]:
    """Every module that holds trainable parameters directly (or the parts of a swapped recurrent or
    attention layer, see ``recurrent``); each covers only its own parameters. ``trainable=False``: every
    module holding parameters, frozen ones too (any of them may be unfrozen during training)."""

    def visit(prefix: str, module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        parts = recurrent.parts_of(module)
        if parts is not None:
            for name, part in parts:
                yield f"{prefix}.{name}" if prefix else name, part
        elif direct_params(module, trainable) and not (module is root and steps_itself(root)):
            yield prefix, module
        for name, child in module.named_children():
            if name == "parametrizations" and is_parametrized(module):
                continue  # the parametrized layer owns its originals (``direct_params``)
            yield from visit(f"{prefix}.{name}" if prefix else name, child)

    yield from visit("", root)


def steps_itself(root: nn.Module) -> bool:
    """A LightningModule (it has ``training_step``): its own parameters are read in the step, not in one
    forward, so they are covered by their uses (``uses``), never by recomputing the module per example."""
    return callable(getattr(type(root), "training_step", None))


def unique_layers(layers: Iterator[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Each layer once, under the first name it is reached by."""
    seen: set[int] = set()
    out = []
    for name, module in layers:
        if id(module) not in seen:
            seen.add(id(module))
            out.append((name, module))
    return out


def expands_params(module: nn.Module, trainable: bool = True) -> bool:
    """A container whose own parameters all have a leading dimension of 1 (ViT's ``cls_token`` and
    ``pos_embed``): during its forward they are per-example views (``broadcast``), used where they line up
    with the batch; a call with any other use is recomputed per example instead."""
    own = direct_params(module, trainable)
    return bool(own) and all(p.dim() > 0 and p.shape[0] == 1 for _, p in own)


def is_opacus_rnn(module: nn.Module) -> bool:
    """Opacus's own DPRNN/DPGRU/DPLSTM (made of per-step linear layers, not swapped by ``recurrent``)."""
    try:
        from opacus.layers.dp_rnn import DPRNNBase
    except ImportError:  # pragma: no cover - opacus is a dependency
        return False
    return isinstance(module, DPRNNBase)


@functools.cache
def _signature(cls: type[nn.Module]) -> inspect.Signature:
    return inspect.signature(cls.forward)


def positional(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """A call's inputs in the order of the layer's ``forward`` parameters (keywords placed by name)."""
    signature = _signature(type(module))  # type: ignore[arg-type]
    try:
        bound = signature.bind(module, *args, **kwargs)
    except TypeError:
        return (*args, *kwargs.values())
    names = list(signature.parameters)
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values()):
        return tuple(bound.arguments.values())[1:]
    # an argument skipped before a keyword one keeps its place with its default
    # (``bag(x, per_sample_weights=w)``: offsets=None, so the weights stay third)
    last = max(names.index(name) for name in bound.arguments)
    return tuple(
        bound.arguments[name] if name in bound.arguments else signature.parameters[name].default
        for name in names[1 : last + 1]
    )


def refuse_packed(name: str, module: nn.Module, args: tuple[Any, ...]) -> None:
    """Opacus's DPRNN layers run a packed sequence one time step at a time on fewer rows each step, sorted
    by length: rows that cannot be matched to the batch's examples."""
    if args and isinstance(args[0], nn.utils.rnn.PackedSequence) and torch.is_grad_enabled():
        raise DPConfigurationError(
            f"Layer {name or '<root>'!r} ({type(module).__name__}, Opacus's own recurrent layer) is called on a "
            "PackedSequence: it runs each time step on the sequences still running, sorted by length, so its "
            "calls' rows are not the batch's examples. Use torch.nn's own layer (nn.LSTM, nn.GRU, nn.RNN), "
            "which lightning-dp swaps for an exact equivalent that takes packed sequences "
            "(pack_padded_sequence(..., enforce_sorted=False)), or pass DPLSTM padded [batch, time, ...] tensors."
        )
