"""Layers whose per-example gradients are recomputed one example at a time, and expanded containers.

A layer with no per-layer formula (``functorch``) and the parameters a container holds directly
(``direct``) keep every input of the call and tap every output tensor; in the backward the layer is re-run
per example (``vmap``, else a loop of plain autograd) and each example's output gradient is pulled back to
its parameters. A container whose own parameters have a leading dimension of 1 (ViT's ``cls_token``) first
runs them as per-example views (``broadcast``): when every use lines up with the batch their gradients are
each example's own, and the call is recomputed only when one does not. The recomputation must leave no
trace: random draws are replayed from the forward's state, buffers put back, a written one refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from lightning_dp.core.errors import DPConfigurationError, quote_error
from lightning_dp.per_example import broadcast, vmap
from lightning_dp.per_example.materialized import direct_params
from lightning_dp.per_example.precision import ieee_fp32
from lightning_dp.per_example.reparametrized import reparametrized
from lightning_dp.per_example.row_labels import to_examples
from lightning_dp.per_example.rows import RowMap, RowProvenance

Buffers = list[tuple[nn.Module, str, Tensor, Tensor]]
"""Buffers saved before a recomputation, as (owner, name, object, values)."""


class RecomputeHost(Protocol):
    """What the recomputed paths read of their :class:`~lightning_dp.per_example.capture.GradientCapture`."""

    rows: RowProvenance
    ignoring: bool
    enabled: bool

    def active(self, module: nn.Module) -> bool: ...

    def own(self, module: nn.Module) -> list[nn.Parameter]: ...

    def count_uses(self, params: Iterable[nn.Parameter]) -> None: ...

    def name_of(self, param: nn.Parameter, default: str = "?") -> str: ...

    def layer_name(self, module: nn.Module) -> str: ...

    def scale(self, batch: int) -> float: ...

    def add_per_example(self, samples: dict[nn.Parameter, Tensor], batch: int) -> None: ...


class _Tap(torch.autograd.Function):
    """Identity on a layer's output tensors whose backward hands all their gradients to ``callback`` at
    once (a layer with several outputs needs every one of them). The outputs are copied: marking them
    dirty would break the layer's own backward where it saved them (tanh, sigmoid)."""

    @staticmethod
    def forward(
        ctx: Any, callback: Callable[[tuple[Tensor, ...]], None], *outputs: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.callback = callback
        return tuple(o.clone() for o in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        ctx.callback(grads)
        return (None, *grads)


@dataclass(frozen=True)
class _Saved:
    """A recomputed call as its forward left it: every input, the outputs tapped, the random state it drew
    from, and the batch rows its rows are (None: the batch in order)."""

    module: nn.Module
    inputs: tuple[list[Any], dict[str, Any]]
    positions: list[int]
    random_state: vmap.RandomState | None
    rows: RowMap | None


class Recompute:
    """The hooks of the recomputed and expanded layers of one capture, and what a forward left for them."""

    def __init__(self, host: RecomputeHost) -> None:
        self.host = host
        self.expanded: dict[nn.Module, tuple[dict[str, nn.Parameter], broadcast.ExpandedCall]] = {}
        """The parameters each running expanded container had before :meth:`expand`, and its call."""
        self.random_states: dict[nn.Module, list[vmap.RandomState]] = {}
        self.misaligned: dict[nn.Module, list[str]] = {}
        """The last uses of each container's expanded parameters that did not line up with the batch."""

    def hook(self, module: nn.Module, expands: bool) -> list[RemovableHandle]:
        """The hooks of a recomputed layer (``expands``: a container of [1, ...] parameters, first expanded)."""
        handles = [module.register_forward_pre_hook(self.note_random_state)]
        if not expands:
            return [*handles, module.register_forward_hook(self.capture_call, with_kwargs=True)]
        return [
            *handles,
            module.register_forward_pre_hook(self.expand, with_kwargs=True),
            module.register_forward_hook(self.capture_expanded, with_kwargs=True),
            module.register_forward_hook(self.restore, always_call=True),
        ]

    def note_random_state(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """A recomputed layer's forward may draw random numbers (dropout): keep the state it starts from."""
        del args
        if self.host.active(module):
            device = next((p.device for p in self.host.own(module)), torch.device("cpu"))
            self.random_states.setdefault(module, []).append(vmap.random_state(device))

    def capture_call(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """Layers recomputed per example: keep every input (keyword ones too) and tap every output tensor."""
        host = self.host
        states = self.random_states.get(module)
        random_state = states.pop() if states else None
        if not host.active(module):
            return None
        args, kwargs = broadcast.unwrap((args, kwargs))
        taps = vmap.output_tensors(output)
        if not taps:
            return None
        first = next((x for x in tree_flatten((args, kwargs))[0] if isinstance(x, Tensor)), None)
        host.rows.note_batch(first)
        host.rows.check_order(module, first)
        host.count_uses(host.own(module))
        rows = host.rows.traced_rows(first)
        detach = lambda x: x.detach() if isinstance(x, Tensor) else x  # noqa: E731
        inputs = ([detach(a) for a in args], {k: detach(v) for k, v in kwargs.items()})
        positions = [i for i, _ in taps]
        saved = _Saved(module, inputs, positions, random_state, rows)

        def on_grads(grads: tuple[Tensor, ...]) -> None:
            if not host.ignoring:
                self.recomputed(saved, grads)

        if isinstance(output, Tensor):  # one output: a hook on it, no copy
            output.register_hook(lambda grad: on_grads((grad,)))
            host.rows.note_output(output, rows)
            return output
        flat, spec = tree_flatten(output)
        for i, tapped in zip(positions, _Tap.apply(on_grads, *(t for _, t in taps)), strict=True):
            flat[i] = tapped
            host.rows.note_output(tapped, rows)
        return tree_unflatten(flat, spec)

    def recomputed(self, saved: _Saved, grads: tuple[Tensor, ...]) -> None:
        """The backward of a recomputed call: its per-example gradients, summed into the capture's."""
        module, rows = saved.module, saved.rows
        batch = grads[0].shape[0] if rows is None else rows.batch
        scaled = [g * self.host.scale(batch) for g in grads]
        self.host.enabled = False  # the recomputation must not reach the hooks of the layer or its children
        # A weight computed from other parameters is recomputed in eval mode: its function (a spectral
        # norm's power iteration) must not step again; it gives the weight the forward used.
        modes = [(m, m.training) for m in module.modules()] if reparametrized(module) else []
        for m, _ in modes:
            m.training = False
        buffers = [
            (owner, name, b, b.detach().clone())
            for owner in module.modules()
            for name, b in owner._buffers.items()
            if b is not None
        ]
        try:
            samples = self._per_example(saved, scaled, buffers)
        finally:
            self.host.enabled = True
            for m, mode in modes:
                m.training = mode
            _put_back(buffers)
        if rows is not None:
            samples = {p: to_examples(g, rows.rows, batch) for p, g in samples.items()}
        self.host.add_per_example(samples, batch)

    def _per_example(
        self, saved: _Saved, scaled: list[Tensor], buffers: Buffers
    ) -> dict[nn.Parameter, Tensor]:
        """``vmap`` of the layer, else the loop (:meth:`_looped`); a layer that writes its buffers is refused."""
        module = saved.module
        call = vmap.RecomputedCall(
            module, dict(direct_params(module)), saved.inputs, saved.positions, scaled, saved.random_state
        )
        try:
            with ieee_fp32():
                try:
                    return vmap.per_example_grads(call)
                except RuntimeError as error:
                    if _written_buffers(buffers) or _written_in_recompute(error, buffers):
                        raise
                    return self._looped(call, error)
        except RuntimeError as error:
            written = _written_buffers(buffers) or _written_in_recompute(error, buffers)
            if not written:
                raise
            raise DPConfigurationError(
                f"{type(module).__name__} writes its buffers {written} in its forward, and its per-example "
                "gradients are recomputed one example at a time, which cannot replay that write (a running "
                "statistic of the batch also mixes examples and is saved with the model without noise). Keep "
                "the buffers constant in the forward, or compute the layer from its parameters only."
            ) from error

    def _looped(self, call: vmap.RecomputedCall, error: RuntimeError) -> dict[nn.Parameter, Tensor]:
        """A forward functorch cannot run one example at a time (a packed sequence's lengths, data-dependent
        shapes): run once on the batch and pulled back per example with plain autograd (exact), else refused."""
        module, params = call.module, call.params
        try:
            return vmap.looped_per_example_grads(call)
        except RuntimeError as looped:
            name = self.host.layer_name(module)
            owned = [self.host.name_of(p, n) for n, p in params.items()]
            uses = self.misaligned.get(module, [])
            why = f" (uses not in line with the batch: {uses[:3]})" if uses else ""
            raise DPConfigurationError(
                f"The per-example gradients of the parameters {owned}, held by {name!r} "
                f"({type(module).__name__}) itself{why}, need its forward recomputed per example, which "
                f"failed ({quote_error(error)}; with plain autograd: {quote_error(looped)}). Hold each such "
                "parameter in a small nn.Module of its own that applies it to the tensor it meets "
                "(return x + self.offset): that layer alone is recomputed per example, exactly; or, for a "
                "parameter of leading dimension 1, give it the rank of that tensor (shape (1, 1) for a "
                "(B, 1) output) so that it lines up with the batch."
            ) from looped

    def expand(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A container's own [1, ...] parameters become per-example [B, ...] views for its forward
        (``broadcast``): each use is checked to line up with the batch."""
        host = self.host
        if not host.active(module):
            return
        first = next((x for x in tree_flatten((args, kwargs))[0] if isinstance(x, Tensor)), None)
        host.rows.note_batch(broadcast.unwrap(first))
        call = broadcast.ExpandedCall(host.rows.hint or 1)
        saved = {}
        for name, p in direct_params(module):
            view = broadcast.per_example_view(p, call, host.name_of(p, name))
            with torch._C.DisableTorchFunctionSubclass():
                view.register_hook(functools.partial(self.expanded_grad, p, call))
            module._parameters[name] = view  # type: ignore[assignment]
            saved[name] = p
        self.expanded[module] = (saved, call)

    def capture_expanded(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """After the forward: a call whose expanded parameters were all used in line with the batch keeps
        their views' gradients; one with another use is recomputed per example (exact for every use)."""
        entry = self.expanded.get(module)
        if entry is not None and entry[1].misaligned:
            self.misaligned[module] = entry[1].misaligned
            return self.capture_call(module, args, kwargs, output)
        states = self.random_states.get(module)
        if states:
            states.pop()
        if entry is not None:
            self.host.count_uses(entry[0].values())
        return None

    def restore(self, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        """Undo :meth:`expand` (also when the forward raised)."""
        del inputs, output
        saved, _ = self.expanded.pop(module, ({}, None))
        for name, p in saved.items():
            module._parameters[name] = p

    def expanded_grad(self, param: nn.Parameter, call: broadcast.ExpandedCall, grad: Tensor) -> None:
        """An expanded parameter's view gradient, each row one example's (unless the call is recomputed)."""
        if call.misaligned or self.host.ignoring:  # the call is recomputed per example instead
            return
        batch = grad.shape[0]
        self.host.add_per_example({param: (grad.detach() * self.host.scale(batch)).unsqueeze(1)}, batch)


def _written_buffers(buffers: Buffers) -> list[str]:
    """The buffers replaced or changed since they were saved as (owner, name, object, values)."""
    written = []
    for owner, name, original, values in buffers:
        current = owner._buffers.get(name)
        if current is not original:
            written.append(name)
            continue
        try:
            if not torch.equal(current, values):
                written.append(name)
        except RuntimeError:  # a batched value left in place by the recomputation
            written.append(name)
    return written


def _written_in_recompute(error: RuntimeError, buffers: Buffers) -> list[str]:
    """The layer's buffers, when torch.func refused the recomputation for writing a tensor the layer holds in
    place (a running mean updated under ``no_grad`` in its forward): the write itself never happened."""
    text = str(error)
    if "captured Tensor" not in text and not ("vmap" in text and "inplace" in text.lower()):
        return []
    return [name for _, name, _, _ in buffers] or ["(a tensor attribute that is not a registered buffer)"]


def _put_back(buffers: Buffers) -> None:
    """Undo what a per-example recomputation wrote into buffers (it must leave no trace)."""
    with torch.no_grad():
        for owner, name, original, values in buffers:
            owner._buffers[name] = original
            if not torch.equal(original, values):
                original.copy_(values)
