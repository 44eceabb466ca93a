"""DPIS (specs/dpis.md §6): the per-step accountant, the a_E scheduler, the two-round sampler, the
Lightning wiring, resume. Numbers in the tables come from the spec's own reference implementation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import TinyModule, make_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dp import DPIS, AdaCliP, DPConfigurationError, DPStrategy, FlatClipping
from lightning_dp.accounting import Gaussian, PoissonGaussian, PrivacyLedger, calibrate_noise
from lightning_dp.accounting.rdp import epsilon_from_rdp
from lightning_dp.noise import ConstantNoise
from lightning_dp.per_example import PerExampleGradients
from lightning_dp.sampling.dpis import (
    acceptance_probabilities,
    dpis_step_event,
    first_round_probabilities,
    schedule_sigma,
)
from lightning_dp.slots import SamplerRuntime, StepContext
from lightning_dp.slots.release import Releases

# -- U1-U5: Eq. (13) is a sampled Gaussian with q = b/(N~ r), noise multiplier σ_G/r -------------------
U1 = {  # K~ -> RDP at alpha = 2, 8, 32, 2.5 (b = 256, N~ = 60000, C = 0.1, σ_G = 0.81)
    6000: (6.537504088582e-05, 4.767566808138e-02, 1.875357429268e01, 8.303340616458e-05),
    3000: (3.377270744389e-05, 1.388988519232e-04, 1.180080545200e00, 4.231129405241e-05),
    1500: (2.911056828274e-05, 1.176677577748e-04, 4.917967522891e-04, None),
}


@pytest.mark.parametrize("k_tilde", sorted(U1))
def test_step_rdp_matches_eq13_table(k_tilde):
    r = k_tilde / (60000 * 0.1)
    got = dpis_step_event(0.81, r, 256, 60000.0).rdp((2.0, 8.0, 32.0, 2.5))
    for value, expected in zip(got, U1[k_tilde], strict=True):
        if expected is not None:
            assert value == pytest.approx(expected, rel=1e-6)
    # U2: closed form at alpha = 2
    q, s = 256 * 0.1 / k_tilde, 0.81 * 60000 * 0.1 / k_tilde
    assert got[0] == pytest.approx(math.log(1 + q * q * (math.exp(1 / s**2) - 1)), rel=1e-9)


def test_r_one_is_dp_sgd_and_rdp_grows_with_r():
    assert dpis_step_event(0.81, 1.0, 256, 60000.0) == PoissonGaussian(0.81, 256 / 60000)  # U3
    assert dpis_step_event(0.81, 1.0, 256, 60000.0).rdp((8.0,))[0] == pytest.approx(
        0.047675668081377, rel=1e-9
    )
    orders = (2.0, 3.0, 5.0, 8.0, 16.0, 32.0)
    for sigma in (0.4, 0.8, 1.5, 4.0):  # U4 (coarser grid)
        values = [dpis_step_event(sigma, r, 256, 60000.0).rdp(orders) for r in np.linspace(0.05, 1, 12)]
        assert np.all(np.diff(np.array(values), axis=0) >= -1e-15)
    assert Gaussian(1200.0).rdp((8.0,))[0] == pytest.approx(2.7778e-06, rel=1e-4)  # U5


# -- U7: the a_E scheduler's 5-epoch test vector -------------------------------------------------------
U7 = {
    0.0: (0.6830, 0.6304, 0.5867, 0.5673, 0.5495),
    0.6: (0.9164, 0.9043, 0.8904, 0.4583, 0.4339),
    1.0: (0.9164, 0.9043, 0.8904, 0.8723, 0.3742),
}


@pytest.mark.parametrize("a_e", sorted(U7))
def test_scheduler_test_vector(a_e):
    orders = tuple(float(a) for a in range(2, 65))
    n_tilde, b, steps, epochs = 10000.0, 100, 100, 5
    spent, sigmas = np.zeros(len(orders)), []
    for e, r in enumerate([0.6, 0.5, 0.4, 0.35, 0.3], start=1):
        phase_one = e <= math.floor(a_e * epochs + 1e-9)
        sigma = schedule_sigma(
            base_rdp=spent,
            r_now=r,
            steps_now=steps,
            r_future=1.0 if phase_one else r,
            steps_future=(epochs - e) * steps,
            batch_size=b,
            n_tilde=n_tilde,
            target_epsilon=2.0,
            delta=1e-5,
            orders=orders,
        )
        sigmas.append(sigma)
        spent = spent + steps * dpis_step_event(sigma, r, b, n_tilde).rdp(orders)
    assert sigmas == pytest.approx(U7[a_e], abs=1e-3)
    assert epsilon_from_rdp(spent, orders, 1e-5)[0] <= 2.0
    assert max(sigmas) <= 0.927 + 1e-3  # never more noise than DP-SGD's constant σ


def test_scheduler_at_r_one_is_dp_sgd_calibration():
    """Equal (saturated) norms give r = 1: the schedule is DP-SGD's calibrated σ at q = b/N~."""
    ledger = PrivacyLedger(delta=1e-5)
    sigma = schedule_sigma(
        base_rdp=np.zeros(len(ledger.orders)),
        r_now=1.0,
        steps_now=50,
        r_future=1.0,
        steps_future=150,
        batch_size=50,
        n_tilde=5000.0,
        target_epsilon=1.0,
        delta=1e-5,
        orders=ledger.orders,
    )
    assert sigma == pytest.approx(
        calibrate_noise(target_epsilon=1.0, delta=1e-5, sample_rate=50 / 5000, steps=200, tol=1e-5), abs=2e-3
    )


