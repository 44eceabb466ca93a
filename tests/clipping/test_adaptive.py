"""Quantile-adaptive clipping (Andrew et al. 2021) and automatic clipping (Bu et al. 2023): the spec's vectors
(shared/specs/adaptive_clipping.md), their price (ε digit for digit DP-SGD's), the noise each release carries,
the norm's trajectory (logged, reported, resumed, over chunks, ranks and users) and what they refuse."""

from __future__ import annotations

import copy
import csv
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import TinyModule, make_trainer
from lightning.pytorch.loggers import CSVLogger
from per_example.test_model_zoo import _batch, _model, reference_grads
from per_example.zoo import ZOO
from user_runs import UserRows, user_strategy_args

from lightning_dp import (
    DPIS,
    AdaptiveGD,
    AutoClipping,
    BandMF,
    CyclicPoisson,
    DPConfigurationError,
    DPStrategy,
    FlatClipping,
    HeavyBall,
    LineSearch,
    QuantileClipping,
    Step,
    StepContext,
)
from lightning_dp.accounting import Gaussian, compute_epsilon
from lightning_dp.clipping import clip_factors
from lightning_dp.clipping.automatic import normalise_factors
from lightning_dp.clipping.quantile import geometric_update, gradient_noise_multiplier
from lightning_dp.per_example import GradientCapture, PerExampleGradients
from lightning_dp.slots.release import ReleaseHook, Releases

# -- the spec's vectors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("z", "m", "z_delta"),
    [(1.0, 256, 1.000763814), (0.8, 256, 0.800390911), (1.1, 64, 1.116616633), (2.0, 1024, 2.000381579)],
)
def test_the_gradient_noise_multiplier_is_the_spec_s(z, m, z_delta):
    clipping = QuantileClipping()
    assert clipping.count_noise(m) == m / 20
    assert gradient_noise_multiplier(z, m / 20) == pytest.approx(z_delta, abs=5e-10)
    assert clipping.gradient_noise_multiplier(z, m) == pytest.approx(z_delta, abs=5e-10)
    # Theorem 1: the gradient at z_Δ and the count (sensitivity ½) at σ_b are one release at z
    assert z_delta**-2 + (2 * m / 20) ** -2 == pytest.approx(z**-2, rel=1e-8)


@pytest.mark.parametrize(
    ("norm", "fraction", "updated"), [(0.1, 0.8, 0.094176453), (1.0, 0.2, 1.061836547), (0.5, 0.5, 0.5)]
)
def test_the_geometric_update_is_the_spec_s(norm, fraction, updated):
    assert geometric_update(norm, fraction, 0.5, 0.2) == pytest.approx(updated, abs=5e-10)


def _ctx(batch: int, norm: float, z: float = 0.0, step: int = 0) -> StepContext:
    return StepContext(
        step=step, batch_size=batch, expected_batch_size=float(batch), max_grad_norm=norm, noise_multiplier=z,
        generator=torch.Generator(),
    )  # fmt: skip


def _grads(norms: list[float]) -> PerExampleGradients:
    """One example per row with exactly the given L2 norms (along one axis)."""
    return PerExampleGradients.from_tensors([torch.tensor(norms).unsqueeze(1) * torch.tensor([[0.6, 0.8]])])


def test_the_count_moves_c_towards_the_target_quantile_and_counts_every_chunk_once():
    clip = QuantileClipping(initial_norm=0.1)
    ctx = _ctx(4, clip.norm)
    sums = clip.clip_and_sum(_grads([0.05, 0.2, 0.3, 0.08]), ctx)  # 2 of 4 unclipped: b̃ = γ, C stays
    torch.testing.assert_close(sums[0], torch.tensor([0.13 + 0.2 / (1 + 1e-5)]) * torch.tensor([0.6, 0.8]))
    clip.finalize(sums, ctx)
    assert clip.norm == pytest.approx(0.1, rel=1e-12)
    # two physical chunks of one step: 3 of 4 unclipped in all
    first, second = clip.clip_and_sum(_grads([0.05]), ctx), clip.clip_and_sum(_grads([0.06, 0.07, 0.5]), ctx)
    clip.finalize([first[0] + second[0]], ctx)
    assert clip.norm == pytest.approx(geometric_update(0.1, 0.75, 0.5, 0.2), rel=1e-12)
    assert clip.last_norm == 0.1
    clip.finalize([torch.zeros(2)], _ctx(4, clip.norm, step=1))  # an empty batch: b̃ = ½ exactly
    assert clip.norm == pytest.approx(geometric_update(0.1, 0.75, 0.5, 0.2), rel=1e-12)


