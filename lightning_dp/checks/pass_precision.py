"""The precision the mixing check's dry passes compute in: IEEE fp32, whatever the run trains in.

The check compares two passes over different rows; what rounding can explain sets its tolerance. In bf16 or
fp16 (``precision="bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``, ``"16-true"``), or with TF32 or oneDNN's
bf16 for fp32 matmuls, one example's gradient is recomputed to 2⁻⁸ or so, and over thousands of kept examples
that allowance grows past C: a dependence that moves the released sum by a whole C hides in it (issue #47:
label smoothing towards the batch's class frequency at B = 4096 under bf16-mixed). So the passes run without
autocast, with the reduced-precision weights and buffers upcast to fp32 (their ``.data`` swapped for fp32
copies, the originals put back untouched) and every backend's fp32 at full precision
(:func:`~lightning_dp.per_example.precision.ieee_fp32`): the check then measures the program's dependence, not
the dtype's rounding. A program that cannot run so (a cast to ``torch.bfloat16`` by hand before a layer) is
checked in the run's own precision instead, with that precision's wider allowance, and a warning says so.
Since the passes then compute in another precision than the real step, ``precision_path.py`` verifies that the
step makes the same operations in both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import Tensor, nn

from lightning_dp.per_example.precision import ieee_fp32

REDUCED = (torch.bfloat16, torch.float16)


class FullPrecision:
    """Stands in for the run's precision plugin in a dry pass: ``training_step`` runs in plain fp32 (no
    autocast, no reduced default dtype)."""

    precision = "32-ieee"
    """Not a Lightning setting: the name the tolerances read (IEEE fp32, whatever the device)."""

    def train_step_context(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def runs_in_full_precision(plugin: Any) -> bool:
    """Whether the passes can run in fp32 for this plugin: Lightning's own mixed, half and fp32 plugins
    (a plugin that replaces layers or shards them, such as bitsandbytes or FSDP, keeps its own precision).
    A plain ``Precision`` labelled reduced is one whose parameters something else casts (``dp_fsdp`` under a
    ``MixedPrecisionPolicy``: FSDP2 gathers bf16 parameters whatever the passes upcast), so it keeps its own."""
    if type(plugin) is Precision and any(r in str(plugin.precision) for r in ("16", "bf16")):
        return False
    return type(plugin) in (Precision, MixedPrecision, HalfPrecision, DoublePrecision)


@contextlib.contextmanager
def full_precision(module: nn.Module, plugin: Any) -> Iterator[Any]:
    """For the block: IEEE fp32 matmuls and convolutions, and every bf16/fp16 parameter and buffer of
    ``module`` computed on as an fp32 copy; yields the plugin to run ``training_step`` under (the run's own
    ``DoublePrecision``, else :class:`FullPrecision`). Gradients of upcast parameters are held aside, and the
    original tensors (storage, values, ``.grad``) are put back afterwards, whatever the block wrote."""
    upcast: list[tuple[Tensor, Tensor, Tensor | None]] = []
    dtypes = [(m, m._dtype) for m in module.modules() if getattr(m, "_dtype", None) in REDUCED]
    for m, _ in dtypes:  # what LightningModule.dtype reads (a step may cast its inputs to self.dtype)
        m._dtype = torch.float32  # type: ignore[assignment]
    with torch.no_grad():
        tensors = [*module.parameters(), *module.buffers()]
        for t in dict.fromkeys(tensors):  # tied tensors once
            if t.dtype in REDUCED:
                upcast.append((t, t.data, t.grad if isinstance(t, nn.Parameter) else None))
                if isinstance(t, nn.Parameter):
                    t.grad = None
                t.data = t.data.float()
    try:
        with ieee_fp32():
            yield plugin if isinstance(plugin, DoublePrecision) else FullPrecision()
    finally:
        for m, dtype in dtypes:
            m._dtype = dtype
        with torch.no_grad():
            for t, data, grad in upcast:
                t.data = data
                if isinstance(t, nn.Parameter):
                    t.grad = grad


def upcast_batch(batch: Any) -> Any:
    """``batch`` with its bf16 and fp16 tensors as fp32 copies (what the run's precision gave the step;
    nothing else changes)."""
    return apply_to_collection(batch, Tensor, lambda t: t.float() if t.dtype in REDUCED else t)
