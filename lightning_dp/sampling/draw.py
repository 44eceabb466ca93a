"""One Poisson draw over a population: every member joins independently with probability ``rate``.

The single primitive every Poisson-type sampler draws with (examples, a cyclic group, users), so the
cost of a step is that of this function.
"""

from __future__ import annotations

import torch


def poisson_subset(population: int, rate: float, generator: torch.Generator) -> torch.Tensor:
    """Sorted distinct int64 positions in ``range(population)``, each included independently w.p. ``rate``."""
    if population <= 0:
        return torch.zeros(0, dtype=torch.long)
    mask = torch.rand(population, generator=generator) < rate
    return torch.nonzero(mask, as_tuple=False).flatten()
