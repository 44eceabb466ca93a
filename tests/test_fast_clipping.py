"""Fast clipping kernels agree with materialised per-example gradients (fp64 per-example autograd)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus.grad_sample.linear import compute_linear_grad_sample
from tolerances import assert_certified, assert_close_scaled
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_dp import fast_clipping as fc

NORM_OVERSTATE = 1e-3
"""Most a certified norm exceeds the exact one on the fixed cases here (the rounding bound the guard adds)."""
GUARD_OVERSTATE = 2.1 * fc.GUARD_FRACTION
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
    cache: fc.Cache | None = None,
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

    norms = fc.sq_norms(layer, activations, backprops, cache)
    assert set(norms) == set(named)
    for p, value in norms.items():
        expected = ref[named[p]].flatten(1).square().sum(1)
        assert value.dtype == torch.float32
        assert value.shape == (B,)
        # never below the exact norm: the guard adds its fp32 rounding bound (≤ 1e-3 on these shapes)
        assert_certified(value, expected, max(rtol, overstate))

    weights = torch.rand(B, generator=torch.Generator().manual_seed(seed + 2))
    sums = fc.weighted_grad(layer, activations, backprops, weights, cache)
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


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("B", [0, 1, 5])
@pytest.mark.parametrize("case", list(CASES))
def test_kernels_match_materialised(case: str, B: int) -> None:
    layer_factory, input_factory = CASES[case]
    layer = make_layer(layer_factory, seed=B)
    assert fc.is_supported(layer)
    check_layer(layer, input_factory(B, torch.Generator().manual_seed(B)), seed=B)


CONV_CASES = [name for name in CASES if name.startswith("conv")]


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("method", fc.CONV_METHODS)
@pytest.mark.parametrize("B", [0, 3])
@pytest.mark.parametrize("case", CONV_CASES)
def test_every_conv_method_matches_materialised(case: str, B: int, method: fc.ConvMethod) -> None:
    """Gram, unfold+bmm and the batch-grouped weight-gradient convolution give the same norms, and
    the per-example gradients the last two materialise give the same clipped sum when reused."""
    layer = make_layer(CASES[case][0], seed=B)
    x = CASES[case][1](B, torch.Generator().manual_seed(B))
    with fc.force_conv_method(method):
        check_layer(layer, x, seed=B, cache={})


@pytest.mark.parametrize("case", ["linear-seq-materialise", "linear-4d-materialise", "conv2d-materialise"])
def test_materialised_norms_are_reused_for_the_sum(case: str) -> None:
    """A layer whose norms materialise its per-example gradients caches them for the weighted sum."""
    layer = make_layer(CASES[case][0], seed=0)
    x = CASES[case][1](4, torch.Generator().manual_seed(0))
    activations, backprops, _ = capture(layer, x)
    cache: fc.Cache = {}
    with fc.force_conv_method("unfold"):
        fc.sq_norms(layer, activations, backprops, cache)
    assert layer.weight in cache
    assert set(cache) <= {layer.weight, layer.bias}
    assert cache[layer.weight].shape == (4, *layer.weight.shape)
    with fc.force_conv_method("unfold"):
        check_layer(layer, x, cache={})


def test_conv_method_is_timed_once_per_shape() -> None:
    """The automatic choice is cached per layer shape, not per batch size (Poisson batches vary)."""
    layer = nn.Conv2d(3, 4, 3)
    fc._conv_choice.clear()
    for B in (2, 5, 3):
        activations, backprops, _ = capture(layer, torch.randn(B, 3, 8, 8))
        fc.sq_norms(layer, activations, backprops)
    assert len(fc._conv_choice) == 1
    assert next(iter(fc._conv_choice.values())) in fc.CONV_METHODS
    with pytest.raises(ValueError, match="conv method must be one of"), fc.force_conv_method("im2col"):  # type: ignore[arg-type]
        pass


@pytest.mark.parametrize(
    ("case", "gram"),
    [
        ("linear-seq-gram", True),
        ("linear-seq-materialise", False),
        ("linear-4d-gram", True),
        ("linear-4d-materialise", False),
        ("conv1d-gram", True),
        ("conv2d-gram", True),
        ("conv2d-materialise", False),
    ],
)
def test_cases_cover_both_branches(case: str, gram: bool) -> None:
    """The sweep's names say which branch they take; check it against ``use_gram``."""
    layer = CASES[case][0]()
    x = CASES[case][1](2, torch.Generator().manual_seed(0))
    if isinstance(layer, nn.Linear):
        T = x[0, ..., 0].numel()
        assert fc.use_gram(T, layer.in_features, layer.out_features) is gram
    else:
        assert isinstance(layer, nn.Conv1d | nn.Conv2d)
        L = layer(x)[0, 0].numel()
        p = layer.in_channels // layer.groups * layer.weight[0, 0].numel()
        assert fc.use_gram(L, p, layer.out_channels // layer.groups) is gram


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(3, 4, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
        nn.Conv2d(2, 4, 3, dilation=2, groups=2),
        nn.Conv2d(1, 16, 8, stride=2, padding=2),
    ],
)
def test_patches_equal_f_unfold(conv: nn.Conv2d) -> None:
    """Our channel-last patches [B, G, L, (kernel, C/G)] hold exactly F.unfold's [B, (C, kernel), L]."""
    x = torch.randn(2, conv.in_channels, 9, 8)
    unfolded = F.unfold(x, conv.kernel_size, conv.dilation, conv.padding, conv.stride)
    G, (kh, kw) = conv.groups, conv.kernel_size
    expected = unfolded.view(2, G, conv.in_channels // G, kh, kw, -1).permute(0, 1, 5, 3, 4, 2)
    torch.testing.assert_close(
        fc._conv_patches(conv, x), expected.reshape(2, G, -1, kh * kw * conv.in_channels // G), rtol=0, atol=0
    )


def test_embedding_branches() -> None:
    assert fc.embedding_use_gram(3, 8)
    assert not fc.embedding_use_gram(12, 4)


def test_frozen_parameters_are_skipped() -> None:
    layer = make_layer(lambda: nn.Linear(4, 3), 0)
    layer.weight.requires_grad_(False)
    check_layer(layer, torch.randn(3, 2, 4))
    frozen = make_layer(lambda: nn.Embedding(5, 3), 0).requires_grad_(False)
    acts, bp = [torch.tensor([[1, 2]])], torch.randn(1, 2, 3)
    assert fc.sq_norms(frozen, acts, bp) == {}
    assert fc.weighted_grad(frozen, acts, bp, torch.ones(1)) == {}
    plain = nn.GroupNorm(2, 4, affine=False)
    assert fc.sq_norms(plain, [torch.randn(2, 4, 3)], torch.randn(2, 4, 3)) == {}


@settings(max_examples=15, deadline=None)
@given(
    method=st.sampled_from(fc.CONV_METHODS),
    B=st.integers(0, 3),
    c_in=st.integers(1, 3),
    c_out=st.integers(1, 3),
    groups=st.sampled_from([1, 2]),
    k=st.integers(1, 3),
    stride=st.integers(1, 2),
    padding=st.integers(0, 2),
    dilation=st.integers(1, 2),
    size=st.integers(5, 8),
    two_d=st.booleans(),
    bias=st.booleans(),
)
def test_conv_random_shapes(
    method: fc.ConvMethod,
    B: int,
    c_in: int,
    c_out: int,
    groups: int,
    k: int,
    stride: int,
    padding: int,
    dilation: int,
    size: int,
    two_d: bool,
    bias: bool,
) -> None:
    conv = nn.Conv2d if two_d else nn.Conv1d
    layer = make_layer(
        lambda: conv(c_in * groups, c_out * groups, k, stride, padding, dilation, groups=groups, bias=bias), B
    )
    shape = (size, size + 1) if two_d else (size,)
    with fc.force_conv_method(method):
        check_layer(layer, torch.randn(B, c_in * groups, *shape), seed=B, cache={}, overstate=GUARD_OVERSTATE)


@settings(max_examples=15, deadline=None)
@given(
    B=st.integers(0, 3),
    T=st.integers(1, 6),
    d_in=st.integers(1, 5),
    d_out=st.integers(1, 5),
    bias=st.booleans(),
)
def test_linear_random_shapes(B: int, T: int, d_in: int, d_out: int, bias: bool) -> None:
    layer = make_layer(lambda: nn.Linear(d_in, d_out, bias=bias), T)
    check_layer(layer, torch.randn(B, T, d_in), seed=T, overstate=GUARD_OVERSTATE)


# --------------------------------------------------------------------------------------------------
# Precision, safety, registry, fallback
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        "linear-seq-gram",
        "linear-2d",
        "conv2d-gram",
        "conv1d-stride-pad-dil-nobias",
        "embedding-sparse",
        "layernorm-seq",
        "groupnorm",
    ],
)
def test_bf16_inputs_give_fp32_outputs(case: str) -> None:
    layer_factory, input_factory = CASES[case]
    layer = make_layer(layer_factory, 0)
    check_layer(layer, input_factory(4, torch.Generator().manual_seed(0)), rtol=1e-4, cast=torch.bfloat16)


