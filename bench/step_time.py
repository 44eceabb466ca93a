"""Time one training step: plain vs lightning-dp's DP-SGD step (fast and materialised per-example
paths) vs Opacus (hooks, ghost clipping), on four models.

Every variant trains its own copy of the same initial model on the same fixed batch, in one process,
on one thread. Variants run in interleaved rounds (round-robin, the order rotating every round) and
the table reports medians, so slow drifts of the machine hit every variant alike. Data loading is
excluded: the batch is already on the device. Each step is timed the way its library runs it:

* plain                     forward, mean cross-entropy, backward, ``optimizer.step()``, ``zero_grad()``
* lightning-dp fast         the library's :class:`~lightning_dp.engine.PrivateStepEngine` without a
                            Trainer, ``grad_sample_mode="fast"``: forward, loss, backward (tensor hooks
                            keep each supported layer's inputs and output gradients), ``engine.privatize()``
                            (per-example norms and the clipped sum straight from those, no [B, *param]
                            tensors; Gaussian noise; ledger), ``engine.apply_step(optimizer)``, zero_grad
* lightning-dp materialize  the same engine with ``grad_sample_mode="materialize"`` (the previous
                            behaviour): per-example gradients materialised in the backward hooks
* lightning-dp quantile     the fast engine with ``QuantileClipping()`` (its noisy unclipped count moves C) and
  lightning-dp auto         with ``AutoClipping()`` (each example normalised): the clipping slots of issue #49,
                            reported as a ratio to ``lightning-dp fast`` (DP-SGD's ``FlatClipping``) too
* opacus hooks              ``PrivacyEngine().make_private(...)``: forward, loss, backward, ``optimizer.step()``
* opacus ghost              ``make_private(..., grad_sample_mode="ghost")``: the wrapped criterion's
                            ``.backward()`` runs Opacus's two backward passes, then ``optimizer.step()``

Models (``--models``): Tramèr & Boneh's MNIST CNN (batch 256), an MLP 784-1000-10 (256), a small
transformer encoder on token sequences of length 128 (batch 32; attention built from ``nn.Linear``
so that every layer has a fast kernel) and a ResNet-20 with GroupNorm on CIFAR-10-shaped input (batch 64).

A second, small table runs a real ``lightning.Trainer`` (plain, and ``DPStrategy(noise_multiplier=1.0)``
with and without ε logged every step) for a fixed number of steps on an in-memory data set.

Run from the repository root::

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/step_time.py [--models cnn,mlp] [--json results.json]
"""

from __future__ import annotations

import os
import sys

# One thread everywhere, set before torch is imported (the intra-op pool reads it at start-up).
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import contextlib
import copy
import ctypes
import functools
import gc
import json
import logging
import statistics
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import opacus
import torch
import torch.nn.functional as F
from _harness import cpu_name, quantile, trainer_kwargs
from opacus import PrivacyEngine
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import lightning_dp
from lightning_dp import DPStrategy, PrivacyCallback
from lightning_dp.accounting import PoissonGaussian, PrivacyLedger
from lightning_dp.clipping import AutoClipping, FlatClipping, GridClipping, QuantileClipping
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.noise import ConstantNoise, DiscreteGaussian
from lightning_dp.per_example import GradMode
from lightning_dp.sampling import Poisson
from lightning_dp.slots import Clipping, Noise, Step, StepContext
from recipes.models import mlp, tramer_boneh_cnn

SIGMA = 1.0
MAX_GRAD_NORM = 1.0
LR = 0.05
DATASET_SIZE = 60_000  # what the sample rate q = B / N refers to (MNIST); only the accountants see it
VARIANTS = (
    "plain",
    "lightning-dp fast",
    "lightning-dp materialize",
    "lightning-dp quantile",
    "lightning-dp auto",
    "opacus hooks",
    "opacus ghost",
)


# -- models ----------------------------------------------------------------------------------------
class SelfAttention(nn.Module):
    """Multi-head self-attention built from four ``nn.Linear`` projections (q, k, v, out).

    Unlike ``nn.MultiheadAttention`` (which owns ``in_proj_weight`` directly, so per-example
    clipping must fall back to functorch or Opacus's ``DPMultiheadAttention``), every parameter here
    lives in a Linear layer, which lightning-dp's fast path and both Opacus modes support.
    """

    def __init__(self, d_model: int, nhead: int) -> None:
        super().__init__()
        self.nhead = nhead
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        B, T, D = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(B, T, self.nhead, D // self.nhead).transpose(1, 2)

        a = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)))
        return self.out(a.transpose(1, 2).reshape(B, T, D))


