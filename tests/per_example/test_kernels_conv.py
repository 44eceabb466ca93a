"""Convolution kernels (kernels/conv.py, conv_methods.py, conv_autotune.py): every norm method agrees with
materialised per-example gradients, and the cost model chooses, once per shape and without any clock,
among what fits the memory budget."""

from __future__ import annotations

import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import assert_close_scaled
from torch import nn

from lightning_dp.per_example.kernels import (
    Cache,
    conv_autotune,
    sq_norms,
    weighted_grad,
)
from lightning_dp.per_example.kernels.conv_autotune import ConvAutotuner, force_conv_method
from lightning_dp.per_example.kernels.conv_methods import (
    CONV_METHODS,
    MATERIALISING,
    ConvMethod,
    _conv_patches,
    live_taps,
)
from tests.per_example.kernel_cases import (
    CASES,
    CONV_CASES,
    GUARD_OVERSTATE,
    capture,
    check_layer,
    make_layer,
)


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("method", CONV_METHODS)
@pytest.mark.parametrize("B", [0, 3])
@pytest.mark.parametrize("case", CONV_CASES)
def test_every_conv_method_matches_materialised(case: str, B: int, method: ConvMethod) -> None:
    """Gram, unfold+bmm and the batch-grouped weight-gradient convolution give the same norms, and
    the per-example gradients the last two materialise give the same clipped sum when reused."""
    layer = make_layer(CASES[case][0], seed=B)
    x = CASES[case][1](B, torch.Generator().manual_seed(B))
    with force_conv_method(method):
        check_layer(layer, x, seed=B, cache={})


def test_conv_plan_is_chosen_once_per_shape_and_announced_once() -> None:
    """The automatic choice is cached per layer shape, not per batch size (Poisson batches vary), and
    announced in one line that names the methods and no batch size."""
    layer = nn.Conv2d(3, 4, 3)
    lines: list[str] = []
    with ConvAutotuner().active() as tuner:
        tuner.announce = lines.append
        for B in (2, 5, 3):
            activations, backprops, _ = capture(layer, torch.randn(B, 3, 8, 8))
            sq_norms(layer, activations, backprops)
    assert len(tuner.choices) == 1
    plan = next(iter(tuner.choices.values()))
    assert plan.norms in CONV_METHODS
    assert lines == [f"convolution Conv2d(3→4, 3×3) on 3×8×8 (cpu): norms {plan.norms}, sum " + (
        "the kept per-example gradients" if plan.norms in MATERIALISING else plan.sum
    )]  # fmt: skip
    assert tuner.report()[0]["norms"] == plan.norms
    assert ConvAutotuner().choices == {}, "each autotuner keeps its own choices"
    with pytest.raises(ValueError, match="conv method must be one of"), force_conv_method("im2col"):  # type: ignore[arg-type]
        pass


SHAPES = [  # (layer, input without the batch): a WRN stage, ResNet's 1×1 and ConvNeXt's 2×2 maps, a stem
    (nn.Conv2d(64, 64, 3, padding=1, bias=False), (64, 8, 8)),
    (nn.Conv2d(32, 32, 3, padding=1, bias=False), (32, 1, 1)),
    (nn.Conv2d(16, 16, 7, padding=3, groups=16), (16, 2, 2)),
    (nn.Conv2d(3, 8, 7, stride=2, padding=3, bias=False), (3, 32, 32)),
    (nn.Conv1d(4, 8, 3, padding=1), (4, 9)),
]


def test_the_plan_is_a_function_of_the_shapes_alone(monkeypatch) -> None:
    """No clock is read while choosing (a busy machine cannot change the choice), and two fresh autotuners
    given different batch sizes choose the same methods for every shape."""

    def no_clock() -> float:
        raise AssertionError("a clock was read while choosing a convolution method")

    reports = []
    for B in (2, 7):
        tuner = ConvAutotuner()
        with monkeypatch.context() as patched, tuner.active():
            for name in ("perf_counter", "thread_time", "process_time", "monotonic", "time"):
                patched.setattr(time, name, no_clock)
            for layer, shape in SHAPES:
                activations, backprops, _ = capture(layer, torch.randn(B, *shape))
                sq_norms(layer, activations, backprops, {})
        reports.append(tuner.report())
    assert reports[0] == reports[1]
    assert [entry["live_offsets"] for entry in reports[0]] == [
        None,
        [[1, 2], [1, 2]],
        [[2, 5], [2, 5]],
        None,
        None,
    ]


