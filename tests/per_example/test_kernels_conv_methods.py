"""The convolution methods a private fit uses (issue #51): chosen by the cost model on the first batch,
announced once per convolution shape, the same in two identical runs, and in ``privacy_report.json``."""

from __future__ import annotations

import json
import logging

import torch
from conftest import TinyModule, make_trainer
from torch import nn

from lightning_dp import DPStrategy


class SmallCNN(TinyModule):
    """A 3×3 stem, a depthwise 5×5 on 2×2 maps (dead offsets) and a head, on 8×8 images."""

    def __init__(self) -> None:
        super().__init__(n=64, batch_size=16)
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 8, 5, padding=2, groups=8), nn.Flatten(), nn.Linear(32, 3),
        )  # fmt: skip
        self.x = torch.randn(64, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def _fit(tmp_path, caplog) -> tuple[list[str], list[dict]]:
    caplog.clear()
    logging.getLogger("lightning.pytorch").setLevel(logging.INFO)
    try:
        make_trainer(DPStrategy(noise_multiplier=1.0, seed=0), tmp_path, max_epochs=1).fit(SmallCNN())
    finally:
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    lines = [r.getMessage() for r in caplog.records if "lightning-dp: convolution" in r.getMessage()]
    return lines, json.loads((tmp_path / "privacy_report.json").read_text())["conv_methods"]


def test_conv_methods_are_announced_once_reported_and_the_same_in_two_runs(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    first_lines, first = _fit(tmp_path / "a", caplog)
    second_lines, second = _fit(tmp_path / "b", caplog)
    assert len(first_lines) == len(first) == 2, "one line per convolution shape, over four steps"
    assert first_lines == second_lines
    assert first == second
    depthwise, stem = sorted(first, key=lambda entry: entry["input"] != [8, 2, 2])  # chosen in backward order
    assert stem["layer"] == "Conv2d(3→8, 3×3, stride (2, 2), padding (1, 1))"
    assert stem["input"] == [3, 8, 8]
    assert depthwise["live_offsets"] == [[1, 4], [1, 4]], "a 5×5 kernel on 2×2 maps reaches 3×3 of it"
    assert all(f"norms {entry['norms']}" in line for entry, line in zip(first, first_lines, strict=True))
