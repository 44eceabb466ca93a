"""Options as objects (issue #52): ``checks=Checks(...)``, ``sampler=UserPoisson(...)``, ``user_bound=UserBound(...)``.

The new forms build the run the old keywords built (the same config, slots and weights), the old keywords
warn with their new form and never show a value, old and new forms of one setting together are refused,
and LightningCLI YAML takes the new forms (the shipped user-level config among them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import warnings
from pathlib import Path

import pytest
import torch
from conftest import TinyModule, make_trainer

from lightning_dp import (
    Checks,
    DPConfigurationError,
    DPDDPStrategy,
    DPFSDPStrategy,
    DPStrategy,
    UserBound,
    UserPoisson,
)
from lightning_dp.strategies.ddp import slot_settings

ROOT = Path(__file__).resolve().parents[2]
OLD_CHECKS = dict(
    check_sensitivity="every_step",
    check_overhead=0.2,
    isolate_examples=False,
    public_buffers=["ema.*"],
    data_changes="public",
)
NEW_CHECKS = Checks(sensitivity="every_step", overhead=0.2, public_buffers=("ema.*",), data_changes="public")


def _quietly(**kwargs) -> DPStrategy:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return DPStrategy(**kwargs)


def _fit(strategy: DPStrategy, batch: int, tmp_path: Path) -> list[torch.Tensor]:
    torch.manual_seed(0)  # the same initial weights for either form
    module = TinyModule(n=2 * batch, batch_size=batch)
    make_trainer(strategy, tmp_path, max_steps=2).fit(module)
    return [p.detach() for p in module.parameters()]


# -- the new forms build the old forms' runs -----------------------------------------------------------------
@pytest.mark.parametrize("batch", [8, 1024])
def test_checks_object_and_old_check_keywords_build_the_same_run(batch, tmp_path):
    old = _quietly(noise_multiplier=1.0, seed=0, **OLD_CHECKS)
    new = DPStrategy(noise_multiplier=1.0, seed=0, checks=NEW_CHECKS)
    assert old.config == new.config
    weights = [_fit(s, batch, tmp_path / name) for name, s in (("old", old), ("new", new))]
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))
    assert (old.epsilon, old.engine.steps) == (new.epsilon, new.engine.steps)
    summary = new.checks.summary()  # what the privacy report says the checks did
    assert summary == old.checks.summary()
    assert (summary["mixing"]["setting"], summary["mixing"]["overhead_budget"]) == ("every step", 0.2)
    assert summary["mixing"]["checked_steps"] == 2  # every step was checked
    assert summary["state_writes"]["public_buffers"] == ["ema.*"]


@pytest.mark.parametrize("batch", [8, 1024])
def test_user_sampler_and_old_user_keywords_build_the_same_run(batch, tmp_path):
    users = torch.arange(2 * batch) // 2  # batch users of two examples each
    kwargs = dict(examples_per_user=2, users_per_step=batch // 2)
    old = _quietly(
        noise_multiplier=1.0, seed=0, privacy_unit="user", user_key=users, unit_selection="cycle",
        unit_reduction="sum", **kwargs,
    )  # fmt: skip
    sampler = UserPoisson(user_key=users, selection="cycle", reduction="sum", seed=0, **kwargs)
    new = DPStrategy(noise_multiplier=1.0, seed=0, sampler=sampler)
    assert type(old.engine.sampler) is UserPoisson
    assert slot_settings(old.engine.sampler) == slot_settings(new.engine.sampler)
    assert old.config.user_level
    assert new.config.user_level
    weights = [_fit(s, batch, tmp_path / name) for name, s in (("old", old), ("new", new))]
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))
    assert (old.epsilon, old.engine.steps) == (new.epsilon, new.engine.steps)
    assert old.privacy_unit == new.privacy_unit
    assert new.privacy_unit is not None
    assert new.privacy_unit.num_units == batch
    reports = [
        json.loads(next((tmp_path / name).rglob("privacy_report.json")).read_text())
        for name in ("old", "new")
    ]
    unit = ("privacy_unit", "unit_key", "examples_per_unit", "unit_selection", "unit_reduction", "statement")
    assert [{k: r[k] for k in unit} for r in reports] == [{k: reports[0][k] for k in unit}] * 2
    assert reports[1]["unit_key"] == "<Tensor>"  # the sampler's key (the report read only the old keyword)


def test_user_bound_and_old_keywords_build_the_same_example_level_run():
    owners = torch.arange(64) // 8
    old = _quietly(noise_multiplier=1.0, seed=0, user_key=owners, max_examples_per_user=2)
    new = DPStrategy(noise_multiplier=1.0, seed=0, user_bound=UserBound(owners, 2))
    assert old.config == new.config
    assert not new.config.user_level
    assert new.engine.sampler.name == "Poisson"


def test_every_strategy_takes_the_option_objects():
    for cls in (DPStrategy, DPDDPStrategy, DPFSDPStrategy):
        strategy = cls(noise_multiplier=1.0, checks=Checks(sensitivity=False), user_bound=UserBound("u", 3))
        assert strategy.config.checks.sensitivity is False
        assert strategy.config.user_bound == UserBound("u", 3)
        assert strategy.config.owner == cls.__name__


# -- the old keywords warn, by name, with the new form -------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "new_form"),
    [
        (dict(check_sensitivity=False, isolate_examples=True), "checks=Checks(sensitivity=..., isolate_examples=...)"),
        (dict(privacy_unit="user", user_key=torch.arange(40) // 4, examples_per_user=2, users_per_step=5),
         "sampler=UserPoisson(user_key=..., examples_per_user=..., users_per_step=...)"),
        (dict(seed=3, privacy_unit="user", user_key="u", examples_per_user=2, users_per_step=5),
         "sampler=UserPoisson(user_key=..., examples_per_user=..., users_per_step=..., seed=<the same seed>)"),
        (dict(user_key=torch.arange(40) // 4, max_examples_per_user=2),
         "user_bound=UserBound(user_key=..., max_examples_per_user=...)"),
    ],
)  # fmt: skip
def test_an_old_keyword_warns_at_the_callers_line_with_the_new_form_and_no_value(kwargs, new_form):
    with pytest.warns(DeprecationWarning, match="deprecated keywords") as caught:
        DPStrategy(noise_multiplier=1.0, **kwargs)
    messages = [str(w.message) for w in caught if w.category is DeprecationWarning]
    assert len(messages) == 1
    assert new_form in messages[0]
    assert caught[0].filename == __file__  # points at the line that built the strategy
    for value in ("tensor(", "=False", "=True", "='u'"):  # names only, never a value (the ids themselves)
        assert value not in messages[0]


def test_an_old_keyword_without_effect_says_so():
    with pytest.warns(DeprecationWarning, match=r"user_key is deprecated and has no effect here"):
        strategy = DPStrategy(noise_multiplier=1.0, user_key="u")
    assert strategy.config.user_bound is None


def test_the_new_forms_warn_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DPStrategy(noise_multiplier=1.0, checks=Checks(isolate_examples=True), sampler=UserPoisson("u", 2, 4))
        DPStrategy(noise_multiplier=1.0, checks=NEW_CHECKS)
        DPStrategy(noise_multiplier=1.0, user_bound=UserBound("u", 2))


# -- refused: both forms of one setting, objects of the wrong kind, bad values --------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(check_sensitivity=False, checks=Checks(overhead=0.1)), "either as checks=Checks"),
        (dict(user_key="u", max_examples_per_user=2, user_bound=UserBound("u", 2)), "not both"),
        (dict(sampler=UserPoisson("u", 2, 4), user_bound=UserBound("u", 2)), "samples users: pass max_examples"),
        (dict(sampler=UserPoisson("u", 2, 4), checks=Checks(data_changes="public")), "U, and so q"),
        (dict(checks={"sensitivity": False}), r"checks must be a lightning_dp\.Checks\(\.\.\.\), got dict"),
        (dict(user_bound=("u", 2)), r"user_bound must be a lightning_dp\.UserBound"),
    ],
)  # fmt: skip
def test_both_forms_or_a_wrong_object_are_refused(kwargs, match):
    with pytest.raises(DPConfigurationError, match=match):
        _quietly(noise_multiplier=1.0, **kwargs)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: Checks(sensitivity="sometimes"), "Checks: sensitivity must be True or False"),
        (lambda: Checks(overhead=0), r"Checks: overhead must be in \(0, 1\]"),
        (lambda: Checks(public_buffers=[1]), "public_buffers must be buffer names"),
        (lambda: Checks(data_changes="maybe"), "Checks: data_changes must be 'refuse' or 'public'"),
        (lambda: UserBound(None, 2), "UserBound: user_key=None"),  # type: ignore[arg-type]
        (lambda: UserBound("u", 0), "UserBound: max_examples_per_user must be"),
    ],
)
def test_the_option_objects_validate_themselves(build, match):
    with pytest.raises(DPConfigurationError, match=match):
        build()


def test_the_option_objects_are_frozen():
    checks = Checks(public_buffers=["ema"])
    assert checks.public_buffers == ("ema",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        checks.sensitivity = False  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        UserBound("u", 2).max_examples_per_user = 3  # type: ignore[misc]


# -- LightningCLI YAML -------------------------------------------------------------------------------------------
NEW_YAML = """
strategy:
  class_path: lightning_dp.DPStrategy
  init_args:
    noise_multiplier: 1.0
    seed: 0
    checks: {sensitivity: every_step, overhead: 0.2, public_buffers: [ema.*], isolate_examples: true}
    sampler:
      class_path: lightning_dp.UserPoisson
      init_args: {user_key: user_id, examples_per_user: 2, users_per_step: 4, seed: 0}
