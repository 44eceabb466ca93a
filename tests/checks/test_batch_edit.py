"""A check edits whole examples (``checks/batch_edit.py``; issue #37, goal 2).

The mixing check runs the user's ``training_step`` itself, on the sampled batch and on that batch with
examples removed or replaced. A changed batch must be one the loader could yield (every per-example field
edited together), and a step that cannot run on a changed batch is checked by replacement or refused by name,
never ended by its own exception.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyModule, make_trainer
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from lightning_dp import DPConfigurationError, DPStrategy, checking
from lightning_dp.checks.batch_edit import remove_rows, replace_rows

# -- a check edits whole examples ----------------------------------------------------------------------


class Records(Dataset):
    """Items ``(x, y, index, {"source": str, "weight": float})``, with ``ragged`` also a variable-length
    ``"tokens"`` tensor: the default collate makes a list of strings and a float tensor of the first two."""

    def __init__(self, n: int = 24, ragged: bool = True) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 10, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.ragged = ragged

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        meta: dict[str, Any] = {"source": f"site-{i}", "weight": 1.0 + i % 3}
        if self.ragged:
            meta["tokens"] = torch.arange(1 + i % 4) + i
        return self.x[i], self.y[i], i, meta


def _collate_records(items: list[Any]) -> Any:
    """The default collate, except for the variable-length tokens: a list of one tensor per example."""
    tokens = [item[3].pop("tokens") for item in (copy.deepcopy(i) for i in items)]
    batch = default_collate(
        [(x, y, i, {k: v for k, v in m.items() if k != "tokens"}) for x, y, i, m in items]
    )
    batch[3]["tokens"] = tokens
    return batch


ALIGNMENT: list[tuple[bool, int, bool]] = []
"""(checking(), rows, aligned) of every training_step call: kept outside the module, which the checks
put back (state outside the module is the user's to guard with checking())."""


class WeightedBySource(TinyModule):
    """A per-example loss weighted by a non-tensor field; records whether every field is aligned."""

    def __init__(self) -> None:
        super().__init__()
        self.data = Records()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y, index, meta = batch
        tokens = meta.get("tokens", [i.view(1) for i in index])
        aligned = (
            len(meta["source"]) == len(tokens) == len(x)
            and all(s == f"site-{int(i)}" for s, i in zip(meta["source"], index, strict=True))
            and all(int(t[0]) == int(i) for t, i in zip(tokens, index, strict=True))
            and torch.equal(meta["weight"], 1.0 + (index % 3).to(meta["weight"].dtype))
            and all(torch.equal(x[j], self.data.x[int(i)]) for j, i in enumerate(index))
        )
        ALIGNMENT.append((checking(), len(x), aligned))
        losses = F.cross_entropy(self(x), y, reduction="none") * meta["weight"].to(x.dtype)
        return losses.mean()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8, collate_fn=_collate_records)


def test_non_tensor_per_example_fields_are_removed_and_replaced_with_their_examples():
    """Strings, a weight and variable-length tensors travel with their example in the check's passes (the
    default setting), so the dry passes see batches the loader could yield; the real steps too."""
    ALIGNMENT.clear()
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_sensitivity="every_step")
    make_trainer(strategy, max_epochs=1).fit(WeightedBySource())
    dry = [(rows, aligned) for is_dry, rows, aligned in ALIGNMENT if is_dry]
    real = [(rows, aligned) for is_dry, rows, aligned in ALIGNMENT if not is_dry]
    assert len(real) == strategy.engine.steps - sum(rows == 0 for rows, _ in real)
    assert dry
    assert all(aligned for _, aligned in dry + real), ALIGNMENT
    assert any(rows < max(r for r, _ in real) for rows, _ in dry)  # an example was removed in a pass


def test_a_loss_weighted_by_non_tensor_fields_moves_the_released_sum_by_at_most_c(neighbour):
    """The neighbour test (σ = 0, default checks on, the default collate's list of strings): the check
    passes on aligned fields and one example moves the sum by at most C."""
    ALIGNMENT.clear()
    module = WeightedBySource()
    move = neighbour.neighbour_move(
        module, Records(ragged=False), lambda: DPStrategy(noise_multiplier=0.0, max_grad_norm=0.01, seed=0)
    )
    neighbour.assert_neighbour_bound(move)
    assert any(is_dry for is_dry, _, _ in ALIGNMENT)
    assert all(aligned for _, _, aligned in ALIGNMENT), ALIGNMENT


Pair = namedtuple("Pair", ["left", "right"])


@dataclasses.dataclass
class Example:
    features: Tensor
    names: list[str]
    pair: Pair
    shared: Tensor


