"""The quick start's main job: `lightning-dp fit --config configs/digits_dpsgd.yaml`, end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DATA_ROOT, MNIST_FILES, requires_data

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_digits_config_trains_privately_to_90_percent(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "lightning_dp.commands.cli",
        "fit",
        "--config",
        str(ROOT / "configs" / "digits_dpsgd.yaml"),
        "--trainer.logger.init_args.save_dir",
        str(tmp_path),
        "--trainer.enable_progress_bar",
        "false",
    ]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    match = re.search(r"ε = ([0-9.]+) .*test accuracy = ([0-9.]+)", out.stdout)
    assert match, out.stdout[-2000:]
    epsilon, accuracy = float(match.group(1)), float(match.group(2))
    assert epsilon <= 3.0
    assert accuracy >= 0.90
    reports = list(tmp_path.rglob("privacy_report.json"))
    assert len(reports) == 1
    report = json.loads(reports[0].read_text())
    assert report["epsilon"] == pytest.approx(epsilon, abs=1e-4)
    assert report["test_accuracy"] == pytest.approx(accuracy, abs=1e-4)
    assert (reports[0].parent / "privacy_curve.png").exists()


@requires_data(*MNIST_FILES)
def test_mnist_config_runs_a_few_private_steps(tmp_path, monkeypatch):
    from lightning_dp.commands.cli import main

    monkeypatch.setenv("LIGHTNING_DP_CACHE", str(tmp_path / "cache"))
    main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "mnist_dpsgd.yaml"),
            "--data.root",
            str(DATA_ROOT),
            "--data.download",
            "false",
            "--trainer.accelerator",
            "cpu",
            "--trainer.max_steps",
            "2",
            "--trainer.limit_val_batches",
            "1",
            "--trainer.num_sanity_val_steps",
            "0",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.enable_checkpointing",
            "false",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--test_after_fit",
            "false",
        ]
    )
    report = json.loads(next(tmp_path.rglob("privacy_report.json")).read_text())
    assert report["steps"] == 2
    assert report["sample_rate"] == pytest.approx(512 / 55000)
    assert 0 < report["epsilon"] < 3.0


def test_registry_name_dp_works_from_the_cli(tmp_path):
    from lightning_dp.commands.cli import main

    main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "digits_dpsgd.yaml"),
            "--trainer.strategy",
            "dp",
            "--trainer.max_steps",
            "3",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--test_after_fit",
            "false",
        ]
    )
    report = json.loads(next(tmp_path.rglob("privacy_report.json")).read_text())
    assert report["steps"] == 3
    assert report["target_epsilon"] == 3.0
    assert report["epsilon"] <= 3.0