# -- U9: first- and second-round probabilities ----------------------------------------------------------
def test_sampler_probabilities_table():
    c = torch.tensor([1, 1, 0.5, 0.5, 0.25, 0.25, 0.1, 0.1, 0.01, 0], dtype=torch.float64).repeat(10)
    k, b, g_l, k_tilde = 3, 2, 0.05, 37.1
    ghat = k * c.clamp(min=g_l)
    q = first_round_probabilities(ghat, b, k_tilde)
    _, p = acceptance_probabilities(c, ghat, 1.0)
    assert float(q.sum()) == pytest.approx(6.145552560647, abs=1e-9)
    assert float((q * p).sum()) == pytest.approx(2.0, abs=1e-12)
    assert float(q.max()) == pytest.approx(0.1617, abs=1e-4)
    assert float((q * p)[0]) == pytest.approx(0.05390836, abs=1e-8)
    assert float((q * p)[9]) == 0.0


# -- a harness: DPIS without Lightning, fixed per-example gradient vectors ------------------------------
def _harness(grads, *, b, k, sigma=1.0, sigma_n=None, sigma_k=None, seed=0, target=None, steps=10):
    ledger = PrivacyLedger(delta=1e-5)
    norms = grads.norm(dim=1).double()
    sampler = DPIS(k=k, seed=seed, sigma_N=sigma_n, sigma_K=sigma_k)
    sampler.bind(len(grads), b)
    runtime = SamplerRuntime(
        norms=lambda idx: norms[idx],
        ledger=ledger,
        target_epsilon=target,
        delta=1e-5,
        planned_steps=steps,
        steps_per_epoch=steps,
        max_grad_norm=1.0,
        fixed_noise_multiplier=None if target else sigma,
        clipping=FlatClipping(),
    )
    sampler.attach_runtime(runtime)
    sampler.use_releases(
        Releases(
            ledger,
            target_epsilon=target,
            noise=ConstantNoise(sigma),
            clipping=FlatClipping(),
            gradient_name="DPIS",
        )
    )
    return sampler, ledger


def _ctx(n):
    return StepContext(0, n, 0.0, 1.0, 1.0, torch.Generator())


def _run_steps(sampler, grads, num_batches):
    """Yield (candidate indices, weights) of each step of one epoch."""
    for batch in sampler.batch_sampler(num_batches):
        sampler.begin_step(batch.info)
        idx = torch.tensor(list(batch), dtype=torch.long)
        param = torch.nn.Parameter(torch.zeros(grads.shape[1:]))
        samples = PerExampleGradients([param], len(idx), {param: grads[idx]}, [])
        weights, sensitivity = sampler.weigh(samples, _ctx(len(idx)))
        yield idx, weights, sensitivity


