"""BatchNorm during a private step: a layer frozen in eval mode normalises each example with fixed statistics
(an affine map of that example alone) and trains; one that uses the batch's own statistics is refused."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def uses_batch_statistics(layer: nn.Module) -> bool:
    """Whether a BatchNorm call normalises with the batch's own statistics (train mode, or no running
    statistics kept), as ``_BatchNorm.forward`` decides; in eval mode with running statistics it does not."""
    assert isinstance(layer, _BatchNorm)
    return layer.training or (layer.running_mean is None and layer.running_var is None)


def _stat_versions(layer: nn.Module) -> tuple[int, ...]:
    """In-place versions of a BatchNorm's running statistics (an update bumps them)."""
    return tuple(b._version for b in layer.buffers(recurse=False))


class BatchNormCalls:
    """The BatchNorm calls of a private step: which used the batch's statistics or moved their running ones."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.names: dict[nn.Module, str] = {
            m: name for name, m in root.named_modules() if isinstance(m, _BatchNorm)
        }
        self.normalised: dict[nn.Module, tuple[int, ...]] = {}
        """BatchNorm layers called since the last ``take``, with their running statistics' versions then."""
        self.batch_statistics: list[str] = []
        """BatchNorm layers called with the batch's own statistics since the last ``take``."""

    def note(self, module: nn.Module) -> None:
        """A BatchNorm call (its pre-hook, while the capture records): in a private step, with the batch's
        statistics it mixes the examples; frozen in eval mode its running statistics must stay as they are."""
        if not (self.root.training and torch.is_grad_enabled()):
            return
        if uses_batch_statistics(module):
            self.batch_statistics.append(self.names[module])
        self.normalised.setdefault(module, _stat_versions(module))

    def take(self) -> list[str]:
        """The layers that mixed this step's examples (batch statistics, or running statistics moved), once
        each, and a fresh start."""
        names = list(dict.fromkeys(self.batch_statistics))
        names += [self.names[m] for m, v in self.normalised.items() if _stat_versions(m) != v]
        self.batch_statistics, self.normalised = [], {}
        return list(dict.fromkeys(names))

    def forget(self) -> None:
        """A new forward starts (``expect_batch``): nothing noted yet."""
        self.batch_statistics, self.normalised = [], {}
