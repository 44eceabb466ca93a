"""The piece every single-stream sampler shares: its own generator, saved and restored with it (and the sizes
a Poisson sampler refuses when bound)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_dp.core import validation
from lightning_dp.core.draws import check_population
from lightning_dp.core.rng import make_generator, saved_state
from lightning_dp.slots import Sampler


def check_sizes(num_samples: int, batch_size: int) -> None:
    """What a Poisson sampler refuses when it is bound: an empty training set, one the draws cannot sample
    exactly (``check_population``), a batch size that is not positive."""
    if num_samples <= 0:
        raise ValueError("The training set is empty: DP training needs at least one example.")
    check_population(num_samples)
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}.")


class SeededSampler(Sampler):
    """A sampler with one RNG stream of its own, seeded from ``os.urandom`` unless ``seed`` is given.

    A checkpoint may be loaded before ``bind`` creates the generator; its state then waits until
    :meth:`_start_stream`. ``restored_shape`` lets the strategy refuse a resume on other data.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = validation.seed(seed, owner=type(self).__name__)
        self.generator: torch.Generator | None = None
        self._pending_state: torch.Tensor | None = None
        self.restored_shape: tuple[int | None, float | None] = (None, None)

    def _start_stream(self, stream: str) -> torch.Generator:
        """Create the generator once (named ``stream``) and apply a state loaded before it existed."""
        if self.generator is None:
            self.generator = make_generator(self.seed, stream=stream)
        if self._pending_state is not None:
            self.generator.set_state(self._pending_state)
            self._pending_state = None
        return self.generator

    def state_dict(self) -> dict[str, Any]:
        """q and N (public settings: the declared N with ``dataset_size``) and, in a seeded run only, the
        generator's state (it regenerates every batch)."""
        state: dict[str, Any] = {"sample_rate": self.sample_rate, "num_samples": self.size_for_releases}
        generator = saved_state(self.generator, self.seed)
        if generator is not None:
            state["generator"] = generator
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "generator" in state:
            if self.generator is not None:
                self.generator.set_state(state["generator"])
            else:
                self._pending_state = state["generator"]
        self.restored_shape = (state.get("num_samples"), state.get("sample_rate"))


class DrawnBatches(torch.utils.data.Sampler[list[int]]):
    """Yields ``num_batches`` index batches per pass, each a fresh call of a sampler's ``draw``."""

    def __init__(self, draw: Callable[[], list[int]], num_batches: int) -> None:
        self.draw = draw
        self.num_batches = num_batches

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.num_batches):
            yield self.draw()
