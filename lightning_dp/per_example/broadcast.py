"""A container's own parameters of leading dimension 1 (ViT's ``cls_token`` and ``pos_embed``) as per-example
views that are used only where they provably line up with the batch.

During the container's forward each such parameter ``p`` of shape [1, ...] is replaced by ``P``, ``p``
expanded to [B, ...], whose gradient row i is example i's gradient of ``p`` *if* every use of ``P`` puts
its dimension 0 on the batch's. :class:`PerExampleView` checks each use as it runs: an element-wise op with
an operand of the same rank that has the batch on dimension 0 (``x + pos_embed``), or ``expand(B, ...)``
(``cls_token.expand(B, -1, -1)``) lines up; ops that keep dimension 0 as it is (a cast, ``exp``, a scale by
a constant) give a view again. Any other use (``(B, 1) + offset`` of shape (1,), ``logits / t``, an RNN's
``h0.expand(-1, B, -1)``, an index) runs on ``p`` itself, exactly as the user wrote it, and marks the call:
its per-example gradients are then recomputed per example (``vmap``), which is exact for every use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

ELEMENTWISE = frozenset(
    f"{prefix}{name}{suffix}"
    for name in ("add", "sub", "mul", "div", "true_divide", "subtract", "multiply", "divide")
    for prefix, suffix in (("", ""), ("__", "__"), ("__r", "__"), ("__i", "__"), ("", "_"))
) | frozenset({"__truediv__", "__rtruediv__", "__itruediv__"})
"""Broadcasting arithmetic: each output element is one element of each operand."""

ROW_PRESERVING = frozenset(
    {
        *("to", "float", "double", "half", "bfloat16", "type", "type_as", "contiguous", "clone"),
        *("neg", "__neg__", "exp", "log", "tanh", "sigmoid", "abs", "square", "sqrt", "rsqrt", "relu"),
        *("softplus", "exp2", "log1p", "expm1", "sin", "cos", "pow", "__pow__", "reciprocal", "clamp"),
    }
)
"""Ops of one tensor (and constants) that map each row of dimension 0 to the same row: a view stays a view."""

METADATA = frozenset(
    {
        *("__get__", "size", "numel", "dim", "ndimension", "nelement", "__len__", "stride", "is_contiguous"),
        *("element_size", "is_floating_point", "is_complex", "get_device", "storage_offset", "data_ptr"),
        *("__repr__", "__format__", "__hash__"),
    }
)
"""Questions about the tensor: answered by the parameter itself (its shape, not the expanded one)."""


@dataclass
class ExpandedCall:
    """One forward of a container with expanded parameters: the batch, and the uses that did not line up."""

    batch: int
    misaligned: list[str] = field(default_factory=list)


class PerExampleView(Tensor):
    """``p.expand(B, ...)`` used where its dimension 0 lines up with the batch; ``original`` (``p``, or what
    the same ops made of it) everywhere else, with the use noted on ``call``."""

    original: Tensor
    call: ExpandedCall
    label: str

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        views = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, PerExampleView)]
        batch = views[0].call.batch
        if name in METADATA:
            return _run(func, *_originals(args, kwargs))
        verdict = "aligned" if batch == 1 else _verdict(name, views, args, kwargs, batch)
        if verdict == "aligned":
            return _run(func, args, kwargs)
        if verdict == "view":
            view = _run(func, args, kwargs)
            original = _run(func, *_originals(args, kwargs))
            if isinstance(view, Tensor) and isinstance(original, Tensor) and view.dim() == original.dim():
                return _wrap(view, original, views[0].call, views[0].label)
            return original
        for view in views:
            shapes = [tuple(t.shape) for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
            use = f"{name} on shapes {shapes} (the parameter as {tuple(view.original.shape)})"
            view.call.misaligned.append(f"{view.label}: {use}")
        return _run(func, *_originals(args, kwargs))


def _run(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _originals(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return unwrap((args, kwargs))


def unwrap(tree: Any) -> Any:
    """``tree`` with every view replaced by what the user's own code computes there (the parameter)."""
    return tree_map(lambda t: t.original if isinstance(t, PerExampleView) else t, tree)


def _verdict(
    name: str, views: list[PerExampleView], args: tuple[Any, ...], kwargs: dict[str, Any], batch: int
) -> str:
    """'aligned' (dimension 0 is the batch's), 'view' (dimension 0 kept as the view's) or 'misaligned'."""
    rank = views[0].dim()
    if any(v.dim() != rank for v in views):
        return "misaligned"
    if name in ("expand", "expand_as"):
        if args[0] is not views[0] or len(views) != 1:
            return "misaligned"
        if name == "expand_as":
            other = args[1]
            sizes: list[Any] = list(other.shape) if isinstance(other, Tensor) else []
        else:
            rest = [*args[1:], *kwargs.values()]
            sizes = (
                list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) else rest
            )
        return "aligned" if len(sizes) == rank and sizes[0] == batch else "misaligned"
    others = [
        t
        for t in tree_flatten((args, kwargs))[0]
        if isinstance(t, Tensor) and not isinstance(t, PerExampleView)
    ]
    if name in ELEMENTWISE:
        in_place = name.endswith("_") or name.startswith("__i")
        if in_place and isinstance(args[0], PerExampleView):  # in place: only into a batch tensor
            return "misaligned"
        if any(t.dim() > rank for t in others):
            return "misaligned"
        same_rank = [t for t in others if t.dim() == rank]
        if any(t.shape[0] not in (1, batch) for t in same_rank):
            return "misaligned"
        if any(t.shape[0] == batch for t in same_rank):
            return "aligned"
        return "view"
    if name == "__getitem__" and args[0] is views[0] and len(views) == 1 and _keeps_rows(args[1]):
        return "view"  # pos_embed[:, :T]
    one = name in ROW_PRESERVING and isinstance(args[0], PerExampleView) and len(views) == 1
    if one and all(t.dim() < rank or t.shape[0] == 1 for t in others):  # constants: dim 0 stays the view's
        return "view"
    return "misaligned"


def _keeps_rows(index: Any) -> bool:
    """An index that takes every row of dimension 0 and basic slices or positions of the others."""
    parts = index if isinstance(index, tuple) else (index,)
    whole = parts[:1] == (slice(None),)
    return whole and all(isinstance(i, (slice, int)) and not isinstance(i, bool) for i in parts)


def _wrap(view: Tensor, original: Tensor, call: ExpandedCall, label: str) -> PerExampleView:
    with torch._C.DisableTorchFunctionSubclass():
        out = view.as_subclass(PerExampleView)
    out.original = original
    out.call = call
    out.label = label
    return out


def per_example_view(param: Tensor, call: ExpandedCall, label: str) -> PerExampleView:
    """``param`` ([1, ...]) expanded to the call's batch, as a view that checks each of its uses."""
    with torch._C.DisableTorchFunctionSubclass():
        expanded = param.expand(call.batch, *param.shape[1:])
    return _wrap(expanded, param, call, label)