class EncoderLayer(nn.Module):
    """Post-norm encoder layer, as ``nn.TransformerEncoderLayer(batch_first=True, dropout=0.0)``."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int) -> None:
        super().__init__()
        self.attn = SelfAttention(d_model, nhead)
        self.norm1 = nn.LayerNorm(d_model)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm1(x + self.attn(x))
        return self.norm2(x + self.linear2(F.relu(self.linear1(x))))


class TinyTransformer(nn.Module):
    """Token + learned position embeddings, 2 encoder layers, mean-pool, Linear(d, classes)."""

    def __init__(
        self, vocab: int = 1000, seq_len: int = 128, d_model: int = 128, nhead: int = 4, ff: int = 256
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.layers = nn.Sequential(*(EncoderLayer(d_model, nhead, ff) for _ in range(2)))
        self.head = nn.Linear(d_model, 2)

    def forward(self, idx: Tensor) -> Tensor:
        B, T = idx.shape
        # Positions per example (so every hook sees the batch), contiguous (Opacus's embedding norm uses .view).
        positions = torch.arange(T, device=idx.device).repeat(B, 1)
        return self.head(self.layers(self.tok(idx) + self.pos(positions)).mean(1))


GN_GROUPS = 8


class BasicBlock(nn.Module):
    """ResNet basic block with GroupNorm; parameter-free shortcut (He et al.'s option A) on downsampling."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(GN_GROUPS, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(GN_GROUPS, c_out)
        self.stride, self.extra = stride, c_out - c_in

    def forward(self, x: Tensor) -> Tensor:
        out = self.gn2(self.conv2(F.relu(self.gn1(self.conv1(x)))))
        shortcut = x[:, :, :: self.stride, :: self.stride] if self.stride > 1 else x
        if self.extra:
            shortcut = F.pad(shortcut, (0, 0, 0, 0, 0, self.extra))
        return F.relu(out + shortcut)


def resnet20(num_classes: int = 10) -> nn.Sequential:
    """ResNet-20 for CIFAR-10 (3 stages × 3 BasicBlocks, 16/32/64 channels), GroupNorm(8) for BatchNorm."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.GroupNorm(GN_GROUPS, 16),
        nn.ReLU(),
    ]
    c_in = 16
    for stage, c_out in enumerate((16, 32, 64)):
        for block in range(3):
            layers.append(BasicBlock(c_in, c_out, 2 if stage > 0 and block == 0 else 1))
            c_in = c_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes)]
    return nn.Sequential(*layers)


@dataclass(frozen=True)
class ModelSpec:
    key: str
    title: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]  # without the batch dimension
    batch_size: int  # the default batch (--batch-size overrides it for every model)
    num_classes: int = 10
    vocab: int | None = None  # integer token inputs in [0, vocab) instead of Gaussian features


MODELS = {
    "cnn": ModelSpec("cnn", "Tramèr & Boneh MNIST CNN", tramer_boneh_cnn, (1, 28, 28), 256),
    "mlp": ModelSpec("mlp", "MLP 784-1000-10", lambda: mlp(784, [1000], 10), (784,), 256),
    "transformer": ModelSpec(
        "transformer",
        "Transformer encoder (2 layers, d 128, 4 heads, ff 256, Linear-built attention)",
        TinyTransformer,
        (128,),
        32,
        num_classes=2,
        vocab=1000,
    ),
    "resnet20": ModelSpec("resnet20", "ResNet-20 (GroupNorm) for CIFAR-10", resnet20, (3, 32, 32), 64),
}
DEFAULT_MODELS = ("cnn", "mlp", "transformer", "resnet20")


def batch_of(spec: ModelSpec, args: argparse.Namespace) -> int:
    return args.batch_size if args.batch_size is not None else spec.batch_size


def fixed_batch(
    spec: ModelSpec, batch_size: int, device: torch.device, seed: int = 0
) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    if spec.vocab is not None:
        x = torch.randint(0, spec.vocab, (batch_size, *spec.input_shape), generator=g)
    else:
        x = torch.randn((batch_size, *spec.input_shape), generator=g)
    y = torch.randint(0, spec.num_classes, (batch_size,), generator=g)
    return x.to(device), y.to(device)


class _RepeatDataset(Dataset):
    """A data set of ``n`` examples that cycles the fixed batch: it only tells Opacus N (and q)."""

    def __init__(self, x: Tensor, y: Tensor, n: int) -> None:
        self.x, self.y, self.n = x.cpu(), y.cpu(), n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        j = i % len(self.y)
        return self.x[j], self.y[j]


# -- variants -------------------------------------------------------------------------------------------
Phase = tuple[str, Callable[[], None]]


@dataclass
class Variant:
    """One way of running the step: named phases (timed separately), then ``zero`` (also timed)."""

    name: str
    phases: list[Phase] = field(default_factory=list)
    zero: Callable[[], None] = lambda: None
    params: list[nn.Parameter] = field(default_factory=list)
    error: str | None = None
    times: list[float] = field(default_factory=list)
    phase_times: dict[str, list[float]] = field(default_factory=dict)
    rounds: int = 0
    peak_bytes: int | None = None  # tensor bytes (allocator events on CPU, max_memory_allocated on CUDA)
    rss_bytes: int | None = None  # CPU: process RSS high-water mark
    note: str = ""
    engine: PrivateStepEngine | None = None  # lightning-dp variants: for the correctness check
    paths: str = ""  # lightning-dp variants: how many layers take which per-example path
    ctx: StepContext | None = None  # lightning-dp variants: the last step's context (per-example norms)
    norms: Tensor | None = None  # lightning-dp variants: the checked first step's per-example norms


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR)


def build_plain(base: nn.Module, x: Tensor, y: Tensor) -> Variant:
    model = copy.deepcopy(base)
    opt = _sgd(model)

    def fwd_bwd() -> None:
        F.cross_entropy(model(x), y).backward()

    return Variant(
        "plain",
        [("fwd+bwd", fwd_bwd), ("update", opt.step)],
        zero=lambda: opt.zero_grad(set_to_none=True),
        params=list(model.parameters()),
    )


def private_variant(
    base: nn.Module,
    forward_backward: Callable[[nn.Module], Callable[[], None]],
    batch_size: int,
    mode: GradMode = "auto",
    *,
    name: str = "lightning-dp",
    lr: float = LR,
    dataset_size: int = DATASET_SIZE,
    secure: bool = False,
    clipping: Clipping | None = None,
) -> Variant:
    """The library's :class:`~lightning_dp.engine.PrivateStepEngine` on a copy of ``base`` (σ = SIGMA,
    C = MAX_GRAD_NORM, SGD over the trainable parameters): fwd+bwd (``forward_backward(model)``),
    privatize, update. Shared by this script, ``model_zoo.py`` and ``gpu_speed.py``. ``secure``: the slots
    of ``DPStrategy(secure=True)`` (integer grid, discrete Gaussian from ``os.urandom``); ``clipping``: another
    clipping slot with ConstantNoise (default FlatClipping)."""
    model = copy.deepcopy(base)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=lr)
    noise: Noise = DiscreteGaussian(SIGMA) if secure else ConstantNoise(SIGMA)
    if isinstance(noise, DiscreteGaussian):
        clipping = GridClipping(noise.grid)
    engine = PrivateStepEngine(
        sampler=Poisson(seed=0), clipping=clipping or FlatClipping(), noise=noise, step=Step(),
        max_grad_norm=MAX_GRAD_NORM, delta=1e-5, target_epsilon=None, accountant="rdp",
        loss_reduction="mean", seed=0, grad_sample_mode=mode,
    )  # fmt: skip
    engine.attach(model)
    engine.sampler.bind(dataset_size, batch_size)
    grads = engine.grads
    assert grads is not None

    def zero() -> None:
        opt.zero_grad(set_to_none=True)
        grads.clear()

    variant = Variant(
        name,
        [
            ("fwd+bwd", forward_backward(model)),
            ("privatize", lambda: setattr(variant, "ctx", engine.privatize())),
            ("update", lambda: engine.apply_step(opt)),
        ],
        zero=zero,
        params=trainable,
    )
    variant.engine = engine
    paths = Counter(grads.path_of(m) for _, m in grads.layers)
    variant.paths = f"{grads.mode} mode: " + ", ".join(f"{n} {k}" for k, n in sorted(paths.items()))
    return variant


def build_lightning_dp(
    base: nn.Module,
    x: Tensor,
    y: Tensor,
    mode: GradMode,
    secure: bool = False,
    clipping: str | None = None,
) -> Variant:
    def forward_backward(model: nn.Module) -> Callable[[], None]:
        return lambda: F.cross_entropy(model(x), y).backward()

    slot = {"quantile": QuantileClipping, "auto": AutoClipping}[clipping]() if clipping else None
    name = "lightning-dp secure" if secure else f"lightning-dp {clipping or mode}"
    return private_variant(base, forward_backward, len(y), mode, name=name, secure=secure, clipping=slot)


def _opacus_loader(x: Tensor, y: Tensor) -> DataLoader:
    return DataLoader(_RepeatDataset(x, y, DATASET_SIZE), batch_size=len(y))


def build_opacus_hooks(base: nn.Module, x: Tensor, y: Tensor) -> Variant:
    model = copy.deepcopy(base)
    gsm, dp_opt, _ = PrivacyEngine().make_private(
        module=model,
        optimizer=_sgd(model),
        data_loader=_opacus_loader(x, y),
        noise_multiplier=SIGMA,
        max_grad_norm=MAX_GRAD_NORM,
        poisson_sampling=False,
    )

    def fwd_bwd() -> None:
        F.cross_entropy(gsm(x), y).backward()

    return Variant(
        "opacus hooks",
        [("fwd+bwd", fwd_bwd), ("step", dp_opt.step)],
        zero=lambda: dp_opt.zero_grad(set_to_none=True),
        params=list(model.parameters()),
    )


def build_opacus_ghost(base: nn.Module, x: Tensor, y: Tensor) -> Variant:
    model = copy.deepcopy(base)
    gsm, dp_opt, criterion, _ = PrivacyEngine().make_private(
        module=model,
        optimizer=_sgd(model),
        data_loader=_opacus_loader(x, y),
        noise_multiplier=SIGMA,
        max_grad_norm=MAX_GRAD_NORM,
        poisson_sampling=False,
        grad_sample_mode="ghost",
        criterion=nn.CrossEntropyLoss(),
    )

    def fwd_bwd() -> None:
        criterion(gsm(x), y).backward()

    return Variant(
        "opacus ghost",
        [("fwd+bwd", fwd_bwd), ("step", dp_opt.step)],
        zero=lambda: dp_opt.zero_grad(set_to_none=True),
        params=list(model.parameters()),
    )


BUILDERS: dict[str, Callable[[nn.Module, Tensor, Tensor], Variant]] = {
    "plain": build_plain,
    "lightning-dp fast": functools.partial(build_lightning_dp, mode="fast"),
    "lightning-dp materialize": functools.partial(build_lightning_dp, mode="materialize"),
    "lightning-dp quantile": functools.partial(build_lightning_dp, mode="fast", clipping="quantile"),
    "lightning-dp auto": functools.partial(build_lightning_dp, mode="fast", clipping="auto"),
    # secure=True (issue #50); not a default variant: `--variants plain,lightning-dp fast,lightning-dp secure`
    "lightning-dp secure": functools.partial(build_lightning_dp, mode="auto", secure=True),
    "opacus hooks": build_opacus_hooks,
    "opacus ghost": build_opacus_ghost,
}


def _reason(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".replace("\n", " ")
    return text if len(text) <= 90 else text[:87] + "..."


# -- timing ---------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CLOCK: Callable[[], float] = time.perf_counter
"""What ``run_step`` times with: wall time (``bench/model_zoo.py --clock cpu`` sets the process's CPU
time, which a busy shared machine inflates less)."""


def run_step(v: Variant, device: torch.device, record: bool) -> float:
    """One step (all phases, then zero_grad); returns its time in seconds (:data:`CLOCK`)."""
    clock = CLOCK
    _sync(device)
    start = last = clock()
    for name, fn in v.phases:
        fn()
        _sync(device)
        now = clock()
        if record:
            v.phase_times.setdefault(name, []).append(now - last)
        last = now
    v.zero()
    _sync(device)
    end = clock()
    if record:
        v.phase_times.setdefault("zero_grad", []).append(end - last)
        v.times.append(end - start)
    return end - start


def check_variant(v: Variant, device: torch.device) -> None:
    """Run one step and assert the gradient it applied and the weights it produced are finite."""
    before = [p.detach().clone() for p in v.params]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _, fn in v.phases:
            fn()
    inconsistent = [w for w in caught if "do not add up" in str(w.message)]
    if inconsistent:
        raise AssertionError(str(inconsistent[0].message))
    grads = [p.grad for p in v.params]
    if any(g is None for g in grads):
        raise AssertionError("a parameter has no gradient after the step")
    if not all(bool(torch.isfinite(g).all()) for g in grads if g is not None):
        raise AssertionError("non-finite gradient")
    if not all(bool(torch.isfinite(p).all()) for p in v.params):
        raise AssertionError("non-finite weights after the step")
    if all(torch.equal(b, p.detach()) for b, p in zip(before, v.params)):
        raise AssertionError("the step did not change the weights")
    engine = v.engine
    if engine is not None and (engine.steps != 1 or engine.pending_ctx is not None):
        raise AssertionError("the engine did not complete exactly one private step")
    if v.ctx is not None:
        v.norms = v.ctx.extras["per_sample_norms"].detach().clone()
    v.zero()
    _sync(device)


# -- memory ---------------------------------------------------------------------------------------------
_LIBC: Any = None


def _malloc_trim() -> None:
    global _LIBC
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL("libc.so.6")
        _LIBC.malloc_trim(0)
    except OSError:
        pass


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def rss_peak_available() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _status_kb("VmHWM")
        return True
    except OSError:
        return False


def measure_peak(v: Variant, device: torch.device) -> int | None:
    """Most tensor bytes one step has live at once, over those live before it.

    CUDA: ``max_memory_allocated`` over ``memory_allocated``. CPU: the same quantity from torch's
    CPU allocator itself: every allocation and free of the step, in order, as recorded by
    ``torch.profiler`` with ``profile_memory=True`` (a free of a block allocated before the step is
    not recorded, so the figure can only err high). Exact and repeatable, unlike RSS; None if this
    torch does not expose the events.
    """
    gc.collect()
    if device.type == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run_step(v, device, record=False)
        return torch.cuda.max_memory_allocated(device) - base
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        run_step(v, device, record=False)
    try:
        events = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    except AttributeError:
        return None
    allocations = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in allocations:
        live += nbytes
        peak = max(peak, live)
    return peak


def measure_rss(v: Variant, device: torch.device) -> int:
    """CPU: the process's peak RSS during one step (VmHWM, reset through /proc/self/clear_refs) over
    its RSS just before it, after ``malloc_trim`` so freed heap pages do not hide new allocations.

    Adds what tensor bytes miss (oneDNN/MKL workspaces, malloc fragmentation) and moves by tens of
    percent between runs of the same code with the heap's state; tracemalloc would see neither: it
    traces Python's allocators only, and torch allocates tensor storage with its own.
    """
    gc.collect()
    _malloc_trim()
    base = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    run_step(v, device, record=False)
    return max(0, _status_kb("VmHWM") - base)


# -- the step benchmark -----------------------------------------------------------------------------------
def schedule(num_rounds: int, count: int) -> set[int]:
    """``count`` rounds out of ``num_rounds``, spread evenly (so a slow variant stays interleaved)."""
    if count >= num_rounds:
        return set(range(num_rounds))
    return {min(num_rounds - 1, int(k * num_rounds / count)) for k in range(count)}


def norm_gap(variants: list[Variant]) -> float | None:
    """Largest relative gap between the fast and the materialised path's per-example norms (first step)."""
    by_name = {v.name: v.norms for v in variants if v.norms is not None}
    fast, full = by_name.get("lightning-dp fast"), by_name.get("lightning-dp materialize")
    if fast is None or full is None:
        return None
    return float((fast - full).abs().max() / full.abs().max().clamp(min=1e-12))


