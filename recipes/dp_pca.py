"""DP-PCA input projection + MLP (the network of AdaCliP's Table 2, after Abadi et al. 2016), priced.

The projection is fit on the private training images before training, so it is a release of its own:
the covariance ``XᵀX`` of the unit-normalised rows, with symmetric Gaussian noise ("Analyze Gauss",
Dwork et al. 2014). Adding or removing one example changes the upper triangle of ``XᵀX`` by ``xxᵀ``,
whose L2 norm is at most ``‖x‖² ≤ 1``: a Gaussian mechanism of sensitivity 1, RDP α/(2σ²). The module
records it in the strategy's ledger as a ``Gaussian(σ_pca)`` event, so every ε the run reports, and the
budget stop, include it; :class:`ComposedNoise` calibrates the training σ for what is left of the target
(shared/specs/adaclip.md §3.6: "account PCA as a separate mechanism and compose").
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_dp.accounting import Gaussian, PrivacyEvent, PrivacyLedger
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.core.rng import make_generator
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.noise import ConstantNoise
from lightning_dp.slots import Sampler
from recipes.classifier import ImageClassifier
from recipes.models import mlp

__all__ = ["ComposedNoise", "DPPCAClassifier", "dp_pca_projection"]


def dp_pca_projection(x: Tensor, k: int, noise_multiplier: float, generator: torch.Generator) -> Tensor:
    """Top-``k`` eigenvectors [d, k] of the noisy covariance of ``x`` [N, d] (rows scaled to norm 1).

    Noise: one N(0, σ²) draw per upper-triangle entry (diagonal included), mirrored, so the release is
    a Gaussian mechanism with L2 sensitivity 1 under adding or removing one row.

    Args:
        x: [N, d] data; each row is scaled to L2 norm 1 first.
        k: the number of eigenvectors kept.
        noise_multiplier: σ of the noise on each covariance entry (sensitivity 1).
        generator: the generator the noise is drawn from.
    """
    x = x.double().flatten(1)
    x = x / x.norm(dim=1, keepdim=True).clamp(min=1.0e-12)  # ‖x‖ ≤ 1 (zero rows stay zero)
    cov = x.T @ x
    d = cov.shape[0]
    noise = torch.randn(d, d, generator=generator, dtype=torch.float64) * noise_multiplier
    noise = torch.triu(noise) + torch.triu(noise, diagonal=1).T
    _, vectors = torch.linalg.eigh(cov + noise)  # ascending eigenvalues
    return vectors[:, -k:].flip(1).float().contiguous()


class ComposedNoise(ConstantNoise):
    """Constant σ, calibrated so that the releases already made (``preceding``, e.g. DP-PCA) plus the
    planned training steps stay within the target ε.

    Args:
        noise_multiplier: σ given directly (then no calibration); None (default): calibrated from the
            strategy's ``target_epsilon`` for the budget the preceding releases leave.
    """

    def __init__(self, noise_multiplier: float | None = None) -> None:
        super().__init__(noise_multiplier)
        self.preceding: list[tuple[PrivacyEvent, int]] = []

    def calibrate(
        self, target_epsilon: float, delta: float, sampler: Sampler, steps: int, accountant: str
    ) -> None:
        ledger = PrivacyLedger(delta, accountant)  # type: ignore[arg-type]
        for event, count in self.preceding:
            ledger.record(event, count)
        if ledger.epsilon() >= target_epsilon:
            raise ValueError(
                f"the releases before training already spend ε={ledger.epsilon():.4g} of {target_epsilon:g}"
            )

        def fits(sigma: float) -> bool:
            return ledger.epsilon_if(sampler.event(sigma), steps) <= target_epsilon

        lo, hi = 0.0, 1.0
        while not fits(hi):
            lo, hi = hi, 2.0 * hi
            if hi > 1e4:
                raise ValueError(
                    f"no noise multiplier up to 1e4 meets ε={target_epsilon:g} over {steps} steps"
                )
        while hi - lo > 1e-3 * hi:  # invariant: fits(hi); hi is returned (conservative)
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        self.sigma = hi


class DPPCAClassifier(ImageClassifier):
    """Frozen DP-PCA projection ``d → pca_components`` then an MLP (``hidden``, default [1000]).

    The projection is fit in ``setup("fit")`` from the datamodule's ``train_set`` (inputs flattened),
    with noise multiplier ``pca_noise_multiplier``; under a lightning-dp strategy its ``Gaussian`` event
    goes into the ledger first. The strategy's noise slot must then be :class:`ComposedNoise` (so σ is
    calibrated for the remaining budget) or a given ``noise_multiplier`` (``target_epsilon`` is then
    the budget stop, which counts the PCA release too).

    Args:
        pca_components: k, the dimension the projection keeps (default 60).
        pca_noise_multiplier: σ of the DP-PCA release (a Gaussian mechanism with L2 sensitivity 1, rows
            scaled to norm 1; default 8.0).
        in_features: d, the flattened input size (default 784, MNIST).
        hidden: the MLP's hidden widths (default [1000]).
        num_classes: the number of classes (default 10).
        activation: the MLP's activation (one of relu, tanh, sigmoid, elu, gelu, silu, leaky_relu;
            default relu).
        lr: the learning rate (default 0.1).
        momentum: SGD's momentum (default 0).
        optimizer: ``"sgd"`` (default) or ``"adam"``.
        weight_decay: L2 weight decay (default 0).
    """

    def __init__(
        self,
        pca_components: int = 60,
        pca_noise_multiplier: float = 8.0,
        in_features: int = 784,
        hidden: list[int] | None = None,
        num_classes: int = 10,
        activation: str = "relu",
        lr: float = 0.1,
        momentum: float = 0.0,
        optimizer: str = "sgd",
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(
            "mlp", num_classes, in_features, hidden, activation, lr, momentum, optimizer, weight_decay
        )
        if not 0 < pca_components <= in_features:
            raise ValueError(f"pca_components must be in (0, {in_features}], got {pca_components}")
        if not (pca_noise_multiplier > 0 and math.isfinite(pca_noise_multiplier)):
            raise ValueError(f"pca_noise_multiplier must be a finite number > 0, got {pca_noise_multiplier}")
        self.net = mlp(pca_components, [1000] if hidden is None else list(hidden), num_classes, activation)
        self.register_buffer("projection", torch.zeros(in_features, pca_components))
        self.pca_event = Gaussian(pca_noise_multiplier)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x.flatten(1) @ self.projection)

    def fit_projection(self, x: Tensor, generator: torch.Generator) -> None:
        """Fit the DP-PCA projection on the training inputs ``x`` (the caller prices the release)."""
        proj = dp_pca_projection(x, self.projection.shape[1], self.pca_event.noise_multiplier, generator)
        self.projection.copy_(proj.to(self.projection.device))

    def setup(self, stage: str) -> None:
        if stage != "fit":
            return
        trainer = self.trainer
        train_set = getattr(trainer.datamodule, "train_set", None) if trainer.datamodule is not None else None
        if train_set is None:
            raise DPConfigurationError(
                "DPPCAClassifier fits its projection on the datamodule's train_set: pass a datamodule to fit()."
            )
        x = torch.cat([batch[0].flatten(1) for batch in DataLoader(train_set, batch_size=4096)])
        engine: PrivateStepEngine | None = getattr(
            trainer.strategy, "engine", None
        )  # None: not a DP strategy
        seed = engine.seed if engine is not None else None
        if engine is not None:  # check-before-spend: priced (or refused) before the projection is computed
            engine.releases.spend(self.pca_event, mechanism="DP-PCA projection")
        self.fit_projection(x, make_generator(seed, stream="dp_pca"))
        if engine is None:  # non-private training: the projection is still DP, but nothing else is
            return
        noise = engine.noise
        if isinstance(noise, ComposedNoise):
            noise.preceding = engine.ledger.history
        elif not noise.is_set:
            raise DPConfigurationError(
                "DP-PCA spends budget before training, but the noise slot calibrates σ for the whole target: "
                "use noise=recipes.dp_pca.ComposedNoise() (or give noise_multiplier)."
            )
