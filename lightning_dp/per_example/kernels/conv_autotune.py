"""Which convolution norm method to use for a layer and input shape: a rough cost model, then a timed
choice among the close candidates, cached per shape."""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any, TypeVar

import torch
from torch import Tensor

from lightning_dp.per_example.kernels.certified import KEEP_FACTOR
from lightning_dp.per_example.kernels.conv_methods import (
    CONV_METHODS,
    CONV_NORMS,
    CONV_SUMS,
    MATERIALISING,
    NORMS_ONLY,
    SUM_METHODS,
    ConvLayer,
    ConvMethod,
    SumMethod,
    padded_positions,
    saved_per_example,
)

_forced: ContextVar[ConvMethod | None] = ContextVar("forced_conv_method", default=None)
_forced_sum: ContextVar[SumMethod | None] = ContextVar("forced_conv_sum_method", default=None)
_active: ContextVar[ConvAutotuner | None] = ContextVar("conv_autotuner", default=None)


@contextlib.contextmanager
def _forcing(var: ContextVar[Any], method: str | None, allowed: tuple[str, ...], what: str) -> Iterator[None]:
    if method is not None and method not in allowed:
        raise ValueError(f"{what} must be one of {allowed}, got {method!r}")
    token = var.set(method)
    try:
        yield
    finally:
        var.reset(token)


def force_conv_method(method: ConvMethod | None) -> contextlib.AbstractContextManager[None]:
    """Use one convolution norm method everywhere inside the block (tests, benchmarks)."""
    return _forcing(_forced, method, CONV_METHODS, "conv method")


def force_conv_sum_method(method: SumMethod | None) -> contextlib.AbstractContextManager[None]:
    """Use one clipped-sum method everywhere inside the block (tests, benchmarks)."""
    return _forcing(_forced_sum, method, SUM_METHODS, "conv sum method")


class ConvAutotuner:
    """The convolution norm method per layer and input shape, chosen once and then reused.

    Each :class:`~lightning_dp.per_example.GradientCapture` owns one (no state shared between models,
    runs or tests); the kernels ask the one made current by :meth:`active`.
    """

    def __init__(self) -> None:
        self.choices: dict[tuple[Any, ...], ConvMethod] = {}
        """The timed choice per (layer shape, input shape without the batch, device, dtype)."""
        self.sum_choices: dict[tuple[Any, ...], SumMethod] = {}
        """The same for the clipped sum of a layer whose per-example gradients were not kept."""

    @contextlib.contextmanager
    def active(self) -> Iterator[ConvAutotuner]:
        """Make this the autotuner the convolution kernels use inside the block."""
        token = _active.set(self)
        try:
            yield self
        finally:
            _active.reset(token)

    def method(self, layer: ConvLayer, x: Tensor, backprops: Tensor) -> ConvMethod:
        """The fastest norm method for this layer and input shape within its memory budget, timed once.

        The methods give the same norms (up to fp32 rounding), so the choice is a speed decision under a
        memory cap: the methods that keep B·O·p per-example gradients for the sum ("grouped", "unfold",
        "correlate") are allowed only when those take at most :data:`.certified.KEEP_FACTOR` times what
        the layer's record holds (:func:`saved_per_example`), and "correlate" only when its C/G-fold copy
        of the output gradients fits in the record; where they do not fit, the same methods run for the norms only, a chunk of examples at
        a time (``NORMS_ONLY``); the two Gram methods work a chunk at a time and are always allowed. Of the allowed methods, those within 3× of the cheapest by the rough estimate of
        :func:`_conv_costs` are timed; which wins depends on the hardware (unfold copies are cheap on
        GPUs, grouped convolutions with many groups are not always), hence measured rather than
        modelled. Cached per shape excluding the batch size, which Poisson sampling changes every step.
        """
        if backprops.shape[0] == 0:  # nothing to time on an empty batch
            return "unfold"
        key = _shape_key(layer, x)
        choice = self.choices.get(key)
        if choice is None:
            costs = _conv_costs(layer, x, backprops)
            budget = saved_per_example(x, backprops)
            # kept per-example gradients within the budget; otherwise the same methods, norms only
            for method in MATERIALISING if layer.weight.numel() > KEEP_FACTOR * budget else NORMS_ONLY:
                del costs[method]
            # correlate repeats the output gradients once per input channel of a group
            if "correlate" in costs and layer.in_channels // layer.groups * backprops[0].numel() > budget:
                del costs["correlate"]
            cheapest = min(costs.values())
            runs = {
                m: functools.partial(CONV_NORMS[m], layer, x, backprops)
                for m, cost in costs.items()
                if cost <= 3 * cheapest
            }
            choice = self.choices[key] = runs.popitem()[0] if len(runs) == 1 else _fastest(runs, x.device)
        return choice

    def sum_method(self, layer: ConvLayer, x: Tensor, backprops: Tensor) -> SumMethod:
        """The fastest way to form Σ_i w_i g_i for this layer and input shape, timed once (with unit
        weights) among the methods within 3× of the cheapest by :func:`_sum_costs`."""
        if backprops.shape[0] < 2:  # nothing worth timing
            return "weight-grad"
        key = _shape_key(layer, x)
        choice = self.sum_choices.get(key)
        if choice is None:
            costs = _sum_costs(layer, x, backprops)
            cheapest = min(costs.values())
            weights = torch.ones(backprops.shape[0], device=backprops.device)
            runs = {
                m: functools.partial(CONV_SUMS[m], layer, x, backprops, weights)
                for m, cost in costs.items()
                if cost <= 3 * cheapest
            }
            choice = self.sum_choices[key] = runs.popitem()[0] if len(runs) == 1 else _fastest(runs, x.device)
        return choice


