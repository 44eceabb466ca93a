"""CUDA correctness (issue #30): the paths only a GPU exercises, checked on the device they run on.

Every test takes a ``device``: the ``cuda`` cases skip without a GPU, and the ``cpu`` cases run in the
ordinary suite (on a few zoo models), so the bodies cannot rot between GPU visits. ``bench/gpu_check.py``
runs the ``cuda`` cases on a GPU, each test in the part its ``cuda`` marker names, within that part's
time box. Precisions: ``fp32`` (TF32 off for matmuls and cuDNN), ``tf32`` (on for both, what
``torch.set_float32_matmul_precision("high")`` and cuDNN's default give; CUDA only) and ``bf16-mixed``
(autocast, PyTorch's default TF32 flags). References are computed on the same device: fp64 for fp32;
for tf32 and bf16-mixed, autograd in the same precision through the same layers (the per-example path swaps
attention and RNN layers for exact equivalents, which round differently from PyTorch's own kernels: at a
ReLU's kink one bf16 unit decides the gradient, so a reference through other kernels is no reference).
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import TinyModule, ZeroSignal, make_trainer
from lightning.pytorch import seed_everything
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import (
    DPIS,
    AdaCliP,
    AdaptiveGD,
    DPConfigurationError,
    DPStrategy,
    HeavyBall,
    LineSearch,
    Nesterov,
    NoiseDividing,
)
from lightning_dp.per_example import GradientCapture
from lightning_dp.per_example.kernels import is_supported, linear
from lightning_dp.per_example.kernels.certified import GUARD_FRACTION
from lightning_dp.per_example.kernels.conv_autotune import force_conv_method
from lightning_dp.run.prepare import replace_batchnorm
from tests.per_example.test_certified import (
    BOUND,
    FAMILIES,
    CancellingSequenceModel,
    assert_bounded,
    conv_method,
    with_normal_examples,
)
from tests.per_example.test_model_zoo import reference_grads
from tests.per_example.zoo import ZOO, ZooModel, zoo_lightning_module
from tests.tolerances import UNDERSTATE

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", "cuda"]
PRECISIONS = ["fp32", "bf16-mixed", "tf32"]
"""In the order the cuda cases run: if a part's time box runs out, TF32 (a setting users opt into) is left out first."""

CPU_ZOO = (
    "hf_gpt2_lm_tied",
    "timm_vit",
    "timm_resnet_groupnorm",
    "lstm_packed_bidirectional",
    "transformer_encoder",
    "channels_last_cnn_custom_layer",
)
"""The zoo models the cpu cases run on (HF, timm, convolutions, RNN and attention swaps, a functorch layer);
the cuda cases run the whole zoo."""

CPU_SKIP = {("bf16-mixed", "timm_resnet_groupnorm")}
"""Not run on the CPU: there PyTorch's own bf16 weight gradient of this model's last 1×1-pixel convolution
came out non-finite or ~1e31 in 6 of 20 plain backward passes (torch 2.14.1, oneDNN on an AMX CPU), where
the exact gradient is 0."""

CPU_FAMILIES = ("linear-gram", "conv-pairs-unfold", "embedding-gram-pairs")
"""Crafted certified-norm families the cpu cases run (tests/per_example/test_certified.py runs them all)."""

TF32 = {"fp32": (False, False), "tf32": (True, True), "bf16-mixed": (False, True)}
"""(matmul, cuDNN) TF32 flags per precision; bf16-mixed keeps PyTorch's defaults (cuDNN convolutions in TF32)."""

EPS = {
    "fp32": torch.finfo(torch.float32).eps,
    "tf32": 2.0**-10,
    "bf16-mixed": torch.finfo(torch.bfloat16).eps,
}
"""Relative spacing of the dtype each precision computes in (TF32 keeps a 10-bit mantissa)."""

GRAD_RTOL = {"fp32": 1e-4, "tf32": 2e-2, "bf16-mixed": 1e-1}
"""Per-example gradients against the reference, relative to each parameter's largest per-example entry: fp32
against fp64 (the zoo measured ≤ 3e-6 on CPU); tf32 and bf16 against autograd in the same precision on each
example alone, which rounds in other places (bf16 measured ≤ 3.3e-2 on CPU, a few units of 2⁻⁷; TF32's unit
is 8× smaller)."""