def test_inclusion_frequencies_and_unbiased_mean():
    """U10/U11 (smaller): P(i accepted) = b c_i/K~, E|X_q| ≈ k b, E|X_p| ≈ b, contributions of norm K~/N~."""
    gen = torch.Generator().manual_seed(1)
    n, b, k, draws = 300, 12, 3, 3000
    grads = torch.randn(n, 3, generator=gen) * torch.rand(n, 1, generator=gen) * 2
    sampler, _ = _harness(grads, b=b, k=k)
    hits, candidates, accepted, mean = torch.zeros(n), 0, 0, torch.zeros(3, dtype=torch.float64)
    for idx, weights, sensitivity in _run_steps(sampler, grads, draws):
        acc = weights > 0
        hits[idx[acc]] += 1
        candidates, accepted = candidates + len(idx), accepted + int(acc.sum())
        contrib = weights[acc, None] * grads[idx[acc]]
        if acc.any():
            norms = contrib.norm(dim=1)
            assert torch.all(norms <= sensitivity)
            assert torch.all(norms >= sensitivity * (1 - 2e-5))
        mean += contrib.double().sum(0) / b
    epoch = sampler.current
    c = grads.norm(dim=1).double().clamp(max=1.0)
    expected = b * c / epoch.k_tilde
    se = (expected * (1 - expected) / draws).sqrt() + 1e-12
    assert float(((hits / draws - expected).abs() / se).max()) < 4.5
    assert candidates / draws == pytest.approx(
        k * b * float(c.clamp(min=0.01).sum()) / epoch.k_tilde, rel=0.03
    )
    assert accepted / draws == pytest.approx(float(expected.sum()), rel=0.04)
    clipped_mean = (grads.double() * (c / grads.norm(dim=1).double())[:, None]).sum(0) / epoch.n_tilde
    assert torch.allclose(
        mean / draws, clipped_mean, atol=4 * float(clipped_mean.norm()) / math.sqrt(draws) + 0.01
    )


def test_saturated_norms_reduce_to_dp_sgd():
    """U12: every n_i ≥ C and K~ = N~ C: q = k b/N~, p = 1/k, weights give exactly the clipped sum,
    and the ledger entry is DP-SGD's PoissonGaussian(σ, b/N~)."""
    gen = torch.Generator().manual_seed(2)
    grads = torch.randn(200, 4, generator=gen) * 5 + 0.5  # norms well above C = 1
    grads = grads / grads.norm(dim=1, keepdim=True) * (1.5 + torch.rand(200, 1, generator=gen))
    sampler, ledger = _harness(grads, b=10, k=3, sigma=0.9, sigma_n=1e-9, sigma_k=1e-9)
    sizes = []
    for idx, weights, _ in _run_steps(sampler, grads, 400):
        acc = weights > 0
        clipped = grads[idx[acc]] / grads[idx[acc]].norm(dim=1, keepdim=True)
        assert torch.allclose((weights[acc, None] * grads[idx[acc]]), clipped, rtol=2e-5)
        sizes.append((len(idx), int(acc.sum())))
    epoch = sampler.current
    assert epoch.r == pytest.approx(1.0, abs=1e-9)
    q = first_round_probabilities(sampler.ghat, 10, epoch.k_tilde)
    assert torch.allclose(q, torch.full_like(q, 3 * 10 / epoch.n_tilde))
    mean_candidates, mean_accepted = np.mean(sizes, axis=0)
    assert mean_candidates == pytest.approx(30, rel=0.05)
    assert mean_accepted == pytest.approx(10, rel=0.06)
    event = sampler.event(sampler.step_noise_multiplier())
    assert event.noise_multiplier == pytest.approx(0.9, rel=1e-9)
    assert event.sample_rate == pytest.approx(10 / epoch.n_tilde, rel=1e-9)
    assert ledger.history[0][0] == Gaussian(1e-9)  # N~ released once, K~ once per epoch


def test_lower_clamp_prevents_saturation():
    """U13: whatever the norms and the K~ noise, max q ≤ 1 (K~ is clamped at k b C + ξ)."""
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        grads = torch.randn(100, 2, generator=gen) * torch.rand(100, 1, generator=gen).pow(4) * 3
        sampler, _ = _harness(grads, b=6, k=4, sigma_k=float(torch.rand(1, generator=gen)) * 200, seed=seed)
        next(iter(sampler.batch_sampler(1)))
        assert float(first_round_probabilities(sampler.ghat, 6, sampler.current.k_tilde).max()) <= 1.0


def test_mid_epoch_state_dict_resumes_without_new_release():
    """U14 at the sampler level: a restored mid-epoch state continues the epoch; no extra K~ release."""
    grads = torch.randn(100, 3, generator=torch.Generator().manual_seed(3))
    sampler, ledger = _harness(grads, b=5, k=3)
    steps = _run_steps(sampler, grads, 8)
    for _ in range(3):
        next(steps)
    state = sampler.state_dict()
    releases = len(ledger)
    fresh, ledger2 = _harness(grads, b=5, k=3, seed=99)
    fresh.load_state_dict(state)
    fresh.bind(100, 5)
    fresh.attach_runtime(sampler.runtime)
    rest = list(_run_steps(fresh, grads, 8))
    assert len(rest) == 5
    assert len(ledger) == releases
    assert len(ledger2) == 0
    assert fresh.current == sampler.current