@pytest.mark.parametrize(
    "case", ["linear-seq-gram", "conv2d-groups", "embedding-sparse", "layernorm-seq", "groupnorm"]
)
def test_zero_weight_examples_are_dropped_even_if_not_finite(case: str) -> None:
    layer = make_layer(CASES[case][0], 0)
    x = CASES[case][1](3, torch.Generator().manual_seed(0))
    activations, backprops, _ = capture(layer, x)
    bad_acts = [a.clone() for a in activations]
    if bad_acts[0].is_floating_point():
        bad_acts[0][1] = float("nan")
    bad_bp = backprops.clone()
    bad_bp[1] = float("inf")
    weights = torch.tensor([0.5, 0.0, 2.0])
    clean = fc.weighted_grad(layer, activations, backprops, weights)
    dirty = fc.weighted_grad(layer, bad_acts, bad_bp, weights)
    for p in clean:
        assert torch.isfinite(dirty[p]).all()
        assert_close_scaled(dirty[p], clean[p], terms=backprops[:, 0].numel())


@pytest.mark.parametrize("method", fc.CONV_METHODS)
@pytest.mark.parametrize("case", ["conv2d-groups", "conv1d-stride-pad-dil-nobias", "linear-seq-materialise"])
def test_reused_samples_drop_zero_weight_examples_even_if_not_finite(
    case: str, method: fc.ConvMethod
) -> None:
    """The sums that reuse what the norms materialised (weights, biases, channel-last views) mask too."""
    layer = make_layer(CASES[case][0], 0)
    activations, backprops, _ = capture(layer, CASES[case][1](3, torch.Generator().manual_seed(0)))
    bad_acts, bad_bp = [a.clone() for a in activations], backprops.clone()
    bad_acts[0][1], bad_bp[1] = float("nan"), float("inf")
    weights = torch.tensor([0.5, 0.0, 2.0])
    with fc.force_conv_method(method):
        clean = fc.weighted_grad(layer, activations, backprops, weights)
        cache: fc.Cache = {}
        norms = fc.sq_norms(layer, bad_acts, bad_bp, cache)
        dirty = fc.weighted_grad(layer, bad_acts, bad_bp, weights, cache)
    assert all(not torch.isfinite(n[1]) for n in norms.values())
    for p in clean:
        assert torch.isfinite(dirty[p]).all()
        # two algorithms (fold + weight-gradient convolution vs the reused samples): entries that nearly
        # cancel differ by ulps of the terms' magnitude, whatever the CPU's vector width
        assert_close_scaled(dirty[p], clean[p], terms=backprops[:, 0].numel())


