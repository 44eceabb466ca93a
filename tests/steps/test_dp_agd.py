"""DP-AGD (AdaptiveGD): the unit properties of ../shared/specs/dp_agd.md §6 (T1-T4 are in
tests/accounting/test_zcdp.py), the NoisyMin sign regression test, and the Lightning wiring."""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

import lightning as L
import pytest
import torch
from _worker import run_worker
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import AdaptiveGD, DPConfigurationError, DPStrategy
from lightning_dp.accounting import (
    ZCDP,
    NoisyMin,
    PoissonGaussian,
    compute_epsilon,
    epsilon_from_rho,
    rho_from_epsilon,
    zcdp_rho,
)
from lightning_dp.clipping import FlatClipping
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.noise import ConstantNoise
from lightning_dp.sampling import Poisson
from lightning_dp.steps.dp_agd import grad_avg, initial_budgets, noisy_min, step_grid
from recipes.linear import LinearClassifier

L8 = math.log(1e8)


def _data(n: int = 300, d: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g)
    w = torch.randn(d, generator=g)
    return x, ((x - 0.5) @ w > 0).long()


def _engine(module, n, step, target=1.0, delta=1e-8, seed=0):
    engine = PrivateStepEngine(
        sampler=Poisson(seed=seed),
        clipping=FlatClipping(),
        noise=ConstantNoise(None),
        step=step,
        max_grad_norm=3.0,
        delta=delta,
        target_epsilon=target,
        accountant="rdp",
        loss_reduction="mean",
        seed=seed,
    )
    engine.sampler.bind(n, n)  # q = 1: the paper's full batch
    engine.attach(module)
    return engine


def _iterate(engine, module, batch, optimizer) -> bool:
    """One DP-AGD iteration through the engine, as the strategy runs it; False once unaffordable."""
    if engine.affordable_steps() < 1:
        return False
    engine.begin_batch(None, data=batch)  # as the strategy announces each batch before user code runs
    module.zero_grad(set_to_none=True)
    module.dp_per_sample_loss(batch).mean().backward()
    engine.privatize()
    engine.apply_step(optimizer)
    return True


# -- T5, T15, T17: budgets ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("eps", "rho_nmax", "sigma0", "rho_ng0", "b", "max_iter"),
    [
        (0.05, 8.68056e-08, 43965.8, 2.32800e-09, 7200, 380.14),
        (0.1, 3.47222e-07, 21982.9, 9.31199e-09, 3600, 379.63),
        (1.0, 3.47222e-05, 2198.29, 9.311990e-07, 360, 370.66),
        (1.6, 8.88889e-05, 1373.93, 2.38387e-06, 225, 364.97),
    ],
)
def test_initial_budgets_t5(eps, rho_nmax, sigma0, rho_ng0, b, max_iter):
    rho, rho_ng, rho_nm = initial_budgets(eps, 1e-8, splits=60, conversion="bun_steinke")
    assert rho_nm == pytest.approx(rho_nmax, rel=1e-5)
    assert rho_ng == pytest.approx(rho_ng0, rel=1e-5)
    assert 3.0 / math.sqrt(2 * rho_ng) == pytest.approx(sigma0, rel=1e-5)
    assert rho_nm / rho_ng == pytest.approx(37.2876, rel=1e-5)
    assert rho / (rho_ng + rho_nm) == pytest.approx(max_iter, rel=1e-5)
    step = AdaptiveGD(conversion="bun_steinke")  # the paper's Lemma 3.8 reproduces its table
    engine = _engine(torch.nn.Linear(2, 1), 10, step, target=eps)
    assert step.noisy_min_scale == pytest.approx(b, rel=1e-6)
    # the filter counts iterations of (gradient + reserved NoisyMin): floor of the table's maximum
    assert engine.affordable_steps() == math.floor(max_iter)


@pytest.mark.parametrize("eps", [0.05, 1.0, 1.6])
def test_default_conversion_is_the_tight_one_and_buys_more_iterations(eps):
    """By default ρ_tot comes from the CKS conversion: more iterations than the paper's Lemma 3.8 at the
    same (ε, δ), and the filter's budget still converts back to exactly ε under CKS."""
    paper = _engine(torch.nn.Linear(2, 1), 10, AdaptiveGD(conversion="bun_steinke"), target=eps)
    step = AdaptiveGD()
    tight = _engine(torch.nn.Linear(2, 1), 10, step, target=eps)
    assert step.rho_total == pytest.approx(rho_from_epsilon(eps, 1e-8, "cks"), rel=1e-12)
    assert epsilon_from_rho(step.rho_total, 1e-8, "cks") == pytest.approx(eps, rel=1e-9)
    assert step.rho_total > 1.17 * rho_from_epsilon(eps, 1e-8, "bun_steinke")
    assert tight.affordable_steps() > 1.17 * paper.affordable_steps()
    with pytest.raises(DPConfigurationError, match="conversion"):
        AdaptiveGD(conversion="tight")  # type: ignore[arg-type]


