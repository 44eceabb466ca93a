"""Random generators for sampling and noise, kept apart from the global torch RNG.

By default each generator is seeded from ``os.urandom`` so neither ``seed_everything`` nor a leaked
seed makes the noise predictable; a user-given seed makes runs reproducible (tests, debugging).
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

import torch


def make_generator(seed: int | None, stream: str, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one named stream; independent streams come from one user seed via hashing.
    Unseeded: an :class:`UnseededGenerator` (its state never leaves the process)."""
    if seed is None:
        return _fresh_unseeded(str(device))
    digest = hashlib.sha256(f"{seed}:{stream}".encode()).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return generator


class UnseededGenerator(torch.Generator):
    """A generator seeded from ``os.urandom`` whose state is not written by ``pickle``.

    Its state is its seed: pickling a sampler, a slot or a ``DataLoader`` that holds one (to save it, or
    to send it to another process) would let whoever reads the bytes regenerate every draw. Unpickled, it
    is a new generator with a fresh ``os.urandom`` seed; ``copy.deepcopy`` (in the process) keeps the state.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_fresh_unseeded, (str(self.device),))

    def __deepcopy__(self, memo: dict[int, Any]) -> UnseededGenerator:
        copied = UnseededGenerator(device=self.device)
        copied.set_state(self.get_state())
        return copied


def _fresh_unseeded(device: str) -> UnseededGenerator:
    generator = UnseededGenerator(device=device)
    generator.manual_seed(int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1))
    return generator


#: Largest value of a :func:`secure_words` word plus one: 63 uniform bits, so every word is a non-negative
#: int64 and two of them compare as one 126-bit number with signed integer arithmetic on any device.
SECURE_WORD = 1 << 63


def secure_words(count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``count`` independent uniform integers in [0, 2⁶³) from the operating system's CSPRNG (``os.urandom``),
    as an int64 tensor on ``device``. No torch generator is involved: there is no state to seed, save or
    regenerate, and nothing of it reaches a checkpoint (the secure noise of ``DiscreteGaussian`` reads them)."""
    raw = (
        torch.frombuffer(bytearray(os.urandom(8 * count)), dtype=torch.int64)
        if count
        else torch.empty(0, dtype=torch.int64)
    )
    return (raw & (SECURE_WORD - 1)).to(device)


#: Keys under which a slot's ``state_dict`` stores generator states (one state, or a dict of named ones).
GENERATOR_KEYS = ("generator", "generators")

SEEDED_RUN_WARNING = (
    "lightning-dp: this run is seeded ({owners}), so its sampling and noise are reproducible: its checkpoints "
    "keep the generator states (and, for DPIS, its per-example norms), and whoever holds a checkpoint or the "
    "seed can regenerate every noise vector and every batch, then read the exact clipped gradient sums off "
    "the weights. Use seeds for tests and debugging only; leave seed unset (os.urandom) for a run whose files "
    "leave your hands."
)


def saved_state(generator: torch.Generator | None, seed: int | None) -> torch.Tensor | None:
    """``generator``'s state for a checkpoint: only where ``seed`` was given (then it repeats the run).

    An unseeded generator's state holds its ``os.urandom`` seed (a CPU state's first 8 bytes): whoever
    holds the file could regenerate every draw, and a resume ignores it anyway (fresh streams).
    """
    return None if seed is None or generator is None else generator.get_state()


def saved_states(generators: dict[str, torch.Generator], seed: int | None) -> dict[str, torch.Tensor]:
    """The named generators' states for a checkpoint; empty unless ``seed`` was given (:func:`saved_state`)."""
    return {} if seed is None else {name: g.get_state() for name, g in generators.items()}