def _cases(*precisions: str, models: list[ZooModel] | None = None) -> list[Any]:
    """(device, precision[, zoo model]) parameters: cuda cases skip without CUDA, tf32 is CUDA-only and the
    cpu cases keep to ``CPU_ZOO``."""
    out = []
    for device in DEVICES:
        for precision in precisions:
            if device == "cpu" and precision == "tf32":
                continue
            marks = [pytest.mark.skipif(not CUDA, reason="needs CUDA")] if device == "cuda" else []
            if models is None:
                out.append(pytest.param(device, precision, marks=marks, id=f"{device}-{precision}"))
                continue
            for entry in models:
                if device == "cpu" and (entry.name not in CPU_ZOO or (precision, entry.name) in CPU_SKIP):
                    continue
                out.append(
                    pytest.param(
                        device, precision, entry, marks=marks, id=f"{device}-{precision}-{entry.name}"
                    )
                )
    return out


def _device_cases() -> list[Any]:
    return [
        pytest.param(
            d, marks=[pytest.mark.skipif(not CUDA, reason="needs CUDA")] if d == "cuda" else [], id=d
        )
        for d in DEVICES
    ]


@contextlib.contextmanager
def precision_flags(precision: str) -> Iterator[None]:
    """Set the TF32 flags ``precision`` runs with; restore the previous ones afterwards."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = TF32[precision]
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def autocast(device: str, precision: str) -> contextlib.AbstractContextManager[Any]:
    """The forward's autocast under ``bf16-mixed`` (as Lightning's precision plugin does), else nothing."""
    if precision == "bf16-mixed":
        return torch.autocast(device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def trainer_args(device: str, precision: str) -> dict[str, Any]:
    return {
        "accelerator": "gpu" if device == "cuda" else "cpu",
        "devices": 1,
        "precision": "bf16-mixed" if precision == "bf16-mixed" else "32-true",
    }


def _zoo_model(entry: ZooModel, device: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = entry.build()
    if entry.on_batchnorm == "replace":
        replace_batchnorm(model)
    return model.to(device=device, dtype=dtype).train()


def _zoo_batch(entry: ZooModel, device: str, dtype: torch.dtype) -> tuple[Tensor, ...]:
    batch = entry.batch(torch.Generator().manual_seed(1))
    return tuple(t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device) for t in batch)


# --------------------------------------------------------------------------------------------------
# Part "gradients": per-example gradients and certified norms from the kernels on the device
# --------------------------------------------------------------------------------------------------


@pytest.mark.cuda("gradients")
@pytest.mark.parametrize(("device", "precision", "entry"), _cases(*PRECISIONS, models=ZOO))
def test_per_example_gradients_match_autograd(device: str, precision: str, entry: ZooModel) -> None:
    """The captured per-example gradients average to autograd's batch gradient of the same pass, equal
    autograd's on each example alone (fp64 for fp32; the same precision otherwise, through the same swapped
    layers), and the norm the clipping uses never understates what each example adds to the released sum
    (the fast path's own weighted sum, rounding included)."""
    with precision_flags(precision):
        model = _zoo_model(entry, device, torch.float32)
        batch = _zoo_batch(entry, device, torch.float32)
        grads = GradientCapture(model)
        try:
            if precision == "fp32":
                ref_model, ref_batch = (
                    _zoo_model(entry, device, torch.float64),
                    _zoo_batch(entry, device, torch.float64),
                )
                pairs = zip(model.parameters(), ref_model.parameters(), strict=True)
                ref_params = {p: q for p, q in pairs if p.requires_grad}
                expected = [
                    {p: r[q] for p, q in ref_params.items()} for r in reference_grads(ref_model, ref_batch)
                ]
            else:  # each example alone through the layers the capture swapped in, not recording
                grads.enabled = False
                with autocast(device, precision):
                    expected = reference_grads(model, batch)
                grads.enabled = True
            with autocast(device, precision):
                loss = model(*batch)
            loss.backward()
            batch_grad = {p: p.grad.detach().clone() for p in model.parameters() if p.grad is not None}
            samples, n = grads.collect()
            norms = samples.sq_norms().double().cpu()
            released = []
            for i in range(n):  # before materialize(): afterwards the sums would come from its copies
                alone = torch.zeros(n, device=device)
                alone[i] = 1.0
                released.append(sum(float(s.double().square().sum()) for s in samples.weighted_sum(alone)))
            full = dict(zip(samples.params, samples.materialize(), strict=True))
        finally:
            grads.remove()
    assert n == batch[0].shape[0]
    names = {p: name for name, p in model.named_parameters()}
    overall = max(float(g.abs().max()) for r in expected for g in r.values())
    wrong, unlike_batch = [], []
    for p in samples.params:
        reference = torch.stack([r[p] for r in expected]).double()
        scale = float(reference.abs().max()) + 1e-6 * overall
        if not float((full[p].double() - reference).abs().max()) <= GRAD_RTOL[precision] * scale:
            wrong.append(names[p])
        mean = full[p].double().mean(0)  # the zoo's losses are batch means
        if not float((mean - batch_grad[p].double()).abs().max()) <= GRAD_RTOL[precision] * scale:
            unlike_batch.append(names[p])
    assert not wrong, f"per-example gradients unlike autograd's on each example alone: {wrong}"
    assert not unlike_batch, f"per-example gradients do not average to the batch gradient: {unlike_batch}"
    sums = torch.tensor(released, dtype=torch.float64)
    assert bool(torch.isfinite(norms).all())
    assert bool((norms >= sums * (1 - UNDERSTATE)).all()), (
        f"norm² / released² - 1: {(norms / sums - 1).tolist()}"
    )
    assert bool((norms <= sums * (1 + 2.1 * GUARD_FRACTION) + 1e-30).all()), (norms / sums - 1).tolist()


CERTIFIED_CASES = [
    pytest.param(*p.values, family, marks=p.marks, id=f"{p.id}-{family}")
    for p in _cases("fp32", "tf32", "bf16-mixed")
    for family in FAMILIES
    if p.values[0] == "cuda" or family in CPU_FAMILIES
]


@pytest.mark.cuda("gradients")
@pytest.mark.parametrize(("device", "precision", "family"), CERTIFIED_CASES)
def test_certified_norms_on_crafted_cancelling_batches(
    device: str, precision: str, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/per_example/test_certified.py's crafted examples on the device: each contribution ≤ C against
    fp64 (bf16 inputs for bf16-mixed); under TF32 the released sum itself (see ``assert_bounded``)."""
    layer, x, d = FAMILIES[family]()
    assert is_supported(layer), f"{family}: no fast kernels"
    monkeypatch.setattr(linear, "FOLD_FLOATS", d[:1].numel())  # the Linear sum folds one example at a time
    x, d = with_normal_examples(x, d)
    if precision == "bf16-mixed":
        x = x.to(torch.bfloat16) if x.is_floating_point() else x
        d = d.to(torch.bfloat16)
    layer, x, d = layer.to(device), x.to(device), d.to(device)
    with precision_flags(precision), force_conv_method(conv_method(family)):
        assert_bounded(layer, x, d, exact=precision != "tf32")


def _cpu_matmul_is_reduced() -> bool:
    """Whether this CPU computes fp32 matmuls in bf16 at ``set_float32_matmul_precision("medium")`` (oneDNN
    does on CPUs with AMX or AVX-512 BF16): TF32's CPU analogue, 8 mantissa bits instead of 10."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 128, generator=g), torch.randn(128, 32, generator=g)
    exact = a.double() @ b.double()
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        error = float(((a @ b).double() - exact).abs().max() / exact.abs().max())
    finally:
        torch.set_float32_matmul_precision(saved)
    return error > 1e-4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_certified_norms_with_fp32_matmuls_in_reduced_precision_on_the_cpu(
    family: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """TF32's risk, reproduced on the CPU: ``set_float32_matmul_precision("medium")`` makes oneDNN compute fp32
    matmuls in bf16; every example must still add at most C to the released sum (the kernels run in IEEE
    fp32 whatever the user's setting: the crafted linear-gram example added 1.0000274·C before)."""
    if not _cpu_matmul_is_reduced():
        pytest.skip("this CPU computes fp32 matmuls in fp32 even at 'medium'")
    layer, x, d = FAMILIES[family]()
    monkeypatch.setattr(linear, "FOLD_FLOATS", d[:1].numel())
    x, d = with_normal_examples(x, d)
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        with force_conv_method(conv_method(family)):
            assert_bounded(layer, x, d, exact=False)
    finally:
        torch.set_float32_matmul_precision(saved)


@pytest.mark.cuda("gradients")
@pytest.mark.parametrize(("device", "precision"), _cases("fp32", "tf32"))
def test_crafted_example_is_clipped_in_a_real_private_step(device: str, precision: str) -> None:
    """σ = 0, q = 1, one crafted example through the Trainer on the device: the update is at most C."""
    model = CancellingSequenceModel()
    before = model.lin.weight.detach().clone()
    with precision_flags(precision), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*adds no noise.*")
        strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=1.0, grad_sample_mode="fast")
        make_trainer(strategy, max_steps=1, **trainer_args(device, precision)).fit(model)
    step = (model.lin.weight.detach().cpu() - before).double().norm().item()
    assert step <= BOUND, step
    if precision == "fp32":  # TF32 rounds the crafted inputs' 2⁻¹³ away: the release may be ~0 there
        assert step > 0.5, step


# --------------------------------------------------------------------------------------------------
# Part "trainer": σ = 0, C = ∞ equals plain training, and the neighbour test, through the Trainer
# --------------------------------------------------------------------------------------------------


def _full_batch(module: Any) -> DataLoader[Any]:
    data = TensorDataset(*module.data)
    return DataLoader(data, batch_size=len(data))  # q = 1: Poisson keeps every example


def _term_scales(module: Any) -> dict[str, float]:
    """Per parameter, the largest entry of one example's update (lr·g_i, fp32 on the CPU): the magnitude the
    step sums, which its rounding scales with (a sum whose terms cancel is far smaller than they are)."""
    net = copy.deepcopy(module.net).float().cpu()
    lr = module.configure_optimizers().param_groups[0]["lr"]
    data = tuple(t.cpu() for t in module.data)
    per_example = reference_grads(net, data)
    names = {p: f"net.{name}" for name, p in net.named_parameters()}
    return {names[p]: lr * max(float(r[p].abs().max()) for r in per_example) for p in per_example[0]}


@pytest.mark.cuda("trainer")
@pytest.mark.parametrize(("device", "precision", "entry"), _cases(*PRECISIONS, models=ZOO))
def test_zero_noise_infinite_clip_equals_plain_training(device: str, precision: str, entry: ZooModel) -> None:
    """Gradient fidelity: one DP step with σ = 0, C = ∞ and q = 1 moves the weights as plain training does,
    on the same device in the same precision (the sensitivity check runs, as by default), within
    ``GRAD_RTOL`` of the largest per-example term each parameter's step sums."""
    plain_module = zoo_lightning_module(entry)
    if entry.on_batchnorm == "replace":
        replace_batchnorm(plain_module)
    private_module = zoo_lightning_module(entry)
    scales = _term_scales(plain_module)
    # The private run swaps some layers for exact equivalents (attention, RNNs), which round differently in
    # bf16/TF32: a pre-activation at a ReLU's kink can then fall on the other side (seen on the CPU: one unit
    # of nn.TransformerEncoder's second linear1). Plain training runs the same swapped layers, not recording.
    swapped = GradientCapture(plain_module.net)
    swapped.enabled = False
    before = {n: p.detach().cpu().clone() for n, p in plain_module.named_parameters() if p.requires_grad}
    args = trainer_args(device, precision)
    with precision_flags(precision), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*adds no noise.*")
        seed_everything(0, verbose=False)
        plain = SingleDeviceStrategy(torch.device(device if device == "cpu" else "cuda:0"))
        make_trainer(plain, max_steps=1, **args).fit(
            plain_module, train_dataloaders=_full_batch(plain_module)
        )
        seed_everything(0, verbose=False)
        strategy = DPStrategy(
            noise_multiplier=0.0, max_grad_norm=math.inf, seed=0, on_batchnorm=entry.on_batchnorm
        )
        make_trainer(strategy, max_steps=1, **args).fit(
            private_module, train_dataloaders=_full_batch(private_module)
        )
    swapped.remove()
    assert strategy.engine.steps == 1
    plain_params = dict(plain_module.named_parameters())
    private_params = dict(private_module.named_parameters())
    overall = max(scales.values())
    wrong = []
    for name, b in before.items():
        plain_move = plain_params[name].detach().cpu().double() - b.double()
        dp_move = private_params[name].detach().cpu().double() - b.double()
        # the weights are fp32 either way: the two updates may round to neighbouring weights
        scale = scales[name] + 1e-6 * overall + 4 * EPS["fp32"] * float(b.abs().max()) / GRAD_RTOL[precision]
        error = float((dp_move - plain_move).abs().max()) / scale
        if not error <= GRAD_RTOL[precision]:
            wrong.append(f"{name} ({error:.2g})")
    assert not wrong, f"the private step moved these unlike the plain step (error / largest term): {wrong}"


@pytest.mark.cuda("trainer")
@pytest.mark.parametrize(("device", "precision", "entry"), _cases(*PRECISIONS, models=ZOO))
def test_neighbour_moves_the_released_sum_by_at_most_c(
    device: str, precision: str, entry: ZooModel, neighbour: Any
) -> None:
    """One real private step (σ = 0, tiny C) with and without one example moves the sum by ≤ C, plus the
    rounding of the n − 1 kept examples' contributions between batches of n and n − 1 (one unit of the
    compute dtype each; fp32's is within the helper's own allowance; bf16 measured ≤ 0.3 units on CPU)."""
    module = zoo_lightning_module(entry)
    data = TensorDataset(*module.data)
    C = 1e-3

    def strategy() -> DPStrategy:
        return DPStrategy(noise_multiplier=0.0, max_grad_norm=C, seed=0, on_batchnorm=entry.on_batchnorm)

    with precision_flags(precision), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*adds no noise.*")
        move = neighbour.neighbour_move(module, data, strategy, **trainer_args(device, precision))
    kept = len(data) - 1
    allowance = 0.0 if precision == "fp32" else kept * EPS[precision]
    neighbour.assert_neighbour_bound(move, bound=C * (1 + allowance))


# --------------------------------------------------------------------------------------------------
# Part "mechanisms": noise, the sensitivity check's RNG, every slot, checkpoints
# --------------------------------------------------------------------------------------------------


@pytest.mark.cuda("mechanisms")
@pytest.mark.parametrize("device", _device_cases())
def test_noise_std_is_sigma_c_over_b_from_the_device_generator(device: str) -> None:
    """One step of pure noise (lr 1, SGD): each coordinate moves by N(0, (σC/B)²), B = q·N the expected batch;
    ~13k coordinates pin the std to ±3 % and the mass within one std to 0.683 ± 0.02."""
    module = ZeroSignal(n=512, d=400, classes=250, batch_size=64, lr=1.0, hidden=20)  # 400-20-250
    before = torch.cat([p.detach().flatten() for p in module.parameters()])
    sigma, C, B = 2.0, 3.0, module.batch_size
    strategy = DPStrategy(noise_multiplier=sigma, max_grad_norm=C, seed=0, check_sensitivity=False)
    make_trainer(strategy, max_steps=1, **trainer_args(device, "fp32")).fit(module)
    assert strategy.engine.generator is not None
    assert strategy.engine.generator.device.type == device
    assert all(p.device.type == device for p in module.parameters())
    moved = torch.cat([p.detach().flatten() for p in module.parameters()]).cpu() - before
    z = moved.double() / (sigma * C / B)
    assert abs(float(z.std()) - 1) < 0.03, float(z.std())
    assert abs(float(z.mean())) < 0.05, float(z.mean())
    assert abs(float((z.abs() < 1).double().mean()) - 0.6827) < 0.02


class DropoutModule(TinyModule):
    """TinyModule with dropout between its layers: random, but per example (no mixing)."""

    def __init__(self) -> None:
        super().__init__(n=128, batch_size=32)
        self.net = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 3))