def test_batch_edits_move_every_per_example_field_in_any_container():
    """Tensors with dim 0 = B and lists/tuples of B values, nested in dicts, lists, namedtuples and
    dataclasses, are removed or replaced together; shared values and the batch's own fields are kept."""
    rows = 4
    batch = {
        "x": torch.arange(8.0).view(4, 2),
        "example": Example(
            torch.arange(4), ["a", "b", "c", "d"], Pair(("p", "q", "r", "s"), torch.ones(4, 1)), torch.ones(3)
        ),
        "ragged": [torch.arange(i + 1) for i in range(4)],
        "fields": (torch.arange(4) * 10, ["w", "x", "y", "z"]),
    }
    out = remove_rows(batch, (1,), rows)
    assert out["x"].tolist() == [[0.0, 1.0], [4.0, 5.0], [6.0, 7.0]]
    assert out["example"].features.tolist() == [0, 2, 3]
    assert out["example"].names == ["a", "c", "d"]
    assert out["example"].pair.left == ("p", "r", "s")
    assert isinstance(out["example"].pair, Pair)
    assert out["example"].pair.right.shape == (3, 1)
    assert torch.equal(out["example"].shared, torch.ones(3))
    assert [len(t) for t in out["ragged"]] == [1, 3, 4]
    assert out["fields"][0].tolist() == [0, 20, 30]
    assert out["fields"][1] == ["w", "y", "z"]
    swapped = replace_rows(batch, (0, 3), [2, 1])
    assert swapped["example"].names == ["c", "b", "c", "b"]
    assert swapped["fields"][0].tolist() == [20, 10, 20, 10]
    assert [len(t) for t in swapped["ragged"]] == [3, 2, 3, 2]
    assert batch["example"].names == ["a", "b", "c", "d"]  # the original is untouched
    two = (torch.zeros(2, 3), torch.tensor([0, 1]))  # two examples: (x, y) are fields, not examples
    assert [t.shape[0] for t in remove_rows(two, (0,), 2)] == [1, 1]


# -- a step that cannot run on a changed batch ---------------------------------------------------------------

VIEWS = 3


def _collate_views(items: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    """Each example's input, its label, and VIEWS noisy views of it flattened to [B * VIEWS, d]."""
    x = torch.stack([item[0] for item in items])
    views = torch.cat([item[0] + 0.1 * k for item in items for k in range(VIEWS)]).view(-1, x.shape[1])
    return x, torch.stack([item[1] for item in items]), views


class GroupedViews(TinyModule):
    """Reshapes the collate_fn's [B * VIEWS, d] views by the group size: a batch with one row of x removed
    (and the views kept whole, since their dim 0 is not the batch) cannot run."""

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y, views = batch
        context = views.view(len(x), VIEWS, -1).mean(1)  # raises on a batch the loader never makes
        return F.cross_entropy(self(x + context), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            TensorDataset(self.x, self.y), batch_size=self.batch_size, collate_fn=_collate_views
        )


def test_a_step_that_cannot_run_on_a_smaller_batch_is_checked_by_replacement_and_trains():
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    make_trainer(strategy, max_steps=3).fit(GroupedViews())
    assert strategy.engine.steps == 3
    assert strategy.checks.mixing.checked_steps[:1] == [0]


def test_grouped_views_move_the_released_sum_by_at_most_c(neighbour):
    """The neighbour test (σ = 0, default checks on): the check runs by replacement and one example (its
    input and its views) moves the released sum by at most C."""
    module = GroupedViews()
    data = TensorDataset(module.x[:12], module.y[:12])
    move = neighbour.neighbour_move(
        module,
        data,
        lambda: DPStrategy(noise_multiplier=0.0, max_grad_norm=0.01, seed=0),
        collate_fn=_collate_views,
    )
    neighbour.assert_neighbour_bound(move)


class DuplicateExampleError(Exception):
    pass


class OnlyLoaderBatches(GroupedViews):
    """Also insists that no example appears twice: neither a removal nor a replacement can run."""

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        x = batch[0]
        if len(torch.unique(x, dim=0)) < len(x):
            raise DuplicateExampleError("an example appears twice in this batch")
        return super().training_step(batch, batch_idx)


def test_a_step_that_runs_only_on_loader_batches_is_refused_by_name_before_any_release():
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    with pytest.raises(DPConfigurationError, match="could not run your training_step") as refusal:
        make_trainer(strategy, max_steps=3).fit(OnlyLoaderBatches())
    message = str(refusal.value)
    assert "removed it raised DuplicateExampleError: an example appears twice" in message  # quoted
    assert "replaced by copies of other examples of the batch it raised DuplicateExampleError" in message
    assert "isolate_examples=True" in message
    assert "Checks(sensitivity=False)" in message
    assert strategy.engine.steps == 0
