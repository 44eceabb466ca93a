"""Losses that keep each example's gradient a function of that example alone (see docs/writing-a-loss.md)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def per_example_token_loss(
    logits: Tensor, labels: Tensor, ignore_index: int = -100, shift: bool = False
) -> Tensor:
    """One loss per example: the mean cross-entropy over that example's own labelled tokens.

    ``logits`` is [B, T, V] (batch first, as Hugging Face models return them), ``labels`` is [B, T];
    tokens labelled ``ignore_index`` (padding, prompts) count for nothing, and an example with no
    labelled token has loss 0. ``shift=True`` predicts token t+1 from position t (causal language
    models: ``logits[:, :-1]`` against ``labels[:, 1:]``). Return ``.mean()`` of the result from
    ``training_step``: unlike a mean over all the batch's tokens, it never weighs one example by the
    others' lengths, so the privacy guarantee holds.

    Args:
        logits: [B, T, V], batch first.
        labels: [B, T] token ids; ``ignore_index`` marks tokens that count for nothing.
        ignore_index: the label of ignored tokens (default -100, Hugging Face's).
        shift: predict token t+1 from position t (causal language models; default False).

    Returns:
        [B], each example's mean loss over its own labelled tokens (0 for an example with none).
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"per_example_token_loss expects logits [B, T, V] and labels [B, T], got {tuple(logits.shape)} "
            f"and {tuple(labels.shape)}."
        )
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    batch, length, vocab = logits.shape
    token_losses = F.cross_entropy(
        logits.reshape(batch * length, vocab).float(),
        labels.reshape(batch * length),
        ignore_index=ignore_index,
        reduction="none",
    ).view(batch, length)
    counted = (labels != ignore_index).sum(dim=1)
    return token_losses.sum(dim=1) / counted.clamp(min=1).to(token_losses.dtype)
