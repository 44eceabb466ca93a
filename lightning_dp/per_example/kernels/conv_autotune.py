"""Which methods a convolution uses for its per-example norms and its clipped sum: a calibrated cost
model, a function of the layer's geometry, the input's shape without the batch, the dtype and the
device type only. Every run, on every machine of a kind, picks the same methods (no timing decides);
each choice is announced once and kept for the privacy report."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_dp.per_example.kernels.certified import KEEP_FACTOR
from lightning_dp.per_example.kernels.conv_methods import (
    CONV_METHODS,
    MATERIALISING,
    NORMS_ONLY,
    SUM_METHODS,
    ConvLayer,
    ConvMethod,
    LiveTaps,
    SumMethod,
    live_taps,
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


# --------------------------------------------------------------------------------------------------
# The cost model
# --------------------------------------------------------------------------------------------------

Features = tuple[float, float, float, float, float]
"""Per example: the method's multiply-adds, a second work term (small-map inefficiency, copies or strided
adds, per method), floats moved, groups (per-group launch cost) and 1."""


def features(method: ConvMethod | SumMethod, layer: ConvLayer, x_shape: Any, out_shape: Any) -> Features:
    """What one example costs ``method`` on ``layer`` with input [C, *spatial] and output [O, *spatial]
    (the core convolution of :class:`.conv_methods.LiveTaps` where some offsets are dead)."""
    G, L, K = layer.groups, math.prod(out_shape[1:]), math.prod(layer.kernel_size)
    cg, o = layer.in_channels // G, layer.out_channels // G
    p = cg * K
    positions = math.prod(x_shape[1:])
    padded = math.prod(n + sum(pair) for n, pair in zip(x_shape[1:], _pad_pairs(layer), strict=True))
    x_n, d_n, w_n = layer.in_channels * positions, layer.out_channels * L, layer.out_channels * p
    per = G * L * p * o  # the per-example weight gradient's multiply-adds
    base: str = NORMS_ONLY.get(method, method)  # type: ignore[arg-type]
    if method == "weight-grad":
        return (per, per / L, x_n + d_n, G, 1)
    if method == "unfold-mm":
        return (per, G * L * p, x_n + d_n, G, 1)
    if base in ("grouped", "grouped-samples"):
        return (per, per / L, x_n + d_n + w_n, G, 1)
    if base in ("correlate", "correlate-samples"):
        return (per, cg * d_n if cg > 1 else 0, x_n + d_n + w_n, layer.in_channels, 1)
    if base == "unfold":
        return (per, G * L * p, d_n + w_n, G, 1)
    if base == "gram":
        return (G * L * L * (p + o), G * L * p, G * L * L, G, 1)
    assert base == "position-gram"
    return (positions**2 * layer.in_channels + G * L * L * o, K * G * L * L, G * padded**2, G, 1)


def _pad_pairs(layer: ConvLayer) -> list[tuple[int, int]]:
    """(before, after) padding per spatial dimension, first dimension first."""
    pads = layer._reversed_padding_repeated_twice
    n = len(layer.kernel_size)
    return [(pads[2 * (n - 1 - i)], pads[2 * (n - 1 - i) + 1]) for i in range(n)]


CPU_COSTS: dict[str, Features] = {
    "gram": (2.14e-11, 2.32e-09, 1.07e-08, 3.10e-07, 4.42e-06),
    "position-gram": (4.25e-11, 1.55e-09, 1.33e-09, 8.22e-06, 0.0),
    "unfold": (3.12e-11, 1.77e-09, 6.37e-10, 1.79e-07, 0.0),
    "grouped": (3.28e-11, 5.68e-10, 7.95e-10, 8.68e-07, 1.52e-06),
    "correlate": (4.84e-11, 2.00e-09, 0.0, 2.85e-07, 2.48e-06),
    "unfold-norms": (3.03e-11, 1.92e-09, 7.99e-10, 5.30e-07, 3.18e-06),
    "grouped-norms": (2.69e-11, 4.45e-10, 1.24e-09, 1.08e-06, 1.06e-05),
    "correlate-norms": (6.68e-11, 7.18e-10, 1.95e-09, 1.81e-07, 7.14e-07),
    "weight-grad": (2.42e-11, 9.72e-11, 1.19e-09, 9.58e-07, 7.68e-07),
    "unfold-mm": (2.79e-11, 1.77e-09, 1.34e-09, 3.35e-07, 0.0),
    "grouped-samples": (4.43e-11, 0.0, 4.64e-11, 7.64e-07, 2.24e-05),
    "correlate-samples": (1.41e-10, 6.07e-11, 0.0, 0.0, 4.60e-06),
}
"""Seconds per unit of each :func:`features` term, fitted by ``bench/conv_costs.py --all --fit``
(non-negative least squares on relative error) to the thread CPU time of every method on the 70
convolution shapes of the benchmark models at B = 64, one CPU thread, fp32 (AMD EPYC, AVX-512). On those
shapes its norm method is within 10 % of the fastest allowed one on 54 and its sum method on 62 (bench/README)."""

GPU_COSTS: dict[str, Features] = {
    method: (6.7e-14, 0.0, 2.0e-12, 1.0e-8, 1.6e-7) for method in (*CONV_METHODS, *SUM_METHODS)
}
"""An uncalibrated roofline for CUDA (no GPU was lent to calibrate one): 15·10¹² fp32 multiply-adds/s,
2·10¹² bytes/s, a 10 µs launch per call amortised over 64 examples; ``bench/gpu_check.py`` reports the
methods it picks so that a GPU visit can fit it as ``bench/conv_costs.py`` fits the CPU's."""


