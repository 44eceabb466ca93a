"""What a run's files must not hold (issue #35): a generator state, a seed the run drew, a private statistic.

``UrandomDraws`` records every ``os.urandom`` draw of the process (the seeds of unseeded streams).
``scan_files`` opens every file under a folder: checkpoints are loaded and every nested value walked; every
other file is searched as text (decimal seeds) and as bytes (a seed's 8 raw bytes); JSON is walked as well.
Generic on purpose: a slot added later is scanned without a change here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

CPU_STATE_BYTES = torch.Generator().get_state().numel()
CUDA_STATE_BYTES = 16  # Philox: seed and offset
MASK63 = (1 << 63) - 1


class UrandomDraws:
    """Wraps ``os.urandom`` and keeps every draw (install with ``monkeypatch.setattr(os, "urandom", draws)``)."""

    def __init__(self) -> None:
        self.real = os.urandom
        self.draws: list[bytes] = []

    def __call__(self, n: int) -> bytes:
        data = self.real(n)
        self.draws.append(data)
        return data

    def add_hex(self, values: Iterable[str]) -> None:
        """Draws another process recorded (a DDP rank)."""
        self.draws.extend(bytes.fromhex(v) for v in values)

    def windows(self) -> set[bytes]:
        """Every 8-byte window of every draw: what a seed looks like as raw bytes."""
        return {d[i : i + 8] for d in self.draws for i in range(0, max(len(d) - 7, 0))}

    def integers(self) -> set[int]:
        """Every integer a seed derived from a draw can be (little/big endian, whole draw, 63-bit masked)."""
        out: set[int] = set()
        for raw in [*self.windows(), *self.draws]:
            for order in ("little", "big"):
                value = int.from_bytes(raw, order)  # type: ignore[arg-type]
                out |= {value, value & MASK63}
        return {v for v in out if v > 2**32}  # a draw's integer; small values would match ordinary counts


@dataclass
class Secrets:
    """What the run must keep to itself: its seeds, and its private statistics' shapes and values."""

    draws: UrandomDraws
    num_samples: int
    """N: a tensor or list with a dimension of this length is one value per training example."""
    realised_sizes: list[int] = field(default_factory=list)
    """The batch sizes the sampler drew (un-noised): neither the list nor its total may be written."""
    public_ints: set[int] = field(default_factory=set)
    """Integers that are public settings (N, the batch size, the step count): never reported as a count."""


def _as_array(value: Any) -> np.ndarray | None:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy() if value.layout == torch.strided else None
    if isinstance(value, np.ndarray):
        return value
    return None


def walk(value: Any, secrets: Secrets, where: str, found: list[str], private_counts: bool) -> None:
    """Every nested value of ``value``: report each generator state, seed and private statistic in ``found``."""
    seeds = secrets.draws.integers()
    if isinstance(value, torch.Generator | np.random.Generator | np.random.BitGenerator):
        found.append(f"{where}: a generator object ({type(value).__name__})")
        return
    if isinstance(value, dict):
        if "bit_generator" in value and "state" in value:
            found.append(f"{where}: a numpy generator state")
        for key, item in value.items():
            walk(key, secrets, f"{where}.<key>", found, private_counts)
            walk(item, secrets, f"{where}.{key}", found, private_counts)
        return
    array = _as_array(value)
    if array is not None:
        if array.dtype == np.uint8 and array.size in (CPU_STATE_BYTES, CUDA_STATE_BYTES):
            found.append(f"{where}: a uint8 tensor of a generator state's size ({array.size} bytes)")
        if array.dtype == np.uint8 and any(w in array.tobytes() for w in secrets.draws.windows()):
            found.append(f"{where}: bytes of a seed the run drew")
        if secrets.num_samples in array.shape:
            found.append(f"{where}: one value per training example (shape {array.shape})")
        if array.dtype.kind in "iu" and array.size < 64:
            walk(array.tolist(), secrets, where, found, private_counts)
        return
    if isinstance(value, list | tuple):
        if len(value) == secrets.num_samples:
            found.append(f"{where}: one value per training example (a list of {len(value)})")
        sizes = secrets.realised_sizes
        head = list(value[: len(sizes)])
        if len(sizes) >= 3 and all(type(v) is int for v in head) and head == sizes:
            found.append(f"{where}: the realised batch sizes")
        for i, item in enumerate(value):
            walk(item, secrets, f"{where}[{i}]", found, private_counts)
        return
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        if value in seeds:
            found.append(f"{where}: a seed the run drew ({value})")
        total = sum(secrets.realised_sizes)
        if private_counts and total and value == total and value not in secrets.public_ints:
            found.append(f"{where}: the number of examples the run sampled ({value})")
        return
    if isinstance(value, float):
        if value.is_integer() and int(value) in seeds:
            found.append(f"{where}: a seed the run drew ({value})")
        return
    if isinstance(value, str | bytes):
        found.extend(f"{where}: {what}" for what in search_text(value, secrets))
        return
    if hasattr(value, "__dict__") and not isinstance(value, type):
        walk(vars(value), secrets, where, found, private_counts)


def search_text(value: str | bytes, secrets: Secrets) -> list[str]:
    """A seed in text (decimal or hex) or in raw bytes."""
    data = value.encode() if isinstance(value, str) else value
    found = [f"raw bytes of a seed {w.hex()}" for w in secrets.draws.windows() if w in data]
    text = data.decode("utf-8", errors="replace").lower()
    for seed in secrets.draws.integers():
        if str(seed) in text or format(seed, "x") in text:
            found.append(f"the seed {seed} as text")
    return found


def scan_files(root: Path, secrets: Secrets) -> tuple[list[str], list[Path]]:
    """Scan every file under ``root``; returns (what was found, the files opened)."""
    found: list[str] = []
    files = sorted(p for p in root.rglob("*") if p.is_file())
    for path in files:
        name = str(path.relative_to(root))
        data = path.read_bytes()
        found.extend(f"{name}: {what}" for what in search_text(data, secrets))
        if path.suffix == ".ckpt":
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
            walk(checkpoint.get("lightning_dp"), secrets, f"{name}[lightning_dp]", found, private_counts=True)
            walk(checkpoint, secrets, name, found, private_counts=False)
        elif path.suffix == ".json":
            walk(json.loads(data), secrets, name, found, private_counts=True)
    return found, files