def bench_model(spec: ModelSpec, args: argparse.Namespace, device: torch.device) -> list[Variant]:
    torch.manual_seed(0)
    base = spec.build().to(device)
    x, y = fixed_batch(spec, batch_of(spec, args), device)
    variants: list[Variant] = []
    for name in args.variants:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                v = BUILDERS[name](base, x, y)
            check_variant(v, device)
        except Exception as err:  # a mode that does not support this model: report, don't crash
            v = Variant(name, error=_reason(err))
        variants.append(v)
    live = [v for v in variants if v.error is None]

    # Warm-up, which also estimates each variant's step time to size its share of the rounds.
    estimate: dict[str, float] = {}
    for v in live:
        try:
            ts = [run_step(v, device, record=False) for _ in range(max(1, args.warmup))]
            estimate[v.name] = statistics.median(ts)
        except Exception as err:
            v.error = _reason(err)
    live = [v for v in live if v.error is None]
    plan: dict[str, set[int]] = {}
    for v in live:
        count = min(args.rounds, max(args.min_rounds, int(args.budget / max(estimate[v.name], 1e-9))))
        plan[v.name] = schedule(args.rounds, count)
        if count < args.rounds:
            v.note = f"{count} of {args.rounds} rounds (slow: ~{estimate[v.name]:.2f} s/step, {args.budget:g} s budget)"

    gc.collect()
    gc.disable()
    try:
        for r in range(args.rounds):
            order = live[r % len(live) :] + live[: r % len(live)] if live else []
            for v in order:
                if v.error is None and r in plan[v.name]:
                    try:
                        run_step(v, device, record=True)
                    except Exception as err:
                        v.error = _reason(err)
            gc.collect()
    finally:
        gc.enable()
    for v in live:
        v.rounds = len(v.times)

    if args.memory:
        can_rss = device.type == "cpu" and rss_peak_available()
        for v in live:
            if v.error is None:
                v.peak_bytes = measure_peak(v, device)
            if v.error is None and can_rss:
                v.rss_bytes = min(measure_rss(v, device) for _ in range(2))
    return variants


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def _memory_cells(nbytes: int | None, plain: int | None) -> tuple[str, str]:
    """(MB, ratio to plain) as printed; n/a where not measured."""
    if nbytes is None:
        return "n/a", "n/a"
    return f"{nbytes / 2**20:,.1f}", f"{nbytes / plain:.2f}" if plain else "n/a"


