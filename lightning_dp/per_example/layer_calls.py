"""What one layer call of a batch's backward left (:class:`LayerCall`): the layer's inputs and raw output
gradient, held until the step's clipped sum, its per-example squared norms and the per-example gradients the
kernels materialised on the way; and :class:`TiedCalls`, an Embedding call and a Linear call that share their
weight, priced by one joint kernel (:func:`tie` pairs them). :mod:`.gradients` holds a batch's records."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from torch import Tensor, nn

from lightning_dp.per_example import kernels
from lightning_dp.per_example.kernels.conv_autotune import ConvAutotuner
from lightning_dp.per_example.kernels.tied import tied_sq_norms, tied_weighted
from lightning_dp.per_example.materialized import add_samples, grad_sampler


@dataclass(eq=False)
class LayerCall:
    """One call of a fast-path layer: its inputs and raw output gradient until they are released.

    The backward hook computes the per-example squared norms at once (``norms``). When the kernels
    materialised every per-example gradient of the layer on the way (``cache``, [B, *param.shape]
    each, no larger than the inputs and output gradient they come from), the clipped sum needs
    nothing else, so the inputs and output gradient are dropped there and then (``released``): the
    backward pass frees them as it would in a plain step. Norms and cache are raw, i.e. per-example
    values are ``scale`` (resp. ``scale²``) times them.
    """

    module: nn.Module
    activations: list[Any]
    backprops: Tensor | None
    norms: dict[nn.Parameter, Tensor] | None = None
    cache: kernels.Cache = field(default_factory=dict)
    spent: bool = False
    """Everything but the norms dropped after the step's clipped sum (see ``release_on_sum``)."""
    tuner: ConvAutotuner | None = None
    """The capture's convolution autotuner, current while the norms are computed."""

    @property
    def released(self) -> bool:
        return self.backprops is None

    def spend(self) -> None:
        """Drop the inputs, output gradient and cached per-example gradients: the sum is done."""
        self.activations.clear()  # in place: the backward hook holds the same list
        self.backprops, self.cache, self.spent = None, {}, True

    def _check_unspent(self) -> None:
        if self.spent:
            raise RuntimeError(
                f"The per-example gradients of {type(self.module).__name__} were freed after the step's "
                "clipped sum; a clipping slot must take one weighted sum per step."
            )

    def sq_norms(self) -> dict[nn.Parameter, Tensor]:
        """Raw per-example squared norms of each parameter (computed once, cached materialisations kept)."""
        if self.norms is None:
            self._check_unspent()
            assert self.backprops is not None
            with self.tuner.active() if self.tuner is not None else contextlib.nullcontext():
                self.norms = kernels.sq_norms(self.module, self.activations, self.backprops, self.cache)
        return self.norms

    def release_if_cached(self, params: Sequence[nn.Parameter]) -> None:
        """Drop the inputs and output gradient when ``cache`` holds every one of ``params``."""
        if all(p in self.cache for p in params):
            self.activations.clear()  # in place: the backward hook holds the same list
            self.backprops = None

    def samples(self, scale: float) -> dict[nn.Parameter, Tensor]:
        """The layer's per-example gradients [B, *shape] (scaled), from the cache or Opacus's formula."""
        self._check_unspent()
        if self.released:
            return {p: g * scale for p, g in self.cache.items()}
        assert self.backprops is not None
        return grad_sampler(self.module)(self.module, self.activations, self.backprops * scale)

    def take(self, rows: Tensor) -> LayerCall:
        """The same record restricted to batch rows ``rows``."""
        self._check_unspent()
        return LayerCall(
            self.module,
            [_take(a, rows) for a in self.activations],
            None if self.backprops is None else _take(self.backprops, rows),
            None if self.norms is None else {p: _take(v, rows) for p, v in self.norms.items()},
            {p: _take(g, rows) for p, g in self.cache.items()},
            tuner=self.tuner,
        )