def predicted_cost(method: ConvMethod | SumMethod, layer: ConvLayer, x: Tensor, backprops: Tensor) -> float:
    """Seconds per example that the cost model of ``x``'s device type predicts for ``method``."""
    table = GPU_COSTS if x.device.type == "cuda" else CPU_COSTS
    terms = features(method, layer, x.shape[1:], backprops.shape[1:])
    return math.fsum(c * f for c, f in zip(table[method], terms, strict=True))


@dataclass(frozen=True)
class ConvPlan:
    """How one convolution shape forms its norms and, when its per-example gradients are not kept, its
    clipped sum; ``live`` crops a kernel whose offsets partly never touch the input."""

    norms: ConvMethod
    sum: SumMethod
    live: LiveTaps | None = None


def _candidates(
    layer: ConvLayer, core: ConvLayer, x: Tensor, backprops: Tensor, cropped: bool
) -> list[ConvMethod]:
    """The norm methods the memory budget allows, in :data:`CONV_METHODS` order.

    The methods that keep B·O·p per-example gradients for the sum ("grouped", "unfold", "correlate") are
    allowed only when those take at most :data:`.certified.KEEP_FACTOR` times what the layer's record
    holds (:func:`saved_per_example`), and not for a cropped kernel (its cache would need the dead
    offsets' zeros); otherwise the same methods run for the norms only, a chunk at a time. "correlate"
    also needs its C/G-fold copy of the output gradients to fit in the record, and more than one output
    position. The Gram methods work a chunk at a time and are always allowed.
    """
    budget = saved_per_example(x, backprops)
    keep = not cropped and layer.weight.numel() <= KEEP_FACTOR * budget
    allowed = [m for m in CONV_METHODS if (m not in NORMS_ONLY if keep else m not in MATERIALISING)]
    one_position = (
        math.prod(backprops.shape[2:]) == 1
    )  # a 1×1 correlation: B·C groups, 100× slower (measured)
    if one_position or core.in_channels // core.groups * backprops[0].numel() > budget:
        allowed = [m for m in allowed if NORMS_ONLY.get(m, m) != "correlate"]
    return allowed


def _cheapest(methods: Any, layer: ConvLayer, x: Tensor, backprops: Tensor) -> Any:
    """The method of least predicted cost (ties: the first listed)."""
    costs = [predicted_cost(m, layer, x, backprops) for m in methods]
    return methods[costs.index(min(costs))]


