"""Plain ``nn.Module`` architectures used by the recipes and benchmarks.

Every model here is compatible with per-example gradient computation: no BatchNorm (which mixes
examples in a batch), only per-example layers (Linear, Conv2d, pooling, GroupNorm, activations).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["activation_layer", "logistic_regression", "mlp", "small_cnn_digits", "tramer_boneh_cnn"]

_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "elu": nn.ELU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "leaky_relu": nn.LeakyReLU,
}


def activation_layer(name: str) -> nn.Module:
    """Return a fresh activation module by name (``relu``, ``tanh``, ``sigmoid``, ``elu``, ...)."""
    try:
        return _ACTIVATIONS[name.lower()]()
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; expected one of {sorted(_ACTIVATIONS)}") from None


def tramer_boneh_cnn(num_classes: int = 10, activation: str = "relu") -> nn.Sequential:
    """End-to-end MNIST CNN of Tramèr & Boneh (2021), 26,010 parameters for 10 classes.

    Input ``(B, 1, 28, 28)``: Conv(1→16, 8×8, stride 2, pad 2) → 13×13 → MaxPool(2, 1) → 12×12 →
    Conv(16→32, 4×4, stride 2) → 5×5 → MaxPool(2, 1) → 4×4 → flatten 512 → Linear(512→32) → Linear(32→C).

    Args:
        num_classes: the number of classes (default 10).
        activation: one of relu, tanh, sigmoid, elu, gelu, silu, leaky_relu (default relu).
    """
    return nn.Sequential(
        nn.Conv2d(1, 16, kernel_size=8, stride=2, padding=2),
        activation_layer(activation),
        nn.MaxPool2d(kernel_size=2, stride=1),
        nn.Conv2d(16, 32, kernel_size=4, stride=2),
        activation_layer(activation),
        nn.MaxPool2d(kernel_size=2, stride=1),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 32),
        activation_layer(activation),
        nn.Linear(32, num_classes),
    )


def mlp(in_features: int, hidden: Sequence[int], num_classes: int, activation: str = "relu") -> nn.Sequential:
    """Fully connected network ``in_features → hidden[0] → ... → num_classes``.

    The input is flattened first, so image batches ``(B, 1, H, W)`` can be fed directly.
    ``mlp(784, [1000], 10)`` has 795,010 parameters; ``hidden=[]`` is a (multinomial) logistic regression.

    Args:
        in_features: the flattened input size.
        hidden: the hidden layers' widths.
        num_classes: the number of classes.
        activation: one of relu, tanh, sigmoid, elu, gelu, silu, leaky_relu (default relu).
    """
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), activation_layer(activation)]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def logistic_regression(in_features: int, num_classes: int) -> nn.Sequential:
    """Multinomial logistic regression (flatten + one linear layer); use with cross-entropy.

    Args:
        in_features: the flattened input size.
        num_classes: the number of classes.
    """
    return mlp(in_features, [], num_classes)


def small_cnn_digits(num_classes: int = 10, activation: str = "tanh", groups: int = 0) -> nn.Sequential:
    """Small CNN for scikit-learn's 8×8 digits, input ``(B, 1, 8, 8)``; 6,090 parameters.

    Conv(1→16, 3, pad 1) → act → MaxPool2 → Conv(16→32, 3, pad 1) → act → MaxPool2 → Linear(128→C).
    ``groups > 0`` inserts GroupNorm(groups, ·) after each convolution (per-example, DP-compatible).

    Args:
        num_classes: the number of classes (default 10).
        activation: one of relu, tanh, sigmoid, elu, gelu, silu, leaky_relu (default tanh).
        groups: GroupNorm's number of groups after each convolution; 0 (default): none.
    """

    def norm(channels: int) -> list[nn.Module]:
        return [nn.GroupNorm(groups, channels)] if groups > 0 else []

    return nn.Sequential(
        nn.Conv2d(1, 16, kernel_size=3, padding=1),
        *norm(16),
        activation_layer(activation),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, kernel_size=3, padding=1),
        *norm(32),
        activation_layer(activation),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 2 * 2, num_classes),
    )