@pytest.mark.parametrize(
    "case", ["linear-seq-materialise", "conv2d-stride-pad-dil", "embedding-gram-padding"]
)
def test_unit_weights_give_the_ordinary_gradient(case: str) -> None:
    layer = make_layer(CASES[case][0], 0)
    activations, backprops, _ = capture(layer, CASES[case][1](4, torch.Generator().manual_seed(0)))
    sums = fc.weighted_grad(layer, activations, backprops, torch.ones(4))
    for p in layer.parameters():
        assert p.grad is not None
        assert_close_scaled(sums[p], p.grad, terms=backprops[:, 0].numel())


def test_registry_and_support() -> None:
    for layer in [
        nn.Linear(2, 2),
        nn.Conv1d(1, 1, 1),
        nn.Conv2d(1, 1, 1),
        nn.Embedding(3, 2),
        nn.LayerNorm(2),
        nn.GroupNorm(1, 2),
    ]:
        assert fc.is_supported(layer)
        assert type(layer) in fc.FAST_CLIPPERS
    assert not fc.is_supported(nn.Conv3d(1, 1, 1))
    assert not fc.is_supported(nn.Embedding(3, 2, scale_grad_by_freq=True))
    assert not fc.is_supported(nn.LSTM(2, 2))

    class MyLinear(nn.Linear):
        pass

    assert not fc.is_supported(MyLinear(2, 2))
    with pytest.raises(TypeError, match="No fast clipping kernels"):
        fc.sq_norms(nn.Conv3d(1, 1, 1), [torch.zeros(1, 1, 1, 1, 1)], torch.zeros(1, 1, 1, 1, 1))
    assert fc.use_gram(3, 10, 10)  # 3·20 < 100 FLOPs
    assert not fc.use_gram(4, 2, 8)


