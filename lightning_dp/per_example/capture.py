"""Per-example gradients from one ordinary backward pass, using Opacus's per-layer formulas.

A forward hook keeps each layer's input; a hook on the layer's *output tensor* receives the gradient
of that output during backward, and Opacus's registered grad sampler (or its functorch fallback for
unknown layers) turns the pair into per-example gradients. Tensor hooks, unlike module full-backward
hooks, survive in-place operations on a layer's output (torchvision's ResNet ``out += identity`` and
``ReLU(inplace=True)``), and leave ``state_dict`` keys untouched. On the fast path the same hook
computes the layer's per-example norms (``per_example.kernels``) and keeps only what the clipped sum needs.

:class:`GradientCapture` is the hooks; what they lean on has a module of its own: which examples a call's
rows are (``rows``), the layers recomputed per example (``recompute``), which parameters each layer covers
(``parameters``), and the run-time checks its observations are held to (``observations``). A little over 500
lines: one class, whose hooks and ``collect`` read and reset the same state of one backward.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_dp.per_example import broadcast, kernels, recurrent
from lightning_dp.per_example.batchnorm import BatchNormCalls
from lightning_dp.per_example.gradients import PerExampleGradients, Registered
from lightning_dp.per_example.kernels import ecosystem
from lightning_dp.per_example.kernels.conv_autotune import ConvAutotuner
from lightning_dp.per_example.layer_calls import LayerCall, tie
from lightning_dp.per_example.layers import (
    expands_params,
    is_opacus_rnn,
    positional,
    refuse_packed,
    trainable_layers,
    unique_layers,
)
from lightning_dp.per_example.materialized import add_samples, direct_params, grad_sampler, layer_method
from lightning_dp.per_example.observations import CaptureChecks, Observed, installed_checks
from lightning_dp.per_example.parameters import GradientWatch, ParameterPaths
from lightning_dp.per_example.precision import ieee_fp32
from lightning_dp.per_example.recompute import Recompute
from lightning_dp.per_example.row_labels import to_examples
from lightning_dp.per_example.rows import RowMap, RowProvenance, input_sizes, to_batch
from lightning_dp.per_example.uses import UseTracer

GradMode = Literal["auto", "fast", "materialize"]


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
    layers are swapped in place for exact equivalents (``recurrent``) until :meth:`remove`. ``checks``: the
    run-time obligations the observations are held to (default: the installed ones, ``observations``).
    """

    # What the backward captured since the last ``clear``: materialised per-example gradients [B, *shape], the
    # fast path's layer calls, the batch they are over, and (layer, dim 0 of its output gradient) per call.
    grad_samples: dict[nn.Parameter, Tensor]
    records: list[LayerCall]
    batch_size: int | None
    calls: list[tuple[nn.Module, int]]

    keep_param_grads = False
    """Set by the strategy when user code reads ``p.grad`` after backward (an ``on_after_backward``
    override): autograd's weight gradients are then computed every step, as documented, although the
    private step never uses them; everyone else keeps the cheaper backward without them."""

    def __init__(
        self,
        root: nn.Module,
        loss_reduction: str = "mean",
        mode: GradMode = "auto",
        checks: CaptureChecks | None = None,
    ) -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}.")
        if mode not in ("auto", "fast", "materialize"):
            raise ValueError(f"mode must be 'auto', 'fast' or 'materialize', got {mode!r}.")
        self.checks = checks if checks is not None else installed_checks()
        self.loss_reduction = loss_reduction
        self.public_scale: float | None = None
        """Set by the engine where the mixing check found the loss divided by public constants (``scale``)."""
        self.enabled = True
        self.ignoring = False
        """True during a gradient the step takes itself (``torch.autograd.grad`` of first order): not the backward
        of the step's loss, so the hooks take nothing from it."""
        self.skip_param_grads = False
        """Book-keeping: when True, autograd computes no weight gradients (the engine builds the
        private gradient from inputs and output gradients alone), which saves a third of the backward."""
        self.registered: Registered | None = None
        """Set by ``dp_fsdp``: a context in which the layers hold the full-size parameters the hooks recorded
        (outside a unit's forward and backward, FSDP2 registers its shards instead)."""
        self.probed = False
        """Whether the strategy tried to classify the layers as shared by the batch (once per capture)."""
        self.clear()
        self.conv_tuner = ConvAutotuner()
        """This capture's choice of convolution norm method per shape (timed once, kept for the run)."""
        ecosystem.register_loaded()
        self._swapped = recurrent.swap(root)
        self.root = root
        self.layers = unique_layers(trainable_layers(root, trainable=False))
        """Every layer holding parameters, frozen ones too: a parameter unfrozen during training
        (``BackboneFinetuning``) is covered from that step on (:meth:`refresh`). A layer registered under
        two names (``self.inp`` and ``self.net[0]``) is listed, and hooked, once, under its first name."""
        self.mode: GradMode = self._choose(mode)
        self.paths = ParameterPaths(root, self.layers, (m for m, _ in self._swapped))
        self.watch = GradientWatch()
        self.tracer = UseTracer(self)
        self.rows = RowProvenance(root, self.tracer)
        self.recompute = Recompute(self)
        self.batchnorms = BatchNormCalls(root)
        self._anchor: Tensor | None = None
        self._tracing = 0
        self._freezing: set[nn.Module] = set()
        """Layers whose parameters :meth:`_freeze` freezes for the length of their forward."""
        self._frozen: dict[nn.Module, list[nn.Parameter]] = {}
        """Book-keeping: the parameters :meth:`_freeze` froze for the length of each layer's forward."""
        self.refresh()
        self._handles = self._hook()
        self.watch.thawed = {p for m, ps in self.paths.all.items() if m not in self._freezing for p in ps}
        _CAPTURES[root] = self

    def _choose(self, mode: GradMode) -> GradMode:
        """``auto``: fast when every layer with a formula has a fast one, else materialise."""
        if mode != "auto":
            return mode
        layers = [m for _, m in self.layers if layer_method(m) != "direct" and direct_params(m)]
        return "fast" if all(kernels.is_supported(m) for m in layers) else "materialize"

    def _hook(self) -> list[RemovableHandle]:
        """Every hook, in the order they must run: freezing, capturing, BatchNorm, refusals, running layers."""
        handles: list[RemovableHandle] = []
        parts = {id(part) for module, _ in self._swapped for _, part in recurrent.parts_of(module) or []}
        for module, _ in self._swapped:
            handles += self._hook_freeze(module)
        for _, module in self.layers:
            path = self.path_of(module)
            if path in ("functorch", "direct"):
                handles += self.recompute.hook(
                    module, path == "direct" and expands_params(module, trainable=False)
                )
                continue
            if id(module) not in parts:
                handles += self._hook_freeze(module)
            handles.append(module.register_forward_hook(self._capture_kwargs, with_kwargs=True))
        handles += [bn.register_forward_pre_hook(self._note_batchnorm) for bn in self.batchnorms.names]
        for name, module in self.root.named_modules():
            if is_opacus_rnn(module):
                handles.append(module.register_forward_pre_hook(functools.partial(refuse_packed, name)))
        for module in {m for _, m in self.layers} | {m for m, _ in self._swapped}:
            handles.append(module.register_forward_pre_hook(self.paths.enter, prepend=True))
            handles.append(module.register_forward_hook(self.paths.leave, always_call=True))
        return handles

    # -- what the tracer of uses outside the layers (``uses``) and the recomputed paths ask --------------------------
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
        return self.paths.used_outside(param)

    @property
    def batch_hint(self) -> int | None:
        return self.rows.hint

    @property
    def _batch_hint(self) -> int | None:
        """The batch of the current forward (read by the checks that rerun the step)."""
        return self.rows.hint

    @property
    def params(self) -> list[nn.Parameter]:
        """Each trainable parameter once, tied ones included (their uses are summed per example)."""
        return self.paths.params

    def scale(self, batch: int) -> float:
        return self._scale(batch)

    def name_of(self, param: nn.Parameter, default: str = "?") -> str:
        return self.paths.names.get(param, default)

    def layer_name(self, module: nn.Module) -> str:
        return next((n for n, m in self.layers if m is module), "") or "<root>"

    def active(self, module: nn.Module) -> bool:
        """Whether a call is captured: in a training forward (the model's mode, not the layer's: a layer the
        user froze in eval mode, a BatchNorm on its running statistics, still trains its parameters)."""
        return (
            self.enabled
            and self.root.training
            and torch.is_grad_enabled()
            and bool(self.paths.own.get(module))
        )

    def own(self, module: nn.Module) -> list[nn.Parameter]:
        return self.paths.own[module]

    def count_uses(self, params: Iterable[nn.Parameter]) -> None:
        self.paths.uses.update(params)

    def add_per_example(self, samples: dict[nn.Parameter, Tensor], batch: int) -> None:
        """Per-example gradients [batch, *shape] of some use, summed with every other use's."""
        add_samples(self.grad_samples, samples)
        self.batch_size = batch

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

    # -- which parameters are covered ---------------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Read which parameters are trainable now (before each step); True when that changed.

        A parameter unfrozen since the last step (``BackboneFinetuning``, ``requires_grad_(True)`` by hand)
        is covered from now on, one frozen is left out; a trainable parameter no hooked layer holds is
        refused (it would be stepped with noise only, or with its raw gradient)."""
        params = self.paths.refresh(self.layers)
        if params is None:
            return False
        self.checks.coverage(self.root, params)
        self.watch.watch([p for p in params if p not in set(self.paths.params)])
        self.paths.params = params
        return True

    def path_of(self, module: nn.Module) -> str:
        """'fast' (norms from inputs and output gradients), 'formula', 'functorch' or 'direct' (materialised)."""
        if self.mode == "fast" and kernels.is_supported(module):
            return "fast"
        return layer_method(module)

    def _hook_freeze(self, module: nn.Module) -> list[RemovableHandle]:
        self._freezing.add(module)
        return [
            module.register_forward_pre_hook(self._freeze),
            module.register_forward_hook(self._thaw, always_call=True),
        ]

    def _freeze(self, module: nn.Module, inputs: tuple[Any, ...]) -> None:
        """Book-keeping: the layer's own parameters stop requiring grad for the length of its forward."""
        if self.skip_param_grads and not self.keep_param_grads and self.active(module):
            frozen = [p for p in self.paths.own[module] if p.requires_grad]
            for p in frozen:
                p.requires_grad_(False)
            self._frozen.setdefault(module, []).extend(frozen)
            self.watch.froze.update(frozen)

    def _thaw(self, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        """Undo :meth:`_freeze` (also when the forward raised)."""
        del inputs, output
        for p in self._frozen.pop(module, []):  # exactly what _freeze froze: a user's frozen layer stays so
            p.requires_grad_(True)

    def _note_batchnorm(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        del args
        if self.enabled:
            self.batchnorms.note(module)

    # -- the forward's layer calls --------------------------------------------------------------------------------------
    def expect_batch(self, size: int | None) -> None:
        """The next forward's batch size as the sampler drew it (None: take it from the first layer's input)."""
        self.rows.hint = size
        self.batchnorms.forget()

    def recording_input_sizes(self) -> contextlib.AbstractContextManager[dict[nn.Module, list[int]]]:
        """For the block: dimension 0 of each hooked layer call's first tensor input (``rows.input_sizes``)."""
        return input_sizes([m for _, m in self.layers])

    def classify(self, smaller: dict[nn.Module, list[int]], larger: dict[nn.Module, list[int]]) -> None:
        """Layers whose input sizes stay the same across batch sizes are shared by the batch (``rows``)."""
        self.rows.classify(smaller, larger)

    def _capture_kwargs(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """A layer called with keyword inputs (``fc(input=x)``) is captured like a positional call."""
        # an expanded parameter passed to the layer is seen as the user wrote it (the parameter itself)
        args, kwargs = broadcast.unwrap((args, kwargs))
        return self._capture(module, positional(module, args, kwargs) if kwargs else args, output)

    def _capture(self, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> Any:
        if not (self.active(module) and isinstance(output, Tensor)):
            return None
        if not output.requires_grad:
            if not (self.skip_param_grads and output.is_floating_point()):
                return None
            # A first layer with frozen weights: graft its output onto a dummy leaf so the backward
            # still reaches it (and only it: no gradient flows to its weights or its input).
            if self._anchor is None or self._anchor.device != output.device:
                self._anchor = torch.zeros((), device=output.device, requires_grad=True)
            output = _Graft.apply(self._anchor, output)
        inputs, output = self.rows.broadcast(module, inputs, output)
        self.rows.check_order(module, inputs[0] if inputs else None)
        rows = self.rows.call_rows(inputs, output)
        self.count_uses(self.paths.own[module])
        # The hook lives on the autograd graph, which the loss keeps alive after backward; the record
        # shares this list and empties it when it releases or spends its inputs, so they are freed.
        activations = [t.detach() if isinstance(t, Tensor) else t for t in inputs]
        count = len(activations)
        if rows is None:
            output.register_hook(lambda grad: self._accumulate(module, activations, grad, count))
        elif rows.one_each:  # rows of the batch, each placed at its example's row of the batch
            placed = [to_batch(a, rows) for a in activations]
            output.register_hook(lambda grad: self._accumulate(module, placed, to_batch(grad, rows), count))
        else:
            output.register_hook(lambda grad: self._accumulate(module, activations, grad, count, rows))
        self.rows.note_output(output, rows)
        return output

    # -- the backward's output gradients ----------------------------------------------------------------------------------
    def _accumulate(
        self, module: nn.Module, activations: list[Any], grad: Tensor, count: int, rows: RowMap | None = None
    ) -> None:
        if self.ignoring:
            return
        self.rows.note_task()
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
            own = self.paths.own[module]
            if all(self.paths.uses[p] == 1 for p in own):  # a shared parameter's norm has cross terms
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
        add_samples(self.grad_samples, {p: to_examples(g, rows.rows, batch) for p, g in samples.items()})
        self.batch_size = batch

    # -- the step's per-example gradients ---------------------------------------------------------------------------------
    def collect(self, expected: int | None = None) -> tuple[PerExampleGradients, int]:
        """The batch's per-example gradients (lazy where possible) and the batch size.

        ``expected``: the number of examples the sampler drew for this batch; every layer call must
        have it on dimension 0 (else :class:`BatchDimensionError`, before anything is released). What the
        hooks observed is held to the run-time checks (``checks``) first.
        """
        batch = self.batch_size or 0
        seen = self._observed(batch, batch if expected is None else expected)
        if seen.second_order:
            self.keep_param_grads = True  # per-example gradients come from autograd's own (one example alone)
        self.checks.collected(seen)
        if seen.second_order:
            return self._autograd_alone(seen.expected)
        if seen.unreached is not None:
            self.watch.stop_reach()
        materialized = dict(self.grad_samples)
        with self.registered() if self.registered is not None else contextlib.nullcontext():
            records = self._split_shared(materialized, self._scale(batch))
        self.paths.uses = Counter()  # the next forward starts a new count
        self.rows.hint = None
        grads = PerExampleGradients(self.params, batch, materialized, records, self._scale(batch))
        grads.registered = self.registered
        return grads, batch

    def _observed(self, batch: int, expected: int) -> Observed:
        """What this step's hooks saw, for the checks; the next forward's observations start afresh."""
        tracer = self.tracer
        refusals, second_order, covered = tracer.refusals, tracer.second_order, tracer.covered
        tracer.reset()
        rows = self.rows.take()
        unreached = None
        if self.watch.checking_reach and batch:  # once: parameters reached that no per-example path gave
            captured = set(self.grad_samples) | {p for r in self.records for p in self.paths.own[r.module]}
            unreached = [self.name_of(p) for p in self.watch.unreached(self.params, captured)]
        return Observed(
            rows=batch,
            expected=expected,
            calls=self.calls,
            layers=self.layers,
            batch_statistics=self.batchnorms.take(),
            tracer_refusals=refusals,
            partial_backwards=rows.partial_backwards,
            second_order=second_order,
            outside=[self.name_of(p) for p in self.watch.take_outside(covered)],
            reordered=self._layer_names(rows.reordered),
            time_major=self._layer_names(rows.time_major),
            disagreeing=any(sample.shape[0] != batch for sample in self.grad_samples.values()),
            unreached=unreached,
            drop=self.clear,
        )

    def _layer_names(self, modules: list[nn.Module]) -> list[str]:
        return list(dict.fromkeys(self.layer_name(m) for m in modules))

    def _autograd_alone(self, batch: int) -> tuple[PerExampleGradients, int]:
        """A step that differentiates a gradient of the model again, on one example alone (the checks refuse
        more): its per-example gradient is autograd's gradient."""
        self.clear()
        self.paths.uses, self.rows.hint = Counter(), None
        grads = {p: p.grad.detach().unsqueeze(0) for p in self.params if p.grad is not None}
        return PerExampleGradients(self.params, batch, grads if batch else {}, []), batch

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
        self.paths.uses = Counter()
        self.rows.forget()
        self.watch.forget()

    def remove(self) -> None:
        """Remove the hooks and give swapped layers back their original classes."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.watch.remove()
        recurrent.unswap(self._swapped)
        self._swapped = []
        if _CAPTURES.get(self.root) is self:
            del _CAPTURES[self.root]
        self.clear()
