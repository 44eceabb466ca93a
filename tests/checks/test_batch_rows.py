"""Every layer call's rows are the batch's examples (``checks/batch_rows.py``): refusals name no size."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyModule, make_trainer
from torch import Tensor

from lightning_dp import DPConfigurationError, DPStrategy


class _RowsThroughAReshape(TinyModule):
    """Each row through a reshape (``h[i].view(1, -1)``): which example a call holds is not traced."""

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.net[0](x))
        return torch.cat([self.net[2](h[i].view(1, -1)) for i in range(len(h))])


def _refusal(batch: int) -> tuple[str, int | None]:
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    with pytest.raises(DPConfigurationError) as refusal:
        make_trainer(strategy, max_steps=1).fit(_RowsThroughAReshape(n=4 * batch, batch_size=batch))
    assert strategy.engine.ledger.steps == 0, "refused before the release"
    return str(refusal.value), strategy.engine.realised_batch


def test_a_layer_called_on_parts_of_the_batch_is_refused_naming_no_size_of_the_batch() -> None:
    small, realised_small = _refusal(8)
    large, realised_large = _refusal(1024)
    assert "was called on parts of the batch" in small
    assert realised_small != realised_large
    assert small == large, "the refusal is the same whatever the batch"
    assert f" {realised_large} " not in large
