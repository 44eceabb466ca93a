"""Augmentation multiplicity (``sampling/augmentation.py``): spec user_level.md §1.5 and its Table A.

Each example's K views are averaged before the clip and compose with a sampler's units; views a chunk or a
slot cannot hold are refused; an augmented run through the Trainer is priced like DP-SGD, and removing one
example with all its views moves the sum by at most C. The clipping helpers (``C``, ``_clip``, ``_close``)
are those of tests/per_example/test_grouped_clipping.py, where the views' units are clipped.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TinyModule, make_trainer
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_dp import DPConfigurationError, DPStrategy
from lightning_dp.core.batches import UnitInfo
from lightning_dp.per_example import PerExampleGradients
from lightning_dp.sampling.augmentation import flatten_views, with_views
from tests.per_example.test_grouped_clipping import C, _clip, _close

# -- Table A: augmentation multiplicity ----------------------------------------------------------------------

TABLE_A_VIEWS = torch.tensor([[2, 0], [0, 2], [0.1, 0], [0.3, 0]])


def test_table_a_views_are_averaged_before_the_clip():
    rows, info = flatten_views([("a0", "a1"), ("b0", "b1")], views=2)
    assert rows == ["a0", "a1", "b0", "b1"]
    units = info.units
    assert units.unit_of_row.tolist() == [0, 0, 1, 1]
    assert units.reduction == "mean"
    grads = PerExampleGradients.from_tensors([TABLE_A_VIEWS]).grouped(units.unit_of_row, units.reduction)
    released = _clip(grads)
    _close(released, [0.907099210199799, 0.7070992101997989])
    _close(released, [0.9071067811865474, 0.7071067811865475], terms=1 << 14)
    per_view = _clip(PerExampleGradients.from_tensors([TABLE_A_VIEWS]))
    _close(per_view, [1.4, 1.0], terms=1 << 14)  # the wrong answer: sensitivity K·C


def test_views_compose_with_a_sampler_s_units():
    users = UnitInfo(torch.tensor([0, 0, 1]), "sum")
    info = with_views(users, examples=3, views=2)
    assert info.sampler_info is users
    assert info.units.unit_of_row.tolist() == [0, 0, 0, 0, 1, 1]
    # "sum" over a user's examples of each example's mean over its views
    assert info.units.row_weights().tolist() == [0.5] * 6
    mean = with_views(UnitInfo(torch.tensor([0, 0, 1]), "mean"), examples=3, views=2).units
    assert mean.row_weights().tolist() == [0.25] * 4 + [0.5] * 2


# -- views a chunk or a slot cannot hold ---------------------------------------------------------------


def test_augmentation_multiplicity_larger_than_a_chunk_is_refused_at_construction():
    with pytest.raises(DPConfigurationError, match="max_physical_batch_size to at least 4"):
        DPStrategy(augmentation_multiplicity=4, max_physical_batch_size=3)
    with pytest.raises(DPConfigurationError, match="augmentation_multiplicity"):
        DPStrategy(augmentation_multiplicity=0)
    # isolate_examples runs each example alone with all its views: accepted, unless a chunk bound given
    # with it cannot hold the views (tests/checks/test_unit_mixing.py runs it)
    DPStrategy(augmentation_multiplicity=2, isolate_examples=True)
    with pytest.raises(DPConfigurationError, match="max_physical_batch_size to at least 2"):
        DPStrategy(augmentation_multiplicity=2, isolate_examples=True, max_physical_batch_size=1)


@pytest.mark.parametrize("slot", ["DPIS", "LineSearch", "AdaptiveGD"])
def test_slots_that_bound_rows_not_units_are_refused_with_augmentation_multiplicity(slot):
    import lightning_dp

    mechanism = getattr(lightning_dp, slot)()
    kind = "sampler" if slot == "DPIS" else "step"
    with pytest.raises(DPConfigurationError, match=f"augmentation_multiplicity=2 with {slot}"):
        DPStrategy(augmentation_multiplicity=2, **{kind: mechanism})


# -- through the Trainer ----------------------------------------------------------------------------------------


class Jittered(Dataset):
    """Each call draws a new view (a random shift of the input), so K calls give K different views."""

    def __init__(self, x: Tensor, y: Tensor, scale: float = 0.1) -> None:
        self.x, self.y, self.scale = x, y, scale

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i] + self.scale * torch.randn(self.x.shape[1]), self.y[i]


class JitteredModule(TinyModule):
    def train_dataloader(self):
        return DataLoader(Jittered(self.x, self.y), batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        self.last_batch = batch
        return super().training_step(batch, batch_idx)


def test_an_augmented_run_sees_k_views_per_example_and_spends_the_epsilon_of_k_equals_1():
    runs = {}
    for views in (1, 3):
        module = JitteredModule(n=64, batch_size=16)
        strategy = DPStrategy(noise_multiplier=1.0, seed=3, augmentation_multiplicity=views)
        make_trainer(strategy, max_steps=4).fit(module)
        assert strategy.engine.steps == 4
        assert all(size % views == 0 for size in module.seen_batch_sizes)
        runs[views] = (strategy.epsilon, module.seen_batch_sizes)
        x, y = module.last_batch
        if views > 1:  # each example's views are consecutive rows: one label, K different draws
            assert torch.equal(y[0::views], y[1::views])
            assert not torch.equal(x[0::views], x[1::views])
    assert runs[3][0] == runs[1][0]
    assert sum(runs[3][1]) > sum(runs[1][1])  # three rows per drawn example


class LinearSum(LightningModule):
    """One bias-free Linear whose loss is the sum of its outputs: each row's gradient is its input."""

    def __init__(self, width: int = 2) -> None:
        super().__init__()
        self.layer = nn.Linear(width, 1, bias=False)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class ViewsInTurn(Dataset):
    """Example i's j-th call returns views[i][j % K]: deterministic views (Table A)."""

    def __init__(self, views: list[list[list[float]]]) -> None:
        self.views, self.calls = views, [0] * len(views)

    def __len__(self) -> int:
        return len(self.views)

    def __getitem__(self, i: int) -> tuple[Tensor]:
        view = self.views[i][self.calls[i] % len(self.views[i])]
        self.calls[i] += 1
        return (torch.tensor(view),)


