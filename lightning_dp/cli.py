"""Kept for users' imports: re-exports :mod:`lightning_dp.commands.cli`, this module's new home."""

from lightning_dp.commands.cli import audit_main, canaries_line, main, tune_main

__all__ = ["audit_main", "canaries_line", "main", "tune_main"]

if __name__ == "__main__":  # python -m lightning_dp.cli
    main()
