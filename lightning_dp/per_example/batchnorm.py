"""BatchNorm during a private step: a layer frozen in eval mode normalises each example with fixed statistics
(an affine map of that example alone) and trains; one that uses the batch's own statistics is refused."""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def uses_batch_statistics(layer: nn.Module) -> bool:
    """Whether a BatchNorm call normalises with the batch's own statistics (train mode, or no running
    statistics kept), as ``_BatchNorm.forward`` decides; in eval mode with running statistics it does not."""
    assert isinstance(layer, _BatchNorm)
    return layer.training or (layer.running_mean is None and layer.running_var is None)


def batch_statistics_message(names: list[str]) -> str:
    """The refusal for BatchNorm layers called with the batch's statistics during a private step."""
    return (
        f"The BatchNorm layers {names} normalised this step's batch with its own statistics (train mode, or "
        "track_running_stats=False): each example's output depends on the other examples of the batch, and "
        "the running statistics it updates are saved with the model without noise. This step releases "
        "nothing. Freeze them in eval mode, so that they normalise with their running statistics (an "
        "affine map of each example alone): layer.eval() in on_train_epoch_start (Lightning sets every "
        "module to train mode before each epoch), a BaseFinetuning callback whose finetune_function calls "
        "layer.eval() (freeze(..., train_bn=False) alone stops their weights but leaves them in train mode), "
        "or a train() override that keeps them in eval; their affine weights may keep training. Or replace "
        "them with GroupNorm, or pass DPStrategy(on_batchnorm='replace')."
    )
