"""Exceptions a user can catch: every message names the problem and the fix."""

from __future__ import annotations

from lightning.pytorch.utilities.exceptions import MisconfigurationException


class DPConfigurationError(MisconfigurationException):
    """A Trainer, model or strategy setting that would break the privacy guarantee."""