"""
OLD_YAML = """
strategy:
  class_path: lightning_dp.DPStrategy
  init_args:
    noise_multiplier: 1.0
    seed: 0
    check_sensitivity: every_step
    check_overhead: 0.2
    public_buffers: [ema.*]
    isolate_examples: true
    privacy_unit: user
    user_key: user_id
    examples_per_user: 2
    users_per_step: 4
"""


def _from_yaml(text: str, tmp_path: Path) -> DPStrategy:
    from jsonargparse import ArgumentParser

    from lightning_dp.strategies.base import DPStrategyBase

    path = tmp_path / "strategy.yaml"
    path.write_text(text)
    parser = ArgumentParser()
    parser.add_argument("--config", action="config")
    parser.add_argument("--strategy", type=DPStrategyBase)
    strategy = parser.instantiate(parser.parse_args(["--config", str(path)])).strategy
    assert isinstance(strategy, DPStrategy)
    return strategy


def test_yaml_new_and_old_forms_build_the_same_strategy(tmp_path):
    new = _from_yaml(NEW_YAML, tmp_path)
    assert new.config.checks == Checks("every_step", 0.2, isolate_examples=True, public_buffers=("ema.*",))
    with pytest.warns(DeprecationWarning, match="deprecated keywords"):
        old = _from_yaml(OLD_YAML, tmp_path)
    assert old.config.checks == new.config.checks
    assert slot_settings(old.engine.sampler) == slot_settings(new.engine.sampler)
    assert new.engine.sampler.user_key == "user_id"


def test_the_shipped_user_level_config_builds_user_sampling_without_a_warning(tmp_path):
    from lightning_dp.commands.lightning_cli import DPLightningCLI

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*deprecated keywords", category=DeprecationWarning)
        cli = DPLightningCLI(
            args=["--config", str(ROOT / "configs" / "digits_users.yaml"), "--trainer.logger", "false"],
            run=False,
        )
    sampler = cli.trainer.strategy.engine.sampler
    assert isinstance(sampler, UserPoisson)
    assert (sampler.user_key, sampler.examples_per_user, sampler.users_per_step) == ("user_id", 10, 13)


def test_fit_help_lists_the_options_and_the_checks_fields():
    from lightning_dp.commands.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["fit", "--trainer.strategy.help", "lightning_dp.DPStrategy"])
    text = out.getvalue()
    for option in ("target_epsilon", "checks.sensitivity", "checks.data_changes", "user_bound", "sampler"):
        assert f"--trainer.strategy.{option}" in text, option
    assert "deprecated: pass checks=Checks(sensitivity=...) instead." in " ".join(text.split())