def test_the_count_s_shares_add_up_to_its_noise_once_over_the_ranks():
    """Under DDP each rank adds σ_b/√W to its own share, so the all-reduced count carries σ_b exactly once."""
    draws, std = 4000, 3.0

    def ranks_sum(gens: list[torch.Generator]) -> float:
        values: list[float] = []
        for rank, gen in enumerate(gens):
            releases = Releases.__new__(Releases)
            releases.rank, releases.world_size, releases.anchor = rank, 2, None
            releases.all_reduce_fn = lambda t: t  # each rank's value before the sum
            values.append(releases.noisy_statistic(1.5, std, gen, shares=True))
        return sum(values)

    gens = [torch.Generator().manual_seed(r) for r in (0, 1)]
    totals = torch.tensor([ranks_sum(gens) for _ in range(draws)], dtype=torch.float64)
    assert float(totals.mean()) == pytest.approx(3.0, abs=4 * std / math.sqrt(draws))
    assert float(totals.std()) == pytest.approx(std, rel=0.05)  # √2·σ_b if each rank added all of it


def test_auto_clipping_normalises_every_example_below_c():
    norms = [0.0, 1e-3, 1.0, 1e4, float("inf")]
    grads = _grads(norms)
    for r in (0.0, 0.01):
        clip = AutoClipping(stability=r)
        for i, n in enumerate(norms):
            alone = PerExampleGradients.from_tensors([grads[0][i : i + 1]])
            out = float(clip.clip_and_sum(alone, _ctx(1, 2.0))[0].norm())
            expected = 0.0 if not math.isfinite(n) else 2.0 * n / (n * (1 + 1e-5) + 1e-6 + r)
            assert out == pytest.approx(expected, rel=1e-6)
            assert out < 2.0
    assert clip.sensitivity(_ctx(1, 2.0)) == 2.0


def test_auto_clipping_at_zero_stability_is_dp_sgd_with_every_example_clipped():
    """AUTO-V with C below every norm takes the same step as FlatClipping at that C, bit for bit."""
    reference = TinyModule(n=64, batch_size=16)
    auto = copy.deepcopy(reference)
    for module, clipping in ((reference, FlatClipping()), (auto, AutoClipping(stability=0.0))):
        strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=1e-4, clipping=clipping, seed=3)
        make_trainer(strategy, max_steps=3).fit(module)
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), auto.parameters(), strict=True))


# -- in the strategy: the price and the noise ---------------------------------------------------------------


