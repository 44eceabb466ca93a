"""Correlated noise through the Trainer and the CLI: pricing, participation, resume, refusals, neighbour, audit.

The digits of the accounting and the statistics of the recursions are in ``tests/noise/test_correlated.py``.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import warnings
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import DATA_ROOT, MNIST_FILES, IndexedModule, TinyModule, make_trainer, requires_data
from neighbour import MOVE_RTOL, released_sum, tiny_data
from torch.utils.data import Subset

from lightning_dp import (
    BLT,
    DPIS,
    AdaCliP,
    AdaptiveGD,
    BandMF,
    CyclicPoisson,
    DPConfigurationError,
    DPStrategy,
    FixedSize,
    HeavyBall,
    LineSearch,
    Poisson,
    audit,
)
from lightning_dp.accounting import PoissonGaussian, compute_epsilon
from lightning_dp.noise.correlated import CorrelatedNoise

ROOT = Path(__file__).resolve().parents[2]
DELTA = 1e-5


def bandmf(bands=4, seed=0, target_epsilon=2.0, **noise) -> DPStrategy:
    """CyclicPoisson(bands) + BandMF(**noise); σ calibrated to ``target_epsilon`` unless given."""
    return DPStrategy(
        target_epsilon=None if "noise_multiplier" in noise else target_epsilon,
        sampler=CyclicPoisson(bands, seed=seed),
        noise=BandMF(**noise),
        seed=seed,
    )


def params(module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


# -- pricing and participation --------------------------------------------------------------------------------
def test_b1_bandmf_is_dp_sgd_bit_for_bit():
    """CyclicPoisson(1) + BandMF(coefficients=[1.0]) is DP-SGD: same σ, ledger, ε and weights for one seed."""
    start = TinyModule(n=256, batch_size=16)
    ours, theirs = copy.deepcopy(start), copy.deepcopy(start)
    mf = DPStrategy(
        target_epsilon=2.0, sampler=CyclicPoisson(1, seed=3), noise=BandMF(coefficients=[1.0]), seed=3
    )
    sgd = DPStrategy(target_epsilon=2.0, sampler=Poisson(seed=3), seed=3)
    make_trainer(mf, max_epochs=2).fit(ours)
    make_trainer(sgd, max_epochs=2).fit(theirs)
    assert mf.ledger.history == sgd.ledger.history
    assert mf.epsilon == sgd.epsilon
    assert ours.seen_batch_sizes == theirs.seen_batch_sizes
    for a, b in zip(params(ours), params(theirs), strict=True):
        assert torch.equal(a, b)


def test_bandmf_records_one_round_per_b_steps():
    module = IndexedModule(n=256, batch_size=16)
    strategy = bandmf(bands=4, target_epsilon=2.0)
    trainer = make_trainer(strategy, max_epochs=3)
    trainer.fit(module)
    steps, sampler, noise = strategy.engine.steps, strategy.engine.sampler, strategy.engine.noise
    assert steps == 48
    assert strategy.ledger.steps == 12  # ⌈48/4⌉ rounds, not 48 steps
    assert sampler.sample_rate == 16 * 4 / 256
    assert sampler.expected_batch_size == 16
    assert strategy.ledger.history == [(PoissonGaussian(noise.sigma, 0.25), 12)]
    assert strategy.epsilon == compute_epsilon(
        noise_multiplier=noise.sigma, sample_rate=0.25, steps=12, delta=DELTA
    )
    assert strategy.epsilon <= 2.0
    assert trainer.callback_metrics["dp/epsilon"] == pytest.approx(strategy.epsilon)
    assert noise.steps_taken == steps
    # every example joins only steps of its own group t ≡ g (mod 4): never two steps less than 4 apart
    groups = sampler.groups()
    seen: dict[int, list[int]] = {}
    for step, indices in enumerate(module.steps[-steps:]):
        for i in indices:
            assert int(groups[i]) == step % 4
            seen.setdefault(i, []).append(step)
    assert all(b - a >= 4 for joined in seen.values() for a, b in itertools.pairwise(joined))
    assert len(seen) > 200


def test_report_has_the_correlated_noise_fields(tmp_path):
    strategy = bandmf(bands=4, target_epsilon=2.0)
    trainer = make_trainer(strategy, tmp_path, max_epochs=2)
    trainer.fit(TinyModule(n=256, batch_size=16))
    report = json.loads((tmp_path / "privacy_report.json").read_text())
    assert report["noise"] == "BandMF"
    assert report["sampler"] == "CyclicPoisson"
    assert report["steps"] == 32
    assert report["ledger_events"] == 8
    assert report["sample_rate"] == 0.25
    assert report["expected_batch_size"] == 16
    correlated = report["correlated_noise"]
    assert correlated["strategy"] == "banded_toeplitz"
    assert correlated["bands"] == 4
    assert len(correlated["coefficients"]) == 4
    assert correlated["column_norm"] == pytest.approx(1.0)
    assert correlated["noise_multiplier_convention"] == "relative to unit max column norm"
    assert correlated["rounds"] == 8
    assert correlated["accounting"].startswith("Choquette-Choo et al. 2023 Thm 4")
    assert correlated["realized_noise_std_factor"]["first_step"] > 1.0
    assert 0 < correlated["predicted_rmse_vs_dpsgd"] < 1.0
    assert correlated["resets"] == []
    assert (tmp_path / "privacy_curve.png").stat().st_size > 0


def test_fit_start_line_names_b_rounds_and_predicted_error(caplog):
    import logging

    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    logging.getLogger("lightning.pytorch").setLevel(logging.INFO)
    try:
        make_trainer(bandmf(bands="auto", target_epsilon=3.0), max_epochs=2).fit(
            TinyModule(n=256, batch_size=16)
        )
    finally:
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    lines = [r.getMessage() for r in caplog.records if "BandMF b=" in r.getMessage()]
    assert lines, caplog.text
    assert "rounds of" in lines[0]
    assert "predicted RMSE" in lines[0]
    assert "bands='auto' from b=1: 1.000" in lines[0]


def test_empty_batches_advance_the_recursion():
    """q_b·|group| ≈ 1: many empty batches; each is a noise-only step that advances z (spec 4.2 #9)."""
    module = TinyModule(n=64, batch_size=1)
    strategy = bandmf(bands=4, target_epsilon=5.0)
    make_trainer(strategy, max_epochs=2).fit(module)
    assert strategy.engine.steps == 128
    assert len(module.seen_batch_sizes) < 128  # the empty ones never reached training_step
    assert strategy.engine.noise.steps_taken == 128
    assert strategy.ledger.steps == 32


def test_virtual_batching_is_unaffected():
    """One z_t per logical step: physical chunks give the same weights and ledger as the whole batch."""
    start = TinyModule(n=256, batch_size=32)
    whole, chunked = copy.deepcopy(start), copy.deepcopy(start)
    a, b = (
        bandmf(bands=4),
        DPStrategy(
            target_epsilon=2.0,
            sampler=CyclicPoisson(4, seed=0),
            noise=BandMF(),
            seed=0,
            max_physical_batch_size=5,
        ),
    )
    make_trainer(a, max_epochs=2).fit(whole)
    make_trainer(b, max_epochs=2).fit(chunked)
    assert a.ledger.history == b.ledger.history
    for p, q in zip(params(whole), params(chunked), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_blt_trains_with_per_step_gaussians():
    strategy = DPStrategy(target_epsilon=3.0, sampler=CyclicPoisson("auto", seed=0), noise=BLT(), seed=0)
    with pytest.warns(UserWarning, match="BLT is predicted to add"):
        make_trainer(strategy, max_epochs=2).fit(TinyModule(n=256, batch_size=16))
    noise = strategy.engine.noise
    assert strategy.engine.sampler.bands == 16  # "auto" for BLT: the widest separation ⌊N/B⌋
    assert strategy.ledger.steps == strategy.engine.steps == 32
    assert strategy.epsilon <= 3.0
    assert strategy.epsilon == pytest.approx(3.0, rel=0.02)
    report = noise.report()
    assert report["strategy"] == "blt"
    assert report["mu"] > 0


def test_training_past_the_plan_keeps_charging_rounds():
    """No horizon guard is needed: rounds are charged as they come (spec pitfall P6)."""
    strategy = bandmf(bands=4, noise_multiplier=1.5, coefficients=[1.0, 0.5, 0.3, 0.2])
    make_trainer(strategy, max_steps=10).fit(TinyModule(n=256, batch_size=16))
    assert strategy.ledger.steps == 3  # steps 0, 4, 8 start rounds
    assert strategy.engine.affordable_steps() is None


def test_budget_stop_counts_rounds():
    """The stop comes at a round boundary: a round's steps are paid at its first step."""
    strategy = bandmf(bands=4, target_epsilon=1.0)
    make_trainer(strategy, max_epochs=1).fit(TinyModule(n=256, batch_size=16))
    engine = strategy.engine
    assert engine.affordable_steps() == 4 * engine.ledger.affordable_count(engine.next_event(), 1.0)
    engine.steps += 1  # mid-round: the rest of the round is already paid
    assert engine.affordable_steps() == 3 + 4 * engine.ledger.affordable_count(engine.next_event(), 1.0)
    engine.steps -= 1


# -- resume ------------------------------------------------------------------------------------------------------
def test_resume_never_stores_buffers_and_resets_them(tmp_path):
    strategy = bandmf(bands=4, noise_multiplier=2.0)
    first = make_trainer(strategy, tmp_path, max_epochs=1)
    first.fit(TinyModule(n=256, batch_size=16))
    ckpt = tmp_path / "mf.ckpt"
    first.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)["lightning_dp"]["slots"]["noise"]
    assert saved["name"] == "BandMF"
    assert set(saved["state"]) == {"sigma", "steps_taken", "resets", "coefficients", "horizon"}
    assert not any(isinstance(v, torch.Tensor) for v in saved["state"].values())  # past noise never saved

    resumed = bandmf(bands=4, target_epsilon=50.0)  # σ and coefficients: the checkpoint's
    with pytest.warns(UserWarning, match="restarts the correlated noise from zero"):
        make_trainer(resumed, tmp_path, max_epochs=3).fit(TinyModule(n=256, batch_size=16), ckpt_path=ckpt)
    assert resumed.engine.steps == 48
    assert resumed.ledger.steps == 12
    assert resumed.engine.noise.coefficients.tolist() == saved["state"]["coefficients"]
    assert resumed.engine.noise.sigma == saved["state"]["sigma"]
    assert resumed.engine.noise.report()["resets"] == [16]

    with pytest.raises(DPConfigurationError, match="other BandMF coefficients"):
        make_trainer(
            bandmf(bands=4, target_epsilon=2.0, coefficients=[1, 0.5, 0.2, 0.1]), tmp_path, max_epochs=3
        ).fit(TinyModule(n=256, batch_size=16), ckpt_path=ckpt)
    with pytest.raises(DPConfigurationError, match="bands=4"):
        make_trainer(bandmf(bands=8, target_epsilon=2.0), tmp_path, max_epochs=3).fit(
            TinyModule(n=256, batch_size=16), ckpt_path=ckpt
        )
    with pytest.raises(DPConfigurationError, match="one σ"):
        make_trainer(bandmf(bands=4, noise_multiplier=9.0), tmp_path, max_epochs=3).fit(
            TinyModule(n=256, batch_size=16), ckpt_path=ckpt
        )


def test_resume_mid_round_keeps_the_groups_and_the_rounds(tmp_path):
    """A checkpoint at step 10 (mid-round): the resumed run continues the phase t mod b and the rounds."""
    module = IndexedModule(n=256, batch_size=16)
    strategy = bandmf(bands=4, noise_multiplier=2.0)
    first = make_trainer(strategy, tmp_path, max_steps=10, max_epochs=5)
    first.fit(module)
    ckpt = tmp_path / "mid.ckpt"
    first.save_checkpoint(ckpt)
    resumed_module = IndexedModule(n=256, batch_size=16)
    resumed = bandmf(bands=4, noise_multiplier=2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(resumed, tmp_path, max_steps=30, max_epochs=5).fit(resumed_module, ckpt_path=ckpt)
    assert resumed.engine.steps == 30
    assert resumed.ledger.steps == 8  # rounds start at 0, 4, …, 28
    groups = resumed.engine.sampler.groups()
    assert torch.equal(groups, strategy.engine.sampler.groups())  # the partition seed was checkpointed
    steps = module.steps[-10:] + resumed_module.steps[-20:]
    for step, indices in enumerate(steps):
        assert all(int(groups[i]) == step % 4 for i in indices)


# -- refusals ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: DPStrategy(sampler=Poisson(), noise=BandMF(coefficients=[1.0, 0.5])), "bands=1"),
        (lambda: DPStrategy(sampler=DPIS(), noise=BandMF()), "cyclic Poisson"),
        (lambda: DPStrategy(sampler=FixedSize(), noise=BandMF()), "different mechanisms"),
        (lambda: DPStrategy(sampler=CyclicPoisson(4), noise=BandMF(), clipping=AdaCliP()), "i.i.d. noise"),
        (
            lambda: DPStrategy(sampler=CyclicPoisson(4), noise=BandMF(), step=AdaptiveGD()),
            "own noise or ledger",
        ),
        (
            lambda: DPStrategy(sampler=CyclicPoisson(4), noise=BandMF(), step=LineSearch()),
            "own noise or ledger",
        ),
        (
            lambda: DPStrategy(sampler=CyclicPoisson(4), noise=BandMF(coefficients=[1.0, 0.5])),
            "2 coefficients",
        ),
        (
            lambda: DPStrategy(sampler=CyclicPoisson("auto"), noise=BandMF(coefficients=[1.0, 0.5])),
            "is fixed",
        ),
        (lambda: DPStrategy(sampler=Poisson(), noise=BLT()), "bands=1"),
        (
            lambda: DPStrategy(sampler=CyclicPoisson(4), noise=BandMF(), accountant="pure"),
            "different mechanisms",
        ),
        (lambda: DPStrategy(sampler=CyclicPoisson(4)), "is for correlated noise"),
        (lambda: DPStrategy(sampler=CyclicPoisson("auto"), noise_multiplier=1.0), "is for correlated noise"),
    ],
)
def test_refused_combinations(build, match):
    with pytest.raises(DPConfigurationError, match=match):
        build()


