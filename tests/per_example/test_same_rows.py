"""A parameter on the LightningModule repeated over the batch's rows (``lightning_dp/per_example/uses.py``):
every row of ``cls.expand(B, -1, -1)`` is the same value, and stays so through row-wise ops (a scale, an
``unsqueeze(1)``, a cast), so a meeting with the batch's rows recomputes each row with that one row. Each
form trains with exact per-example gradients through ``Trainer.fit`` under the defaults (fp64 autograd on
each example alone is the reference; the neighbour test moves the clipped sum by at most C); rows of a
repeated parameter that differ by their position in the batch, or that meet the batch's mean, stay
refused."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import seed_everything
from test_model_patterns import Patterned, assert_exact, assert_refused, data
from torch import Tensor, nn


class Tokens(Patterned):
    """Patch tokens of each example, with learned tokens put in front of them in the model's own forward."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.patch = nn.Linear(2, 6)
        self.head = nn.Linear(6, 3)
        self.cls = nn.Parameter(0.1 * torch.randn(1, 1, 6))
        self.flat = nn.Parameter(0.1 * torch.randn(1, 6))
        self.registers = nn.Parameter(0.1 * torch.randn(1, 3, 6))
        self.query = nn.Parameter(0.1 * torch.randn(1, 2, 6))

    def forward(self, x: Tensor) -> Tensor:
        b = len(x)
        h = torch.tanh(self.patch(x.view(b, 5, 2)))
        if self.form == "query":  # attention pooling with learned queries (Set Transformer's PMA)
            weights = torch.einsum("bqd,btd->bqt", self.query.expand(b, -1, -1), h).softmax(-1)
            return self.head(torch.einsum("bqt,btd->bqd", weights, h).mean(1))
        if self.form == "gated":  # learned per-token gates, repeated along the tokens and cut to their number
            return self.head((self.registers.expand(b, -1, -1).repeat(1, 2, 1)[:, :5] * h).mean(1))
        front = {
            "unsqueezed": lambda: self.flat.expand(b, -1).unsqueeze(1),
            "scaled": lambda: self.cls.expand(b, -1, -1) * 2.0,
            "new-dimension": lambda: self.cls.squeeze(0).expand(b, -1, -1),
            "cast": lambda: self.cls.repeat(b, 1, 1).to(x.dtype).contiguous(),
            "registers": lambda: torch.cat([self.cls.expand(b, -1, -1), self.registers.expand(b, -1, -1)], 1),
            "stacked": lambda: torch.stack([self.flat.expand(b, -1), 0.5 * self.flat.expand(b, -1)], 1),
            "by-position": lambda: self.cls.expand(b, -1, -1).cumsum(0),
            "position-weights": lambda: (
                self.cls.expand(b, -1, -1) * torch.linspace(0.5, 1.5, b).to(x)[:, None, None]
            ),
            "batch-mean": lambda: self.cls.expand(b, -1, -1) + h.mean((0, 1), keepdim=True),
        }[self.form]()
        tokens = torch.cat([front, h], dim=1)
        return self.head(torch.tanh(tokens).mean(1) + tokens[:, 0])


FORMS = ["unsqueezed", "scaled", "new-dimension", "cast", "registers", "stacked", "gated", "query"]


@pytest.mark.parametrize(
    ("form", "dtype"),
    [(f, torch.float64) for f in FORMS] + [(f, torch.float32) for f in ("unsqueezed", "scaled")],
)
def test_a_parameter_repeated_over_the_rows_trains_exactly(form, dtype, neighbour):
    seed_everything(0, verbose=False)
    assert_exact(Tokens(form).to(dtype), data(8, dtype), neighbour)


@pytest.mark.parametrize("form", ["unsqueezed", "new-dimension", "gated"])
def test_at_a_larger_batch_too(form, neighbour):
    seed_everything(0, verbose=False)
    assert_exact(Tokens(form).double(), data(64, torch.float64), neighbour)


def test_rows_of_a_repeated_parameter_that_differ_by_position_stay_refused():
    assert_refused(Tokens("by-position"), "traced to the batch's examples")
    assert_refused(Tokens("position-weights"), "Sensitivity check failed")


def test_a_repeated_parameter_plus_the_batch_mean_stays_refused():
    assert_refused(Tokens("batch-mean"), "traced to the batch's examples")
