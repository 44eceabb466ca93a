"""Kept for users' imports: re-exports :mod:`lightning_dp.commands.audit`, this module's new home (its
``__all__``, so a name exported there is exported here)."""

from lightning_dp.commands import audit as _home
from lightning_dp.commands.audit import *  # noqa: F403  (the names of its __all__)

__all__ = list(_home.__all__)
