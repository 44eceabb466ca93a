"""What the layer hooks cannot see, traced as ``training_step`` runs: uses of a trainable parameter outside the
forward of every layer that holds it, and which example each row of a selected or regrouped tensor is.

:class:`UseTracer` is a ``TorchFunctionMode`` active while the step's forward and loss run. Three things it
follows:

* **Tracked tensors**: a trainable parameter read outside its layer's forward (a parameter on the
  LightningModule itself, ``F.normalize(head.weight)``, a tied ``h @ emb.weight.T``, a temperature in the
  loss), and every tensor computed from such parameters alone (``normalize(W)``, ``exp(-log_var)``).
* **Rows**: the example each row (dimension 0) of a tensor belongs to. A tensor whose dimension 0 is the
  batch is the batch's rows; rows taken from it (``x[mask]``, ``index_select``), regrouped (``reshape(B*T,
  d)`` and back) or put back (``index_add``) keep the examples they came from (``-1``: a row of no example,
  a constant; ``-2``: a row several examples reach, which nothing may use); what each op does to the rows is
  :mod:`.row_labels`.
* **Meetings**: an op where a tracked tensor meets rows. Its per-example gradient is the op recomputed per
  row (``vmap``), the rows summed into their examples, pulled back to the parameters through the tracked
  tensor's own graph (``is_grads_batched``). A tracked tensor added to a loss already reduced over the batch
  (a weight penalty, Kendall's ``+ log_var``) gives every example the same gradient (``loss_reduction=
  "mean"``: the loss is the mean of per-example losses that each hold the term). Any other meeting is
  refused at ``collect``, naming the use, if a gradient reaches it.

* **Repeated rows and position lists**: a ``[1, ...]`` parameter repeated over the rows (a class token) keeps
  its one row; a list of the batch's row positions (``nonzero``) cut to a prefix chooses rows by their rank,
  and is refused (``rank_selection_message``).

Each contribution is added to the capture's per-example gradients, so a parameter used by several layers,
outside them, or both, has the sum of all its uses; the engine's first-step check that they add up to
autograd's gradient tests that sum.

The module is a little over 500 lines: it is one ``TorchFunctionMode`` whose concerns above read and write
the same weak maps of the step's tensors in one ``__torch_function__``; what each op does to rows, the pure
part, is :mod:`.row_labels`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

from lightning_dp.per_example.broadcast import METADATA
from lightning_dp.per_example.row_labels import (
    FOLLOWED,
    JOINS,
    MIXED,
    NONE,
    POSITION_KEEPING,
    POSITION_LISTS,
    PUTS,
    REPEATS,
    RESHAPES,
    ROW_WISE,
    SPLITS,
    SWAPS,
    along_rows,
    cuts,
    dim_of,
    keeps_first,
    keeps_rows,
    regrouped_rows,
    repeat_sizes,
    repeated_rows,
    selected_rows,
    split_rows,
    swaps_first_two,
    to_examples,
)


class TracedCapture(Protocol):
    """What the tracer reads of its :class:`~lightning_dp.per_example.capture.GradientCapture` and adds to it."""

    ignoring: bool
    """True while a backward the capture must not record runs (an inner ``autograd.grad``)."""
    loss_reduction: str

    @property
    def batch_hint(self) -> int | None: ...

    def tracing_now(self) -> bool: ...

    def used_outside(self, param: nn.Parameter) -> bool: ...

    def scale(self, batch: int) -> float: ...

    def name_of(self, param: nn.Parameter) -> str: ...

    def add_outside(self, samples: dict[nn.Parameter, Tensor]) -> None: ...

    def ignoring_backward(self) -> contextlib.AbstractContextManager[None]: ...


IGNORED = (METADATA - {"__get__"}) | {
    *("requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "retain_grad"),
    *("detach", "detach_", "backward", "item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__"),
}
"""Calls that neither compute a differentiable value nor move rows."""

ADDITIVE = frozenset(
    {"add", "__add__", "__radd__", "__iadd__", "add_", "sub", "__sub__", "__rsub__", "__isub__"}
)
"""Ops whose gradient to one operand does not depend on the other's value."""

