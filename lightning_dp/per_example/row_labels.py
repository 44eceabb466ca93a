"""Which example each row (dimension 0) of a tensor is, through the torch ops that select, regroup or put back
rows: the labels (an example's index in the batch, :data:`NONE`, :data:`MIXED`), the families of ops that keep,
move or regroup rows, and the pure functions that give an op's output rows from its input's. The tracer
(:mod:`.uses`) applies them as ``training_step`` runs; the capture and the recomputed layers sum per-row
gradients into their examples with :func:`to_examples`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

NONE, MIXED = -1, -2
"""Row labels: a row of no example (a constant) and a row several examples reach."""

ROW_WISE = frozenset(
    {
        *("add", "sub", "mul", "div", "true_divide", "pow", "neg", "abs", "exp", "log", "sqrt", "rsqrt"),
        *("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__"),
        *("__pow__", "__neg__", "__iadd__", "__imul__", "add_", "mul_", "where", "masked_fill", "clamp"),
        *("tanh", "sigmoid", "relu", "gelu", "silu", "elu", "leaky_relu", "softplus", "dropout", "hardtanh"),
        *("linear", "matmul", "__matmul__", "embedding", "to", "float", "double", "half", "type_as"),
        *("contiguous", "clone", "relu_", "tanh_", "sigmoid_"),
    }
)
"""Ops whose output row i is computed from row i of their row-carrying operands alone."""

ALONG = frozenset({"softmax", "log_softmax", "normalize", "mean", "sum", "amax", "amin", "layer_norm"})
"""Ops that reduce or normalise along a dimension: row-wise when that dimension is not 0."""

SWAPS = frozenset({"t", "transpose", "swapaxes", "swapdims", "permute", "movedim"})
"""Ops that may swap dimensions 0 and 1 (a batch-first tensor made time-major, or back)."""

RESHAPES = frozenset({"reshape", "view", "flatten", "view_as", "reshape_as", "unflatten"})
PUTS = frozenset({"index_add", "index_add_", "index_copy", "index_copy_"})
REPEATS = frozenset({"repeat_interleave", "repeat"})
"""Ops that repeat the rows along dimension 0 (``x.repeat_interleave(k, 0)``: k views of each example)."""
SPLITS = frozenset({"chunk", "split", "tensor_split"})
"""Ops that cut a tensor into consecutive parts along a dimension (a tuple of tensors)."""
FOLLOWED = SWAPS | RESHAPES | PUTS | REPEATS | SPLITS | {"__getitem__", "index_select", "cat"}
"""Ops that may give rows of the batch another order or grouping (followed whatever their operands)."""


def dim_of(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``dim`` argument of an op that takes one (keyword or second positional), else None."""
    if "dim" in kwargs:
        return kwargs["dim"]
    if name == "layer_norm":
        return -1
    return args[1] if len(args) > 1 and isinstance(args[1], (int, tuple, list)) else None


