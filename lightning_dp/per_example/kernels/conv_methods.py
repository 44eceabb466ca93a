"""The convolution norm methods: Gram, position Gram, unfold, batch-grouped and correlate, chunked to a
memory budget. All give the same norms up to fp32 rounding; :mod:`.conv_autotune` picks one.

A little over 500 lines: the norm methods and the clipped-sum methods beside them (``CONV_SUMS``) share
the patch layouts, the live taps and the chunking, and each method is a few lines."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn import grad as nn_grad

from lightning_dp.per_example.kernels.certified import (
    certified_sq_norms,
    fold_weights,
    gram_certified,
    gram_sq_norm,
    mask_rows,
    rounding_gamma,
    sum_bound,
)
from lightning_dp.per_example.materialized import materialized_sq_norm, materialized_weighted

ConvLayer = nn.Conv1d | nn.Conv2d


def _conv_padded_input(layer: ConvLayer, x: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Input in ``dtype`` (fp32) padded exactly as the layer pads it (zeros, reflect, ..., 'same' possibly
    asymmetric)."""
    x = x.to(dtype)
    pad = list(layer._reversed_padding_repeated_twice)
    if not any(pad):
        return x
    return F.pad(x, pad, mode="constant" if layer.padding_mode == "zeros" else layer.padding_mode)


def _channel_last(layer: ConvLayer, x: Tensor) -> Tensor:
    """The fp32 input [B, *spatial, C], contiguous, padded exactly as the layer pads it."""
    pad = list(layer._reversed_padding_repeated_twice)
    if any(pad) and layer.padding_mode == "zeros":  # one copy: pad the channel-last view directly
        return F.pad(x.float().movedim(1, -1), [0, 0, *pad]).contiguous()
    return _conv_padded_input(layer, x).movedim(1, -1).contiguous()


