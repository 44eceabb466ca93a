"""Whether lightning-dp is running the user's code itself (a dry pass), for the user and for the undo log.

Kept apart from the dry pass (``user_step.py``): the state snapshot (``snapshot.py``) reads it too, and sits
below the dry pass that saves and restores it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_dry_passes = 0


def checking() -> bool:
    """True while lightning-dp runs your ``training_step`` (and, before it, your per-batch hooks) itself, for
    a check or a probe (a dry pass: nothing is logged, stepped or released). Test it to keep state the checks
    cannot put back (a global, a file) to real steps: ``if not lightning_dp.checking(): log_file.write(...)``."""
    return _dry_passes > 0


@contextlib.contextmanager
def _dry() -> Iterator[None]:
    global _dry_passes
    _dry_passes += 1
    try:
        yield
    finally:
        _dry_passes -= 1
