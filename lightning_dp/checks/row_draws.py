"""The same random numbers for the same row, in two dry passes over batches of different sizes.

The mixing check compares the user's step on a batch (pass A, which draws exactly what the real step will)
and on the batch with one unit (a user, an example) removed (pass B). When the step draws random numbers
(dropout, noise augmentation), every kept row must get the same draws in both passes, or the comparison
measures the randomness instead of a dependence between units. Drawing again does not give that: a dropout
mask over R − 1 rows is not the first R − 1 rows of the mask over R (the vectorised normal sampler
recomputes a tensor's last values, the bernoulli kernel depends on the CPU, a second draw starts at
another offset).

:class:`RowDraws` records pass A's draws and replays them in pass B, row by row. Each call of a torch
random function (:data:`RANDOM_FUNCTIONS`) is recorded with what it drew: the output of a function whose
values do not depend on its inputs' values (``rand``, ``randn_like``, the in-place fills, ...), the scaled
mask of a dropout (drawn as the dropout of ones, the same draw the dropout itself makes), or, for any other
random function, the generator state it drew from. Pass B gets the recorded values, each kept row its own
row's (``row_map``: the pass A row of each pass B row), and the global generators are left where pass A left
them after each call. Draws this cannot give row by row are reported, never guessed: pass A drawing from
the global generators outside these functions (a recurrent layer's built-in dropout) or pass B calling them
otherwise makes :attr:`aligned` false, and the check then replaces units instead of removing one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode


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

Kind = Literal["mask", "fill", "other"]


@dataclass
class Draw:
    """One random call of pass A: the function, what it drew (a mask or values; None: only its generator
    state is kept), and the global generators' states before and after it."""

    func: Callable[..., Any]
    kind: Kind
    values: Tensor | None
    before: tuple[Tensor, list[Tensor]]
    after: tuple[Tensor, list[Tensor]]


@dataclass
class DrawLog:
    """Pass A's random calls, in order."""

    draws: list[Draw] = field(default_factory=list)


class RowDraws(TorchFunctionMode):
    """While active, pass A's random calls are recorded (``log`` None), or replayed row by row (``log``: pass
    A's; ``row_map``: the pass A row of each row of this pass, None when it has pass A's rows)."""

    def __init__(
        self,
        rows: int,
        log: DrawLog | None = None,
        row_map: list[int] | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.rows = rows
        self.replaying = log is not None
        self.log = log if log is not None else DrawLog()
        self.aligned = True
        """Recording: every draw went through a known random function. Replaying: every call matched."""
        self.cuda = device is not None and device.type == "cuda" and torch.cuda.is_available()
        self._map = None if row_map is None else torch.tensor(row_map, dtype=torch.long)
        self._small = rows if row_map is None else len(row_map)
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
        self.log.draws.append(Draw(func, kind, values, before, self._last))
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
        self._set(draw.before)
        try:
            if kind == "other" or draw.values is None:
                out = func(*args, **kwargs)  # the same generator state: the same draws where shapes agree
                if self._map is not None and _rows(out) == self._small:
                    self.aligned = False
                return out
            if kind == "mask":
                data, inplace = _mask_input(func, args, kwargs)
                mask = self._rows_of(draw.values, data.shape)
                if mask is None:
                    return func(*args, **kwargs)
                mask = mask.to(data.dtype)  # a pass in another precision (bf16) gets its own dtype's mask
                return data.mul_(mask) if inplace else data * mask
            shape, dtype = _fill_shape(func, args, kwargs)
            values = self._rows_of(draw.values, shape)
            if values is None:
                return func(*args, **kwargs)
            if getattr(func, "__name__", "").endswith("_"):
                with torch.no_grad():
                    return args[0].copy_(values)
            return values.to(dtype, copy=True)
        finally:
            self._set(draw.after)

    def _rows_of(self, values: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor | None:
        """``values`` (pass A's) for a tensor of ``shape``: as they are, or the rows of this pass's rows
        (None, and not aligned, when neither fits: the call then draws afresh)."""
        if tuple(values.shape) == tuple(shape):
            return values
        fits = values.dim() > 0 and (self.rows, self._small) == (values.shape[0], shape[0] if shape else -1)
        if self._map is not None and fits and tuple(values.shape[1:]) == tuple(shape[1:]):
            return values.index_select(0, self._map.to(values.device))
        self.aligned = False
        return None


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
        return "other" if tensors or by_input else "fill"
    return "other"


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
    if kind == "fill" and isinstance(out, Tensor):
        return out, out.detach().clone()
    return out, None


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


def _rows(value: Any) -> int | None:
    return value.shape[0] if isinstance(value, Tensor) and value.dim() else None
