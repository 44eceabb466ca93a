"""DPStrategy end to end on tiny models: exactness, clipping bound, noise level, sampling, refusals."""

from __future__ import annotations

import copy
import json
import math
import warnings

import pytest
import torch
from conftest import GradientRecorder, RecordingClipping, TinyModule, ZeroSignal, make_trainer
from lightning.pytorch import Callback
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn

from lightning_dp import DPStrategy, EmptyBatch, PrivacyCallback, checking
from lightning_dp.accounting import compute_epsilon


def _params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_zero_noise_infinite_clip_equals_plain_training(optimizer):
    """σ=0, C=∞ and q=1 (every example in every batch): DP-SGD must be plain full-batch training."""
    plain = TinyModule(n=64, batch_size=64, optimizer=optimizer)
    private = copy.deepcopy(plain)
    make_trainer(SingleDeviceStrategy("cpu"), max_epochs=5).fit(plain)
    make_trainer(DPStrategy(noise_multiplier=0.0, max_grad_norm=math.inf, seed=0), max_epochs=5).fit(private)
    assert private.seen_batch_sizes == [64] * 5
    for a, b in zip(_params(plain), _params(private), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_gradient_is_noisy_sum_over_expected_batch_size():
    """With q<1 the divisor is the public expected batch size q·N, never the realised batch size."""
    seen = {}

    class Capture(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen["grad"] = [p.grad.clone() for p in pl_module.parameters()]

    module = TinyModule(n=128, batch_size=32)
    reference = copy.deepcopy(module)
    strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=math.inf, seed=1, check_sensitivity=False)
    trainer = make_trainer(
        strategy, max_steps=1, callbacks=[Capture()]
    )  # records the first training_step's batch
    batches = []
    original = module.training_step

    def record(batch, batch_idx):
        if not checking():
            batches.append(batch)
        return original(batch, batch_idx)

    module.training_step = record  # type: ignore[method-assign]
    trainer.fit(module)
    x, y = batches[0]
    loss = nn.functional.cross_entropy(reference(x), y, reduction="sum") / 32.0
    expected = torch.autograd.grad(loss, list(reference.parameters()))
    for got, want in zip(seen["grad"], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_every_contribution_is_at_most_c(precision):
    module = TinyModule(n=64, batch_size=16)
    module.x = module.x * 1e3  # extreme inputs: raw per-example norms far above C
    clipping = RecordingClipping()
    C = 0.05
    trainer = make_trainer(
        DPStrategy(noise_multiplier=1.0, max_grad_norm=C, clipping=clipping, seed=0),
        precision=precision,
        max_epochs=1,
    )
    trainer.fit(module)
    assert clipping.max_raw_norm > 10 * C
    assert 0 < clipping.max_contribution <= C
    if precision == "bf16-mixed":
        assert torch.bfloat16 in clipping.grad_dtypes


def test_noise_std_matches_sigma_c_over_b():
    """Zero-signal loss: the private gradient is pure noise with std σC/(qN) on every coordinate."""
    recorder = GradientRecorder()
    sigma, C = 2.0, 3.0
    trainer = make_trainer(
        DPStrategy(noise_multiplier=sigma, max_grad_norm=C), max_steps=3, callbacks=[recorder]
    )
    trainer.fit(ZeroSignal(n=400, d=50, hidden=100, classes=50, batch_size=40))
    noise = torch.cat(recorder.grads)
    expected = sigma * C / 40.0
    assert noise.numel() > 30_000
    assert abs(float(noise.std()) / expected - 1) < 0.03
    assert abs(float(noise.mean())) < 0.03 * expected


def test_huge_noise_destroys_accuracy():
    """Guard against Opacus #313: σ=1000 must not train (the noise really reaches the weights)."""

    def accuracy(sigma: float) -> float:
        torch.manual_seed(0)
        module = TinyModule(n=512, batch_size=64, lr=0.5)
        trainer = make_trainer(DPStrategy(noise_multiplier=sigma, max_grad_norm=1.0, seed=3), max_epochs=4)
        trainer.fit(module)
        return float(trainer.test(module, verbose=False)[0]["test_acc"])

    assert accuracy(0.3) > 0.8
    assert accuracy(1000.0) < 0.6


def test_empty_batches_are_noise_only_steps_user_code_never_sees():
    module = TinyModule(n=200, batch_size=1)  # q = 1/200: about 37% of batches are empty
    before = _params(module)
    trainer = make_trainer(DPStrategy(noise_multiplier=1.0, seed=0), max_epochs=1)
    trainer.fit(module)
    strategy = trainer.strategy
    assert isinstance(strategy, DPStrategy)
    assert strategy.engine.steps == 200
    assert len(module.seen_batch_sizes) < 170  # many steps never reached training_step
    assert min(module.seen_batch_sizes) >= 1
    assert all(not torch.equal(a, b) for a, b in zip(before, _params(module), strict=True))
    assert strategy.epsilon == pytest.approx(
        compute_epsilon(noise_multiplier=1.0, sample_rate=1 / 200, steps=200, delta=1e-5)
    )


def test_collate_turns_empty_index_list_into_sentinel():
    from lightning_dp.strategies.loaders import CollateWithEmpty

    collate = CollateWithEmpty(torch.utils.data.default_collate)
    assert isinstance(collate([]), EmptyBatch)
    assert collate([torch.ones(2)]).shape == (1, 2)


def test_poisson_batches_have_the_expected_size_and_own_rng():
    sizes = []
    module = TinyModule(n=1000, batch_size=50)
    module.training_step = lambda batch, batch_idx: (
        (checking() or sizes.append(len(batch[0])))
        or nn.functional.cross_entropy(  # type: ignore[method-assign]
            module(batch[0]), batch[1]
        )
    )
    torch.manual_seed(0)
    strategy = DPStrategy(noise_multiplier=1.0, check_sensitivity=False)  # counts every training_step call
    make_trainer(strategy, max_epochs=5).fit(module)
    assert len(sizes) == 100
    assert abs(sum(sizes) / len(sizes) - 50) < 3  # std of the mean ≈ 0.7
    assert len(set(sizes)) > 5  # Poisson, not fixed-size


def test_target_epsilon_calibrates_and_never_overshoots(tmp_path):
    module = TinyModule(n=256, batch_size=32)
    trainer = make_trainer(DPStrategy(target_epsilon=2.0, seed=0), tmp_path, max_epochs=3)
    trainer.fit(module)
    strategy = trainer.strategy
    assert strategy.engine.steps == 24
    assert strategy.epsilon <= 2.0
    assert strategy.epsilon > 1.9  # calibrated, not wastefully conservative
    report = json.loads((tmp_path / "privacy_report.json").read_text())
    assert report["epsilon"] == pytest.approx(strategy.epsilon)
    assert report["steps"] == 24
    assert report["sampler"] == "Poisson"
    assert report["clipping"] == "FlatClipping"
    assert report["sample_rate"] == pytest.approx(32 / 256)
    assert (tmp_path / "privacy_curve.png").stat().st_size > 1000


def test_budget_stop_happens_before_the_step_that_would_exceed(tmp_path):
    sigma, q = 1.0, 32 / 256
    target = compute_epsilon(noise_multiplier=sigma, sample_rate=q, steps=10, delta=1e-5) + 1e-6
    module = TinyModule(n=256, batch_size=32)
    trainer = make_trainer(
        DPStrategy(noise_multiplier=sigma, target_epsilon=target, seed=0), tmp_path, max_epochs=5
    )
    trainer.fit(module)
    assert trainer.strategy.engine.steps == 10
    assert trainer.strategy.epsilon <= target
    callback = next(c for c in trainer.callbacks if isinstance(c, PrivacyCallback))
    assert callback.stopped_on_budget


def test_epsilon_is_logged_to_loggers_and_progress_bar(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    module = TinyModule(n=128, batch_size=32)
    trainer = make_trainer(
        DPStrategy(noise_multiplier=1.0, seed=0),
        tmp_path,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        max_epochs=2,
    )
    trainer.fit(module)
    assert "dp/epsilon" in trainer.progress_bar_metrics
    for key in ("dp/epsilon", "dp/delta", "dp/noise_multiplier", "dp/sample_rate", "dp/steps"):
        assert key in trainer.logged_metrics
    header = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    assert "dp/epsilon" in header


def test_registry_string_and_device_from_accelerator():
    trainer = make_trainer("dp", max_steps=2)
    assert isinstance(trainer.strategy, DPStrategy)
    trainer.fit(TinyModule())
    assert trainer.strategy.root_device == torch.device("cpu")
    assert trainer.strategy.target_epsilon == 3.0


def test_checkpoint_resume_continues_epsilon_exactly(tmp_path):
    sigma, q = 1.1, 32 / 256
    module = TinyModule(n=256, batch_size=32)
    straight = copy.deepcopy(module)
    trainer = make_trainer(DPStrategy(noise_multiplier=sigma, seed=5), tmp_path, max_epochs=2)
    trainer.fit(module)
    ckpt = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    first = trainer.strategy.engine.state_dict()
    saved = torch.load(ckpt, weights_only=True)
    assert saved["lightning_dp"]["steps"] == 16

    resumed_module = TinyModule(n=256, batch_size=32)
    resumed = make_trainer(DPStrategy(noise_multiplier=sigma, seed=5), tmp_path, max_epochs=4)
    resumed.fit(resumed_module, ckpt_path=ckpt)
    assert resumed.strategy.engine.steps == 32
    assert resumed.strategy.epsilon == pytest.approx(
        compute_epsilon(noise_multiplier=sigma, sample_rate=q, steps=32, delta=1e-5), rel=1e-9
    )
    assert first["noise_generator"] is not None

    # The same run without interruption gives the same weights (same sampler and noise streams).
    make_trainer(DPStrategy(noise_multiplier=sigma, seed=5), tmp_path, max_epochs=4).fit(straight)
    for a, b in zip(_params(straight), _params(resumed_module), strict=True):
        torch.testing.assert_close(a, b)


class WithBatchNorm(TinyModule):
    def __init__(self, affine: bool = True):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(10, 16), nn.BatchNorm1d(16, affine=affine), nn.Tanh(), nn.Linear(16, 3)
        )


def test_replaces_batchnorm_with_groupnorm_in_place():
    module = WithBatchNorm()
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "error", message=".*do not add up.*"
        )  # the replacement must not kill the layer
        strategy = DPStrategy(noise_multiplier=1.0, on_batchnorm="replace")
        make_trainer(strategy, max_steps=2).fit(module)
    assert isinstance(module.net[1], nn.GroupNorm)
    assert module.net[1].num_groups == 1  # BatchNorm1d on (B, C): one group, not one channel per group
    assert strategy.setup_notes == ["replaced BatchNorm with GroupNorm: ['net.1']"]


def test_replace_batchnorm2d_uses_gcd_groups():
    from lightning_dp.run.prepare import replace_batchnorm

    net = nn.Sequential(nn.Conv2d(3, 48, 3), nn.BatchNorm2d(48, affine=False))
    assert replace_batchnorm(net) == ["1"]
    assert isinstance(net[1], nn.GroupNorm)
    assert (net[1].num_groups, net[1].affine) == (16, False)


def test_state_dict_keys_unchanged():
    module = TinyModule()
    keys = list(module.state_dict())
    make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=1).fit(module)
    assert list(module.state_dict()) == keys


