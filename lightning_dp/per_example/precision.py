"""fp32 arithmetic at full fp32 precision for the per-example norms and clipped sums.

The certified norms' rounding bounds (``kernels/certified.py``) assume fp32 products: u = 2⁻²⁴. A matmul
or convolution run in reduced precision (TF32 on CUDA, cuDNN's default for fp32 convolutions;
``set_float32_matmul_precision("high"/"medium")``, which oneDNN turns into bf16 on CPUs with AMX) keeps
10 or 8 mantissa bits: a crafted example then adds more than C to the released sum (measured: 1.0000274·C
on the CPU at "medium"). So the norms and sums run with every backend's fp32 precision set to IEEE for the
block, and the user's settings are put back after; the forward and backward keep them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def _backends() -> list[Any]:
    """The backend settings that choose an fp32 precision (PyTorch ≥ 2.9's ``fp32_precision``)."""
    b = torch.backends
    found = []
    for parent, names in (
        (b.cuda, ("matmul",)),
        (b.cudnn, ("conv", "rnn")),
        (b.mkldnn, ("matmul", "conv", "rnn")),
    ):
        for name in names:
            setting = getattr(parent, name, None)
            if setting is not None and hasattr(setting, "fp32_precision"):
                found.append(setting)
    return found


@contextlib.contextmanager
def ieee_fp32() -> Iterator[None]:
    """Full-precision fp32 matmuls and convolutions for the block (see the module docstring)."""
    settings = _backends()
    if settings:
        saved = [s.fp32_precision for s in settings]
        try:
            for s in settings:
                if s.fp32_precision != "ieee":
                    s.fp32_precision = "ieee"
            yield
        finally:
            for s, value in zip(settings, saved, strict=True):
                if s.fp32_precision != value:
                    s.fp32_precision = value
        return
    precision, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32  # older PyTorch
    try:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn
