"""Per-example gradients of any layer by recomputing it per example (``torch.func``: vmap of grad).

The generic rule for layers without a formula and for the parameters a container module holds
directly: the layer's recorded inputs (positional and keyword, any pytree) are re-run one example at
a time with ``functional_call``, and each example's output gradient is pulled back to the chosen
parameters only. Tensors whose first dimension is the batch are split, everything else (masks of a
batch of 1, constants) is shared; buffers are read from the module as they are; a layer with several
output tensors gets each one's gradient. Random operations inside are refused (the recomputation
could not replay the forward's draws).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_dp.core.errors import DPConfigurationError


def output_tensors(output: Any) -> list[tuple[int, Tensor]]:
    """(position in the flattened output, tensor) of each floating output that carries a gradient."""
    flat, _ = tree_flatten(output)
    return [(i, t) for i, t in enumerate(flat) if isinstance(t, Tensor) and t.requires_grad]


@dataclass(frozen=True, eq=False)
class RecomputedCall:
    """One recorded call of a layer whose per-example gradients are recomputed: the layer, the parameters
    to differentiate (``params``, names relative to ``module``), its recorded inputs (positional, keyword),
    the positions in its flattened output of the tensors with a gradient and those gradients [B, ...]
    (``grads``), and the random state its forward started from (None: not kept)."""

    module: nn.Module
    params: dict[str, nn.Parameter]
    inputs: tuple[Sequence[Any], dict[str, Any]]
    output_positions: Sequence[int]
    grads: Sequence[Tensor]
    random_state: RandomState | None = None

    def outputs(
        self, weights: Sequence[Tensor], inputs: tuple[Sequence[Any], dict[str, Any]] | None = None
    ) -> list[Tensor]:
        """The layer run with ``weights`` for ``params`` on ``inputs`` (the recorded ones unless given):
        its output tensors at ``output_positions``."""
        args, kwargs = self.inputs if inputs is None else inputs
        output = torch.func.functional_call(
            self.module, dict(zip(self.params, weights, strict=True)), tuple(args), kwargs
        )
        outs, _ = tree_flatten(output)
        return [outs[i] for i in self.output_positions]


def per_example_grads(call: RecomputedCall) -> dict[nn.Parameter, Tensor]:
    """[B, *shape] gradient of each of ``call.params`` for each example.

    A layer that draws random numbers (dropout, drop-path) cannot be recomputed one example at a time;
    with ``call.random_state`` (the random state its forward started from) it is replayed instead
    (:func:`replayed_per_example_grads`).
    """
    module, grads, inputs = call.module, call.grads, call.inputs
    batch = grads[0].shape[0]
    values = tuple(p.detach() for p in call.params.values())
    dtype = values[0].dtype
    flat, spec = tree_flatten((list(inputs[0]), dict(inputs[1])))

    def batched(x: Any) -> bool:
        return isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == batch

    flat = [x.detach().to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x for x in flat]
    dims = tuple(0 if batched(x) else None for x in flat)
    split = tuple(x if d == 0 else None for x, d in zip(flat, dims, strict=True))
    shared = tuple(None if d == 0 else x for x, d in zip(flat, dims, strict=True))

    def loss(weights: tuple[Tensor, ...], one: tuple[Any, ...], out_grads: tuple[Tensor, ...]) -> Tensor:
        leaves = [s if d is None else o.unsqueeze(0) for s, o, d in zip(shared, one, dims, strict=True)]
        outs = call.outputs(weights, tree_unflatten(leaves, spec))
        return sum(
            ((out * g.unsqueeze(0)).sum() for out, g in zip(outs, out_grads, strict=True)),
            torch.zeros((), dtype=dtype, device=g_device),
        )

    g_device = grads[0].device
    cast = tuple(g.detach().to(dtype) for g in grads)
    compute = torch.func.vmap(torch.func.grad(loss), in_dims=(None, dims, 0))
    try:
        with torch.no_grad():
            samples = compute(values, split, cast)
    except RuntimeError as error:
        if OLD_STYLE_FUNCTION in str(error):  # a custom autograd.Function that functorch cannot transform
            return looped_per_example_grads(call)
        if "randomness" not in str(error):
            raise
        if call.random_state is not None:
            return replayed_per_example_grads(call)
        raise DPConfigurationError(
            f"{type(module).__name__} draws random numbers (dropout) inside its forward, and its per-example "
            "gradients are recomputed one example at a time, which cannot replay those draws. Move the "
            "dropout out of the layer (into a parent module), or set its probability to 0."
        ) from error
    return dict(zip(call.params.values(), samples, strict=True))


OLD_STYLE_FUNCTION = "it must override the setup_context staticmethod"
"""Part of functorch's error for an ``autograd.Function`` whose ``forward`` takes ``ctx`` (the old style)."""


def looped_per_example_grads(call: RecomputedCall) -> dict[nn.Parameter, Tensor]:
    """Per-example gradients with plain autograd, for layers functorch cannot transform (an old-style
    ``autograd.Function`` in the forward): the layer is run once more on the batch (from the forward's
    random state, when it had one) and its graph is pulled back once per example, each with that
    example's own output gradient. Exact; one backward of the layer per example."""
    state, grads = call.random_state, call.grads
    weights = tuple(p.detach().requires_grad_(True) for p in call.params.values())
    with _replaying(state) if state is not None else contextlib.nullcontext(), torch.enable_grad():
        tapped = call.outputs(weights)
    batch = grads[0].shape[0]
    samples = [torch.zeros((batch, *w.shape), dtype=w.dtype, device=w.device) for w in weights]
    for row in range(batch):
        cotangents = []
        for out, g in zip(tapped, grads, strict=True):
            one = torch.zeros_like(out)
            one[row] = g[row].to(out.dtype)
            cotangents.append(one)
        pulled = torch.autograd.grad(
            tapped, weights, cotangents, retain_graph=row + 1 < batch, allow_unused=True
        )
        for sample, value in zip(samples, pulled, strict=True):
            if value is not None:
                sample[row] = value
    return dict(zip(call.params.values(), samples, strict=True))


RandomState = tuple[Tensor, list[tuple[int, Tensor]]]
"""The CPU generator's state and each used CUDA device's, at the start of a layer's forward."""


def random_state(device: torch.device) -> RandomState:
    """The global random state a forward on ``device`` draws from (cheap: a few kB copied)."""
    cuda = [(device.index or 0, torch.cuda.get_rng_state(device))] if device.type == "cuda" else []
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _replaying(state: RandomState) -> Iterator[None]:
    cpu, cuda = torch.get_rng_state(), [(i, torch.cuda.get_rng_state(i)) for i, _ in state[1]]
    torch.set_rng_state(state[0])
    for index, value in state[1]:
        torch.cuda.set_rng_state(value, index)
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        for index, value in cuda:
            torch.cuda.set_rng_state(value, index)


REPLAY_CHUNK_ELEMENTS = 2**24
"""Per-example cotangents pulled back at once in a replay (elements): bounds its memory."""


def replayed_per_example_grads(call: RecomputedCall) -> dict[nn.Parameter, Tensor]:
    """Per-example gradients of a layer that draws random numbers: its forward is run once more on the whole
    batch from the random state the original forward started from (``call.random_state``: same shapes, so
    the same draws: the same dropout masks), and the one backward graph is pulled back once per example
    (each example's own output gradient, ``vmap`` over the cotangents), so every example keeps its own mask."""
    state, grads = call.random_state, call.grads
    assert state is not None
    values = tuple(p.detach() for p in call.params.values())
    batch = grads[0].shape[0]

    def forward(*weights: Tensor) -> tuple[Tensor, ...]:
        return tuple(call.outputs(weights))

    with _replaying(state), torch.enable_grad():
        pull_back = torch.func.vjp(forward, *values)[1]
    cotangents = [g.detach() for g in grads]

    def one(onehot: Tensor) -> tuple[Tensor, ...]:
        return pull_back(tuple(g * onehot.view(-1, *([1] * (g.dim() - 1))).to(g.dtype) for g in cotangents))

    per_row = max(1, sum(g.numel() for g in cotangents))
    chunk = max(1, min(batch, REPLAY_CHUNK_ELEMENTS // per_row))
    eye = torch.eye(batch, device=grads[0].device)
    with torch.no_grad():
        samples = torch.func.vmap(one, chunk_size=chunk)(eye)
    return dict(zip(call.params.values(), samples, strict=True))