def test_table_a_through_the_engine_never_clips_per_view(neighbour):
    views = [[[2.0, 0.0], [0.0, 2.0]], [[0.1, 0.0], [0.3, 0.0]]]
    capture = neighbour.released_sum(
        LinearSum(),
        ViewsInTurn(views),
        lambda: DPStrategy(
            noise_multiplier=0.0, max_grad_norm=C, loss_reduction="sum", augmentation_multiplicity=2
        ),
    )
    assert capture.sums is not None
    _close(capture.sums[0].flatten(), [0.907099210199799, 0.7070992101997989])


@pytest.mark.parametrize(("chunk", "precision"), [(None, "32-true"), (8, "32-true"), (None, "bf16-mixed")])
def test_removing_one_example_with_all_its_views_moves_the_sum_by_at_most_c(neighbour, chunk, precision):
    """Identical huge views (no random transform): per-view clipping would move the sum by K·C; grouped
    clipping moves it by exactly C. Also under virtual batching (chunks of whole units) and in bf16.

    Exactly C up to rounding: the five kept units are recomputed in a batch of 20 rows, not 24, so the mean
    loss scales their gradients by another 1/B, rounded in the step's dtype (bf16 under ``bf16-mixed``, the
    forward itself being row-for-row the same). Each entry of a kept unit's gradient then differs by a
    rounding or two (relative, below eps), so its clipped contribution (norm C) moves by less than eps·C;
    the five units' errors are independent, so their sum moves by about eps·C·√5 at most, and so does the
    move (triangle inequality). In fp32 that is 3e-7, below the 1e-5 of clip_factors' margin; in bf16
    1.7e-2 (over 140 weight seeds |move/C − 1| stayed below 1.8e-3, so the fp32 allowance alone failed on
    about half of the draws), far from the 4C of per-view clipping."""
    small_c = 1e-3
    torch.manual_seed(0)  # the module's weights (the data has its own generator)
    module = TinyModule(n=6)
    x = torch.randn(6, 10, generator=torch.Generator().manual_seed(0)) * 1e3
    data = TensorDataset(x, torch.arange(6) % 3)
    move = neighbour.neighbour_move(
        module,
        data,
        lambda: DPStrategy(
            noise_multiplier=0.0,
            max_grad_norm=small_c,
            augmentation_multiplicity=4,
            max_physical_batch_size=chunk,
        ),
        precision=precision,
    )
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float32
    rounding = torch.finfo(dtype).eps * math.sqrt(len(data) - 1)
    assert move.l2 <= small_c * (1 + 1e-5 + rounding), move.l2 / small_c - 1
    assert move.l2 >= small_c * (1 - 1e-3 - rounding), move.l2 / small_c - 1  # exactly C, not 4C
