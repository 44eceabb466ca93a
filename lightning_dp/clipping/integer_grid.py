"""The integer grid of secure noise (Kairouz, Liu & Steinke 2021): clip, scale, round, sum exactly in int64.

Each example's clipped gradient g (‖g‖ ≤ C) is scaled to grid units by 1/γ, γ = 2sC/√d, and rounded to the
nearest integer in every coordinate. The rounded vector's norm is at most C/γ + √d/2 = (√d/2s)(1 + s) grid
units, i.e. C(1 + s) in gradient units: that is the sum's sensitivity Δ (deterministic rounding,
C' = C + γ√d/2).
The sum over examples is computed in int64, where addition is exact and associative, so the released sum
does not depend on the order, the chunking or the number of ranks it was added in.

The norms that set the clip factor are computed from the very values that are rounded (materialised per
layer), so the bound holds for what is released, not for a formula's estimate of it; where the gradients are
materialised a second time, each example's scaled norm is measured again before anything is released. The
arithmetic is fp32 (fp64 past 2²² grid units per clip bound), whose rounding the margin in Δ covers, and the
rounded integers are summed exactly (chunks of rows exactly in the working dtype, the chunks in int64). The cost is materialising the per-example gradients (twice when
they do not fit ``KEEP_BYTES``), which the fast path avoids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from lightning_dp.accounting.discrete_gaussian import NORM_MARGIN, IntegerGrid
from lightning_dp.per_example import PerExampleGradients
from lightning_dp.slots import Clipping, StepContext

__all__ = ["GridClipping", "IntegerGrid"]

_EXACT_FP32 = 2.0**22
"""Grid units per clip bound below which fp32 holds every scaled coordinate and its rounding exactly."""

KEEP_BYTES = 64 << 20
"""Per-example gradients are held between the norm pass and the rounding pass while they take at most this
many bytes, or twice the largest layer's (the peak of materialising one layer at a time at most doubles);
beyond it each layer's are materialised again for the rounding (twice the work, no more memory)."""


class GridClipping(Clipping):
    """Flat L2 clipping at C onto :class:`IntegerGrid` ``grid``, summed exactly in int64 (secure noise).

    ``clip_and_sum`` returns int64 sums in grid units; ``sensitivity`` is Δ in grid units; ``finalize``
    turns the noisy integers into gradients (× γ, ÷ the public expected batch). Built by the strategy from
    :class:`~lightning_dp.noise.discrete_gaussian.DiscreteGaussian`'s grid.
    """

    def __init__(self, grid: IntegerGrid) -> None:
        self.grid = grid

    @property
    def integer_grid(self) -> IntegerGrid:
        return self.grid

    def setup(self, params: Sequence[Tensor]) -> None:
        self.grid.setup(params)

    def sensitivity(self, ctx: StepContext) -> float:
        return self.grid.sensitivity

    def clip_and_sum(self, grad_samples: PerExampleGradients, ctx: StepContext) -> list[Tensor]:
        """Σ_i round(g_i · min(1, C/‖g_i‖) / γ) per parameter, int64; every term's norm checked ≤ Δ."""
        params = grad_samples.params
        sums = [torch.zeros(p.shape, dtype=torch.int64, device=p.device) for p in params]
        batch = grad_samples.batch
        if batch == 0:
            return sums
        entries = [layer.samples for layer in grad_samples.layers()]
        try:
            norms_sq, held = _squared_norms(entries, batch)
        except _SharedParameterError:  # a layer called twice: its calls' rows add up before norm and rounding
            entries = [lambda: dict(zip(params, grad_samples.materialize(), strict=True))]
            norms_sq, held = _squared_norms(entries, batch)
        ctx.extras["per_sample_norms"] = norms_sq.sqrt().float()  # as FlatClipping's (metrics, benches)
        unit = self.grid.unit
        factors = (ctx.max_grad_norm / norms_sq.sqrt()).clamp(max=1.0)
        scale = torch.where(torch.isfinite(norms_sq), factors * (unit / ctx.max_grad_norm), 0.0)
        scaled_sq = torch.zeros(batch, dtype=torch.float64, device=scale.device)
        index = {p: j for j, p in enumerate(params)}
        exact = torch.float32 if unit * (1 + NORM_MARGIN) < _EXACT_FP32 else torch.float64
        clean = bool(torch.isfinite(norms_sq).all())  # then every value of a kept materialisation is finite
        for position, entry in enumerate(entries):
            samples = held[position] if held is not None else entry()
            for p, g in samples.items():
                total, sq = _round_and_sum(
                    g, scale.to(g.device), exact, unit * (1 + NORM_MARGIN), again=held is None, clean=clean
                )
                sums[index[p]] += total
                scaled_sq += sq.to(scaled_sq.device)
        limit = unit * (1 + NORM_MARGIN / 2)
        if not bool((scaled_sq <= limit * limit).all()):  # NaN too: a value that turned non-finite
            raise RuntimeError(
                "secure=True: an example's rounded gradient came out above the grid's sensitivity bound, so its "
                "per-example gradients differed between two materialisations (non-deterministic kernels). "
                "Nothing was released; train with deterministic algorithms (torch.use_deterministic_algorithms)."
            )
        return sums

    def finalize(self, noisy_sums: list[Tensor], ctx: StepContext) -> list[Tensor]:
        """Integers back to gradients: × γ ÷ q·N (post-processing of the released integers), fp32."""
        factor = self.grid.step(ctx.max_grad_norm) / ctx.expected_batch_size
        return [(s.to(torch.float64) * factor).to(torch.float32) for s in noisy_sums]


