"""Fast-path kernels of every family (kernels/__init__.py registry) agree with materialised per-example
gradients (fp64 per-example autograd); dtype, frozen parameters and dropped examples."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest
import torch
from tolerances import assert_close_scaled
from torch import nn

from lightning_dp.per_example.kernels import (
    FAST_CLIPPERS,
    Cache,
    is_supported,
    sq_norms,
    weighted_grad,
)
from lightning_dp.per_example.kernels.conv_autotune import force_conv_method
from lightning_dp.per_example.kernels.linear import use_gram
from tests.per_example.kernel_cases import (
    CASES,
    capture,
    check_layer,
    make_layer,
)


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("B", [0, 1, 5])
@pytest.mark.parametrize("case", list(CASES))
def test_kernels_match_materialised(case: str, B: int) -> None:
    layer_factory, input_factory = CASES[case]
    layer = make_layer(layer_factory, seed=B)
    assert is_supported(layer)
    check_layer(layer, input_factory(B, torch.Generator().manual_seed(B)), seed=B)


@pytest.mark.parametrize("case", ["linear-seq-materialise", "linear-4d-materialise", "conv2d-materialise"])
def test_materialised_norms_are_reused_for_the_sum(case: str) -> None:
    """A layer whose norms materialise its per-example gradients caches them for the weighted sum."""
    layer = make_layer(CASES[case][0], seed=0)
    x = CASES[case][1](4, torch.Generator().manual_seed(0))
    activations, backprops, _ = capture(layer, x)
    cache: Cache = {}
    with force_conv_method("unfold"):
        sq_norms(layer, activations, backprops, cache)
    assert layer.weight in cache
    assert set(cache) <= {layer.weight, layer.bias}
    assert cache[layer.weight].shape == (4, *layer.weight.shape)
    with force_conv_method("unfold"):
        check_layer(layer, x, cache={})


@pytest.mark.parametrize(
    ("case", "gram"),
    [
        ("linear-seq-gram", True),
        ("linear-seq-materialise", False),
        ("linear-4d-gram", True),
        ("linear-4d-materialise", False),
        ("conv1d-gram", True),
        ("conv2d-gram", True),
        ("conv2d-materialise", False),
    ],
)
def test_cases_cover_both_branches(case: str, gram: bool) -> None:
    """The sweep's names say which branch they take; check it against ``use_gram``."""
    layer = CASES[case][0]()
    x = CASES[case][1](2, torch.Generator().manual_seed(0))
    if isinstance(layer, nn.Linear):
        T = x[0, ..., 0].numel()
        assert use_gram(T, layer.in_features, layer.out_features) is gram
    else:
        assert isinstance(layer, nn.Conv1d | nn.Conv2d)
        L = layer(x)[0, 0].numel()
        p = layer.in_channels // layer.groups * layer.weight[0, 0].numel()
        assert use_gram(L, p, layer.out_channels // layer.groups) is gram


def test_frozen_parameters_are_skipped() -> None:
    layer = make_layer(lambda: nn.Linear(4, 3), 0)
    layer.weight.requires_grad_(False)
    check_layer(layer, torch.randn(3, 2, 4))
    frozen = make_layer(lambda: nn.Embedding(5, 3), 0).requires_grad_(False)
    acts, bp = [torch.tensor([[1, 2]])], torch.randn(1, 2, 3)
    assert sq_norms(frozen, acts, bp) == {}
    assert weighted_grad(frozen, acts, bp, torch.ones(1)) == {}
    plain = nn.GroupNorm(2, 4, affine=False)
    assert sq_norms(plain, [torch.randn(2, 4, 3)], torch.randn(2, 4, 3)) == {}


@pytest.mark.parametrize(
    "case",
    [
        "linear-seq-gram",
        "linear-2d",
        "conv2d-gram",
        "conv1d-stride-pad-dil-nobias",
        "embedding-sparse",
        "layernorm-seq",
        "groupnorm",
    ],
)
def test_bf16_inputs_give_fp32_outputs(case: str) -> None:
    layer_factory, input_factory = CASES[case]
    layer = make_layer(layer_factory, 0)
    check_layer(layer, input_factory(4, torch.Generator().manual_seed(0)), rtol=1e-4, cast=torch.bfloat16)


@pytest.mark.parametrize(
    "case", ["linear-seq-gram", "conv2d-groups", "embedding-sparse", "layernorm-seq", "groupnorm"]
)
def test_zero_weight_examples_are_dropped_even_if_not_finite(case: str) -> None:
    layer = make_layer(CASES[case][0], 0)
    x = CASES[case][1](3, torch.Generator().manual_seed(0))
    activations, backprops, _ = capture(layer, x)
    bad_acts = [a.clone() for a in activations]
    if bad_acts[0].is_floating_point():
        bad_acts[0][1] = float("nan")
    bad_bp = backprops.clone()
    bad_bp[1] = float("inf")
    weights = torch.tensor([0.5, 0.0, 2.0])
    clean = weighted_grad(layer, activations, backprops, weights)
    dirty = weighted_grad(layer, bad_acts, bad_bp, weights)
    for p in clean:
        assert torch.isfinite(dirty[p]).all()
        assert_close_scaled(dirty[p], clean[p], terms=backprops[:, 0].numel())


@pytest.mark.parametrize(
    "case", ["linear-seq-materialise", "conv2d-stride-pad-dil", "embedding-gram-padding"]
)
def test_unit_weights_give_the_ordinary_gradient(case: str) -> None:
    layer = make_layer(CASES[case][0], 0)
    activations, backprops, _ = capture(layer, CASES[case][1](4, torch.Generator().manual_seed(0)))
    sums = weighted_grad(layer, activations, backprops, torch.ones(4))
    for p in layer.parameters():
        assert p.grad is not None
        assert_close_scaled(sums[p], p.grad, terms=backprops[:, 0].numel())


def test_registry_and_support() -> None:
    for layer in [
        nn.Linear(2, 2),
        nn.Conv1d(1, 1, 1),
        nn.Conv2d(1, 1, 1),
        nn.Embedding(3, 2),
        nn.LayerNorm(2),
        nn.GroupNorm(1, 2),
    ]:
        assert is_supported(layer)
        assert type(layer) in FAST_CLIPPERS
    assert not is_supported(nn.Conv3d(1, 1, 1))
    assert not is_supported(nn.Embedding(3, 2, scale_grad_by_freq=True))
    assert not is_supported(nn.LSTM(2, 2))

    class MyLinear(nn.Linear):
        pass

    assert not is_supported(MyLinear(2, 2))
    with pytest.raises(TypeError, match="No fast clipping kernels"):
        sq_norms(nn.Conv3d(1, 1, 1), [torch.zeros(1, 1, 1, 1, 1)], torch.zeros(1, 1, 1, 1, 1))
    assert use_gram(3, 10, 10)  # 3·20 < 100 FLOPs
    assert not use_gram(4, 2, 8)
