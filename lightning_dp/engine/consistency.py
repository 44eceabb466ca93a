"""The engine's two refusals of a model whose per-example gradients would not be each example's own.

Before the first batch, a trainable layer built sequence-first (its tensors are [time, batch, ...]); at
the first release, a parameter whose per-example gradients do not add up to autograd's gradient (part of
its gradient comes through a path the hooks do not see, which would be released without clipping)."""

from __future__ import annotations

import math

from torch import Tensor, nn

from lightning_dp.core.errors import BatchDimensionError
from lightning_dp.per_example.recurrent import SWAPS

CONSISTENCY_RTOL = 1e-2
"""Relative gap between a parameter's summed per-example gradients and autograd's gradient above which
part of its gradient is missed (rounding in fp32, and in the tf32/bf16 a run may use, stays far below)."""

CONSISTENCY_FLOOR = 1e-3
"""Gaps are relative to a parameter's own gradient plus this fraction of the whole gradient's norm."""


def refuse_sequence_first(root: nn.Module) -> None:
    """Refuse trainable layers built sequence-first (``batch_first=False``) that no exact path covers.

    Their inputs and outputs are [T, B, ...], so the hooks would take time steps for examples; a size
    check cannot see it when T equals the batch size, this check sees it before the first batch. The
    recurrent and attention layers that :mod:`lightning_dp.per_example.recurrent` swaps in place (exactly
    ``nn.RNN``/``LSTM``/``GRU``/``MultiheadAttention``/``Transformer*Layer``) put the batch first
    themselves; subclasses of them, whose forward may differ, are not swapped and stay refused."""
    exact = tuple(SWAPS)
    for name, module in root.named_modules():
        if type(module) in exact or not any(p.requires_grad for p in module.parameters(recurse=False)):
            continue
        if getattr(module, "batch_first", None) is False:
            raise BatchDimensionError(
                f"Layer {name or '<root>'!r} ({type(module).__name__}) is built with batch_first=False (PyTorch's "
                "default): its tensors are [time, batch, ...], and per-example clipping takes dimension 0 as "
                "the examples, so it would clip each time step instead of each example. Build it with "
                "batch_first=True and feed it [batch, time, ...] tensors."
            )


def missed_gradients(
    params: list[nn.Parameter], totals: list[Tensor], scale: float, names: dict[nn.Parameter, str]
) -> list[tuple[str, float]]:
    """The parameters (name, relative gap) whose summed per-example gradients ``totals`` (÷ ``scale``, the
    loss's normalisation) miss part of autograd's gradient ``p.grad``; empty when every one adds up."""
    pairs = [
        (p, total / scale, p.grad.detach().float())
        for p, total in zip(params, totals, strict=True)
        if p.grad is not None
    ]
    # A parameter whose gradient cancels over the batch (a last bias under a translation-invariant loss)
    # has rounding far above its own tiny norm: gaps are measured against a floor of the whole gradient.
    whole = math.sqrt(sum(float(ref.square().sum()) for _, _, ref in pairs))
    gaps: list[tuple[str, float]] = []
    for p, mean, reference in pairs:
        scale_norm = max(float(reference.norm()), float(mean.norm())) + CONSISTENCY_FLOOR * whole
        err = float((mean - reference).norm()) / (scale_norm + 1e-12)
        if math.isfinite(err) and err > CONSISTENCY_RTOL:
            gaps.append((names.get(p, "?"), err))
    return gaps