def test_materialized_fallback() -> None:
    p, q = nn.Parameter(torch.zeros(3, 2)), nn.Parameter(torch.zeros(4))
    g = {p: torch.randn(5, 3, 2, dtype=torch.float64), q: torch.randn(5, 4).bfloat16()}
    g[p][2] = float("nan")
    weights = torch.tensor([1.0, 0.5, 0.0, 2.0, 0.25])
    norms, sums = fc.materialized_sq_norms(g), fc.materialized_weighted_grad(g, weights)
    for param, samples in g.items():
        assert norms[param].dtype == torch.float32
        expected = samples.double().flatten(1).square().sum(1)
        torch.testing.assert_close(norms[param].double(), expected, rtol=1e-5, atol=0.0, equal_nan=True)
        keep = samples.double().clone()
        keep[2] = 0.0
        expected_sum = torch.einsum("i,i...->...", weights.double(), keep)
        assert_rel(sums[param], expected_sum, 1e-5)
    empty = fc.materialized_sq_norms({p: torch.zeros(0, 3, 2)})
    assert empty[p].shape == (0,)


def test_materialized_reductions_read_permuted_layouts_in_place() -> None:
    """A per-example gradient stored channel-last and viewed in the weight's layout: same norms and
    sums as its contiguous copy, result contiguous in the weight's layout."""
    stored = torch.randn(5, 4, 3, 2, 6)  # [B, O, kh, kw, C]
    g = stored.permute(0, 1, 4, 2, 3)  # [B, O, C, kh, kw], not contiguous
    weights = torch.tensor([1.0, 0.0, 0.5, 2.0, 0.25])
    total = fc.materialized_weighted(g, weights)
    assert total.shape == (4, 6, 3, 2)
    assert total.is_contiguous()
    assert_close_scaled(total, torch.tensordot(weights, g.contiguous(), dims=1), terms=5)
    assert_close_scaled(
        fc.materialized_sq_norm(g), g.contiguous().flatten(1).square().sum(1), terms=g[0].numel()
    )
    assert fc.materialized_sq_norm(torch.randn(3)).shape == (3,)


