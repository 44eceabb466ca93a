"""The paths users import keep working after the root was grouped by floor (issue #52 item 3).

Each module kept at the root (``tests/test_layering.py``'s ``ALIASES``) re-exports its new home: the same
objects, not copies. The console script, ``python -m lightning_dp.cli``, ``lightning_dp.audit`` (the
function) and every ``class_path`` of the shipped configs and docs resolve.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from test_layering import ALIASES

import lightning_dp

ROOT = Path(__file__).resolve().parents[1]
HOMES = {
    "audit": "commands.audit",
    "callbacks": "run.callbacks",
    "checkpointing": "run.checkpointing",
    "cli": "commands.cli",
    "errors": "core.errors",
    "losses": "core.losses",
    "release": "slots.release",
    "tuning": "commands.tuning",
    "validation": "core.validation",
}


def test_every_alias_has_its_home() -> None:
    assert sorted(f"{name}.py" for name in HOMES) == sorted(ALIASES)


@pytest.mark.parametrize("alias", sorted(HOMES))
def test_an_alias_hands_on_the_objects_of_its_new_home(alias: str) -> None:
    kept = importlib.import_module(f"lightning_dp.{alias}")
    home = importlib.import_module(f"lightning_dp.{HOMES[alias]}")
    assert kept.__all__, alias
    for name in kept.__all__:
        assert getattr(kept, name) is getattr(home, name), f"lightning_dp.{alias}.{name}"


@pytest.mark.parametrize("alias", ["audit", "tuning"])
def test_an_alias_of_a_home_with_all_exports_the_whole_of_it(alias: str) -> None:
    """``lightning_dp.audit`` and ``lightning_dp.tuning`` take their names from their home's ``__all__``: a
    name added there is exported by the kept path too, with no second list to keep in step."""
    kept = importlib.import_module(f"lightning_dp.{alias}")
    home = importlib.import_module(f"lightning_dp.{HOMES[alias]}")
    assert list(kept.__all__) == list(home.__all__), alias


def test_the_users_paths_named_in_the_docs() -> None:
    from lightning_dp.callbacks import PrivacyCallback
    from lightning_dp.checkpointing import latest_valid_checkpoint
    from lightning_dp.errors import DPConfigurationError
    from lightning_dp.losses import per_example_token_loss
    from lightning_dp.release import ReleaseHook
    from lightning_dp.slots import Clipping, StepHost, sums_once
    from lightning_dp.validation import ArgumentError

    assert PrivacyCallback is lightning_dp.PrivacyCallback
    assert DPConfigurationError is lightning_dp.DPConfigurationError
    assert per_example_token_loss is lightning_dp.per_example_token_loss
    assert Clipping is lightning_dp.Clipping
    assert issubclass(ArgumentError, DPConfigurationError)
    assert callable(latest_valid_checkpoint)
    assert ReleaseHook.__module__ == "lightning_dp.slots.release"
    assert StepHost
    assert sums_once


def test_lightning_dp_audit_stays_the_function_after_the_module_is_imported() -> None:
    import lightning_dp.audit
    from lightning_dp.audit import audit

    assert lightning_dp.audit is audit
    assert callable(lightning_dp.audit)


def test_the_slots_face_exports_the_whole_contract() -> None:
    """A public name added to ``slots/contract.py`` is importable from ``lightning_dp.slots``."""
    import lightning_dp.slots
    import lightning_dp.slots.contract as contract

    defined = {
        name
        for name, value in vars(contract).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == contract.__name__
    }
    assert defined <= set(lightning_dp.slots.__all__), sorted(defined - set(lightning_dp.slots.__all__))


def test_the_console_script_and_python_m() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["lightning-dp"].partition(":")
    assert callable(getattr(importlib.import_module(module), function))
    done = subprocess.run(
        [sys.executable, "-c", "import runpy, sys; sys.argv = ['x', '--help']; runpy.run_module('lightning_dp.cli', run_name='__main__')"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "fit" in done.stdout


def test_every_class_path_of_the_configs_and_docs_resolves() -> None:
    texts = [
        p.read_text() for p in [*ROOT.glob("configs/*.yaml"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]
    ]
    paths = {m for text in texts for m in re.findall(r"class_path:\s*(lightning_dp\.[\w.]+)", text)}
    paths |= {m for text in texts for m in re.findall(r"--\S+ (lightning_dp\.[A-Z]\w+)", text)}
    assert paths
    for path in sorted(paths):
        module, _, name = path.rpartition(".")
        assert hasattr(importlib.import_module(module), name), path
