"""The private step, independent of Lightning: per-example gradients → clip → price → noise → step.

:class:`PrivateStepEngine` (``step.py``) owns the privacy-relevant arithmetic, so the single-device and
distributed strategies (and tests) share one implementation; ``state.py`` what it holds and saves (the slots,
the releases with the ledger, the step count, the noise generator); ``inputs.py`` holds what the strategy hands
in (``StepInputs``, the engine's base: one method an input) and ``batch.py`` the values it hands in about each
sampled batch and the chunk sums pending until the release; ``consistency.py`` the engine's
refusals of a model whose per-example gradients would not be each example's own.
"""

from lightning_dp.engine.batch import Chunk, PendingChunks, SampledBatch
from lightning_dp.engine.consistency import CONSISTENCY_FLOOR, CONSISTENCY_RTOL, refuse_sequence_first
from lightning_dp.engine.inputs import GradientSink, StepInputs
from lightning_dp.engine.state import EngineState
from lightning_dp.engine.step import PrivateStepEngine

__all__ = [
    "CONSISTENCY_FLOOR",
    "CONSISTENCY_RTOL",
    "Chunk",
    "EngineState",
    "GradientSink",
    "PendingChunks",
    "PrivateStepEngine",
    "SampledBatch",
    "StepInputs",
    "refuse_sequence_first",
]
