"""The capture observes; the run-time checks it is handed judge (``per_example/observations.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_dp.checks.capture import CaptureObligations
from lightning_dp.per_example import GradientCapture, observations


class Recording(CaptureObligations):
    """The package's checks, recording what they are handed."""

    def __init__(self) -> None:
        self.covered: list[list[nn.Parameter]] = []
        self.seen: list[observations.Observed] = []

    def coverage(self, root: nn.Module, covered: Any) -> None:
        self.covered.append(list(covered))
        super().coverage(root, covered)

    def collected(self, seen: observations.Observed) -> None:
        self.seen.append(seen)
        super().collected(seen)


def test_the_package_installs_the_run_time_checks() -> None:
    assert isinstance(observations.installed_checks(), CaptureObligations)
    assert isinstance(GradientCapture(nn.Linear(2, 2)).checks, CaptureObligations)


@pytest.mark.parametrize("batch", [8, 1024])
def test_a_capture_hands_its_observations_to_the_checks_it_is_given(batch: int) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    checks = Recording()
    capture = GradientCapture(model, checks=checks)
    assert checks.covered == [list(model.parameters())], "checked at set-up"
    model(torch.randn(batch, 3)).sum().backward()
    grads, rows = capture.collect(batch)
    (seen,) = checks.seen
    assert (seen.rows, seen.expected, rows, grads.batch) == (batch, batch, batch, batch)
    assert [size for _, size in seen.calls] == [batch, batch]
    assert [seen.outside, seen.reordered, seen.time_major, seen.batch_statistics] == [[], [], [], []]
    assert seen.unreached == [], "the first batch checks the reach"
    model(torch.randn(batch, 3)).sum().backward()
    capture.collect(batch)
    assert checks.seen[1].unreached is None, "once"
    capture.remove()


def test_a_refusal_comes_from_the_checks_the_capture_holds() -> None:
    class Refusing(CaptureObligations):
        def collected(self, seen: observations.Observed) -> None:
            raise ValueError("refused by the checks")

    model = nn.Linear(3, 2)
    capture = GradientCapture(model, checks=Refusing())
    model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(ValueError, match="refused by the checks"):
        capture.collect(4)


def test_no_capture_starts_without_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(observations, "_INSTALLED", [])
    with pytest.raises(RuntimeError, match="No run-time checks are installed for per-example gradients"):
        GradientCapture(nn.Linear(2, 2))
