"""PrivacyConfig: one set of privacy options, validated once, shared by every strategy."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest
from lightning.pytorch.trainer.states import TrainerFn

from lightning_dp import (
    DPConfigurationError,
    DPDDPStrategy,
    DPFSDPStrategy,
    DPStrategy,
    FixedSize,
    MultiStageNesterov,
    NoiseDividing,
    PrivacyConfig,
)
from lightning_dp.clipping import L1Clipping
from lightning_dp.strategies import deprecated
from lightning_dp.strategies.config import DEFAULT_TARGET_EPSILON

STRATEGIES = [DPStrategy, DPDDPStrategy, DPFSDPStrategy]


def _privacy_signature(cls: type) -> dict[str, inspect.Parameter]:
    parameters = inspect.signature(cls.__init__).parameters
    return {name: parameters[name] for name in PrivacyConfig.parameters() if name in parameters}


@pytest.mark.parametrize("cls", STRATEGIES)
def test_each_strategy_takes_every_privacy_option_with_the_configs_default_and_type(cls):
    """The signature callers and jsonargparse read is PrivacyConfig's, generated (one definition)."""
    signature = _privacy_signature(cls)
    assert list(signature) == list(PrivacyConfig.parameters())
    hints = typing.get_type_hints(PrivacyConfig)
    fields = {f.name: f for f in dataclasses.fields(PrivacyConfig)}
    for name, parameter in signature.items():
        factory = fields[name].default_factory
        assert parameter.default == (fields[name].default if factory is dataclasses.MISSING else factory()), (
            name
        )
        assert parameter.annotation == hints[name], name
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, name


@pytest.mark.parametrize("cls", STRATEGIES)
def test_each_strategy_still_lists_the_deprecated_keywords_and_refuses_a_typo(cls):
    """YAML with the old keywords still parses (they default to None: not given); a misspelt option fails
    as a Python call does, naming it."""
    parameters = inspect.signature(cls.__init__).parameters
    assert all(parameters[name].default is None for name in deprecated.KEYWORDS)
    with pytest.raises(TypeError, match="unexpected keyword argument 'target_epsilom'"):
        cls(target_epsilom=3.0)


def test_the_strategy_keeps_the_validated_config():
    strategy = DPStrategy(target_epsilon=2.0, max_grad_norm=0.5, seed=3)
    assert strategy.config == PrivacyConfig(target_epsilon=2.0, max_grad_norm=0.5, seed=3)
    assert (strategy.engine.max_grad_norm, strategy.target_epsilon) == (0.5, 2.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.config.max_grad_norm = 10.0  # type: ignore[misc]


def test_defaults_fill_in_the_target_and_the_slots():
    config = PrivacyConfig()
    assert config.target_epsilon == DEFAULT_TARGET_EPSILON
    assert PrivacyConfig(noise_multiplier=1.0).target_epsilon is None
    engine = PrivacyConfig(seed=0).build_engine()
    assert (engine.sampler.name, engine.clipping.name, engine.noise.name, engine.step_slot.name) == (
        "Poisson",
        "FlatClipping",
        "ConstantNoise",
        "Step",
    )


@pytest.mark.parametrize("cls", [DPStrategy, DPDDPStrategy])
def test_a_bad_argument_is_refused_in_the_owners_name(cls):
    with pytest.raises(DPConfigurationError, match=f"{cls.__name__}.*delta"):
        cls(delta=2.0)
    with pytest.raises(DPConfigurationError, match=r"either noise=\.\.\. or noise_multiplier"):
        cls(noise_multiplier=1.0, noise=NoiseDividing())


def test_laplace_noise_on_several_processes_is_refused_before_any_release():
    """Each rank adds its own noise share: Gaussian shares sum to the priced Gaussian, Laplace shares do not."""

    class TwoProcesses:
        def world_size(self) -> int:
            return 2

        def global_rank(self) -> int:
            return 0

        def local_rank(self) -> int:
            return 0

        def node_rank(self) -> int:
            return 0

    strategy = DPDDPStrategy(
        target_epsilon=1.0,
        accountant="pure",  # type: ignore[arg-type]
        sampler=FixedSize(seed=0),
        clipping=L1Clipping(),
        noise=NoiseDividing(privacy="paper"),
        step=MultiStageNesterov(lr=0.1, mu=0.1, L=1.0, n1=3),
        cluster_environment=TwoProcesses(),
    )
    assert strategy.world_size == 2
    trainer = type("Trainer", (), {"state": type("State", (), {"fn": TrainerFn.FITTING})()})()
    with pytest.raises(DPConfigurationError, match=r"sum of Laplace shares is not Laplace noise"):
        strategy.setup(trainer)  # type: ignore[arg-type]


def test_jsonargparse_builds_the_config_with_a_slot_from_yaml():
    """The config is a typed dataclass: LightningCLI's parser builds it, slots by ``class_path``."""
    from jsonargparse import ArgumentParser

    from lightning_dp import AdaCliP

    parser = ArgumentParser()
    parser.add_argument("--privacy", type=PrivacyConfig)
    parsed = parser.parse_args(
        [
            "--privacy",
            '{"target_epsilon": 2, "max_grad_norm": 0.5, "clipping": {"class_path": "lightning_dp.AdaCliP"}}',
        ]
    )
    build = getattr(parser, "instantiate", None) or parser.instantiate_classes
    config = build(parsed).privacy
    assert isinstance(config, PrivacyConfig)
    assert isinstance(config.clipping, AdaCliP)
    assert (config.target_epsilon, config.max_grad_norm, config.delta) == (2.0, 0.5, 1e-5)