def _fit_dropout(device: str, precision: str, check: bool) -> tuple[DropoutModule, DPStrategy]:
    seed_everything(0, verbose=False)
    module = DropoutModule()
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_sensitivity=check)
    make_trainer(strategy, max_steps=3, **trainer_args(device, precision)).fit(module)
    return module, strategy


@pytest.mark.cuda("mechanisms")
@pytest.mark.parametrize(("device", "precision"), _cases("fp32", "bf16-mixed"))
def test_dropout_on_the_device_trains_and_the_check_leaves_the_run_unchanged(
    device: str, precision: str
) -> None:
    """The sensitivity check accepts per-example dropout (drawn from the device's generator), and the
    run with the check is the run without it: the check restores the random states it used."""
    with precision_flags(precision):
        checked, strategy = _fit_dropout(device, precision, check=True)
        unchecked, _ = _fit_dropout(device, precision, check=False)
    assert strategy.engine.steps == 3
    for a, b in zip(checked.parameters(), unchecked.parameters(), strict=True):
        # other dropout masks would move the weights by ~1e-2; the tolerance only allows kernel nondeterminism
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda("mechanisms")
@pytest.mark.parametrize("device", _device_cases())
@pytest.mark.parametrize("mixing", ["Mixup", "BatchStandardised"])
def test_a_model_that_mixes_examples_is_refused_on_the_device(
    device: str, mixing: str, neighbour: Any
) -> None:
    """In-batch mixup (a random permutation) and a batch statistic are refused before any release."""
    module = getattr(neighbour, mixing)(batch_size=32)
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    with pytest.raises(DPConfigurationError):
        make_trainer(strategy, max_steps=3, **trainer_args(device, "fp32")).fit(module)


