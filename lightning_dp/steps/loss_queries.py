"""Loss probes: evaluate a LightningModule's clipped per-example losses at candidate weights.

Step slots that choose a step size from the data (DP-AGD's noisy-min grid search, DP line search)
need ``F(w − η·d) = Σ_i clamp(ℓ_i(w − η·d), 0, C_obj)`` for several η. The module contract is one
method::

    def dp_per_sample_loss(self, batch) -> Tensor:   # shape [B], unreduced, one loss per example

A probe calls it under ``torch.no_grad()`` (so the per-example gradient hooks record nothing), with
``self.log``/``self.log_dict`` silenced (a private batch's loss must not reach a logger), every
candidate evaluated with the same forward randomness (dropout masks are identical across candidates,
and the global RNG is left exactly as it was), and the weights, buffers and, if given, the inner
optimizer's state restored bit-for-bit afterwards. The sums are released only after noise is added by
the caller: clipping to ``[0, C_obj]`` makes each sum a monotone query of sensitivity ``C_obj``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dp.core.batches import EmptyBatch, batch_length, split_batch
from lightning_dp.core.errors import DPConfigurationError

__all__ = ["PROBE_METHOD", "USER_LEVEL_REFUSAL", "LossProbe", "require_loss_probe"]

#: The LightningModule method a loss probe calls.
PROBE_METHOD = "dp_per_sample_loss"

USER_LEVEL_REFUSAL = "it queries per-example losses, whose sensitivity over a user's examples is not priced"
"""Why a step that queries losses through a probe refuses user-level DP (its ``refuses_user_level``)."""


def require_loss_probe(module: nn.Module, algorithm: str) -> Callable[[Any], Tensor]:
    """The module's ``dp_per_sample_loss``, or a DPConfigurationError naming the method and the contract."""
    method = getattr(module, PROBE_METHOD, None)
    if not callable(method):
        raise DPConfigurationError(
            f"{algorithm} evaluates the training loss at candidate weights, so the LightningModule must "
            f"implement `{PROBE_METHOD}(batch) -> Tensor[B]` returning the unreduced per-example losses; "
            f"{type(module).__name__} has no `{PROBE_METHOD}`."
        )
    return method


def _rng_devices(params: Sequence[Tensor]) -> list[torch.device]:
    return sorted({p.device for p in params if p.device.type == "cuda"}, key=str)


def _get_rng(devices: list[torch.device]) -> tuple[Tensor, list[Tensor]]:
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


def _set_rng(state: tuple[Tensor, list[Tensor]], devices: list[torch.device]) -> None:
    torch.set_rng_state(state[0])
    for device, s in zip(devices, state[1], strict=True):
        torch.cuda.set_rng_state(s, device)