def test_torchvision_resnet_with_inplace_relu_trains():
    torchvision = pytest.importorskip("torchvision")
    from torchvision.models.resnet import BasicBlock, ResNet

    class Res(TinyModule):
        def __init__(self):
            super().__init__(n=8, batch_size=4)
            self.net = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=3)
            self.x = torch.randn(8, 3, 16, 16)

    module = Res()
    assert any(getattr(m, "inplace", False) for m in module.modules())
    before = _params(module)
    make_trainer(DPStrategy(noise_multiplier=0.5, on_batchnorm="replace"), max_steps=2).fit(module)
    assert not torch.equal(before[0], next(module.parameters()))
    del torchvision


def test_prv_accountant_end_to_end(tmp_path):
    """PRV: calibrated below target, priced per step without re-running PRV each step, reported."""
    module = TinyModule(n=256, batch_size=32)
    trainer = make_trainer(DPStrategy(target_epsilon=2.0, accountant="prv", seed=0), tmp_path, max_epochs=2)
    trainer.fit(module)
    strategy = trainer.strategy
    assert strategy.engine.steps == 16
    sigma = strategy.engine.noise.noise_multiplier(0)
    expected = compute_epsilon(
        noise_multiplier=sigma, sample_rate=32 / 256, steps=16, delta=1e-5, accountant="prv"
    )
    assert strategy.epsilon == pytest.approx(expected, rel=1e-6)
    assert strategy.epsilon <= 2.0
    assert json.loads((tmp_path / "privacy_report.json").read_text())["accountant"] == "prv"


