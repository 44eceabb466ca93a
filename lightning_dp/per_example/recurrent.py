"""Exact per-example gradients for recurrent and attention layers (tuple outputs, sequence-first).

``nn.RNN``/``nn.LSTM``/``nn.GRU``, ``nn.MultiheadAttention`` and ``nn.Transformer{Encoder,Decoder}Layer``
are swapped *in place* (``__class__``) for subclasses whose training forward is the same computation
written with explicit input projections, batch first. Each weight/bias pair is then the parameters of a
Linear over a sequence ("part"): an RNN's ``weight_ih`` sees the inputs and the gate gradients, its
``weight_hh`` the previous hidden states and the hidden-path gradients (collected through a zero
"probe" added at each step), attention's ``in_proj_weight`` the queries/keys/values. Parts reuse the
Linear kernels, so norms are exact and never need [B, *param.shape] tensors. The parameters, their
names and ``state_dict`` keys are untouched (checkpoints load into the original classes); evaluation and
no-grad forwards run the original implementation; :func:`unswap` restores the original classes.
The steps of a swapped RNN/LSTM/GRU run in one autograd Function, in :mod:`.recurrence`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from opacus.grad_sample import GradSampleHooks
from opacus.layers.dp_rnn import RNNLinear
from torch import Tensor, nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.per_example import kernels as fast_kernels
from lightning_dp.per_example.recurrence import Recurrence


class LinearPart(nn.Linear):
    """``F.linear`` with parameters borrowed from a swapped layer (not registered as its child)."""

    @classmethod
    def borrow(cls, weight: nn.Parameter, bias: nn.Parameter | None) -> LinearPart:
        part = cls.__new__(cls)
        nn.Module.__init__(part)
        part.out_features, part.in_features = weight.shape
        part.weight = weight
        part.register_parameter("bias", bias)
        return part


class HiddenPart(LinearPart):
    """The hidden-to-hidden weights of an RNN: called once on a [B, T, H] buffer that the recurrence
    fills with h_{t-1} as it runs; returns the zero probe [B, T, G] whose gradient is the hidden path's
    (an expanded zero: no memory, and nothing accumulates into a leaf)."""

    def forward(self, hidden: Tensor) -> Tensor:
        shape = (*hidden.shape[:-1], self.out_features)
        anchor = torch.zeros((), dtype=hidden.dtype, device=hidden.device, requires_grad=True)
        return _Probe.apply(anchor, shape)


class _Probe(torch.autograd.Function):
    """A zero tensor of ``shape`` that requires grad; its gradient reaches the hooks on it and stops there."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, shape: tuple[int, ...]) -> Tensor:
        del ctx
        return anchor.detach().expand(shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None]:
        del ctx, grad
        return None, None


# Parts and Linear-equivalent layers use the Linear kernels and Opacus's Linear formula.
for _linear_type in (LinearPart, HiddenPart, NonDynamicallyQuantizableLinear, RNNLinear):
    fast_kernels.FAST_CLIPPERS[_linear_type] = fast_kernels.FAST_CLIPPERS[nn.Linear]
    GradSampleHooks.GRAD_SAMPLERS.setdefault(_linear_type, GradSampleHooks.GRAD_SAMPLERS[nn.Linear])


def _refuse(layer: nn.Module, what: str, fix: str) -> DPConfigurationError:
    return DPConfigurationError(
        f"{type(layer).__name__} with {what} has no exact per-example gradients. {fix}"
    )


def _capturing(layer: nn.Module) -> bool:
    return layer.training and torch.is_grad_enabled()


# --------------------------------------------------------------------------------------------------
# RNN / LSTM / GRU
# --------------------------------------------------------------------------------------------------