def _conv_patches(layer: ConvLayer, x: Tensor) -> Tensor:
    """Unfolded input patches [B, G, L, prod(kernel)·C_in/G] in fp32, columns in (kernel, channel) order.

    Gathered from strided ``Tensor.unfold`` views of the channel-last input with one copy: each
    kernel row is then a contiguous run of k·C floats, 2–3× faster than ``F.unfold``'s (channel,
    kernel) order on CPU. Dilation is a window of span (k-1)·d+1 sampled every d.
    """
    n, G = len(layer.kernel_size), layer.groups
    x = _channel_last(layer, x)
    for i, (k, s, d) in enumerate(zip(layer.kernel_size, layer.stride, layer.dilation)):
        x = x.unfold(1 + i, (k - 1) * d + 1, s)  # [B, *out, C, *window]
    if any(d > 1 for d in layer.dilation):
        every_d: tuple[Any, ...] = (Ellipsis, *(slice(None, None, d) for d in layer.dilation))
        x = x[every_d]
    B, out, C = x.shape[0], x.shape[1 : 1 + n], x.shape[1 + n]
    # [B, *out, G, C/G, *kernel] -> [B, G, *out, *kernel, C/G] -> [B, G, L, prod(kernel)·C/G]
    x = x.unflatten(1 + n, (G, C // G))
    x = x.permute(0, 1 + n, *range(1, 1 + n), *range(3 + n, 3 + 2 * n), 2 + n)
    return x.reshape(B, G, math.prod(out), math.prod(layer.kernel_size) * (C // G))


def _conv_inputs(layer: ConvLayer, x: Tensor, backprops: Tensor) -> tuple[Tensor, Tensor]:
    """Patches [B, G, L, p/G] (see :func:`_conv_patches`) and backprops [B, G, L, o/G] per group, fp32."""
    B, G, L = backprops.shape[0], layer.groups, math.prod(backprops.shape[2:])
    d = backprops.float().reshape(B, G, layer.out_channels // G, L)
    return _conv_patches(layer, x), d.transpose(2, 3)


@dataclass(frozen=True)
class LiveTaps:
    """The kernel offsets of a zero-padded convolution that ever touch the input, when some never do.

    On a map no larger than the kernel's reach (a 3×3 kernel on ResNet's 1×1 maps, ConvNeXt's depthwise
    7×7 on 2×2 maps) an offset that only ever meets zero padding has a per-example gradient of exactly 0.
    The live offsets form the ``core`` convolution, unpadded, over the input cropped (padded with zeros
    where it runs past the edge) to what they read: its per-example gradients are the layer's at those
    offsets, so the norms are the same and the clipped sum is the core's sum with zeros around it.
    """

    ranges: tuple[tuple[int, int], ...]
    """Per spatial dimension, the first and one past the last live offset."""
    pads: tuple[int, ...]
    """``F.pad`` widths (last dimension first; negative ones crop) that turn the input into the core's."""
    core: ConvLayer
    """The convolution of the live offsets: stride and dilation of the layer, no padding (meta device)."""

    def input(self, x: Tensor) -> Tensor:
        """The layer's input [B, C, *spatial] as the core convolution reads it."""
        return F.pad(x, list(self.pads))

    def embed(self, core_grad: Tensor, layer: ConvLayer) -> Tensor:
        """The layer's weight gradient from the core's: zero at every dead offset."""
        full = core_grad.new_zeros(layer.weight.shape)
        full[(slice(None), slice(None), *(slice(a, b) for a, b in self.ranges))] = core_grad
        return full


def live_taps(layer: ConvLayer, x: Tensor, backprops: Tensor) -> LiveTaps | None:
    """The layer's :class:`LiveTaps` on this input, or None when every offset can touch it (or the padding
    is not zeros: reflected or circular padding repeats the input)."""
    if layer.padding_mode != "zeros":
        return None
    reversed_pads = layer._reversed_padding_repeated_twice
    n = len(layer.kernel_size)
    ranges, pads = [], []
    for i in range(n):
        size, out, pad = x.shape[2 + i], backprops.shape[2 + i], reversed_pads[2 * (n - 1 - i)]
        k, s, d = layer.kernel_size[i], layer.stride[i], layer.dilation[i]
        # offset j reads s·t + d·j − pad at output t ∈ [0, out): live iff one of those is in [0, size)
        live = [
            j
            for j in range(k)
            if max(0, -((d * j - pad) // s)) <= min(out - 1, (size - 1 + pad - d * j) // s)
        ]
        if not live:  # no offset reaches the input: keep the layer as it is
            return None
        first, last = live[0], live[-1]
        ranges.append((first, last + 1))
        start, stop = d * first - pad, s * (out - 1) + d * last - pad  # the input positions the core reads
        pads.append((-start, stop - (size - 1)))
    if all(r == (0, k) for r, k in zip(ranges, layer.kernel_size, strict=True)):
        return None
    flat_pads = tuple(w for left_right in reversed(pads) for w in left_right)
    kernel = tuple(b - a for a, b in ranges)
    core = _core_conv(
        isinstance(layer, nn.Conv2d),
        layer.in_channels,
        layer.out_channels,
        kernel,
        layer.stride,
        layer.dilation,
        layer.groups,
    )
    return LiveTaps(tuple(ranges), flat_pads, core)


@functools.lru_cache(maxsize=256)
def _core_conv(
    two_d: bool,
    c_in: int,
    c_out: int,
    kernel: tuple[int, ...],
    stride: tuple[int, ...],
    dilation: tuple[int, ...],
    groups: int,
) -> ConvLayer:
    """A weightless (meta) convolution of the given geometry: what the methods read of a layer."""
    conv: Any = nn.Conv2d if two_d else nn.Conv1d
    return conv(c_in, c_out, kernel, stride, 0, dilation, groups, bias=False, device="meta")


ConvMethod = Literal[
    "gram",
    "position-gram",
    "unfold",
    "grouped",
    "correlate",
    "unfold-norms",
    "grouped-norms",
    "correlate-norms",
]
CONV_METHODS: tuple[ConvMethod, ...] = (
    "gram", "position-gram", "unfold", "grouped", "correlate", "unfold-norms", "grouped-norms", "correlate-norms"
)  # fmt: skip


def conv_weight_grad(
    layer: ConvLayer,
    x: Tensor,
    grad_output: Tensor,
    groups: int,
    shape: Any,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The layer's weight-gradient convolution on its input in ``dtype`` (fp32; zero padding done by the
    convolution itself, other padding modes and 'same' padded here first)."""
    conv_weight = nn_grad.conv1d_weight if isinstance(layer, nn.Conv1d) else nn_grad.conv2d_weight
    padding: Any = layer.padding
    if layer.padding_mode == "zeros" and not isinstance(padding, str):
        x = x.to(dtype)
    else:
        x, padding = _conv_padded_input(layer, x, dtype), 0
    return conv_weight(
        x, shape, grad_output, stride=layer.stride, padding=padding, dilation=layer.dilation, groups=groups
    )


def conv_samples_grouped(
    layer: ConvLayer, x: Tensor, backprops: Tensor, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Per-example weight gradients [B, *weight.shape] in ``dtype`` (fp32; fp64 for the guard's exact
    recompute) from ONE weight-gradient convolution with the batch folded into the channels (B·groups
    groups): no unfolded patches, no per-example bmm."""
    B = backprops.shape[0]
    if B == 0:
        return backprops.new_zeros((0, *layer.weight.shape), dtype=dtype)
    xb = x.reshape(1, B * x.shape[1], *x.shape[2:])
    db = backprops.to(dtype).reshape(1, B * backprops.shape[1], *backprops.shape[2:])
    shape = (B * layer.out_channels, *layer.weight.shape[1:])
    return conv_weight_grad(layer, xb, db, B * layer.groups, shape, dtype).view(B, *layer.weight.shape)


def _conv_exact_sq_norms(layer: ConvLayer, x: Tensor, backprops: Tensor) -> Tensor:
    """Exact squared weight-gradient norms (fp64) of a few examples: the guard's recompute."""
    return conv_samples_grouped(layer, x, backprops, torch.float64).flatten(1).square().sum(1)


def conv_spread(layer: ConvLayer, x: Tensor, backprops: Tensor) -> Tensor:
    """Σ_t ‖a_t‖‖δ_t‖ ≤ √K ‖x_padded‖‖δ‖ per example (Cauchy–Schwarz; an input position lies in at most
    K = prod(kernel) patches), from two norms per example instead of the patches."""
    xp = x.float() if layer.padding_mode == "zeros" else _conv_padded_input(layer, x)
    K = math.prod(layer.kernel_size)
    return math.sqrt(K) * xp.flatten(1).norm(dim=1) * backprops.float().flatten(1).norm(dim=1)


def conv_sum_err(layer: ConvLayer, x: Tensor, backprops: Tensor) -> Tensor:
    """Rounding bound of per-example weight gradients summed over the L output positions in fp32:
    γ_L Σ_t ‖a_t‖‖δ_t‖ (bounded by :func:`conv_spread`)."""
    return rounding_gamma(math.prod(backprops.shape[2:])) * conv_spread(layer, x, backprops)


def _conv_samples_correlate(layer: ConvLayer, x: Tensor, backprops: Tensor) -> Tensor:
    """Per-example weight gradients [B, *weight.shape] from ONE forward convolution: each example's
    padded input channel correlated with that example's output gradients as the kernel.

    g[b, o, c, k] = Σ_t δ[b, o, t] · x[b, c, stride·t + dilation·k], a correlation over x whose kernel
    δ is dilated by the layer's stride and which steps by the layer's dilation; one group per (example,
    input channel). oneDNN runs this forward convolution 2× faster than the batch-grouped
    weight-gradient one for a first layer on grey images (CNN conv1: 2.5 vs 5.9 ms). With C/G > 1
    input channels per group the output gradients are repeated C/G times, so it pays for few channels.
    """
    B, G = backprops.shape[0], layer.groups
    if B == 0:
        return backprops.new_zeros((0, *layer.weight.shape), dtype=torch.float32)
    C, K = layer.in_channels, layer.kernel_size
    cg, og, out = C // G, layer.out_channels // G, backprops.shape[2:]
    xp = _conv_padded_input(layer, x)
    kernels = (
        backprops.float().reshape(B, G, 1, og, *out).expand(B, G, cg, og, *out).reshape(B * C * og, 1, *out)
    )
    conv = F.conv1d if isinstance(layer, nn.Conv1d) else F.conv2d
    full = conv(
        xp.reshape(1, B * C, *xp.shape[2:]),
        kernels,
        stride=layer.dilation,
        dilation=layer.stride,
        groups=B * C,
    )
    first_k: tuple[Any, ...] = (0, slice(None), *(slice(0, k) for k in K))
    g = full[first_k]  # [B·C·og, *kernel] in (example, group, input channel, output channel) order
    return g.reshape(B, G, cg, og, *K).transpose(2, 3).reshape(B, *layer.weight.shape)


def _conv_samples_unfold(layer: ConvLayer, x: Tensor, backprops: Tensor) -> Tensor:
    """Per-example weight gradients [B, *weight.shape] as bmms of unfolded patches and backprops.

    Written into one channel-last buffer [B, O, *kernel, C/G] and returned as a permuted view of it:
    the norm and the weighted sum read it in that order, so it is never copied into the weight's layout.
    The patches are unfolded a chunk of examples at a time (see :func:`_chunks`).
    """
    B, G, n = backprops.shape[0], layer.groups, len(layer.kernel_size)
    o, c = layer.out_channels, layer.in_channels // G
    out = backprops.new_empty((B, o, *layer.kernel_size, c), dtype=torch.float32)
    for rows in _chunks(layer, x, backprops):
        a, d = _conv_inputs(layer, x[rows], backprops[rows])
        b = a.shape[0] * G
        torch.bmm(
            d.reshape(b, *d.shape[2:]).transpose(1, 2),
            a.reshape(b, *a.shape[2:]),
            out=out[rows].view(b, o // G, -1),
        )
    return out.permute(0, 1, 2 + n, *range(2, 2 + n))


def _conv_gram(layer: ConvLayer, x: Tensor, backprops: Tensor) -> Tensor:
    """Per-example squared weight-gradient norms by the Gram trick over output positions, per group."""
    terms = backprops.new_zeros((3, backprops.shape[0]), dtype=torch.float32)  # value, bound, spread
    for rows in _chunks(layer, x, backprops, gram=True):
        a, d = _conv_inputs(layer, x[rows], backprops[rows])
        b, G = a.shape[0], a.shape[1]
        found = gram_sq_norm(a.reshape(b * G, *a.shape[2:]), d.reshape(b * G, *d.shape[2:]))
        terms[:, rows] = _sum_groups(found, b, G)
    return _conv_certified(layer, x, backprops, terms)


def _conv_position_gram(layer: ConvLayer, x: Tensor, backprops: Tensor) -> Tensor:
    """Per-example squared weight-gradient norms by the Gram trick, without unfolding any patch.

    Two patches overlap kernel offset by kernel offset: a_t·a_s = Σ_k M[P_t + k·dil, P_s + k·dil], with
    M = XᵀX the channel-contracted Gram matrix of the padded input positions and P_t the corner of
    output t. So the [L, L] patch Gram is a sum of prod(kernel) strided views of M. It costs
    (H·W)²·C/G per group instead of L²·C·k²/G plus the patch copy: far cheaper on small, deep inputs
    (ResNet's last stage, ScatterNet features), far dearer on large ones (the timer decides).
    """
    G = layer.groups
    zero_padded = layer.padding_mode == "zeros"
    out = backprops.shape[2:]
    L = math.prod(out)
    terms = backprops.new_zeros((3, backprops.shape[0]), dtype=torch.float32)  # value, bound, spread
    offsets = list(itertools.product(*(range(k) for k in layer.kernel_size)))
    for rows in _chunks(layer, x, backprops, gram=True, positions=True):
        xs = x[rows].float() if zero_padded else _conv_padded_input(layer, x[rows])
        b, spatial = xs.shape[0], xs.shape[2:]
        X = xs.reshape(b * G, xs.shape[1] // G, math.prod(spatial))
        M = torch.bmm(X.transpose(1, 2), X).view(b * G, *spatial, *spatial)
        if zero_padded and any(layer._reversed_padding_repeated_twice):
            M = F.pad(M, list(layer._reversed_padding_repeated_twice) * 2)  # zero rows/columns
        aa = M.new_zeros((b * G, *out, *out))
        for offset in offsets:
            window = tuple(
                slice(k * d, k * d + s * (o - 1) + 1, s)
                for k, d, s, o in zip(offset, layer.dilation, layer.stride, out, strict=True)
            )
            aa += M[(slice(None), *window, *window)]
        d = backprops[rows].float().reshape(b * G, layer.out_channels // G, L)
        dd = torch.bmm(d.transpose(1, 2), d)
        # each entry of aa is a dot product of length C/G·K: C/G for M, K windows added
        found = gram_certified(aa.view(b * G, L, L), dd, X.shape[1] + len(offsets), d.shape[1])
        terms[:, rows] = _sum_groups(found, b, G)
    return _conv_certified(layer, x, backprops, terms)


def _sum_groups(found: tuple[Tensor, Tensor, Tensor], b: int, G: int) -> Tensor:
    """(value, bound, spread) per example [3, b] from those per (example, group); the bound covers the
    sum over the groups too."""
    value, bound, spread = (t.view(b, G) for t in found)
    total = value.sum(1)
    return torch.stack([total, bound.sum(1) + rounding_gamma(G) * value.abs().sum(1), spread.sum(1)])


def _conv_certified(layer: ConvLayer, x: Tensor, backprops: Tensor, terms: Tensor) -> Tensor:
    """The Gram methods' norms through the guard (exact recompute by a fp64 weight-gradient convolution;
    the clipped sum's convolution adds at most B·L terms per entry)."""
    B, L = backprops.shape[0], math.prod(backprops.shape[2:])
    return certified_sq_norms(
        terms[0], terms[1], lambda i: _conv_exact_sq_norms(layer, x[i], backprops[i]), terms[2], B * L
    )


def saved_per_example(x: Tensor, backprops: Tensor) -> int:
    """Floats per example the layer's record holds (its input and output gradient): the memory budget
    of its norm method. Per-example gradients within it are kept instead of the record (released in
    the backward hook, see ``gradients.LayerCall``), so the clipping pass's peak stays near a plain step's."""
    return max(1, (x.numel() + backprops.numel()) // max(1, backprops.shape[0]))


CHUNK_FLOATS = 1 << 20
"""Most floats of temporaries per chunk of examples (4 MiB): bigger chunks fall out of the CPU caches
and ran 2× slower on ScatterNet's first convolution at 3,072 candidates."""


def _chunks(
    layer: ConvLayer, x: Tensor, backprops: Tensor, gram: bool = False, positions: bool = False
) -> Iterator[slice]:
    """Slices of the batch whose temporaries fit in the layer's budget and in :data:`CHUNK_FLOATS`
    (at least one example per slice): unfolded patches, or with ``positions`` the (padded)
    input-position Gram matrix; plus the two [L, L] Gram matrices with ``gram``."""
    B, L, G = backprops.shape[0], math.prod(backprops.shape[2:]), layer.groups
    if positions:
        temporary = G * padded_positions(layer, x) ** 2
    else:
        temporary = L * G * layer.weight[0].numel()
    temporary += 2 * G * L * L if gram else 0
    step = max(1, min(saved_per_example(x, backprops) * B, CHUNK_FLOATS) // temporary)
    for start in range(0, B, step):
        yield slice(start, min(B, start + step))


def padded_positions(layer: ConvLayer, x: Tensor) -> int:
    """Number of input positions after the layer's padding."""
    pad = layer._reversed_padding_repeated_twice
    return math.prod(size + pad[2 * i] + pad[2 * i + 1] for i, size in enumerate(reversed(x.shape[2:])))


MATERIALISING: tuple[ConvMethod, ...] = ("unfold", "grouped", "correlate")
"""Methods returning per-example gradients [B, *weight.shape] (kept for the sum); the others return norms."""
NORMS_ONLY: dict[ConvMethod, ConvMethod] = {
    "unfold-norms": "unfold",
    "grouped-norms": "grouped",
    "correlate-norms": "correlate",
}
"""Each materialising method run a chunk of examples at a time for the norms only: the per-example
gradients are dropped as soon as their norms are taken (the clipped sum is then the layer's own
weight-gradient convolution, as after a Gram method). For layers whose per-example gradients are larger
than what their record holds (depthwise 7×7 kernels on small maps, 3×3 kernels on 16×16 maps with 64
channels), where they may not be kept, but computing them is still far cheaper than a Gram matrix."""


def _temporary_floats(method: ConvMethod, layer: ConvLayer, x: Tensor, backprops: Tensor) -> int:
    """Floats per example a materialising method allocates: the per-example gradient, plus the unfolded
    patches (unfold) or the output gradients repeated per input channel of a group (correlate)."""
    G, L = layer.groups, math.prod(backprops.shape[2:])
    cg = layer.in_channels // G
    per_example = math.prod(backprops.shape[1:])
    extra = {"unfold": L * G * layer.weight[0].numel(), "correlate": cg * per_example if cg > 1 else 0}
    return layer.weight.numel() + extra.get(method, 0)


def _dropping(method: ConvMethod) -> Callable[[ConvLayer, Tensor, Tensor], Tensor]:
    """Certified squared norms from ``method``'s per-example gradients, taken :data:`CHUNK_FLOATS` at a
    time and dropped. The rounding bound of a gradient summed over L positions in fp32 is γ_L·spread
    (:func:`conv_spread`); flagged examples are recomputed in fp64, plus the clipped sum's own rounding
    (a weight-gradient convolution over B·L terms)."""

    def norms(layer: ConvLayer, x: Tensor, backprops: Tensor) -> Tensor:
        B, L = backprops.shape[0], math.prod(backprops.shape[2:])
        values = backprops.new_zeros(B, dtype=torch.float32)
        step = max(1, CHUNK_FLOATS // _temporary_floats(method, layer, x, backprops))
        for start in range(0, B, step):
            rows = slice(start, min(B, start + step))
            values[rows] = materialized_sq_norm(CONV_NORMS[method](layer, x[rows], backprops[rows]))
        spread = conv_spread(layer, x, backprops)
        return certified_sq_norms(
            values,
            sum_bound(values, rounding_gamma(L) * spread),
            lambda i: _conv_exact_sq_norms(layer, x[i], backprops[i]),
            spread,
            B * L,
        )

    return norms


CONV_NORMS: dict[ConvMethod, Callable[[ConvLayer, Tensor, Tensor], Tensor]] = {
    "gram": _conv_gram,
    "position-gram": _conv_position_gram,
    "unfold": _conv_samples_unfold,
    "grouped": conv_samples_grouped,
    "correlate": _conv_samples_correlate,
}
CONV_NORMS.update({name: _dropping(method) for name, method in NORMS_ONLY.items()})


# --------------------------------------------------------------------------------------------------
# The clipped sum Σ_i w_i g_i of a layer whose per-example gradients were not kept
# --------------------------------------------------------------------------------------------------

SumMethod = Literal["weight-grad", "unfold-mm", "grouped-samples", "correlate-samples"]
SUM_METHODS: tuple[SumMethod, ...] = ("weight-grad", "unfold-mm", "grouped-samples", "correlate-samples")


def _sum_weight_grad(layer: ConvLayer, x: Tensor, backprops: Tensor, weights: Tensor) -> Tensor:
    """The layer's own weight-gradient convolution with w_i·δ_i as output gradient: one reduction over
    the batch and the positions, the same as a matmul of the unfolded patches but without unfolding."""
    wd, keep = fold_weights(weights, backprops)
    return conv_weight_grad(layer, mask_rows(x, keep), wd, layer.groups, layer.weight.shape)


def _sum_unfold_mm(layer: ConvLayer, x: Tensor, backprops: Tensor, weights: Tensor) -> Tensor:
    """(w ⊙ δ)ᵀ · patches per group, one matmul over all examples and positions, a chunk of examples at a
    time (oneDNN's weight-gradient convolution is 5× slower on small maps with many channels: 512×512
    3×3 kernels on 2×2 maps)."""
    G, n, o = layer.groups, len(layer.kernel_size), layer.out_channels // layer.groups
    total = backprops.new_zeros((G, o, layer.weight[0].numel()), dtype=torch.float32)
    for rows in _chunks(layer, x, backprops):
        wd, keep = fold_weights(weights[rows], backprops[rows])
        a, d = _conv_inputs(layer, mask_rows(x[rows], keep), wd)  # [b, G, L, p], [b, G, L, o]
        b, L = a.shape[0], a.shape[2]
        a = a.transpose(0, 1).reshape(G, b * L, -1)
        d = d.transpose(0, 1).reshape(G, b * L, o)
        total.baddbmm_(d.transpose(1, 2), a)
    # columns in (kernel, channel) order: back to the weight's [O, C/G, *kernel]
    grad = total.view(layer.out_channels, *layer.kernel_size, -1)
    return grad.permute(0, 1 + n, *range(1, 1 + n)).contiguous()


def _sum_of_samples(method: ConvMethod) -> Callable[[ConvLayer, Tensor, Tensor, Tensor], Tensor]:
    """Σ_i w_i g_i from ``method``'s per-example gradients, a chunk of examples at a time (depthwise
    kernels: the correlation runs 4-10× faster than the weight-gradient convolution)."""

    def weighted(layer: ConvLayer, x: Tensor, backprops: Tensor, weights: Tensor) -> Tensor:
        B, L = backprops.shape[0], math.prod(backprops.shape[2:])
        if B < 2 or L < 2:  # the norms' rounding allowance assumes B·L ≥ B + L terms per entry
            return _sum_weight_grad(layer, x, backprops, weights)
        total = torch.zeros(layer.weight.shape, dtype=torch.float32, device=backprops.device)
        step = max(1, CHUNK_FLOATS // _temporary_floats(method, layer, x, backprops))
        for start in range(0, B, step):
            rows = slice(start, min(B, start + step))
            w = weights[rows]
            keep = w != 0  # weight-0 examples may hold non-finite values: never multiplied
            if not bool(keep.all()):
                index = keep.nonzero().squeeze(1) + start
                if index.numel() == 0:
                    continue
                samples = CONV_NORMS[method](layer, x[index], backprops[index])
                w = weights[index]
            else:
                samples = CONV_NORMS[method](layer, x[rows], backprops[rows])
            total += materialized_weighted(samples, w)
        return total

    return weighted


CONV_SUMS: dict[SumMethod, Callable[[ConvLayer, Tensor, Tensor, Tensor], Tensor]] = {
    "weight-grad": _sum_weight_grad,
    "unfold-mm": _sum_unfold_mm,
    "grouped-samples": _sum_of_samples("grouped"),
    "correlate-samples": _sum_of_samples("correlate"),
}
"""The ways to form a convolution's clipped sum without kept per-example gradients; all reduce B·L terms
per entry in fp32 (the rounding the certified norms allow for), :mod:`.conv_autotune` times them."""