def print_model_table(
    spec: ModelSpec, variants: list[Variant], args: argparse.Namespace, params: int
) -> None:
    shape = ", ".join(str(d) for d in (batch_of(spec, args), *spec.input_shape))
    print(f"\n{spec.title} ({params:,} parameters), batch ({shape}), {args.device}")
    w = 26
    header = (
        f"{'variant':<{w}}{'n':>4}{'median ms':>12}{'IQR ms':>18}{'× plain':>9}{'peak MB':>10}{'mem × plain':>13}"
        f"{'RSS MB':>9}{'RSS × plain':>13}"
    )
    print(header)
    print("-" * len(header))
    plain = next((v for v in variants if v.name == "plain" and v.error is None and v.times), None)
    plain_median = statistics.median(plain.times) if plain else None
    plain_peak = plain.peak_bytes if plain is not None else None
    plain_rss = plain.rss_bytes if plain is not None else None
    for v in variants:
        if v.error is not None or not v.times:
            print(f"{v.name:<{w}}  n/a ({v.error or 'no timed rounds'})")
            continue
        med = statistics.median(v.times)
        iqr = f"{_ms(quantile(v.times, 0.25))}-{_ms(quantile(v.times, 0.75))}"
        ratio = f"{med / plain_median:.2f}" if plain_median else "n/a"
        peak, mem = _memory_cells(v.peak_bytes, plain_peak)
        rss, rss_ratio = _memory_cells(v.rss_bytes, plain_rss)
        print(
            f"{v.name:<{w}}{v.rounds:>4}{_ms(med):>12}{iqr:>18}{ratio:>9}{peak:>10}{mem:>13}{rss:>9}{rss_ratio:>13}"
        )
    print("  phases (median ms):")
    for v in variants:
        if v.error is None and v.times:
            parts = ", ".join(f"{k} {_ms(statistics.median(t))}" for k, t in v.phase_times.items())
            print(f"    {v.name:<{w}}{parts}")
    for v in variants:
        if v.paths:
            print(f"  {v.name}: {v.paths}")
    print_clipping_ratios(variants)
    gap = norm_gap(variants)
    if gap is not None:
        print(f"  check: fast vs materialised per-example norms (first step), max relative gap {gap:.1e}")
    for v in variants:
        if v.note:
            print(f"  note: {v.name}: {v.note}")


