"""The clipped sum of a convolution whose per-example gradients were not kept: every method of
``conv_methods.CONV_SUMS`` against the fp64 per-example reference, zero-weight examples with non-finite
values dropped, and crafted cancelling inputs still contributing at most C whichever method sums them."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close_scaled

from lightning_dp.per_example.kernels import Cache, sq_norms, weighted_grad
from lightning_dp.per_example.kernels.conv_autotune import (
    ConvAutotuner,
    force_conv_method,
    force_conv_sum_method,
)
from lightning_dp.per_example.kernels.conv_methods import CONV_SUMS, NORMS_ONLY, SUM_METHODS, SumMethod
from tests.per_example.kernel_cases import CASES, CONV_CASES, capture, check_layer, make_layer
from tests.per_example.test_certified import FAMILIES, assert_bounded, with_normal_examples


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("method", SUM_METHODS)
@pytest.mark.parametrize("B", [0, 1, 3])
@pytest.mark.parametrize("case", CONV_CASES)
def test_every_sum_method_matches_the_fp64_reference(case: str, B: int, method: SumMethod) -> None:
    """Norms by a Gram method (nothing kept), then the clipped sum by ``method``: equal to Σ_i w_i g_i of
    fp64 per-example gradients (strides, dilation, groups, padding modes, 'same', Conv1d and Conv2d)."""
    layer = make_layer(CASES[case][0], seed=B)
    x = CASES[case][1](B, torch.Generator().manual_seed(B))
    with force_conv_method("gram"), force_conv_sum_method(method):
        check_layer(layer, x, seed=B, cache={})


@pytest.mark.parametrize("method", SUM_METHODS)
@pytest.mark.parametrize("case", ["conv2d-groups", "conv1d-stride-pad-dil-nobias", "conv2d-gram"])
def test_sum_methods_drop_zero_weight_examples_even_if_not_finite(case: str, method: SumMethod) -> None:
    """Examples with weight 0 (non-finite norms are clipped to 0) contribute exactly nothing."""
    layer = make_layer(CASES[case][0], 0)
    activations, backprops, _ = capture(layer, CASES[case][1](3, torch.Generator().manual_seed(0)))
    bad_acts, bad_bp = [a.clone() for a in activations], backprops.clone()
    bad_acts[0][1], bad_bp[1] = float("nan"), float("inf")
    weights = torch.tensor([0.5, 0.0, 2.0])
    clean = CONV_SUMS["weight-grad"](layer, activations[0], backprops, weights)
    dirty = CONV_SUMS[method](layer, bad_acts[0], bad_bp, weights)
    assert torch.isfinite(dirty).all()
    assert_close_scaled(dirty, clean, terms=backprops[:, 0].numel())


@pytest.mark.parametrize("method", SUM_METHODS)
@pytest.mark.parametrize("family", [f for f in FAMILIES if f.startswith("conv-")])
def test_crafted_examples_contribute_at_most_c_whichever_method_sums(family: str, method: SumMethod) -> None:
    """The certified norms allow for the rounding of a B·L-term reduction in fp32; every sum method does
    at most that, so a crafted cancelling example's released contribution stays ≤ C."""
    layer, x, d = FAMILIES[family]()
    x, d = with_normal_examples(x, d)
    norm_method = family.removeprefix("conv-pairs-").removeprefix("conv-")
    with force_conv_method(norm_method), force_conv_sum_method(method):  # type: ignore[arg-type]
        assert_bounded(layer, x, d)


def test_the_sum_method_is_chosen_once_per_shape_and_the_norms_only_methods_keep_nothing() -> None:
    """Per-example gradients more than KEEP_FACTOR times the layer's record (a 3×3 kernel with 32 channels
    over 6×6 maps: 9,216 floats against 2,304) are not kept: the cost model picks among the Gram and
    norms-only methods and a sum method, once per shape, whatever the batch size."""
    layer = torch.nn.Conv2d(32, 32, 3, padding=1)
    tuner = ConvAutotuner()
    with tuner.active():
        for B in (2, 5, 3):
            activations, backprops, _ = capture(layer, torch.randn(B, 32, 6, 6))
            cache: Cache = {}
            sq_norms(layer, activations, backprops, cache)
            weighted_grad(layer, activations, backprops, torch.rand(B), cache)
            assert layer.weight not in cache
    assert len(tuner.choices) == 1
    plan = next(iter(tuner.choices.values()))
    assert plan.norms in ("gram", "position-gram", *NORMS_ONLY)
    assert plan.sum in SUM_METHODS
    with pytest.raises(ValueError, match="conv sum method must be one of"), force_conv_sum_method("im2col"):  # type: ignore[arg-type]
        pass