def test_classic_gaussian_t15_and_no_moments_floor_t17():
    _, rho_ng, _ = initial_budgets(1.0, 1e-5, splits=1)  # ε_s = 0.5
    assert 1.0 / math.sqrt(2 * rho_ng) == pytest.approx(9.689610525, rel=1e-9)
    # one DP-SGD step (σ = 4, q = 1/√n) costs far less than the 0.5756 floor of an accountant capped at order 32
    eps = compute_epsilon(noise_multiplier=4.0, sample_rate=1 / math.sqrt(36_000), steps=1, delta=1e-8)
    assert eps < 0.1 < L8 / 32


# -- T9: GradAvg ---------------------------------------------------------------------------------
def test_grad_avg_variance_identity_and_chained_refinement():
    torch.manual_seed(0)
    c, g, draws = 3.0, torch.full((200_000,), 0.7, dtype=torch.float64), 200_000
    del draws

    def measure(rho):
        return g + torch.randn_like(g) * c / math.sqrt(2 * rho)

    rho0 = 1e-4
    s = measure(rho0)
    s1 = grad_avg([s], rho0, [measure(1.1e-4 - rho0)], 1.1e-4)[0]
    assert float(s1.var()) == pytest.approx(c**2 / (2 * 1.1e-4), rel=0.015)  # 40909.09
    rho2 = rho0 * 1.1**2
    s2 = grad_avg([s1], 1.1e-4, [measure(rho2 - 1.1e-4)], rho2)[0]
    assert float(s2.var()) == pytest.approx(37190.08, rel=0.015)  # not the stale-average 40571
    assert float(s2.mean()) == pytest.approx(0.7, abs=2.0)


# -- T10, T11: NoisyMin, including the sign regression test ---------------------------------------
def _frequencies(scores, scale, noise, draws=5_000):
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(len(scores))
    t = torch.tensor(scores, dtype=torch.float64)
    for _ in range(draws):
        counts[noisy_min(t, scale, noise, gen)] += 1
    return (counts / draws).tolist()


def test_noisy_min_exponential_is_permute_and_flip():
    assert _frequencies([0.0, 1.0, 2.0], 1.0, "exponential") == pytest.approx(
        [0.764988, 0.175642, 0.059370], abs=0.012
    )
    assert _frequencies([0.0, 360.0], 360.0, "exponential")[0] == pytest.approx(0.816060, abs=0.025)
    assert _frequencies([0.0, 1.0], 1.0, "laplace")[0] == pytest.approx(0.724090, abs=0.025)


def test_noisy_min_sign_regression():
    """21 candidates, α = 0 better than the other 20 by d = b: the private choice picks it 12.9% of the
    time; the authors' argmin(Ω + E) would pick it 65%, and leaks 20ε (spec T10, T11, §7 A1)."""
    p0 = _frequencies([0.0] + [1.0] * 20, 1.0, "exponential")[0]
    assert p0 == pytest.approx(0.129434, abs=0.02)
    assert p0 < 0.3  # the wrong sign gives 0.649639
    # privacy ratio on monotone neighbours: Ω_0 = 1 vs 0, others 0, b = Δ = 1 → e^1 (wrong sign: e^20)
    worse = _frequencies([1.0] + [0.0] * 20, 1.0, "exponential", draws=12_000)[0]
    equal = _frequencies([0.0] * 21, 1.0, "exponential", draws=5_000)[0]
    assert worse == pytest.approx(math.exp(-1) / 21, abs=0.005)
    assert equal == pytest.approx(1 / 21, abs=0.012)
    assert equal / worse < math.e * 1.6  # the wrong sign: e^20
    assert noisy_min(torch.tensor([3.0, 1.0, 2.0]), 0.0, "exponential", None) == 1  # b → 0: true argmin


