"""The swapped RNN/LSTM/GRU layers' steps in one autograd Function (:class:`Recurrence`).

One layer and direction runs over all T steps without an autograd graph per step: the forward keeps the
gate activations (and LSTM cells, GRU's hidden candidate), and the backward goes back through time once,
as torch's own recurrent kernels do, handing the input path's and the hidden path's gate gradients for
every step to the Linear parts of :mod:`.recurrent`, which turn them into per-example weight gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class Recurrence(torch.autograd.Function):
    """One recurrent layer and direction over all T steps, given the input path's pre-activations.

    forward(kind, xi [B, T, G], probe [B, T, G] (zeros), h0, c0 [B, H], W_hh [G, H], b_hh, mask [B, T, 1]
    or None, previous [B, T, H]) → (out [B, T, H], h_T, c_T). Per step the hidden path is
    h_{t-1} W_hhᵀ + b_hh (+ probe_t, zero), then the cell of ``kind`` ("lstm", "gru", "rnn_tanh",
    "rnn_relu", torch's gate order); ``previous`` receives h_{t-1}. Padded steps (mask 0) keep the state
    and output zero. The steps run without autograd; the backward goes back through time once and returns
    the gradients of xi (the input path's gate gradients) and of the probe (the hidden path's: the same
    for LSTM and RNN, r ⊙ δn on GRU's candidate gate) for every step, which the Linear parts turn into
    per-example weight gradients over the whole sequence at once. W_hh's and b_hh's own gradients (one
    matmul over all steps) are computed only when autograd asks for them.
    """

    @staticmethod
    def forward(
        ctx: Any,
        kind: str,
        xi: Tensor,
        probe: Tensor,
        h0: Tensor,
        c0: Tensor,
        w_hh: Tensor,
        b_hh: Tensor | None,
        mask: Tensor | None,
        previous: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        del probe  # zeros: only its gradient matters
        keep = None if mask is None else (mask != 0).transpose(0, 1)  # [T, B, 1] bool
        state = _forward_steps(kind, xi.transpose(0, 1), h0, c0, w_hh, b_hh, keep, previous)
        out, h, c = state.out, state.h, state.c
        ctx.kind = kind
        ctx.save_for_backward(h0, c0, w_hh, mask, previous, out, state.acts, state.cells, state.extra)
        ctx.set_materialize_grads(False)
        if kind != "lstm":  # no cell state
            c = c0.new_empty(0)
            ctx.mark_non_differentiable(c)
        return out.transpose(0, 1), h, c

    @staticmethod
    def backward(ctx: Any, g_out: Tensor | None, g_h: Tensor | None, g_c: Tensor | None) -> tuple[Any, ...]:
        h0, c0, w_hh, mask, previous, out, acts, cells, extra = ctx.saved_tensors
        kind = ctx.kind
        keep = None if mask is None else (mask != 0).transpose(0, 1)  # [T, B, 1]
        go = None if g_out is None else g_out.transpose(0, 1)  # [T, B, H]
        if keep is not None and go is not None:
            go = go * keep  # padded steps output zero: no gradient reaches their state from there
        dh = torch.zeros_like(h0) if g_h is None else g_h
        saved = _Steps(out, dh, c0, acts, cells, extra)
        if kind == "lstm":
            dc = torch.zeros_like(c0) if g_c is None else g_c
            d_in, d_hid, dh, dc = _lstm_backward(saved, dc, go, w_hh, keep)
        elif kind == "gru":
            d_in, d_hid, dh = _gru_backward(saved, go, w_hh, keep, previous)
            dc = None
        else:
            d_in, d_hid, dh = _rnn_backward(saved, kind, go, w_hh, keep)
            dc = None
        g_xi, g_probe = d_in.transpose(0, 1), d_hid.transpose(0, 1)
        g_w = g_b = None
        T, B, G = d_hid.shape
        if ctx.needs_input_grad[5]:  # W_hh: Σ over examples and steps of δhidden_t h_{t-1}ᵀ, one matmul
            g_w = d_hid.reshape(T * B, G).t() @ previous.transpose(0, 1).reshape(T * B, -1)
        if ctx.needs_input_grad[6]:
            g_b = d_hid.sum((0, 1))
        g_h0 = dh if ctx.needs_input_grad[3] else None
        g_c0 = dc if ctx.needs_input_grad[4] else None
        return None, g_xi, g_probe, g_h0, g_c0, g_w, g_b, None, None


class _Steps:
    """What the forward of :class:`Recurrence` keeps, time-major: the outputs [T, B, H], the final
    state (h, c), the gate activations (LSTM i, f, g, o; GRU r, z, n) [T, B, G], the LSTM cells c_t
    [T, B, H] and GRU's hidden candidate W_hn h_{t-1} + b_hn [T, B, H]."""

    def __init__(
        self,
        out: Tensor,
        h: Tensor,
        c: Tensor,
        acts: Tensor | None = None,
        cells: Tensor | None = None,
        extra: Tensor | None = None,
    ) -> None:
        self.out, self.h, self.c, self.acts, self.cells, self.extra = out, h, c, acts, cells, extra


def _forward_steps(
    kind: str,
    xs: Tensor,
    h: Tensor,
    c: Tensor,
    w_hh: Tensor,
    b_hh: Tensor | None,
    keep: Tensor | None,
    previous: Tensor,
) -> _Steps:
    """The recurrence over xs [T, B, G] (time-major view of the input path's pre-activations)."""
    T, B, G = xs.shape
    H = w_hh.shape[1]
    w_t = w_hh.t()
    out = xs.new_empty((T, B, H))
    if kind != "gru" and b_hh is not None:  # the hidden bias joins the input path once, not per step
        xs = xs + b_hh
    acts = xs.new_empty((T, B, G)) if kind in ("lstm", "gru") else None
    cells = xs.new_empty((T, B, H)) if kind == "lstm" else None
    hns = xs.new_empty((T, B, H)) if kind == "gru" else None
    for t in range(T):
        previous[:, t] = h
        if kind == "lstm":
            assert acts is not None
            gates = torch.addmm(xs[t], h, w_t, out=acts[t])
            gates[:, 2 * H : 3 * H].tanh_()
            gates[:, : 2 * H].sigmoid_()
            gates[:, 3 * H :].sigmoid_()
            i, f, g, o = gates.chunk(4, dim=1)
            c_new = torch.addcmul(f * c, i, g)
            h_new = o * torch.tanh(c_new)
        elif kind == "gru":
            assert acts is not None
            assert hns is not None
            hidden = torch.addmm(b_hh, h, w_t) if b_hh is not None else h @ w_t
            gates = acts[t]
            torch.add(xs[t, :, : 2 * H], hidden[:, : 2 * H], out=gates[:, : 2 * H]).sigmoid_()
            r, z = gates[:, :H], gates[:, H : 2 * H]
            hns[t] = hidden[:, 2 * H :]
            n = torch.tanh(torch.addcmul(xs[t, :, 2 * H :], r, hidden[:, 2 * H :]), out=gates[:, 2 * H :])
            h_new, c_new = torch.lerp(n, h, z), c  # (1 − z)·n + z·h
        else:
            pre = torch.addmm(xs[t], h, w_t)
            h_new, c_new = (pre.tanh_() if kind == "rnn_tanh" else pre.relu_()), c
        if keep is not None:  # padded steps keep the state, output zero
            h_new = torch.where(keep[t], h_new, h)
            if cells is not None:
                c_new = torch.where(keep[t], c_new, c)
            torch.mul(h_new, keep[t], out=out[t])
        else:
            out[t] = h_new
        if cells is not None:
            cells[t] = c_new
        h, c = h_new, c_new
    return _Steps(out, h, c, acts, cells, hns)


def _lstm_backward(
    saved: _Steps, dc: Tensor, go: Tensor | None, w_hh: Tensor, keep: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Back through an LSTM's steps: (δgates [T, B, 4H] for both paths, the same tensor twice, δh_0, δc_0).

    Per step δc_t = δc + δh·o·(1 − tanh²c_t), the pre-activation gradients are δc_t ⊙ (g, c_{t−1}, i)
    and δh ⊙ tanh c_t times the gates' slopes, then δc ← δc_t ⊙ f, δh ← δgates W_hh: those factors are
    formed for all steps at once first, so a step is six small operations."""
    acts, cells, dh = saved.acts, saved.cells, saved.h
    assert acts is not None
    assert cells is not None
    T, B, G = acts.shape
    H = G // 4
    i, f, g, o = acts.split(H, dim=2)
    tanh_c = cells.tanh()
    c_prev = torch.cat([saved.c.unsqueeze(0), cells[:-1]])
    # δc_t ⊙ [g·i(1−i), c_{t−1}·f(1−f), i·(1−g²)] and δh ⊙ tanh c_t·o(1−o): the factors, [T, B, 3, H]
    factors = torch.stack([g * i * (1 - i), c_prev * f * (1 - f), i * (1 - g.square())], dim=2)
    out_factor = tanh_c * o * (1 - o)
    o_dtanh = o * (1 - tanh_c.square())
    d_gates = acts.new_empty((T, B, G))
    for t in reversed(range(T)):
        if go is not None:
            dh = dh + go[t]
        dc_t = torch.addcmul(dc, dh, o_dtanh[t])
        d = d_gates[t]
        torch.mul(factors[t], dc_t.unsqueeze(1), out=d[:, : 3 * H].view(B, 3, H))
        torch.mul(dh, out_factor[t], out=d[:, 3 * H :])
        dc_prev = dc_t * f[t]
        back = d @ w_hh
        if keep is not None:  # a padded step passed the state through unchanged
            d.mul_(keep[t])
            back = torch.where(keep[t], back, dh)
            dc_prev = torch.where(keep[t], dc_prev, dc)
        dh, dc = back, dc_prev
    return d_gates, d_gates, dh, dc


def _gru_backward(
    saved: _Steps, go: Tensor | None, w_hh: Tensor, keep: Tensor | None, previous: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Back through a GRU's steps: (δ input path [T, B, 3H], δ hidden path [T, B, 3H], δh_0); the hidden
    path's candidate block is r ⊙ δn (the reset gate scales W_hn h + b_hn)."""
    acts, hns, dh = saved.acts, saved.extra, saved.h
    assert acts is not None
    assert hns is not None
    T, B, G = acts.shape
    H = G // 3
    r, z, n = acts.split(H, dim=2)
    h_prev = previous.transpose(0, 1)  # [T, B, H] view
    slope = acts * (1 - acts)
    slope[:, :, 2 * H :] = 1 - n.square()
    d_in = acts.new_empty((T, B, G))
    d_hid = acts.new_empty((T, B, G))
    for t in reversed(range(T)):
        if go is not None:
            dh = dh + go[t]
        d, dhid = d_in[t], d_hid[t]
        torch.mul(dh, h_prev[t] - n[t], out=d[:, H : 2 * H])  # δz
        torch.mul(dh, 1 - z[t], out=d[:, 2 * H :])  # δn
        d[:, H:].mul_(slope[t, :, H:])
        torch.mul(d[:, 2 * H :], hns[t], out=d[:, :H])  # δr
        d[:, :H].mul_(slope[t, :, :H])
        dhid[:, : 2 * H] = d[:, : 2 * H]
        torch.mul(d[:, 2 * H :], r[t], out=dhid[:, 2 * H :])
        back = torch.addmm(dh * z[t], dhid, w_hh)
        if keep is not None:
            d.mul_(keep[t])
            dhid.mul_(keep[t])
            back = torch.where(keep[t], back, dh)
        dh = back
    return d_in, d_hid, dh


def _rnn_backward(
    saved: _Steps, kind: str, go: Tensor | None, w_hh: Tensor, keep: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Back through a tanh or ReLU RNN's steps: (δ pre-activations [T, B, H] for both paths, δh_0)."""
    out, dh = saved.out, saved.h
    # out_t = h_t on the steps that count (padded steps are masked below)
    slope = 1 - out.square() if kind == "rnn_tanh" else (out > 0).to(out.dtype)
    d_pre = out.new_empty(out.shape)
    for t in reversed(range(out.shape[0])):
        if go is not None:
            dh = dh + go[t]
        d = torch.mul(dh, slope[t], out=d_pre[t])
        back = d @ w_hh
        if keep is not None:
            d.mul_(keep[t])
            back = torch.where(keep[t], back, dh)
        dh = back
    return d_pre, d_pre, dh
