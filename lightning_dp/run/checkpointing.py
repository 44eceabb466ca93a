"""Crash-safe checkpoints: atomic local writes, and detection of truncated or corrupt files.

Lightning's local save goes through an fsspec transaction that writes a temporary file in the
*system* temp folder and ``shutil.move``s it into place: when that folder is on another file system
the move is a copy, and a SIGKILL during the copy leaves a half-written checkpoint under the final
name. Here the temporary file lives next to the target, is fsynced, and ``os.replace`` makes the
checkpoint appear all at once, so a crash leaves either the previous file or the new one.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from typing import IO, Any

import torch

from lightning_dp.core.errors import DPConfigurationError

PARTIAL_SUFFIX = ".partial"
#: Keys every ``checkpoint["lightning_dp"]`` entry must hold, and the slots inside ``"slots"``.
REQUIRED_KEYS = ("steps", "ledger", "slots")
SLOT_NAMES = ("sampler", "clipping", "noise", "step")
LEDGER_KEYS = ("version", "accountant", "delta", "history")
#: Slot-state counters of steps the slot has taken: never more than the engine's private steps.
SLOT_STEP_COUNTERS = ("steps_taken", "iteration")


def is_local_path(path: Any) -> bool:
    """A plain file-system path (not ``s3://``, ``gs://``, …)."""
    text = os.fspath(path)
    return "://" not in text or text.startswith("file://")


def atomic_write(path: Any, write: Callable[[IO[bytes]], object], what: str) -> str:
    """Write ``path`` through ``write`` into ``<path>.<random>.partial`` beside it, fsync, rename over ``path``.

    A crash or a failed write leaves the previous file intact and no partial file behind; a failed
    write raises an ``OSError`` that names the file, says whether the disk is full, and that the file
    in place is not from this run. Returns the absolute path written.
    """
    target = os.path.abspath(os.fspath(path).removeprefix("file://"))
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(
            prefix=os.path.basename(target) + ".", suffix=PARTIAL_SUFFIX, dir=directory
        )
    except OSError as err:
        raise OSError(err.errno, write_failure(target, what, err)) from err
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except Exception as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OSError(getattr(err, "errno", None) or errno.EIO, write_failure(target, what, err)) from err
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
    return target


def atomic_save(checkpoint: dict[str, Any], path: Any) -> None:
    """``torch.save`` ``checkpoint`` to ``path`` atomically (see :func:`atomic_write`)."""
    atomic_write(path, lambda f: torch.save(checkpoint, f), "checkpoint")


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


def free_bytes(directory: str) -> int | None:
    """Free space on the file system holding ``directory`` (None when it cannot be read)."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def write_failure(target: str, what: str, err: BaseException) -> str:
    """Say which write failed, whether the disk looks full, and what was left in place.

    ``torch.save`` reports a full disk as ``enforce fail at inline_container.cc … unexpected pos`` or
    ``file write failed``, and ``open``/``write`` as ``ENOSPC``; all of them mean the same here.
    """
    text = str(err)
    full = getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or any(
        mark in text for mark in ("unexpected pos", "file write failed", "No space left")
    )
    free = free_bytes(os.path.dirname(target))
    space = f" ({free / 2**20:.1f} MiB free there)" if free is not None else ""
    cause = f"the disk is full{space}" if full else f"{type(err).__name__}: {text}"
    return (
        f"Writing the {what} {target} failed: {cause}. Nothing was written under that name: the previous "
        f"{what} there, if any, is intact and is NOT from this run. Free space (or choose another folder) "
        "and write it again."
    )


def unreadable_checkpoint(path: Any) -> str | None:
    """Why ``path`` cannot be resumed from, in a sentence with the fix (None when it is a complete file)."""
    text = os.fspath(path)
    if os.path.isdir(text):
        return (
            f"ckpt_path={text} is a folder, not a checkpoint file. Pass one file: "
            "lightning_dp.checkpointing.latest_valid_checkpoint(folder) returns the newest complete one."
        )
    if not os.path.exists(text):
        return f"The checkpoint {text} does not exist. Check the path, or resume from latest_valid_checkpoint(folder)."
    problem = checkpoint_problem(text)
    if problem is None:
        return None
    return (
        f"The checkpoint {text} is damaged: {problem}. It was probably being written when the process died. "
        "Resume from the previous one: lightning_dp.checkpointing.latest_valid_checkpoint(folder) returns the "
        "newest complete checkpoint."
    )


def check_privacy_state(state: Any, path: Any) -> None:
    """Refuse a ``lightning_dp`` entry that lacks the ledger, the step count or a slot, naming what is missing."""
    missing = [key for key in REQUIRED_KEYS if not isinstance(state, dict) or key not in state]
    if not missing:
        slots, ledger = state["slots"], state["ledger"]
        missing = [f"slots.{name}" for name in SLOT_NAMES if not isinstance(slots, dict) or name not in slots]
        missing += [
            f"ledger.{key}" for key in LEDGER_KEYS if not isinstance(ledger, dict) or key not in ledger
        ]
    if missing:
        raise DPConfigurationError(
            f"The checkpoint {path} has an incomplete privacy state: {', '.join(missing)} missing. It was "
            "edited, or written by something other than DPStrategy, so ε cannot be continued from it. Resume "
            "from a checkpoint DPStrategy wrote (latest_valid_checkpoint(folder)), or start a new run."
        )


def _fit_loop(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    loops = checkpoint.get("loops")
    fit_loop = loops.get("fit_loop") if isinstance(loops, dict) else None
    return fit_loop if isinstance(fit_loop, dict) else None


def _counter(state: Any, path: tuple[str, ...]) -> int | None:
    for key in path:
        state = state.get(key) if isinstance(state, dict) else None
    return state if isinstance(state, int) else None


def loop_global_step(checkpoint: dict[str, Any]) -> int | None:
    """The optimizer steps Lightning's fit loop will resume from (its progress counters, which set
    ``trainer.global_step`` on resume; the top-level ``global_step`` is only a copy). None when absent."""
    fit_loop = _fit_loop(checkpoint)
    if fit_loop is None:
        return None
    paths = (
        ("epoch_loop.automatic_optimization.optim_progress", "optimizer", "step", "total", "completed"),
        ("epoch_loop.manual_optimization.optim_step_progress", "total", "completed"),
    )
    counts = [n for n in (_counter(fit_loop, path) for path in paths) if n is not None]
    return sum(counts) if counts else None


def step_in_flight(checkpoint: dict[str, Any]) -> bool:
    """Whether the checkpoint was written in the middle of a training step (an interrupt or an exception,
    e.g. by ``OnExceptionCheckpoint``): Lightning's loop had started a batch it had not finished processing
    (its optimizer steps included). Resumed, the loop runs that batch again."""
    fit_loop = _fit_loop(checkpoint)
    total = ("epoch_loop.batch_progress", "total")
    started = _counter(fit_loop, (*total, "started"))
    processed = _counter(fit_loop, (*total, "processed"))
    return started is not None and processed is not None and started > processed


def check_resumed_counts(
    engine: Any, state: dict[str, Any], checkpoint: dict[str, Any], path: Any, counts: Any, in_flight: bool
) -> None:
    """The restored ledger must agree with the loop's step count, the engine's and the slots' own.

    Every private step records at least one event (steps that also release a search or a statistic
    record more; correlated noise with cyclic sampling, one per round of b steps), so
    ``ledger events ≥ ⌈private steps / b⌉``; the ledger's size at save time is stored beside
    it, and no slot can have taken more steps than the engine. Lightning's loop counts
    ``private steps − outside + silent`` optimizer steps (``counts.silent_steps``: steps that released
    nothing; ``counts.steps_outside_loop``: releases no optimizer step of the loop counted), in its progress
    counters and in the top-level ``global_step``. A lowered count or an emptied history would resume at a
    smaller ε than was spent.

    A checkpoint written inside a step (``in_flight``) may hold what that step did before it stopped, all of
    it counted in ε: the ledger's event (its saved size then one short), the private step (one more than the
    loop counted) and the slots' counters (one ahead of the engine). Each step that stopped so, and ran again
    on resume (``counts.interrupted_steps``), lets the slots' counters stay one step further ahead.
    """
    steps, events = engine.steps, engine.ledger.steps
    silent, outside = counts.silent_steps, counts.steps_outside_loop
    paid = -(-steps // engine.noise.steps_per_event)  # BandMF: one event per round of b steps
    problems = []
    saved_events = state.get("ledger_events")
    if saved_events is not None and (
        events < int(saved_events) or (events > int(saved_events) and not in_flight)
    ):
        problems.append(f"its ledger holds {events} events but was saved holding {int(saved_events)}")
    if events < paid:
        problems.append(
            f"its ledger holds {events} events for {steps} private steps (at least one each"
            + (f" round of {engine.noise.steps_per_event} steps)" if paid != steps else ")")
        )
    if silent < 0 or outside < 0 or outside > steps:
        problems.append(f"its step counts are impossible ({silent} silent, {outside} outside the loop)")
    global_step, loop_steps = checkpoint.get("global_step"), loop_global_step(checkpoint)
    if isinstance(global_step, int) and loop_steps is not None and global_step != loop_steps:
        problems.append(f"its global_step {global_step} is not the fit loop's {loop_steps} optimizer steps")
    looped = steps - outside + silent
    for counted in dict.fromkeys(n for n in (global_step, loop_steps) if isinstance(n, int)):
        if not counted <= looped <= counted + int(in_flight):  # in flight: one the loop had not counted yet
            extra = f" (+ {silent} that released nothing)" if silent else ""
            extra += f" (− {outside} outside the loop)" if outside else ""
            problems.append(f"it records {steps} private steps{extra} at global_step {counted}")
    ahead = counts.interrupted_steps + int(in_flight)
    for name, slot in state["slots"].items():
        slot_state = slot.get("state") if isinstance(slot, dict) else None
        for key in SLOT_STEP_COUNTERS:
            value = slot_state.get(key) if isinstance(slot_state, dict) else None
            if isinstance(value, int) and value > steps + ahead:
                problems.append(f"its {name} ({slot.get('name')}) has taken {value} steps, more than {steps}")
    if problems:
        raise DPConfigurationError(does_not_add_up(path, problems))


def does_not_add_up(path: Any, problems: list[str]) -> str:
    """The refusal of a checkpoint whose privacy state disagrees with itself, listing each disagreement."""
    return (
        f"The checkpoint {path} does not add up: {'; '.join(problems)}. It was edited or written by "
        "something else, and resuming from it would report less ε than was spent. Resume from a checkpoint "
        "DPStrategy wrote, unchanged (latest_valid_checkpoint(folder)), or start a new run."
    )