def test_bad_batch_and_other_clipping_are_refused():
    with pytest.raises(ValueError, match="k·batch_size < N"):
        DPIS(k=5).bind(100, 20)
    with pytest.raises(DPConfigurationError, match="AdaCliP"):
        make_trainer(DPStrategy(sampler=DPIS(), clipping=AdaCliP(h2=1.0), noise_multiplier=1.0)).fit(
            TinyModule()
        )


# -- Lightning ------------------------------------------------------------------------------------------
def _fit(tmp_path, *, epochs=2, ckpt=None, callbacks=(), **kwargs):
    module = TinyModule(n=400, batch_size=10)
    strategy = DPStrategy(sampler=DPIS(k=3, seed=0), seed=0, max_grad_norm=0.5, **kwargs)
    trainer = make_trainer(
        strategy, tmp_path, max_epochs=epochs, callbacks=list(callbacks), enable_checkpointing=bool(callbacks)
    )
    trainer.fit(module, ckpt_path=ckpt)
    return strategy, module


def test_fit_meets_target_and_resume_matches_uninterrupted(tmp_path):
    """The scheduler spends the target and never more; resuming after epoch 1 gives the same ledger."""
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_epochs=1, save_last=False)
    full, _ = _fit(tmp_path, target_epsilon=1.0, callbacks=[ckpt])
    assert 0.99 <= full.epsilon <= 1.0
    assert full.engine.steps == 2 * 40
    epochs = full.engine.sampler.epochs
    assert len(epochs) == 2
    assert all(e.sigma_g > 0 for e in epochs)
    first = sorted((tmp_path / "ck").glob("epoch=0*.ckpt"))[0]
    resumed, _ = _fit(tmp_path, target_epsilon=1.0, ckpt=str(first))
    assert resumed.engine.sampler.epochs == epochs
    assert resumed.engine.ledger.history == full.engine.ledger.history
    assert resumed.epsilon == pytest.approx(full.epsilon, abs=1e-12)


def test_virtual_batching(tmp_path):
    """Chunks of 4 candidates each go through the acceptance round; fixed σ_G prices every step."""
    strategy, module = _fit(tmp_path, epochs=1, noise_multiplier=1.2, max_physical_batch_size=4)
    assert strategy.engine.steps == 40
    assert max(module.seen_batch_sizes) <= 4
    events = [e for e, _ in strategy.engine.ledger.history if isinstance(e, PoissonGaussian)]
    r = strategy.engine.sampler.current.r
    assert events == [PoissonGaussian(1.2 / r, 10 / (strategy.engine.sampler.n_tilde * r))]


def test_empty_candidate_sets_are_noise_only_steps(tmp_path):
    """b = 2, k = 1: many steps draw no candidate; each still releases noise and is priced."""
    module = TinyModule(n=400, batch_size=2)
    strategy = DPStrategy(
        sampler=DPIS(k=1, seed=1), seed=0, noise_multiplier=1.0, max_physical_batch_size=50,
        check_sensitivity=False,  # counts the user's training_step calls: the checks would add their own
    )  # fmt: skip
    make_trainer(strategy, tmp_path).fit(module)
    assert strategy.engine.steps == 200
    steps = sum(c for e, c in strategy.engine.ledger.history if isinstance(e, PoissonGaussian))
    assert steps == 200
    norm_pass_calls = 8  # 400 examples in chunks of 50
    assert norm_pass_calls < len(module.seen_batch_sizes) < 200 + norm_pass_calls - 10


def test_dpis_from_yaml_config(tmp_path):
    """``sampler: class_path: lightning_dp.DPIS`` in a LightningCLI config trains privately."""
    import json
    from pathlib import Path

    from lightning_dp.commands.cli import main

    root = Path(__file__).resolve().parents[2]
    main(
        [
            "fit",
            "--config",
            str(root / "configs" / "digits_dpis.yaml"),
            "--trainer.max_steps",
            "4",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--test_after_fit",
            "false",
        ]
    )
    report = json.loads(next(tmp_path.rglob("privacy_report.json")).read_text())
    assert report["sampler"] == "DPIS"
    assert report["noise_multiplier"] > 0  # the scheduled σ_G/r of the last step, not the unset noise slot
    assert report["steps"] == 4
    assert 0 < report["epsilon"] <= 3.0