def test_momentum_steps_are_allowed_with_a_warning():
    with pytest.warns(UserWarning, match="optimised for the prefix sums of plain SGD"):
        DPStrategy(sampler=CyclicPoisson(4), noise=BandMF(), step=HeavyBall(beta=0.9))


def test_sample_rate_above_one_is_refused():
    strategy = DPStrategy(target_epsilon=2.0, sampler=CyclicPoisson(32), noise=BandMF())
    with pytest.raises(DPConfigurationError, match=r"bands ≤ N/B = 16"):
        make_trainer(strategy, max_epochs=1).fit(TinyModule(n=256, batch_size=16))


def test_auto_bands_need_a_target_epsilon():
    strategy = DPStrategy(sampler=CyclicPoisson("auto"), noise=BandMF(noise_multiplier=1.0))
    with pytest.raises(DPConfigurationError, match="bands='auto'"):
        make_trainer(strategy, max_epochs=1).fit(TinyModule(n=256, batch_size=16))


def test_gradient_canaries_are_refused_and_input_canaries_audit_a_bandmf_run(tmp_path):
    from recipes import DigitsDataModule, ImageClassifier

    def trainer(strategy, steps):
        return make_trainer(strategy, tmp_path, max_steps=steps, max_epochs=-1, limit_val_batches=0)

    strategy = DPStrategy(target_epsilon=2.0, sampler=CyclicPoisson(4, seed=0), noise=BandMF(), seed=0)
    model = ImageClassifier(arch="logreg", in_features=64, lr=2.0)
    with pytest.raises(DPConfigurationError, match="canary='input'"):
        audit(trainer(strategy, 100), model, DigitsDataModule(batch_size=64, flatten=True), seed=1)

    def run(broken: bool, steps: int, lr: float):
        torch.manual_seed(0)
        strategy = DPStrategy(target_epsilon=1.0, sampler=CyclicPoisson(4, seed=0), noise=BandMF(), seed=0)
        model = ImageClassifier(arch="logreg", in_features=64, lr=lr)
        silent = mock.patch.object(CorrelatedNoise, "add_noise", lambda self, sums, std, generator: sums)
        with warnings.catch_warnings(), silent if broken else nullcontext():
            warnings.simplefilter("ignore")
            return audit(
                trainer(strategy, steps), model, DigitsDataModule(batch_size=64, flatten=True), canary="input",
                num_canaries=256, seed=1,
            )  # fmt: skip

    correct = run(broken=False, steps=100, lr=2.0)
    assert correct.claimed_epsilon == pytest.approx(1.0, abs=0.01)
    assert correct.passed
    broken = run(broken=True, steps=300, lr=8.0)
    assert broken.epsilon_lower_bound > broken.claimed_epsilon, broken  # the noise is what the claim rests on


