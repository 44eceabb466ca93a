"""A thin optimizer proxy: Lightning steps it like the user's optimizer, the step slot decides the move.

The private gradient is already in ``p.grad`` when the closure returns (the strategy privatises in
``post_backward``), so every Lightning hook after backward sees only private gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.engine import PrivateStepEngine


class DPOptimizer(Optimizer):
    """Wraps the user's optimizer; ``param_groups``/``state`` are shared, so LR schedulers keep working."""

    def __init__(
        self,
        optimizer: Optimizer,
        engine: PrivateStepEngine,
        after_closure: Callable[[], None] | None = None,
    ) -> None:  # no super().__init__: a proxy
        """``after_closure``: called once the closure ran (the backward, the release and Lightning's
        ``on_before_optimizer_step``), before the weights move: what the hooks wrote is read there."""
        if isinstance(optimizer, torch.optim.SparseAdam):
            raise DPConfigurationError(
                "SparseAdam steps only sparse gradients, but the private gradient is dense: the noise is added to "
                "every row of an embedding, not only the rows the batch looked up (keeping those rows alone "
                "would reveal which tokens the batch held). Build the embedding with sparse=False and use a "
                "dense optimizer (torch.optim.Adam or AdamW, SGD)."
            )
        self.original_optimizer = optimizer
        self.engine = engine
        self.after_closure = after_closure

    @property
    def optimizer(self) -> Optimizer:
        """The user's optimizer, where Lightning's callbacks look for a wrapped one (``LearningRateMonitor``
        logs ``lr-SGD``, not ``lr-DPOptimizer``), as they do for ``LightningOptimizer.optimizer``."""
        return self.original_optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.original_optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.original_optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.original_optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.original_optimizer.defaults = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none)
        if self.engine.grads is not None:
            self.engine.grads.clear()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            if self.after_closure is not None:
                self.after_closure()
        if self.engine.halted:  # the budget is spent: no release and no move (the strategy stops training)
            self.zero_grad()
            return loss
        if self.engine.pending_ctx is None:
            # No backward ran (training_step returned None, or the batch was empty): a skipped step
            # would reveal a data-dependent decision, so release a noise-only step instead.
            self.zero_grad()
            self.engine.noise_only_step()
        self.engine.apply_step(self.original_optimizer)
        return loss

    def __getstate__(self) -> dict[str, Any]:
        """A proxy pickles its own attributes (``torch.optim.Optimizer``'s would drop the wrapped optimizer)."""
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def state_dict(self) -> dict[str, Any]:
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.original_optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.original_optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"DPOptimizer({self.original_optimizer!r})"
