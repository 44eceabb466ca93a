"""DP-PCA recipe (AdaCliP's Table 2 network): the projection, and its release composed into the ledger."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_trainer

from lightning_dp import AdaCliP, DPStrategy
from lightning_dp.accounting import Gaussian, PoissonGaussian, PrivacyLedger, calibrate_noise
from lightning_dp.core.errors import DPConfigurationError
from recipes import DigitsDataModule
from recipes.dp_pca import ComposedNoise, DPPCAClassifier, dp_pca_projection


def test_projection_recovers_the_top_subspace_when_noise_is_small():
    gen = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(20, 3, generator=gen))[0]
    x = torch.randn(2000, 3, generator=gen) * torch.tensor([5.0, 3.0, 2.0]) @ basis.T
    x = x + 0.01 * torch.randn(2000, 20, generator=gen)
    proj = dp_pca_projection(x, 3, noise_multiplier=1e-3, generator=gen)
    torch.testing.assert_close(proj.T @ proj, torch.eye(3), atol=1e-5, rtol=0)
    # same subspace: the projector onto proj equals the projector onto basis
    torch.testing.assert_close(proj @ proj.T, basis @ basis.T, atol=1e-2, rtol=0)


def test_pca_release_is_composed_into_the_ledger_and_the_calibration():
    data = DigitsDataModule(batch_size=64, flatten=True, val_fraction=0.0)
    model = DPPCAClassifier(pca_components=10, pca_noise_multiplier=6.0, in_features=64, hidden=[16], lr=0.5)
    noise = ComposedNoise()
    strategy = DPStrategy(target_epsilon=1.0, noise=noise, clipping=AdaCliP(h2=1e-2), seed=0)
    make_trainer(strategy, max_epochs=2).fit(model, data)
    history = strategy.ledger.history
    assert history[0] == (Gaussian(6.0), 1)
    assert isinstance(history[1][0], PoissonGaussian)
    steps = history[1][1]
    assert strategy.epsilon <= 1.0
    q = history[1][0].sample_rate
    # σ leaves room for the PCA release: larger than a training-only calibration, and ε without PCA is lower
    assert noise.sigma > calibrate_noise(target_epsilon=1.0, delta=1e-5, sample_rate=q, steps=steps)
    training_only = PrivacyLedger(1e-5)
    training_only.record(history[1][0], steps)
    assert training_only.epsilon() < strategy.epsilon - 0.05
    assert float(model.projection.abs().sum()) > 0


def test_pca_without_a_composing_noise_slot_is_refused():
    data = DigitsDataModule(batch_size=64, flatten=True, val_fraction=0.0)
    model = DPPCAClassifier(pca_components=10, in_features=64, hidden=[16])
    with pytest.raises(DPConfigurationError, match="ComposedNoise"):
        make_trainer(DPStrategy(target_epsilon=1.0), max_epochs=1).fit(model, data)


CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("adaclip_mnist_*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_adaclip_mnist_configs_instantiate(config):
    """Every Table 1/2 config parses and builds its model, data module and DP strategy (no training)."""
    from lightning_dp.commands.cli import DPLightningCLI

    cli = DPLightningCLI(args=["--config", str(config)], run=False, auto_configure_optimizers=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, DPStrategy)
    assert cli.datamodule.batch_size == 600
    assert strategy.delta == 1e-5
    is_adaclip = "dpsgd" not in config.stem
    assert isinstance(strategy.engine.clipping, AdaCliP) == is_adaclip
    if "pca" in config.stem:
        assert isinstance(cli.model, DPPCAClassifier)
        assert isinstance(strategy.engine.noise, ComposedNoise)
    if config.stem.endswith("c4"):
        assert strategy.engine.max_grad_norm == 4.0