class LossQueries(TinyModule):
    """TinyModule with the per-example loss that LineSearch and AdaptiveGD evaluate at candidate weights."""

    def dp_per_sample_loss(self, batch: Any) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y, reduction="none")


SLOTS: dict[str, Callable[[], dict[str, Any]]] = {
    "DPIS": lambda: {"sampler": DPIS(k=3, seed=0)},
    "AdaCliP": lambda: {"clipping": AdaCliP()},
    "LineSearch": lambda: {"step": LineSearch()},
    "AdaptiveGD": lambda: {"step": AdaptiveGD()},
    "HeavyBall": lambda: {"step": HeavyBall(beta=0.9)},
    "Nesterov": lambda: {"step": Nesterov(momentum=0.9)},
    "Nesterov+NoiseDividing": lambda: {"step": Nesterov(momentum=0.9), "noise": NoiseDividing()},
}


@pytest.mark.cuda("mechanisms")
@pytest.mark.parametrize("device", _device_cases())
@pytest.mark.parametrize("slot", list(SLOTS))
def test_every_slot_takes_private_steps_on_the_device(device: str, slot: str) -> None:
    """Each mechanism at its defaults (ε = 3 over one epoch of TinyModule) takes private steps on the device:
    finite weights that moved, on the device, and a finite ε within the target."""
    module = LossQueries(n=256, batch_size=32)
    before = [p.detach().cpu().clone() for p in module.parameters()]
    strategy = DPStrategy(target_epsilon=3.0, seed=0, **SLOTS[slot]())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(strategy, max_steps=4, **trainer_args(device, "fp32")).fit(module)
    assert strategy.engine.steps >= 1
    assert all(p.device.type == device for p in module.parameters())
    after = [p.detach().cpu() for p in module.parameters()]
    assert all(bool(torch.isfinite(p).all()) for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert 0 < strategy.epsilon <= 3.0 + 1e-9


def _resume_run(device: str, tmp_path: Any, epochs: int, ckpt: Any = None) -> tuple[TinyModule, DPStrategy]:
    seed_everything(0, verbose=False)  # the same initial weights in every run
    module = TinyModule(n=64, batch_size=16)
    strategy = DPStrategy(noise_multiplier=1.0, seed=3, step=HeavyBall())
    trainer = make_trainer(strategy, tmp_path, max_epochs=epochs, **trainer_args(device, "fp32"))
    trainer.fit(module, ckpt_path=ckpt)
    if ckpt is None and epochs == 1:
        trainer.save_checkpoint(tmp_path / "one.ckpt")
    return module, strategy


@pytest.mark.cuda("mechanisms")
@pytest.mark.parametrize("device", _device_cases())
def test_checkpoint_save_and_resume_on_the_device(device: str, tmp_path: Any) -> None:
    """A seeded run saved after one epoch and resumed for a second equals the uninterrupted run: same steps,
    ledger and ε, and the same weights (the device's noise generator state travels in the checkpoint)."""
    with precision_flags("fp32"):
        full, full_strategy = _resume_run(device, tmp_path, epochs=2)
        _resume_run(device, tmp_path, epochs=1)
        resumed, strategy = _resume_run(device, tmp_path, epochs=2, ckpt=tmp_path / "one.ckpt")
    state = torch.load(tmp_path / "one.ckpt", map_location="cpu", weights_only=True)
    assert "lightning_dp" in state
    assert strategy.engine.steps == full_strategy.engine.steps
    assert strategy.engine.ledger.history == full_strategy.engine.ledger.history
    assert strategy.epsilon == pytest.approx(full_strategy.epsilon, abs=1e-12)
    for a, b in zip(resumed.parameters(), full.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------------
# On the CPU only: the zoo stays device-clean, so the cuda cases test the library, not the test models
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ZOO, ids=repr)
def test_zoo_forward_creates_no_tensor_on_the_default_device(entry: ZooModel) -> None:
    """With the default device set to ``meta``, a tensor made without ``device=`` (``torch.arange(T)``)
    lands on meta and the forward fails, as it would on CUDA against the CPU default."""
    model = _zoo_model(entry, "cpu", torch.float32)
    batch = _zoo_batch(entry, "cpu", torch.float32)
    torch.set_default_device("meta")
    try:
        loss = model(*batch)
    finally:
        torch.set_default_device(None)
    assert loss.device.type == "cpu"