def print_clipping_ratios(variants: list[Variant]) -> None:
    """The adaptive clipping slots' median step time as a ratio to DP-SGD's (``lightning-dp fast``)."""
    timed = {v.name: statistics.median(v.times) for v in variants if v.error is None and v.times}
    dpsgd = timed.get("lightning-dp fast")
    cells = [
        f"{n} ×{timed[n] / dpsgd:.2f}" for n in ("lightning-dp quantile", "lightning-dp auto") if n in timed
    ]
    if dpsgd and cells:
        print("  clipping slots vs DP-SGD (lightning-dp fast, FlatClipping): " + ", ".join(cells))


def variant_record(spec: ModelSpec, v: Variant, plain_median: float | None) -> dict[str, Any]:
    rec: dict[str, Any] = {"model": spec.key, "variant": v.name}
    if v.error is not None or not v.times:
        rec["error"] = v.error or "no timed rounds"
        return rec
    med = statistics.median(v.times)
    rec.update(
        rounds=v.rounds,
        median_ms=med * 1e3,
        p25_ms=quantile(v.times, 0.25) * 1e3,
        p75_ms=quantile(v.times, 0.75) * 1e3,
        ratio_to_plain=med / plain_median if plain_median else None,
        peak_mb=v.peak_bytes / 2**20 if v.peak_bytes is not None else None,
        rss_peak_mb=v.rss_bytes / 2**20 if v.rss_bytes is not None else None,
        phases_median_ms={k: statistics.median(t) * 1e3 for k, t in v.phase_times.items()},
        note=v.note or None,
    )
    return rec


