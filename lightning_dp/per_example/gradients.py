"""The per-example gradients of a batch as a whole (:class:`PerExampleGradients`, made of what each layer call
left, :mod:`.layer_calls`): squared norms and weighted sums without materialising; the typed view a clipping
reads (:class:`LayerGradients`), and the batch's privacy units (:class:`UnitGradients`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, TypeVar

import torch
from torch import Tensor, nn

from lightning_dp.core.batches import UnitInfo
from lightning_dp.per_example import kernels
from lightning_dp.per_example.kernels import unit_norms as unit_kernels
from lightning_dp.per_example.layer_calls import LayerCall, TiedCalls
from lightning_dp.per_example.materialized import (
    add_samples,
    materialized_sq_norm,
    materialized_weighted,
    materialized_weighted_grad,
)


class LayerGradients:
    """One layer's share of a batch's per-example gradients, as a clipping slot reads them.

    A fast-path layer call whose inputs are still held has ``module`` set: a clipping may compute from
    ``inputs`` and :meth:`output_grad` directly (AdaCliP's Linear formula). Otherwise ``module`` is None
    and :meth:`samples` gives the stored per-example gradients. :meth:`samples` always works.
    """

    def __init__(
        self,
        call: LayerCall | TiedCalls | None,
        scale: float,
        materialized: dict[nn.Parameter, Tensor] | None = None,
    ) -> None:
        self._call, self._scale, self._materialized = call, scale, materialized

    @property
    def _held(self) -> LayerCall | None:
        """The layer call whose inputs and output gradient are held (None: materialised entries)."""
        call = self._call
        return call if isinstance(call, LayerCall) and not call.released else None

    @property
    def module(self) -> nn.Module | None:
        """The layer whose inputs and output gradient are held, or None (gradients materialised)."""
        held = self._held
        return None if held is None else held.module

    @property
    def inputs(self) -> list[Any]:
        """The layer call's recorded inputs (empty where ``module`` is None)."""
        held = self._held
        return [] if held is None else held.activations

    def output_grad(self) -> Tensor:
        """The per-example gradient of the layer's output (scaled; a new tensor); only where ``module`` is set."""
        held = self._held
        if held is None or held.backprops is None:
            raise ValueError("this entry holds materialised per-example gradients, not a layer call")
        return held.backprops * self._scale

    def samples(self) -> dict[nn.Parameter, Tensor]:
        """Per-example gradients [B, *shape] of this entry's parameters (materialised now for a layer call)."""
        if self._call is None:
            assert self._materialized is not None
            return self._materialized
        return self._call.samples(self._scale)


class SumSink(Protocol):
    """Where each part of a weighted sum goes as soon as it is formed (``dp_fsdp``: a reduce-scatter per FSDP
    unit, so the whole model's full-size sum never exists at once)."""

    def groups(self, params: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
        """``params`` split into the parts summed one after another, in an order every rank shares."""
        ...

    def take(self, params: list[nn.Parameter], sums: list[Tensor]) -> list[Tensor]:
        """What the sum keeps of one part's full-size sums (this rank's shards of their sum over all ranks)."""
        ...


Registered = Callable[[], contextlib.AbstractContextManager[None]]
"""A context in which every layer holds the parameter objects its per-example terms were recorded with."""

_T = TypeVar("_T")


def _as_recorded(method: Callable[..., _T]) -> Callable[..., _T]:
    """Run ``method`` inside ``self.registered`` (when set): the kernels key their results by the layer's
    parameters as registered, and ``dp_fsdp`` registers sharded ones on a layer outside its forward and backward."""

    @functools.wraps(method)
    def run(self: PerExampleGradients, *args: Any, **kwargs: Any) -> _T:
        if self.registered is None:
            return method(self, *args, **kwargs)
        with self.registered():
            return method(self, *args, **kwargs)

    return run


class PerExampleGradients(Sequence[Tensor]):
    """The per-example gradients of one batch, one entry per parameter, materialised only on demand.

    Layers with a fast formula keep only (inputs, output gradients): their per-example norms and the
    clipped sum are computed from those directly (``sq_norms``, ``weighted_sum``), never as a
    [B, *param.shape] tensor. Indexing or iterating materialises every entry (Opacus's formulas), so
    a clipping that needs the full per-example gradients still gets them.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        batch: int,
        materialized: dict[nn.Parameter, Tensor],
        records: Sequence[LayerCall | TiedCalls],
        scale: float = 1.0,
    ) -> None:
        self.params, self.batch = params, batch
        self.scale = scale
        """Records hold the raw output gradients; per-example gradients are ``scale`` times theirs
        (the batch size under a mean loss), applied to the few scalars that need it, not to every δ."""
        self._materialized = materialized
        self._records = records
        self._full: list[Tensor] | None = None
        self.release_on_sum = False
        """Set by the engine when the next ``weighted_sum`` is the step's last use of the per-example
        terms: each layer's are then freed as soon as its sum is taken, which lowers the step's peak."""
        self.sink: SumSink | None = None
        """Set by the engine (``dp_fsdp``): ``weighted_sum`` forms the sum part by part and returns what the
        sink keeps of each part (this rank's shards), never the full-size sum of every parameter at once."""
        self.registered: Registered | None = None
        """Set by the capture (``dp_fsdp``): how the layers get back the parameters the hooks recorded."""

    @classmethod
    def from_tensors(cls, tensors: Sequence[Tensor]) -> PerExampleGradients:
        """Wrap materialised per-example gradients [B, *shape] (tests, a clipping applied to a hand-made
        batch); each entry is identified by a placeholder parameter of the entry's shape."""
        if not tensors:
            raise ValueError("from_tensors needs at least one [B, *shape] tensor")
        params = [
            nn.Parameter(torch.empty_strided(g.shape[1:], [0] * (g.dim() - 1), device=g.device), False)
            for g in tensors
        ]
        grads = cls(params, tensors[0].shape[0], {}, [])
        grads._full = list(tensors)
        return grads

    def layers(self) -> list[LayerGradients]:
        """The batch per layer: one entry per fast-path layer call, one for all materialised parameters.

        Parameters no layer reached are in no entry (their per-example gradients are zero).
        """
        if self._full is not None:
            return [LayerGradients(None, 1.0, dict(zip(self.params, self._full, strict=True)))]
        whole = [LayerGradients(None, 1.0, self._materialized)] if self._materialized else []
        return whole + [LayerGradients(call, self.scale) for call in self._records]

    def __len__(self) -> int:
        return len(self.params)

    def __getitem__(self, index: int) -> Tensor:  # type: ignore[override]
        return self.materialize()[index]

    @_as_recorded
    def materialize(self) -> list[Tensor]:
        """Every parameter's [B, *shape] per-example gradients (zeros for unused parameters)."""
        if self._full is None:
            grads = dict(self._materialized)
            for record in self._records:
                add_samples(grads, record.samples(self.scale))
            self._full = [
                grads[p] if p in grads else torch.zeros((self.batch, *p.shape), device=p.device)
                for p in self.params
            ]
        return self._full

    @_as_recorded
    def sq_norms(self) -> Tensor:
        """Each example's squared gradient norm over all parameters, in fp32."""
        device = self.params[0].device if self.params else None
        total = torch.zeros(self.batch, dtype=torch.float32, device=device)
        if self._full is not None:
            sources: list[Tensor] = self._full
        else:
            sources = list(self._materialized.values())
            for record in self._records:
                for value in record.sq_norms().values():
                    total += value
            total *= self.scale**2
        for g in sources:
            total += materialized_sq_norm(g)
        return total

    @_as_recorded
    def weighted_sum(self, weights: Tensor) -> list[Tensor]:
        """Σ_i w_i g_i per parameter in fp32; examples with weight 0 contribute exactly 0 (NaN-safe)."""
        if self.sink is not None:
            return self._sunk_weighted_sum(self.sink, weights)
        if self._full is not None:
            return [materialized_weighted(g, weights) for g in self._full]
        sums = materialized_weighted_grad(self._materialized, weights)
        weights = weights * self.scale
        rows = _sparse_rows(weights)
        for record in self._records:
            layer_sums = self._record_sum(record, weights, rows)
            for p, value in layer_sums.items():
                sums[p] = value if p not in sums else sums[p] + value
        return [
            sums[p] if p in sums else torch.zeros(p.shape, device=p.device, dtype=torch.float32)
            for p in self.params
        ]

    def _sunk_weighted_sum(self, sink: SumSink, weights: Tensor) -> list[Tensor]:
        """:meth:`weighted_sum` one sink part at a time: each part's layers are summed (and freed, with
        ``release_on_sum``) when its turn comes, and only what the sink keeps of the part stays."""
        groups = sink.groups(self.params)
        part = {p: i for i, group in enumerate(groups) for p in group}
        formed: list[dict[nn.Parameter, Tensor]] = [{} for _ in groups]

        def add(sums: dict[nn.Parameter, Tensor]) -> None:
            for p, value in sums.items():
                if p not in part:  # not trained (frozen): no sum is returned for it
                    continue
                held = formed[part[p]]
                held[p] = value if p not in held else held[p] + value

        full = dict(zip(self.params, self._full, strict=True)) if self._full is not None else None
        scaled = weights * self.scale
        rows = _sparse_rows(scaled)
        by_part: list[list[LayerCall | TiedCalls]] = [[] for _ in groups]
        for record in self._records if full is None else []:
            owners = {part[p] for p in _record_params(record) if p in part}
            if len(owners) == 1:
                by_part[owners.pop()].append(record)
            else:  # a layer whose parameters the sink cannot place before its sum is formed
                add(self._record_sum(record, scaled, rows))
        kept: dict[nn.Parameter, Tensor] = {}
        for i, group in enumerate(groups):
            if full is not None:
                add({p: materialized_weighted(full[p], weights) for p in group})
            else:
                own = {p: self._materialized[p] for p in group if p in self._materialized}
                add(materialized_weighted_grad(own, weights))
                for record in by_part[i]:
                    add(self._record_sum(record, scaled, rows))
            sums = [
                formed[i].pop(p)
                if p in formed[i]
                else torch.zeros(p.shape, device=p.device, dtype=torch.float32)
                for p in group
            ]
            kept.update(zip(group, sink.take(group, sums), strict=True))
            del sums
        return [kept[p] for p in self.params]

    def _record_sum(
        self, record: LayerCall | TiedCalls, scaled: Tensor, rows: Tensor | None
    ) -> dict[nn.Parameter, Tensor]:
        sums = _layer_weighted_sum(record, scaled, rows)
        if self.release_on_sum:
            record.spend()
        return sums

    def grouped(
        self, unit_of_row: Tensor, reduction: Literal["mean", "sum"] = "mean", views: int = 1
    ) -> UnitGradients:
        """These rows grouped into privacy units (rows of one unit contiguous, ``unit_of_row``
        non-decreasing from 0): the clipping then bounds each unit's ``reduction`` of its rows'
        gradients, so adding or removing a whole unit moves the clipped sum by at most C."""
        return UnitGradients(self, unit_of_row, reduction, views)


class UnitGradients(PerExampleGradients):
    """The gradients of a batch's privacy units h_u = Σ_{r∈u} w_r g_r (w_r = 1/n_u under "mean", 1 under
    "sum", divided by ``views`` for augmented views), as a clipping reads per-example gradients: ``batch``
    is the number of units, :meth:`sq_norms` gives ‖h_u‖², and :meth:`weighted_sum` expands unit weights
    to rows (Σ_u c_u h_u = Σ_r c_{π(r)} w_r g_r), so every row kernel computes the clipped sum unchanged.

    Unit norms come from each fast-path layer's inputs regrouped by unit (:mod:`.kernels.units`), from the
    row norms for units of one row (the same digits as example-level clipping), and otherwise from the
    per-row gradients index-added per unit (one layer at a time). :meth:`materialize` gives [U, *shape].
    """

    def __init__(
        self,
        rows: PerExampleGradients,
        unit_of_row: Tensor,
        reduction: Literal["mean", "sum"],
        views: int = 1,
    ) -> None:
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        device = rows.params[0].device if rows.params else unit_of_row.device
        self.unit_of_row = unit_of_row.to(device=device, dtype=torch.int64)
        if self.unit_of_row.numel() != rows.batch:
            raise ValueError("The unit map and the per-example gradients have different numbers of rows.")
        self.info = UnitInfo(self.unit_of_row, reduction, views)
        super().__init__(rows.params, self.info.num_units, {}, [], rows.scale)
        self.rows = rows
        self.registered = rows.registered
        self.row_weights = self.info.row_weights()
        """w_r: the weight of row r in its unit's gradient."""

    def layers(self) -> list[LayerGradients]:
        """One materialised entry: every parameter's per-unit gradients [U, *shape]."""
        return [LayerGradients(None, 1.0, dict(zip(self.params, self.materialize(), strict=True)))]

    @_as_recorded
    def materialize(self) -> list[Tensor]:
        """Every parameter's per-unit gradients [U, *shape] (Σ_{r∈u} w_r g_r, in the rows' dtype)."""
        if self._full is None:
            index = self.unit_of_row
            self._full = [
                g.new_zeros((self.batch, *g.shape[1:])).index_add_(
                    0, index.to(g.device), g * self.row_weights.to(g).view(-1, *([1] * (g.dim() - 1)))
                )
                for g in self.rows.materialize()
            ]
        return self._full

    @_as_recorded
    def sq_norms(self) -> Tensor:
        """Each unit's squared gradient norm ‖h_u‖² over all parameters, in fp32, never understated."""
        rows, index, weights, units = self.rows, self.unit_of_row, self.row_weights, self.batch
        total = torch.zeros(units, dtype=torch.float32, device=index.device)
        single, first = unit_kernels.single_row_units(index, units)
        if bool(single.all()):  # every unit one row: exactly the example-level norms
            return rows.sq_norms()[first] * weights[first].square()
        if rows._full is not None:
            for g in rows._full:
                total += unit_kernels.unit_sums_sq_norms(g, index, weights, units).to(total.device)
        else:
            for g in rows._materialized.values():
                total += unit_kernels.unit_sums_sq_norms(g, index, weights, units).to(total.device)
            for record in rows._records:
                total += self._record_sq_norms(record)
        if bool(single.any()):
            total = torch.where(single, rows.sq_norms()[first] * weights[first].square(), total)
        return total

    def _record_sq_norms(self, record: LayerCall | TiedCalls) -> Tensor:
        """One layer call's share of the unit norms (regrouped inputs, else materialised per row)."""
        rows, index, weights, units = self.rows, self.unit_of_row, self.row_weights, self.batch
        total = torch.zeros(units, dtype=torch.float32, device=index.device)
        if (
            isinstance(record, LayerCall)
            and not record.released
            and unit_kernels.has_unit_kernel(record.module)
        ):
            record._check_unspent()
            assert record.backprops is not None
            with record.tuner.active() if record.tuner is not None else contextlib.nullcontext():
                norms = unit_kernels.unit_sq_norms(
                    record.module, record.activations, record.backprops, index, weights, units
                )
            for value in norms.values():
                total += value.to(total.device) * rows.scale**2
            return total
        for g in record.samples(rows.scale).values():
            total += unit_kernels.unit_sums_sq_norms(g, index, weights, units).to(total.device)
        return total

    def weighted_sum(self, weights: Tensor) -> list[Tensor]:
        """Σ_u c_u h_u per parameter in fp32, computed over rows as Σ_r c_{π(r)} w_r g_r."""
        self.rows.release_on_sum, self.rows.sink = self.release_on_sum, self.sink
        row_weights = weights.to(self.unit_of_row.device)[self.unit_of_row] * self.row_weights
        return self.rows.weighted_sum(row_weights)


def _record_params(record: LayerCall | TiedCalls) -> list[nn.Parameter]:
    """The parameters whose sums one layer call's record gives (its layer's own)."""
    if isinstance(record, TiedCalls):
        return [record.weight]
    return list(record.module.parameters(recurse=False))


def _layer_weighted_sum(
    record: LayerCall | TiedCalls, weights: Tensor, rows: Tensor | None
) -> dict[nn.Parameter, Tensor]:
    """Σ_i w_i g_i of one fast-path layer call (raw scale), over ``rows`` only when given."""
    if rows is not None:  # reductions over the weighted rows only
        record, weights = record.take(rows), weights[rows]
    if isinstance(record, TiedCalls):
        return record.weighted(weights)
    record._check_unspent()
    if record.released:  # the cache holds every per-example gradient of the layer
        return materialized_weighted_grad(record.cache, weights)
    assert record.backprops is not None
    with record.tuner.active() if record.tuner is not None else contextlib.nullcontext():
        return kernels.weighted_grad(
            record.module, record.activations, record.backprops, weights, record.cache
        )


SPARSE_FRACTION = 0.5
"""``weighted_sum`` reduces over the rows with a nonzero weight only when they are at most this
fraction of the batch (DPIS rejects about 1 − 1/k of its candidates): the row gather then costs less
than the reduction it shortens."""


def _sparse_rows(weights: Tensor) -> Tensor | None:
    """Indices of the nonzero weights when few enough of them are nonzero, else None."""
    keep = weights != 0
    kept = int(keep.sum())
    if kept > SPARSE_FRACTION * weights.numel():
        return None
    return keep.nonzero().squeeze(1)
