"""The capture's obligations, judged in order on what its hooks observed (``checks/capture.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from lightning_dp.checks.capture import CaptureObligations
from lightning_dp.core.errors import BatchDimensionError, DPConfigurationError
from lightning_dp.per_example.observations import Observed

LAYER = nn.Linear(2, 2)

# Each broken obligation, in the order they are judged, with what its refusal says.
BROKEN: list[tuple[str, Any, str]] = [
    ("batch_statistics", ["bn"], r"The BatchNorm layers \['bn'\]"),
    ("tracer_refusals", ["untraced use"], "untraced use"),
    ("partial_backwards", True, "Several backward passes over parts of one sampled batch"),
    ("second_order", True, "differentiates a gradient of the model again"),
    ("outside", ["w"], r"parameters \['w'\] do not add up"),
    ("reordered", ["fc"], r"The layers \['fc'\] are called on the batch's rows reordered"),
    ("calls", [(LAYER, 3)], r"Layer 'fc' \(Linear\) has fewer rows"),
    ("time_major", ["fc"], r"The layers \['fc'\] are called on a time-major tensor"),
    ("disagreeing", True, "Per-example gradients disagree on the batch size"),
    ("unreached", ["w"], r"The parameters \['w'\] received a gradient but no per-example gradient"),
]
KEEPS = {"calls", "unreached"}
"""The refusals that leave the step's capture as it is (the strategy reads the calls to explain them)."""


def _seen(dropped: list[int], **broken: Any) -> Observed:
    clean: dict[str, Any] = {
        "rows": 8, "expected": 8, "calls": [(LAYER, 8)], "layers": [("fc", LAYER)], "batch_statistics": [],
        "tracer_refusals": [], "partial_backwards": False, "second_order": False, "outside": [],
        "reordered": [], "time_major": [], "disagreeing": False, "unreached": None,
    }  # fmt: skip
    return Observed(**{**clean, **broken}, drop=lambda: dropped.append(1))


def test_a_clean_step_passes_and_drops_nothing() -> None:
    dropped: list[int] = []
    CaptureObligations().collected(_seen(dropped, unreached=[]))
    assert not dropped


@pytest.mark.parametrize("first", range(len(BROKEN)), ids=[name for name, _, _ in BROKEN])
def test_the_first_obligation_broken_is_refused_and_drops_the_step_but_where_its_calls_explain_it(
    first: int,
) -> None:
    dropped: list[int] = []
    broken = {name: value for name, value, _ in BROKEN[first:]}
    name, _, message = BROKEN[first]
    kind = (
        BatchDimensionError if name in ("partial_backwards", "calls", "time_major", "disagreeing") else None
    )
    with pytest.raises(kind or DPConfigurationError, match=message) as refusal:
        CaptureObligations().collected(_seen(dropped, **broken))
    assert bool(dropped) == (name not in KEEPS)
    if name == "calls":
        assert not {"3", "8"} & set(str(refusal.value)), "no size of the batch"


def test_a_second_order_loss_on_one_example_is_exact_and_judged_no_further() -> None:
    dropped: list[int] = []
    CaptureObligations().collected(_seen(dropped, rows=1, expected=1, second_order=True, outside=["w"]))
    assert not dropped
