"""The slot floor, above ``per_example/`` and ``accounting/``: what a mechanism implements and what it sees.

``contract.py`` declares the four slots (sampler, clipping, noise, step) with every hook; beside it
``context.py`` (``StepContext``, what one step knows), ``release.py`` (``Releases``, the one door to the
budget) and ``compatibility.py`` (which slot combinations the ledger can price). The slot folders
(``sampling/``, ``clipping/``, ``noise/``, ``steps/``) sit on the floor above.
"""

from lightning_dp.slots.contract import (
    NOISE_SLICE,
    ClipAndSum,
    Clipping,
    Noise,
    Sampler,
    SamplerRuntime,
    Slot,
    Step,
    StepContext,
    StepHost,
    StepPlan,
    StepSetup,
    iter_slots,
    sums_once,
    takes_config,
)

__all__ = [
    "NOISE_SLICE",
    "ClipAndSum",
    "Clipping",
    "Noise",
    "Sampler",
    "SamplerRuntime",
    "Slot",
    "Step",
    "StepContext",
    "StepHost",
    "StepPlan",
    "StepSetup",
    "iter_slots",
    "sums_once",
    "takes_config",
]
