"""StepContext: what one private step knows about itself, handed to every slot hook and to the release.

Below both the slot contract (``contract.py``) and the release path (``release.py``), so neither imports the
other's module for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class StepContext:
    """What one private step knows about itself; passed to every slot hook."""

    step: int
    """Index of this private step (0-based, counts every logical step, empty batches included)."""
    batch_size: int
    """Realised number of examples in this logical batch (never used for normalisation)."""
    expected_batch_size: float
    """Public expected batch size q·N: the divisor of the noisy sum."""
    max_grad_norm: float
    """C, the clipping bound of this step (an L2 norm in the gradient's units)."""
    noise_multiplier: float
    """σ of this step, relative to the clipping's sensitivity: the noise std is σ·sensitivity."""
    generator: torch.Generator
    """The noise generator: seeded from ``os.urandom`` unless the user asked for a seed."""
    sensitivity: float | None = None
    """L2 sensitivity of the sum when a sampler bounds each contribution itself (DPIS); None: the
    clipping slot's ``sensitivity``."""
    clipped_sums: list[Tensor] | None = None
    """This rank's clipped sums before the noise, for steps with ``needs_sums`` (else None)."""
    noisy_sums: list[Tensor] | None = None
    """The released noisy sums before ``finalize``, for steps with ``needs_sums`` (else None)."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Scratch space of a clipping slot within one step (read by nothing else)."""

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (the engine holds the step's context until the optimizer step) without the clipped sums:
        with the released noisy sums they give the noise."""
        return dict(self.__dict__, clipped_sums=None)
