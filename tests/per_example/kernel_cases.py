"""Shared cases and checks for the kernel tests: layers, inputs, and an fp64 per-example reference."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import copy
from collections.abc import Callable

import torch
from tolerances import assert_certified
from torch import Tensor, nn

from lightning_dp.per_example.kernels import (
    Cache,
    sq_norms,
    weighted_grad,
)
from lightning_dp.per_example.kernels.certified import GUARD_FRACTION

NORM_OVERSTATE = 1e-3
"""Most a certified norm exceeds the exact one on the fixed cases here (the rounding bound the guard adds)."""
GUARD_OVERSTATE = 2.1 * GUARD_FRACTION
"""Most it may exceed it on any input: a value plus a bound ≤ GUARD_FRACTION of it, itself within the
bound of the exact one. Random shapes can cancel by chance (p = o = 1) and get near it."""

torch.set_num_threads(1)

LayerFactory = Callable[[], nn.Module]
InputFactory = Callable[[int, torch.Generator], Tensor]


def randn(*shape: int) -> InputFactory:
    return lambda B, g: torch.randn(B, *shape, generator=g)


def randint(high: int, *shape: int) -> InputFactory:
    return lambda B, g: torch.randint(0, high, (B, *shape), generator=g)


def capture(layer: nn.Module, x: Tensor, seed: int = 0) -> tuple[list[Tensor], Tensor, Tensor]:
    """Forward, then backward of loss = Σ out·R; returns (activations, backprops, R) captured by hooks."""
    seen: dict[str, object] = {}
    handle = layer.register_forward_hook(lambda m, inp, out: seen.update(acts=[t.detach() for t in inp]))
    out = layer(x)
    handle.remove()
    out.register_hook(lambda grad: seen.update(backprops=grad.detach()))
    R = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    if out.numel() > 0:
        (out * R).sum().backward()
    else:  # empty batch: autograd still gives a (zero-size) output gradient
        seen["backprops"] = torch.zeros_like(out)
    return seen["acts"], seen["backprops"], R  # type: ignore[return-value]


def reference(layer: nn.Module, x: Tensor, R: Tensor) -> dict[str, Tensor]:
    """Per-example gradients [B, *shape] in fp64 by one autograd call per example."""
    layer64 = copy.deepcopy(layer).double()
    names = [n for n, p in layer64.named_parameters() if p.requires_grad]
    params = [p for p in layer64.parameters() if p.requires_grad]
    x64 = x.double() if x.is_floating_point() else x
    per_example = []
    for i in range(x.shape[0]):
        out = layer64(x64[i : i + 1])
        per_example.append(
            torch.autograd.grad((out * R[i : i + 1].double()).sum(), params, allow_unused=True)
        )
    out_dict = {}
    for j, (n, p) in enumerate(zip(names, params)):
        rows = [torch.zeros_like(p) if g[j] is None else g[j] for g in per_example]
        out_dict[n] = torch.stack(rows) if rows else torch.zeros((0, *p.shape), dtype=torch.float64)
    return out_dict


def assert_rel(got: Tensor, ref: Tensor, rtol: float) -> None:
    """fp32 result within ``rtol`` of the fp64 reference, relative to the reference's norm."""
    assert got.dtype == torch.float32
    assert got.shape == ref.shape
    err = (got.double() - ref).norm().item()
    assert err <= rtol * ref.norm().item() + 1e-12, (err, ref.norm().item())


def check_layer(
    layer: nn.Module,
    x: Tensor,
    rtol: float = 1e-5,
    seed: int = 0,
    cast: torch.dtype | None = None,
    cache: Cache | None = None,
    overstate: float = NORM_OVERSTATE,
) -> None:
    """sq_norms and weighted_grad (random weights) against materialised fp64 per-example gradients.

    With ``cache`` the weighted sum reuses whatever per-example gradients the norms materialised.
    """
    activations, backprops, R = capture(layer, x, seed)
    if cast is not None:  # low-precision inputs: the reference uses the same rounded values
        activations = [a.to(cast) if a.is_floating_point() else a for a in activations]
        backprops = backprops.to(cast)
        R = backprops.double()
        x = activations[0].double() if activations[0].is_floating_point() else activations[0]
    ref = reference(layer, x, R)
    named = {p: n for n, p in layer.named_parameters() if p.requires_grad}
    B = x.shape[0]

    norms = sq_norms(layer, activations, backprops, cache)
    assert set(norms) == set(named)
    for p, value in norms.items():
        expected = ref[named[p]].flatten(1).square().sum(1)
        assert value.dtype == torch.float32
        assert value.shape == (B,)
        # never below the exact norm: the guard adds its fp32 rounding bound (≤ 1e-3 on these shapes)
        assert_certified(value, expected, max(rtol, overstate))

    weights = torch.rand(B, generator=torch.Generator().manual_seed(seed + 2))
    sums = weighted_grad(layer, activations, backprops, weights, cache)
    assert set(sums) == set(named)
    for p, value in sums.items():
        expected = torch.einsum("i,i...->...", weights.double(), ref[named[p]])
        assert value.shape == p.shape
        assert_rel(value, expected, rtol)
    for p, g in (cache or {}).items():  # kept intact: a released record sums from it alone
        assert g.shape == (B, *p.shape)
        assert_rel(g, ref[named[p]], rtol)