def _shape_key(layer: ConvLayer, x: Tensor) -> tuple[Any, ...]:
    """What a timed choice depends on: the layer's shape and the input's without the batch size."""
    return (
        type(layer), layer.weight.shape, layer.stride, layer.padding, layer.dilation, layer.groups,
        tuple(x.shape[1:]), x.device.type, x.dtype,
    )  # fmt: skip


COPY_COST = 40
"""Multiply-adds one copied or gathered float costs, roughly (CPU, one thread: a ``bmm`` does about
40 multiply-adds in the time a patch copy moves one float)."""
STRIDED_ADD_COST = 100
"""Same for one element of the position Gram's strided accumulation (small inner dimensions)."""


def _conv_costs(layer: ConvLayer, x: Tensor, backprops: Tensor) -> dict[ConvMethod, int]:
    """Rough cost per example of each norm method, in multiply-adds (copies weighted as above)."""
    G, L, K = layer.groups, math.prod(backprops.shape[2:]), math.prod(layer.kernel_size)
    p, o = layer.weight[0].numel(), layer.out_channels // G
    per_example = G * L * p * o
    patches = COPY_COST * G * L * p
    # XᵀX over the unpadded input when zero padding is added to M afterwards
    positions = math.prod(x.shape[2:]) if layer.padding_mode == "zeros" else padded_positions(layer, x)
    cg = layer.in_channels // G
    costs: dict[ConvMethod, int] = {
        "grouped": per_example,
        "correlate": per_example + (COPY_COST * cg * G * L * o if cg > 1 else 0),  # repeated δ
        "unfold": per_example + patches,
        "gram": G * L * L * (p + o) + patches,
        "position-gram": positions**2 * layer.in_channels + G * L * L * (STRIDED_ADD_COST * K + o),
    }
    costs.update({name: costs[method] for name, method in NORMS_ONLY.items()})
    return costs


def _sum_costs(layer: ConvLayer, x: Tensor, backprops: Tensor) -> dict[SumMethod, int]:
    """Rough cost per example of each clipped-sum method, in multiply-adds (see :func:`_conv_costs`)."""
    norms = _conv_costs(layer, x, backprops)
    G, L = layer.groups, math.prod(backprops.shape[2:])
    reduction = G * L * layer.weight[0].numel() * (layer.out_channels // G)
    return {
        "weight-grad": reduction,
        "unfold-mm": norms["unfold"],
        "grouped-samples": norms["grouped"] + layer.weight.numel(),
        "correlate-samples": norms["correlate"] + layer.weight.numel(),
    }


def conv_sum_method(layer: ConvLayer, x: Tensor, backprops: Tensor) -> SumMethod:
    """The method forced by :func:`force_conv_sum_method`, else the current autotuner's clipped-sum method
    (a fresh autotuner outside any ``active`` block)."""
    forced = _forced_sum.get()
    if forced is not None:
        return forced
    return (_active.get() or ConvAutotuner()).sum_method(layer, x, backprops)


def conv_method(layer: ConvLayer, x: Tensor, backprops: Tensor) -> ConvMethod:
    """The method forced by :func:`force_conv_method`, else the current autotuner's choice (a fresh one,
    which keeps nothing, outside any :meth:`ConvAutotuner.active` block)."""
    forced = _forced.get()
    if forced is not None:
        return forced
    return (_active.get() or ConvAutotuner()).method(layer, x, backprops)


M = TypeVar("M", bound=str)


def _fastest(runs: Mapping[M, Callable[[], Any]], device: torch.device, rounds: int = 3) -> M:
    """The run with the best wall-clock time: each warmed up once, then timed in interleaved rounds
    (so a slow moment of the machine does not decide the choice for the whole training)."""
    best = dict.fromkeys(runs, math.inf)
    # this thread's CPU time on a CPU: a busy machine's other processes do not decide the choice
    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    for fn in runs.values():
        fn()
    for _ in range(rounds):
        for method, fn in runs.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = clock()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best[method] = min(best[method], clock() - start)
    return min(best, key=best.__getitem__)