def test_a_cropped_kernel_keeps_nothing_and_its_dead_offsets_sum_to_exact_zeros() -> None:
    """A 3×3 kernel on 1×1 maps: only the centre offset ever touches the input; the norms come from that
    offset alone (nothing kept: the cache would need the dead offsets), the sum is exactly 0 elsewhere."""
    layer, shape = SHAPES[1]
    activations, backprops, _ = capture(layer, torch.randn(3, *shape))
    cache: Cache = {}
    with ConvAutotuner().active():
        norms = sq_norms(layer, activations, backprops, cache)[layer.weight]
        total = weighted_grad(layer, activations, backprops, torch.ones(3), cache)[layer.weight]
    assert layer.weight not in cache
    exact = (backprops.flatten(1).square().sum(1) * activations[0].flatten(1).square().sum(1)).double()
    assert_close_scaled(norms.double(), exact, terms=32)
    assert torch.count_nonzero(total[:, :, [0, 2]]) == torch.count_nonzero(total[:, :, 1, [0, 2]]) == 0
    assert (
        live_taps(nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), torch.zeros(1, 2, 1, 1), backprops)
        is None
    )


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(3, 4, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
        nn.Conv2d(2, 4, 3, dilation=2, groups=2),
        nn.Conv2d(1, 16, 8, stride=2, padding=2),
    ],
)
def test_patches_equal_f_unfold(conv: nn.Conv2d) -> None:
    """Our channel-last patches [B, G, L, (kernel, C/G)] hold exactly F.unfold's [B, (C, kernel), L]."""
    x = torch.randn(2, conv.in_channels, 9, 8)
    unfolded = F.unfold(x, conv.kernel_size, conv.dilation, conv.padding, conv.stride)
    G, (kh, kw) = conv.groups, conv.kernel_size
    expected = unfolded.view(2, G, conv.in_channels // G, kh, kw, -1).permute(0, 1, 5, 3, 4, 2)
    torch.testing.assert_close(
        _conv_patches(conv, x), expected.reshape(2, G, -1, kh * kw * conv.in_channels // G), rtol=0, atol=0
    )


@settings(max_examples=15, deadline=None)
@given(
    method=st.sampled_from(CONV_METHODS),
    B=st.integers(0, 3),
    c_in=st.integers(1, 3),
    c_out=st.integers(1, 3),
    groups=st.sampled_from([1, 2]),
    k=st.integers(1, 3),
    stride=st.integers(1, 2),
    padding=st.integers(0, 2),
    dilation=st.integers(1, 2),
    size=st.integers(5, 8),
    two_d=st.booleans(),
    bias=st.booleans(),
)
def test_conv_random_shapes(
    method: ConvMethod,
    B: int,
    c_in: int,
    c_out: int,
    groups: int,
    k: int,
    stride: int,
    padding: int,
    dilation: int,
    size: int,
    two_d: bool,
    bias: bool,
) -> None:
    conv = nn.Conv2d if two_d else nn.Conv1d
    layer = make_layer(
        lambda: conv(c_in * groups, c_out * groups, k, stride, padding, dilation, groups=groups, bias=bias), B
    )
    shape = (size, size + 1) if two_d else (size,)
    with force_conv_method(method):
        check_layer(layer, torch.randn(B, c_in * groups, *shape), seed=B, cache={}, overstate=GUARD_OVERSTATE)


@pytest.mark.parametrize("method", CONV_METHODS)
@pytest.mark.parametrize("case", ["conv2d-groups", "conv1d-stride-pad-dil-nobias", "linear-seq-materialise"])
def test_reused_samples_drop_zero_weight_examples_even_if_not_finite(case: str, method: ConvMethod) -> None:
    """The sums that reuse what the norms materialised (weights, biases, channel-last views) mask too."""
    layer = make_layer(CASES[case][0], 0)
    activations, backprops, _ = capture(layer, CASES[case][1](3, torch.Generator().manual_seed(0)))
    bad_acts, bad_bp = [a.clone() for a in activations], backprops.clone()
    bad_acts[0][1], bad_bp[1] = float("nan"), float("inf")
    weights = torch.tensor([0.5, 0.0, 2.0])
    with force_conv_method(method):
        clean = weighted_grad(layer, activations, backprops, weights)
        cache: Cache = {}
        norms = sq_norms(layer, bad_acts, bad_bp, cache)
        dirty = weighted_grad(layer, bad_acts, bad_bp, weights, cache)
    assert all(not torch.isfinite(n[1]) for n in norms.values())
    for p in clean:
        assert torch.isfinite(dirty[p]).all()
        # two algorithms (fold + weight-gradient convolution vs the reused samples): entries that nearly
        # cancel differ by ulps of the terms' magnitude, whatever the CPU's vector width
        assert_close_scaled(dirty[p], clean[p], terms=backprops[:, 0].numel())


@pytest.mark.parametrize(
    ("layer", "shape", "allowed"),
    [
        # grey first layer: per-example gradients (1024) fit in input + output gradient (784 + 16·169)
        (nn.Conv2d(1, 16, 8, stride=2, padding=2), (1, 28, 28), {"grouped", "correlate", "unfold"}),
        # per-example gradients (8192 floats) exceed input + output gradient (2304 + 800): Gram only
        (nn.Conv2d(16, 32, 4, stride=2), (16, 12, 12), set()),
        # 3 input channels: gradients fit (432 ≤ 3072 + 16384), but correlate's 3 copies of the
        # output gradients (49152) do not
        (nn.Conv2d(3, 16, 3, padding=1), (3, 32, 32), {"grouped", "unfold"}),
    ],
)
def test_conv_methods_that_keep_more_than_the_record_are_never_chosen(layer, shape, allowed) -> None:
    """The memory cap: a method whose per-example gradients (or, for correlate, its copies of the output
    gradients) exceed what the layer's record holds is not a candidate, however cheap it might be; the
    Gram methods always are."""
    activations, backprops, _ = capture(layer, torch.randn(2, *shape))
    candidates = set(conv_autotune._candidates(layer, layer, activations[0], backprops, cropped=False))
    assert candidates & set(MATERIALISING) == allowed
    assert {"gram", "position-gram"} <= candidates
    cropped = set(conv_autotune._candidates(layer, layer, activations[0], backprops, cropped=True))
    assert not cropped & set(MATERIALISING), "a cropped kernel never keeps its per-example gradients"
