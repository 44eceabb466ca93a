"""DPLightningCLI: LightningCLI whose ``fit`` also runs the test set and prints ε next to the accuracy.

Used by the ``lightning-dp`` command (``cli.py``) and by private tuning, which builds one per trial; it
imports nothing above the callback, so the tuning package and the command need not import each other.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_dp.run.callbacks import PrivacyCallback


class DPLightningCLI(LightningCLI):
    """LightningCLI whose ``fit`` also runs the test set and prints the privacy summary."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--test_after_fit", type=bool, default=True, help="Run trainer.test after fit.")

    def after_fit(self) -> None:
        config = self.config.get(self.subcommand, self.config)
        has_test = self.datamodule is not None and _overrides(self.datamodule, "test_dataloader")
        if config.get("test_after_fit", True) and has_test:
            self.trainer.test(self.model, datamodule=self.datamodule, verbose=False)
        self._print_summary()

    def _print_summary(self) -> None:
        callback = next((c for c in self.trainer.callbacks if isinstance(c, PrivacyCallback)), None)  # type: ignore[attr-defined]
        if callback is None or callback.report_path is None or not self.trainer.is_global_zero:
            return
        with open(callback.report_path) as f:
            report: dict[str, Any] = json.load(f)
        line = f"lightning-dp: ε = {report['epsilon']:.4f} (δ = {report['delta']:g}, {report['accountant']}, {report['steps']} steps)"
        if "test_accuracy" in report:
            line += f", test accuracy = {report['test_accuracy']:.4f}"
        print(line)
        print(f"lightning-dp: report {os.path.abspath(callback.report_path)}")


@contextlib.contextmanager
def command_line_args() -> Iterator[None]:
    """While the ``lightning-dp`` command builds its LightningCLI from the command line it was given.

    The command hands LightningCLI its own (parsed or stripped) ``sys.argv`` as ``args``, so LightningCLI's
    warning that both ``args`` and ``sys.argv`` were given says nothing true; only that warning is hidden.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="LightningCLI's args parameter is intended", category=UserWarning
        )
        yield


def _overrides(obj: Any, method: str) -> bool:
    from lightning.pytorch import LightningDataModule

    return getattr(type(obj), method, None) is not getattr(LightningDataModule, method, None)
