"""The same random numbers for the same row, in two dry passes over batches of different sizes.

The mixing check compares the user's step on a batch (pass A, which draws exactly what the real step will)
and on the batch with one unit (a user, an example) removed (pass B). When the step draws random numbers
(dropout, noise augmentation), every kept row must get the same draws in both passes, or the comparison
measures the randomness instead of a dependence between units. Drawing again does not give that: a dropout
mask over R − 1 rows is not the first R − 1 rows of the mask over R (the vectorised normal sampler
recomputes a tensor's last values, the bernoulli kernel depends on the CPU, a second draw starts at
another offset).

:class:`RowDraws` records pass A's draws and replays them in pass B, row by row. Each call of a torch
random function (:data:`RANDOM_FUNCTIONS`) is recorded with what it drew (its output; for a dropout, its
scaled mask, drawn as the dropout of ones, the same draw the dropout itself makes) and the generator state
it drew from. Pass B gets the recorded values of a fill (a function whose values depend on no input's values:
``rand``, ``randn_like``, the in-place fills, ...) or a mask, each kept row its own row's (``row_map``: the
pass A row of each pass B row); an elementwise draw of a tensor law (``bernoulli(p)``, ``normal(mean, std)``,
``poisson(rates)``) is made again from pass A's state, the replaced rows from their own law, and its kept
rows given pass A's values; any other is made again from pass A's state. The global generators are left
where pass A left them after each call. Draws this cannot give row by row are reported, never guessed: pass
A drawing from the global generators outside these functions (a recurrent layer's built-in dropout), pass B
calling them otherwise, or a draw made again over fewer rows that does not come out as pass A's, makes
:attr:`aligned` false, and the check then replaces units instead of removing one.

A replayed value carries pass A's law: a dropout's ``p``, a fill's mean, std or bounds
(``normal_(0, float(x.std()))``, ``randint(0, len(x), ...)``), a bernoulli's probabilities. So each draw's
law is recorded too (:func:`_law`: the arguments that set what it draws, not its sizes nor the tensor it
fills or transforms), and pass B's is compared with it while every draw before it was pass A's: a scalar law
exactly (a constant is the same), a tensor law on every kept row up to rounding. A call whose law differs is
named in :attr:`RowDraws.moved`, and the check refuses it: that law is computed from the batch (a statistic
of it, or its size), and replaying pass A's values would hide how the kept rows depend on the others. A
permutation of the batch's rows (``randperm`` of its size) is replayed as pass A's order of the kept rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode, resolve_name


def _functions(owner: Any, names: str) -> frozenset[Callable[..., Any]]:
    return frozenset(getattr(owner, name) for name in names.split() if hasattr(owner, name))


_MASKS = _functions(F, "dropout dropout1d dropout2d dropout3d") | _functions(torch, "dropout feature_dropout")
"""Random functions that multiply their input by a random mask (scaled): the mask is what is drawn."""
_FILLS = _functions(
    torch, "rand randn randint rand_like randn_like randint_like randperm normal"
) | _functions(Tensor, "uniform_ normal_ random_ exponential_ geometric_ cauchy_ log_normal_ bernoulli_")
"""Random functions whose values depend on no input's values (sizes and scalars only)."""
_OTHERS = (
    _functions(
        torch, "bernoulli poisson multinomial alpha_dropout feature_alpha_dropout native_dropout rrelu rrelu_"
    )
    | _functions(F, "alpha_dropout feature_alpha_dropout rrelu gumbel_softmax")
    | _functions(Tensor, "bernoulli multinomial")
)
RANDOM_FUNCTIONS: frozenset[Callable[..., Any]] = _MASKS | _FILLS | _OTHERS
"""The torch functions that draw random numbers, as a ``TorchFunctionMode`` sees them."""
_LAWS = _functions(torch, "bernoulli normal poisson") | _functions(Tensor, "bernoulli bernoulli_")
"""Elementwise draws whose law may be given by tensors (probabilities, means, stds, rates): each output
entry is drawn from the law's entry at its place, so a row's draws follow that row's law."""
_DATA_FIRST = _functions(
    torch, "alpha_dropout feature_alpha_dropout native_dropout rrelu rrelu_"
) | _functions(F, "alpha_dropout feature_alpha_dropout rrelu gumbel_softmax")
"""Random functions whose first argument is the data they transform, not their law."""