# -- the Trainer benchmark -----------------------------------------------------------------------------------
class _Classifier(L.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _sgd(self)


class _StepTimer(L.Callback):
    """Timestamps each training batch: start (batch already fetched) and end (after every callback)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.starts: list[float] = []
        self.ends: list[float] = []

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        _sync(self.device)
        self.starts.append(time.perf_counter())

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        _sync(self.device)
        self.ends.append(time.perf_counter())


def bench_trainer(spec: ModelSpec, args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    # One epoch covers every step: no epoch boundary inside.
    n = batch_of(spec, args) * (args.trainer_steps + 1)
    data = TensorDataset(*fixed_batch(spec, n, torch.device("cpu"), seed=1))
    configs: list[tuple[str, Callable[[], tuple[Any, list[L.Callback]]]]] = [
        ("plain Trainer", lambda: ("auto", [])),
        (
            "DPStrategy, ε logged every step",
            lambda: (DPStrategy(noise_multiplier=SIGMA, seed=0), [PrivacyCallback(report=False)]),
        ),
        (
            "DPStrategy, ε logged once",
            lambda: (
                DPStrategy(noise_multiplier=SIGMA, seed=0),
                [PrivacyCallback(log_every_n_steps=10**9, report=False)],
            ),
        ),
    ]
    pooled: dict[str, dict[str, list[float]]] = {
        label: {"step": [], "loop": [], "fit": []} for label, _ in configs
    }
    for repeat in range(args.trainer_repeats):
        for label, make in configs if repeat % 2 == 0 else configs[::-1]:
            in_step, loop, total = _fit_once(spec, args, device, data, make)
            pooled[label]["step"] += in_step
            pooled[label]["loop"] += loop
            pooled[label]["fit"].append(total)
    rows = []
    for label, _ in configs:
        r = pooled[label]
        rows.append(
            {
                "config": label,
                "timed": len(r["step"]),
                "step_ms": statistics.median(r["step"]) * 1e3,
                "loop_ms": statistics.median(r["loop"]) * 1e3,
                "fit_s": statistics.median(r["fit"]),
            }
        )
    return rows


def _fit_once(
    spec: ModelSpec,
    args: argparse.Namespace,
    device: torch.device,
    data: TensorDataset,
    make: Callable[[], tuple[Any, list[L.Callback]]],
) -> tuple[list[float], list[float], float]:
    """One ``trainer.fit``; returns the in-step and start-to-start times (s) after warm-up, and the fit time."""
    skip = min(args.warmup, args.trainer_steps // 2)
    torch.manual_seed(0)
    module = _Classifier(spec.build())
    strategy, callbacks = make()
    timer = _StepTimer(device)
    loader = DataLoader(data, batch_size=batch_of(spec, args), shuffle=True, drop_last=True)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            **trainer_kwargs(
                accelerator=device.type,
                devices=1,
                strategy=strategy,
                max_steps=args.trainer_steps,
                max_epochs=1,
                callbacks=[*callbacks, timer],  # the privacy callback first: its logging is inside the step
                default_root_dir=root,
            )
        )
        t0 = time.perf_counter()
        trainer.fit(module, train_dataloaders=loader)
        total = time.perf_counter() - t0
    in_step = [e - s for s, e in zip(timer.starts, timer.ends)][skip:]
    loop = [b - a for a, b in zip(timer.starts, timer.starts[1:])][skip:]
    return in_step, loop, total


def epsilon_readout_ms(batch_size: int, dataset_size: int, repeats: int = 200) -> float:
    """Median cost of what the privacy callback adds to the ledger's work per step: record + ε readout."""
    ledger = PrivacyLedger(delta=1e-5, accountant="rdp")
    event = PoissonGaussian(noise_multiplier=SIGMA, sample_rate=batch_size / dataset_size)
    times = []
    for _ in range(repeats):
        ledger.record(event)
        t0 = time.perf_counter()
        ledger.epsilon()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def print_trainer_table(spec: ModelSpec, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\nlightning.Trainer, {spec.title}, batch {batch_of(spec, args)} (Poisson for DP), {args.device}, logger=False"
    )
    header = f"{'configuration':<34}{'steps':>6}{'step ms':>10}{'loop ms':>10}{'× plain':>9}{'fit s':>7}"
    print(header)
    print("-" * len(header))
    base = rows[0]["loop_ms"] if rows else None
    for r in rows:
        ratio = f"{r['loop_ms'] / base:.2f}" if base else "n/a"
        print(
            f"{r['config']:<34}{r['timed']:>6}{r['step_ms']:>10.1f}{r['loop_ms']:>10.1f}{ratio:>9}{r['fit_s']:>7.1f}"
        )
    print(
        "  step ms: on_train_batch_start → end of on_train_batch_end (training_step, backward, privatize,\n"
        "  optimizer step, the privacy callback); loop ms: start to start of consecutive batches (adds\n"
        "  fetching and collating the next batch); medians over every fit's steps after its first warm-up\n"
        f"  steps, {args.trainer_repeats} fits per configuration in alternating order; × plain on loop ms.\n"
        f"  For scale: the ledger's ε readout after a new step (PrivacyLedger.epsilon, RDP) takes "
        f"{epsilon_readout_ms(batch_of(spec, args), batch_of(spec, args) * (args.trainer_steps + 1)):.3f} ms."
    )


# -- main -----------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="one batch for every model (default: each model's own, "
        + ", ".join(f"{k} {m.batch_size}" for k, m in MODELS.items())
        + ")",
    )
    p.add_argument("--rounds", type=int, default=60, help="interleaved rounds (each variant once per round)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant before the rounds")
    p.add_argument(
        "--budget",
        type=float,
        default=15.0,
        help="seconds of timed steps per variant and model; a slower variant runs in fewer (evenly spread) rounds",
    )
    p.add_argument("--min-rounds", type=int, default=7, help="rounds a slow variant still gets")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma-separated, from {list(MODELS)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {list(VARIANTS)}")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--trainer-steps", type=int, default=60, help="steps per fit in the Trainer table (0: skip it)"
    )
    p.add_argument("--trainer-repeats", type=int, default=2, help="fits per Trainer configuration")
    p.add_argument("--trainer-model", default="cnn", choices=sorted(MODELS))
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak-memory pass")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for m in args.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; choose from {sorted(MODELS)}")
    for v in args.variants:
        if v not in BUILDERS:
            p.error(f"unknown variant {v!r}; choose from {list(VARIANTS)}")
    if args.rounds < 1 or (args.batch_size is not None and args.batch_size < 1):
        p.error("--rounds and --batch-size must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):  # already set if torch started its inter-op pool
        torch.set_num_interop_threads(1)
    for name in ("lightning", "lightning.pytorch", "lightning_dp", "opacus"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*Full backward hook is firing.*")
    warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*treespec.*")
    device = torch.device(args.device)
    cpu = cpu_name()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    print(
        f"step_time: torch {torch.__version__}, opacus {opacus.__version__}, lightning {L.__version__}, "
        f"lightning-dp {lightning_dp.__version__}"
    )
    print(
        f"device {args.device}{f' ({gpu})' if gpu else ''}, CPU {cpu}, torch threads {torch.get_num_threads()}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"
    )
    print(
        f"σ={SIGMA}, C={MAX_GRAD_NORM}, SGD lr={LR}, q=B/{DATASET_SIZE}; {args.rounds} interleaved "
        f"rounds after {args.warmup} warm-up steps; medians; peak MB = most tensor bytes live at once in "
        f"a step over those live before it ({'max_memory_allocated' if device.type == 'cuda' else 'from the CPU allocator events'})"
        + ("; RSS MB = the same from the process RSS high-water mark" if device.type == "cpu" else "")
    )
    results: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "env": {
            "torch": torch.__version__,
            "opacus": opacus.__version__,
            "lightning": L.__version__,
            "lightning_dp": lightning_dp.__version__,
            "cpu": cpu,
            "gpu": gpu,
            "threads": torch.get_num_threads(),
        },
        "models": {},
        "steps": [],
        "trainer": [],
    }
    for key in args.models:
        spec = MODELS[key]
        t0 = time.perf_counter()
        variants = bench_model(spec, args, device)
        params = sum(p.numel() for p in spec.build().parameters())
        print_model_table(spec, variants, args, params)
        print(f"  ({time.perf_counter() - t0:.0f} s)")
        plain = next((v for v in variants if v.name == "plain" and v.times), None)
        plain_median = statistics.median(plain.times) if plain else None
        results["models"][key] = {
            "title": spec.title,
            "parameters": params,
            "input_shape": [batch_of(spec, args), *spec.input_shape],
        }
        results["steps"] += [variant_record(spec, v, plain_median) for v in variants]
        del variants
        gc.collect()
    if args.trainer_steps > 0:
        spec = MODELS[args.trainer_model]
        try:
            rows = bench_trainer(spec, args, device)
            print_trainer_table(spec, rows, args)
            for r in rows:
                r["loop_ratio_to_plain"] = r["loop_ms"] / rows[0]["loop_ms"]
            results["trainer"] = rows
        except Exception as err:
            print(f"\nlightning.Trainer table: n/a ({_reason(err)})")
            results["trainer"] = [{"error": _reason(err)}]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
