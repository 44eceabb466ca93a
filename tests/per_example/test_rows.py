"""Which examples a layer call's rows are (``per_example/rows.py``)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_dp.per_example.rows import RowMap, reordered_rows, rows_of, to_batch


def _layer_output(batch: int) -> tuple[torch.Tensor, set[object]]:
    h = nn.Linear(3, 3)(torch.randn(batch, 3))
    return h, {h.grad_fn}


def test_rows_taken_from_a_layer_output_over_the_batch_are_its_examples() -> None:
    h, batched = _layer_output(6)
    assert rows_of(h[2:5], 6, batched).tolist() == [2, 3, 4]
    assert rows_of(h[-1].unsqueeze(0), 6, batched).tolist() == [5]
    assert rows_of(torch.tanh(h)[torch.tensor([4, 0])], 6, batched).tolist() == [4, 0]
    assert rows_of(torch.randn(6, 3)[1:3], 6, batched).tolist() == [1, 2], "rows of the batch itself"


def test_rows_that_cannot_be_traced_to_the_examples_are_not_given_any() -> None:
    h, batched = _layer_output(6)
    assert rows_of(h.reshape(2, 9), 6, batched) is None, "a regrouping"
    assert rows_of(h[2:4], 6, set()) is None, "not from a layer output over the batch"
    assert rows_of(h[:, :1], 6, batched) is None, "not a selection of rows"


def test_a_reordering_is_seen_and_one_undone_later_cancels() -> None:
    h, batched = _layer_output(4)
    perm = torch.tensor([2, 0, 3, 1])
    assert reordered_rows(h[perm].grad_fn, 4, batched).tolist() == perm.tolist()
    assert reordered_rows(torch.tanh(h[perm])[perm.argsort()].grad_fn, 4, batched) is None
    assert reordered_rows(h.index_select(1, torch.tensor([2, 0, 1])).grad_fn, 4, batched) is None, (
        "not the batch's dimension"
    )


def test_each_row_is_placed_at_its_example() -> None:
    rows = RowMap(torch.tensor([3, 0]), 4)
    placed = to_batch(torch.tensor([[1.0], [2.0]]), rows)
    assert placed.tolist() == [[2.0], [0.0], [0.0], [1.0]]
    assert rows.one_each
    assert not RowMap(torch.tensor([1, 1]), 4).one_each