# -- T6, T13, T18 through the engine --------------------------------------------------------------
def test_rejections_refine_the_same_gradient_and_cost_t6(monkeypatch):
    x, y = _data()
    module = LinearClassifier(x.shape[1])
    step = AdaptiveGD()
    engine = _engine(module, len(y), step, target=1.0)
    rho_ng0 = step.rho_ng
    assert rho_ng0 == pytest.approx(9.311990306e-07, rel=1e-9)
    script = iter([0, 0, 0, 5])
    monkeypatch.setattr(step, "_select", lambda scores, gen: next(script))
    measure, measured = step._measure, []

    def spy(sums: list[torch.Tensor], rho: float, ctx: Any) -> list[torch.Tensor]:
        """Each re-measurement is fresh noise on the clipped sums: they are not noised in place."""
        snapshot = [s.clone() for s in sums]
        out = measure(sums, rho, ctx)
        assert all(torch.equal(a, b) for a, b in zip(snapshot, sums, strict=True))
        measured.append(out)
        return out

    monkeypatch.setattr(step, "_measure", spy)
    before = [p.detach().clone() for p in module.parameters()]
    assert _iterate(engine, module, (x, y), torch.optim.SGD(module.parameters(), lr=0.1))
    assert len(measured) == 3
    moved = math.sqrt(
        sum(float(((p.detach() - b) ** 2).sum()) for p, b in zip(module.parameters(), before, strict=True))
    )
    assert moved == pytest.approx(step_grid(2.0, 20)[5], rel=1e-5)  # |α_i · d| with d a unit vector
    assert step.rho_ng == pytest.approx(1.2394259098e-06, rel=1e-9)
    costs = [(e.kind, zcdp_rho(e), n) for e, n in engine.ledger.history]
    kinds = [k for k, _, n in costs for _ in range(n)]
    assert kinds == [
        "poisson_gaussian",
        "noisy_min",
        "poisson_gaussian",
        "noisy_min",
        "poisson_gaussian",
        "noisy_min",
        "poisson_gaussian",
        "noisy_min",
    ]
    increments = [r for k, r, _ in costs if k == "poisson_gaussian"][1:]
    assert increments == pytest.approx([9.3120e-08, 1.02432e-07, 1.12675e-07], rel=1e-4)
    assert engine.ledger.rho_spent == pytest.approx(1.401283148e-04, rel=1e-6)
    assert (step.iterations, step.rejections, step.noisy_min_calls) == (1, 3, 4)


def test_step_grid_and_alpha_max_adaptation_t13(monkeypatch):
    assert step_grid(2.0, 20) == pytest.approx([k / 10 for k in range(21)])
    x, y = _data()
    module = LinearClassifier(x.shape[1])
    step = AdaptiveGD(alpha_max_cap=2.0)
    engine = _engine(module, len(y), step, target=1.0)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    monkeypatch.setattr(step, "_select", lambda scores, gen: 5)  # α = 0.5 on the initial grid
    for i in range(9):
        _iterate(engine, module, (x, y), opt)
        assert step.alpha_max == 2.0, i
    _iterate(engine, module, (x, y), opt)
    assert step.alpha_max == pytest.approx(0.55)
    assert step_grid(step.alpha_max, 20)[1] == pytest.approx(0.0275)
    monkeypatch.setattr(step, "_select", lambda scores, gen: 20)  # the top of the grid, 0.55
    for _ in range(10):
        _iterate(engine, module, (x, y), opt)
    assert step.alpha_max == pytest.approx(0.605)
    step.alpha_max = 1.9
    monkeypatch.setattr(step, "_select", lambda scores, gen: 20)
    for _ in range(10):
        _iterate(engine, module, (x, y), opt)
    assert step.alpha_max == 2.0  # 2.09 capped


def test_structural_invariants_until_the_budget_runs_out_t18():
    x, y = _data(400)
    module = LinearClassifier(x.shape[1])
    step = AdaptiveGD(splits=8, gamma=0.3)
    engine = _engine(module, len(y), step, target=0.5)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    rho_seen, calls = [], 0
    while True:
        before = [p.detach().clone() for p in module.parameters()]
        iters, calls_before = step.iterations, step.noisy_min_calls
        if not _iterate(engine, module, (x, y), opt):
            break
        changed = any(not torch.equal(p, b) for p, b in zip(module.parameters(), before, strict=True))
        assert changed == (step.iterations == iters + 1)  # weights move only when NoisyMin picks i > 0
        assert engine.ledger.rho_spent <= step.rho_total  # never over budget
        rho_seen.append(step.rho_ng)
        calls += step.noisy_min_calls - calls_before
    assert rho_seen == sorted(rho_seen)  # ρ_ng never decreases
    assert step.noisy_min_calls - (step.iterations + step.rejections) in (0, 1)
    for event, _ in engine.ledger.history:  # every entry is a Gaussian measurement or a NoisyMin
        assert isinstance(event, PoissonGaussian | NoisyMin)
    nm = next(e for e, _ in engine.ledger.history if isinstance(e, NoisyMin))
    assert zcdp_rho(nm) == pytest.approx(step.rho_nmax, rel=1e-12)
    assert engine.ledger.epsilon() <= 0.5
    assert not engine.ledger.can_afford(ZCDP(step.rho_ng + step.rho_nmax))


