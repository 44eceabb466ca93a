"""Every trainable parameter's whole gradient comes through a per-example path.

The proof clips each example's gradient; a parameter no path covers would be stepped with noise only or
its raw gradient, and a part of a gradient the paths miss (a use outside the layer that holds the
parameter, a second-order term) would be released without clipping. These are refused before the release.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_dp.core.errors import DPConfigurationError


def refuse_uncovered(root: nn.Module, covered: Sequence[nn.Parameter]) -> None:
    """Every trainable parameter needs a per-example path; one without would get noise only. At least one
    parameter must be trainable."""
    held = set(covered)
    missing = [name for name, p in root.named_parameters() if p.requires_grad and p not in held]
    if missing:
        raise DPConfigurationError(
            f"No per-example gradient path covers the trainable parameters {missing}: they would receive "
            "noise only. Hold them in an nn.Module that uses them in its forward, or freeze them "
            "(requires_grad=False)."
        )
    if not covered:
        raise DPConfigurationError(
            "No parameter is trainable: every layer is frozen (requires_grad=False), so a private step "
            "would release nothing but noise. Unfreeze at least one layer."
        )


def refuse_unreached(names: list[str]) -> None:
    """Once, on the first batch: a parameter that got an ordinary gradient but no per-example one is used
    outside the forward of the layer that holds it (e.g. another module reads ``layer.weight``)."""
    if names:
        raise DPConfigurationError(
            f"The parameters {names} received a gradient but no per-example gradient: they are used "
            "outside the forward of the module that holds them (another module reads them, or the loss "
            "does). Call that module instead of reading its parameters, or freeze them."
        )


def missed_use_message(names: list[str]) -> str:
    """The refusal for parameters whose gradient the per-example capture misses in part. It holds no
    figure: the gap is computed from the batch's gradients, a statistic of private data."""
    return (
        f"The per-example gradients of the parameters {names} do not add up to their ordinary gradient"
        ": part of their gradient comes from a use outside the forward of the module that holds "
        "them (a tied output projection h @ emb.weight.T, a temperature or scale read in the loss, a weight "
        "penalty added to the loss), which per-example clipping cannot bound, so the private step would miss "
        "it. This step releases nothing. Use the parameter only through its module's call (tie the weight to an nn.Linear "
        "and call it; put a temperature in a module the forward calls), move weight penalties into the "
        "optimizer's weight_decay, or freeze the parameter. A loss summed over the batch needs "
        "DPStrategy(loss_reduction='sum')."
    )


def second_order_message() -> str:
    """The refusal for a loss that differentiates a gradient of the model again, on more than one example."""
    return (
        "The loss differentiates a gradient of the model again (torch.autograd.grad(..., create_graph=True): "
        "a WGAN-GP gradient penalty, an input-gradient regulariser): its per-example gradients cannot be "
        "taken from one backward over the batch, whose second-order terms the layer hooks do not see. This "
        "step releases nothing. Pass DPStrategy(checks=Checks(isolate_examples=True)): each example then runs through "
        "training_step alone and its per-example gradient is autograd's own, exact for any loss (one forward "
        "and backward per example)."
    )
