"""Ordinary Lightning recipes (data modules, models, a classifier) that the DP strategy wraps.

Nothing here knows about differential privacy; the models only respect its constraints
(no BatchNorm, layers in ``self.net``, mean training loss, map-style train data with ``batch_size``).
"""

from recipes.accelerated import PaperLogisticRegression, SyntheticLogRegDataModule, paper_logreg_problem
from recipes.classifier import ImageClassifier, build_model
from recipes.data import DigitsDataModule, MNISTDataModule, TabularDataModule, resolve_mnist_root
from recipes.dp_pca import ComposedNoise, DPPCAClassifier, dp_pca_projection
from recipes.linear import LinearClassifier
from recipes.models import logistic_regression, mlp, small_cnn_digits, tramer_boneh_cnn
from recipes.scatternet import Scattering2D, ScatterNetDataModule, scatternet_cnn

__all__ = [
    "ComposedNoise",
    "DPPCAClassifier",
    "DigitsDataModule",
    "ImageClassifier",
    "LinearClassifier",
    "MNISTDataModule",
    "PaperLogisticRegression",
    "ScatterNetDataModule",
    "Scattering2D",
    "SyntheticLogRegDataModule",
    "TabularDataModule",
    "build_model",
    "dp_pca_projection",
    "logistic_regression",
    "mlp",
    "paper_logreg_problem",
    "resolve_mnist_root",
    "scatternet_cnn",
    "small_cnn_digits",
    "tramer_boneh_cnn",
]
