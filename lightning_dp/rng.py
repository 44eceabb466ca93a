"""Random generators for sampling and noise, kept apart from the global torch RNG.

By default each generator is seeded from ``os.urandom`` so neither ``seed_everything`` nor a leaked
seed makes the noise predictable; a user-given seed makes runs reproducible (tests, debugging).
"""

from __future__ import annotations

import hashlib
import os

import torch


def make_generator(seed: int | None, stream: str, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one named stream; independent streams come from one user seed via hashing."""
    if seed is None:
        value = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
    else:
        digest = hashlib.sha256(f"{seed}:{stream}".encode()).digest()
        value = int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
    generator = torch.Generator(device=device)
    generator.manual_seed(value)
    return generator