Kind = Literal["mask", "fill", "law", "other"]


@dataclass
class Draw:
    """One random call of pass A: the function, what it drew (a mask or values; None: only its generator
    state is kept), and the global generators' states before and after it."""

    func: Callable[..., Any]
    kind: Kind
    values: Tensor | None
    before: tuple[Tensor, list[Tensor]]
    after: tuple[Tensor, list[Tensor]]
    law: tuple[Any, ...] = ()
    """The arguments that set what it draws (:func:`_law`)."""


@dataclass
class DrawLog:
    """Pass A's random calls, in order."""

    draws: list[Draw] = field(default_factory=list)


class RowDraws(TorchFunctionMode):
    """While active, pass A's random calls are recorded (``log`` None), or replayed row by row (``log``: pass
    A's; ``row_map``: the pass A row of each row of this pass, None when it has pass A's rows; ``kept``: this
    pass's rows that are pass A's, not replaced, None for all; ``rounding``: the passes' relative rounding,
    within which a tensor law counts as the same)."""

    def __init__(
        self,
        rows: int,
        log: DrawLog | None = None,
        row_map: list[int] | None = None,
        device: torch.device | None = None,
        rounding: float = 2.0**-13,
        kept: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.rows = rows
        self.rounding = rounding
        """How much a tensor law's entry may differ, relatively, between the passes (their rounding)."""
        self.replaying = log is not None
        self.log = log if log is not None else DrawLog()
        self.aligned = True
        """Recording: every draw went through a known random function. Replaying: every call matched."""
        self.moved: list[str] = []
        """Replaying: the random functions called with another law than in pass A (by name, once each)."""
        self.cuda = device is not None and device.type == "cuda" and torch.cuda.is_available()
        self._map = None if row_map is None else torch.tensor(row_map, dtype=torch.long)
        self._small = rows if row_map is None else len(row_map)
        self._kept = torch.arange(self._small) if kept is None else torch.tensor(kept, dtype=torch.long)
        """This pass's rows whose law must be pass A's (the others were replaced)."""
        self._index = 0
        self._last: tuple[Tensor, list[Tensor]] | None = None

    @property
    def drew(self) -> bool:
        """Whether pass A drew random numbers at all (through these functions or not)."""
        return bool(self.log.draws) or not self.aligned

    def _state(self) -> tuple[Tensor, list[Tensor]]:
        return torch.get_rng_state(), torch.cuda.get_rng_state_all() if self.cuda else []

    def _set(self, state: tuple[Tensor, list[Tensor]]) -> None:
        torch.set_rng_state(state[0])
        if self.cuda:
            torch.cuda.set_rng_state_all(state[1])

    def _moved(self) -> bool:
        """Whether the global generators moved since the last draw this mode made (or saw)."""
        assert self._last is not None
        cpu, cuda = self._state()
        return not (torch.equal(cpu, self._last[0]) and all(map(torch.equal, cuda, self._last[1])))

    def __enter__(self) -> RowDraws:
        super().__enter__()
        self._last = self._state()
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.replaying and self._moved():
            self.aligned = False  # an operation it does not know drew from the global generators
        if self.replaying and self._index != len(self.log.draws):
            self.aligned = False
        super().__exit__(*exc)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func not in RANDOM_FUNCTIONS or (func in _MASKS and not _training(func, args, kwargs)):
            return func(*args, **kwargs)
        kind = _kind(func, args, kwargs)
        if self.replaying:
            return self._replay(func, kind, args, kwargs)
        if self._moved():
            self.aligned = False
        before = self._state()
        out, values = _draw(func, kind, args, kwargs)
        self._last = self._state()
        self.log.draws.append(Draw(func, kind, values, before, self._last, _law(func, kind, args, kwargs)))
        return out

    def _replay(
        self, func: Callable[..., Any], kind: Kind, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Pass A's draw of this call, each row its own row's; the generators left as pass A left them."""
        draws = self.log.draws
        draw = draws[self._index] if self._index < len(draws) else None
        self._index += 1
        if draw is None or draw.func is not func or draw.kind != kind:
            self.aligned = False
            return func(*args, **kwargs)
        if self.aligned and self._law_moved(draw, _law(func, kind, args, kwargs)):
            name = resolve_name(func) or getattr(func, "__name__", repr(func))
            self.moved += [name] if name not in self.moved else []
        self._set(draw.before)
        try:
            if kind == "mask" and draw.values is not None:
                data, inplace = _mask_input(func, args, kwargs)
                mask = self._rows_of(draw.values, data.shape)
                if mask is None:
                    return func(*args, **kwargs)
                mask = mask.to(data.dtype)  # a pass in another precision (bf16) gets its own dtype's mask
                return data.mul_(mask) if inplace else data * mask
            if kind == "fill" and draw.values is not None:
                return self._fill(func, draw.values, args, kwargs)
            out = func(*args, **kwargs)  # the same generator state: the same draws where shapes agree
            if kind == "law" and draw.values is not None and self._batched(draw.values, out):
                return self._kept_values(out, draw.values, getattr(func, "__name__", "").endswith("_"))
            if self._map is not None and not _same_values(out, draw.values):
                self.aligned = False  # drawn again over other rows: not pass A's draws, row by row
            return out
        finally:
            self._set(draw.after)

    def _law_moved(self, draw: Draw, law: tuple[Any, ...]) -> bool:
        """Whether this call's law differs from pass A's: a scalar exactly (NaN is NaN), a tensor on the
        kept rows beyond rounding."""
        if len(draw.law) != len(law):
            return True
        for a, b in zip(draw.law, law, strict=True):
            if isinstance(a, Tensor) and isinstance(b, Tensor):
                if not self._close_rows(a, b):
                    return True
            elif isinstance(a, Tensor) or isinstance(b, Tensor) or not (a == b or (a != a and b != b)):
                return True
        return False

    def _close_rows(self, a: Tensor, b: Tensor) -> bool:
        """Whether ``b`` (this pass's) holds ``a``'s (pass A's) values on the kept rows, up to rounding: within
        ``rounding`` of the larger entry or of its row's largest (a near-zero entry rounds like the sums it
        comes from). A tensor whose shapes tell no rows apart is compared whole; shapes that tell neither are
        not compared (the call is then drawn again, unaligned)."""
        batched = self._batched(a, b)
        if not batched and a.shape != b.shape:
            return True
        b = b.detach().to(a.device)
        if batched:
            mine, theirs = self._kept_rows(a.device)
            a, b = a.index_select(0, theirs), b.index_select(0, mine)
        if not a.is_floating_point():
            return torch.equal(a, b.to(a.dtype))
        rows = a.shape[0] if a.dim() else 1
        x, y = a.double().reshape(rows, -1), b.double().reshape(rows, -1)
        scale = torch.maximum(x.abs(), y.abs()).nan_to_num(0.0, 0.0, 0.0)
        scale = torch.maximum(scale, scale.amax(1, keepdim=True)) if scale.numel() else scale
        near = ((x - y).abs() <= self.rounding * scale) | (x == y) | (x.isnan() & y.isnan())
        return bool(near.all())

    def _batched(self, recorded: Tensor, now: Any) -> bool:
        """Whether ``recorded`` (pass A's) and ``now`` (this pass's) have the batch's rows on dimension 0."""
        return (
            isinstance(now, Tensor)
            and recorded.dim() > 0
            and now.dim() > 0
            and (recorded.shape[0], now.shape[0]) == (self.rows, self._small)
            and recorded.shape[1:] == now.shape[1:]
        )

    def _kept_rows(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """The kept rows: in this pass, and in pass A."""
        mine = self._kept.to(device)
        return mine, mine if self._map is None else self._map.to(device).index_select(0, mine)

    def _kept_values(self, out: Tensor, recorded: Tensor, inplace: bool) -> Tensor:
        """An elementwise draw made again (the replaced rows drawn from their own law) with pass A's values
        on the kept rows, whose law is pass A's (compared before). Its graph is kept: these draws have zero
        derivatives (torch's), so nothing flows through the values swapped in."""
        mine, theirs = self._kept_rows(out.device)
        merged = out.detach().index_copy(
            0, mine, recorded.to(out.device).index_select(0, theirs).to(out.dtype)
        )
        if inplace:
            out.data.copy_(merged)  # the in-place draw's output is the user's tensor
            return out
        return out + (merged - out).detach() if out.requires_grad else merged

    def _fill(
        self, func: Callable[..., Any], recorded: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Tensor:
        """A fill's pass A values for this call (a permutation of the batch's rows: pass A's order of the
        kept rows); drawn afresh, and not aligned, where they do not fit."""
        shape, dtype = _fill_shape(func, args, kwargs)
        if (
            func is torch.randperm
            and self._map is not None
            and self._batched(recorded, torch.empty(shape, device="meta"))
        ):
            return _kept_order(recorded, self._map)
        values = self._rows_of(recorded, shape)
        if values is None:
            return func(*args, **kwargs)
        if getattr(func, "__name__", "").endswith("_"):
            with torch.no_grad():
                return args[0].copy_(values)
        return values.to(dtype, copy=True)  # a pass in another precision gets its own dtype

    def _rows_of(self, values: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor | None:
        """``values`` (pass A's) for a tensor of ``shape``: as they are, or the rows of this pass's rows
        (None, and not aligned, when neither fits: the call then draws afresh). With a row map, a tensor of
        the batch's rows takes its rows' values also when this pass has as many rows as pass A (the same rows
        in another order)."""
        fits = values.dim() > 0 and (self.rows, self._small) == (values.shape[0], shape[0] if shape else -1)
        if self._map is not None and fits and tuple(values.shape[1:]) == tuple(shape[1:]):
            return values.index_select(0, self._map.to(values.device))
        if tuple(values.shape) == tuple(shape):
            return values
        self.aligned = False
        return None


def _kept_order(permutation: Tensor, row_map: Tensor) -> Tensor:
    """Pass A's permutation of its rows, restricted to the kept rows (numbered as in pass B): the order
    pass A put them in, which is a uniform permutation of the kept rows as a fresh draw would be."""
    position = torch.empty_like(permutation)
    position[permutation] = torch.arange(len(permutation), dtype=permutation.dtype, device=permutation.device)
    return position.index_select(0, row_map.to(permutation.device)).argsort().to(permutation.dtype)


_SIZED = _functions(torch, "rand randn randperm")
"""Fills whose positional arguments are all sizes."""
_BOOKKEEPING = frozenset(
    {"size", "generator", "out", "dtype", "layout", "device", "pin_memory", "requires_grad", "memory_format"}
)
"""Keyword arguments that say where and in what a draw is made, not what it draws."""


def _law(
    func: Callable[..., Any], kind: Kind, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    """The arguments that set what a call draws: a dropout's ``p``; a fill's means, stds, probabilities and
    bounds; an elementwise draw's tensors of them too (copied). Not sizes, nor the tensor a call fills,
    transforms or reads the shape of, nor where the draw is made."""
    if kind == "mask":
        return (_plain(kwargs.get("p", args[1] if len(args) > 1 else 0.5)),)
    first = bool(args) and isinstance(args[0], Tensor)
    skip = func in _SIZED or (first and _reads_first(func, kind, args, kwargs))
    positional = () if func in _SIZED else args[1:] if skip else args
    named = [kwargs[k] for k in sorted(kwargs) if k not in _BOOKKEEPING and not (skip and k == "input")]
    law: list[Any] = []
    for value in (*positional, *named):
        value = _plain(value)
        if isinstance(value, Tensor):
            if kind == "law":
                law.append(value.detach().clone())
        elif not isinstance(value, tuple | list | torch.Size):
            law.append(value)
    return tuple(law)


def _reads_first(func: Callable[..., Any], kind: Kind, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call's first tensor is what it fills, transforms or takes the shape of, not its law."""
    inplace = getattr(func, "__name__", "").endswith("_")
    return kind == "fill" or inplace or func in _DATA_FIRST or _scalar_law(func, args, kwargs)


def _scalar_law(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``bernoulli(x, p)`` with a number ``p``: ``x`` gives only the shape."""
    p = kwargs.get("p", args[1] if len(args) > 1 else None)
    return func in (torch.bernoulli, Tensor.bernoulli) and p is not None and not isinstance(p, Tensor)


def _plain(value: Any) -> Any:
    """A law's argument as a plain value (a zero-dimensional tensor as its number)."""
    if isinstance(value, Tensor) and value.numel() == 1 and value.dim() == 0:
        return value.detach().item()
    return value


def _kind(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Kind:
    if func in _MASKS:
        return "mask"
    if func in _FILLS:
        tensors = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, Tensor)]
        first = args[0] if args else None
        by_input = (
            isinstance(first, Tensor)
            and func not in _LIKE
            and not getattr(func, "__name__", "").endswith("_")
        )
        if not (tensors or by_input):
            return "fill"
    return "law" if func in _LAWS else "other"


_LIKE = _functions(torch, "rand_like randn_like randint_like")
"""Fills that read only the shape of their tensor argument."""


def _draw(
    func: Callable[..., Any], kind: Kind, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Tensor | None]:
    """Run a random call of pass A as the real step would, and what to replay of it."""
    if kind == "mask":
        data, inplace = _mask_input(func, args, kwargs)
        ones_args, ones_kwargs = _with_input(func, args, kwargs, torch.ones_like(data))
        mask = func(*ones_args, **ones_kwargs)  # the dropout's own draw, on ones: its scaled mask
        return (data.mul_(mask) if inplace else data * mask), mask.detach()
    out = func(*args, **kwargs)
    return out, out.detach().clone() if isinstance(out, Tensor) else None


def _mask_input(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Tensor, bool]:
    """A dropout's input and whether it is applied in place (``F.dropout(x, p, training, inplace)``)."""
    data = args[0] if args else kwargs["input"]
    inplace = bool(kwargs.get("inplace", args[3] if len(args) > 3 and func in _INPLACE_FOURTH else False))
    return data, inplace


_INPLACE_FOURTH = _functions(F, "dropout dropout1d dropout2d dropout3d")


def _training(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a dropout call drops (``training``/``train``: its third argument, True by default in ``F``)."""
    flag = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else func in _INPLACE_FOURTH))
    return bool(flag)


def _with_input(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], data: Tensor
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with ``data`` as its input, out of place."""
    kwargs = {**kwargs, "inplace": False} if "inplace" in kwargs else dict(kwargs)
    if args:
        rest = list(args[1:])
        if func in _INPLACE_FOURTH and len(rest) > 2:
            rest[2] = False
        return (data, *rest), kwargs
    return (), {**kwargs, "input": data}


def _fill_shape(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Size, torch.dtype]:
    """The shape and dtype a fill's output has in this pass (found without drawing: on the meta device), so
    that a pass in another precision (a bf16 default dtype) gets values of its own dtype."""
    if args and isinstance(args[0], Tensor):
        return args[0].shape, kwargs.get("dtype") or args[0].dtype
    meta = {**kwargs, "device": "meta"}
    meta.pop("generator", None)
    meta.pop("out", None)
    out = func(*args, **meta)
    return out.shape, out.dtype


def _same_values(value: Any, recorded: Tensor | None) -> bool:
    """Whether a call drawn again gave pass A's tensor (same shape, same values)."""
    return (
        isinstance(value, Tensor)
        and recorded is not None
        and value.shape == recorded.shape
        and bool(
            ((value == recorded.to(value.device)) | (value.isnan() & recorded.to(value.device).isnan())).all()
        )
    )