class _LargestTensor(TorchDispatchMode):
    """Records the most elements any ATen op returns while active: what a code path materialises."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_linear_weighted_grad_never_materialises_per_example_gradients() -> None:
    """2-D Linear: the norms and the weighted sum come from [B, d] tensors and one [d_out, d_in] matmul;
    no [B, d_out, d_in] tensor exists (what made it ≥ 5× faster than Opacus's path at 1000×1000)."""
    torch.manual_seed(0)
    B, d_in, d_out = 64, 40, 30
    layer = nn.Linear(d_in, d_out)
    acts, bp, w = [torch.randn(B, d_in)], torch.randn(B, d_out), torch.rand(B)
    with _LargestTensor() as fast:
        fc.sq_norms(layer, acts, bp)
        fc.weighted_grad(layer, acts, bp, w)
    with _LargestTensor() as materialised:
        samples = compute_linear_grad_sample(layer, acts, bp)
        fc.materialized_sq_norms(samples)
        fc.materialized_weighted_grad(samples, w)
    assert fast.numel <= max(B * d_in, B * d_out, d_out * d_in)
    assert materialised.numel == B * d_out * d_in  # the probe sees what the slow path builds


@pytest.mark.parametrize("B", [0, 1, 5])
@pytest.mark.parametrize("case", ["linear-2d", "linear-seq-gram", "linear-4d-gram"])
def test_linear_sum_folds_a_chunk_of_examples_at_a_time(case: str, B: int, monkeypatch) -> None:
    """The clipped sum of a Linear accumulates w_i·δ_i chunk by chunk (uneven chunks here: 2 examples
    each), with the same result, the NaN masking included, as folding the whole batch at once."""
    layer = make_layer(CASES[case][0], B)
    x = CASES[case][1](B, torch.Generator().manual_seed(B))
    activations, backprops, _ = capture(layer, x)
    weights = torch.rand(B, generator=torch.Generator().manual_seed(1))
    if B > 1:
        activations[0][1], backprops[1], weights[1] = float("nan"), float("inf"), 0.0
    one_pass = fc.weighted_grad(layer, activations, backprops, weights)
    monkeypatch.setattr(fc, "FOLD_FLOATS", 2 * backprops[:1].numel() if B else 1)
    folds: list[int] = []
    original = fc._fold
    monkeypatch.setattr(fc, "_fold", lambda w, d: folds.append(d.shape[0]) or original(w, d))
    chunked = fc.weighted_grad(layer, activations, backprops, weights)
    assert folds == ([2] * (B // 2) + [B % 2] * (B % 2) if B else [0])
    for p, value in one_pass.items():
        assert torch.isfinite(chunked[p]).all()
        assert_close_scaled(chunked[p], value, terms=max(1, backprops[:, 0].numel()))


@pytest.mark.parametrize(
    ("layer", "shape", "allowed"),
    [
        # grey first layer: per-example gradients (1024) fit in input + output gradient (784 + 16·169)
        (nn.Conv2d(1, 16, 8, stride=2, padding=2), (1, 28, 28), {"grouped", "correlate", "unfold"}),
        # per-example gradients (8192 floats) exceed input + output gradient (2304 + 800): Gram only
        (nn.Conv2d(16, 32, 4, stride=2), (16, 12, 12), set()),
        # 3 input channels: gradients fit (432 ≤ 3072 + 16384), but correlate's 3 copies of the
        # output gradients (49152) do not
        (nn.Conv2d(3, 16, 3, padding=1), (3, 32, 32), {"grouped", "unfold"}),
    ],
)
def test_conv_methods_that_keep_more_than_the_record_are_never_tried(
    layer, shape, allowed, monkeypatch
) -> None:
    """The memory cap: a method whose per-example gradients (or, for correlate, its copies of the output
    gradients) exceed what the layer's record holds is not even timed, however fast it might be."""
    tried: list[set[str]] = []

    def fastest(runs, device, rounds=3):
        tried.append(set(runs))
        return next(iter(runs))

    monkeypatch.setattr(fc, "_fastest", fastest)
    monkeypatch.setattr(fc, "_conv_costs", lambda layer, x, d: dict.fromkeys(fc.CONV_METHODS, 1))
    fc._conv_choice.clear()
    activations, backprops, _ = capture(layer, torch.randn(2, *shape))
    fc.sq_norms(layer, activations, backprops)
    fc._conv_choice.clear()
    assert tried, "several methods are allowed, so the timer runs"
    assert tried[0] & set(fc._MATERIALISING) == allowed
    assert {"gram", "position-gram"} <= tried[0]
