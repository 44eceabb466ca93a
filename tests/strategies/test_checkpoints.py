"""Resuming: fresh noise unless a seed is given, and a ledger that must agree with the loop's counts."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyModule, make_trainer

from lightning_dp import DPIS, DPConfigurationError, DPStrategy, HeavyBall, LineSearch
from lightning_dp.slots import StepContext
from lightning_dp.slots.release import ReleaseHook

N, BATCH = 64, 16


def dp(seed: int | None = None) -> DPStrategy:
    """The runs below: heavy-ball momentum, whose own step counter is checked on resume."""
    return DPStrategy(noise_multiplier=1.0, seed=seed, step=HeavyBall())


class RecordNoise(ReleaseHook):
    """Keeps the noise of every release: the noisy sums minus the clipped sums they were made from."""

    def __init__(self) -> None:
        self.noise: list[torch.Tensor] = []
        self._sums: list[torch.Tensor] = []

    def before_noise(self, sums: list[torch.Tensor], ctx: StepContext) -> list[torch.Tensor]:
        self._sums = [s.detach().clone() for s in sums]
        return sums

    def after_release(self, noisy: list[torch.Tensor], ctx: StepContext) -> list[torch.Tensor]:
        self.noise.append(torch.cat([(n - s).flatten() for n, s in zip(noisy, self._sums, strict=True)]))
        return noisy


@pytest.fixture
def checkpoint(tmp_path):
    """A two-step DP checkpoint: seeded, so its saved generator states are known to the resumes below."""
    trainer = make_trainer(dp(seed=3), tmp_path, max_steps=2, max_epochs=5)
    trainer.fit(TinyModule(n=N, batch_size=BATCH))
    path = tmp_path / "two.ckpt"
    trainer.save_checkpoint(path)
    return path


def resumed_noise(path, tmp_path, seed: int | None) -> torch.Tensor:
    """The noise of the third step of a run resumed from ``path``."""
    strategy = dp(seed)
    hook = RecordNoise()
    strategy.engine.release_hooks.append(hook)
    make_trainer(strategy, tmp_path, max_steps=3, max_epochs=5).fit(
        TinyModule(n=N, batch_size=BATCH), ckpt_path=path
    )
    assert len(hook.noise) == 1
    return hook.noise[0]


def test_two_resumes_from_one_checkpoint_draw_different_noise(checkpoint, tmp_path):
    first, second = resumed_noise(checkpoint, tmp_path, None), resumed_noise(checkpoint, tmp_path, None)
    assert first.abs().max() > 0
    # Independent N(0, σ²C²) draws over ~200 coordinates: their difference is nowhere near zero.
    assert (first - second).norm() > 0.5 * first.norm()


def test_with_a_seed_the_same_checkpoint_repeats_the_noise(checkpoint, tmp_path):
    first, second = resumed_noise(checkpoint, tmp_path, 3), resumed_noise(checkpoint, tmp_path, 3)
    torch.testing.assert_close(first, second, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("make_step", "make_sampler", "slot", "pending"),
    [
        (LineSearch, None, "step", "_pending_generators"),
        (None, DPIS, "sampler", "_pending_generators"),
    ],
    ids=["LineSearch", "DPIS"],
)
def test_slots_with_their_own_generators_restart_them_unless_seeded(make_step, make_sampler, slot, pending):
    """The line search's SVT noise and DPIS's noisy statistics are noise too: fresh on every resume."""
    saved_streams = {"svt": torch.Generator().manual_seed(1).get_state()}

    def engine(seed: int | None) -> object:
        kwargs = {"seed": seed} if seed is not None else {}
        strategy = DPStrategy(
            noise_multiplier=1.0,
            seed=seed,
            step=make_step(**kwargs) if make_step else None,
            sampler=make_sampler(**kwargs) if make_sampler else None,
        )
        return strategy.engine

    source = engine(None)
    state = source.state_dict()
    state["slots"][slot]["state"]["generators"] = dict(saved_streams)
    state["noise_generator"] = torch.Generator().manual_seed(2).get_state()
    fresh, seeded = engine(None), engine(7)
    fresh.load_state_dict(state)
    seeded.load_state_dict(state)

    def streams(e: object) -> dict:
        return getattr(e.sampler if slot == "sampler" else e.step_slot, pending)

    assert streams(fresh) == {}
    assert fresh._pending_generator_state is None
    assert set(streams(seeded)) == {"svt"}
    assert seeded._pending_generator_state is not None


def edit_and_resume(path, tmp_path, edit) -> None:
    checkpoint = torch.load(path, weights_only=True)
    for state in (checkpoint["lightning_dp"], *checkpoint["lightning_dp"]["ranks"]):
        edit(checkpoint, state)
    torch.save(checkpoint, tmp_path / "edited.ckpt")
    make_trainer(dp(), tmp_path, max_steps=4, max_epochs=5).fit(
        TinyModule(n=N, batch_size=BATCH), ckpt_path=tmp_path / "edited.ckpt"
    )


def lower_everything_but_the_loop(checkpoint: dict, state: dict) -> None:
    """A consistent-looking ledger of one step in a checkpoint whose loop took two."""
    state["steps"] = 1
    state["ledger_events"] = 1
    state["ledger"]["history"][0]["count"] = 1


def lower_everything(checkpoint: dict, state: dict) -> None:
    """The loop's count lowered too; the momentum step's own counter still says two."""
    lower_everything_but_the_loop(checkpoint, state)
    checkpoint["global_step"] = 1


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lower_everything_but_the_loop, "it records 1 private steps at global_step 2"),
        (lower_everything, "its step (HeavyBall) has taken 2 steps, more than 1"),
    ],
)
def test_a_ledger_that_disagrees_with_the_loop_or_the_slots_is_refused(checkpoint, tmp_path, edit, message):
    with pytest.raises(DPConfigurationError, match="does not add up") as info:
        edit_and_resume(checkpoint, tmp_path, edit)
    assert message in str(info.value)
    assert "resuming from it would report less ε than was spent" in str(info.value)


def test_an_unedited_resume_passes_the_count_checks(checkpoint, tmp_path):
    strategy = dp()
    make_trainer(strategy, tmp_path, max_steps=3, max_epochs=5).fit(
        TinyModule(n=N, batch_size=BATCH), ckpt_path=checkpoint
    )
    assert strategy.engine.steps == strategy.ledger.steps == 3
