"""Per-example gradients from one ordinary backward pass, using Opacus's per-layer formulas.

A forward hook keeps each layer's input; a hook on the layer's *output tensor* receives the gradient
of that output during backward, and Opacus's registered grad sampler (or its functorch fallback for
unknown layers) turns the pair into per-example gradients. Tensor hooks, unlike module full-backward
hooks, survive in-place operations on a layer's output (torchvision's ResNet ``out += identity`` and
``ReLU(inplace=True)``), and leave ``state_dict`` keys untouched. On the fast path the same hook
computes the layer's per-example norms (``per_example.kernels``) and keeps only what the clipped sum needs.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from lightning_dp.errors import DPConfigurationError
from lightning_dp.per_example import broadcast, kernels, recurrent, vmap
from lightning_dp.per_example.batchnorm import batch_statistics_message, uses_batch_statistics
from lightning_dp.per_example.gradients import LayerCall, PerExampleGradients, Registered, tie
from lightning_dp.per_example.kernels import ecosystem
from lightning_dp.per_example.kernels.conv_autotune import ConvAutotuner
from lightning_dp.per_example.materialized import add_samples, direct_params, grad_sampler, layer_method
from lightning_dp.per_example.precision import ieee_fp32
from lightning_dp.per_example.reparametrized import is_parametrized, reparametrized
from lightning_dp.per_example.uses import UseTracer, _to_examples, time_major_message


def trainable_layers(root: nn.Module, trainable: bool = True) -> Iterator[tuple[str, nn.Module]]:
    """Every module that holds trainable parameters directly (or the parts of a swapped recurrent or
    attention layer, see ``recurrent``); each covers only its own parameters. ``trainable=False``: every
    module holding parameters, frozen ones too (any of them may be unfrozen during training)."""

    def visit(prefix: str, module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        parts = recurrent.parts_of(module)
        if parts is not None:
            for name, part in parts:
                yield f"{prefix}.{name}" if prefix else name, part
        elif direct_params(module, trainable) and not (module is root and steps_itself(root)):
            yield prefix, module
        for name, child in module.named_children():
            if name == "parametrizations" and is_parametrized(module):
                continue  # the parametrized layer owns its originals (``direct_params``)
            yield from visit(f"{prefix}.{name}" if prefix else name, child)

    yield from visit("", root)


def steps_itself(root: nn.Module) -> bool:
    """A LightningModule (it has ``training_step``): its own parameters are read in the step, not in one
    forward, so they are covered by their uses (``uses``), never by recomputing the module per example."""
    return callable(getattr(type(root), "training_step", None))


def _unique(layers: Iterator[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Each layer once, under the first name it is reached by."""
    seen: set[int] = set()
    out = []
    for name, module in layers:
        if id(module) not in seen:
            seen.add(id(module))
            out.append((name, module))
    return out


def expands_params(module: nn.Module, trainable: bool = True) -> bool:
    """A container whose own parameters all have a leading dimension of 1 (ViT's ``cls_token`` and
    ``pos_embed``): during its forward they are per-example views (``broadcast``), used where they line up
    with the batch; a call with any other use is recomputed per example instead."""
    own = direct_params(module, trainable)
    return bool(own) and all(p.dim() > 0 and p.shape[0] == 1 for _, p in own)


GradMode = Literal["auto", "fast", "materialize"]

GRAPH_WALK_LIMIT = 4096
"""Graph nodes visited at most when deciding whether a one-row layer input derives from the batch."""

ORDER_WALK_LIMIT = 256
"""Graph nodes visited at most, per layer call, back to the layer outputs it derives from, looking for
reorderings of the batch (``pad_packed_sequence`` undoes ``pack_padded_sequence``'s sort 16 nodes later)."""


class _Graft(torch.autograd.Function):
    """Identity on ``x`` that makes it require grad, with no copy: ``x`` is returned marked dirty (as
    if modified in place), so it becomes a non-leaf and in-place ops downstream stay legal."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, x: Tensor) -> Tensor:
        del anchor
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
        del ctx
        return None, grad


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


_CAPTURES: weakref.WeakKeyDictionary[nn.Module, GradientCapture] = weakref.WeakKeyDictionary()
"""The capture attached to each root module (``tracing``)."""


@contextlib.contextmanager
def tracing(module: nn.Module) -> Iterator[None]:
    """Run the block (a ``training_step``) with the uses of ``module``'s capture traced; nothing without one."""
    capture = _CAPTURES.get(module)
    if capture is None:
        yield
        return
    with capture.tracing():
        yield