class _Noise(ReleaseHook):
    """Per release: C, the gradient's σ and the noise actually added (noisy − clipped sums)."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, float, torch.Tensor]] = []
        self._clipped: list[torch.Tensor] = []

    def before_noise(self, sums, ctx):
        self._clipped = [s.clone() for s in sums]
        return sums

    def after_release(self, noisy, ctx):
        noise = torch.cat([(a - b).flatten() for a, b in zip(noisy, self._clipped, strict=True)])
        self.rows.append((ctx.max_grad_norm, ctx.noise_multiplier, noise))
        return noisy


@pytest.fixture(scope="module")
def quantile_run(tmp_path_factory):
    """ε = 3 with QuantileClipping's defaults (and DP-SGD's run beside it), logged to CSV, report written."""
    root = tmp_path_factory.mktemp("quantile")
    runs = {}
    for name, clipping in (("quantile", QuantileClipping(seed=0)), ("dpsgd", None), ("auto", AutoClipping())):
        strategy = DPStrategy(target_epsilon=3.0, clipping=clipping, seed=0)
        noise = _Noise()
        strategy.engine.release_hooks.append(noise)
        trainer = make_trainer(
            strategy,
            root / name,
            max_epochs=2,
            logger=CSVLogger(root / name, name="logs"),
            log_every_n_steps=1,
        )
        trainer.fit(TinyModule(n=256, batch_size=32, hidden=64))
        runs[name] = (strategy, trainer, noise)
    return runs


def test_epsilon_and_sigma_are_dp_sgd_s_digit_for_digit(quantile_run):
    (quantile, _, _), (dpsgd, _, _), (auto, _, _) = (quantile_run[k] for k in ("quantile", "dpsgd", "auto"))
    sigma = dpsgd.engine.noise.noise_multiplier(0)
    for strategy in (quantile, auto):
        assert strategy.engine.noise.noise_multiplier(0) == sigma
        assert strategy.engine.steps == dpsgd.engine.steps == 16
        assert strategy.epsilon == dpsgd.epsilon
        assert [e.noise_multiplier for e, _ in strategy.ledger.history] == [sigma]  # one event kind, z
    assert quantile.epsilon == compute_epsilon(
        noise_multiplier=sigma, sample_rate=1 / 8, steps=16, delta=1e-5
    )


def test_the_gradient_is_noised_at_z_delta_times_c_t(quantile_run):
    strategy, _, noise = quantile_run["quantile"]
    z = strategy.engine.noise.noise_multiplier(0)
    z_delta = gradient_noise_multiplier(z, 32 / 20)
    assert z_delta > z * 1.03  # m = 32: the count takes a visible share
    norms = [c for c, _, _ in noise.rows]
    assert all(s == z_delta for _, s, _ in noise.rows)
    assert norms[0] == 0.1  # C starts at C_0 and moves
    assert len(set(norms)) > 5
    scaled = torch.cat([n / c for c, _, n in noise.rows])
    assert float(scaled.std()) == pytest.approx(z_delta, rel=0.02)  # ~70k draws: 2% is > 5 std errors
    _, _, flat_noise = quantile_run["dpsgd"]
    assert float(torch.cat([n for _, _, n in flat_noise.rows]).std()) == pytest.approx(z, rel=0.02)


def test_clip_norm_is_in_every_logged_step_and_in_the_report(quantile_run):
    strategy, trainer, noise = quantile_run["quantile"]
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("dp/clip_norm")]
    assert [float(r["dp/clip_norm"]) for r in rows] == pytest.approx([c for c, _, _ in noise.rows], rel=1e-6)
    report = json.loads((Path(trainer.log_dir) / "privacy_report.json").read_text())
    assert report["clipping"] == "QuantileClipping"
    assert report["clip_norm"]["initial"] == 0.1
    assert report["clip_norm"]["last_used"] == pytest.approx(noise.rows[-1][0])
    assert report["max_grad_norm"] == strategy.engine.max_grad_norm == strategy.engine.clipping.norm
    _, auto_trainer, _ = quantile_run["auto"]
    assert "dp/clip_norm" not in auto_trainer.callback_metrics  # a fixed C is the strategy's max_grad_norm


# -- the norm's trajectory: resumed, over chunks, users and momentum steps ---------------------------------------


def test_the_trajectory_resumes_exactly_from_a_checkpoint(tmp_path):
    first = TinyModule(n=128, batch_size=32)
    straight = copy.deepcopy(first)
    trainer = make_trainer(
        DPStrategy(noise_multiplier=1.0, clipping=QuantileClipping(seed=5), seed=4), tmp_path
    )
    trainer.fit(first)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    resumed_clip, straight_clip = QuantileClipping(seed=5), QuantileClipping(seed=5)
    resumed = TinyModule(n=128, batch_size=32)
    strategy = DPStrategy(noise_multiplier=1.0, clipping=resumed_clip, seed=4)
    make_trainer(strategy, tmp_path, max_epochs=2).fit(resumed, ckpt_path=tmp_path / "a.ckpt")
    reference = DPStrategy(noise_multiplier=1.0, clipping=straight_clip, seed=4)
    make_trainer(reference, max_epochs=2).fit(straight)
    assert resumed_clip.norm == straight_clip.norm != 0.1
    assert resumed_clip.norm_range == straight_clip.norm_range
    assert strategy.epsilon == reference.epsilon
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_virtual_batching_gives_the_same_trajectory_and_step():
    reference = TinyModule(n=64, batch_size=64)
    split = copy.deepcopy(reference)
    clips = []
    for module, chunk in ((reference, None), (split, 10)):
        clips.append(QuantileClipping(initial_norm=0.5, seed=1))
        strategy = DPStrategy(noise_multiplier=0.7, clipping=clips[-1], seed=2, max_physical_batch_size=chunk)
        make_trainer(strategy, max_epochs=3).fit(module)
    assert clips[0].norm == pytest.approx(clips[1].norm, rel=1e-9)
    assert clips[0].norm != 0.5
    for a, b in zip(reference.parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("initial", "fraction"), [(1e3, 1.0), (1e-6, 0.0)])
def test_a_user_level_run_counts_users_not_rows(initial, fraction):
    """q_u = 1, 40 users with 1–4 rows (100 rows): b̃ is over the m = 40 users (rows would give 70/40)."""
    clip = QuantileClipping(initial_norm=initial)
    strategy = DPStrategy(clipping=clip, **user_strategy_args(4, 40, noise_multiplier=0.0))
    make_trainer(strategy, max_steps=1).fit(UserRows(batch_size=100))
    assert clip.norm == pytest.approx(geometric_update(initial, fraction, 0.5, 0.2), rel=1e-12)


def test_heavy_ball_steps_train_at_dp_sgd_s_epsilon():
    strategy = DPStrategy(target_epsilon=2.0, clipping=QuantileClipping(), step=HeavyBall(beta=0.5), seed=0)
    module = TinyModule(n=128, batch_size=32)
    make_trainer(strategy, max_epochs=2).fit(module)
    sigma = strategy.engine.noise.noise_multiplier(0)
    assert strategy.epsilon == compute_epsilon(noise_multiplier=sigma, sample_rate=0.25, steps=8, delta=1e-5)
    assert all(torch.isfinite(p).all() for p in module.parameters())


# -- what is refused, and what is not ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("slots", "match"),
    [
        (dict(noise=BandMF(), sampler=CyclicPoisson(bands="auto", seed=0)), "noise=BandMF"),
        (dict(sampler=DPIS(k=3, seed=0)), "sampler=DPIS"),
        (dict(step=LineSearch(seed=0)), "step=LineSearch"),
        (dict(step=AdaptiveGD()), "step=AdaptiveGD"),
        (dict(max_grad_norm=0.5), "max_grad_norm=0.5 with clipping=QuantileClipping"),
    ],
)
def test_combinations_that_would_leave_the_count_unpriced_are_refused(slots, match):
    with pytest.raises(DPConfigurationError, match=match):
        DPStrategy(target_epsilon=1.0, clipping=QuantileClipping(), **slots)


class _PricedStatisticStep(Step):
    """Reads the released sums (post-processing) and releases a statistic of its own, priced through Releases."""

    needs_sums = True

    def bind(self, host):
        self.host = host

    def step(self, optimizer, ctx):
        assert ctx.noisy_sums is not None
        self.host.releases.spend(Gaussian(50.0), mechanism="a statistic of the step's own")
        optimizer.step()


def test_a_step_that_prices_its_own_statistic_trains_with_the_count():
    strategy = DPStrategy(noise_multiplier=1.0, clipping=QuantileClipping(), step=_PricedStatisticStep())
    make_trainer(strategy, max_steps=3).fit(TinyModule(n=128, batch_size=32))
    kinds = sorted({type(event).__name__ for event, _ in strategy.ledger.history})
    assert kinds == ["Gaussian", "PoissonGaussian"]
    assert strategy.engine.clipping.norm != 0.1


def test_auto_clipping_refuses_an_infinite_scale():
    with pytest.raises(DPConfigurationError, match="max_grad_norm=inf with AutoClipping"):
        DPStrategy(noise_multiplier=0.0, max_grad_norm=math.inf, clipping=AutoClipping())


def test_a_sigma_the_count_cannot_share_is_refused_before_any_step_and_a_larger_count_noise_trains():
    """m = 8: the default σ_b = 0.4 cannot split σ = 1 (2σ_b ≤ z); σ_b = 1 can."""
    module = TinyModule(n=64, batch_size=8)
    with pytest.raises(DPConfigurationError, match=r"QuantileClipping cannot split .* needs 2σ_b > σ"):
        make_trainer(DPStrategy(noise_multiplier=1.0, clipping=QuantileClipping()), max_steps=1).fit(module)
    assert module.seen_batch_sizes == []
    strategy = DPStrategy(noise_multiplier=1.0, clipping=QuantileClipping(count_noise=1.0))
    make_trainer(strategy, max_steps=2).fit(module)
    assert strategy.engine.steps == 2


def test_bad_hyperparameters_are_refused_by_name():
    with pytest.raises(DPConfigurationError, match="target_quantile"):
        QuantileClipping(target_quantile=1.5)
    with pytest.raises(DPConfigurationError, match="initial_norm=2 must lie in"):
        QuantileClipping(initial_norm=2.0, max_norm=1.0)
    with pytest.raises(DPConfigurationError, match="stability"):
        AutoClipping(stability=-1.0)


# -- every zoo model: each example's contribution below the bound, the sum exact ------------------------------


@pytest.mark.parametrize("entry", ZOO, ids=repr)
def test_every_zoo_model_s_contributions_stay_below_the_bound_and_sum_exactly(entry):
    """Per example (fp64 autograd on that example alone): the weight each clipping gives it from the fast-path
    norm bounds its contribution by C (every example clipped at C = 1e-3; normalised at C = 1), which is all
    one example can move the sum by (the Trainer's neighbour test: tests/test_neighbour.py); and the clipping's
    sum equals Σ w_i g_i of the exact per-example gradients."""
    model, batch = _model(entry), _batch(entry)
    expected = reference_grads(model, batch)
    grads = GradientCapture(model)
    try:
        model(*batch).backward()
        samples, n = grads.collect()
        results = {}
        for name, clipping, bound in (
            ("quantile", QuantileClipping(initial_norm=1e-3), 1e-3),
            ("auto", AutoClipping(), 1.0),
        ):
            ctx = _ctx(n, clipping.clip_bound(1.0))
            results[name] = (clipping.clip_and_sum(samples, ctx), ctx.extras["per_sample_norms"], bound)
    finally:
        grads.remove()
    exact_norms = torch.stack([sum(g.double().square().sum() for g in r.values()) for r in expected]).sqrt()
    overall = max(float(g.abs().max()) for r in expected for g in r.values())  # a floor, as test_model_zoo's
    for name, (sums, norms, bound) in results.items():
        factors = clip_factors(norms, bound) if name == "quantile" else normalise_factors(norms, bound, 0.01)
        contributions = factors.double() * exact_norms
        assert bool((contributions <= bound).all()), (name, contributions.max().item())
        for p, total in zip(samples.params, sums, strict=True):
            want = sum(float(w) * r[p] for w, r in zip(factors, expected, strict=True))
            scale = (max(float(r[p].abs().max()) for r in expected) + 1e-9 * overall) * float(factors.max())
            assert float((total.double() - want).abs().max()) <= 1e-4 * scale, (name, p.shape)


# -- the shipped config: the LightningCLI form ---------------------------------------------------------------


CONFIG = Path(__file__).resolve().parents[2] / "configs" / "digits_quantile.yaml"


def test_the_shipped_config_trains_with_quantile_clipping_from_its_class_path(tmp_path):
    from lightning_dp.commands.cli import main

    main(
        [
            "fit", "--config", str(CONFIG), "--trainer.max_steps", "3", "--trainer.log_every_n_steps", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(tmp_path),
            "--test_after_fit", "false",
        ]
    )  # fmt: skip
    report = json.loads(next(tmp_path.rglob("privacy_report.json")).read_text())
    assert report["clipping"] == "QuantileClipping"
    assert report["steps"] == 3
    assert report["epsilon"] <= 3.0
    assert report["clip_norm"]["initial"] == 0.1
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        logged = [float(r["dp/clip_norm"]) for r in csv.DictReader(f) if r.get("dp/clip_norm")]
    assert len(logged) == 3
    assert logged[0] == pytest.approx(0.1)


def test_the_config_s_clipping_class_path_takes_auto_clipping_too():
    from lightning_dp.commands.tuning.planning import instantiate_cli

    cli = instantiate_cli(
        ["--config", str(CONFIG), "--trainer.strategy.init_args.clipping", "lightning_dp.AutoClipping"]
    )
    clipping = cli.trainer.strategy.engine.clipping
    assert isinstance(clipping, AutoClipping)
    assert clipping.stability == 0.01
