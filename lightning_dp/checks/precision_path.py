"""The step in the run's own precision, against the mixing check's fp32 pass A (issue #47).

The mixing check computes its passes in IEEE fp32 (``pass_precision.py``), so that bf16 rounding cannot
widen what it lets pass. A step that computes something else in reduced precision (it branches on
``x.dtype``, ``torch.is_autocast_enabled()``, ``self.dtype`` or the default dtype: a normalisation by the
batch's mean applied only in bf16) would then be checked on a path the real step does not take. So on a
checked batch of a run in bf16 or fp16, the forward of pass A (the per-batch hooks and ``training_step``)
runs once more in the run's own precision (on the batch as the step gets it, from the same state, with pass
A's random draws) and must make the same torch calls as the fp32 pass A (:class:`OpTrace`: each function, its
tensors' shapes and its integer, boolean and string arguments, in order), whatever their values: a branch is
refused however small its effect.

Left out of the comparison: casts, questions about a tensor (its dtype, its size), float constants (a cast to
``self.dtype``, a dtype's ``eps`` or ``finfo().min`` read no other example), and the calls Lightning's and
lightning-dp's own code make. The values are not compared: one example's gradient in bf16 may differ from
fp32's by its whole size (a saturated activation, a ReLU at its kink), so no rounding allowance would tell a
path from its rounding; a step that switches on its values alone (not on a dtype) is not seen.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from lightning_dp.checks.row_draws import DrawLog
from lightning_dp.per_example.broadcast import METADATA

CASTS = frozenset({"to", "float", "double", "half", "bfloat16", "type", "type_as"})
"""Calls that change only a tensor's dtype (or device): a path that casts in one precision only is the same
computation."""

LIBRARIES = frozenset({"lightning", "pytorch_lightning", "lightning_fabric", "lightning_dp"})
"""Packages whose own calls are not the step's (lightning-dp's capture hooks, Lightning's logging)."""


def _label(value: Any) -> Any:
    """What the trace keeps of one argument: a tensor's shape and kind of dtype, a dtype's kind, a float as
    its type only, ints, bools, strings and None as they are."""
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), _kind(value.dtype))
    if isinstance(value, torch.dtype):
        return ("dtype", _kind(value))
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return "float"
    if isinstance(value, torch.device):
        return ("device", value.type)
    if isinstance(value, slice):
        return ("slice", _label(value.start), _label(value.stop), _label(value.step))
    return type(value).__name__


def _kind(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "float"
    if dtype.is_complex:
        return "complex"
    return "bool" if dtype == torch.bool else "int"


def _name(func: Callable[..., Any]) -> str:
    return str(getattr(func, "__name__", None) or type(func).__name__)


def _called_by_a_library() -> bool:
    """Whether the code that made the current torch call (the first frame outside torch) is Lightning's or
    lightning-dp's (a layer hook that captures per-example gradients), not the step's."""
    frame = sys._getframe(2)
    while frame is not None:
        root = str(frame.f_globals.get("__name__", "")).partition(".")[0]
        if root != "torch":
            return root in LIBRARIES
        frame = frame.f_back  # type: ignore[assignment]
    return False


class OpTrace(TorchFunctionMode):
    """While active (and not :meth:`paused`), every torch call (``__torch_function__``: the user's calls, not
    what a function does inside) is folded into one fingerprint, with the count of calls. Enter it inside
    the capture's tracer, so that it sees each call first and none the tracer makes."""

    def __init__(self) -> None:
        super().__init__()
        self.fingerprint = 0
        self.calls = 0
        self.recording = True

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing recorded in the block (a backward, and the hooks around it)."""
        recording, self.recording = self.recording, False
        try:
            yield
        finally:
            self.recording = recording

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        if self.recording and name not in METADATA and name not in CASTS and not _called_by_a_library():
            leaves, _ = tree_flatten((args, kwargs))
            self.fingerprint = hash((self.fingerprint, name, tuple(_label(x) for x in leaves)))
            self.calls += 1
        return func(*args, **kwargs)

    def same(self, other: OpTrace) -> bool:
        return (self.fingerprint, self.calls) == (other.fingerprint, other.calls)


def computes_in_reduced_precision(plugin: Any) -> bool:
    """Whether the run's step computes in bf16 or fp16 (``bf16-mixed``, ``bf16-true``, ``16-true``, ...)."""
    return "16" in str(getattr(plugin, "precision", ""))


@dataclass
class PathReference:
    """What the fp32 pass A did, for the forward in the run's precision to be compared with."""

    precision: str
    """The run's precision setting (``"bf16-mixed"``)."""
    trace: OpTrace = field(default_factory=OpTrace)
    """The fp32 pass A's operations."""
    log: DrawLog | None = None
    """Its random draws, replayed in the run's precision (None until pass A ran)."""


def path_message(precision: str) -> str:
    """The refusal when the step makes other operations in the run's precision than in fp32 (one line: it is
    quoted)."""
    return (
        f"lightning-dp's sensitivity check ran your training_step in fp32 and again in the run's precision "
        f"({precision}) on the same batch, and the two made different torch operations: the step computes "
        "something else in reduced precision than in fp32 (it branches on a tensor's dtype, on "
        "torch.is_autocast_enabled(), on self.dtype or on the default dtype), so the check, which compares its "
        "passes in fp32, did not see the path the real step takes, and the reported ε may not hold for it. "
        "This step releases nothing. Compute the same operations in any precision: cast where you need to "
        "(x.to(self.dtype), x.float(): casts are fine), but never switch a normalisation, a loss term or a "
        "layer on the dtype (a statistic of the batch is refused on either path); or train in fp32 "
        "(precision='32-true'), where the check sees the step as it runs."
    )
