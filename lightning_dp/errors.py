"""Kept for users' imports: re-exports :mod:`lightning_dp.core.errors`, this module's new home."""

from lightning_dp.core.errors import (
    TROUBLESHOOTING,
    TROUBLESHOOTING_PAGE,
    BatchDimensionError,
    DPConfigurationError,
    quote_error,
    troubleshooting_entry,
    with_troubleshooting_link,
)

__all__ = [
    "TROUBLESHOOTING",
    "TROUBLESHOOTING_PAGE",
    "BatchDimensionError",
    "DPConfigurationError",
    "quote_error",
    "troubleshooting_entry",
    "with_troubleshooting_link",
]