@dataclass(eq=False)
class TiedCalls:
    """An Embedding call and a Linear call that share their weight (tied input and output embeddings):
    one record whose norms include the cross term (:mod:`.kernels.tied`), instead of materialising both.

    To a clipping that reads ``layers()`` it is a materialised entry (``released``): its ``samples``
    are the two calls' per-example gradients summed.
    """

    embedding: LayerCall
    linear: LayerCall
    norms: dict[nn.Parameter, Tensor] | None = None
    released = True
    tuner = None

    @property
    def module(self) -> nn.Module:
        return self.linear.module

    @property
    def weight(self) -> nn.Parameter:
        return cast(nn.Parameter, self.linear.module.weight)

    def _calls(self) -> tuple[kernels.KernelCall, kernels.KernelCall]:
        self.embedding._check_unspent()
        self.linear._check_unspent()
        calls = []
        for call in (self.embedding, self.linear):
            assert call.backprops is not None
            calls.append(kernels.KernelCall(call.module, call.activations, call.backprops))
        return calls[0], calls[1]

    def sq_norms(self) -> dict[nn.Parameter, Tensor]:
        if self.norms is None:
            self.norms = {self.weight: tied_sq_norms(*self._calls())}
        return self.norms

    def weighted(self, weights: Tensor) -> dict[nn.Parameter, Tensor]:
        return {self.weight: tied_weighted(*self._calls(), weights)}

    def samples(self, scale: float) -> dict[nn.Parameter, Tensor]:
        out: dict[nn.Parameter, Tensor] = {}
        add_samples(out, self.embedding.samples(scale))
        add_samples(out, self.linear.samples(scale))
        return out

    def spend(self) -> None:
        self.embedding.spend()
        self.linear.spend()

    def take(self, rows: Tensor) -> TiedCalls:
        return TiedCalls(
            self.embedding.take(rows),
            self.linear.take(rows),
            None if self.norms is None else {p: _take(v, rows) for p, v in self.norms.items()},
        )


def tie(
    records: Sequence[LayerCall], uses: dict[nn.Parameter, int]
) -> tuple[list[TiedCalls], list[LayerCall]]:
    """Pair the records of shared parameters that a joint kernel covers (one Embedding call and one Linear
    call sharing exactly the weight, nothing else shared); return (the pairs, the records left over,
    which are materialised). ``uses``: calls per parameter over the whole batch."""
    by_weight: dict[nn.Parameter, list[LayerCall]] = {}
    for record in records:
        weight = getattr(record.module, "weight", None)
        if isinstance(weight, nn.Parameter):
            by_weight.setdefault(weight, []).append(record)
    pairs: list[TiedCalls] = []
    paired: set[int] = set()
    for weight, group in by_weight.items():
        emb = [r for r in group if type(r.module) is nn.Embedding and kernels.is_supported(r.module)]
        lin = [r for r in group if isinstance(r.module, nn.Linear) and _linear_kernels(r.module)]
        if len(group) != 2 or len(emb) != 1 or len(lin) != 1 or uses.get(weight) != 2:
            continue
        others = [p for r in group for p in r.module.parameters() if p is not weight and p.requires_grad]
        if others or any(r.released or r.spent for r in group):
            continue
        pairs.append(TiedCalls(emb[0], lin[0]))
        paired.update(id(r) for r in group)
    return pairs, [r for r in records if id(r) not in paired]


def _linear_kernels(layer: nn.Module) -> bool:
    """Whether ``layer`` is on the Linear kernels (nn.Linear and the Linear parts of swapped layers)."""
    found = kernels.FAST_CLIPPERS.get(type(layer))
    return found is not None and found == kernels.FAST_CLIPPERS[nn.Linear]


def _take(value: Any, rows: Tensor) -> Any:
    """Rows ``rows`` of a batch-first recorded input (non-tensor inputs pass through)."""
    return value.index_select(0, rows.to(value.device)) if isinstance(value, Tensor) else value
