"""The integer grid (``clipping/integer_grid.py``, issue #50), without a Trainer: every rounded contribution within
the sensitivity, the integer sum as flat clipping up to the rounding and exact beyond 2⁵³, non-finite examples
dropped and sums that never overflow."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dp.clipping.integer_grid import GridClipping
from lightning_dp.noise.discrete_gaussian import DiscreteGaussian
from lightning_dp.per_example import PerExampleGradients
from lightning_dp.slots import StepContext

# -- the integer grid -------------------------------------------------------------------------------------------


def _ctx(batch: int, C: float) -> StepContext:
    return StepContext(0, batch, float(batch), C, 1.0, torch.Generator())


@pytest.mark.parametrize("slack", [1e-1, 1e-3])
def test_every_rounded_contribution_is_within_the_sensitivity(slack):
    g = torch.Generator().manual_seed(0)
    grads = [100 * torch.randn(16, 5, 7, generator=g), torch.randn(16, 7, generator=g) * 1e-3]
    clipping = GridClipping(DiscreteGaussian(1.0, rounding_slack=slack).grid)
    clipping.setup([p[0] for p in grads])
    for C in (1e-3, 0.5, 40.0):
        for i in range(16):
            one = clipping.clip_and_sum(
                PerExampleGradients.from_tensors([p[i : i + 1] for p in grads]), _ctx(1, C)
            )
            norm = math.sqrt(sum(float(t.double().square().sum()) for t in one))
            assert norm <= clipping.sensitivity(_ctx(1, C))
            assert clipping.grid.step(C) * clipping.sensitivity(_ctx(1, C)) <= C * (1 + slack + 1.01e-4)


def test_the_integer_sum_is_flat_clipping_up_to_half_a_grid_step_per_example():
    """The neutral check: the released sum (σ = 0) is DP-SGD's clipped sum, up to the rounding (≤ γ/2 a
    coordinate and example), and it is exact: the same integers in any order or split."""
    from lightning_dp import FlatClipping

    g = torch.Generator().manual_seed(1)
    grads = [3 * torch.randn(8, 4, 3, generator=g), torch.randn(8, 3, generator=g)]
    clipping = GridClipping(DiscreteGaussian(0.0).grid)
    clipping.setup([p[0] for p in grads])
    ctx = _ctx(8, 1.0)
    integers = clipping.clip_and_sum(PerExampleGradients.from_tensors(grads), ctx)
    released = clipping.finalize([s.clone() for s in integers], ctx)
    flat = [s / 8 for s in FlatClipping().clip_and_sum(PerExampleGradients.from_tensors(grads), ctx)]
    step = clipping.grid.step(1.0)
    for a, b in zip(released, flat, strict=True):
        assert float((a - b).abs().max()) <= step / 2 + 2e-5  # 2e-5: FlatClipping's own 1e-5 inflation
    split = [
        a + b
        for a, b in zip(
            clipping.clip_and_sum(PerExampleGradients.from_tensors([p[:3] for p in grads]), ctx),
            clipping.clip_and_sum(PerExampleGradients.from_tensors([p[3:] for p in grads]), ctx),
            strict=True,
        )
    ]
    assert all(torch.equal(a, b) for a, b in zip(integers, split, strict=True))


def test_the_integer_sum_is_exact_beyond_two_to_the_53():
    """Rounded rows of about 2⁴⁶ grid units, 2048 of them: their sum passes 2⁵³, where fp64 adds inexactly;
    the integers must still add up exactly (each chunk exactly, the chunks in int64), whatever the order."""
    from lightning_dp.clipping import integer_grid

    g = torch.Generator().manual_seed(3)
    unit = 2.0**46
    rows = torch.randint(-(2**20), 2**20, (2048, 4), generator=g, dtype=torch.int64) + (2**46 - 2**21)
    values = rows.to(torch.float64)
    total, _ = integer_grid._round_and_sum(
        values, torch.ones(2048, dtype=torch.float64), torch.float64, unit, again=False, clean=True
    )
    exact = [sum(int(v) for v in rows[:, j].tolist()) for j in range(4)]
    assert total.tolist() == exact
    flipped, _ = integer_grid._round_and_sum(
        values.flip(0), torch.ones(2048, dtype=torch.float64), torch.float64, unit, again=False, clean=True
    )
    assert torch.equal(total, flipped)


def test_non_finite_examples_are_dropped_and_sums_never_overflow():
    grads = [torch.randn(4, 6)]
    grads[0][1, 2] = math.nan
    grads[0][2, 0] = math.inf
    noise = DiscreteGaussian(1.0)
    clipping = GridClipping(noise.grid)
    clipping.setup([grads[0][0]])
    sums = clipping.clip_and_sum(PerExampleGradients.from_tensors(grads), _ctx(4, 1.0))
    alone = clipping.clip_and_sum(PerExampleGradients.from_tensors([grads[0][[0, 3]]]), _ctx(2, 1.0))
    assert torch.equal(sums[0], alone[0])
    tiny = DiscreteGaussian(1.0, rounding_slack=1e-19)  # a grid so fine that 4 examples could overflow int64

    class Data:
        num_samples = 4

    tiny.link_sampler(Data())  # type: ignore[arg-type]
    tiny.setup([torch.zeros(6)])
    from lightning_dp import DPConfigurationError

    with pytest.raises(DPConfigurationError, match="overflow int64"):
        tiny.add_noise([torch.zeros(6, dtype=torch.int64)], 1.0, torch.Generator())
    with pytest.raises(DPConfigurationError, match="integer sums only"):
        noise.add_noise([torch.zeros(6)], 1.0, torch.Generator())