def test_resuming_a_spent_budget_stops_cleanly_before_any_step(tmp_path):
    sigma, q = 1.0, 32 / 256
    target = compute_epsilon(noise_multiplier=sigma, sample_rate=q, steps=8, delta=1e-5) + 1e-6
    trainer = make_trainer(
        DPStrategy(noise_multiplier=sigma, target_epsilon=target, seed=0), tmp_path, max_epochs=3
    )
    trainer.fit(TinyModule(n=256, batch_size=32))
    assert trainer.strategy.engine.steps == 8
    ckpt = tmp_path / "spent.ckpt"
    trainer.save_checkpoint(ckpt)
    module = TinyModule(n=256, batch_size=32)
    resumed = make_trainer(
        DPStrategy(noise_multiplier=sigma, target_epsilon=target, seed=0), tmp_path, max_epochs=6
    )
    resumed.fit(module, ckpt_path=ckpt)
    assert resumed.strategy.engine.steps == 8
    assert module.seen_batch_sizes == []


def test_resuming_with_a_new_noise_multiplier_keeps_the_checkpoints_sigma(tmp_path):
    """docs/checkpoints.md: the saved σ replaces the one given on resume (a σ picked after part of the run
    was seen would be chosen adaptively), with a warning; the ledger prices every step at that σ."""
    trainer = make_trainer(DPStrategy(noise_multiplier=1.0, seed=0), tmp_path, max_epochs=1)
    trainer.fit(TinyModule(n=256, batch_size=32))
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed = make_trainer(DPStrategy(noise_multiplier=3.0, seed=0), tmp_path, max_epochs=2)
    with pytest.warns(UserWarning, match="checkpoint used 1.0: the checkpoint's σ is kept"):
        resumed.fit(TinyModule(n=256, batch_size=32), ckpt_path=ckpt)
    assert resumed.strategy.engine.noise.noise_multiplier(8) == 1.0
    assert [(e.noise_multiplier, n) for e, n in resumed.strategy.ledger.history] == [(1.0, 16)]
    expected = compute_epsilon(noise_multiplier=1.0, sample_rate=1 / 8, steps=16, delta=1e-5)
    assert resumed.strategy.epsilon == pytest.approx(expected, rel=1e-9)


