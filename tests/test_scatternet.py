"""Our ScatterNet (2-D scattering, J = 2, L = 8) and the CNN head of Tramèr & Boneh."""

from __future__ import annotations

import torch

from recipes import Scattering2D, build_model


def test_shapes_and_parameter_counts():
    assert Scattering2D((28, 28))(torch.rand(2, 1, 28, 28)).shape == (2, 81, 7, 7)
    assert Scattering2D((32, 32))(torch.rand(2, 3, 32, 32)).shape == (2, 243, 8, 8)
    assert sum(p.numel() for p in build_model("scatternet_cnn", in_features=81).parameters()) == 33066
    assert sum(p.numel() for p in build_model("scatternet_cnn", in_features=243).parameters()) == 187210


def test_constant_image_has_only_the_low_pass_coefficient():
    """Morlet wavelets have zero mean: a constant image gives S0 = the constant, S1 = S2 = 0."""
    out = Scattering2D((28, 28))(torch.full((1, 1, 28, 28), 0.7))
    assert torch.allclose(out[0, 0], torch.full((7, 7), 0.7), atol=1e-4)
    assert out[0, 1:].abs().max() < 1e-4


def test_features_are_nearly_translation_invariant_and_positive():
    """Scattering coefficients are averages of moduli (≥ 0), stable to small shifts (unlike pixels)."""
    gen = torch.Generator().manual_seed(0)
    image = torch.zeros(1, 1, 28, 28)
    image[0, 0, 8:20, 10:14] = torch.rand(12, 4, generator=gen) + 0.5
    shifted = torch.roll(image, shifts=1, dims=-1)
    transform = Scattering2D((28, 28))
    a, b = transform(image), transform(shifted)
    assert a[:, 1:].min() >= -1e-3 * a[:, 1:].max()
    pixel_change = (image - shifted).norm() / image.norm()
    feature_change = (a - b).norm() / a.norm()
    assert feature_change < 0.5 * pixel_change
