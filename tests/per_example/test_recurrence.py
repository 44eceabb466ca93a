"""The swapped recurrent layers' one-Function recurrence (``recurrence.Recurrence``) in fp64: the same
outputs, final states and parameter gradients as torch's own ``nn.RNN``/``nn.LSTM``/``nn.GRU`` (padded
and packed sequences, both directions, several layers, a given initial state), and per-example gradients
equal to autograd on each example alone."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from lightning_dp.per_example import GradientCapture

CONFIGS = {
    "lstm": ("LSTM", {}),
    "lstm-2-layers-bidirectional": ("LSTM", {"num_layers": 2, "bidirectional": True}),
    "lstm-no-bias": ("LSTM", {"bias": False}),
    "gru": ("GRU", {}),
    "gru-bidirectional": ("GRU", {"bidirectional": True}),
    "gru-2-layers-no-bias": ("GRU", {"num_layers": 2, "bias": False}),
    "rnn-tanh": ("RNN", {}),
    "rnn-relu-bidirectional": ("RNN", {"nonlinearity": "relu", "bidirectional": True}),
}
LENGTHS = torch.tensor([3, 6, 2, 5])


def _loss(rnn: nn.Module, x: Tensor, packed: bool, state: object, lengths: Tensor = LENGTHS) -> Tensor:
    """A loss on every output and on the final states (h and, for an LSTM, c), with distinct weights."""
    inp = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False) if packed else x
    out, final = rnn(inp, state)
    if packed:
        out = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0]
    weights = torch.linspace(-1, 1, out[0].numel(), dtype=out.dtype).view_as(out[0])
    loss = (out * weights).sum() + (final[0] if isinstance(final, tuple) else final).square().sum()
    if isinstance(final, tuple):
        loss = loss + 0.3 * final[1].sum()
    return loss


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_recurrence_equals_torch_s_and_its_per_example_gradients_are_exact(
    config: str, packed: bool
) -> None:
    kind, options = CONFIGS[config]
    torch.manual_seed(0)
    reference = getattr(nn, kind)(5, 7, batch_first=True, **options).double()
    swapped = copy.deepcopy(reference)
    x = torch.randn(4, 6, 5, dtype=torch.float64)
    layers = reference.num_layers * (2 if reference.bidirectional else 1)
    h0 = torch.randn(layers, 4, 7, dtype=torch.float64, requires_grad=True)
    state: object = (h0, torch.randn(layers, 4, 7, dtype=torch.float64)) if kind == "LSTM" else h0

    expected_loss = _loss(reference, x, packed, state)
    expected_loss.backward()
    expected_h0 = h0.grad.clone()
    h0.grad = None
    params = [p for p in reference.parameters()]
    per_example = [
        torch.autograd.grad(
            _loss(reference, x[i : i + 1], packed, _rows(state, i), LENGTHS[i : i + 1]),
            params,
            allow_unused=True,
        )
        for i in range(4)
    ]

    capture = GradientCapture(swapped, loss_reduction="sum")
    try:
        loss = _loss(swapped, x, packed, state)
        loss.backward()
        samples, n = capture.collect()
        full = dict(zip(samples.params, samples.materialize(), strict=True))
        norms = samples.sq_norms()
    finally:
        capture.remove()
    assert type(swapped) is type(reference)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h0.grad, expected_h0, rtol=1e-10, atol=1e-12)
    for p, q in zip(reference.parameters(), swapped.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12)  # autograd's, through the Function
    assert n == 4
    for i, grads in enumerate(per_example):  # the fast path's kernels run in fp32
        total = 0.0
        for p, g in zip(swapped.parameters(), grads, strict=True):
            g = torch.zeros_like(p) if g is None else g
            total += float(g.square().sum())
            scale = float(g.abs().max()) + 1e-9
            assert float((full[p][i].double() - g).abs().max()) <= 1e-5 * scale
        assert float(norms[i]) >= total * (1 - 1e-6)  # certified: never below


def _rows(state: object, i: int) -> object:
    """Example i's initial state (batch on dim 1)."""
    if isinstance(state, tuple):
        return tuple(s[:, i : i + 1] for s in state)
    assert isinstance(state, Tensor)
    return state[:, i : i + 1]


def test_the_hidden_weights_get_no_autograd_gradient_when_frozen() -> None:
    """Book-keeping freezes the layer's weights during its forward: the Function then skips W_hh's
    own gradient (one matmul over all steps), and the per-example path still has everything."""
    torch.manual_seed(0)
    lstm = nn.LSTM(3, 4, batch_first=True)
    capture = GradientCapture(lstm)
    capture.skip_param_grads = True
    try:
        out, _ = lstm(torch.randn(2, 5, 3))
        out.sum().backward()
        samples, _ = capture.collect()
        assert all(p.grad is None for p in lstm.parameters())
        assert bool((samples.sq_norms() > 0).all())
    finally:
        capture.remove()