# --------------------------------------------------------------------------------------------------
# Parametrised sweep: every supported layer, both branches, B in {0, 1, 5}
# --------------------------------------------------------------------------------------------------

CASES: dict[str, tuple[LayerFactory, InputFactory]] = {
    "linear-2d": (lambda: nn.Linear(7, 5), randn(7)),
    "linear-2d-nobias": (lambda: nn.Linear(7, 5, bias=False), randn(7)),
    "linear-seq-gram": (lambda: nn.Linear(8, 7), randn(3, 8)),  # T=3: 3·15 < 56
    "linear-seq-materialise": (lambda: nn.Linear(3, 2), randn(4, 3)),  # T²=16 ≥ 6
    "linear-4d-gram": (lambda: nn.Linear(12, 10), randn(2, 2, 12)),  # T=4: 4·22 < 120
    "linear-4d-materialise": (lambda: nn.Linear(5, 4), randn(2, 3, 5)),  # T=6: 36 ≥ 20
    "conv1d": (lambda: nn.Conv1d(3, 4, 3), randn(3, 9)),
    "conv1d-stride-pad-dil-nobias": (
        lambda: nn.Conv1d(3, 4, 3, stride=2, padding=2, dilation=2, bias=False),
        randn(3, 11),
    ),
    "conv1d-same": (lambda: nn.Conv1d(2, 3, 4, padding="same"), randn(2, 7)),
    "conv1d-reflect": (lambda: nn.Conv1d(2, 3, 3, padding=1, padding_mode="reflect"), randn(2, 6)),
    "conv1d-depthwise": (lambda: nn.Conv1d(4, 8, 3, groups=4), randn(4, 7)),
    "conv1d-gram": (lambda: nn.Conv1d(8, 8, 3, stride=3), randn(8, 12)),  # L=4: 16 < 24·8
    "conv2d-gram": (lambda: nn.Conv2d(8, 16, 3, padding=1), randn(8, 3, 3)),  # L=9: 9·88 < 72·16
    "conv2d-materialise": (lambda: nn.Conv2d(1, 2, 2), randn(1, 6, 6)),  # L=25: 625 ≥ 8
    "conv2d-stride-pad-dil": (
        lambda: nn.Conv2d(2, 3, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
        randn(2, 7, 6),
    ),
    "conv2d-nobias": (lambda: nn.Conv2d(3, 2, 2, stride=2, bias=False), randn(3, 6, 6)),
    # stride dividing the kernel (the MNIST CNN's conv2), odd sizes, groups with reflect padding
    "conv2d-stride-divides-kernel": (lambda: nn.Conv2d(3, 4, 4, stride=2, padding=1), randn(3, 9, 8)),
    "conv1d-stride-divides-kernel-groups-reflect": (
        lambda: nn.Conv1d(4, 6, 4, stride=2, groups=2, padding=1, padding_mode="reflect"),
        randn(4, 11),
    ),
    "conv2d-groups": (lambda: nn.Conv2d(4, 6, 3, groups=2, padding=1), randn(4, 4, 5)),
    "conv2d-same-circular": (
        lambda: nn.Conv2d(2, 2, (2, 3), padding="same", padding_mode="circular"),
        randn(2, 5, 4),
    ),
    # maps smaller than the kernel's reach: offsets that only meet padding (conv_methods.LiveTaps)
    "conv2d-dead-offsets-depthwise": (
        lambda: nn.Conv2d(4, 4, 5, stride=2, padding=2, groups=4),
        randn(4, 2, 3),
    ),
    "conv1d-dead-offsets-dilated": (
        lambda: nn.Conv1d(2, 3, 3, stride=3, padding=4, dilation=2, bias=False),
        randn(2, 2),
    ),
    "embedding-gram": (lambda: nn.Embedding(10, 8), randint(4, 3)),  # T=3, repeats likely
    "embedding-sparse": (lambda: nn.Embedding(10, 4, padding_idx=0), randint(5, 12)),  # T²=144 > 16
    "embedding-gram-padding": (lambda: nn.Embedding(6, 8, padding_idx=2), randint(4, 2, 2)),
    "layernorm": (lambda: nn.LayerNorm(5), randn(5)),
    "layernorm-seq": (lambda: nn.LayerNorm(5), randn(3, 5)),
    "layernorm-2dshape": (lambda: nn.LayerNorm([3, 4]), randn(2, 3, 4)),
    "layernorm-nobias": (lambda: nn.LayerNorm(6, bias=False), randn(2, 6)),
    "groupnorm": (lambda: nn.GroupNorm(2, 4), randn(4, 3, 3)),
    "groupnorm-1d": (lambda: nn.GroupNorm(3, 6), randn(6, 5)),
}


def make_layer(factory: LayerFactory, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layer = factory()
    with torch.no_grad():  # norm layers start at weight 1, bias 0: perturb so nothing is trivial
        for p in layer.parameters():
            p.add_(0.3 * torch.randn(p.shape))
    return layer


CONV_CASES = [name for name in CASES if name.startswith("conv")]
