"""lightning-dp: differentially private training for any PyTorch Lightning module.

``Trainer(strategy=DPStrategy(target_epsilon=3.0), callbacks=[PrivacyCallback()])`` trains an ordinary
LightningModule with DP-SGD: Poisson sampling, per-example clipping, calibrated Gaussian noise and a
privacy ledger that never lets ε pass its target.
"""

import lightning_dp.core._logging  # noqa: F401  (first: Opacus's import must not add a root logging handler)
from lightning_dp.audit import AuditResult, audit  # via the kept path: lightning_dp.audit stays the function
from lightning_dp.checks import checking
from lightning_dp.checks.capture import CaptureObligations
from lightning_dp.clipping import AdaCliP, AutoClipping, FlatClipping, L1Clipping, QuantileClipping
from lightning_dp.commands.tuning import tune
from lightning_dp.core.batches import EmptyBatch
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.core.losses import per_example_token_loss
from lightning_dp.core.version import __version__
from lightning_dp.noise import BLT, BandMF, ConstantNoise, DiscreteGaussian, NoiseDividing
from lightning_dp.per_example.observations import install_checks
from lightning_dp.run.callbacks import PrivacyCallback
from lightning_dp.run.prepare import load_from_checkpoint, replace_batchnorm
from lightning_dp.sampling import DPIS, CyclicPoisson, FixedSize, Poisson, UserPoisson
from lightning_dp.slots import Clipping, Noise, Sampler, Step, StepContext
from lightning_dp.steps import AdaptiveGD, HeavyBall, MultiStageNesterov, Nesterov
from lightning_dp.steps.line_search import LineSearch, LineSearchConfig
from lightning_dp.strategies import (
    Checks,
    DPDDPStrategy,
    DPFSDPStrategy,
    DPStrategy,
    PrivacyConfig,
    UserBound,
    register,
)

install_checks(CaptureObligations())  # the run-time obligations every per-example capture is held to
register()

__all__ = [
    "BLT",
    "DPIS",
    "AdaCliP",
    "AdaptiveGD",
    "AuditResult",
    "AutoClipping",
    "BandMF",
    "Checks",
    "Clipping",
    "ConstantNoise",
    "CyclicPoisson",
    "DPConfigurationError",
    "DPDDPStrategy",
    "DPFSDPStrategy",
    "DPStrategy",
    "DiscreteGaussian",
    "EmptyBatch",
    "FixedSize",
    "FlatClipping",
    "HeavyBall",
    "L1Clipping",
    "LineSearch",
    "LineSearchConfig",
    "MultiStageNesterov",
    "Nesterov",
    "Noise",
    "NoiseDividing",
    "Poisson",
    "PrivacyCallback",
    "PrivacyConfig",
    "QuantileClipping",
    "Sampler",
    "Step",
    "StepContext",
    "UserBound",
    "UserPoisson",
    "__version__",
    "audit",
    "checking",
    "load_from_checkpoint",
    "per_example_token_loss",
    "register",
    "replace_batchnorm",
    "tune",
]
