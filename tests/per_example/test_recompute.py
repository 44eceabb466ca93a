"""Layers recomputed per example, and containers whose [1, ...] parameters are expanded (``per_example/recompute.py``)."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyModule, make_trainer
from torch import Tensor, nn

from lightning_dp import DPStrategy
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.per_example import GradientCapture, vmap


class _Offset(nn.Module):
    """A container's own [1, 3] parameter, used in line with the batch or not (then recomputed per example)."""

    def __init__(self, aligned: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.offset = nn.Parameter(torch.randn(1, 3))
        self.aligned = aligned

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + (self.offset if self.aligned else self.offset.squeeze(0))


def _per_example_autograd(model: nn.Module, x: torch.Tensor) -> list[list[torch.Tensor]]:
    out = []
    for i in range(len(x)):
        model.zero_grad()
        model(x[i : i + 1]).pow(2).sum().backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


@pytest.mark.parametrize("aligned", [True, False], ids=["views", "recomputed"])
def test_an_expanded_container_gives_each_example_its_own_gradient(aligned: bool) -> None:
    torch.manual_seed(0)
    model, x = _Offset(aligned).double(), torch.randn(5, 3, dtype=torch.float64)
    expected = _per_example_autograd(model, x)
    capture = GradientCapture(model)
    model.zero_grad()
    model(x).pow(2).sum(1).mean().backward()
    grads, _ = capture.collect(5)
    samples = dict(zip(grads.params, grads.materialize(), strict=True))
    for i, reference in enumerate(expected):
        for p, g in zip(model.parameters(), reference, strict=True):
            torch.testing.assert_close(samples[p][i], g)
    capture.remove()


class _Counting(nn.Module):
    """A layer with no per-layer formula whose forward writes a buffer from the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.register_buffer("mean", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.mean.copy_(x.mean(0))
        return x * self.w


def test_a_recomputed_layer_that_writes_its_buffers_is_refused_and_leaves_no_trace() -> None:
    model = _Counting()
    capture = GradientCapture(nn.Sequential(model))
    x = torch.randn(4, 3)
    out = model(x)
    written = model.mean.clone()
    with pytest.raises(DPConfigurationError, match=r"writes its buffers \['mean'\] in its forward"):
        out.sum().backward()
    torch.testing.assert_close(model.mean, written)
    capture.remove()


class _OffsetModel(TinyModule):
    """A container's own [1, 3] parameter used out of line with the batch: recomputed per example."""

    def __init__(self, batch: int) -> None:
        super().__init__(n=4 * batch, d=3, classes=3, batch_size=batch)
        self.net = nn.Sequential(_Offset(aligned=False))


@pytest.mark.parametrize("batch", [8, 1024])
def test_a_recomputation_that_fails_both_ways_is_refused_quoting_no_size(
    batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(call: vmap.RecomputedCall) -> None:
        raise RuntimeError(f"shape [{call.grads[0].shape[0]}, 3] is invalid")

    monkeypatch.setattr(vmap, "per_example_grads", failing)
    monkeypatch.setattr(vmap, "looped_per_example_grads", failing)
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    with pytest.raises(
        DPConfigurationError, match="need its forward recomputed per example, which failed"
    ) as refusal:
        make_trainer(strategy, max_steps=1).fit(_OffsetModel(batch))
    assert "RuntimeError: shape […, …] is invalid" in str(refusal.value)
    assert strategy.engine.ledger.steps == 0


# -- a custom layer that writes a buffer in place in its forward --------------------------------------------


class RunningMean(nn.Module):
    """A custom layer (no per-example formula: recomputed per example) keeping a running mean of its input."""

    def __init__(self, d: int = 10) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.register_buffer("mean", torch.zeros(d))

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x * self.scale - self.mean


class WithRunningMean(TinyModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(RunningMean(), nn.Tanh(), nn.Linear(10, 3))


@pytest.mark.parametrize("check_sensitivity", [True, False], ids=["default", "checks-off"])
def test_a_layer_writing_its_buffer_in_place_under_no_grad_is_refused_by_name(check_sensitivity):
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_sensitivity=check_sensitivity)
    module = WithRunningMean()
    with pytest.raises(DPConfigurationError, match=r"writes its buffers \['mean'\] in its forward"):
        make_trainer(strategy, max_steps=2).fit(module)
    assert strategy.engine.steps == 0
