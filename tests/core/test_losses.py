"""``per_example_token_loss``: each example's own token mean, the fix the mixing check's refusal names."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_dp import per_example_token_loss


def test_per_example_token_loss_is_each_examples_own_token_mean():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g)
    labels = torch.randint(0, 7, (3, 5), generator=g)
    labels[0, 2:] = -100  # padding
    labels[2] = -100  # no labelled token at all
    losses = per_example_token_loss(logits, labels)
    assert losses.shape == (3,)
    torch.testing.assert_close(losses[0], F.cross_entropy(logits[0, :2], labels[0, :2]))
    torch.testing.assert_close(losses[1], F.cross_entropy(logits[1], labels[1]))
    assert losses[2] == 0
    custom = labels.masked_fill(labels == -100, 0)
    custom[0, 2:] = 0
    assert not torch.equal(per_example_token_loss(logits, custom, ignore_index=0), losses)


def test_per_example_token_loss_shifts_for_causal_models():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 9, generator=g)
    tokens = torch.randint(0, 9, (2, 6), generator=g)
    shifted = per_example_token_loss(logits, tokens, shift=True)
    torch.testing.assert_close(shifted, per_example_token_loss(logits[:, :-1], tokens[:, 1:]))
    for i in range(2):
        assert math.isclose(
            float(shifted[i]), float(F.cross_entropy(logits[i, :-1], tokens[i, 1:])), rel_tol=1e-6
        )
    with pytest.raises(ValueError, match=r"logits \[B, T, V\]"):
        per_example_token_loss(logits[:, 0], tokens)
