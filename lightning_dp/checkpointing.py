"""Crash-safe checkpoints: atomic local writes, and detection of truncated or corrupt files.

Lightning's local save goes through an fsspec transaction that writes a temporary file in the
*system* temp folder and ``shutil.move``s it into place: when that folder is on another file system
the move is a copy, and a SIGKILL during the copy leaves a half-written checkpoint under the final
name. Here the temporary file lives next to the target, is fsynced, and ``os.replace`` makes the
checkpoint appear all at once, so a crash leaves either the previous file or the new one.
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
import zipfile
from typing import Any

import torch

PARTIAL_SUFFIX = ".partial"


def is_local_path(path: Any) -> bool:
    """A plain file-system path (not ``s3://``, ``gs://``, …)."""
    text = os.fspath(path)
    return "://" not in text or text.startswith("file://")


def atomic_save(checkpoint: dict[str, Any], path: Any) -> None:
    """``torch.save`` into ``<path>.<random>.partial`` in the same folder, fsync, then rename over ``path``."""
    target = os.path.abspath(os.fspath(path).removeprefix("file://"))
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(target) + ".", suffix=PARTIAL_SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (not supported everywhere)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def checkpoint_problem(path: Any) -> str | None:
    """Why ``path`` is not a complete ``torch.save`` file (None when it is): missing, empty, truncated, bad CRC."""
    text = os.fspath(path)
    if not os.path.isfile(text):
        return "the file does not exist"
    if os.path.getsize(text) == 0:
        return "the file is empty"
    try:
        with zipfile.ZipFile(text) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        return f"the file is truncated or not a torch checkpoint ({err})"
    if bad is not None:
        return f"the entry {bad} fails its CRC check"
    return None


def latest_valid_checkpoint(directory: Any, pattern: str = "*.ckpt") -> str | None:
    """The newest complete checkpoint in ``directory`` (by modification time), skipping damaged ones."""
    paths = sorted(glob.glob(os.path.join(os.fspath(directory), pattern)), key=os.path.getmtime, reverse=True)
    return next((p for p in paths if checkpoint_problem(p) is None), None)
