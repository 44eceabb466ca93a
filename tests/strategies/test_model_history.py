"""A model's history (``ModelHistory``, ``strategies/checkpoints.py``; issue #37 item 5): a model privately
trained before carries its ledger (in memory and in its checkpoint); a new strategy fitting it continues that
ledger, or refuses naming why the two cannot be added up."""

from __future__ import annotations

import json

import pytest
from conftest import TinyModule, make_trainer

from lightning_dp import DPConfigurationError, DPStrategy, PrivacyCallback, load_from_checkpoint
from lightning_dp.accounting import compute_epsilon

SIGMA, Q = 1.0, 32 / 256  # TinyModule's defaults: N = 256, batch 32: 8 steps an epoch


def _eps(steps: int) -> float:
    return compute_epsilon(noise_multiplier=SIGMA, sample_rate=Q, steps=steps, delta=1e-5)


def test_a_new_strategy_continues_the_models_ledger_and_the_report_covers_every_release(tmp_path):
    module = TinyModule()
    first = DPStrategy(noise_multiplier=SIGMA)
    make_trainer(first, max_epochs=2).fit(module)
    assert first.epsilon == pytest.approx(_eps(16), rel=1e-9)

    second = DPStrategy(noise_multiplier=SIGMA)
    trainer = make_trainer(second, tmp_path, max_epochs=1, callbacks=[PrivacyCallback()])
    with pytest.warns(UserWarning, match="trained privately before"):
        trainer.fit(module)
    assert second.engine.steps == 8  # its own steps; the ledger holds all 24
    assert second.epsilon == pytest.approx(_eps(24), rel=1e-9)  # not ε of its own 8 steps
    report = json.loads((tmp_path / "privacy_report.json").read_text())
    assert report["epsilon"] == pytest.approx(_eps(24), rel=1e-9)
    assert report["earlier_ledger_events"] == 16

    # and in its checkpoint: a model loaded from the file by lightning_dp.load_from_checkpoint carries it
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    loaded = load_from_checkpoint(TinyModule, tmp_path / "model.ckpt")
    third = DPStrategy(noise_multiplier=SIGMA)
    with pytest.warns(UserWarning, match="trained privately before"):
        make_trainer(third, max_epochs=1).fit(loaded)
    assert third.epsilon == pytest.approx(_eps(32), rel=1e-9)


def test_the_same_strategy_fitting_again_does_not_count_its_releases_twice():
    module = TinyModule()
    strategy = DPStrategy(noise_multiplier=SIGMA)
    trainer = make_trainer(strategy, max_epochs=1)
    trainer.fit(module)
    trainer.fit_loop.max_epochs = 2
    trainer.fit(module)
    assert strategy.engine.steps == 16
    assert strategy.epsilon == pytest.approx(_eps(16), rel=1e-9)


def test_a_continuation_that_cannot_add_up_is_refused_by_name():
    module = TinyModule()
    make_trainer(DPStrategy(noise_multiplier=SIGMA), max_epochs=1).fit(module)
    with pytest.raises(DPConfigurationError, match=r"delta=1e-06.*Use delta=1e-05"):
        make_trainer(DPStrategy(noise_multiplier=SIGMA, delta=1e-6), max_epochs=1).fit(module)
    x, y = module.x, module.y
    module.x, module.y = x[:200], y[:200]  # another data set size
    with pytest.raises(DPConfigurationError, match=r"N=256 examples; this fit has N=200"):
        make_trainer(DPStrategy(noise_multiplier=SIGMA), max_epochs=1).fit(module)
    module.x, module.y = x, y
    with pytest.raises(DPConfigurationError, match="earlier private training already spent"):
        make_trainer(DPStrategy(target_epsilon=0.9 * _eps(8)), max_epochs=1).fit(module)
    strategy = DPStrategy(noise_multiplier=SIGMA)  # the refusals left the model's history as it was
    make_trainer(strategy, max_epochs=1).fit(module)
    assert strategy.epsilon == pytest.approx(_eps(16), rel=1e-9)


def test_a_resume_continues_the_checkpoints_ledger_which_belongs_to_its_weights(tmp_path):
    """ckpt_path replaces the module's weights, so the checkpoint's ledger replaces the module's history."""
    module = TinyModule()
    first = make_trainer(DPStrategy(noise_multiplier=SIGMA), max_epochs=1)
    first.fit(module)
    first.save_checkpoint(tmp_path / "one.ckpt")
    with pytest.warns(UserWarning, match="trained privately before"):
        make_trainer(DPStrategy(noise_multiplier=SIGMA), max_epochs=2).fit(module)  # the model now has 24
    resumed = DPStrategy(noise_multiplier=SIGMA)
    make_trainer(resumed, max_epochs=2).fit(module, ckpt_path=tmp_path / "one.ckpt")
    assert resumed.engine.steps == 16
    assert resumed.epsilon == pytest.approx(_eps(16), rel=1e-9)
    assert module.lightning_dp_history.epsilon() == pytest.approx(_eps(16), rel=1e-9)