# -- the neighbour test ---------------------------------------------------------------------------------------------
def _first_batch(seed: int, n: int, batch: int) -> list[int]:
    sampler = CyclicPoisson(2, seed=seed)
    sampler.bind(n, batch)
    return sampler.draw(0)


def test_neighbour_bandmf_step_moves_the_sum_by_at_most_c():
    """One real BandMF step (σ = 0, tiny C) on D and on D minus its last example: the sum moves ≤ C.

    q_b = B·b/N cannot be equal for N and N − 1 examples, so the seed is one whose first step takes the same
    examples from both, plus the removed one from D (the harness's ``neighbour_move`` assumes q = 1)."""
    module = TinyModule(n=32, batch_size=32)
    data = tiny_data(module, 32)
    seed = next(s for s in range(200) if _first_batch(s, 32, 16) == [*_first_batch(s, 31, 15), 31])

    def strategy() -> DPStrategy:
        return DPStrategy(
            noise=BandMF(noise_multiplier=0.0, coefficients=[0.8, 0.6]), max_grad_norm=1e-3,
            sampler=CyclicPoisson(2, seed=seed), seed=0,
        )  # fmt: skip

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = released_sum(module, data, strategy, batch_size=16)
        kept = released_sum(module, Subset(data, range(31)), strategy, batch_size=15)
    assert full.sums is not None
    assert kept.sums is not None
    move = math.sqrt(sum(float((a - b).pow(2).sum()) for a, b in zip(full.sums, kept.sums, strict=True)))
    assert 0.5e-3 < move <= 1e-3 * (1 + MOVE_RTOL)  # the removed example was in the step, and moved it ≤ C


