"""The RepeatAndSelect bound of private tuning (``accounting/repeat_select.py``; PS22 Thm 2/6, issue #20): the law
of K, the hand-computed case and dp_accounting, the digits table, its properties, and the event in the ledger.

Pinned numbers come from the spec (shared/specs/private_tuning.md §2), computed on lightning_dp's own digits
curve and cross-checked there against dp_accounting. ``tests/commands/test_tuning.py`` tests the search that
spends it.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from lightning_dp.accounting import (
    DEFAULT_ORDERS,
    Gaussian,
    PoissonGaussian,
    PrivacyEvent,
    PrivacyLedger,
    RepeatAndSelect,
    Repetitions,
    SubsampledLaplace,
    delta_from_rdp,
    epsilon_from_rdp,
    repeat_and_select_rdp,
)
from lightning_dp.accounting.repeat_select import threshold_rdp

Q = 128 / 1257
SIGMA = 2.828125
REL = 1e-9


def digits_ledger(sigma: float = SIGMA, q: float = Q, steps: int = 300) -> PrivacyLedger:
    ledger = PrivacyLedger(1e-5)
    ledger.record(PoissonGaussian(sigma, q), steps)
    return ledger


def tuned(history: list[tuple[PrivacyEvent, int]], reps: Repetitions) -> tuple[float, float | None]:
    ledger = PrivacyLedger(1e-5)
    ledger.record(RepeatAndSelect.of([history], reps))
    return ledger.epsilon_and_order()


FAMILIES_AT_10 = {
    "logarithmic": Repetitions.logarithmic(10),
    "tnb0.5": Repetitions.tnb(10, 0.5),
    "geometric": Repetitions.geometric(10),
    "tnb2": Repetitions.tnb(10, 2.0),
}


# ------------------------------------------------------------------------------------ T1: the law of K
@pytest.mark.parametrize(
    ("name", "gamma", "p1"),
    [
        ("logarithmic", 0.026918259600680214, 0.2691825960068022),
        ("tnb0.5", 0.0625, 0.15625),
        ("geometric", 0.1, 0.1),
        ("tnb2", 0.17082039324993692, 0.049844718999242914),
    ],
)
def test_distribution_gamma_pmf_and_mean(name: str, gamma: float, p1: float) -> None:
    reps = FAMILIES_AT_10[name]
    assert reps.gamma == pytest.approx(gamma, rel=1e-12)
    assert reps.pmf(1) == pytest.approx(p1, rel=1e-12)
    pmf = np.array([reps.pmf(k) for k in range(1, 4001)])
    assert math.fsum(pmf) == pytest.approx(1.0, abs=1e-12)
    assert math.fsum(pmf * np.arange(1, 4001)) == pytest.approx(reps.expected_trials, rel=1e-9)
    assert reps.expected_trials == pytest.approx(10.0, rel=1e-12)


def test_poisson_pmf_at_zero() -> None:
    assert Repetitions.poisson(10).pmf(0) == pytest.approx(4.5399929762484854e-05, rel=1e-12)


@pytest.mark.parametrize("name", ["logarithmic", "tnb0.5", "geometric", "tnb2", "poisson"])
def test_sampler_matches_pmf(name: str) -> None:
    reps = Repetitions.poisson(10) if name == "poisson" else FAMILIES_AT_10[name]
    draws = reps.sample(np.random.default_rng(20), size=200_000)
    assert isinstance(reps.sample(np.random.default_rng(20)), int)
    pmf = np.array([reps.pmf(k) for k in range(0, 4001)])
    mean = math.fsum(pmf * np.arange(4001))
    sd = math.sqrt(math.fsum(pmf * (np.arange(4001) - mean) ** 2))
    assert abs(draws.mean() - mean) < 4 * sd / math.sqrt(len(draws))
    if name != "poisson":
        assert draws.min() >= 1
    observed = np.bincount(np.minimum(draws, 21), minlength=22)
    expected = len(draws) * np.append(pmf[:21], 1 - pmf[:21].sum())
    keep = expected > 5
    result = stats.chisquare(observed[keep], expected[keep] * observed[keep].sum() / expected[keep].sum())
    assert result.pvalue > 1e-3


@pytest.mark.parametrize(
    ("family", "mean", "eta"),
    [
        ("poisson", 0.5, 0.0),
        ("geometric", 1.0, 0.0),
        ("logarithmic", 0.9, 0.0),
        ("tnb", 5.0, -0.5),
        ("uniform", 5, 0),
    ],
)
def test_degenerate_laws_are_refused(family: str, mean: float, eta: float) -> None:
    with pytest.raises(ValueError, match=r"mean|eta|distribution"):
        Repetitions(family, mean, eta)


# ------------------------------------------------------------------- T2: hand-computed case and DPA
HAND_ORDERS = (2.0, 3.0, 4.0)


def test_hand_computed_vectors() -> None:
    curve = Gaussian(1.0).rdp(HAND_ORDERS)
    ln10 = math.log(10)
    geo = repeat_and_select_rdp(curve, HAND_ORDERS, Repetitions.geometric(10))
    np.testing.assert_allclose(geo, [2.5 + 1.5 * ln10, 2.5 + 1.5 * ln10, 3 + 4 / 3 * ln10], rtol=1e-13)
    log = repeat_and_select_rdp(curve, HAND_ORDERS, Repetitions.logarithmic(10))
    np.testing.assert_allclose(log, [4.8562760221928665, 4.8562760221928665, 4.972511840027193], rtol=REL)
    poi = repeat_and_select_rdp(curve, HAND_ORDERS, Repetitions.poisson(10))
    np.testing.assert_allclose(poi, [6.700437378567853, 7.181762260595432, 7.864306792692059], rtol=1e-13)
    assert poi[0] == pytest.approx(1 + 10 * math.e / 8 + ln10, rel=1e-13)
    for order, expected in zip(
        HAND_ORDERS, [0.3397852285573807, 0.4530469714098409, 0.509677842836071], strict=True
    ):
        assert delta_from_rdp(curve, HAND_ORDERS, math.log1p(1 / (order - 1))) == pytest.approx(
            expected, rel=1e-13
        )


def test_agrees_with_dp_accounting() -> None:
    """Equal to dp_accounting for D_{η,γ}; for Poisson ours also applies RDP's monotonicity in the order, which
    dp_accounting skips there: equal at every order where its curve is already nondecreasing, tighter below."""
    rdp_module = pytest.importorskip("dp_accounting.rdp.rdp_privacy_accountant")
    ledger = digits_ledger()
    orders, curve = np.array(ledger.orders), ledger.rdp
    for reps, shape, rel in [
        (Repetitions.poisson(10), math.inf, 1e-12),
        (Repetitions.geometric(10), 1.0, 1e-12),
        (Repetitions.logarithmic(10), 0.0, 1e-9),
        (Repetitions.tnb(10, 0.5), 0.5, 1e-9),
    ]:
        theirs = np.asarray(rdp_module._compute_rdp_repeat_and_select(orders, curve, 10.0, shape))
        ours = repeat_and_select_rdp(curve, ledger.orders, reps)
        monotone_theirs = np.minimum.accumulate(theirs[::-1])[::-1]
        np.testing.assert_allclose(ours, monotone_theirs, rtol=rel)
        assert np.all(ours <= theirs * (1 + rel))
        eps_theirs = rdp_module.compute_epsilon(orders, theirs, 1e-5)[0]
        assert epsilon_from_rdp(ours, ledger.orders, 1e-5)[0] == pytest.approx(eps_theirs, rel=rel)
        if shape == math.inf:  # the orders where dp_accounting's Poisson curve is not monotone: all below 2.5
            tighter = orders[ours < theirs * (1 - 1e-12)]
            assert tighter.size > 0
            assert tighter.max() < 2.5


# -------------------------------------------------------------------------------- T3: the digits table
def test_digits_table() -> None:
    ledger = digits_ledger()
    assert ledger.epsilon_and_order() == pytest.approx((2.9857608468082266, 7.2), rel=REL)
    naive = digits_ledger(steps=3000)
    assert naive.epsilon_and_order() == pytest.approx((11.05542543795224, 3.2), rel=REL)
    history = ledger.history
    for reps, eps, order in [
        (Repetitions.poisson(10), 6.5261414978057175, 6.9),
        (Repetitions.logarithmic(10), 4.877674814129812, 7.9),
        (Repetitions.geometric(10), 5.700402749556156, 7.9),
    ]:
        assert tuned(history, reps) == pytest.approx((eps, order), rel=REL)
    assert tuned(history, Repetitions.tnb(10, 0.5))[0] == pytest.approx(5.316014, abs=1e-6)
    assert tuned(history, Repetitions.tnb(10, 2.0))[0] == pytest.approx(6.358334, abs=1e-6)
    threshold = threshold_rdp(ledger.rdp, ledger.orders, 0.1)
    assert epsilon_from_rdp(threshold, ledger.orders, 1e-5)[0] == pytest.approx(4.825598, abs=1e-6)


MEAN_TABLE = {
    2: [3.732269, 3.909818, 4.073709, 4.195580, 4.366038],
    3: [4.114998, 4.211373, 4.457853, 4.653044, 4.950652],
    5: [4.832124, 4.522150, 4.857306, 5.136786, 5.587645],
    20: [9.751726, 5.187784, 5.716260, 6.198134, 7.061543],
    100: [28.066230, 5.809484, 6.515767, 7.201920, 8.511058],
}


@pytest.mark.parametrize("mean", sorted(MEAN_TABLE))
def test_digits_mean_table(mean: int) -> None:
    history = digits_ledger().history
    laws = [Repetitions.poisson(mean), *(Repetitions.tnb(mean, eta) for eta in (0.0, 0.5, 1.0, 2.0))]
    got = [tuned(history, reps)[0] for reps in laws]
    np.testing.assert_allclose(got, MEAN_TABLE[mean], atol=1e-6)


# ---------------------------------------------------------------------------------- T4: properties
LAWS = [
    lambda m: Repetitions.poisson(m),
    lambda m: Repetitions.logarithmic(m),
    lambda m: Repetitions.geometric(m),
    lambda m: Repetitions.tnb(m, 2.0),
]


@settings(max_examples=10, deadline=None)
@given(
    sigma=st.floats(0.5, 20),
    q=st.floats(1e-3, 1.0),
    steps=st.integers(1, 5000),
    means=st.tuples(st.floats(1.01, 1000), st.floats(1.01, 1000)),
    law=st.sampled_from(range(len(LAWS))),
    bump=st.floats(0.0, 2.0),
)
def test_properties(
    sigma: float, q: float, steps: int, means: tuple[float, float], law: int, bump: float
) -> None:
    orders = DEFAULT_ORDERS
    curve = steps * PoissonGaussian(sigma, q).rdp(orders)
    m1, m2 = sorted(means)
    low = repeat_and_select_rdp(curve, orders, LAWS[law](m1))
    high = repeat_and_select_rdp(curve, orders, LAWS[law](m2))
    assert np.all(low <= high + 1e-12)  # monotone in the mean, pointwise
    assert np.all(low >= curve)  # never below one trial
    eps = epsilon_from_rdp(low, orders, 1e-5)[0]
    assert eps >= epsilon_from_rdp(curve, orders, 1e-5)[0]
    raised = repeat_and_select_rdp(curve * (1 + bump), orders, LAWS[law](m1))
    assert epsilon_from_rdp(raised, orders, 1e-5)[0] >= eps - 1e-12
    history = [(PoissonGaussian(sigma, q), steps)]
    more = RepeatAndSelect.of([history, [(Gaussian(sigma + 1.0), 3)]], LAWS[law](m1))
    assert np.all(more.rdp(orders) >= RepeatAndSelect.of([history], LAWS[law](m1)).rdp(orders) - 1e-12)


# ------------------------------------------------------------------------------------- T5: the event
def test_event_serialises_and_composes(tmp_path: Path) -> None:
    event = RepeatAndSelect.of(
        [[(PoissonGaussian(SIGMA, Q), 300), (Gaussian(10.0), 1)]], Repetitions.poisson(3)
    )
    assert PrivacyEvent.from_dict(event.to_dict()) == event
    assert hash(PrivacyEvent.from_dict(event.to_dict())) == hash(event)
    ledger = PrivacyLedger(1e-5)
    ledger.record(event)
    assert ledger.epsilon() == pytest.approx(4.163996505202108, rel=REL)
    torch.save(ledger.state_dict(), tmp_path / "ledger.pt")
    restored = PrivacyLedger(1e-5)
    restored.load_state_dict(torch.load(tmp_path / "ledger.pt", weights_only=True))
    assert restored.epsilon() == ledger.epsilon()
    ledger.record(PoissonGaussian(SIGMA, Q), 300)  # a later release (retraining with θ*) composes
    np.testing.assert_allclose(ledger.rdp, event.rdp(ledger.orders) + digits_ledger().rdp, rtol=1e-15)
    with pytest.raises(ValueError, match="PRV accountant cannot price"):
        PrivacyLedger(1e-5, "prv").record(event)


def test_pure_trials_give_two_plus_eta_epsilon() -> None:
    step = SubsampledLaplace(5.0, 0.1)
    eps0 = 20 * step.pure_epsilon()
    for reps, factor in [(Repetitions.geometric(10), 3.0), (Repetitions.tnb(10, 0.5), 2.5)]:
        ledger = PrivacyLedger(1e-5, "pure")
        ledger.record(RepeatAndSelect.of([[(step, 20)]], reps))
        assert ledger.epsilon() == pytest.approx(factor * eps0, rel=1e-12)
    assert RepeatAndSelect.of([[(step, 20)]], Repetitions.poisson(10)).pure_epsilon() is None
