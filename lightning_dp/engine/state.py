"""What the engine holds across steps and saves: the four slots, the releases (with the ledger), the step
count and the noise generator; the state a checkpoint holds and a pickle keeps of them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_dp.accounting import PrivacyLedger
from lightning_dp.core.rng import make_generator, without_generator_states
from lightning_dp.engine.inputs import StepInputs
from lightning_dp.slots import Clipping, Noise, Sampler, Step, iter_slots
from lightning_dp.slots.release import AllReduce, ReleaseHook, Releases


class EngineState(StepInputs):
    """The engine's slots, releases, step count and noise generator (the base of ``PrivateStepEngine``),
    with their checkpoint (``state_dict``/``load_state_dict``) and pickle forms."""

    def __init__(
        self,
        slots: tuple[Sampler, Clipping, Noise, Step],
        releases: Releases,
        max_grad_norm: float,
        seed: int | None,
    ) -> None:
        super().__init__()  # the inputs the strategy hands in (StepInputs), all unset
        self.sampler, self.clipping, self.noise, self.step_slot = slots
        self.releases = releases
        self._max_grad_norm = max_grad_norm
        self.seed = seed
        self.steps = 0
        self.generator: torch.Generator | None = None
        self._pending_generator_state: Tensor | None = None

    @property
    def max_grad_norm(self) -> float:
        """The clipping bound C of the next release: the configured one unless the clipping or the step adapts it."""
        return self.step_slot.clip_bound(self.clipping.clip_bound(self._max_grad_norm))

    # -- the run's releases (one Releases service; these views keep the strategy's reads working) -----
    @property
    def ledger(self) -> PrivacyLedger:
        return self.releases.ledger

    @property
    def release_hooks(self) -> list[ReleaseHook]:
        return self.releases.hooks

    def connect(self, rank: int, world_size: int, all_reduce: AllReduce | None) -> None:
        """Once the processes exist: this rank, their number and the sum over them (None on one process)."""
        self.releases.connect(rank, world_size, all_reduce)
        self.noise.link_ranks(world_size)

    @property
    def rank(self) -> int:
        """This process's rank (set by :meth:`connect`, as are the two below)."""
        return self.releases.rank

    @property
    def world_size(self) -> int:
        return self.releases.world_size

    @property
    def all_reduce(self) -> AllReduce | None:
        return self.releases.all_reduce_fn

    def _noise_generator(self, device: torch.device) -> torch.Generator:
        if self.generator is None or self.generator.device != device:
            self.generator = make_generator(self.seed, stream=f"noise/{self.rank}", device=device)
            if self._pending_generator_state is not None:
                self.generator.set_state(self._pending_generator_state)
                self._pending_generator_state = None
        return self.generator

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The privacy state a checkpoint holds: the ledger, the step count, the slots' states and, only in
        a seeded run, the generator states (an unseeded run's would let the file's holder regenerate its noise)."""
        slots = {name: {"name": slot.name, "state": self._slot_state(slot)} for name, slot in self._slots()}
        return {
            "version": 1,
            "steps": self.steps,
            "ledger": self.ledger.state_dict(),
            "ledger_events": self.ledger.steps,
            "prior_events": self.prior_events,
            "noise_generator": self._noise_generator_state(),
            "slots": slots,
            "max_grad_norm": self.max_grad_norm,
        }

    def seeded(self) -> list[str]:
        """Who draws from a user-given seed (the strategy, a slot): their states stay in checkpoints."""
        owners = ["seed"] if self.seed is not None else []
        return owners + [
            f"{name}={slot.name}(seed=...)" for name, slot in self._slots() if slot.seed is not None
        ]

    @staticmethod
    def _slot_state(slot: Any) -> Any:
        """A slot's saved state; an unseeded slot's generator states are dropped even if it saved them."""
        state = slot.state_dict()
        return without_generator_states(state) if slot.seed is None and isinstance(state, dict) else state

    def _noise_generator_state(self) -> Tensor | None:
        """The noise generator's state as of the last release (before any draws made ahead for the next);
        None in an unseeded run (:func:`~lightning_dp.core.rng.saved_state`)."""
        if self.generator is None or self.seed is None:
            return None
        before = self.releases.prefetch.state_before(self.generator)
        return before if before is not None else self.generator.get_state()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled like a checkpoint: the noise generator only as the state a seeded run saves (none without a
        seed), taken before any draws made ahead, so a seeded copy draws the next release's noise again."""
        state = dict(self.__dict__)
        if self.generator is not None:
            state["_pending_generator_state"] = self._noise_generator_state()
        state["generator"] = None
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the ledger, the step count and the slots; random streams only where a seed was given.

        Without a seed every generator (noise, and the slots' own) starts afresh from ``os.urandom``:
        two runs resumed from one checkpoint must not draw the same noise. With ``seed`` the saved
        states are restored, so the same seed and checkpoint repeat the run exactly.
        """
        for name, slot in self._slots():
            saved = state["slots"][name]
            if saved["name"] != slot.name:
                raise ValueError(
                    f"The checkpoint was trained with {name}={saved['name']}, this run uses {slot.name}: "
                    "resuming with a different mechanism cannot be priced by the ledger."
                )
            slot_state = saved["state"]
            if slot.seed is None and isinstance(slot_state, dict):
                slot_state = without_generator_states(slot_state)
            slot.load_state_dict(slot_state)
        self.ledger.load_state_dict(state["ledger"])
        self.steps = int(state["steps"])
        self._prior_events = int(state.get("prior_events", 0))
        self.generator = None
        self._pending_generator_state = state.get("noise_generator") if self.seed is not None else None

    def resume_inside_step(self) -> None:
        """The state just loaded was saved inside a step: every slot learns the steps released so far."""
        for _, slot in self._slots():
            slot.resume_at(self.steps)

    def _slots(self) -> list[tuple[str, Any]]:
        return list(iter_slots(self.sampler, self.clipping, self.noise, self.step_slot))