class GradientCapture:
    """Hooks on every trainable layer of ``root`` that capture what per-example clipping needs.

    ``loss_reduction='mean'`` means the loss the user backpropagates is a mean over the batch, so
    each layer's output gradient is multiplied by the batch size to get per-example gradients.
    ``mode``: ``"fast"`` keeps (inputs, output gradients) for layers with a fast formula and
    materialises the rest; ``"materialize"`` materialises every layer (Opacus's formulas);
    ``"auto"`` is fast when every layer has a fast formula, else materialise. Recurrent and attention
    layers are swapped in place for exact equivalents (``recurrent``) until :meth:`remove`.
    """

    def __init__(self, root: nn.Module, loss_reduction: str = "mean", mode: GradMode = "auto") -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}.")
        if mode not in ("auto", "fast", "materialize"):
            raise ValueError(f"mode must be 'auto', 'fast' or 'materialize', got {mode!r}.")
        self.loss_reduction = loss_reduction
        self.public_scale: float | None = None
        """Set by the engine where the mixing check found the loss divided by public constants (``_scale``)."""
        self.enabled = True
        self.grad_samples: dict[nn.Parameter, Tensor] = {}
        self.records: list[LayerCall] = []
        self.batch_size: int | None = None
        self.calls: list[tuple[nn.Module, int]] = []
        """(layer, size of dim 0 of its output gradient) of every call since the last ``clear``."""
        self.conv_tuner = ConvAutotuner()
        """This capture's choice of convolution norm method per shape (timed once, kept for the run)."""
        ecosystem.register_loaded()
        self._swapped = recurrent.swap(root)
        self.root = root
        self.layers = _unique(trainable_layers(root, trainable=False))
        """Every layer holding parameters, frozen ones too: a parameter unfrozen during training
        (``BackboneFinetuning``) is covered from that step on (:meth:`refresh`). A layer registered under
        two names (``self.inp`` and ``self.net[0]``) is listed, and hooked, once, under its first name."""
        if mode == "auto":
            layers = [m for _, m in self.layers if layer_method(m) != "direct" and direct_params(m)]
            mode = "fast" if all(kernels.is_supported(m) for m in layers) else "materialize"
        self.mode = mode
        self._all: dict[nn.Module, list[nn.Parameter]] = {
            m: [p for _, p in direct_params(m, trainable=False)] for _, m in self.layers
        }
        for module, _ in self._swapped:  # their parts are called inside their forward
            self._all[module] = [p for _, p in direct_params(module, trainable=False)]
        self._own: dict[nn.Module, list[nn.Parameter]] = {}
        self.params: list[nn.Parameter] = []
        """Each trainable parameter once, tied ones included (their uses are summed per example)."""
        self._trainable: tuple[bool, ...] = ()
        self._frozen: dict[nn.Module, list[nn.Parameter]] = {}
        """Book-keeping: the parameters :meth:`_freeze` froze for the length of each layer's forward."""
        self.registered: Registered | None = None
        """Set by ``dp_fsdp``: a context in which the layers hold the full-size parameters the hooks recorded
        (outside a unit's forward and backward, FSDP2 registers its shards instead)."""
        self.skip_param_grads = False
        """Book-keeping: when True, autograd computes no weight gradients (the engine builds the
        private gradient from inputs and output gradients alone), which saves a third of the backward."""
        self._anchor: Tensor | None = None
        self._uses: Counter[nn.Parameter] = Counter()
        """How many captured layer calls use each parameter since the last ``collect`` (shared if > 1)."""
        self._batch_hint: int | None = None
        """The batch of the current forward: dimension 0 of the first captured layer's input."""
        self.shared: set[nn.Module] = set()
        """Layers whose calls take an input shared by the whole batch (``classify``)."""
        self.batched: set[nn.Module] = set()
        """Layers whose inputs scale with the batch (``classify``)."""
        self.classified = False
        """Whether ``classify`` ran (else the size rule: a one-dimensional lookup input whose length is not
        the batch is shared)."""
        self.probed = False
        """Whether the strategy tried to classify (once per capture)."""
        self._expanded: dict[nn.Module, tuple[dict[str, nn.Parameter], broadcast.ExpandedCall]] = {}
        self._random_states: dict[nn.Module, list[vmap.RandomState]] = {}
        self._handles: list[RemovableHandle] = []
        self._names = {p: name for name, p in root.named_parameters()}
        self._reached: set[nn.Parameter] = set()
        """Parameters autograd accumulated a gradient into since the last ``collect`` (first batch only)."""
        self._reach_handles: list[RemovableHandle] = []
        self._unchecked: set[nn.Parameter] = set()
        """Trainable parameters whose per-example path no batch has confirmed yet (``_check_reached``)."""
        self._froze: set[nn.Parameter] = set()
        """Parameters :meth:`_freeze` froze during their layer's forward since the last ``collect``."""
        self._outside: set[nn.Parameter] = set()
        """Of those, the ones autograd still accumulated a gradient into: used outside their layer's forward."""
        self._outside_handles: list[RemovableHandle] = []
        self._reordered: list[nn.Module] = []
        """Layers called since the last ``collect`` on the batch's rows reordered (``_reordered_rows``)."""
        self._misaligned: dict[nn.Module, list[str]] = {}
        """The last uses of each container's expanded parameters that did not line up with the batch."""
        self._batched_nodes: set[Any] = set()
        """Graph nodes of this forward's layer outputs over the whole batch (``_from_batch``)."""
        self._freezing: set[nn.Module] = set()
        """Layers whose parameters :meth:`_freeze` freezes for the length of their forward."""
        self._thawed: set[nn.Parameter] = set()
        """Parameters that some holder uses unfrozen (a recomputed layer): their gradient always accumulates."""
        self._running: Counter[nn.Module] = Counter()
        """Layers whose forward is running (a parameter read outside all its holders' forwards is traced)."""
        self._holders: dict[nn.Parameter, list[nn.Module]] = {}
        self.ignoring = False
        """True during a gradient the step takes itself (``torch.autograd.grad`` of first order): not the backward
        of the step's loss, so the hooks take nothing from it."""
        self.tracer = UseTracer(self)
        self._tracing = 0
        self._tasks: set[int] = set()
        """The backward passes (autograd graph tasks) the hooks took calls from since the last ``collect``."""
        self._partial = False
        """Whether a call since the last ``collect`` ran on traced rows that leave out some of the batch."""
        self._time_major: list[nn.Module] = []
        """Layers called since the last ``collect`` on a tensor whose batch is on dimension 1."""
        self._batchnorms: dict[nn.Module, str] = {
            m: name for name, m in root.named_modules() if isinstance(m, _BatchNorm)
        }
        self._normalised: dict[nn.Module, tuple[int, ...]] = {}
        """BatchNorm layers called since the last ``collect``, with their running statistics' versions then."""
        self._batch_statistics: list[str] = []
        """BatchNorm layers called with the batch's own statistics since the last ``collect``."""
        self.refresh()
        parts = {id(part) for module, _ in self._swapped for _, part in recurrent.parts_of(module) or []}
        for module, _ in self._swapped:
            self._hook_freeze(module)
        for _, module in self.layers:
            path = self.path_of(module)
            if path == "direct" and expands_params(module, trainable=False):
                self._handles.append(module.register_forward_pre_hook(self._note_random_state))
                self._handles.append(module.register_forward_pre_hook(self._expand, with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._capture_expanded, with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._restore, always_call=True))
                continue
            if id(module) not in parts and path not in ("direct", "functorch"):
                self._hook_freeze(module)
            if path in ("functorch", "direct"):
                self._handles.append(module.register_forward_pre_hook(self._note_random_state))
                self._handles.append(module.register_forward_hook(self._capture_call, with_kwargs=True))
            else:
                self._handles.append(module.register_forward_hook(self._capture_kwargs, with_kwargs=True))
        self._thawed = {p for m, ps in self._all.items() if m not in self._freezing for p in ps}
        for bn in self._batchnorms:
            self._handles.append(bn.register_forward_pre_hook(self._note_batchnorm))
        for name, module in root.named_modules():
            if _is_opacus_rnn(module):
                self._handles.append(
                    module.register_forward_pre_hook(functools.partial(_refuse_packed, name))
                )
        for module in {m for _, m in self.layers} | {m for m, _ in self._swapped}:
            self._handles.append(module.register_forward_pre_hook(self._enter, prepend=True))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))
        _CAPTURES[root] = self

    # -- what the tracer of uses outside the layers asks (``uses``) ----------------------------------------------
    def _enter(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        del args
        self._running[module] += 1

    def _leave(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        del args, output
        self._running[module] -= 1

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """For the length of the block (the step's forward and loss): trace parameter uses outside the layers
        and the rows of selected tensors (:class:`~lightning_dp.per_example.uses.UseTracer`)."""
        if self._tracing:
            yield
            return
        self._tracing += 1
        try:
            with self.tracer:
                yield
        finally:
            self._tracing -= 1

    def tracing_now(self) -> bool:
        return self.enabled and not self.ignoring and self.root.training and torch.is_grad_enabled()

    def used_outside(self, param: nn.Parameter) -> bool:
        """A trainable parameter read while no layer holding it runs its forward."""
        holders = self._holders.get(param)
        return holders is not None and param.requires_grad and not any(self._running[m] for m in holders)

    @property
    def batch_hint(self) -> int | None:
        return self._batch_hint

    def scale(self, batch: int) -> float:
        return self._scale(batch)

    def name_of(self, param: nn.Parameter) -> str:
        return self._names.get(param, "?")

    def add_outside(self, samples: dict[nn.Parameter, Tensor]) -> None:
        """Per-example gradients [B, *shape] of uses outside the layers (summed with every other use)."""
        add_samples(self.grad_samples, samples)
        if samples:
            self.batch_size = next(iter(samples.values())).shape[0]

    @contextlib.contextmanager
    def ignoring_backward(self) -> Iterator[None]:
        previous, self.ignoring = self.ignoring, True
        try:
            yield
        finally:
            self.ignoring = previous

    def _note_batchnorm(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """A BatchNorm call in a private step: with the batch's statistics it mixes the examples (refused at
        ``collect``); frozen in eval mode its running statistics must stay as they are."""
        del args
        if not (self.enabled and self.root.training and torch.is_grad_enabled()):
            return
        if uses_batch_statistics(module):
            self._batch_statistics.append(self._batchnorms[module])
        self._normalised.setdefault(module, _stat_versions(module))

    def _check_batchnorms(self) -> None:
        """Refuse this step when a BatchNorm used the batch's statistics or its running statistics moved."""
        names = list(dict.fromkeys(self._batch_statistics))
        names += [self._batchnorms[m] for m, v in self._normalised.items() if _stat_versions(m) != v]
        self._batch_statistics, self._normalised = [], {}
        if names:
            self.clear()
            raise DPConfigurationError(batch_statistics_message(list(dict.fromkeys(names))))

    def refresh(self) -> bool:
        """Read which parameters are trainable now (before each step); True when that changed.

        A parameter unfrozen since the last step (``BackboneFinetuning``, ``requires_grad_(True)`` by hand)
        is covered from now on, one frozen is left out; a trainable parameter no hooked layer holds is
        refused (it would be stepped with noise only, or with its raw gradient)."""
        flags = tuple(p.requires_grad for ps in self._all.values() for p in ps)
        if steps_itself(self.root):
            flags += tuple(p.requires_grad for _, p in direct_params(self.root, trainable=False))
        if flags == self._trainable:
            return False
        self._trainable = flags
        self._own = {m: [p for p in ps if p.requires_grad] for m, ps in self._all.items()}
        loose = [p for _, p in direct_params(self.root)] if steps_itself(self.root) else []
        params = list(dict.fromkeys([*loose, *(p for _, m in self.layers for p in self._own[m])]))
        self._holders = {p: [] for p in loose}
        for m, ps in self._all.items():
            for p in ps:
                self._holders.setdefault(p, []).append(m)
        _check_covered(self.root, set(params))
        if not params:
            raise DPConfigurationError(
                "No parameter is trainable: every layer is frozen (requires_grad=False), so a private step "
                "would release nothing but noise. Unfreeze at least one layer."
            )
        new = [p for p in params if p not in set(self.params)]
        self._unchecked |= set(new)
        self._reach_handles += [p.register_post_accumulate_grad_hook(self._reached.add) for p in new]
        self._outside_handles += [p.register_post_accumulate_grad_hook(self._note_outside) for p in new]
        self.params = params
        return True

    def _hook_freeze(self, module: nn.Module) -> None:
        self._freezing.add(module)
        self._handles.append(module.register_forward_pre_hook(self._freeze))
        self._handles.append(module.register_forward_hook(self._thaw, always_call=True))

    def path_of(self, module: nn.Module) -> str:
        """'fast' (norms from inputs and output gradients), 'formula', 'functorch' or 'direct' (materialised)."""
        if self.mode == "fast" and kernels.is_supported(module):
            return "fast"
        return layer_method(module)

    def _active(self, module: nn.Module) -> bool:
        """Whether a call is captured: in a training forward (the model's mode, not the layer's: a layer the
        user froze in eval mode, a BatchNorm on its running statistics, still trains its parameters)."""
        return self.enabled and self.root.training and torch.is_grad_enabled() and bool(self._own.get(module))

    keep_param_grads = False
    """Set by the strategy when user code reads ``p.grad`` after backward (an ``on_after_backward``
    override): autograd's weight gradients are then computed every step, as documented, although the
    private step never uses them; everyone else keeps the cheaper backward without them."""

    def _freeze(self, module: nn.Module, inputs: tuple[Any, ...]) -> None:
        """Book-keeping: the layer's own parameters stop requiring grad for the length of its forward."""
        if self.skip_param_grads and not self.keep_param_grads and self._active(module):
            frozen = [p for p in self._own[module] if p.requires_grad]
            for p in frozen:
                p.requires_grad_(False)
            self._frozen.setdefault(module, []).extend(frozen)
            self._froze.update(frozen)

    def _note_outside(self, param: Tensor) -> None:
        """A gradient accumulated into a parameter its layer's forward had frozen: another use reached it
        (``h @ emb.weight.T``, the loss reading it), which no per-example path covers."""
        if param in self._froze and param not in self._thawed:
            self._outside.add(param)  # type: ignore[arg-type]

    def _thaw(self, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        """Undo :meth:`_freeze` (also when the forward raised)."""
        del inputs, output
        for p in self._frozen.pop(module, []):  # exactly what _freeze froze: a user's frozen layer stays so
            p.requires_grad_(True)

    def expect_batch(self, size: int | None) -> None:
        """The next forward's batch size as the sampler drew it (None: take it from the first layer's input)."""
        self._batch_hint = size
        self._batch_statistics, self._normalised = [], {}

    def _note_batch(self, first: Any) -> None:
        """The forward's batch size, from the first captured layer's input (unless already known)."""
        if self._batch_hint is None and isinstance(first, Tensor) and first.dim() > 0:
            self._batch_hint = first.shape[0]

    def _broadcast(
        self, module: nn.Module, inputs: tuple[Any, ...], output: Tensor
    ) -> tuple[tuple[Any, ...], Tensor]:
        """A layer called on one input shared by the whole batch (GPT-2's ``wpe`` on positions [1, T],
        nanoGPT's ``wpe(arange(T))``) gets its output expanded to the batch, so its output gradient, and
        so its per-example gradient, is each example's own slice instead of their sum."""
        first = inputs[0] if inputs and isinstance(inputs[0], Tensor) else None
        self._note_batch(first)
        batch = self._batch_hint
        if batch is None or first is None or output.dim() == 0:
            return inputs, output
        if module in self.batched:  # its inputs scale with the batch: never a broadcast, whatever the size
            return inputs, output
        shared = module in self.shared
        one_row = batch > 1 and first.dim() > 0 and first.shape[0] == 1 and output.shape[0] == 1
        if one_row and self._from_batch(first, batch, shared):
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

    def _from_batch(self, first: Tensor, batch: int, shared: bool) -> bool:
        """Whether a layer input of one row derives from the batch's rows (``h[i:i+1]``, ``h.unsqueeze(0)``)
        rather than being shared by every example (positions, a learned query): its autograd graph reaches
        the output of a layer call over the batch, or it is a view of a batch-sized tensor with no
        history, or the structure probe ran and did not find the layer shared."""
        if first.grad_fn is not None and self._batched_nodes:
            seen: set[Any] = set()
            todo = [first.grad_fn]
            while todo and len(seen) < GRAPH_WALK_LIMIT:
                node = todo.pop()
                if node in self._batched_nodes:
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

    def _call_rows(self, inputs: tuple[Any, ...], output: Tensor) -> RowMap | None:
        """The batch rows of a call on fewer rows than the batch, when its first input is provably made of
        them (``_rows_of``); None for an ordinary call, or rows that cannot be traced (refused later)."""
        batch = self._batch_hint
        first = inputs[0] if inputs and isinstance(inputs[0], Tensor) else None
        if batch is None or first is None or first.dim() == 0 or output.dim() == 0:
            return None
        size = first.shape[0]
        if size == batch or output.shape[0] != size:
            return None
        base = first._base
        if base is not None and any(base is b for b in self.root.buffers()):
            return None  # rows of a model constant, not of the batch
        rows = _rows_of(first, batch, self._batched_nodes) if size < batch else None
        if rows is None or rows.numel() != size or rows.unique().numel() != size:
            # rows the tracer followed (a selection of the data, a regrouping)
            traced = self._traced_rows(first)
            if traced is None:
                return None
            rows = traced.rows
        for x in inputs[1:]:  # every other batch-sized input must be indexed the same way: not known here
            if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == size and size > 1:
                return None
        return RowMap(rows, batch)

    def _traced_rows(self, first: Any) -> RowMap | None:
        """The examples of a call's rows as the tracer followed them (None: the batch in order, or unknown)."""
        batch = self._batch_hint
        if batch is None or not isinstance(first, Tensor) or first.dim() == 0 or first.shape[0] == batch:
            return None
        rows = self.tracer.rows.get(first)
        if rows is None or rows.numel() != first.shape[0] or bool((rows < 0).any()):
            return None  # rows of no example, or reached by several, cannot be given to one example
        return RowMap(rows, batch)

    def _check_order(self, module: nn.Module, first: Any) -> None:
        """A call on the whole batch whose rows are reordered (``h[perm]``) since the layer outputs it derives
        from is noted, and refused at ``collect``: its rows are not those layers' examples in order."""
        batch = self._batch_hint
        if batch is None or batch < 2 or not isinstance(first, Tensor) or first.grad_fn is None:
            return
        whole = first.dim() > 0 and first.shape[0] == batch
        if whole and _reordered_rows(first.grad_fn, batch, self._batched_nodes) is not None:
            self._reordered.append(module)

    def _check_time_major(self, module: nn.Module, first: Any) -> None:
        """A call on a tensor whose batch was moved to dimension 1 is noted, and refused at ``collect``."""
        if isinstance(first, Tensor) and first in self.tracer.moved:
            self._time_major.append(module)

    def _note_output(self, output: Tensor, rows: RowMap | None = None) -> None:
        """Remember the graph node of a layer output over the whole batch (``_from_batch`` looks for it), or
        the examples of the rows of an output over rows of the batch (the tracer follows them on)."""
        if rows is not None:
            self.tracer.set_rows(output, rows.rows)
            return
        batch = self._batch_hint
        if output.grad_fn is not None and output.dim() > 0 and batch is not None and output.shape[0] == batch:
            self._batched_nodes.add(output.grad_fn)

    # -- which layer calls are shared by the batch: decided by structure, not by a size -----------------
    @contextlib.contextmanager
    def recording_input_sizes(self) -> Iterator[dict[nn.Module, list[int]]]:
        """For the block: dimension 0 of each hooked layer call's first tensor input, per layer, in call
        order (the forward may run without autograd; nothing is captured)."""
        sizes: dict[nn.Module, list[int]] = {}

        def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            first = next((x for x in tree_flatten((args, kwargs))[0] if isinstance(x, Tensor)), None)
            if first is not None:
                sizes.setdefault(module, []).append(first.shape[0] if first.dim() else -1)

        handles = [m.register_forward_pre_hook(record, with_kwargs=True) for _, m in self.layers]
        try:
            yield sizes
        finally:
            for handle in handles:
                handle.remove()

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

    def _capture_kwargs(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """A layer called with keyword inputs (``fc(input=x)``) is captured like a positional call."""
        # an expanded parameter passed to the layer is seen as the user wrote it (the parameter itself)
        args, kwargs = broadcast.unwrap((args, kwargs))
        return self._capture(module, positional(module, args, kwargs) if kwargs else args, output)

    def _capture(self, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> Any:
        if not (self._active(module) and isinstance(output, Tensor)):
            return None
        if not output.requires_grad:
            if not (self.skip_param_grads and output.is_floating_point()):
                return None
            # A first layer with frozen weights: graft its output onto a dummy leaf so the backward
            # still reaches it (and only it: no gradient flows to its weights or its input).
            if self._anchor is None or self._anchor.device != output.device:
                self._anchor = torch.zeros((), device=output.device, requires_grad=True)
            output = _Graft.apply(self._anchor, output)
        inputs, output = self._broadcast(module, inputs, output)
        self._check_order(module, inputs[0] if inputs else None)
        self._check_time_major(module, inputs[0] if inputs else None)
        rows = self._call_rows(inputs, output)
        self._uses.update(self._own[module])
        # The hook lives on the autograd graph, which the loss keeps alive after backward; the record
        # shares this list and empties it when it releases or spends its inputs, so they are freed.
        activations = [t.detach() if isinstance(t, Tensor) else t for t in inputs]
        count = len(activations)
        self._partial |= rows is not None and rows.rows.unique().numel() < rows.batch
        if rows is None:
            output.register_hook(lambda grad: self._accumulate(module, activations, grad, count))
        elif rows.one_each:  # rows of the batch, each placed at its example's row of the batch
            placed = [_to_batch(a, rows) for a in activations]
            output.register_hook(lambda grad: self._accumulate(module, placed, _to_batch(grad, rows), count))
        else:
            output.register_hook(lambda grad: self._accumulate(module, activations, grad, count, rows))
        self._note_output(output, rows)
        return output

    def _accumulate(
        self, module: nn.Module, activations: list[Any], grad: Tensor, count: int, rows: RowMap | None = None
    ) -> None:
        if self.ignoring:
            return
        self._tasks.add(torch._C._current_graph_task_id())
        if rows is not None:  # a call on rows of the batch, some of one example: per row, summed per example
            self._accumulate_rows(module, activations, grad, rows)
            return
        if len(activations) < count:  # freed by an earlier backward through the same forward
            raise RuntimeError(
                f"A second backward through the same forward reached {type(module).__name__}, whose inputs "
                "the first one already freed; private training needs one backward per forward "
                "(no retain_graph=True)."
            )
        batch = grad.shape[0]
        self.calls.append((module, batch))
        if self.path_of(module) == "fast":
            record = LayerCall(module, activations, grad.detach(), tuner=self.conv_tuner)
            own = self._own[module]
            if all(self._uses[p] == 1 for p in own):  # a shared parameter's norm has cross terms
                record.sq_norms()  # now, while the output gradient is in cache
                record.release_if_cached(own)
            self.records.append(record)
        else:
            with ieee_fp32():
                samples = grad_sampler(module)(module, activations, grad.detach() * self._scale(batch))
            add_samples(self.grad_samples, samples)
        self.batch_size = batch

    def _accumulate_rows(self, module: nn.Module, activations: list[Any], grad: Tensor, rows: RowMap) -> None:
        """Per-row gradients of a call whose rows are the batch's rows regrouped (several rows of one example:
        the tokens a mixture-of-experts layer routes to one expert), summed into each row's example."""
        batch = rows.batch
        self.calls.append((module, batch))
        with ieee_fp32():
            samples = grad_sampler(module)(module, activations, grad.detach() * self._scale(batch))
        add_samples(self.grad_samples, {p: _to_examples(g, rows.rows, batch) for p, g in samples.items()})
        self.batch_size = batch

    def _note_random_state(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """A recomputed layer's forward may draw random numbers (dropout): keep the state it starts from."""
        del args
        if self._active(module):
            device = next((p.device for p in self._own[module]), torch.device("cpu"))
            self._random_states.setdefault(module, []).append(vmap.random_state(device))

    def _capture_call(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """Layers recomputed per example: keep every input (keyword ones too) and tap every output tensor."""
        states = self._random_states.get(module)
        random_state = states.pop() if states else None
        if not self._active(module):
            return None
        args, kwargs = broadcast.unwrap((args, kwargs))
        taps = vmap.output_tensors(output)
        if not taps:
            return None
        first = next((x for x in tree_flatten((args, kwargs))[0] if isinstance(x, Tensor)), None)
        self._note_batch(first)
        self._check_order(module, first)
        self._check_time_major(module, first)
        self._uses.update(self._own[module])
        rows = self._traced_rows(first)
        detach = lambda x: x.detach() if isinstance(x, Tensor) else x  # noqa: E731
        saved = ([detach(a) for a in args], {k: detach(v) for k, v in kwargs.items()})
        positions = [i for i, _ in taps]

        def on_grads(grads: tuple[Tensor, ...]) -> None:
            if not self.ignoring:
                self._recomputed(module, saved, positions, grads, random_state, rows)

        if isinstance(output, Tensor):  # one output: a hook on it, no copy
            output.register_hook(lambda grad: on_grads((grad,)))
            self._note_output(output, rows)
            return output
        flat, spec = tree_flatten(output)
        for i, tapped in zip(positions, _Tap.apply(on_grads, *(t for _, t in taps)), strict=True):
            flat[i] = tapped
            self._note_output(tapped, rows)
        return tree_unflatten(flat, spec)

    def _recomputed(
        self,
        module: nn.Module,
        saved: tuple[list[Any], dict[str, Any]],
        positions: list[int],
        grads: tuple[Tensor, ...],
        random_state: vmap.RandomState | None = None,
        rows: RowMap | None = None,
    ) -> None:
        batch = grads[0].shape[0] if rows is None else rows.batch
        scale = self._scale(batch)
        self.enabled = False  # the recomputation must not reach the hooks of the layer or its children
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
        params, scaled = dict(direct_params(module)), [g * scale for g in grads]
        try:
            with ieee_fp32():
                try:
                    samples = vmap.per_example_grads(module, params, saved, positions, scaled, random_state)
                except RuntimeError as error:
                    if _written_buffers(buffers) or _written_in_recompute(error, buffers):
                        raise
                    samples = self._looped(module, params, saved, positions, scaled, random_state, error)
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
        finally:
            self.enabled = True
            for m, mode in modes:
                m.training = mode
            _put_back(buffers)
        if rows is not None:
            samples = {p: _to_examples(g, rows.rows, batch) for p, g in samples.items()}
        add_samples(self.grad_samples, samples)
        self.batch_size = batch

    def _looped(
        self,
        module: nn.Module,
        params: dict[str, nn.Parameter],
        saved: tuple[list[Any], dict[str, Any]],
        positions: list[int],
        grads: list[Tensor],
        random_state: vmap.RandomState | None,
        error: RuntimeError,
    ) -> dict[nn.Parameter, Tensor]:
        """A forward functorch cannot run one example at a time (a packed sequence's lengths, data-dependent
        shapes): run once on the batch and pulled back per example with plain autograd (exact), else refused."""
        try:
            return vmap.looped_per_example_grads(module, params, saved, positions, grads, random_state)
        except RuntimeError as looped:
            name = next((n for n, m in self.layers if m is module), "") or "<root>"
            owned = [self._names.get(p, n) for n, p in params.items()]
            uses = self._misaligned.get(module, [])
            why = f" (uses not in line with the batch: {uses[:3]})" if uses else ""
            raise DPConfigurationError(
                f"The per-example gradients of the parameters {owned}, held by {name!r} "
                f"({type(module).__name__}) itself{why}, need its forward recomputed per example, which "
                f"failed ({str(error)[:200]}; with plain autograd: {str(looped)[:200]}). Hold each such "
                "parameter in a small nn.Module of its own that applies it to the tensor it meets "
                "(return x + self.offset): that layer alone is recomputed per example, exactly; or, for a "
                "parameter of leading dimension 1, give it the rank of that tensor (shape (1, 1) for a "
                "(B, 1) output) so that it lines up with the batch."
            ) from looped

    def _expand(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A container's own [1, ...] parameters become per-example [B, ...] views for its forward
        (``broadcast``): each use is checked to line up with the batch."""
        if not self._active(module):
            return
        first = next((x for x in tree_flatten((args, kwargs))[0] if isinstance(x, Tensor)), None)
        self._note_batch(broadcast.unwrap(first))
        call = broadcast.ExpandedCall(self._batch_hint or 1)
        saved = {}
        for name, p in direct_params(module):
            view = broadcast.per_example_view(p, call, self._names.get(p, name))
            with torch._C.DisableTorchFunctionSubclass():
                view.register_hook(functools.partial(self._expanded_grad, p, call))
            module._parameters[name] = view  # type: ignore[assignment]
            saved[name] = p
        self._expanded[module] = (saved, call)

    def _capture_expanded(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """After the forward: a call whose expanded parameters were all used in line with the batch keeps
        their views' gradients; one with another use is recomputed per example (exact for every use)."""
        entry = self._expanded.get(module)
        if entry is not None and entry[1].misaligned:
            self._misaligned[module] = entry[1].misaligned
            return self._capture_call(module, args, kwargs, output)
        states = self._random_states.get(module)
        if states:
            states.pop()
        if entry is not None:
            self._uses.update(entry[0].values())
        return None

    def _restore(self, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        """Undo :meth:`_expand` (also when the forward raised)."""
        del inputs, output
        saved, _ = self._expanded.pop(module, ({}, None))
        for name, p in saved.items():
            module._parameters[name] = p

    def _expanded_grad(self, param: nn.Parameter, call: broadcast.ExpandedCall, grad: Tensor) -> None:
        if call.misaligned or self.ignoring:  # the call is recomputed per example instead
            return
        batch = grad.shape[0]
        add_samples(self.grad_samples, {param: (grad.detach() * self._scale(batch)).unsqueeze(1)})
        self.batch_size = batch

    def collect(self, expected: int | None = None) -> tuple[PerExampleGradients, int]:
        """The batch's per-example gradients (lazy where possible) and the batch size.

        ``expected``: the number of examples the sampler drew for this batch; every layer call must
        have it on dimension 0 (else :class:`BatchDimensionError`, before anything is released).
        """
        batch = self.batch_size or 0
        self._check_batchnorms()
        tracer = self.tracer
        refusals, second_order, covered = tracer.refusals, tracer.second_order, tracer.covered
        tracer.reset()
        outside, self._outside, self._froze = self._outside - covered, set(), set()
        self._batched_nodes = set()
        if refusals:
            self.clear()
            raise DPConfigurationError(refusals[0])
        time_major, self._time_major = self._time_major, []
        parts, self._tasks, self._partial = len(self._tasks) > 1 and self._partial, set(), False
        if parts:
            self.clear()
            raise BatchDimensionError(partial_backwards_message())
        if second_order:
            self.keep_param_grads = True  # per-example gradients come from autograd's own (one example alone)
            return self._autograd_alone(batch if expected is None else expected)
        if outside:
            self.clear()
            raise DPConfigurationError(missed_use_message([self._names.get(p, "?") for p in outside]))
        reordered, self._reordered = self._reordered, []
        if reordered:
            self.clear()
            raise DPConfigurationError(reordered_message(self._layer_names(reordered)))
        check_batch_dimension(self.calls, batch if expected is None else expected, self.layers)
        if time_major:  # also when the time length equals the batch size, which no size shows
            self.clear()
            raise BatchDimensionError(time_major_message(self._layer_names(time_major)))
        for sample in self.grad_samples.values():
            if sample.shape[0] != batch:
                self.clear()
                raise BatchDimensionError(
                    "Per-example gradients disagree on the batch size "
                    f"({sample.shape[0]} vs {batch}): every layer must see the batch on dimension 0."
                )
        if self._reach_handles and batch:
            self._check_reached()
        materialized = dict(self.grad_samples)
        with self.registered() if self.registered is not None else contextlib.nullcontext():
            records = self._split_shared(materialized, self._scale(batch))
        self._uses = Counter()  # the next forward starts a new count
        self._batch_hint = None
        grads = PerExampleGradients(self.params, batch, materialized, records, self._scale(batch))
        grads.registered = self.registered
        return grads, batch

    def _layer_names(self, modules: list[nn.Module]) -> list[str]:
        return list(dict.fromkeys(next((n for n, m in self.layers if m is r), "<root>") for r in modules))

    def _autograd_alone(self, batch: int) -> tuple[PerExampleGradients, int]:
        """A step that differentiates a gradient of the model again: exact only for one example alone, where
        its per-example gradient is autograd's gradient; refused otherwise, naming what makes it exact."""
        self.clear()
        self._uses, self._batch_hint = Counter(), None
        if batch > 1:
            raise DPConfigurationError(second_order_message())
        grads = {p: p.grad.detach().unsqueeze(0) for p in self.params if p.grad is not None}
        return PerExampleGradients(self.params, batch, grads if batch else {}, []), batch

    def _check_reached(self) -> None:
        """Once: a parameter that got an ordinary gradient but no per-example one is used outside the
        forward of the layer that holds it (e.g. another module reads ``layer.weight``): refuse it."""
        captured = set(self.grad_samples) | {p for r in self.records for p in self._own[r.module]}
        missed = [self._names.get(p, "?") for p in self.params if p in self._reached and p not in captured]
        self._reached.clear()
        if missed:
            raise DPConfigurationError(
                f"The parameters {missed} received a gradient but no per-example gradient: they are used "
                "outside the forward of the module that holds them (another module reads them, or the loss "
                "does). Call that module instead of reading its parameters, or freeze them."
            )
        for handle in self._reach_handles:  # checked on the first batch; later steps pay nothing
            handle.remove()
        self._reach_handles = []
        self._unchecked.clear()

    def _scale(self, batch: int) -> float:
        """Output gradient → per-example gradient factor: 1 under a sum loss; under a mean loss the rows it
        was divided by (``batch``), or ``public_scale`` where the loss is divided by public constants only
        (a per-user loss over ``users_per_step``): the rows' count is then no factor of any gradient."""
        if self.loss_reduction != "mean":
            return 1.0
        return float(batch) if self.public_scale is None else self.public_scale

    def _split_shared(self, materialized: dict[nn.Parameter, Tensor], scale: float) -> list[Any]:
        """A parameter reached by several calls (a reused layer, tied weights) has cross terms in its
        norm: an Embedding and a Linear sharing their weight become one joint record (``tie``), other such
        calls are materialised and summed; the others stay fast."""
        seen: dict[nn.Parameter, int] = {p: 1 for p in materialized}
        for record in self.records:
            for p in record.module.parameters():
                seen[p] = seen.get(p, 0) + 1
        fast: list[Any] = []
        shared = []
        for record in self.records:
            if any(seen.get(p, 0) > 1 for p in record.module.parameters()):
                shared.append(record)
            else:
                fast.append(record)
        tied, rest = tie(shared, seen)  # an Embedding and a Linear sharing their weight: a joint kernel
        for record in rest:
            add_samples(materialized, record.samples(scale))
        return fast + tied

    def clear(self) -> None:
        """Drop what the backward captured. The forward's call counts stay until ``collect``: Lightning
        calls ``zero_grad`` (and so this) between the forward and the backward."""
        self.grad_samples = {}
        self.records = []
        self.batch_size = None
        self.calls = []

    def discard(self) -> None:
        """Forget a pass as if it never ran: what its backward captured and what its forward counted
        (``dp_fsdp``'s zero-contributing passes, which only keep the ranks' collectives in step)."""
        self.clear()
        self._uses = Counter()
        self._batched_nodes, self._reordered = set(), []
        self._froze, self._outside = set(), set()

    def remove(self) -> None:
        """Remove the hooks and give swapped layers back their original classes."""
        for handle in [*self._handles, *self._reach_handles, *self._outside_handles]:
            handle.remove()
        self._handles, self._reach_handles, self._outside_handles = [], [], []
        recurrent.unswap(self._swapped)
        self._swapped = []
        if _CAPTURES.get(self.root) is self:
            del _CAPTURES[self.root]
        self.clear()


@dataclass(frozen=True)
class RowMap:
    """Which batch rows a layer call's rows are (``rows[j]`` for the call's row j), in a batch of ``batch``."""

    rows: Tensor
    batch: int

    @property
    def one_each(self) -> bool:
        """Each example at most once (placed at its row of the batch); else rows are summed per example."""
        return self.rows.numel() <= self.batch and self.rows.unique().numel() == self.rows.numel()


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


def _rows_of(t: Tensor, batch: int, batched: set[Any]) -> Tensor | None:
    """The batch rows ``t``'s rows are, when provably so: ``t`` is a dim-0 slice, row or index of a tensor
    that is a layer output over the whole batch (through element-wise activations only), or a row slice
    of a batch-sized tensor with no history (the batch itself). None when it cannot be shown."""
    node: Any = t.grad_fn  # autograd nodes expose their saved arguments as untyped attributes
    while node is not None and _row_wise_input(node) is not None:  # element-wise ops after the selection
        node = _row_wise_input(node)
    if node is None:
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
    name = type(node).__name__
    if name == "UnsqueezeBackward0" and node._saved_dim == 0:
        inner = node.next_functions[0][0]
        if type(inner).__name__ != "SelectBackward0" or inner._saved_dim != 0:
            return None
        size = inner._saved_self_sym_sizes[0]
        rows = torch.tensor([_signed(inner._saved_index) % size], device=t.device)
        source = inner.next_functions[0][0]
    elif name == "SliceBackward0" and node._saved_dim == 0:
        size = node._saved_self_sym_sizes[0]
        start, end, step = _signed(node._saved_start), _signed(node._saved_end), node._saved_step
        rows = torch.arange(size, device=t.device)[slice(start, end, step)]
        source = node.next_functions[0][0]
    elif name == "IndexBackward0":
        indices = node._saved_indices
        if len(indices) != 1 or indices[0] is None:
            return None
        size = node._saved_self_sym_sizes[0]
        index = indices[0].to(t.device)
        rows = index.nonzero().squeeze(1) if index.dtype == torch.bool else index.reshape(-1) % size
        source = node.next_functions[0][0]
    else:
        return None
    if size != batch:
        return None
    while (
        source is not None and source not in batched
    ):  # element-wise ops between the batch and the selection
        source = _row_wise_input(source)
    return None if source is None else rows


def _to_batch(value: Any, rows: RowMap) -> Any:
    """A call's tensor on its rows, placed at its batch rows of a zero tensor over the whole batch."""
    if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != rows.rows.numel():
        return value
    out = value.new_zeros((rows.batch, *value.shape[1:]))
    out[rows.rows.to(value.device)] = value
    return out


def _is_opacus_rnn(module: nn.Module) -> bool:
    """Opacus's own DPRNN/DPGRU/DPLSTM (made of per-step linear layers, not swapped by ``recurrent``)."""
    try:
        from opacus.layers.dp_rnn import DPRNNBase
    except ImportError:  # pragma: no cover - opacus is a dependency
        return False
    return isinstance(module, DPRNNBase)


def _refuse_packed(name: str, module: nn.Module, args: tuple[Any, ...]) -> None:
    """Opacus's DPRNN layers run a packed sequence one time step at a time on fewer rows each step, sorted
    by length: rows that cannot be matched to the batch's examples."""
    if args and isinstance(args[0], nn.utils.rnn.PackedSequence) and torch.is_grad_enabled():
        raise DPConfigurationError(
            f"Layer {name or '<root>'!r} ({type(module).__name__}, Opacus's own recurrent layer) is called on a "
            "PackedSequence: it runs each time step on the sequences still running, sorted by length, so its "
            "calls' rows are not the batch's examples. Use torch.nn's own layer (nn.LSTM, nn.GRU, nn.RNN), "
            "which lightning-dp swaps for an exact equivalent that takes packed sequences "
            "(pack_padded_sequence(..., enforce_sorted=False)), or pass DPLSTM padded [batch, time, ...] tensors."
        )


def _stat_versions(layer: nn.Module) -> tuple[int, ...]:
    """In-place versions of a BatchNorm's running statistics (an update bumps them)."""
    return tuple(b._version for b in layer.buffers(recurse=False))


def _written_buffers(buffers: list[tuple[nn.Module, str, Tensor, Tensor]]) -> list[str]:
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


def _written_in_recompute(
    error: RuntimeError, buffers: list[tuple[nn.Module, str, Tensor, Tensor]]
) -> list[str]:
    """The layer's buffers, when torch.func refused the recomputation for writing a tensor the layer holds in
    place (a running mean updated under ``no_grad`` in its forward): the write itself never happened."""
    text = str(error)
    if "captured Tensor" not in text and not ("vmap" in text and "inplace" in text.lower()):
        return []
    return [name for _, name, _, _ in buffers] or ["(a tensor attribute that is not a registered buffer)"]


def _put_back(buffers: list[tuple[nn.Module, str, Tensor, Tensor]]) -> None:
    """Undo what a per-example recomputation wrote into buffers (it must leave no trace)."""
    with torch.no_grad():
        for owner, name, original, values in buffers:
            owner._buffers[name] = original
            if not torch.equal(original, values):
                original.copy_(values)


@functools.cache
def _signature(cls: type[nn.Module]) -> inspect.Signature:
    return inspect.signature(cls.forward)


def positional(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """A call's inputs in the order of the layer's ``forward`` parameters (keywords placed by name)."""
    signature = _signature(type(module))  # type: ignore[arg-type]
    try:
        bound = signature.bind(module, *args, **kwargs)
    except TypeError:
        return (*args, *kwargs.values())
    names = list(signature.parameters)
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values()):
        return tuple(bound.arguments.values())[1:]
    # an argument skipped before a keyword one keeps its place with its default
    # (``bag(x, per_sample_weights=w)``: offsets=None, so the weights stay third)
    last = max(names.index(name) for name in bound.arguments)
    return tuple(
        bound.arguments[name] if name in bound.arguments else signature.parameters[name].default
        for name in names[1 : last + 1]
    )


class BatchDimensionError(DPConfigurationError):
    """A layer's dimension 0 is not the batch the sampler drew: its "per-example" gradients are not."""


def check_batch_dimension(
    calls: Sequence[tuple[nn.Module, int]], expected: int, layers: Sequence[tuple[str, nn.Module]]
) -> None:
    """Refuse when a layer call's dimension 0 is not ``expected`` examples (see docs/guarantees.md)."""
    bad = next(((m, size) for m, size in calls if size != expected), None)
    if bad is None:
        return
    module, size = bad
    name = next((n for n, m in layers if m is module), "") or "<root>"
    sizes = [n for m, n in calls if m is module]
    if len(sizes) > 1 and sum(sizes) == expected:
        shown = sizes if len(sizes) <= 8 else [*sizes[:8], "..."]
        raise BatchDimensionError(
            f"Layer {name!r} ({type(module).__name__}) was called on parts of the batch (dimension 0 of its "
            f"calls: {shown}, together the {expected} examples) instead of once on the whole batch: "
            "per-example clipping takes the rows of one call as the batch's examples, and parts of a batch "
            "cannot be matched to the examples they hold. Likely cause: manual gradient accumulation "
            "(manual_backward once per part of a batch, then one optimizer step): call manual_backward once "
            "on the whole batch's loss, or let DPStrategy(max_physical_batch_size=...) split the batch under "
            "automatic optimization; or a forward that calls the layer on rows whose examples cannot be "
            "traced (taken through a reshape, h[i].view(1, -1)): take them as slices, h[i:i+1] (traced, "
            "exact), or call the layer once on the whole batch (fc(h))."
        )
    if size == 1:
        cause = (
            "an input of batch 1 broadcast over the batch (e.g. position embeddings looked up with batch 1): "
            "one gradient would stand for every example, which clipping cannot bound. Look it up per example "
            "(expand the input to the batch size before the layer). A layer called on one row of the batch "
            "(fc(h[i:i+1])) or on the batch as one set (h.unsqueeze(0)) must be called on the whole batch "
            "with the examples on dimension 0."
        )
    elif size < expected:
        cause = (
            "a forward over a subset of the batch's rows (the model run on x[mask], e.g. the labelled "
            "examples only: a copy whose rows cannot be traced to the examples): run the model on the whole "
            "batch and zero the loss of the rows not used (per-example losses multiplied by the mask, "
            "summed, divided by the batch size), or select rows of a hidden state (head(body(x)[mask]), "
            "traced and exact). Or "
            "sequence-first (time-major) tensors or a reshaped batch: keep the batch on dimension 0 and build "
            "recurrent and attention layers with batch_first=True."
        )
    else:
        cause = (
            "sequence-first (time-major) tensors or a reshaped batch: per-example clipping takes dimension 0 "
            "as the examples, so it would clip each time step or row instead. Build nn.LSTM, nn.GRU, nn.RNN, "
            "nn.MultiheadAttention and nn.Transformer* with batch_first=True, keep the batch on dimension 0 "
            "(no transpose or view(B * T, ...) before a trainable layer)."
        )
    raise BatchDimensionError(
        f"Layer {name!r} ({type(module).__name__}) has {size} on its batch dimension (dim 0), but this batch "
        f"has {expected} examples. Likely cause: {cause}"
    )


def _reordered_rows(node: Any, batch: int, batched: set[Any]) -> Tensor | None:
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


def reordered_message(names: list[str]) -> str:
    """The refusal for layers called on the batch's rows reordered (``_reordered_rows``)."""
    return (
        f"The layers {names} are called on the batch's rows reordered by an index (h[perm], index_select) "
        "that no earlier reordering undoes, so their rows are not the examples of the layers before them in "
        "order (nor of the layers after them): each example's per-example gradient would mix the rows of "
        "different examples. "
        "Likely cause: the batch sorted by length for pack_padded_sequence(..., enforce_sorted=True) and the "
        "order restored by hand (h[-1][inverse]). Pass the unsorted batch with "
        "pack_padded_sequence(..., enforce_sorted=False), which sorts and restores the order inside the "
        "packed sequence (exact); any other reordering of rows must be undone before the next layer is called "
        "(h[perm][inverse]), or mixes examples."
    )


def missed_use_message(names: list[str], gap: float | None = None) -> str:
    """The refusal for parameters whose gradient the per-example capture misses in part."""
    measured = "" if gap is None else f" (relative gap up to {gap:.2g})"
    return (
        f"The per-example gradients of the parameters {names} do not add up to their ordinary gradient"
        f"{measured}: part of their gradient comes from a use outside the forward of the module that holds "
        "them (a tied output projection h @ emb.weight.T, a temperature or scale read in the loss, a weight "
        "penalty added to the loss), which per-example clipping cannot bound, so the private step would miss "
        "it. This step releases nothing. Use the parameter only through its module's call (tie the weight to an nn.Linear "
        "and call it; put a temperature in a module the forward calls), move weight penalties into the "
        "optimizer's weight_decay, or freeze the parameter. A loss summed over the batch needs "
        "DPStrategy(loss_reduction='sum')."
    )


def partial_backwards_message() -> str:
    """The refusal for several backward passes over parts of one batch before its release."""
    return (
        "Several backward passes over parts of one sampled batch (manual gradient accumulation: "
        "manual_backward once per part, then one optimizer step) before its release: each part's loss is a "
        "mean over the part, so each example's gradient depends on how the batch was split, and the private "
        "step is one release per sampled batch. Call manual_backward once on the whole batch's loss; if the "
        "batch does not fit in memory, use DPStrategy(max_physical_batch_size=...) with automatic "
        "optimization, which splits it and adds the noise once."
    )


def second_order_message() -> str:
    """The refusal for a loss that differentiates a gradient of the model again, on more than one example."""
    return (
        "The loss differentiates a gradient of the model again (torch.autograd.grad(..., create_graph=True): "
        "a WGAN-GP gradient penalty, an input-gradient regulariser): its per-example gradients cannot be "
        "taken from one backward over the batch, whose second-order terms the layer hooks do not see. This "
        "step releases nothing. Pass DPStrategy(isolate_examples=True): each example then runs through "
        "training_step alone and its per-example gradient is autograd's own, exact for any loss (one forward "
        "and backward per example)."
    )


def _check_covered(root: nn.Module, covered: set[nn.Parameter]) -> None:
    """Every trainable parameter needs a per-example path; one without would get noise only."""
    missing = [name for name, p in root.named_parameters() if p.requires_grad and p not in covered]
    if missing:
        raise DPConfigurationError(
            f"No per-example gradient path covers the trainable parameters {missing}: they would receive "
            "noise only. Hold them in an nn.Module that uses them in its forward, or freeze them "
            "(requires_grad=False)."
        )