class LossProbe:
    """Sums of clipped per-example losses of ``module`` on a batch, at the current or candidate weights.

    Args:
        module: the LightningModule (must implement ``dp_per_sample_loss``).
        params: the trainable parameters the candidates move (the order of every direction list).
        clip: ``C_obj``; each loss is clamped to ``[0, clip]``.
        chunk_size: evaluate at most this many examples per forward (virtual batching); ``None``: all.
        algorithm: name used in the error message when the method is missing.
        vectorize: evaluate all candidates of a chunk in one ``torch.func.vmap`` forward (K× the
            activation memory); falls back to one forward per candidate if vmap cannot run the model.
    """

    def __init__(
        self,
        module: nn.Module,
        params: Sequence[Tensor],
        clip: float,
        chunk_size: int | None = None,
        algorithm: str = "This step",
        vectorize: bool = True,
    ) -> None:
        if not clip > 0:
            raise ValueError(f"the loss clip C_obj must be > 0, got {clip}")
        self.loss_fn = require_loss_probe(module, algorithm)
        self.module = module
        self.params = list(params)
        self.clip = float(clip)
        self.chunk_size = chunk_size
        self.vectorize = vectorize

    # -- side-effect control -------------------------------------------------------------------
    @contextlib.contextmanager
    def preserved(self, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
        """Inside: no grad, no logging, any weight/buffer/optimizer change undone on exit, global RNG untouched."""
        devices = _rng_devices(self.params)
        rng = _get_rng(devices)
        weights = [p.detach().clone() for p in self.params]
        buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        opt_state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
        own = {name: vars(self.module).get(name, _MISSING) for name in ("log", "log_dict")}
        for name in own:
            object.__setattr__(self.module, name, _no_log)
        try:
            with torch.no_grad():
                yield
        finally:
            for name, previous in own.items():
                if previous is _MISSING:
                    object.__delattr__(self.module, name)
                else:
                    object.__setattr__(self.module, name, previous)
            with torch.no_grad():
                for p, w in zip(self.params, weights, strict=True):
                    p.copy_(w)
                for b, saved in buffers:
                    b.copy_(saved)
            if optimizer is not None and opt_state is not None:
                optimizer.load_state_dict(opt_state)
            _set_rng(rng, devices)

    # -- evaluation ------------------------------------------------------------------------------
    def _chunks(self, batch: Any) -> list[Any]:
        if batch is None or _is_empty(batch):
            return []
        return split_batch(batch, self.chunk_size) if self.chunk_size else [batch]

    def _clipped(self, chunk: Any) -> Tensor:
        losses = self.loss_fn(chunk)
        if not isinstance(losses, Tensor) or losses.dim() != 1:
            raise DPConfigurationError(
                f"`{PROBE_METHOD}` must return a 1-D tensor of per-example losses (shape [B]), got "
                f"{getattr(losses, 'shape', type(losses).__name__)}."
            )
        return losses.detach().double().nan_to_num(nan=self.clip, posinf=self.clip).clamp(0.0, self.clip)

    def clipped_losses(self, batch: Any) -> Tensor:
        """``clamp(ℓ_i(w), 0, C_obj)`` for every example of ``batch`` at the current weights (float64)."""
        with self.preserved():
            parts = [self._clipped(chunk) for chunk in self._chunks(batch)]
        device = self.params[0].device
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)

    def along(self, batch: Any, direction: Sequence[Tensor], steps: Sequence[float]) -> Tensor:
        """``F(w − η_k·d)`` for each ``η_k`` in ``steps`` (float64, shape [K]); the weights are restored.

        Candidates share the forward randomness of each chunk, so with dropout the differences between
        candidates come from the weights only. An empty batch gives zeros (every sum is over no example).
        """
        if len(direction) != len(self.params):
            raise ValueError(f"direction has {len(direction)} tensors, the probe moves {len(self.params)}")
        device = self.params[0].device
        totals = torch.zeros(len(steps), dtype=torch.float64, device=device)
        chunks = self._chunks(batch)
        if not chunks:
            return totals
        devices = _rng_devices(self.params)
        with self.preserved():
            origin = [p.detach().clone() for p in self.params]
            for chunk in chunks:
                rng = _get_rng(devices)
                if self.vectorize:
                    try:
                        totals += self._vmapped(chunk, origin, direction, steps)
                        continue
                    except (RuntimeError, NotImplementedError):  # an op vmap cannot batch, or out of memory
                        self.vectorize = False
                        _set_rng(rng, devices)
                for k, eta in enumerate(steps):
                    for p, w, d in zip(self.params, origin, direction, strict=True):
                        p.copy_(w - float(eta) * d.to(p.dtype))
                    _set_rng(rng, devices)
                    totals[k] += self._clipped(chunk).sum()
        return totals

    def _vmapped(
        self, chunk: Any, origin: list[Tensor], direction: Sequence[Tensor], steps: Sequence[float]
    ) -> Tensor:
        """All candidates of one chunk in one batched forward (``torch.func.vmap``, same randomness)."""
        names = {id(p): name for name, p in self.module.named_parameters()}
        if any(id(p) not in names for p in self.params):
            raise NotImplementedError("a probed tensor is not a parameter of the module")
        etas = torch.tensor([float(e) for e in steps], dtype=origin[0].dtype, device=origin[0].device)
        stacked = {
            f"inner.{names[id(p)]}": w.unsqueeze(0)
            - etas.view(-1, *([1] * w.dim())) * d.to(w.dtype).unsqueeze(0)
            for p, w, d in zip(self.params, origin, direction, strict=True)
        }
        wrapper = _LossCall(self)

        def total(params: dict[str, Tensor]) -> Tensor:
            return torch.func.functional_call(wrapper, params, (chunk,), strict=False)

        return torch.func.vmap(total, randomness="same")(stacked)


class _LossCall(nn.Module):
    """``functional_call`` target: its forward is the probe's clipped loss sum of the wrapped module."""

    def __init__(self, probe: LossProbe) -> None:
        super().__init__()
        self.inner = probe.module
        self.probe = probe

    def forward(self, chunk: Any) -> Tensor:
        return self.probe._clipped(chunk).sum()


def _no_log(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``LightningModule.log`` while probing: a private batch's loss is never logged."""
    del args, kwargs


_MISSING = object()


def _is_empty(batch: Any) -> bool:

    return isinstance(batch, EmptyBatch) or batch_length(batch) == 0