def test_noise_free_limit_is_monotone_normalised_gd():
    x, y = _data(200)
    module = LinearClassifier(x.shape[1])
    step = AdaptiveGD(rho_ng=1e6, rho_nmax=1e6)  # σ and b ≈ 1e-3: the noise-free limit
    engine = _engine(module, len(y), step, target=1e9)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    losses = []
    for _ in range(15):
        with torch.no_grad():
            losses.append(float(module.dp_per_sample_loss((x, y)).sum()))
        _iterate(engine, module, (x, y), opt)
    assert losses[0] == pytest.approx(200 * math.log(2))  # T14: logistic loss at w_0 = 0 is ln 2
    assert all(b <= a + 1e-9 for a, b in itertools.pairwise(losses))
    assert losses[-1] < 0.8 * losses[0]


# -- Lightning ---------------------------------------------------------------------------------------
def test_fit_stops_on_budget_with_checkpoint_and_report(tmp_path):
    x, y = _data(300)
    module = LinearClassifier(x.shape[1])
    step = AdaptiveGD(splits=10)
    trainer = L.Trainer(
        strategy=DPStrategy(
            step=step, target_epsilon=0.5, delta=1e-8, max_grad_norm=3.0, seed=0, max_physical_batch_size=128
        ),
        max_epochs=-1,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=len(y)))
    ledger = trainer.strategy.ledger
    assert step.iterations >= 5
    assert ledger.rho_spent <= step.rho_total
    assert trainer.strategy.epsilon <= 0.5
    assert not ledger.can_afford(ZCDP(step.rho_ng + step.rho_nmax))
    assert (tmp_path / "privacy_report.json").exists()
    ckpts = list(tmp_path.rglob("*.ckpt"))
    assert ckpts
    state = torch.load(ckpts[0], weights_only=True)["lightning_dp"]
    assert state["slots"]["step"]["state"]["iterations"] == step.iterations
    assert state["ledger"]["filter"]["mode"] == "zcdp"


def test_refuses_bad_configurations():
    module = torch.nn.Linear(2, 1)
    with pytest.raises(DPConfigurationError, match="noise"):
        DPStrategy(step=AdaptiveGD(), target_epsilon=1.0, noise_multiplier=1.0)
    with pytest.raises(DPConfigurationError, match="rdp"):
        DPStrategy(step=AdaptiveGD(), target_epsilon=1.0, accountant="prv")
    step = AdaptiveGD()
    engine = _engine(module, 4, step)
    x = torch.rand(4, 2)
    engine.begin_batch(None, data=(x, torch.zeros(4)))
    module(x).sum().backward()
    engine.privatize()
    with pytest.raises(DPConfigurationError, match="dp_per_sample_loss"):
        engine.apply_step(torch.optim.SGD(module.parameters(), lr=0.1))


@pytest.mark.slow
def test_two_processes_agree_on_every_decision(tmp_path):
    """DDP (gloo, 2 ranks): candidate losses all-reduced, NoisyMin drawn on rank 0 and broadcast, so both
    ranks take the same steps, spend the same budget and end with identical weights."""
    run_worker("ddp_agd_worker.py", tmp_path)
    r0, r1 = (json.loads((tmp_path / f"agd.rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1
    assert r0["iterations"] >= 3
    assert r0["rho_spent"] <= r0["rho_total"]
    assert r0["epsilon"] <= 0.5
    assert r0["noisy_min_calls"] == r0["iterations"] + r0["rejections"]
    assert any(w != 0.0 for w in r0["weights"])


def test_resume_continues_the_budget_and_the_step_state(tmp_path):
    x, y = _data(300)

    def fit(step, max_steps, ckpt=None):
        module = LinearClassifier(x.shape[1])
        trainer = L.Trainer(
            strategy=DPStrategy(step=step, target_epsilon=0.5, delta=1e-8, max_grad_norm=3.0, seed=0),
            max_epochs=-1,
            max_steps=max_steps,
            default_root_dir=tmp_path,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=len(y)), ckpt_path=ckpt)
        return trainer

    first = AdaptiveGD(splits=10, gamma=0.3)
    spent_then = fit(first, 3).strategy.ledger.rho_spent
    ckpt = str(sorted(tmp_path.rglob("*.ckpt"))[-1])
    second = AdaptiveGD(splits=10, gamma=0.3)
    resumed = fit(second, -1, ckpt)
    whole = AdaptiveGD(splits=10, gamma=0.3)
    straight = fit(whole, -1)
    assert resumed.strategy.ledger.rho_spent > spent_then
    # the step state, the filter and the noise streams come back: the same run as without interruption
    assert resumed.strategy.ledger.rho_spent == straight.strategy.ledger.rho_spent
    assert second.state_dict() == whole.state_dict()
    assert not resumed.strategy.ledger.can_afford(ZCDP(second.rho_ng + second.rho_nmax))