BROADCASTS = frozenset({"expand", "expand_as", "broadcast_to"})
"""Ops that repeat a tensor along a new or size-1 dimension 0 without copying (``cls.expand(B, -1, -1)``)."""


@dataclass(frozen=True, eq=False)
class TracedCall:
    """One torch call the tracer saw with a tracked operand: the op, its arguments, the tracked operands (each
    with the parameters it is computed from) and the call's result."""

    name: str
    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    sources: dict[Tensor, frozenset[nn.Parameter]]
    out: Any


class UseTracer(TorchFunctionMode):
    """The tracer of one :class:`~lightning_dp.per_example.capture.GradientCapture` (see the module doc)."""

    def __init__(self, capture: TracedCapture) -> None:
        super().__init__()
        self.capture = capture
        self.derived = WeakTensorKeyDictionary()
        """Tracked tensors that are not parameters → the parameters they were computed from."""
        self.rows = WeakTensorKeyDictionary()
        """Tensors whose rows are not the batch's in order → the example of each row."""
        self.covered: set[nn.Parameter] = set()
        """Parameters whose uses outside a layer gave per-example gradients since the last ``reset``."""
        self.moved = WeakTensorKeyDictionary()
        """Tensors whose dimension 1, not 0, holds the batch's rows (``x.transpose(0, 1)``: time-major)."""
        self.expanded = WeakTensorKeyDictionary()
        """Tracked tensors whose rows (dimension 0) are all one value → that row, a ``[1, ...]`` tensor
        computed from the parameters (``cls.expand(B, -1, -1)``, ``pos.repeat(B, 1, 1)``, and what row-wise
        ops make of them: ``* 2``, ``unsqueeze(1)``): a meeting with the batch's rows recomputes each row
        with that one row (see ``_meet_rows`` and ``_note_expanded``)."""
        self.positions = WeakTensorKeyDictionary()
        """Lists of the batch's row positions (``(choice == e).nonzero()``) → True: cut to a prefix, they choose
        rows by their rank among the batch's rows (see :meth:`_follow_positions`)."""
        self.refusals: list[str] = []
        self.second_order = False
        """A gradient of the model was differentiated again (``create_graph=True``) since the last reset."""
        self._paused = 0

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (with the engine) without this step's weak maps of tensors: a copy starts a step afresh."""
        return {
            k: v
            for k, v in self.__dict__.items()
            if k not in ("derived", "rows", "moved", "expanded", "positions")
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.reset()

    def reset(self) -> None:
        self.derived, self.rows = WeakTensorKeyDictionary(), WeakTensorKeyDictionary()
        self.moved, self.expanded = WeakTensorKeyDictionary(), WeakTensorKeyDictionary()
        self.positions = WeakTensorKeyDictionary()
        self.covered, self.refusals, self.second_order = set(), [], False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # -- dispatch ---------------------------------------------------------------------------------------
    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property: ``shape`` is metadata, ``T`` or ``mT`` a value
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if self._paused or name in IGNORED or not self.capture.tracing_now():
            return func(*args, **kwargs)
        if func is torch.autograd.grad:
            return self._autograd_grad(func, args, kwargs)
        tensors = _shallow_tensors(args, kwargs)
        if not tensors:
            return func(*args, **kwargs)
        sources = {t: found for t in tensors if (found := self._sources(t))}
        out = func(*args, **kwargs)
        if sources:
            self._use(TracedCall(name, func, args, kwargs, sources, out))
        elif name in FOLLOWED or self._carries_rows(tensors):
            self._follow_rows(name, args, kwargs, tensors, out)
        if name in POSITION_LISTS or (len(self.positions) and any(t in self.positions for t in tensors)):
            self._follow_positions(name, args, out)
        return out

    def _follow_positions(self, name: str, args: tuple[Any, ...], out: Any) -> None:
        """Mark the lists of batch-row positions an op makes or hands on whole; refuse one cut along its entries.

        ``(choice == e).nonzero()`` lists the rows routed to expert ``e``, each row's entry decided by that row
        alone. Its prefix ``[:k]`` (an expert's capacity, "the first k labelled rows") keeps a row only if fewer
        than k rows before it passed: which rows are kept depends on the other examples, whatever the removal
        check happens to remove."""
        base = args[0] if args and isinstance(args[0], Tensor) else None
        if base is None:
            return
        parts = out if isinstance(out, tuple | list) else (out,)
        if name in POSITION_LISTS:
            batch = self.capture.batch_hint
            if base.dim() > 0 and base.shape[0] > 1 and (base in self.rows or base.shape[0] == batch):
                for part in parts:
                    if isinstance(part, Tensor) and part.dim() > 0:
                        self.positions[part] = True
            return
        if base not in self.positions:
            return
        whole = name in POSITION_KEEPING or (
            name == "__getitem__" and keeps_first(args[1])  # nz[:, 0]: every entry, its one column
        )
        if whole and isinstance(out, Tensor):
            self.positions[out] = True
        elif name in ("narrow", "split", "chunk", "tensor_split") or (
            name == "__getitem__" and cuts(args[1])
        ):
            self.refusals.append(rank_selection_message())
        # read by a tensor of indices (``rows[j]``), the list's entries are gathered, not cut by rank: what
        # the gathered positions then select is the rows' own business (the removal check judges it)

    def _carries_rows(self, tensors: list[Tensor]) -> bool:
        """Whether an operand has rows other than the batch's in order, or its batch on dimension 1."""
        rows, moved = self.rows, self.moved
        return bool(
            (len(rows) and any(t in rows for t in tensors))
            or (len(moved) and any(t in moved for t in tensors))
        )

    def _sources(self, t: Tensor) -> frozenset[nn.Parameter]:
        if isinstance(t, nn.Parameter):
            return frozenset({t}) if self.capture.used_outside(t) else frozenset()
        return self.derived.get(t, frozenset()) if len(self.derived) else frozenset()

    def _autograd_grad(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A gradient taken inside the step: first order, it is not the step's backward (the hooks ignore it);
        with ``create_graph=True`` the loss differentiates it again, which one backward cannot split."""
        bound = inspect.signature(torch.autograd.grad).bind(*args, **kwargs)
        if bound.arguments.get("create_graph", False):
            self.second_order = True
            return func(*args, **kwargs)
        with self.capture.ignoring_backward():
            return func(*args, **kwargs)

    # -- rows -----------------------------------------------------------------------------------------------
    def rows_of(self, t: Tensor) -> Tensor | None:
        """The example of each row of ``t`` (None: not known); the batch's own rows for dim 0 = the batch."""
        found = self.rows.get(t)
        if found is not None:
            return found
        batch = self.capture.batch_hint
        if batch is not None and t.dim() > 0 and t.shape[0] == batch:
            return torch.arange(batch, device=t.device)
        return None

    def set_rows(self, t: Tensor, rows: Tensor | None) -> None:
        """Record that ``t``'s rows are ``rows``' examples (None, or the batch in order: nothing to record)."""
        batch = self.capture.batch_hint
        if rows is None or t.dim() == 0 or rows.numel() != t.shape[0]:
            return
        if rows.numel() == batch and torch.equal(rows, torch.arange(batch, device=rows.device)):
            return
        self.rows[t] = rows

    def _follow_rows(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[Tensor], out: Any
    ) -> None:
        """Give ``out`` the examples of its rows when an op selects, regroups, repeats, splits or puts back
        rows."""
        base = args[0] if args and isinstance(args[0], Tensor) else None
        if (
            name in SPLITS
            and base is not None
            and base.dim() > 0
            and (rows := self.rows_of(base)) is not None
        ):
            for part, part_rows in zip(out, split_rows(name, rows, args, kwargs, out)):
                self.set_rows(part, part_rows)
            return
        if not isinstance(out, Tensor) or out.dim() == 0:
            return
        if name in SWAPS and base is not None and base.dim() > 1 and swaps_first_two(name, args, kwargs):
            if base not in self.moved and self.capture.batch_hint == base.shape[0] and base not in self.rows:
                self.moved[out] = True  # the batch's rows moved to dimension 1 (swapped back: not marked)
        elif any(t in self.moved for t in tensors) and name in ROW_WISE:
            self.moved[out] = True
        elif name == "__getitem__" and base is not None and base.dim() > 0:
            whole = keeps_first(args[1])
            if base in self.rows and whole:
                self.rows[out] = self.rows[base]
            elif not whole and (rows := self.rows_of(base)) is not None:
                self.set_rows(out, selected_rows(rows, args[1]))
        elif name == "index_select" and base is not None and dim_of(name, args, kwargs) == 0:
            rows = self.rows_of(base)
            index = args[2] if len(args) > 2 else kwargs.get("index")
            if rows is not None and isinstance(index, Tensor):
                self.set_rows(out, rows[index.to(rows.device)])
        elif name in RESHAPES and base is not None and base.dim() > 0:
            if base not in self.rows and out.shape[0] == base.shape[0]:
                return  # the batch's rows in order stay so
            rows = self.rows_of(base)
            if rows is not None:
                self.set_rows(out, regrouped_rows(rows, base, out))
        elif name in REPEATS and base is not None and base.dim() > 0:
            if (rows := self.rows_of(base)) is not None:
                self.set_rows(out, repeated_rows(name, rows, args, kwargs))
        elif name in PUTS and base is not None and dim_of(name, args, kwargs) in (0, None):
            self._put(base, args, kwargs, out)
        elif (
            name == "cat"
            and dim_of(name, args, kwargs) in (0, None)
            and args
            and isinstance(args[0], (list, tuple))
        ):
            parts = [self.rows_of(t) for t in args[0]]
            if any(p is not None for p in parts) and all(isinstance(t, Tensor) for t in args[0]):
                filled = [
                    p if p is not None else torch.full((t.shape[0],), MIXED if t.requires_grad else NONE)
                    for p, t in zip(parts, args[0], strict=True)
                ]
                self.set_rows(out, torch.cat([f.to(filled[0].device) for f in filled]))
        else:
            mapped = [self.rows[t] for t in tensors if t in self.rows]
            if mapped and self._row_wise(name, args, kwargs, out, mapped):
                self.rows[out] = mapped[0]

    def _row_wise(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Tensor, mapped: list[Tensor]
    ) -> bool:
        n = mapped[0].numel()
        if out.shape[0] != n or any(m is not mapped[0] and not torch.equal(m, mapped[0]) for m in mapped):
            return False
        return name in ROW_WISE or along_rows(name, args, kwargs)

    def _put(self, base: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any], out: Tensor) -> None:
        """``base.index_add(0, index, source)``: row ``index[j]`` gets source row j's example too."""
        index = args[2] if len(args) > 2 else kwargs.get("index")
        source = args[3] if len(args) > 3 else kwargs.get("source")
        if not isinstance(index, Tensor) or not isinstance(source, Tensor):
            return
        rows = self.rows_of(base)
        if rows is None:
            rows = torch.full((base.shape[0],), MIXED if base.requires_grad else NONE, device=index.device)
        given = self.rows_of(source)
        if given is None:
            given = torch.full((source.shape[0],), MIXED if source.requires_grad else NONE)
        merged = rows.clone()
        index, given = index.to(merged.device), given.to(merged.device)
        for value in given.unique().tolist():
            targets = index[given == value]
            current = merged[targets]
            merged[targets] = torch.where((current == NONE) | (current == value), value, MIXED)
        self.set_rows(out, merged)

    # -- uses of tracked tensors ------------------------------------------------------------------------------
    def _use(self, call: TracedCall) -> None:
        name, args, kwargs, sources, out = call.name, call.args, call.kwargs, call.sources, call.out
        params = frozenset().union(*sources.values())
        others = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor) and t not in sources]
        rowed = [(t, r) for t in others if t.dim() > 0 and (r := self.rows_of(t)) is not None]
        level = [t for t in others if t.requires_grad and t.dim() == 0]
        unknown = [t for t in others if t.requires_grad and t.dim() > 0 and all(t is not u for u, _ in rowed)]
        if not isinstance(out, Tensor) or not out.requires_grad:
            return
        if not rowed and not level and not unknown:
            if not isinstance(out, nn.Parameter):
                self.derived[out] = params
                self._note_expanded(call)
            return
        label = self._label(name, params)
        if rowed and not level and not unknown:
            rows = rowed[0][1]
            same = all(r.numel() == rows.numel() and torch.equal(r.to(rows.device), rows) for _, r in rowed)
            if same and bool((rows >= NONE).all().item()) and out.dim() > 0 and out.shape[0] == rows.numel():
                self._meet_rows(call, rows, label)
                self.set_rows(out, rows)
                return
        elif level and not rowed and not unknown and name in ADDITIVE:
            self._meet_batch_level(call, label)
            return
        self._refuse_if_reached(out, unmatched_message(label))

    def _note_expanded(self, call: TracedCall) -> None:
        """Remember a tracked ``out`` of several rows that are all one value, with that row (:attr:`expanded`):
        a tracked tensor broadcast along a new or size-1 dimension 0 (``expand``, ``broadcast_to``,
        ``repeat(B, ...)``); such a tensor expanded, repeated or indexed along its other dimensions
        (``.repeat(1, 2, 1)[:, :5]``); or a row-wise op's result whose operands with rows are all such
        tensors, the row being the op on their rows (``cls2d.expand(B, -1).unsqueeze(1)``, ``* s``, a
        ``cat`` or ``stack`` along another dimension). Without it, a meeting with the batch's rows would see
        the whole repeated tensor next to each row."""
        out = call.out
        if out.dim() == 0 or out.shape[0] == 1:
            return
        row = None
        with self.paused(), contextlib.suppress(RuntimeError, TypeError, ValueError, IndexError):
            # a row the op cannot make again (a shape only the whole tensor has) is just not remembered
            row = self._one_row(call)
        if isinstance(row, Tensor) and row.shape == (1, *out.shape[1:]):
            self.expanded[out] = row

    def _one_row(self, call: TracedCall) -> Tensor | None:
        """The one row every row of ``call.out`` is (see :meth:`_note_expanded`), or None."""
        name, func, args, kwargs, out = call.name, call.func, call.args, call.kwargs, call.out
        sources = call.sources
        base = args[0] if args and isinstance(args[0], Tensor) else out
        repeated = base in sources and (base.dim() < out.dim() or base.shape[0] == 1)
        known = self.expanded.get(base) if len(self.expanded) else None
        one = base if repeated else known  # the tensor whose one row ``out`` repeats, if it is a repeat
        if name in BROADCASTS and one is not None:
            return one.expand(1, *out.shape[1:])
        if name == "repeat" and one is not None:
            sizes = repeat_sizes(args[1:], kwargs)
            if repeated and len(sizes) == out.dim():
                return one.repeat(1, *sizes[1:])
            return one.repeat(1, *sizes[1:]) if len(sizes) == base.dim() and sizes[0] == 1 else None
        if name == "__getitem__" and known is not None and len(args) > 1 and keeps_first(args[1]):
            return known[args[1]]
        if not len(self.expanded) or not keeps_rows(name, args, kwargs):
            return None
        flat, spec = tree_flatten((args, kwargs))
        # the operands with rows: the joined tensors, those of out's rank (broadcast ones are the same for
        # every row), or the input of an op along another dimension (``unsqueeze(1)``, ``sum(-1)``)
        many = [
            isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] > 1
            and (name in JOINS or t.dim() == out.dim() or (t is base and name not in ROW_WISE))
            for t in flat
        ]  # fmt: skip
        if not any(many) or not all(t in self.expanded for t, m in zip(flat, many, strict=True) if m):
            return None
        a, k = tree_unflatten([self.expanded[t] if m else t for t, m in zip(flat, many, strict=True)], spec)
        return func(*a, **k)

    def _label(self, name: str, params: frozenset[nn.Parameter]) -> str:
        names = sorted(self.capture.name_of(p) for p in params)
        return f"{name} on {names}"

    def _refuse_if_reached(self, out: Tensor, message: str) -> None:
        out.register_hook(lambda grad: self.refusals.append(message) if not self.capture.ignoring else None)

    def _meet_rows(self, call: TracedCall, rows: Tensor, label: str) -> None:
        """Per-row gradients of the tracked operands, recomputed per row, summed into the rows' examples."""
        func, sources = call.func, call.sources
        flat, spec = tree_flatten((call.args, call.kwargs))
        # a tracked row repeated over the rows (``cls.expand(B, -1, -1)``) is recomputed as that one row, and
        # its per-example gradients pulled back through it: the same value, without a [B, B, ...] gradient
        flat = [self.expanded.get(t, t) if isinstance(t, Tensor) and len(self.expanded) else t for t in flat]
        sources = {**sources, **{self.expanded[t]: ps for t, ps in sources.items() if t in self.expanded}}
        tracked = [i for i, t in enumerate(flat) if isinstance(t, Tensor) and t in sources]
        per_row = [
            i
            for i, t in enumerate(flat)
            if isinstance(t, Tensor) and i not in tracked and t.dim() > 0 and t.shape[0] == rows.numel()
        ]
        values = [t.detach() if isinstance(t, Tensor) else t for t in flat]
        batch = self.capture.batch_hint

        def one_row(qs: tuple[Tensor, ...], xs: tuple[Tensor, ...], g: Tensor) -> Tensor:
            leaves = list(values)
            for i, q in zip(tracked, qs, strict=True):
                leaves[i] = q
            for i, x in zip(per_row, xs, strict=True):
                leaves[i] = x.unsqueeze(0)
            a, k = tree_unflatten(leaves, spec)
            return (func(*a, **k) * g.unsqueeze(0)).sum()

        def on_grad(grad: Tensor) -> None:
            if self.capture.ignoring or batch is None:
                return
            with self.paused(), torch.no_grad():
                try:
                    qs = tuple(values[i] for i in tracked)
                    compute = torch.func.vmap(torch.func.grad(one_row), in_dims=(None, 0, 0))
                    grads = compute(qs, tuple(values[i] for i in per_row), grad.detach().to(qs[0].dtype))
                except RuntimeError as error:
                    self.refusals.append(unmatched_message(label, str(error)[:200]))
                    return
            for i, g in zip(tracked, grads, strict=True):
                self._add(flat[i], sources[flat[i]], to_examples(g, rows, batch), label)

        call.out.register_hook(on_grad)

    def _meet_batch_level(self, call: TracedCall, label: str) -> None:
        """A tracked term added to a loss reduced over the batch: each example's loss holds it whole."""
        func, sources = call.func, call.sources
        flat, spec = tree_flatten((call.args, call.kwargs))
        tracked = [i for i, t in enumerate(flat) if isinstance(t, Tensor) and t in sources]
        values = [t.detach() if isinstance(t, Tensor) else t for t in flat]
        batch = self.capture.batch_hint

        def on_grad(grad: Tensor) -> None:
            if self.capture.ignoring or batch is None:
                return
            if self.capture.loss_reduction != "mean":
                self.refusals.append(summed_term_message(label))
                return
            with self.paused(), torch.enable_grad():
                leaves = list(values)
                inputs = []
                for i in tracked:
                    leaves[i] = values[i].clone().requires_grad_(True)
                    inputs.append(leaves[i])
                a, k = tree_unflatten(leaves, spec)
                grads = torch.autograd.grad(func(*a, **k), inputs, grad.detach())
            for i, g in zip(tracked, grads, strict=True):
                whole = g.unsqueeze(0).expand(batch, *g.shape) / self.capture.scale(batch)
                self._add(flat[i], sources[flat[i]], whole, label)

        call.out.register_hook(on_grad)

    def _add(self, tracked: Tensor, params: frozenset[nn.Parameter], per_example: Tensor, label: str) -> None:
        """Pull per-example gradients of a tracked tensor back to its parameters and add them (scaled)."""
        scale = self.capture.scale(per_example.shape[0])
        if isinstance(tracked, nn.Parameter):
            pulled: dict[nn.Parameter, Tensor] = {tracked: per_example}
        else:
            ordered = list(params)
            with self.paused():
                try:
                    grads = torch.autograd.grad(
                        tracked, ordered, per_example.to(tracked.dtype), retain_graph=True,
                        is_grads_batched=True, allow_unused=True,
                    )  # fmt: skip
                except RuntimeError as error:
                    self.refusals.append(unmatched_message(label, str(error)[:200]))
                    return
            pulled = {p: g for p, g in zip(ordered, grads, strict=True) if g is not None}
        self.capture.add_outside({p: g.detach() * scale for p, g in pulled.items()})
        self.covered.update(pulled)


