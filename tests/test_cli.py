"""The quick start's main job: `lightning-dp fit --config configs/digits_dpsgd.yaml`, end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_digits_config_trains_privately_to_90_percent(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable, "-m", "lightning_dp.cli", "fit",
        "--config", str(ROOT / "configs" / "digits_dpsgd.yaml"),
        "--trainer.logger.init_args.save_dir", str(tmp_path),
        "--trainer.enable_progress_bar", "false",
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
