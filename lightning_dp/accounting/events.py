"""Privacy events: one noisy release each, priced in Rényi DP and serialisable as plain data.

A ledger stores a run-length history of ``(event, count)``. Event types register themselves under a
``kind`` string, so new mechanisms (Laplace, sparse vector, noisy max, zCDP, ...) can be added by
subclassing :class:`PrivacyEvent` in their own module without touching the ledger.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np

from .sgm import sgm_rdp

__all__ = ["Gaussian", "PoissonGaussian", "PrivacyEvent", "event_type"]

_EVENT_TYPES: dict[str, type[PrivacyEvent]] = {}


def _check_noise_multiplier(value: Any) -> float:
    """Validate σ (σ ≥ 0 and finite; σ = 0 is allowed and means no privacy, i.e. infinite ε)."""
    try:
        sigma = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"noise_multiplier must be a real number, got {value!r}") from None
    if math.isnan(sigma) or math.isinf(sigma) or sigma < 0:
        raise ValueError(
            f"noise_multiplier must be a finite number >= 0 (0 means no privacy, infinite ε), got {value!r}"
        )
    return sigma


def _check_sample_rate(value: Any) -> float:
    """Validate the Poisson sampling rate q ∈ [0, 1]."""
    try:
        q = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"sample_rate must be a real number, got {value!r}") from None
    if math.isnan(q) or not 0.0 <= q <= 1.0:
        raise ValueError(f"sample_rate must be in [0, 1], got {value!r}")
    return q


@dataclass(frozen=True)
class PrivacyEvent(abc.ABC):
    """One occurrence of a private mechanism; frozen and hashable so RDP vectors can be cached per event.

    Subclasses are frozen dataclasses declared as ``class MyEvent(PrivacyEvent, kind="my_event")``;
    their fields must be plain ``float``/``int``/``str`` so :meth:`to_dict` survives
    ``torch.load(weights_only=True)``.
    """

    kind: ClassVar[str] = ""

    def __init_subclass__(cls, *, kind: str | None = None, **kwargs: Any) -> None:
        """Register the subclass under ``kind`` so :meth:`from_dict` can rebuild it from a checkpoint."""
        super().__init_subclass__(**kwargs)
        if kind is None:
            return
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"event kind must be a non-empty string, got {kind!r}")
        previous = _EVENT_TYPES.get(kind)
        if previous is not None and (previous.__module__, previous.__qualname__) != (
            cls.__module__,
            cls.__qualname__,
        ):
            raise ValueError(
                f"event kind {kind!r} is already registered by {previous.__module__}.{previous.__qualname__}"
            )
        cls.kind = kind
        _EVENT_TYPES[kind] = cls

    @abc.abstractmethod
    def rdp(self, orders: tuple[float, ...]) -> np.ndarray:
        """RDP ε(α) of ONE occurrence of this event at each order α (may contain ``inf``)."""

    def poisson_gaussian_params(self) -> tuple[float, float] | None:
        """``(noise_multiplier, sample_rate)`` if this event is a (subsampled) Gaussian, else ``None``.

        The PRV accountant can only price subsampled Gaussians; other events return ``None``.
        """
        return None

    def pure_epsilon(self) -> float | None:
        """ε of one occurrence if this event is pure ε-DP (priced by ``accountant="pure"``), else ``None``."""
        return None

    def to_dict(self) -> dict[str, Any]:
        """Plain-python description (``kind`` plus the dataclass fields) for checkpoints."""
        out: dict[str, Any] = {"kind": self.kind}
        for f in fields(self):
            out[f.name] = getattr(self, f.name)
        return out

    @staticmethod
    def from_dict(data: dict[str, Any]) -> PrivacyEvent:
        """Rebuild an event from :meth:`to_dict` output, dispatching on its registered ``kind``."""
        if not isinstance(data, dict) or "kind" not in data:
            raise ValueError(f"event dict must be a dict with a 'kind' key, got {data!r}")
        params = dict(data)
        cls = event_type(params.pop("kind"))
        names = {f.name for f in fields(cls)}
        if set(params) != names:
            raise ValueError(
                f"event of kind {cls.kind!r} expects fields {sorted(names)}, got {sorted(params)}"
            )
        return cls(**params)


def event_type(kind: str) -> type[PrivacyEvent]:
    """Return the event class registered under ``kind`` (ValueError listing the known kinds if absent)."""
    try:
        return _EVENT_TYPES[kind]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown privacy event kind {kind!r}; registered kinds: {sorted(_EVENT_TYPES)}"
        ) from None


@dataclass(frozen=True)
class PoissonGaussian(PrivacyEvent, kind="poisson_gaussian"):
    """Poisson-subsampled Gaussian mechanism: one DP-SGD step with noise σ·C and sampling rate q."""

    noise_multiplier: float
    sample_rate: float

    def __post_init__(self) -> None:
        """Validate and normalise to floats so equal events hash equal and serialise as floats."""
        object.__setattr__(self, "noise_multiplier", _check_noise_multiplier(self.noise_multiplier))
        object.__setattr__(self, "sample_rate", _check_sample_rate(self.sample_rate))

    def rdp(self, orders: tuple[float, ...]) -> np.ndarray:
        """RDP of one subsampled-Gaussian step (Mironov et al. 2019): Opacus's series, vectorised."""
        return sgm_rdp(self.noise_multiplier, self.sample_rate, tuple(orders))

    def poisson_gaussian_params(self) -> tuple[float, float] | None:
        """This event is a subsampled Gaussian, so the PRV accountant can price it."""
        return (self.noise_multiplier, self.sample_rate)


@dataclass(frozen=True)
class Gaussian(PrivacyEvent, kind="gaussian"):
    """Unsampled Gaussian mechanism (q = 1) with noise σ times the L2 sensitivity."""

    noise_multiplier: float

    def __post_init__(self) -> None:
        """Validate and normalise σ to float."""
        object.__setattr__(self, "noise_multiplier", _check_noise_multiplier(self.noise_multiplier))

    def rdp(self, orders: tuple[float, ...]) -> np.ndarray:
        """RDP of the Gaussian mechanism: α / (2σ²)."""
        if self.noise_multiplier == 0.0:
            return np.full(len(orders), math.inf)
        return np.asarray(orders, dtype=np.float64) / (2.0 * self.noise_multiplier**2)

    def poisson_gaussian_params(self) -> tuple[float, float] | None:
        """A Gaussian is a subsampled Gaussian with q = 1, so the PRV accountant can price it."""
        return (self.noise_multiplier, 1.0)
