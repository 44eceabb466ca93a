"""Exceptions a user can catch: every message names the problem and the fix."""

from __future__ import annotations

import re

from lightning.pytorch.utilities.exceptions import MisconfigurationException


class DPConfigurationError(MisconfigurationException):
    """A Trainer, model or strategy setting that would break the privacy guarantee."""


class BatchDimensionError(DPConfigurationError):
    """A layer's dimension 0 is not the batch the sampler drew: its "per-example" gradients are not."""


def quote_error(error: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters), for a refusal that quotes the user's
    own exception on a batch the checks made; its numbers become ``…``: a shape or an index there can be the
    private batch's size, which no message of lightning-dp holds."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = re.sub(r"\d+", "…", text)
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
