"""What the audit tests share (``tests/commands/test_audit.py``, ``tests/commands/test_audit_users.py``): the
noise bug every audit must catch, and the quiet Trainer an audited run trains under."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any
from unittest import mock

from conftest import make_trainer
from lightning.pytorch import Trainer

from lightning_dp import ConstantNoise, Noise


class SilentNoise(ConstantNoise):
    """The worst silent failure: σ is calibrated and priced, but no noise is ever added."""

    def add_noise(self, sums, std, generator):
        return sums


def dropped_noise(broken: bool) -> AbstractContextManager[Any]:
    """While inside (``broken``): no noise slot adds noise, whichever one the mechanism installs (some steps
    replace the noise slot with their own); σ is still calibrated and priced."""
    return mock.patch.object(Noise, "add_noise", SilentNoise.add_noise) if broken else nullcontext()


def audit_trainer(strategy: Any, steps: int, tmp_path: Any, **kwargs: Any) -> Trainer:
    """A Trainer for ``steps`` private steps with nothing else (no logger, checkpoints, validation)."""
    return make_trainer(strategy, tmp_path, max_steps=steps, max_epochs=-1, limit_val_batches=0, **kwargs)
