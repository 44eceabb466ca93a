"""Import Opacus without the root logging handler its import installs.

``opacus/utils/module_utils.py`` calls ``logging.basicConfig(...)`` at import time. That gives the root
logger a stderr handler, so every record that Lightning's own ``lightning`` handler prints also propagates
to the root one and is printed twice. Imported first by ``lightning_dp/__init__.py``: when the root logger
had no handler before, the one Opacus added is removed again; a handler the user configured is never touched,
and ``logging.basicConfig`` in user code still works afterwards (the root logger is left without handlers).
"""

from __future__ import annotations

import logging
import sys


def import_opacus_quietly() -> None:
    """Run Opacus's import-time ``logging.basicConfig`` and take back the root handler it adds (if it adds one)."""
    if "opacus.utils.module_utils" in sys.modules:
        return  # imported before lightning_dp: whatever the root logger has now is the user's setup
    root = logging.getLogger()
    before = list(root.handlers)
    import opacus.utils.module_utils  # noqa: F401  (the import runs logging.basicConfig)

    for handler in list(root.handlers):
        if handler not in before:
            root.removeHandler(handler)


import_opacus_quietly()
