"""Batch fingerprints: did the tensors ``training_step`` receives come unchanged from the sampled batch?

A fingerprint is exact integer arithmetic on the tensors' bits (the same on every device, in any
summation order), per example: each row of every tensor whose dimension 0 is the batch gets a hash, and
an example's hash combines its rows in all those tensors. Two fingerprints agree when the same examples
arrive, whole, in any order; an in-place edit, a mixed row, a dropped or added example or a re-paired
label changes them (with probability 1 − 2⁻⁶³ per changed value sampled). Rows longer than
:data:`MAX_COLUMNS` values are sampled at fixed positions, so the cost is O(batch) on any input size.

Where a tensor object reaches the step unchanged (the same object, the same in-place version counter, as
on a CPU run with no batch hooks), nothing is hashed at all: :class:`Seen` recognises it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_dp.core.batches import BatchWithInfo, EmptyBatch, tensor_leaves

MAX_COLUMNS = 4096
"""Values hashed per example and tensor: every value up to this many, else this many at fixed positions
(an edit that mixes examples, standardises a batch or blends inputs touches every position)."""

_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # the 64-bit golden ratio, as a signed int64


def _signed(value: int) -> int:
    """``value`` modulo 2⁶⁴ as a signed 64-bit integer (what int64 arithmetic wraps to)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _column_weights(count: int, device: torch.device) -> Tensor:
    """Fixed odd int64 weights, one per hashed position (the same on every device and run)."""
    g = torch.Generator().manual_seed(0x5EED)
    weights = torch.randint(-(2**62), 2**62, (count,), generator=g, dtype=torch.int64) * 2 + 1
    return weights.to(device)


def _columns(width: int) -> Tensor | None:
    """The positions hashed in a row of ``width`` values (None: all of them)."""
    if width <= MAX_COLUMNS:
        return None
    g = torch.Generator().manual_seed(width)
    return torch.randperm(width, generator=g)[:MAX_COLUMNS].sort().values


def _bits(t: Tensor) -> Tensor:
    """The tensor's values as int64 bit patterns (floats by their bits, so -0.0 and NaN payloads count)."""
    if t.dtype == torch.bool:
        return t.to(torch.int64)
    if t.is_complex():
        t = torch.view_as_real(t)
    size = t.element_size()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    if t.is_floating_point() or t.dtype != as_int:
        t = t.contiguous().view(as_int)
    return t.to(torch.int64)


def row_hashes(t: Tensor, rows: int) -> Tensor:
    """One int64 hash per example of a batch-first tensor with ``rows`` rows (on the tensor's device)."""
    flat = t.detach().reshape(rows, -1)
    picked = _columns(flat.shape[1])
    if picked is not None:
        flat = flat.index_select(1, picked.to(flat.device))
    weights = _column_weights(flat.shape[1], flat.device)
    return (_bits(flat) * weights).sum(1)  # wraps modulo 2⁶⁴: exact and order-independent


@dataclass
class Fingerprint:
    """Per-example hashes of a batch (order-free), plus hashes of its tensors that are not per example."""

    examples: Tensor
    """Sorted int64 [B] on the CPU: each example's rows in every batch-first tensor, combined."""
    shared: tuple[int, ...]
    """Sorted hashes of the tensors whose dimension 0 is not the batch (one value each)."""

    def same(self, other: Fingerprint) -> bool:
        return self.shared == other.shared and torch.equal(self.examples, other.examples)


def unwrap(batch: Any) -> Any:
    """The user's batch inside the sampler's side-channel wrapper (DPIS), if any."""
    return batch.batch if isinstance(batch, BatchWithInfo) else batch


def fingerprint(batch: Any) -> Fingerprint | None:
    """The batch's fingerprint (None for an empty Poisson batch or a batch without tensors)."""
    batch = unwrap(batch)
    if isinstance(batch, EmptyBatch):
        return None
    leaves = tensor_leaves(batch)
    rows = next((t.shape[0] for t in leaves if t.dim() > 0), None)  # batch_length, from the same walk
    if not leaves or rows is None:
        return None
    combined: Tensor | None = None
    shared: list[int] = []
    for position, t in enumerate(leaves):
        salt = _signed((position + 1) * _MIX)
        if t.dim() > 0 and t.shape[0] == rows:
            h = row_hashes(t, rows) * salt + hash((str(t.dtype), tuple(t.shape[1:]))) % (1 << 61)
            combined = h if combined is None else combined + h.to(combined.device)
        else:
            whole = row_hashes(t.reshape(1, -1), 1) if t.numel() else torch.zeros(1, dtype=torch.int64)
            shared.append(int(whole.cpu()[0]) ^ hash((str(t.dtype), tuple(t.shape))))
    examples = torch.zeros(0, dtype=torch.int64) if combined is None else combined.cpu().sort().values
    return Fingerprint(examples, tuple(sorted(shared)))


@dataclass
class Seen:
    """The tensor objects of a batch and their in-place version counters at one moment: a batch that
    still holds exactly these objects, at these versions, is unchanged without hashing anything."""

    tensors: list[tuple[int, int]] = field(default_factory=list)
    _keep: list[Tensor] = field(default_factory=list, repr=False)

    @classmethod
    def of(cls, batch: Any) -> Seen:
        leaves = tensor_leaves(unwrap(batch))
        return cls([(id(t), t._version) for t in leaves], leaves)

    def unchanged(self, batch: Any) -> bool:
        leaves = tensor_leaves(unwrap(batch))
        return [(id(t), t._version) for t in leaves] == self.tensors
