"""Random generators for sampling and noise, kept apart from the global torch RNG.

By default each generator is seeded from ``os.urandom`` so neither ``seed_everything`` nor a leaked
seed makes the noise predictable; a user-given seed makes runs reproducible (tests, debugging).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

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


#: Keys under which a slot's ``state_dict`` stores generator states (one state, or a dict of named ones).
GENERATOR_KEYS = ("generator", "generators")


def without_generator_states(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` minus its saved generator states, so a resume draws from fresh ``os.urandom`` streams.

    Restoring them would make two runs resumed from one checkpoint draw the *same* noise (the difference
    of their releases then cancels it); a slot whose generators are absent seeds new ones itself.
    """
    out = {key: value for key, value in state.items() if key != "generator"}
    if "generators" in out:
        out["generators"] = {}
    return out
