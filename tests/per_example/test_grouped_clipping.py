"""Grouped clipping (units of rows clipped as one: ``PerExampleGradients.grouped`` and the unit norms of
``per_example/kernels/unit_norms.py``): spec user_level.md §1.4 and its Tables C and L; the unit-norm oracle
over zoo models; the neighbour test with a whole unit removed; virtual batching at unit boundaries.
Augmentation multiplicity, whose views are units too, is tests/sampling/test_augmentation.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

from lightning_dp import DPConfigurationError, FlatClipping
from lightning_dp.clipping import clip_factors
from lightning_dp.core.batches import UnitInfo, split_batch, unit_chunks
from lightning_dp.per_example import GradientCapture, PerExampleGradients
from lightning_dp.per_example.kernels import unit_norms as unit_kernels
from lightning_dp.per_example.materialized import grad_sampler
from lightning_dp.slots import StepContext
from tests.per_example.zoo import ZOO, ZooModel
from tests.tolerances import rtol_for

C = 1.0


def _ctx(units: int) -> StepContext:
    return StepContext(
        step=0, batch_size=units, expected_batch_size=float(units), max_grad_norm=C,
        noise_multiplier=0.0, generator=torch.Generator(),
    )  # fmt: skip


def _clip(grads: PerExampleGradients) -> Tensor:
    ctx = _ctx(grads.batch)
    return FlatClipping().clip_and_sum(grads, ctx)[0].double()


def _close(got: Tensor, want: list[float] | Tensor, terms: int = 8) -> None:
    want = torch.as_tensor(want, dtype=torch.float64)
    tol = rtol_for(torch.float32, terms) * max(1.0, float(want.abs().max()))
    assert (got.double() - want).abs().max() <= tol, (got.tolist(), want.tolist())


# -- Table C: per-user clipping by hand -------------------------------------------------------------------

TABLE_C_ROWS = torch.tensor([[3, 0], [0, 4], [0.3, 0.4], [1, 0], [-1, 0], [0, 0.5]], dtype=torch.float64)
TABLE_C_UNITS = torch.tensor([0, 0, 1, 2, 2, 2])  # users 7, 2, 5


@pytest.mark.parametrize(
    ("reduction", "sq_norms", "exact", "with_clip_factors"),
    [
        ("mean", [6.25, 0.25, 1 / 36], [0.9, 1.3666666666666667], [0.8999937600648953, 1.3666583467531939]),
        ("sum", [25.0, 0.25, 0.25], [0.9, 1.7], [0.8999938800624234, 1.6999918400832312]),
    ],
)
def test_table_c_per_user_clipping(reduction, sq_norms, exact, with_clip_factors):
    grads = PerExampleGradients.from_tensors([TABLE_C_ROWS]).grouped(TABLE_C_UNITS, reduction)
    assert grads.batch == 3
    _close(grads.sq_norms(), sq_norms)
    released = _clip(grads)
    _close(released, with_clip_factors)
    _close(released, exact, terms=1 << 14)  # clip_factors' 1e-5 inflation, nothing more
    per_example = _clip(PerExampleGradients.from_tensors([TABLE_C_ROWS]))
    _close(per_example, [1.2999896667734432, 1.8999897501050613])  # example-level clipping differs


def test_table_c_user_five_with_two_rows_chosen_and_the_fp32_factor():
    rows = TABLE_C_ROWS[[0, 1, 2, 3, 4]]
    grads = PerExampleGradients.from_tensors([rows]).grouped(torch.tensor([0, 0, 1, 2, 2]), "mean")
    _close(_clip(grads), [0.9, 1.2], terms=1 << 14)
    factor = clip_factors(grads.sq_norms().sqrt(), C)[0]
    assert math.isclose(float(factor), 0.3999958336353302, rel_tol=rtol_for(torch.float32, 8))


def test_a_unit_within_c_passes_unchanged():
    rows = torch.tensor([[0.1, 0.2], [0.3, -0.1]])
    grads = PerExampleGradients.from_tensors([rows]).grouped(torch.tensor([0, 0]), "sum")
    assert torch.equal(clip_factors(grads.sq_norms().sqrt(), C), torch.ones(1))


def test_units_of_one_row_are_example_level_clipping_bit_for_bit():
    rows = torch.randn(7, 5, generator=torch.Generator().manual_seed(0)) * 3
    plain = _clip(PerExampleGradients.from_tensors([rows]))
    grouped = _clip(PerExampleGradients.from_tensors([rows]).grouped(torch.arange(7), "mean"))
    assert torch.equal(plain, grouped)


# -- Table L: unit norms on the fast path and the materialised oracle ---------------------------------------


def _linear_unit_norms(x: Tensor, delta: Tensor, units: Tensor, reduction: str, mode: str) -> Tensor:
    layer = nn.Linear(x.shape[-1], 1, bias=False)
    capture = GradientCapture(layer, loss_reduction="sum", mode=mode)  # type: ignore[arg-type]
    try:
        (layer(x).squeeze(-1) * delta).sum().backward()
        grads, _ = capture.collect()
        return grads.grouped(units, reduction).sq_norms()  # type: ignore[arg-type]
    finally:
        capture.remove()


L1 = (torch.tensor([[1.0, 0], [0, 1], [0.6, 0.8]]), torch.tensor([3.0, 4, 0.5]))
L2 = (
    torch.tensor([[[1.0, 0], [0, 1]], [[1, 1], [0, 2]], [[0.5, 0], [0, 0.5]]]),
    torch.tensor([[1.0, 2], [-1, 0.5], [2, 2]]),
)


@pytest.mark.parametrize("mode", ["fast", "materialize"])
@pytest.mark.parametrize(
    ("case", "reduction", "want"),
    [(L1, "sum", [25.0, 0.25]), (L2, "sum", [4.0, 2.0]), (L2, "mean", [1.0, 2.0])],
    ids=["L1-sum", "L2-sum", "L2-mean"],
)
def test_table_l_unit_norms(mode, case, reduction, want):
    got = _linear_unit_norms(*case, torch.tensor([0, 0, 1]), reduction, mode)
    _close(got, want)


def test_cancelling_rows_of_one_unit_never_understate_and_stay_within_c():
    """Two rows with huge gradients that cancel to a tiny unit gradient (fp32's worst case, Table L2's
    shape at scale), on the Gram route (a wide Linear) and the materialising one."""
    g = torch.Generator().manual_seed(0)
    for width in (64, 3):
        x = torch.randn(1, 4, width, generator=g).repeat(2, 1, 1)
        x[1, 0, 0] += 1e-3
        delta = torch.randn(1, 4, generator=g).repeat(2, 1) * 1e4
        delta[1] *= -1
        got = _linear_unit_norms(x, delta, torch.tensor([0, 0]), "sum", "fast")
        exact = (delta[0, :, None] * x[0]).sum(0) - (delta[0, :, None] * x[1]).sum(0)
        assert float(got[0]) >= float(exact.double().square().sum()) * (1 - 1e-6)


# -- every fast-path layer family and the fallback ----------------------------------------------------------

FAMILIES = {
    "linear-materialise": (lambda: nn.Linear(6, 5), lambda g, n: torch.randn(n, 4, 6, generator=g)),
    "linear-gram": (lambda: nn.Linear(64, 64), lambda g, n: torch.randn(n, 3, 64, generator=g)),
    "embedding-padding": (
        lambda: nn.Embedding(11, 4, padding_idx=0),
        lambda g, n: torch.randint(0, 11, (n, 5), generator=g),
    ),
    "conv1d": (lambda: nn.Conv1d(3, 4, 3, padding=1), lambda g, n: torch.randn(n, 3, 8, generator=g)),
    "conv2d-groups": (
        lambda: nn.Conv2d(4, 6, 3, groups=2),
        lambda g, n: torch.randn(n, 4, 6, 6, generator=g),
    ),
    "layernorm-fallback": (lambda: nn.LayerNorm(6), lambda g, n: torch.randn(n, 2, 6, generator=g)),
}
CRAFTED_UNITS = torch.tensor([0, 0, 1, 1, 1, 2, 2])
"""Unit 1 is crafted: three identical rows (per-row clipping would let it count 3C)."""


def _family_grads(
    name: str, x: Tensor, units: Tensor, mode: str, dtype: torch.dtype = torch.float32
) -> PerExampleGradients:
    torch.manual_seed(0)
    layer = FAMILIES[name][0]().to(dtype)
    x = x.to(dtype) if x.is_floating_point() else x
    capture = GradientCapture(layer, loss_reduction="sum", mode=mode)  # type: ignore[arg-type]
    try:
        out = layer(x)
        weights = torch.randn(out.shape[1:], generator=torch.Generator().manual_seed(1)).to(dtype)
        (out * weights).sum().backward()
        grads, _ = capture.collect()
    finally:
        capture.remove()
    return grads.grouped(units, "mean")


def _crafted_batch(name: str, scale: float) -> Tensor:
    x = FAMILIES[name][1](torch.Generator().manual_seed(2), 7)
    x[3] = x[4] = x[2]
    if x.is_floating_point():
        x[2:5] *= scale
    return x


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fast_unit_norms_equal_the_materialised_ones(name):
    x = _crafted_batch(name, 1.0)
    fast = _family_grads(name, x, CRAFTED_UNITS, "auto").sq_norms()
    exact = _family_grads(name, x, CRAFTED_UNITS, "materialize", torch.float64)
    want = exact.sq_norms().double()
    assert torch.all(fast.double() >= want * (1 - 1e-6)), (fast, want)
    assert torch.allclose(fast.double(), want, rtol=1e-4), (fast, want)


@pytest.mark.parametrize("name", [n for n in FAMILIES if "fallback" not in n])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_regrouped_kernels_equal_per_row_gradients_summed_per_unit(name, reduction):
    """The regrouped-sequence kernels themselves (a layer whose per-row gradients were materialised on the
    way takes the index-add route in the engine, so the kernels are called directly here)."""
    torch.manual_seed(0)
    layer = FAMILIES[name][0]()
    x = _crafted_batch(name, 1.0)
    delta = torch.randn(layer(x).shape, generator=torch.Generator().manual_seed(3))
    info = UnitInfo(CRAFTED_UNITS, reduction)
    weights = info.row_weights()
    got = sum(unit_kernels.unit_sq_norms(layer, [x], delta, CRAFTED_UNITS, weights, 3).values())
    exact64 = layer.double()
    rows = grad_sampler(exact64)(exact64, [x.double() if x.is_floating_point() else x], delta.double())
    want = torch.zeros(3, dtype=torch.float64)
    for g in rows.values():
        sums = g.new_zeros(3, *g.shape[1:]).index_add_(
            0, CRAFTED_UNITS, g * weights.double().view(-1, *[1] * (g.dim() - 1))
        )
        want += sums.flatten(1).square().sum(1)
    assert torch.all(got.double() >= want * (1 - 1e-6)), (got, want)
    assert torch.allclose(got.double(), want, rtol=1e-4), (got, want)


@pytest.mark.parametrize("mode", ["auto", "materialize"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_removing_a_unit_of_identical_huge_rows_moves_the_clipped_sum_by_c(name, mode):
    small_c = 1e-3
    x = _crafted_batch(name, 1e3)
    kept = CRAFTED_UNITS != 1
    ctx = _ctx(3)
    ctx.max_grad_norm = small_c
    full = FlatClipping().clip_and_sum(_family_grads(name, x, CRAFTED_UNITS, mode), ctx)
    ctx = _ctx(2)
    ctx.max_grad_norm = small_c
    rest = FlatClipping().clip_and_sum(_family_grads(name, x[kept], torch.tensor([0, 0, 1, 1]), mode), ctx)
    move = math.sqrt(
        sum(float((a.double() - b.double()).square().sum()) for a, b in zip(full, rest, strict=True))
    )
    assert move <= small_c * (1 + 1e-5)
    assert move >= small_c * (1 - 1e-3)  # exactly C: the unit's three rows count once


# -- the unit-norm oracle over zoo models (spec §5.7-3) ------------------------------------------------------

ORACLE_ZOO = [
    e
    for e in ZOO
    if e.name in ("transformer_encoder", "channels_last_cnn_custom_layer", "nanogpt_tied", "gru")
]


def _zoo(entry: ZooModel) -> tuple[nn.Module, tuple[Tensor, ...]]:
    torch.manual_seed(0)
    model = entry.build().double().train()
    batch = entry.batch(torch.Generator().manual_seed(1))
    # 7 rows from copies of the batch (7 ≠ the zoo's sequence length T, so a broadcast position lookup
    # is not taken for the batch), so units of up to 4 rows hold different examples
    batch = tuple(torch.cat([t, t.flip(0), t])[:7] for t in batch)
    return model, tuple(t.double() if t.is_floating_point() else t for t in batch)


@pytest.mark.parametrize("mode", ["auto", "materialize"])
@pytest.mark.parametrize("entry", ORACLE_ZOO, ids=repr)
def test_unit_norms_equal_autograd_of_each_unit_s_mean_loss(entry: ZooModel, mode: str) -> None:
    model, batch = _zoo(entry)
    rows = batch[0].shape[0]
    units = torch.tensor([0, 1, 1, 2, 2, 2, 2])[:rows]
    params = [p for p in model.parameters() if p.requires_grad]
    expected = []
    for u in range(int(units[-1]) + 1):
        index = (units == u).nonzero().squeeze(1)
        h = [torch.zeros_like(p) for p in params]
        for i in index.tolist():
            grads = torch.autograd.grad(model(*(t[i : i + 1] for t in batch)), params, allow_unused=True)
            for total, g in zip(h, grads, strict=True):
                if g is not None:
                    total += g
        expected.append(sum(float(t.square().sum()) for t in h) / len(index) ** 2)
    capture = GradientCapture(model, mode=mode)  # type: ignore[arg-type]
    try:
        capture.expect_batch(rows)  # as the engine does: a broadcast position lookup has the batch's rows
        model(*batch).backward()
        grads, _ = capture.collect()
        got = grads.grouped(units, "mean").sq_norms().double()
    finally:
        capture.remove()
    want = torch.tensor(expected, dtype=torch.float64)
    assert torch.all(got >= want * (1 - 1e-5)), (got, want)  # never understated
    assert torch.allclose(got, want, rtol=1e-4), (got, want)


# -- virtual batching at unit boundaries --------------------------------------------------------------------


def test_chunks_hold_whole_units_and_a_unit_larger_than_a_chunk_is_refused():
    units = UnitInfo(torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3]))
    batch = (torch.arange(9), torch.zeros(()))
    chunks = split_batch(batch, 5, units)
    assert [c[0].tolist() for c in chunks] == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    assert [u.unit_of_row.tolist() for _, _, u in unit_chunks(units, 5)] == [[0, 0, 0, 1, 1], [0, 1, 1, 1]]
    with pytest.raises(DPConfigurationError, match="max_physical_batch_size"):
        split_batch(batch, 2, units)


def test_leaving_whole_units_out_keeps_the_other_units_grouped_as_before():
    """UnitInfo.without: what a unit-aware mixing check removes (the rows of whole units) and compares."""
    units = UnitInfo(torch.tensor([0, 0, 1, 2, 2, 2, 3]))
    rows, rest, kept = units.without([0, 2])
    assert rows == [0, 1, 3, 4, 5]
    assert rest.unit_of_row.tolist() == [0, 1]
    assert kept.tolist() == [1, 3]
    g = torch.randn(7, 3, generator=torch.Generator().manual_seed(0))
    before = PerExampleGradients.from_tensors([g]).grouped(units.unit_of_row).sq_norms()
    keep = [r for r in range(7) if r not in rows]
    after = PerExampleGradients.from_tensors([g[keep]]).grouped(rest.unit_of_row).sq_norms()
    assert torch.equal(before[kept], after)