# -- the CLI -----------------------------------------------------------------------------------------------------------
def test_cli_trains_a_bandmf_config(tmp_path):
    from lightning_dp.commands.cli import main

    main(
        [
            "fit", "--config", str(ROOT / "configs" / "digits_dpsgd.yaml"),
            "--trainer.max_epochs", "3", "--trainer.enable_progress_bar", "false",
            "--trainer.logger.init_args.save_dir", str(tmp_path),
            "--trainer.strategy.init_args.sampler", "lightning_dp.CyclicPoisson",
            "--trainer.strategy.init_args.sampler.bands", "2",
            "--trainer.strategy.init_args.noise", "lightning_dp.BandMF",
        ]
    )  # fmt: skip
    report = json.loads(next(tmp_path.rglob("privacy_report.json")).read_text())
    assert report["noise"] == "BandMF"
    assert report["correlated_noise"]["bands"] == 2
    assert report["ledger_events"] == math.ceil(report["steps"] / 2)
    assert report["epsilon"] <= 3.0
    metrics = next(tmp_path.rglob("metrics.csv")).read_text()
    assert "dp/epsilon" in metrics


@pytest.mark.slow
@requires_data(*MNIST_FILES)
def test_mnist_bandmf_config_runs_a_few_private_steps(tmp_path, monkeypatch):
    from lightning_dp.commands.cli import main

    monkeypatch.setenv("LIGHTNING_DP_CACHE", str(tmp_path / "cache"))
    main(
        [
            "fit", "--config", str(ROOT / "configs" / "mnist_bandmf.yaml"), "--data.root", str(DATA_ROOT),
            "--data.download", "false", "--trainer.accelerator", "cpu", "--trainer.max_steps", "20",
            "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "false",
            "--trainer.logger.init_args.save_dir", str(tmp_path), "--test_after_fit", "false",
        ]
    )  # fmt: skip
    report = json.loads(next(tmp_path.rglob("privacy_report.json")).read_text())
    assert report["steps"] == 20
    correlated = report["correlated_noise"]
    bands = correlated["bands"]  # chosen for the 20 planned steps
    assert bands == min(correlated["bands_search"], key=lambda c: c["ratio"])["bands"]
    assert report["ledger_events"] == math.ceil(20 / bands)
    assert report["epsilon"] <= 3.0