class _RecurrentMixin(nn.RNNBase):
    """Unrolled batch-first forward of ``nn.RNNBase`` with the per-layer/direction Linear parts."""

    def dp_parts(self) -> list[tuple[str, LinearPart]]:
        parts: list[tuple[str, LinearPart]] | None = self.__dict__.get("_dp_parts")
        if parts is None:
            parts = []
            for layer in range(self.num_layers):
                for suffix in ("", "_reverse")[: 2 if self.bidirectional else 1]:
                    names = [f"{kind}_l{layer}{suffix}" for kind in ("ih", "hh")]
                    for kind, name in zip((LinearPart, HiddenPart), names, strict=True):
                        weight = getattr(self, f"weight_{name}")
                        bias = getattr(self, f"bias_{name}") if self.bias else None
                        parts.append((name, kind.borrow(weight, bias)))
            self.__dict__["_dp_parts"] = parts
        for _, part in parts:
            part.training = self.training
        return parts

    def forward(self, input: Any, hx: Any = None) -> Any:
        if not _capturing(self):
            return super().forward(input, hx)
        parts = dict(self.dp_parts())
        packed = isinstance(input, PackedSequence)
        if packed:
            x, lengths = pad_packed_sequence(input, batch_first=True)
            lengths = lengths.to(x.device)
        else:
            if input.dim() != 3:
                raise _refuse(self, "unbatched input", "Pass a batch: (B, T, features) or (T, B, features).")
            x, lengths = (input if self.batch_first else input.transpose(0, 1)), None
        B, T = x.shape[:2]
        directions = 2 if self.bidirectional else 1
        lstm = isinstance(self, nn.LSTM)
        h0, c0 = self._initial_state(hx, B, x, lstm)
        mask = None if lengths is None else (torch.arange(T, device=x.device) < lengths.unsqueeze(1))
        h_out, c_out = [], []
        for layer in range(self.num_layers):
            outputs = []
            for direction in range(directions):
                suffix = "_reverse" if direction else ""
                k = layer * directions + direction
                seq = x if not direction else _reverse(x, lengths)
                m = None if mask is None else mask.unsqueeze(2).to(x.dtype)
                out, h_n, c_n = self._run(
                    parts[f"ih_l{layer}{suffix}"], parts[f"hh_l{layer}{suffix}"], seq, h0[k], c0[k], m
                )
                outputs.append(out if not direction else _reverse(out, lengths))
                h_out.append(h_n)
                c_out.append(c_n)
            x = torch.cat(outputs, dim=2) if directions > 1 else outputs[0]
            if self.dropout and layer < self.num_layers - 1:
                x = F.dropout(x, self.dropout, training=True)
        h_n = torch.stack(h_out)
        state: Any = (h_n, torch.stack(c_out)) if lstm else h_n
        if packed:
            return _repack(x, input), state
        return (x if self.batch_first else x.transpose(0, 1)), state

    def _initial_state(self, hx: Any, B: int, x: Tensor, lstm: bool) -> tuple[Tensor, Tensor]:
        shape = (self.num_layers * (2 if self.bidirectional else 1), B, self.hidden_size)
        if hx is None:
            zeros = x.new_zeros(shape)
            return zeros, zeros
        h0, c0 = hx if lstm else (hx, hx)
        return h0, c0

    def _run(
        self, ih: LinearPart, hh: LinearPart, seq: Tensor, h: Tensor, c: Tensor, mask: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One layer and direction over [B, T, ·]: (outputs [B, T, H], h_T, c_T).

        The input path is one Linear over the whole sequence (``ih``: its output gradient is every
        step's gate gradient); the hidden path's per-step matmuls run inside
        :class:`~.recurrence.Recurrence`, which fills ``previous`` with h_{t-1} for ``hh`` and hands back
        the hidden path's gradients for all steps at once. No autograd graph per step: the backward runs
        back through time in one loop, as torch's own recurrent kernels do."""
        xi = ih(seq)  # [B, T, G]
        previous = seq.new_empty((*seq.shape[:2], self.hidden_size))
        probe = hh(previous)  # the hidden path's gradients; ``previous`` is filled by the recurrence
        return Recurrence.apply(self._kind(), xi, probe, h, c, hh.weight, hh.bias, mask, previous)

    def _kind(self) -> str:
        raise NotImplementedError


class DPRNN(_RecurrentMixin, nn.RNN):
    """``nn.RNN`` with the exact per-example parts (swapped in place; same parameters and keys)."""

    def _kind(self) -> str:
        return "rnn_tanh" if self.nonlinearity == "tanh" else "rnn_relu"


class DPLSTM(_RecurrentMixin, nn.LSTM):
    """``nn.LSTM`` with the exact per-example parts (swapped in place; same parameters and keys)."""

    def _kind(self) -> str:
        return "lstm"


class DPGRU(_RecurrentMixin, nn.GRU):
    """``nn.GRU`` with the exact per-example parts (swapped in place; same parameters and keys)."""

    def _kind(self) -> str:
        return "gru"


def _reverse(x: Tensor, lengths: Tensor | None) -> Tensor:
    """Each sequence of [B, T, ·] reversed within its own length (padding stays at the end)."""
    if lengths is None:
        return x.flip(1)
    T = x.shape[1]
    t = torch.arange(T, device=x.device).unsqueeze(0)
    index = torch.where(t < lengths.unsqueeze(1), lengths.unsqueeze(1) - 1 - t, t)
    return x.gather(1, index.unsqueeze(2).expand_as(x))


def _repack(padded: Tensor, like: PackedSequence) -> PackedSequence:
    """Batch-first padded outputs (original order) in the layout of the input ``like``."""
    order = like.sorted_indices
    ordered = padded if order is None else padded.index_select(0, order)
    steps = [ordered[: int(n), t] for t, n in enumerate(like.batch_sizes)]
    return PackedSequence(torch.cat(steps), like.batch_sizes, like.sorted_indices, like.unsorted_indices)


# --------------------------------------------------------------------------------------------------
# Multi-head attention and the Transformer layers
# --------------------------------------------------------------------------------------------------


class DPMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` whose projections are Linear calls the hooks see (swapped in place)."""

    def dp_parts(self) -> list[tuple[str, LinearPart]]:
        parts: list[tuple[str, LinearPart]] | None = self.__dict__.get("_dp_parts")
        if parts is None:
            assert self.in_proj_weight is not None
            parts = [("in_proj", LinearPart.borrow(self.in_proj_weight, self.in_proj_bias))]
            self.__dict__["_dp_parts"] = parts
        for _, part in parts:
            part.training = self.training
        return parts

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        if not _capturing(self):
            return super().forward(
                query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
            )
        if query.dim() != 3:
            raise _refuse(self, "unbatched input", "Pass a batch: (B, L, E) or (L, B, E).")
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        (in_proj,) = (part for _, part in self.dp_parts())
        E, L = self.embed_dim, query.shape[1]
        if query is key and key is value:
            q, k, v = in_proj(query).chunk(3, dim=2)
        else:  # one Linear over the three inputs stacked along the sequence; each keeps its block
            S = key.shape[1]
            projected = in_proj(torch.cat([query, key, value], dim=1))
            q, k, v = projected[:, :L, :E], projected[:, L : L + S, E : 2 * E], projected[:, L + S :, 2 * E :]
        out, weights = self._attend(q, k, v, key_padding_mask, attn_mask, is_causal, need_weights)
        out = self.out_proj(out)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        is_causal: bool,
        need_weights: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """Scaled dot-product attention over batch-first q [B, L, E], k/v [B, S, E] as torch computes it."""
        B, L, E = q.shape
        S, H = k.shape[1], self.num_heads
        heads = [t.reshape(B, -1, H, E // H).transpose(1, 2) for t in (q, k, v)]
        scores = heads[0] @ heads[1].transpose(2, 3) / math.sqrt(E // H)  # [B, H, L, S]
        if attn_mask is None and is_causal:
            attn_mask = torch.ones(L, S, dtype=torch.bool, device=q.device).triu(1)
        if attn_mask is not None:
            mask = attn_mask.reshape(B, H, L, S) if attn_mask.dim() == 3 else attn_mask
            scores = _masked(scores, mask)
        if key_padding_mask is not None:
            scores = _masked(scores, key_padding_mask.reshape(B, 1, 1, S))
        weights = scores.softmax(dim=-1)
        attended = F.dropout(weights, self.dropout, training=True) if self.dropout else weights
        out = (attended @ heads[2]).transpose(1, 2).reshape(B, L, E)
        return out, (weights if need_weights else None)


def _masked(scores: Tensor, mask: Tensor) -> Tensor:
    """Boolean masks exclude (True = masked out), float masks are added, as in torch's attention."""
    if mask.dtype == torch.bool:
        return scores.masked_fill(mask, float("-inf"))
    return scores + mask.to(scores.dtype)


@contextlib.contextmanager
def _batch_first(*layers: nn.MultiheadAttention) -> Iterator[None]:
    saved = [layer.batch_first for layer in layers]
    for layer in layers:
        layer.batch_first = True
    try:
        yield
    finally:
        for layer, flag in zip(layers, saved, strict=True):
            layer.batch_first = flag


class DPTransformerEncoderLayer(nn.TransformerEncoderLayer):
    """Sequence-first encoder layers run batch first, so their Linear/LayerNorm calls see the batch on
    dimension 0 (per-example, not per-position, gradients)."""

    def forward(self, src: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if not _capturing(self) or self.self_attn.batch_first or src.dim() != 3:
            return super().forward(src, *args, **kwargs)
        with _batch_first(self.self_attn):
            return super().forward(src.transpose(0, 1), *args, **kwargs).transpose(0, 1)


class DPTransformerDecoderLayer(nn.TransformerDecoderLayer):
    """Sequence-first decoder layers run batch first (see :class:`DPTransformerEncoderLayer`)."""

    def forward(self, tgt: Tensor, memory: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if not _capturing(self) or self.self_attn.batch_first or tgt.dim() != 3:
            return super().forward(tgt, memory, *args, **kwargs)
        with _batch_first(self.self_attn, self.multihead_attn):
            out = super().forward(tgt.transpose(0, 1), memory.transpose(0, 1), *args, **kwargs)
        return out.transpose(0, 1)


# --------------------------------------------------------------------------------------------------
# Swapping
# --------------------------------------------------------------------------------------------------

SWAPS: dict[type[nn.Module], type[nn.Module]] = {
    nn.RNN: DPRNN,
    nn.LSTM: DPLSTM,
    nn.GRU: DPGRU,
    nn.MultiheadAttention: DPMultiheadAttention,
    nn.TransformerEncoderLayer: DPTransformerEncoderLayer,
    nn.TransformerDecoderLayer: DPTransformerDecoderLayer,
}
"""Exact original type → the subclass swapped in (subclasses of these may change forward: not swapped)."""


def _check_swappable(name: str, module: nn.Module) -> None:
    """Refuse the options the swapped forward does not implement, naming the layer."""
    where = f"Layer {name or '<root>'}: "
    if isinstance(module, nn.LSTM) and module.proj_size:
        raise DPConfigurationError(
            where + "nn.LSTM with proj_size > 0 is not supported; use proj_size=0 "
            "and a Linear after the LSTM."
        )
    if isinstance(module, nn.MultiheadAttention) and (
        not module._qkv_same_embed_dim or module.bias_k is not None or module.add_zero_attn
    ):
        raise DPConfigurationError(
            where + "nn.MultiheadAttention with kdim/vdim different from embed_dim, add_bias_kv or "
            "add_zero_attn is not supported; project keys and values to embed_dim with Linear layers."
        )


def swap(root: nn.Module) -> list[tuple[nn.Module, type[nn.Module]]]:
    """Swap every exact RNN/LSTM/GRU/attention/Transformer layer of ``root`` in place; returns
    (module, original class) pairs for :func:`unswap`."""
    swapped = []
    for name, module in root.named_modules():
        target = SWAPS.get(type(module))
        if target is None or not any(p.requires_grad for p in module.parameters()):
            continue
        _check_swappable(name, module)
        swapped.append((module, type(module)))
        module.__class__ = target
    return swapped


def unswap(swapped: list[tuple[nn.Module, type[nn.Module]]]) -> None:
    """Give swapped layers back their original classes."""
    for module, original in swapped:
        module.__dict__.pop("_dp_parts", None)
        module.__class__ = original


def parts_of(module: nn.Module) -> list[tuple[str, LinearPart]] | None:
    """The Linear parts that carry a swapped layer's own parameters (None for other layers)."""
    parts = getattr(module, "dp_parts", None)
    return parts() if callable(parts) else None
