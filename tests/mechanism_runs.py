"""Every mechanism at its defaults on a user's model, one argument swapped into a DP-SGD config.

Shared by ``bench/mechanisms.py`` (the README's table) and ``tests/test_mechanism_accuracy.py`` (the CI
check that each mechanism is within 2 points of DP-SGD or says what to change). Models:

* ``digits``: a 64-64-10 tanh MLP on scikit-learn's digits (SGD lr 1.0, batch 128, C = 1);
* ``mnist_cnn``: Tramèr & Boneh's MNIST CNN (tanh, SGD lr 0.5 momentum 0.9 as in configs/mnist_dpsgd.yaml
  but plain SGD lr 2.0 so the momentum steps are a one-argument swap, batch 512, C = 0.1);
* ``text``: Embedding → GRU → Linear on recipes/text.py's sequence-direction task (SGD lr 2.0, batch
  128, C = 1).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
from lightning import Trainer, seed_everything

from lightning_dp import AdaCliP, AdaptiveGD, DPStrategy, HeavyBall, LineSearch, Nesterov, NoiseDividing

FULL_BATCH = -1
"""Marker: the batch is the whole train split (q = 1)."""

#: name -> (the DPStrategy arguments swapped in, batch size and epochs when they differ from the user's).
#: A row after a mechanism's default row applies the fix its run-time message names.
MECHANISMS: dict[str, tuple[Callable[[], dict[str, Any]], int | None, int | None]] = {
    "DP-SGD": (dict, None, None),
    "LineSearch()": (lambda: {"step": LineSearch()}, None, None),
    "AdaCliP()": (lambda: {"clipping": AdaCliP()}, None, None),
    "AdaCliP(h2=1e-2)": (lambda: {"clipping": AdaCliP(h2=1e-2)}, None, None),
    "HeavyBall(beta=0.9)": (lambda: {"step": HeavyBall(beta=0.9)}, None, None),
    "Nesterov(momentum=0.9)": (lambda: {"step": Nesterov(momentum=0.9)}, None, None),
    "Nesterov(0.9) + NoiseDividing()": (
        lambda: {"step": Nesterov(momentum=0.9), "noise": NoiseDividing()},
        None,
        None,
    ),
    "Nesterov(0.9) + NoiseDividing(uniform=True)": (
        lambda: {"step": Nesterov(momentum=0.9), "noise": NoiseDividing(uniform=True)},
        None,
        None,
    ),
    "AdaptiveGD()": (lambda: {"step": AdaptiveGD()}, None, None),
    "AdaptiveGD(), full batch, max_epochs=-1": (lambda: {"step": AdaptiveGD()}, FULL_BATCH, -1),
}


@dataclass(frozen=True)
class UserModel:
    """A user's model and data as they would write them, and the DP-SGD settings tuned for it."""

    build: Callable[[], tuple[L.LightningModule, L.LightningDataModule]]
    max_grad_norm: float
    epochs: int


def _digits() -> tuple[L.LightningModule, L.LightningDataModule]:
    from recipes import DigitsDataModule, ImageClassifier

    model = ImageClassifier(arch="mlp", hidden=[64], activation="tanh", in_features=64, lr=1.0)
    return model, DigitsDataModule(batch_size=128, flatten=True)


def _mnist_cnn() -> tuple[L.LightningModule, L.LightningDataModule]:
    from recipes import ImageClassifier, MNISTDataModule

    root = os.environ.get("LIGHTNING_DP_DATA", str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    model = ImageClassifier(arch="tramer_boneh_cnn", activation="tanh", lr=2.0)
    return model, MNISTDataModule(root=root, download=False, batch_size=512)


def _text() -> tuple[L.LightningModule, L.LightningDataModule]:
    from recipes.text import SequenceDirectionDataModule, TextClassifier

    return TextClassifier(lr=2.0), SequenceDirectionDataModule(batch_size=128)


MODELS: dict[str, UserModel] = {
    "digits": UserModel(_digits, max_grad_norm=1.0, epochs=20),
    "mnist_cnn": UserModel(_mnist_cnn, max_grad_norm=0.1, epochs=3),
    "text": UserModel(_text, max_grad_norm=1.0, epochs=15),
}


@dataclass(frozen=True)
class RunResult:
    accuracy: float
    epsilon: float
    said: tuple[str, ...]
    """The distinct lightning-dp warnings of the run (what it told the user to change)."""


def run(model_name: str, mechanism: str, seed: int, epsilon: float, epochs: int | None = None) -> RunResult:
    """Train ``model_name`` privately with ``mechanism`` swapped in; test accuracy, ε spent, warnings."""
    user = MODELS[model_name]
    seed_everything(seed, verbose=False)
    arguments, batch_size, row_epochs = MECHANISMS[mechanism]
    model, data = user.build()
    if batch_size == FULL_BATCH:  # the whole train split in every batch: q = 1
        data.setup("fit")
        data.batch_size = len(data.train_set)  # type: ignore[attr-defined]
    epochs = row_epochs if row_epochs is not None else (epochs or user.epochs)
    strategy = DPStrategy(
        target_epsilon=epsilon, delta=1e-5, max_grad_norm=user.max_grad_norm, seed=seed, **arguments()
    )
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(
            strategy=strategy,
            accelerator="cpu",
            max_epochs=epochs,
            default_root_dir=root,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )
        trainer.fit(model, data)
        accuracy = float(trainer.test(model, data, verbose=False)[0]["test_acc"])
    said = tuple(sorted({str(w.message)[:90] for w in caught if "lightning_dp" in str(w.filename)}))
    return RunResult(accuracy, strategy.epsilon, said)