# -- DDP ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    from _worker import run_worker

    out = tmp_path_factory.mktemp("ddp_correlated")
    run_worker("ddp_correlated_worker.py", out)
    return lambda name: [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_ddp_bandmf_prices_like_one_process_and_keeps_the_groups(ddp_results):
    ranks = ddp_results("bandmf")
    single = bandmf(bands=4, seed=1, target_epsilon=2.0)
    make_trainer(single, max_epochs=3).fit(TinyModule(n=256, batch_size=16))
    assert ranks[0]["epsilon"] == ranks[1]["epsilon"] == single.epsilon
    assert ranks[0]["history"] == [[e.to_dict(), c] for e, c in single.ledger.history]
    assert ranks[0]["steps"] == 48
    assert ranks[0]["groups"] == ranks[1]["groups"]  # one partition (the same seed on every rank)
    groups, joined = ranks[0]["groups"], {}
    for rank in ranks:
        for step, indices in enumerate(rank["indices"][-48:]):
            for i in indices:
                assert i % 2 == rank["rank"]  # each rank samples its own share
                assert groups[i] == step % 4  # only the step's group
                joined.setdefault(i, []).append(step)
    assert all(b - a >= 4 for steps in joined.values() for a, b in itertools.pairwise(steps))


@pytest.mark.slow
def test_ddp_correlated_shares_sum_to_the_single_process_covariance(ddp_results):
    """Each rank runs its own recursion on σC/√2: the released sum has σ²C²·C⁻¹C⁻ᵀ/B² (spec §1.5)."""
    import numpy as np

    from lightning_dp.accounting import matrix_factorization as mf

    ranks = ddp_results("noise")
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # every rank applies the same private gradient
    cov = np.array(ranks[0]["covariance"])
    coef = np.array([1.0, 0.5, 0.375, 0.3125]) / math.sqrt(1.48828125)
    inverse = np.linalg.inv(
        np.array([[coef[i - j] if 0 <= i - j < 4 else 0.0 for j in range(8)] for i in range(8)])
    )
    want = (2.0 * 3.0 / 40.0) ** 2 * inverse @ inverse.T
    n = ranks[0]["numel"]
    se = np.sqrt((np.outer(np.diag(want), np.diag(want)) + want**2) / n)
    assert (np.abs(cov - want) <= 4 * se).all(), (cov - want) / se
    assert mf.noise_std_factors(coef, 8)[-1] > 1.1  # correlated: larger per step than i.i.d. noise


def test_poisson_with_bandmf_is_dp_sgd():
    """Poisson() is cyclic Poisson with b = 1: BandMF() then is DP-SGD, also with σ given (no horizon)."""
    strategy = DPStrategy(sampler=Poisson(seed=0), noise=BandMF(noise_multiplier=1.0), seed=0)
    make_trainer(strategy, max_epochs=1).fit(TinyModule(n=256, batch_size=16))
    assert strategy.ledger.history == [(PoissonGaussian(1.0, 1 / 16), 16)]
    assert strategy.engine.noise.report()["coefficients"] == [1.0]


def test_auto_bands_respect_the_memory_budget():
    """TinyModule has 227 parameters (908 bytes a buffer): 2000 bytes allow b − 1 ≤ 2, so b ≤ 2 (not the free 4)."""
    free = bandmf(bands="auto", target_epsilon=3.0)
    make_trainer(free, max_epochs=3).fit(TinyModule(n=256, batch_size=16))
    capped = DPStrategy(
        target_epsilon=3.0, sampler=CyclicPoisson("auto", seed=0), noise=BandMF(max_buffer_bytes=2000), seed=0
    )
    make_trainer(capped, max_epochs=3).fit(TinyModule(n=256, batch_size=16))
    assert free.engine.sampler.bands == 4
    assert capped.engine.sampler.bands == 2
    report = capped.engine.noise.report()
    assert [c["bands"] for c in report["bands_search"]] == [1, 2]
    assert report["buffer_bytes"] == 4 * 227 <= 2000
