"""Layer scale (y = x · γ per channel): timm's LayerScale / LayerScale2d and the ChannelScale part that
carries ConvNeXt blocks' own ``gamma``; exact per-example gradients in fp64, and crafted inputs whose
per-position terms cancel still contribute at most C."""

from __future__ import annotations

import pytest
import torch
from timm.layers import LayerScale, LayerScale2d
from timm.models.convnext import ConvNeXtBlock
from torch import nn

from lightning_dp.per_example import GradientCapture
from lightning_dp.per_example.kernels import is_supported
from lightning_dp.per_example.kernels.ecosystem import ChannelScale, register_loaded
from tests.per_example.kernel_cases import check_layer, make_layer, randn
from tests.per_example.test_certified import assert_bounded, huge_pairs, with_normal_examples

register_loaded()


def _channel_scale(dim: int) -> nn.Module:
    class Holder(nn.Module):  # the part borrows a parameter its block owns
        def __init__(self) -> None:
            super().__init__()
            self.gamma = nn.Parameter(torch.ones(4))
            self.part = ChannelScale(self.gamma, dim=dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.part(x)

    return Holder().part


CASES = {
    "layerscale-seq": (lambda: LayerScale(4, init_values=0.5), randn(3, 4)),
    "layerscale-2d-input": (lambda: LayerScale(4, init_values=0.5), randn(4)),
    "layerscale2d": (lambda: LayerScale2d(4, init_values=0.5), randn(4, 3, 5)),
    "channelscale-dim1": (lambda: _channel_scale(1), randn(4, 5, 2)),
    "channelscale-last": (lambda: _channel_scale(-1), randn(2, 3, 4)),
}


@pytest.mark.parametrize("B", [0, 1, 5])
@pytest.mark.parametrize("case", list(CASES))
def test_layer_scale_matches_the_fp64_reference(case: str, B: int) -> None:
    layer = make_layer(CASES[case][0], seed=B)
    assert is_supported(layer)
    check_layer(layer, CASES[case][1](B, torch.Generator().manual_seed(B)), seed=B, cache={})


def test_channels_last_input() -> None:
    """ConvNeXt applies its scale to a [B, C, H, W] view of channels-last memory."""
    layer = make_layer(lambda: _channel_scale(1), seed=0)
    x = torch.randn(3, 5, 2, 4).permute(0, 3, 1, 2)  # [3, 4, 5, 2], channels innermost in memory
    check_layer(layer, x, cache={})


def test_the_in_place_layer_scale_is_not_on_the_fast_path() -> None:
    """LayerScale(inplace=True) overwrites the input its kernels would read."""
    assert not is_supported(LayerScale(4, inplace=True))


@pytest.mark.parametrize("dim", [1, -1])
def test_crafted_cancelling_positions_contribute_at_most_c(dim: int) -> None:
    """±2²⁴ output gradients that cancel over the positions, between small ones: the fp32 position sum
    loses the small terms; the certified norm still bounds the example's contribution by C."""
    layer = _channel_scale(dim)
    d = huge_pairs(16, 4, 7)  # [1, 16, 4]: positions × channels
    x = torch.ones_like(d)
    if dim == 1:
        x, d = x.transpose(1, 2).contiguous(), d.transpose(1, 2).contiguous()
    assert_bounded(layer, *with_normal_examples(x, d))


def test_convnext_block_gamma_takes_the_fast_path_and_is_exact() -> None:
    """The block's own ``gamma`` goes through a ChannelScale part (no per-example recompute of the
    block); per-example gradients of every parameter equal autograd on each example alone, in fp64."""
    torch.manual_seed(0)
    block = ConvNeXtBlock(8, 8, conv_mlp=False, ls_init_value=0.5).double().train()
    x = torch.randn(3, 8, 5, 5, dtype=torch.float64)
    params = [p for p in block.parameters() if p.requires_grad]
    expected = [torch.autograd.grad(block(x[i : i + 1]).square().sum(), params) for i in range(3)]
    capture = GradientCapture(block, loss_reduction="sum")
    try:
        assert "ChannelScale" in {type(m).__name__ for _, m in capture.layers}
        assert {capture.path_of(m) for _, m in capture.layers} == {"fast"}
        block(x).square().sum().backward()
        samples, _ = capture.collect()
        full = dict(zip(samples.params, samples.materialize(), strict=True))
    finally:
        capture.remove()
    assert type(block) is ConvNeXtBlock
    for i, grads in enumerate(expected):
        for p, g in zip(params, grads, strict=True):
            torch.testing.assert_close(full[p][i].double(), g, rtol=1e-5, atol=1e-6 * float(g.abs().max()))