def without_generator_states(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` minus its saved generator states, so a resume draws from fresh ``os.urandom`` streams.

    Restoring them would make two runs resumed from one checkpoint draw the *same* noise (the difference
    of their releases then cancels it); a slot whose generators are absent seeds new ones itself.
    """
    out = {key: value for key, value in state.items() if key != "generator"}
    if "generators" in out:
        out["generators"] = {}
    return out


class NoisePrefetch:
    """The standard normal draws of the next gradient release, made on a background thread while the
    step's forward and backward run, so they are off the step's critical path (CPU).

    They are exactly the draws the release would make itself: the same generator, the same order and the
    same slices as ``Noise.add_noise`` (one ``normal_`` per slice of each parameter-shaped sum), so the
    released noise is bit-identical to drawing it in the release. Whoever reads the generator's state for
    a checkpoint gets the state from before these draws (:meth:`state_before`), so a run resumed with a
    seed draws them again, and nothing else may draw from the generator while they are pending (the
    engine enables this only for steps whose slots draw nothing else from it). A release whose sums do
    not match what was drawn for (other shapes, a release hook's extra tensors, σ = 0) rewinds the
    generator and draws as usual. The buffers are one fp32 copy of the parameters, held between steps
    and refilled in place once the release has added them.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._generator: torch.Generator | None = None
        self._layout: tuple[Any, ...] | None = None
        self._buffers: list[torch.Tensor] = []
        self._state: torch.Tensor | None = None
        self._spare: list[torch.Tensor] = []
        self._spare_layout: tuple[Any, ...] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with nothing drawn: the pending draws are the next release's noise, the spare buffers the
        last one's, and the saved state is the generator's (its ``os.urandom`` seed in an unseeded run)."""
        return NoisePrefetch().__dict__

    @staticmethod
    def layout(tensors: list[torch.Tensor]) -> tuple[Any, ...] | None:
        """What a draw for ``tensors`` depends on; None where it cannot be drawn ahead (not all contiguous
        CPU tensors of one floating dtype)."""
        if not tensors or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
            return None
        dtype = tensors[0].dtype
        if not dtype.is_floating_point or any(t.dtype != dtype for t in tensors):
            return None
        return (dtype, tuple(tuple(t.shape) for t in tensors))

    def start(self, generator: torch.Generator, layout: tuple[Any, ...], slice_size: int) -> None:
        """Begin drawing, on a background thread, the noise of a release of sums laid out as ``layout``,
        ``slice_size`` values per ``normal_`` (the release's own slices)."""
        self.cancel()
        dtype, shapes = layout
        if self._spare_layout == layout:  # refill the buffers the last release consumed
            buffers = self._spare
        else:
            buffers = [torch.empty(shape, dtype=dtype) for shape in shapes]
        self._spare, self._spare_layout = [], None

        def draw() -> None:
            for buffer in buffers:
                for part in buffer.view(-1).split(slice_size):
                    part.normal_(generator=generator)

        self._state = generator.get_state()
        self._generator, self._layout, self._buffers = generator, layout, buffers
        self._thread = threading.Thread(target=draw, name="lightning-dp-noise")  # joined at exit
        self._thread.start()

    def take(self, generator: torch.Generator, layout: tuple[Any, ...] | None) -> list[torch.Tensor] | None:
        """The pending draws if they were made from ``generator`` for sums laid out as ``layout`` (then they
        are consumed), else None, with the generator rewound to before them."""
        if self._thread is None:
            return None
        self._thread.join()
        if generator is self._generator and layout == self._layout:
            buffers = self._buffers
            self._clear()
            self._spare, self._spare_layout = buffers, layout  # the caller uses them now; refilled next
            return buffers
        self.cancel()
        return None

    def cancel(self) -> None:
        """Drop the pending draws and rewind their generator to before them."""
        if self._thread is None:
            return
        self._thread.join()
        assert self._generator is not None
        assert self._state is not None
        self._generator.set_state(self._state)
        self._clear()

    def state_before(self, generator: torch.Generator) -> torch.Tensor | None:
        """The state ``generator`` had before pending draws from it (None: nothing pending from it)."""
        return self._state if self._thread is not None and generator is self._generator else None

    def _clear(self) -> None:
        self._thread, self._generator, self._layout, self._buffers, self._state = None, None, None, [], None