def swaps_first_two(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``SWAPS`` op puts dimension 0 at position 1 and dimension 1 at position 0."""
    base: Tensor = args[0]
    rank = base.dim()
    rest = [*args[1:], *kwargs.values()]
    if name == "t":
        return rank == 2
    if name == "permute":
        order = list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else list(rest)
        return len(order) == rank and order[0] % rank == 1 and order[1] % rank == 0
    if name == "movedim":
        return len(rest) == 2 and rest[0] in (0, 1) and rest[1] == 1 - rest[0]
    return len(rest) == 2 and {int(d) % rank for d in rest} == {0, 1}


def keeps_first(index: Any) -> bool:
    """An index that keeps dimension 0 whole (``h[:, 0]``, ``h[..., :2]`` with more than one dimension)."""
    first = index[0] if isinstance(index, tuple) and index else index
    if first is Ellipsis:
        return isinstance(index, tuple) and len(index) > 1
    return (
        isinstance(first, slice)
        and first == slice(None)
        and not any(
            isinstance(i, Tensor) or i is None or isinstance(i, list)
            for i in (index[1:] if isinstance(index, tuple) else ())
        )
    )


def cuts(index: Any) -> bool:
    """An index that keeps a prefix, a part or one entry of dimension 0 (``idx[:k]``, ``idx[1:]``, ``idx[0]``),
    not all of it and not entries chosen by a tensor or list of indices."""
    first = index[0] if isinstance(index, tuple) and index else index
    if isinstance(first, bool):
        return False
    return isinstance(first, int) or (isinstance(first, slice) and first != slice(None))


def selected_rows(rows: Tensor, index: Any) -> Tensor | None:
    """The examples of the rows ``t[index]`` keeps, or None where dimension 0 is not simply selected."""
    first = index[0] if isinstance(index, tuple) and index else index
    rest = index[1:] if isinstance(index, tuple) else ()
    if any(isinstance(i, Tensor) or i is None or isinstance(i, list) for i in rest):
        return None  # advanced or new-axis indexing beyond dimension 0 moves rows or adds one in front
    if first is Ellipsis:
        return rows if len(rest) > 0 and rest[-1] is not Ellipsis else None
    if isinstance(first, int) and not isinstance(first, bool):
        return None  # dimension 0 removed
    if isinstance(first, Tensor) and first.dim() != 1:
        return None
    try:
        picked = rows[first.to(rows.device) if isinstance(first, Tensor) else first]
    except (IndexError, TypeError, RuntimeError):
        return None
    return picked if picked.dim() == 1 else None


def regrouped_rows(rows: Tensor, before: Tensor, after: Tensor) -> Tensor | None:
    """The examples of ``after``'s rows when it is ``before`` with its leading rows merged or split."""
    if after.dim() == 0 or before.numel() != after.numel() or before.numel() == 0:
        return None
    inner_before, inner_after = before.numel() // before.shape[0], after.numel() // after.shape[0]
    if inner_before == inner_after:
        return rows
    if inner_before % inner_after == 0:  # each row split into several
        return rows.repeat_interleave(inner_before // inner_after)
    if inner_after % inner_before == 0:  # several rows merged into one
        groups = rows.view(after.shape[0], inner_after // inner_before)
        lowest = torch.where(groups >= 0, groups, groups.max() + 1).amin(1)
        one = ((groups == lowest[:, None]) | (groups == NONE)).all(1) & (groups != MIXED).all(1)
        return torch.where(one, torch.where(lowest > groups.max(), NONE, lowest), MIXED)
    return None


def repeated_rows(name: str, rows: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    """The examples of the rows of ``x.repeat_interleave(k, dim=0)`` (each row k times in place) or
    ``x.repeat(k, ...)`` (the rows k times over), or None where dimension 0 is not repeated that way."""
    base: Tensor = args[0]
    rest = [*args[1:], *kwargs.values()] if name == "repeat" else list(args[1:])
    if name == "repeat":
        sizes = list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) else rest
        if len(sizes) != base.dim() or not all(isinstance(k, int) for k in sizes):
            return None  # new leading dimensions: dimension 0 is no longer the rows
        return rows.repeat(sizes[0])
    repeats = rest[0] if rest else kwargs.get("repeats")
    dim = rest[1] if len(rest) > 1 else kwargs.get("dim")
    if dim is None or dim % max(base.dim(), 1) != 0 or not isinstance(repeats, (int, Tensor)):
        return None
    return rows.repeat_interleave(repeats.to(rows.device) if isinstance(repeats, Tensor) else repeats)


def split_rows(name: str, rows: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any], parts: Any) -> list:
    """The examples of each part of ``x.chunk(n)``, ``x.split(size)`` or ``x.tensor_split(n)`` along dimension
    0 (consecutive slices of the rows), or [] where the parts are cut along another dimension."""
    base: Tensor = args[0]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if not isinstance(dim, int) or dim % max(base.dim(), 1) != 0 or not isinstance(parts, (tuple, list)):
        return []
    out, start = [], 0
    for part in parts:
        if not isinstance(part, Tensor) or part.dim() == 0:
            return []
        out.append(rows[start : start + part.shape[0]])
        start += part.shape[0]
    return out if start == rows.numel() else []


def to_examples(per_row: Tensor, rows: Tensor, batch: int) -> Tensor:
    """Per-row gradients [n, ...] summed into their examples [batch, ...] (rows of no example dropped)."""
    if rows.numel() == batch and torch.equal(rows, torch.arange(batch, device=rows.device)):
        return per_row
    keep = (rows >= 0).to(per_row.device)
    out = per_row.new_zeros((batch, *per_row.shape[1:]))
    return out.index_add_(0, rows.to(per_row.device)[keep], per_row[keep])


POSITION_LISTS = frozenset({"nonzero", "argwhere"})
"""Ops whose output lists positions of the rows that pass a test, row by row: which rows are listed depends on
each row alone, but the k-th entry of the list depends on every row before it."""

POSITION_KEEPING = frozenset(
    {"squeeze", "flatten", "view", "reshape", "contiguous", "to", "long", "int", "t"}
)
"""Ops that hand a position list on whole (its entries in their order)."""

JOINS = frozenset({"cat", "concat", "concatenate", "stack"})
"""Ops that join a list of tensors along a dimension (``stack``: a new one)."""


def off_rows(dim: Any, rank: int) -> bool:
    """Whether an op's ``dim`` argument (an int or a tuple) names dimensions other than 0 only."""
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return dim is not None and all(d not in (0, -rank) for d in dims)


def along_rows(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an op that takes a dimension (``softmax``, ``sum``, ``unsqueeze``, ...) keeps each row of its
    input to itself: that dimension is not 0."""
    if name in ALONG:
        return off_rows(dim_of(name, args, kwargs), args[0].dim())
    if name == "unsqueeze":
        return dim_of(name, args, kwargs) not in (0, None)
    return False


def keeps_rows(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an op's output row i is computed from row i of its operands alone, and the op can be run again
    on one row with the same result: no random draw (``dropout``) and no in-place write."""
    if name == "dropout" or (name.endswith("_") and not name.endswith("__")) or name.startswith("__i"):
        return False
    if name in JOINS and args and isinstance(args[0], (list, tuple)) and args[0]:
        return off_rows(dim_of(name, args, kwargs), args[0][0].dim() + (name == "stack"))
    return name in ROW_WISE or along_rows(name, args, kwargs)


def repeat_sizes(rest: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
    """The sizes of ``t.repeat(*sizes)`` or ``t.repeat(sizes)``."""
    found = kwargs.get("repeats", rest[0] if len(rest) == 1 else rest)
    if isinstance(found, int):
        return (found,)
    return tuple(int(v) for v in found)