class ConvAutotuner:
    """The :class:`ConvPlan` per convolution shape, chosen once by the cost model and then reused.

    Each :class:`~lightning_dp.per_example.GradientCapture` owns one (no state shared between models,
    runs or tests); the kernels ask the one made current by :meth:`active`.
    """

    def __init__(self) -> None:
        self.choices: dict[tuple[Any, ...], ConvPlan] = {}
        """The plan per (layer shape, input shape without the batch, device type, dtype)."""
        self.announce: Callable[[str], None] | None = None
        """Called with one line per new choice (the strategy prints it; nothing by default)."""

    @contextlib.contextmanager
    def active(self) -> Iterator[ConvAutotuner]:
        """Make this the autotuner the convolution kernels use inside the block."""
        token = _active.set(self)
        try:
            yield self
        finally:
            _active.reset(token)

    def plan(self, layer: ConvLayer, x: Tensor, backprops: Tensor) -> ConvPlan:
        """The plan for this layer and input shape: the norm method of least predicted cost among those
        the memory budget allows, and the cheapest clipped-sum method. Not a function of the batch size
        (Poisson sampling changes it every step, and a choice that depended on it would reveal it)."""
        if backprops.shape[0] == 0:  # an empty batch: nothing to choose from (and nothing kept)
            return ConvPlan("unfold", "weight-grad")
        key = _shape_key(layer, x)
        choice = self.choices.get(key)
        if choice is None:
            live = live_taps(layer, x[:1], backprops[:1])
            core, cx = (layer, x[:1]) if live is None else (live.core, live.input(x[:1]))
            d = backprops[:1]
            norms = _cheapest(_candidates(layer, core, x, backprops, live is not None), core, cx, d)
            total = _cheapest(list(SUM_METHODS), core, cx, d)
            choice = self.choices[key] = ConvPlan(norms, total, live)
            if self.announce is not None:
                self.announce(describe(key, choice))
        return choice

    def report(self) -> list[dict[str, Any]]:
        """Every choice so far, as plain values (the privacy report's ``conv_methods``)."""
        return [
            {"layer": _layer_text(key), "input": list(key[6]), "device": key[7], "norms": plan.norms,
             "sum": plan.sum if plan.norms not in MATERIALISING else "kept per-example gradients",
             "live_offsets": None if plan.live is None else [list(r) for r in plan.live.ranges]}
            for key, plan in self.choices.items()
        ]  # fmt: skip


def _shape_key(layer: ConvLayer, x: Tensor) -> tuple[Any, ...]:
    """What a choice depends on: the layer's shape and the input's without the batch size."""
    return (
        type(layer), layer.weight.shape, layer.stride, layer.padding, layer.dilation, layer.groups,
        tuple(x.shape[1:]), x.device.type, x.dtype,
    )  # fmt: skip


def _layer_text(key: tuple[Any, ...]) -> str:
    kind, shape, stride, padding, dilation, groups = key[:6]
    kernel = "×".join(map(str, shape[2:]))
    extra = "".join(
        f", {name} {value}" for name, value, plain in
        (("stride", stride, (1,) * len(stride)), ("padding", padding, None), ("dilation", dilation, (1,) * len(dilation)))
        if value != plain and value not in (0, (0,) * len(stride))
    )  # fmt: skip
    group_text = f", groups {groups}" if groups > 1 else ""
    return f"{kind.__name__}({shape[1] * groups}→{shape[0]}, {kernel}{extra}{group_text})"


def describe(key: tuple[Any, ...], plan: ConvPlan) -> str:
    """One line: the layer, its input and the methods the cost model chose for it."""
    sizes = "×".join(map(str, key[6]))
    kept = plan.norms in MATERIALISING
    total = "the kept per-example gradients" if kept else plan.sum
    crop = "" if plan.live is None else f", live offsets {[list(r) for r in plan.live.ranges]}"
    return f"convolution {_layer_text(key)} on {sizes} ({key[7]}): norms {plan.norms}, sum {total}{crop}"


def conv_plan(layer: ConvLayer, x: Tensor, backprops: Tensor) -> ConvPlan:
    """The current autotuner's plan (a fresh autotuner's outside any ``active`` block), with the methods
    forced by :func:`force_conv_method` and :func:`force_conv_sum_method` in place of its own; a
    materialising method forced on a cropped kernel runs for the norms only (its cache would lack the
    dead offsets)."""
    plan = (_active.get() or ConvAutotuner()).plan(layer, x, backprops)
    norms, total = _forced.get() or plan.norms, _forced_sum.get() or plan.sum
    if plan.live is not None and norms in MATERIALISING:
        norms = next(name for name, base in NORMS_ONLY.items() if base == norms)
    if (norms, total) == (plan.norms, plan.sum):
        return plan
    return ConvPlan(norms, total, plan.live)
