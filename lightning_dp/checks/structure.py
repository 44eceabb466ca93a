"""Which layer calls are shared by the whole batch, decided by structure before the first batch.

A layer called on an input that no example owns (nanoGPT's ``wpe(torch.arange(T))``, a lookup of
positions) must have its per-example gradient taken from each example's slice of its output, not from
rows of its input: rows of ``arange(T)`` are positions, not examples. A size cannot tell the two apart when
T equals the batch. So, once per fit, the user's ``training_step`` runs forward only (no backward, nothing
captured, logging detached, random streams and buffers put back) on one training example repeated twice
and three times: a layer whose inputs keep their size is shared, one whose inputs grow is per example.
Repeating one example keeps every padded length the same, so only the batch size differs.

The probe is the first time user code sees a training record, so code that initialises weights from the
first batch it sees (ActNorm, LSUV, behind a Python flag) would write that record into the model here.
The parameters are compared by value after the probe: a write is put back and refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info

from lightning_dp.checks.snapshot import ModuleState
from lightning_dp.checks.state import ParameterValues
from lightning_dp.checks.user_step import dry_training_step
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.per_example import GradientCapture


def probe_batch_structure(
    capture: GradientCapture,
    module: LightningModule,
    dataset: Any,
    collate: Callable[[list[Any]], Any],
    device: torch.device,
    precision: Any,
) -> None:
    """Classify ``capture``'s layers as shared by the batch or per example (see the module docstring)."""
    if capture.probed or len(dataset) == 0:
        return
    capture.probed = True
    example = dataset[0]
    sizes = []
    state = ModuleState.save(module, device)
    values = ParameterValues.take(module)
    written: list[str] = []
    try:
        for copies in (2, 3):
            batch = move_data_to_device(precision.convert_input(collate([example] * copies)), device)
            with capture.recording_input_sizes() as seen, torch.no_grad():
                dry_training_step(module, batch, 0, precision, forward_only=True)
            sizes.append(seen)
            written += values.written()  # after each pass: a second write could put the first one back
            values.restore()
            state.restore()
    except Exception as error:  # the real step reports the same error in its own words
        rank_zero_info(
            f"lightning-dp: the batch-structure probe could not run ({error!r}); layer calls whose "
            "input is one-dimensional are taken as shared when its length differs from the batch."
        )
        return
    finally:
        state.restore()
        written = sorted(set(written + values.written()))
        values.restore()
        if written:
            raise DPConfigurationError(initialisation_message(written))
    capture.classify(sizes[0], sizes[1])


def initialisation_message(names: list[str]) -> str:
    """The refusal for user code that wrote parameters from a batch outside the optimizer's step."""
    return (
        f"The parameters {names} were written in place during the first forward of training_step that saw "
        "training records (lightning-dp's forward-only probe of the batch structure, on copies of one "
        "training example), not by the optimizer: a data-dependent initialisation (ActNorm, LSUV, weight "
        "normalisation set from the first batch's statistics), an assignment through .data, copy_ under "
        "no_grad or set_ writes private records into the weights without noise, and ε does not cover it. "
        "The weights were put back. Initialise from public data before trainer.fit (run the layer's "
        "initialisation on a public batch, then fit), or initialise from constants."
    )
