"""What the capture observed of a step, and the run-time checks it hands that to.

The hooks observe (which parameters are covered, each layer call's rows); whether that meets the privacy
proof's obligations is decided by the run-time checks, :mod:`lightning_dp.checks.capture`. Those sit
floors above ``per_example`` (``tests/test_layering.py``), so they are passed in: a capture is given a
:class:`CaptureChecks`, by default the one the package installs at import (:func:`install_checks`). A
capture made with none installed refuses to start rather than run unchecked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import nn


@dataclass(frozen=True)
class Observed:
    """One step's observations at ``collect``, by name (no size or position of the private batch)."""

    rows: int
    """Rows of the per-example gradients the backward left (0: no backward ran)."""
    expected: int
    """Examples every layer call must have on dimension 0 (the sampler's draw, else ``rows``)."""
    calls: Sequence[tuple[nn.Module, int]]
    """(layer, dimension 0 of its output gradient) of every captured call."""
    layers: Sequence[tuple[str, nn.Module]]
    batch_statistics: list[str]
    """BatchNorm layers that normalised with the batch's statistics, or moved their running ones."""
    tracer_refusals: list[str]
    """Uses outside the layers that the tracer could not follow (``uses``), as their refusals."""
    partial_backwards: bool
    second_order: bool
    outside: list[str]
    """Parameters autograd reached outside the forward of every layer that holds them."""
    reordered: list[str]
    time_major: list[str]
    disagreeing: bool
    """Materialised per-example gradients of another number of rows than ``rows``."""
    unreached: list[str] | None
    """First batch only: parameters with an ordinary gradient but no per-example one (None: not checked)."""
    drop: Callable[[], None]
    """Drops what the backward captured; called before every refusal but the batch dimension's (whose
    calls the strategy reads to explain it) and the first batch's reach (a step's checks ran in full)."""


class CaptureChecks(Protocol):
    """The run-time obligations a capture's observations are held to (:mod:`lightning_dp.checks.capture`)."""

    def coverage(self, root: nn.Module, covered: Sequence[nn.Parameter]) -> None:
        """At set-up and whenever the trainable parameters change: every one has a per-example path."""
        ...

    def collected(self, seen: Observed) -> None:
        """Before the per-example gradients of a step are used: raises the first obligation ``seen`` breaks."""
        ...

    def missed_use_message(self, names: list[str]) -> str:
        """The refusal for parameters whose per-example gradients miss part of their gradient (it names them;
        the gap, a statistic of the batch's gradients, stays out of it)."""
        ...


_INSTALLED: list[CaptureChecks] = []


def install_checks(checks: CaptureChecks) -> None:
    """Make ``checks`` the default of every capture made from now on (the package does it at import)."""
    _INSTALLED[:] = [checks]


def installed_checks() -> CaptureChecks:
    """The installed checks; a capture never runs without them."""
    if not _INSTALLED:
        raise RuntimeError(
            "No run-time checks are installed for per-example gradients: import lightning_dp (it installs "
            "lightning_dp.checks.capture), or pass GradientCapture(checks=...)."
        )
    return _INSTALLED[0]
