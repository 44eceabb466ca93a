"""Which modules the capture hooks, and how a call's inputs are read (``per_example/layers.py``)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_dp.per_example.layers import expands_params, positional, trainable_layers, unique_layers


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(2, 2)
        self.net = nn.Sequential(self.inp, nn.Tanh())
        self.frozen = nn.Linear(2, 2).requires_grad_(False)
        self.cls_token = nn.Parameter(torch.zeros(1, 2))


def test_each_layer_holding_parameters_is_hooked_once_under_its_first_name() -> None:
    model = _Twice()
    assert [name for name, _ in unique_layers(trainable_layers(model))] == ["", "inp"]
    assert [name for name, _ in unique_layers(trainable_layers(model, trainable=False))] == [
        "",
        "inp",
        "frozen",
    ]
    assert expands_params(model), "a container of [1, ...] parameters is expanded to the batch"
    assert not expands_params(model.inp)


def test_a_calls_inputs_are_read_in_the_order_of_its_forward() -> None:
    bag = nn.EmbeddingBag(5, 2, mode="sum")
    x, w = torch.tensor([0, 1]), torch.ones(2)
    assert positional(bag, (x,), {"per_sample_weights": w}) == (x, None, w), (
        "a skipped offsets keeps its place"
    )
    fc = nn.Linear(2, 2)
    h = torch.ones(1, 2)
    assert positional(fc, (), {"input": h}) == (h,)