def test_on_after_backward_hooks_are_flagged():
    class Peeks(TinyModule):
        def on_after_backward(self):
            pass

    with pytest.warns(UserWarning, match="NON-private gradient"):
        make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=1).fit(Peeks())


@pytest.mark.parametrize("chunk", [1, 10, 64])
def test_virtual_batching_equals_the_unsplit_logical_batch(chunk):
    """σ=0, finite C: chunking one logical batch changes nothing but memory; one ledger event a step."""
    reference = TinyModule(n=64, batch_size=64)
    split = copy.deepcopy(reference)
    make_trainer(DPStrategy(noise_multiplier=0.0, max_grad_norm=0.1, seed=0), max_epochs=3).fit(reference)
    strategy = DPStrategy(
        noise_multiplier=0.0,
        max_grad_norm=0.1,
        seed=0,
        max_physical_batch_size=chunk,
        check_sensitivity=False,
    )  # counts every training_step call: the sensitivity check's passes would add to it
    make_trainer(strategy, max_epochs=3).fit(split)
    assert max(split.seen_batch_sizes) == min(chunk, 64)
    assert sum(split.seen_batch_sizes) == 3 * 64
    for a, b in zip(_params(reference), _params(split), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert strategy.engine.steps == 3
    assert strategy.ledger.history[0][1] == 3


def test_virtual_batching_keeps_epsilon_and_the_clipping_bound():
    clipping = RecordingClipping()
    module = TinyModule(n=256, batch_size=64)
    module.x = module.x * 100
    strategy = DPStrategy(
        noise_multiplier=1.0, max_grad_norm=0.05, clipping=clipping, max_physical_batch_size=16
    )
    make_trainer(strategy, max_epochs=2).fit(module)
    assert max(module.seen_batch_sizes) <= 16
    assert 0 < clipping.max_contribution <= 0.05
    assert strategy.epsilon == pytest.approx(
        compute_epsilon(noise_multiplier=1.0, sample_rate=0.25, steps=8, delta=1e-5)
    )


def test_only_epsilon_is_logged_between_the_loggers_writes(tmp_path, monkeypatch):
    """Lightning's log costs about 1 ms a call and loggers receive on-step values only every
    log_every_n_steps: ε is logged every step (progress bar), the other dp/* metrics on the loggers'
    steps (and the first), where the CSV then has every one of them."""
    from lightning.pytorch import LightningModule
    from lightning.pytorch.loggers import CSVLogger

    calls: list[tuple[int, str]] = []
    original = LightningModule.log

    def spy(self, name, *args, **kwargs):
        if name.startswith("dp/"):
            calls.append((self.trainer.global_step, name))
        return original(self, name, *args, **kwargs)

    monkeypatch.setattr(LightningModule, "log", spy)
    module = TinyModule(n=256, batch_size=16)  # 16 steps in one epoch
    trainer = make_trainer(
        DPStrategy(noise_multiplier=1.0, seed=0), tmp_path, logger=CSVLogger(tmp_path), log_every_n_steps=5
    )
    trainer.fit(module)
    steps = sorted({s for s, _ in calls})
    assert steps == list(range(1, 17)), "ε is logged at every step"
    full = sorted({s for s, n in calls if n == "dp/delta"})
    assert full == [1, 5, 10, 15]
    rows = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    for row in rows[1:]:
        values = dict(zip(header, row.split(","), strict=True))
        if values.get("dp/epsilon"):
            assert all(values[k] for k in ("dp/delta", "dp/noise_multiplier", "dp/sample_rate", "dp/steps"))
