"""Ordinary Lightning recipes (data modules, models, a classifier) that the DP strategy wraps.

Nothing here knows about differential privacy; the models only respect its constraints
(no BatchNorm, layers in ``self.net``, mean training loss, map-style train data with ``batch_size``).
"""

from recipes.classifier import ImageClassifier, build_model
from recipes.data import DigitsDataModule, MNISTDataModule, TabularDataModule, resolve_mnist_root
from recipes.models import logistic_regression, mlp, small_cnn_digits, tramer_boneh_cnn
from recipes.scatternet import Scattering2D, ScatterNetDataModule, scatternet_cnn

__all__ = [
    "DigitsDataModule",
    "ImageClassifier",
    "MNISTDataModule",
    "ScatterNetDataModule",
    "Scattering2D",
    "TabularDataModule",
    "build_model",
    "logistic_regression",
    "mlp",
    "resolve_mnist_root",
    "scatternet_cnn",
    "small_cnn_digits",
    "tramer_boneh_cnn",
]
