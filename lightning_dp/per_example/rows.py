"""Which examples a layer call's rows are: the provenance of rows, followed through one forward.

Per-example clipping takes row i of a layer call as example i. That holds for a call on the whole batch in
order; this module follows the calls for which it does not: a call on one input shared by the batch
(broadcast to every example), a call on rows of the batch (each row given to its example), a call on the
batch's rows reordered or moved to dimension 1 (noted, and refused at ``collect``), and several backward
passes over parts of one batch. :class:`RowProvenance` holds what one forward and its backward showed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from lightning_dp.per_example.uses import UseTracer

GRAPH_WALK_LIMIT = 4096
"""Graph nodes visited at most when deciding whether a one-row layer input derives from the batch."""

ORDER_WALK_LIMIT = 256
"""Graph nodes visited at most, per layer call, back to the layer outputs it derives from, looking for
reorderings of the batch (``pad_packed_sequence`` undoes ``pack_padded_sequence``'s sort 16 nodes later)."""


@dataclass(frozen=True)
class RowMap:
    """Which batch rows a layer call's rows are (``rows[j]`` for the call's row j), in a batch of ``batch``."""

    rows: Tensor
    batch: int

    @property
    def one_each(self) -> bool:
        """Each example at most once (placed at its row of the batch); else rows are summed per example."""
        return self.rows.numel() <= self.batch and self.rows.unique().numel() == self.rows.numel()


@dataclass(frozen=True)
class RowsSeen:
    """What the rows of one step's layer calls showed, handed to the checks at ``collect``."""

    reordered: list[nn.Module]
    """Layers called on the batch's rows reordered (``reordered_rows``)."""
    time_major: list[nn.Module]
    """Layers called on a tensor whose batch is on dimension 1."""
    partial_backwards: bool
    """Several backward passes, on traced rows that leave out some of the batch."""


class RowProvenance:
    """The rows of one forward's layer calls: the batch they are on, and which examples they are."""

    def __init__(self, root: nn.Module, tracer: UseTracer) -> None:
        self.root, self.tracer = root, tracer
        self.hint: int | None = None
        """The batch of the current forward: as the sampler drew it, else dimension 0 of the first layer's input."""
        self.shared: set[nn.Module] = set()
        """Layers whose calls take an input shared by the whole batch (``classify``)."""
        self.batched: set[nn.Module] = set()
        """Layers whose inputs scale with the batch (``classify``)."""
        self.classified = False
        """Whether ``classify`` ran (else the size rule: a one-dimensional lookup input whose length is not
        the batch is shared)."""
        self.batched_nodes: set[Any] = set()
        """Graph nodes of this forward's layer outputs over the whole batch (``from_batch``)."""
        self.reordered: list[nn.Module] = []
        self.time_major: list[nn.Module] = []
        self.tasks: set[int] = set()
        """The backward passes (autograd graph tasks) the hooks took calls from since the last ``collect``."""
        self.partial = False
        """Whether a call since the last ``collect`` ran on traced rows that leave out some of the batch."""

    def note_batch(self, first: Any) -> None:
        """The forward's batch size, from the first captured layer's input (unless already known)."""
        if self.hint is None and isinstance(first, Tensor) and first.dim() > 0:
            self.hint = first.shape[0]

    def note_task(self) -> None:
        """A layer call's gradient arrived: in which backward pass (several over one batch are refused)."""
        self.tasks.add(torch._C._current_graph_task_id())

    def take(self) -> RowsSeen:
        """What this step's calls showed, and a fresh start for the next forward's."""
        partial = len(self.tasks) > 1 and self.partial
        seen = RowsSeen(self.reordered, self.time_major, partial)
        self.reordered, self.time_major, self.tasks, self.partial = [], [], set(), False
        self.batched_nodes = set()
        return seen

    def forget(self) -> None:
        """Forget a forward as if it never ran (``GradientCapture.discard``)."""
        self.batched_nodes, self.reordered = set(), []

    def broadcast(
        self, module: nn.Module, inputs: tuple[Any, ...], output: Tensor
    ) -> tuple[tuple[Any, ...], Tensor]:
        """A layer called on one input shared by the whole batch (GPT-2's ``wpe`` on positions [1, T],
        nanoGPT's ``wpe(arange(T))``) gets its output expanded to the batch, so its output gradient, and
        so its per-example gradient, is each example's own slice instead of their sum."""
        first = inputs[0] if inputs and isinstance(inputs[0], Tensor) else None
        self.note_batch(first)
        batch = self.hint
        if batch is None or first is None or output.dim() == 0:
            return inputs, output
        if module in self.batched:  # its inputs scale with the batch: never a broadcast, whatever the size
            return inputs, output
        shared = module in self.shared
        one_row = batch > 1 and first.dim() > 0 and first.shape[0] == 1 and output.shape[0] == 1
        if one_row and self.from_batch(first, batch, shared):
            return inputs, output  # a row of the batch, or the batch as one set: never a broadcast
        if one_row:
            expanded = tuple(
                x.expand(batch, *x.shape[1:])
                if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == 1
                else x
                for x in inputs
            )
            return expanded, output.expand(batch, *output.shape[1:])
        lookup = isinstance(module, nn.Embedding) and first.dim() == 1
        if lookup and (shared or (first.shape[0] != batch and not self.classified)):
            return (first.expand(batch, -1), *inputs[1:]), output.expand(batch, *output.shape)
        return inputs, output

    def from_batch(self, first: Tensor, batch: int, shared: bool) -> bool:
        """Whether a layer input of one row derives from the batch's rows (``h[i:i+1]``, ``h.unsqueeze(0)``)
        rather than being shared by every example (positions, a learned query): its autograd graph reaches
        the output of a layer call over the batch, or it is a view of a batch-sized tensor with no
        history, or the structure probe ran and did not find the layer shared."""
        if first.grad_fn is not None and self.batched_nodes:
            seen: set[Any] = set()
            todo = [first.grad_fn]
            while todo and len(seen) < GRAPH_WALK_LIMIT:
                node = todo.pop()
                if node in self.batched_nodes:
                    return True
                if node in seen:
                    continue
                seen.add(node)
                todo.extend(n for n, _ in node.next_functions if n is not None)
        if shared:
            return False
        base = first._base
        if base is not None and base.dim() > 0 and base.shape[0] == batch and base.grad_fn is None:
            return True
        return self.classified

    def call_rows(self, inputs: tuple[Any, ...], output: Tensor) -> RowMap | None:
        """The batch rows of a call on fewer rows than the batch, when its first input is provably made of
        them (``rows_of``); None for an ordinary call, or rows that cannot be traced (refused later). Rows that
        leave out some of the batch are noted (several backward passes over parts of a batch are refused)."""
        batch = self.hint
        first = inputs[0] if inputs and isinstance(inputs[0], Tensor) else None
        if batch is None or first is None or first.dim() == 0 or output.dim() == 0:
            return None
        size = first.shape[0]
        if size == batch or output.shape[0] != size:
            return None
        base = first._base
        if base is not None and any(base is b for b in self.root.buffers()):
            return None  # rows of a model constant, not of the batch
        rows = rows_of(first, batch, self.batched_nodes) if size < batch else None
        if rows is None or rows.numel() != size or rows.unique().numel() != size:
            # rows the tracer followed (a selection of the data, a regrouping)
            traced = self.traced_rows(first)
            if traced is None:
                return None
            rows = traced.rows
        for x in inputs[1:]:  # every other batch-sized input must be indexed the same way: not known here
            if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == size and size > 1:
                return None
        found = RowMap(rows, batch)
        self.partial |= found.rows.unique().numel() < found.batch
        return found

    def traced_rows(self, first: Any) -> RowMap | None:
        """The examples of a call's rows as the tracer followed them (None: the batch in order, or unknown)."""
        batch = self.hint
        if batch is None or not isinstance(first, Tensor) or first.dim() == 0 or first.shape[0] == batch:
            return None
        rows = self.tracer.rows.get(first)
        if rows is None or rows.numel() != first.shape[0] or bool((rows < 0).any()):
            return None  # rows of no example, or reached by several, cannot be given to one example
        return RowMap(rows, batch)

    def check_order(self, module: nn.Module, first: Any) -> None:
        """A call on the whole batch whose rows are reordered (``h[perm]``) since the layer outputs it derives
        from is noted, and refused at ``collect``: its rows are not those layers' examples in order; so is a
        call on a tensor whose batch was moved to dimension 1."""
        if isinstance(first, Tensor) and first in self.tracer.moved:
            self.time_major.append(module)
        batch = self.hint
        if batch is None or batch < 2 or not isinstance(first, Tensor) or first.grad_fn is None:
            return
        whole = first.dim() > 0 and first.shape[0] == batch
        if whole and reordered_rows(first.grad_fn, batch, self.batched_nodes) is not None:
            self.reordered.append(module)

    def note_output(self, output: Tensor, rows: RowMap | None = None) -> None:
        """Remember the graph node of a layer output over the whole batch (``from_batch`` looks for it), or
        the examples of the rows of an output over rows of the batch (the tracer follows them on)."""
        if rows is not None:
            self.tracer.set_rows(output, rows.rows)
            return
        batch = self.hint
        if output.grad_fn is not None and output.dim() > 0 and batch is not None and output.shape[0] == batch:
            self.batched_nodes.add(output.grad_fn)

    def classify(self, smaller: dict[nn.Module, list[int]], larger: dict[nn.Module, list[int]]) -> None:
        """Layers whose input sizes are the same in two forwards of different batch sizes are shared by
        the batch (a position lookup on ``arange(T)``): their calls are broadcast to every example even
        when T happens to equal the batch. Layers whose sizes moved are per example."""
        for module in smaller.keys() & larger.keys():
            a, b = smaller[module], larger[module]
            if len(a) != len(b):
                continue
            if a == b:
                self.shared.add(module)
            else:
                self.batched.add(module)
        self.classified = True


@contextlib.contextmanager
def input_sizes(layers: Sequence[nn.Module]) -> Iterator[dict[nn.Module, list[int]]]:
    """For the block: dimension 0 of each layer call's first tensor input, per layer, in call order (the
    forward may run without autograd; nothing is captured), for :meth:`RowProvenance.classify`."""
    sizes: dict[nn.Module, list[int]] = {}

    def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        first = next((x for x in tree_flatten((args, kwargs))[0] if isinstance(x, Tensor)), None)
        if first is not None:
            sizes.setdefault(module, []).append(first.shape[0] if first.dim() else -1)

    handles = [m.register_forward_pre_hook(record, with_kwargs=True) for m in layers]
    try:
        yield sizes
    finally:
        for handle in handles:
            handle.remove()


ROW_WISE = frozenset(
    f"{name}Backward{version}"
    for name in (
        *("Tanh", "Relu", "Sigmoid", "Gelu", "Silu", "Elu", "LeakyRelu", "Hardtanh", "Clone", "ToCopy"),
        *("Mul", "Div", "Add", "Sub", "Neg", "Exp", "Log", "Pow", "Sqrt", "Rsqrt", "Abs"),
    )
    for version in (0, 1)
)
"""Element-wise autograd nodes: with one input that carries a gradient, each row of the output comes from the
same row of that input alone (broadcasting may only add rows, never take one row's place with another's)."""


def _row_wise_input(node: Any) -> Any:
    """The one gradient-carrying input of an element-wise node, or None (another kind, or several inputs)."""
    if type(node).__name__ not in ROW_WISE:
        return None
    nexts = [n for n, _ in node.next_functions if n is not None]
    return nexts[0] if len(nexts) == 1 else None


_SIGNED = 2**63


def _signed(value: int) -> int:
    return value - 2 * _SIGNED if value >= _SIGNED else value


def _view_rows(t: Tensor, batch: int) -> Tensor | None:
    """The rows of ``t`` when it is a row slice of a batch-sized tensor with no history (the batch itself)."""
    base = t._base
    if base is None or base.requires_grad or base.dim() != t.dim() or base.shape[0] != batch:
        return None
    if base.shape[1:] != t.shape[1:] or base.stride()[1:] != t.stride()[1:] or base.stride(0) == 0:
        return None
    offset = t.storage_offset() - base.storage_offset()
    if offset % base.stride(0) or t.stride(0) % base.stride(0):
        return None
    start, step = offset // base.stride(0), t.stride(0) // base.stride(0)
    rows = torch.arange(t.shape[0], device=t.device) * step + start
    return rows if rows.numel() == 0 or (int(rows.min()) >= 0 and int(rows.max()) < batch) else None


def _selected_rows(node: Any, device: torch.device) -> tuple[Tensor, int, Any] | None:
    """(rows, size of the tensor they are taken from, its node) of a dim-0 row, slice or index node."""
    name = type(node).__name__
    if name == "UnsqueezeBackward0" and node._saved_dim == 0:
        inner = node.next_functions[0][0]
        if type(inner).__name__ != "SelectBackward0" or inner._saved_dim != 0:
            return None
        size = inner._saved_self_sym_sizes[0]
        rows = torch.tensor([_signed(inner._saved_index) % size], device=device)
        return rows, size, inner.next_functions[0][0]
    if name == "SliceBackward0" and node._saved_dim == 0:
        size = node._saved_self_sym_sizes[0]
        start, end, step = _signed(node._saved_start), _signed(node._saved_end), node._saved_step
        return torch.arange(size, device=device)[slice(start, end, step)], size, node.next_functions[0][0]
    if name == "IndexBackward0":
        indices = node._saved_indices
        if len(indices) != 1 or indices[0] is None:
            return None
        size = node._saved_self_sym_sizes[0]
        index = indices[0].to(device)
        rows = index.nonzero().squeeze(1) if index.dtype == torch.bool else index.reshape(-1) % size
        return rows, size, node.next_functions[0][0]
    return None


def rows_of(t: Tensor, batch: int, batched: set[Any]) -> Tensor | None:
    """The batch rows ``t``'s rows are, when provably so: ``t`` is a dim-0 slice, row or index of a tensor
    that is a layer output over the whole batch (through element-wise activations only), or a row slice
    of a batch-sized tensor with no history (the batch itself). None when it cannot be shown."""
    node: Any = t.grad_fn  # autograd nodes expose their saved arguments as untyped attributes
    while node is not None and _row_wise_input(node) is not None:  # element-wise ops after the selection
        node = _row_wise_input(node)
    if node is None:
        return _view_rows(t, batch)
    selected = _selected_rows(node, t.device)
    if selected is None:
        return None
    rows, size, source = selected
    if size != batch:
        return None
    while (
        source is not None and source not in batched
    ):  # element-wise ops between the batch and the selection
        source = _row_wise_input(source)
    return None if source is None else rows


def to_batch(value: Any, rows: RowMap) -> Any:
    """A call's tensor on its rows, placed at its batch rows of a zero tensor over the whole batch."""
    if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != rows.rows.numel():
        return value
    out = value.new_zeros((rows.batch, *value.shape[1:]))
    out[rows.rows.to(value.device)] = value
    return out


def reordered_rows(node: Any, batch: int, batched: set[Any]) -> Tensor | None:
    """The net reordering of the batch's rows at autograd ``node`` since the layer outputs over the batch it
    derives from (or the data): every permutation of the batch met on the way back (``h[perm]``,
    ``index_select``; on dimension 1 too, a sequence-first batch's), composed, so that a reordering undone
    later (``pack_padded_sequence`` sorts, ``pad_packed_sequence`` restores) cancels. None: the identity."""
    rows: Tensor | None = None
    seen: set[Any] = set()
    todo = [node]
    while todo and len(seen) < ORDER_WALK_LIMIT:
        current = todo.pop(0)
        if current in seen or current in batched:
            continue
        seen.add(current)
        found = _reordering(current, batch)
        if found is not None:  # the walk goes from the last reordering applied to the first
            rows = found if rows is None else found.to(rows.device)[rows]
        todo.extend(n for n, _ in current.next_functions if n is not None)
    if rows is None or torch.equal(rows, torch.arange(batch, device=rows.device)):
        return None
    return rows


def _reordering(node: Any, batch: int) -> Tensor | None:
    """The index of an index or index_select node that permutes dimension 0 or 1 of size ``batch`` (not
    the identity), else None."""
    name = type(node).__name__
    if name == "IndexBackward0":
        indices = [(d, i) for d, i in enumerate(node._saved_indices) if i is not None]
        if len(indices) != 1 or indices[0][1].dtype == torch.bool:
            return None
        dim, index = indices[0]
    elif name == "IndexSelectBackward0":
        index, dim = node._saved_index, node._saved_dim
    else:
        return None
    sizes = node._saved_self_sym_sizes
    if dim > 1 or dim >= len(sizes) or sizes[dim] != batch or index.numel() != batch:
        return None
    rows = index.reshape(-1) % batch
    order = torch.arange(batch, device=rows.device)
    if torch.equal(rows, order) or not torch.equal(rows.sort().values, order):
        return None
    return rows
