"""What a run's files and pickles must not hold (issues #35, #47): a generator state, a seed the run drew,
a private statistic, the noise it added.

``UrandomDraws`` records every ``os.urandom`` draw of the process (the seeds of unseeded streams), and
``NoiseRecord`` every gradient release's noise and released values. ``scan_files`` opens every file under a
folder: checkpoints are loaded and every nested value walked; every other file is searched as text (decimal
seeds) and as bytes (a seed's 8 raw bytes); JSON is walked as well. ``scan_pickle`` searches a pickle's
bytes the same way, then loads it and walks the whole object graph. Generic on purpose: a slot added later
is scanned without a change here.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_dp.slots.release import Releases

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


NOISE_SHARE = 0.5
"""A value whose part outside the released values' span lies this much in the span of the added noise is noise."""


class NoiseRecord:
    """Every gradient release of this process: the noise it added and the values it released, per tensor and
    concatenated (install with ``record.install(monkeypatch)``; one process, so the all-reduce is the identity).

    ``share(array)`` tells noise from what may be kept: a row of a stored array is first stripped of the span
    of every released value (a noisy sum, a finalized gradient: momentum, weights minus their initial values
    and the gradients lie there), and what remains is measured against the span of the noise. Noise itself
    (or a clipped sum: the released value minus the noise) keeps all of its remainder there, a function of
    the released values almost none of it, a random vector about (noise vectors) / (its length).
    """

    def __init__(self) -> None:
        self.noise: dict[int, list[np.ndarray]] = {}
        self.released: dict[int, list[np.ndarray]] = {}
        self._bases: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}

    def _add(self, kept: dict[int, list[np.ndarray]], vectors: list[np.ndarray]) -> None:
        for v in [*vectors, np.concatenate(vectors)] if len(vectors) > 1 else vectors:
            kept.setdefault(v.size, []).append(v)

    def install(self, monkeypatch: Any) -> None:
        real_noisy, real_release = Releases.noisy, Releases.release_gradient

        def flat(tensors: list[torch.Tensor]) -> list[np.ndarray]:
            return [t.detach().cpu().double().flatten().numpy().copy() for t in tensors]

        def noisy(
            releases: Releases, sums: list[torch.Tensor], *args: Any, **kwargs: Any
        ) -> list[torch.Tensor]:
            before = flat(sums)
            out = real_noisy(releases, sums, *args, **kwargs)
            after = flat(out)
            self._add(self.noise, [a - b for a, b in zip(after, before, strict=True)])
            self._add(self.released, after)
            return out

        def release_gradient(releases: Releases, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
            out = real_release(releases, *args, **kwargs)
            self._add(self.released, flat(out))
            return out

        monkeypatch.setattr(Releases, "noisy", noisy)
        monkeypatch.setattr(Releases, "release_gradient", release_gradient)

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.noise.values())

    @staticmethod
    def _basis(vectors: np.ndarray) -> np.ndarray:
        """An orthonormal basis ([L, rank]) of the span of ``vectors`` ([L, k])."""
        if vectors.size == 0:
            return np.zeros((vectors.shape[0], 0))
        u, s, _ = np.linalg.svd(vectors, full_matrices=False)
        return u[:, s > s.max() * 1e-9] if s.size and s.max() > 0 else u[:, :0]

    def _spans(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Bases of the released values' span and of the noise's span outside it (vectors of ``length``)."""
        noise = self.noise[length]
        cached = self._bases.get(length)
        if cached is None or cached[0] != len(noise):
            released = np.array(self.released.get(length, [])).T.reshape(length, -1)
            kept = self._basis(released)
            rest = np.array(noise).T
            cached = (len(noise), kept, self._basis(rest - kept @ (kept.T @ rest)))
            self._bases[length] = cached
        return cached[1], cached[2]

    def share(self, array: np.ndarray, max_rows: int = 64) -> float:
        """The largest noise share of a row of ``array`` (rows as long as a recorded noise vector)."""
        values = np.asarray(array, dtype=np.float64).ravel()
        best = 0.0
        for length, noise in self.noise.items():
            if values.size % length or 8 * (len(noise) + len(self.released.get(length, []))) > length:
                continue  # a random row would lie largely in the span: nothing to tell
            kept, noise_rest = self._spans(length)
            for row in values.reshape(-1, length)[:max_rows]:
                rest = row - kept @ (kept.T @ row)
                size = float(rest @ rest)
                if np.isfinite(size) and size > 1e-10 * float(row @ row):
                    best = max(best, float(np.sum((noise_rest.T @ rest) ** 2)) / size)
        return best


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
    noise: NoiseRecord | None = None
    """The noise the run added (None: not looked for)."""


def _noise_found(array: np.ndarray, secrets: Secrets, where: str) -> list[str]:
    if secrets.noise is None or array.dtype.kind != "f" or array.size < 64:
        return []
    share = secrets.noise.share(array)
    if share <= NOISE_SHARE:
        return []
    return [f"{where}: noise the run added ({share:.2f} of what the releases do not explain is in its span)"]


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
        found.extend(_noise_found(array, secrets, where))
        return
    if isinstance(value, list | tuple):
        if len(value) >= 64 and all(type(v) is float for v in value):
            found.extend(_noise_found(np.array(value), secrets, where))
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


def _children(value: Any) -> list[tuple[str, Any]]:
    """What an object of the graph holds: items, elements, attributes (``__dict__`` and ``__slots__``)."""
    if isinstance(value, dict):
        return [(str(k), v) for k, v in value.items()]
    if isinstance(value, list | tuple | set | frozenset):
        return [(f"[{i}]", v) for i, v in enumerate(value)]
    out = []
    if hasattr(value, "__dict__") and not isinstance(value, type):
        out += [(f".{k}", v) for k, v in vars(value).items()]
    for name in getattr(type(value), "__slots__", ()):
        if hasattr(value, name):
            out.append((f".{name}", getattr(value, name)))
    return out


def walk_objects(root: Any, secrets: Secrets, where: str) -> list[str]:
    """Every object reachable from ``root`` (each once): generator states holding a seed the run drew, seeds
    as numbers, and noise the run added, in any tensor or array (text is left to ``search_text``)."""
    found: list[str] = []
    windows, seeds = secrets.draws.windows(), secrets.draws.integers()
    seen: set[int] = set()
    stack = [(where, root)]
    while stack:
        path, value = stack.pop()
        if id(value) in seen or isinstance(value, type | bool | str | bytes | type(None)):
            continue
        seen.add(id(value))
        if isinstance(value, torch.Generator):
            if any(w in value.get_state().numpy().tobytes() for w in windows):
                found.append(f"{path}: a generator whose state holds a seed the run drew")
            continue
        array = _as_array(value)
        if array is not None:
            if array.dtype == np.uint8 and array.size in (CPU_STATE_BYTES, CUDA_STATE_BYTES):
                found.append(f"{path}: a uint8 tensor of a generator state's size ({array.size} bytes)")
            found.extend(_noise_found(array, secrets, path))
            continue
        if isinstance(value, int | float):
            if float(value).is_integer() and int(value) in seeds:
                found.append(f"{path}: a seed the run drew ({value})")
            continue
        stack.extend((path + name, child) for name, child in _children(value))
    return found


def scan_pickle(data: bytes, secrets: Secrets, where: str) -> list[str]:
    """A pickle's bytes searched for seeds, then the object it loads walked (``walk_objects``). The draws
    are copied first: loading draws fresh seeds for the unseeded generators it holds, and those are new."""
    found = [f"{where}: {what}" for what in search_text(data, secrets)]
    before = UrandomDraws()
    before.draws = list(secrets.draws.draws)
    frozen = Secrets(before, secrets.num_samples, noise=secrets.noise)
    return found + walk_objects(pickle.loads(data), frozen, where)
