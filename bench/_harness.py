"""The set-up the bench scripts share: quiet Trainer arguments, the CPU's name and quantiles of timings.

One place, so every benchmark times the same Trainer (no logger, checkpoints, progress bar, summary or
validation: only training steps) and reports the machine the same way.
"""

from __future__ import annotations

import math
import platform
import tempfile
import time
from collections.abc import Sequence
from typing import Any


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    """``lightning.Trainer`` arguments for a timed CPU run with nothing but training; ``overrides`` win."""
    return {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        **overrides,
    }


def fit_and_test(model: Any, data: Any, strategy: Any, **trainer_args: Any) -> dict[str, Any]:
    """Fit ``model`` privately on ``data`` (a datamodule) and test it: test accuracy, the ledger's final ε, σ,
    the steps taken and the fit's wall time. The privacy report goes to a temporary folder, not the cwd."""
    from lightning.pytorch import Trainer

    with tempfile.TemporaryDirectory() as log_dir:
        trainer = Trainer(**trainer_kwargs(default_root_dir=log_dir, strategy=strategy, **trainer_args))
        start = time.perf_counter()
        trainer.fit(model, datamodule=data)
        wall = time.perf_counter() - start
        (metrics,) = trainer.test(model, datamodule=data, verbose=False)
    return {
        "accuracy": float(metrics["test_acc"]),
        "epsilon": strategy.epsilon,
        "sigma": strategy.engine.noise.noise_multiplier(0),
        "steps": strategy.engine.steps,
        "wall": wall,
    }


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows, else "?"."""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        name = None
    return name or platform.processor() or platform.machine() or "?"


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` with linear interpolation (numpy's default method)."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
