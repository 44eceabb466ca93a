"""The paper's experiment from YAML: step/noise/sampler/clipping slots by class_path, paper mode priced exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_dp.commands.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_paper_mode_config_trains_and_spends_exactly_epsilon(tmp_path):
    main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "accelerated_logreg_paper.yaml"),
            "--data.n",
            "2000",
            "--trainer.max_steps",
            "5",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path),
        ]
    )
    report = json.loads(next(Path(tmp_path).rglob("privacy_report.json")).read_text())
    assert report["accountant"] == "pure"
    assert report["steps"] == 5
    assert report["epsilon"] == pytest.approx(1.0, abs=1e-9)
    assert report["epsilon"] <= 1.0


def test_gaussian_config_resolves_the_slots(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "configs" / "accelerated_logreg.yaml"), "--print_config"])
    printed = capsys.readouterr().out
    assert "lightning_dp.Nesterov" in printed
    assert "lightning_dp.NoiseDividing" in printed