Entry = Callable[[], dict[nn.Parameter, Tensor]]
"""One layer entry's per-example gradients {parameter: [B, *shape]}, materialised when called."""


def _squared_norms(
    entries: list[Entry], batch: int
) -> tuple[Tensor, list[dict[nn.Parameter, Tensor]] | None]:
    """Each example's squared norm over every parameter (of the materialised values, accumulated in fp64),
    and the materialisations when they fit :data:`KEEP_BYTES` (else None: they are made again)."""
    total: Tensor | None = None
    held: list[dict[nn.Parameter, Tensor]] | None = []
    seen: set[nn.Parameter] = set()
    size = largest = 0
    for entry in entries:
        samples = entry()
        entry_bytes = 0
        for p, g in samples.items():
            if p in seen:  # a second call of one layer: its rows add to the first's before any norm
                raise _SharedParameterError
            seen.add(p)
            sq = torch.cat([_row_norms(part).double().square() for part in _rows(g)])
            total = sq if total is None else total + sq.to(total.device)
            entry_bytes += g.numel() * g.element_size()
        size, largest = size + entry_bytes, max(largest, entry_bytes)
        if held is not None:
            held.append(samples)
            if size > max(KEEP_BYTES, 2 * largest):
                held = None
    if total is None:
        total = torch.zeros(batch, dtype=torch.float64)
    return total, held


class _SharedParameterError(Exception):
    """A parameter's per-example gradient is split over two layer entries (a layer called twice in one forward)."""


_ROW_ELEMENTS = 1 << 22
"""The arithmetic is done a slice of examples at a time, at most this many values per slice."""


def _rows(g: Tensor) -> list[Tensor]:
    """``g`` [B, *shape] split along the examples into slices of at most :data:`_ROW_ELEMENTS` values."""
    per_row = max(1, g[0].numel()) if len(g) else 1
    return list(g.split(max(1, _ROW_ELEMENTS // per_row)))


def _row_norms(g: Tensor) -> Tensor:
    """‖g_i‖ per example (fp32 at least, the cascade sum of torch's norm kernel)."""
    values = g if g.dtype == torch.float64 else g.float()
    return torch.linalg.vector_norm(values.reshape(len(g), -1), dim=1)


def _round_and_sum(
    g: Tensor, scale: Tensor, exact: torch.dtype, bound: float, *, again: bool, clean: bool
) -> tuple[Tensor, Tensor]:
    """(Σ_i round(g_i·scale_i) as int64, ‖g_i·scale_i‖² per example), a slice of examples at a time.

    ``exact``: the dtype in which every scaled coordinate and its rounding are exact (fp32 below 2²² grid
    units); ``bound``: the largest |coordinate| a scaled example within the grid's bound can have;
    ``again``: ``g`` was materialised a second time, so its scaled norms are measured (else they are the
    norm pass's own values, within the bound by construction: zeros are returned); ``clean``: the norm
    pass found every value finite. Rows of dropped examples (scale 0) and any non-finite value become exact zeros; each
    chunk of rows is summed exactly in ``work`` and the chunks' sums in int64, exact whatever the order (the caller's
    capacity check keeps the total below 2⁶³)."""
    total = torch.zeros(g.shape[1:], dtype=torch.int64, device=g.device)
    squares = []
    start = 0
    work = torch.float64 if g.dtype == torch.float64 else exact
    # rows whose integers add up exactly in ``work`` (fp32: partial sums below 2²⁴); a row beyond the bound
    # is refused after the loop, so its sums are never released
    step = max(1, int((2.0**24 if work == torch.float32 else 2.0**53) // (bound + 1)))
    for part in _rows(g):
        rows = len(part)
        v = part.to(work) * scale[start : start + rows].to(work).view(-1, *([1] * (part.dim() - 1)))
        if again or not clean:
            v = torch.nan_to_num_(v, nan=0.0, posinf=0.0, neginf=0.0)
        if again:
            squares.append(_row_norms(v).double().square())
        else:
            squares.append(torch.zeros(rows, dtype=torch.float64, device=v.device))
        torch.round_(v)
        for chunk in v.split(step):
            total += chunk.sum(0).to(torch.int64)
        start += rows
    return total, torch.cat(squares)
