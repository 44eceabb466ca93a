"""The privacy state in a Lightning checkpoint: saved beside the weights, checked and restored on resume.

Rank 0's ledger and every rank's own sampling and noise streams are stored under ``CHECKPOINT_KEY``; a
resume must continue the same run (same processes, data set and batch size) or it is refused, because a
ledger restarted or continued on other data would report less ε than was spent. The file-level parts
(atomic writes, damaged-file diagnosis) are in ``lightning_dp/checkpointing.py``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from lightning_dp.checkpointing import check_privacy_state, check_resumed_counts
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.errors import DPConfigurationError
from lightning_dp.slots import Sampler

CHECKPOINT_KEY = "lightning_dp"


def gather_dp_state(engine: PrivateStepEngine, world_size: int) -> dict[str, Any]:
    """Rank 0's privacy state plus every rank's own (its sampling and noise streams differ)."""
    state = engine.state_dict()
    states: list[Any] = [state]
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        states = [None] * world_size
        dist.all_gather_object(states, state)
    return dict(states[0], ranks=states, world_size=world_size)


def _rank_dp_state(state: dict[str, Any], world_size: int, rank: int) -> dict[str, Any]:
    saved_world = state.get("world_size", 1)
    if saved_world != world_size:
        raise DPConfigurationError(
            f"The checkpoint was written by {saved_world} processes, this run has {world_size}. Each "
            "rank's sampling and noise streams are in the checkpoint and cannot be re-split; resume with "
            f"the same number of devices × nodes ({saved_world})."
        )
    ranks = state.get("ranks")
    return ranks[rank] if ranks else state


def restore_dp_state(
    engine: PrivateStepEngine, checkpoint: dict[str, Any], path: Any, world_size: int, rank: int
) -> None:
    """Load this rank's privacy state into ``engine``, refusing a checkpoint that would under-report ε."""
    state = checkpoint.get(CHECKPOINT_KEY)
    if state is None:
        raise DPConfigurationError(
            f"The checkpoint {path} has no privacy state (ledger, sampler and noise streams), "
            "so resuming would restart ε at zero. Resume only from checkpoints written by DPStrategy; "
            "to start DP training from non-private weights, load them into the module and call fit "
            "without ckpt_path."
        )
    rank_state = _rank_dp_state(state, world_size, rank)
    check_privacy_state(rank_state, path)
    try:
        engine.load_state_dict(rank_state)
    except ValueError as err:
        raise DPConfigurationError(str(err)) from err
    check_resumed_counts(engine, rank_state, checkpoint.get("global_step"), path)


def check_resumed_data(sampler: Sampler) -> None:
    """A resumed run must sample from the same N with the same q as the run it continues."""
    saved_n, saved_q = sampler.restored_shape
    if saved_n is None or saved_q is None or (saved_n, saved_q) == (sampler.num_samples, sampler.sample_rate):
        return
    raise DPConfigurationError(
        f"The checkpoint was trained on N={saved_n} with sample rate {saved_q:.6g}; this run has "
        f"N={sampler.num_samples}, rate {sampler.sample_rate:.6g}. The ledger cannot continue across a "
        f"different data set or batch size: {_shape_change(saved_n, saved_q, sampler)} Resume with the "
        "same training set and batch_size, or start a new run without ckpt_path (its ε then adds to "
        "the first run's)."
    )


def _shape_change(saved_n: int, saved_q: float, sampler: Sampler) -> str:
    """One sentence on what changed between the checkpoint's data and this run's, and what it does to q."""
    n, q = sampler.num_samples, sampler.sample_rate
    if n == saved_n:
        return f"the data set has the same N, but batch_size changed q from {saved_q:.6g} to {q:.6g}."
    change = "shrank" if n < saved_n else "grew"
    return (
        f"the training set {change} from {saved_n} to {n} examples (by {abs(n - saved_n)}), which changed q "
        f"from {saved_q:.6g} to {q:.6g}."
    )