def _shallow_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """The tensor operands of a call: its arguments, and the items of list or tuple arguments."""
    found: list[Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, Tensor))
    return found


def unmatched_message(label: str, error: str = "") -> str:
    """The refusal for a parameter use whose per-example gradient cannot be traced to the examples."""
    failed = f" (recomputing it per row failed: {error})" if error else ""
    return (
        f"A trainable parameter is used outside the forward of its layer ({label}) where its rows cannot be "
        f"traced to the batch's examples{failed}: it meets a tensor whose rows are not the batch's (reshaped, "
        "or combined across examples), or a value already reduced over the batch other than by adding to it "
        "(a temperature or weight multiplying the batch's mean loss), so its per-example gradient is unknown. "
        "This step releases nothing. Apply the parameter to per-example values: keep the batch on dimension 0 "
        "and multiply per-example losses before the mean ((w * F.cross_entropy(out, y, reduction='none'))"
        ".mean()); or pass DPStrategy(checks=Checks(isolate_examples=True)), which runs each example alone (exact for any "
        "use, one forward per example)."
    )


def summed_term_message(label: str) -> str:
    """The refusal for a parameter term added to a loss summed over the batch (its share per example is unknown)."""
    return (
        f"A trainable parameter's term ({label}) is added to a loss summed over the batch "
        "(loss_reduction='sum'): which share of it each example's loss holds depends on the batch size, which "
        "is private. This step releases nothing. Add it to a loss averaged over the batch (the default "
        "loss_reduction='mean'), or add it to each example's loss before the sum."
    )


def rank_selection_message() -> str:
    """The refusal for rows chosen by their rank among the batch's rows (one line: it is quoted)."""
    return (
        "The step chooses the batch's rows by their rank: it cuts a list of row positions (x.nonzero(), "
        "torch.argwhere) to a prefix or a part (an expert's capacity idx[:k] in a mixture of experts, the first k "
        "rows that pass a test), so whether a row is kept depends on the other examples before it, and one "
        "example can change the gradients of others. This step releases nothing. Keep every listed row (route "
        "with a mask, or drop tokens past capacity by a rule that reads each row alone, e.g. a threshold on its "
        "own router score), or pass DPStrategy(checks=Checks(isolate_examples=True)): each example then runs "
        "through training_step alone."
    )
