"""User-level DP, the sampling, data, config and report half (issue #38, ``../shared/specs/user_level.md``).

Table U and Table B (the ledger prices a UserPoisson run as DP-SGD over U users, for any k), the sampler's
statistics at fixed seeds (§5.7 tests 1, 2), the equivalence with Poisson at one example per user (test 6),
resume (test 8), the enforced contribution bound and the ELS statement (test 10), user_key resolution,
the refusals of §6, and the report's unit fields. Clipping units as one is tested with the engine's grouping.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import TinyModule, make_trainer
from neighbour import released_sum
from scipy import stats
from torch.utils.data import TensorDataset

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
    L1Clipping,
    LineSearch,
    UserPoisson,
)
from lightning_dp.accounting import PrivacyLedger, calibrate_noise, compute_epsilon
from lightning_dp.noise import ConstantNoise
from lightning_dp.run.report import NO_USER_LEVEL_GUARANTEE
from lightning_dp.sampling.contribution_bound import ContributionBound, bounded_examples
from lightning_dp.sampling.user_ids import resolve_user_ids

DIGITS_USERS = torch.arange(1257) // 10  # §5.8: consecutive runs of 10 → U = 126 (125 × 10 + 1 × 7)


def bound(sampler: UserPoisson, user_of_example: torch.Tensor) -> UserPoisson:
    """``sampler`` bound to a data set whose examples belong to ``user_of_example`` (rows as the sampler draws)."""
    sampler.user_key = user_of_example
    sampler.bind(len(user_of_example), sampler.users_per_step * sampler.examples_per_user)
    return sampler


def users_of(num_users: int, per_user: int = 3) -> torch.Tensor:
    return torch.arange(num_users * per_user) // per_user


# -- Table U: ULS accounting is DP-SGD over users, whatever k, the selection and the reduction ------------
TABLE_U = {  # (U, B_u, σ, T, δ): (ε RDP, ε PRV, ε PLD), lightning-dp columns of the spec
    "U1": ((1000, 50, 1.0, 200, 1e-5), (5.367640841572282, 4.7762422894079615, 4.765920019234886)),
    "U2": ((10000, 100, 1.0, 1000, 1e-6), (2.4366938030221488, 2.1346440609594026, 2.1245225256749363)),
    "U3": ((125, 25, 2.0, 150, 1e-5), (6.8335964271797085, 6.282833011111074, 6.272489017839662)),
}


@pytest.mark.parametrize("case", sorted(TABLE_U))
def test_table_u_a_user_poisson_run_is_priced_as_dp_sgd_over_users(case):
    (num_users, users_per_step, sigma, steps, delta), (rdp, prv, pld) = TABLE_U[case]
    variants = [(1, "random", "mean"), (2, "cycle", "sum"), (8, "random", "sum"), (10, "cycle", "mean")]
    events = set()
    for k, selection, reduction in variants:
        sampler = UserPoisson(examples_per_user=k, users_per_step=users_per_step, selection=selection,
                              reduction=reduction, seed=0)  # fmt: skip
        bound(sampler, users_of(num_users, per_user=2))  # 2 examples per user: N = 2U, but q is over U
        assert (sampler.sample_rate, sampler.expected_batch_size) == (
            users_per_step / num_users,
            users_per_step,
        )
        events.add(sampler.event(sigma))
    assert (
        len(events) == 1
    )  # the same event, so the same ε digit for digit, for every k, selection, reduction
    for accountant, expected in (("rdp", rdp), ("prv", prv), ("pld", pld)):
        ledger = PrivacyLedger(delta=delta, accountant=accountant)
        for _ in range(steps):  # one event per step, as the engine records them
            ledger.record(next(iter(events)))
        assert ledger.epsilon() == pytest.approx(expected, rel=1e-12), accountant


# -- Table B: σ calibrated over users -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("users", "users_per_step", "steps", "rdp_sigma", "pld_sigma"),
    [
        (DIGITS_USERS, 13, 300, 2.859375, 2.6583251953124996),  # the digits-users bench
        (users_of(1000, 1), 50, 200, 1.375, None),  # the U1 shape (its PLD σ is the accounting tests')
    ],
)
def test_table_b_sigma_is_calibrated_from_the_user_sample_rate(
    users, users_per_step, steps, rdp_sigma, pld_sigma
):
    sampler = bound(UserPoisson(examples_per_user=10, users_per_step=users_per_step, seed=0), users)
    for accountant, expected in (("rdp", rdp_sigma), ("pld", pld_sigma)):
        if expected is None:
            continue
        noise = ConstantNoise()
        noise.calibrate(3.0, 1e-5, sampler, steps, accountant)
        assert noise.noise_multiplier(0) == expected
    assert sampler.sample_rate == users_per_step / (int(users.max()) + 1)
    at_sigma = compute_epsilon(
        noise_multiplier=rdp_sigma, sample_rate=sampler.sample_rate, steps=steps, delta=1e-5
    )
    assert at_sigma == pytest.approx(
        2.9888881996598844 if users is DIGITS_USERS else 2.9895571804306216, rel=1e-12
    )
    assert at_sigma == pytest.approx(
        compute_epsilon(noise_multiplier=calibrate_noise(
            target_epsilon=3.0, delta=1e-5, sample_rate=sampler.sample_rate, steps=steps
        ), sample_rate=sampler.sample_rate, steps=steps, delta=1e-5), rel=1e-12
    )  # fmt: skip


# -- §5.7 test 1: Poisson over users ----------------------------------------------------------------------------
def test_poisson_over_users_has_the_right_rates_and_rows():
    """U = 126 (the digits users: 125 × 10 and 1 × 7), q = 13/126, k = 8, 4,000 steps at a fixed seed.

    False alarms at a fresh seed: the mean within 3 s.e. (0.27%); every user's inclusion frequency within
    4.5 s.e., Bonferroni over 126 users (< 0.1% in all)."""
    steps, k = 4000, 8
    sampler = bound(UserPoisson(examples_per_user=k, users_per_step=13, seed=1), DIGITS_USERS)
    q, num_users = 13 / 126, 126
    owner = DIGITS_USERS.numpy()
    counts = np.bincount(owner)
    included = np.zeros(num_users)
    total_users = 0
    for batch in sampler.batch_sampler(steps):
        rows, unit_of_row = np.asarray(batch, dtype=np.int64), batch.info.unit_of_row.numpy()
        assert len(unit_of_row) == len(rows) == len(np.unique(rows))  # no example twice in a step
        assert np.all(np.diff(unit_of_row) >= 0)  # each unit's rows contiguous
        first = np.flatnonzero(np.r_[True, np.diff(unit_of_row) != 0])
        user_of_unit = owner[rows[first]]
        assert np.array_equal(owner[rows], user_of_unit[unit_of_row])  # a unit is one user's rows
        assert len(np.unique(user_of_unit)) == len(user_of_unit)  # and each user one unit
        assert np.array_equal(np.bincount(unit_of_row), np.minimum(counts[user_of_unit], k))
        included[user_of_unit] += 1
        total_users += len(user_of_unit)
    mean_se = math.sqrt(num_users * q * (1 - q) / steps)
    assert abs(total_users / steps - 13) < 3 * mean_se
    user_se = math.sqrt(q * (1 - q) / steps)
    assert np.all(np.abs(included / steps - q) < 4.5 * user_se)


def test_empty_steps_occur_at_the_poisson_rate_and_still_yield():
    """U = 10, q = 0.1: a step is empty w.p. 0.9^10 = 0.349; 4,000 steps, within 3 s.e. (0.27% false alarm)."""
    steps = 4000
    sampler = bound(UserPoisson(examples_per_user=2, users_per_step=1, seed=2), users_of(10))
    batches = list(sampler.batch_sampler(steps))
    assert len(batches) == steps  # every step yields, empty or not
    empty = [b for b in batches if len(b) == 0]
    assert all(b.info.num_units == 0 and b.info.unit_of_row.numel() == 0 for b in empty)
    rate = 0.9**10
    assert abs(len(empty) / steps - rate) < 3 * math.sqrt(rate * (1 - rate) / steps)


def test_ddp_ranks_sample_disjoint_users_whose_union_is_one_poisson_draw():
    """Rank r owns the users u ≡ r (mod W): no user's rows on two ranks; q and U as on one process."""
    users = DIGITS_USERS
    world = 3
    ranks = []
    for rank in range(world):
        sampler = UserPoisson(user_key=users, examples_per_user=10, users_per_step=13, seed=rank)
        sampler.bind(len(users), 130, rank=rank, world_size=world)
        assert (sampler.num_samples, sampler.sample_rate) == (126, 13 / 126)
        ranks.append({int(users[i]) for b in sampler.batch_sampler(200) for i in b})
    for rank, seen in enumerate(ranks):
        assert seen
        assert all(u % world == rank for u in seen)


# -- §5.7 test 2: which rows of a sampled user -------------------------------------------------------------------
def one_user(selection: str, seed: int = 0) -> UserPoisson:
    """One user with n_u = 5 examples, k = 2, sampled every step (q = 1)."""
    return bound(UserPoisson(examples_per_user=2, users_per_step=1, selection=selection, seed=seed),
                 torch.zeros(5, dtype=torch.long))  # fmt: skip


def test_random_selection_is_a_uniform_subset():
    """20,000 draws: each of the 10 two-subsets has frequency 0.1 (chi-square, p > 0.001: 0.1% false alarm)."""
    draws = Counter(tuple(sorted(b)) for b in one_user("random").batch_sampler(20000))
    assert set(draws) == {(a, b) for a in range(5) for b in range(a + 1, 5)}
    assert stats.chisquare(list(draws.values())).pvalue > 0.001


def test_cycle_selection_walks_each_users_examples_in_order_without_repeats():
    """{0,1},{2,3},{4,0},{1,2},… from a random starting point; never one example twice in a step."""
    for seed in range(4):
        batches = [list(b) for b in one_user("cycle", seed).batch_sampler(10)]
        start = batches[0][0]
        walk = [(start + i) % 5 for i in range(20)]
        assert [sorted(b) for b in batches] == [sorted(walk[2 * i : 2 * i + 2]) for i in range(10)]
        assert all(len(set(b)) == 2 for b in batches)


# -- §5.7 test 6: one example per user is DP-SGD ----------------------------------------------------------------
def test_one_example_per_user_is_poisson_sampling():
    """k = 1, every user one example, q = 1: the same clipped sum as Poisson on the same batch, the same ε."""
    template = TinyModule(n=24)
    data = TensorDataset(template.x[:24], template.y[:24])
    ids = torch.arange(24)
    users = released_sum(template, data, lambda: DPStrategy(
        noise_multiplier=0.0, max_grad_norm=0.05, privacy_unit="user", user_key=ids, examples_per_user=1,
        users_per_step=24, seed=0,
    ))  # fmt: skip
    examples = released_sum(
        template, data, lambda: DPStrategy(noise_multiplier=0.0, max_grad_norm=0.05, seed=0)
    )
    assert users.sums is not None
    assert examples.sums is not None
    for a, b in zip(users.sums, examples.sums, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    user_event = bound(UserPoisson(examples_per_user=1, users_per_step=5, seed=0), ids).event(1.3)
    assert user_event.to_dict() == {**user_event.to_dict(), "sample_rate": 5 / 24, "noise_multiplier": 1.3}


# -- user ids -----------------------------------------------------------------------------------------------------
class Records(torch.utils.data.Dataset):
    """Items are dicts with a user id, like a JSON-lines corpus."""

    def __init__(self, owners):
        self.owners = owners

    def __len__(self):
        return len(self.owners)

    def __getitem__(self, index):
        return {"x": torch.zeros(2), "author": self.owners[index]}


class Columns(Records):
    """A stand-in for a Hugging Face ``datasets.Dataset``: a column is read whole, never item by item."""

    __module__ = "datasets.arrow_dataset"
    column_names = ("x", "author")

    def __getitem__(self, key):
        if key == "author":
            return list(self.owners)
        raise AssertionError("the user ids must be read as a column")


def test_user_key_is_read_from_ids_a_function_a_column_an_attribute_or_the_items():
    owners = ["carol", "alice", "bob", "alice", "carol", "carol"]
    expected = [2, 0, 1, 0, 2, 2]  # relabelled in sorted order: alice 0, bob 1, carol 2
    records = Records(owners)
    records.authors = owners  # an attribute
    for key in (owners, lambda i: owners[i], "authors"):
        users = resolve_user_ids(records, key)
        assert users.user_of_example.tolist() == expected
        assert users.raw_ids == ["alice", "bob", "carol"]
    assert resolve_user_ids(Columns(owners), "author").user_of_example.tolist() == expected
    subset = torch.utils.data.Subset(records, [5, 1, 2])  # a Subset reads its dataset's ids, then selects
    assert resolve_user_ids(subset, "authors").raw_ids == ["alice", "bob", "carol"]
    assert resolve_user_ids(subset, "authors").user_of_example.tolist() == [2, 0, 1]
    with pytest.warns(UserWarning, match="loads each example once"):
        assert resolve_user_ids(Records(owners), "author").user_of_example.tolist() == expected
    assert resolve_user_ids(range(4), torch.tensor([30, 10, 30, 20])).user_of_example.tolist() == [2, 0, 2, 1]


@pytest.mark.parametrize(
    ("key", "match"),
    [
        ([1, None, 2, float("nan")], "some examples have no user id"),
        ([1, [1, 2], 2, 3], "lists several ids"),
        (torch.zeros(4, 2), "exactly one user"),
        ([1, 2, 3], "3 user ids for a training set of 4"),
        (None, "needs user_key"),
    ],
)
def test_missing_several_or_misaligned_user_ids_are_refused(key, match):
    with pytest.raises(DPConfigurationError, match=match):
        resolve_user_ids(range(4), key)


# -- §5.7 test 10: the contribution bound is enforced -------------------------------------------------------------
def test_max_examples_per_user_keeps_at_most_k_per_user_whatever_the_other_users():
    owners = torch.tensor([0] * 7 + [1] * 2 + [2] * 12 + [3] * 3)
    users = resolve_user_ids(range(len(owners)), owners)
    kept = bounded_examples(users, 3, seed=5)
    per_user = torch.bincount(owners[kept], minlength=4)
    assert per_user.tolist() == [3, 2, 3, 3]  # the excess dropped; smaller users keep everything
    assert bounded_examples(users, 3, seed=5).tolist() == kept.tolist()  # seeded: the same choice again
    # A neighbour without user 0: every other user keeps exactly the same examples.
    rest = torch.arange(7, len(owners))
    kept_rest = rest[bounded_examples(resolve_user_ids(range(len(rest)), owners[rest]), 3, seed=5)]
    assert kept_rest.tolist() == [i for i in kept.tolist() if i >= 7]
    bounded = ContributionBound(owners.tolist(), 3, seed=5).apply(TensorDataset(torch.zeros(len(owners))))
    assert len(bounded) == 11


def test_a_user_poisson_cap_draws_only_kept_examples():
    owners = torch.tensor([0] * 9 + [1] * 2)
    sampler = bound(
        UserPoisson(examples_per_user=4, users_per_step=2, max_examples_per_user=5, seed=0), owners
    )
    seen = {i for b in sampler.batch_sampler(200) for i in b}
    assert len([i for i in seen if owners[i] == 0]) == 5
    assert {9, 10} <= seen


# -- refusals (spec §6) --------------------------------------------------------------------------------------------
USERS = dict(privacy_unit="user", user_key="user_id", examples_per_user=4, users_per_step=8)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(privacy_unit="user"), "needs user_key, examples_per_user, users_per_step"),
        (dict(privacy_unit="user", user_key="u", users_per_step=3), "needs examples_per_user"),
        (dict(examples_per_user=4), "only apply with privacy_unit='user'"),
        (dict(max_examples_per_user=4), "needs user_key"),
        (dict(privacy_unit="team"), "privacy_unit must be"),
        ({**USERS, "unit_selection": "all"}, "unit_selection must be"),
        ({**USERS, "sampler": DPIS()}, "DPIS with users is not priced"),
        ({**USERS, "sampler": FixedSize()}, "FixedSize with users is not priced"),
        (dict(privacy_unit="user", sampler=CyclicPoisson(bands=2)), "CyclicPoisson with users"),
        ({**USERS, "accountant": "pure"}, "Use Gaussian noise"),
        ({**USERS, "clipping": L1Clipping()}, r"L1Clipping \(Laplace noise\) is not priced"),
        ({**USERS, "clipping": AdaCliP()}, "AdaCliP cannot be used with user-level DP"),
        ({**USERS, "step": LineSearch()}, "LineSearch cannot be used with user-level DP"),
        ({**USERS, "step": AdaptiveGD()}, "AdaptiveGD cannot be used with user-level DP"),
        ({**USERS, "noise": BandMF()}, "BandMF cannot be used with user-level DP"),
        ({**USERS, "noise": BLT()}, "BLT cannot be used with user-level DP"),
        ({**USERS, "data_changes": "public"}, "U, and so q"),
        ({**USERS, "max_physical_batch_size": 3}, "Set max_physical_batch_size ≥ 4"),
        (dict(sampler=UserPoisson("u", 4, 2), max_physical_batch_size=2), "clipped once per part"),
        (dict(privacy_unit="user", user_key="u", sampler=UserPoisson("u", 4, 2)), "not both"),
        (dict(sampler=UserPoisson("u", 4, 2), max_examples_per_user=3), "not both"),  # never silently ignored
    ],
)
def test_user_level_refusals_name_the_fix(kwargs, match):
    with pytest.raises(DPConfigurationError, match=match):
        DPStrategy(**kwargs)


def test_more_users_per_step_than_users_is_refused_at_fit(tmp_path):
    module = TinyModule(n=30)
    strategy = DPStrategy(noise_multiplier=1.0, privacy_unit="user", user_key=torch.arange(30) // 3,
                          examples_per_user=3, users_per_step=11)  # fmt: skip
    with pytest.raises(
        DPConfigurationError, match="users_per_step=11 is larger than the number of users U=10"
    ):
        make_trainer(strategy, tmp_path, max_steps=1).fit(module)


# -- a user-level fit: ε, report, fit-start line, resume (§5.7 test 8) ------------------------------------------
N_USERS, PER_USER = 40, 6


def user_strategy(**overrides) -> DPStrategy:
    kwargs = dict(noise_multiplier=1.0, delta=1e-4, privacy_unit="user", user_key=torch.arange(240) // PER_USER,
                  examples_per_user=4, users_per_step=8, unit_selection="cycle", seed=0)  # fmt: skip
    kwargs.update(overrides)
    return DPStrategy(**kwargs)


def test_a_user_level_fit_trains_prices_users_and_reports_its_unit(tmp_path, monkeypatch):
    module = TinyModule(n=240, batch_size=32)
    before = [p.detach().clone() for p in module.parameters()]
    strategy = user_strategy()
    said: list[str] = []
    monkeypatch.setattr("lightning_dp.strategies.base.rank_zero_info", said.append)
    logged: dict[str, float] = {}
    monkeypatch.setattr(type(module), "log", lambda self, name, value, **kw: logged.__setitem__(name, value))
    make_trainer(strategy, tmp_path, max_epochs=2).fit(module)
    steps = strategy.engine.steps
    assert steps == 2 * math.ceil(N_USERS / 8)  # an epoch samples each user once in expectation
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    expected = compute_epsilon(noise_multiplier=1.0, sample_rate=8 / N_USERS, steps=steps, delta=1e-4)
    assert strategy.epsilon == expected  # the ledger is in user units
    assert strategy.privacy_unit is not None
    assert strategy.privacy_unit.num_units == N_USERS
    line = "user-level DP over 40 users (≤4 examples each, mean then clip), q=0.2 (8 users/step)"
    assert any(line in message for message in said)
    assert logged["dp/epsilon"] == expected
    assert logged["dp/sample_rate"] == 0.2
    assert not [name for name in logged if name.startswith("dp/") and ("user" in name or "rows" in name)]
    report = json.loads((tmp_path / "privacy_report.json").read_text())
    assert report["epsilon"] == expected
    assert {k: report[k] for k in ("privacy_unit", "num_units", "sample_rate", "expected_batch_size",
                                   "examples_per_unit", "unit_selection", "unit_reduction",
                                   "augmentation_multiplicity", "unit_key")} == {
        "privacy_unit": "user", "num_units": N_USERS, "sample_rate": 0.2, "expected_batch_size": 8.0,
        "examples_per_unit": 4, "unit_selection": "cycle", "unit_reduction": "mean",
        "augmentation_multiplicity": 1, "unit_key": "<Tensor>",
    }  # fmt: skip
    assert "all of their examples" in report["adjacency"]
    assert report["statement"].startswith(
        "User-level DP (add/remove one user, all checkpoints), δ=0.0001: ε = "
    )
    assert "each user contributes at most 4 examples per step" in report["statement"]
    assert "dataset_size" not in report  # the number of examples is a statistic of the users' data
    assert 240 not in [v for v in report.values() if isinstance(v, int)]


def test_resume_continues_user_level_epsilon_and_refuses_another_user_rate(tmp_path):
    first = make_trainer(user_strategy(), tmp_path, max_steps=3, max_epochs=5)
    first.fit(TinyModule(n=240, batch_size=32))
    path = tmp_path / "three.ckpt"
    first.save_checkpoint(path)
    sampler_entry = torch.load(path, weights_only=False)["lightning_dp"]["slots"]["sampler"]
    assert sampler_entry["name"] == "UserPoisson"
    assert set(sampler_entry["state"]) <= {"sample_rate", "num_samples", "generator"}  # nothing per user
    assert sampler_entry["state"]["num_samples"] == N_USERS  # U, not the number of examples
    resumed = user_strategy(seed=None)
    make_trainer(resumed, tmp_path, max_steps=5, max_epochs=5).fit(
        TinyModule(n=240, batch_size=32), ckpt_path=path
    )
    assert resumed.engine.steps == 5
    assert resumed.epsilon == compute_epsilon(noise_multiplier=1.0, sample_rate=0.2, steps=5, delta=1e-4)
    with pytest.raises(DPConfigurationError, match=r"sample rate 0\.2"):
        make_trainer(user_strategy(users_per_step=10), tmp_path, max_steps=5, max_epochs=5).fit(
            TinyModule(n=240, batch_size=32), ckpt_path=path
        )


def test_an_example_level_report_names_its_unit_and_says_there_is_no_user_level_guarantee(tmp_path):
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    make_trainer(strategy, tmp_path, max_steps=2).fit(TinyModule(n=64, batch_size=16))
    report = json.loads((tmp_path / "privacy_report.json").read_text())
    assert (report["privacy_unit"], report["num_units"], report["examples_per_unit"]) == ("example", 64, 1)
    assert report["adjacency"] == "add/remove one example"
    assert report["statement"].endswith(NO_USER_LEVEL_GUARANTEE)
    assert "user_level" not in report


# -- the ELS statement (Table E) ------------------------------------------------------------------------------------
@pytest.mark.slow  # two mixture-of-Gaussians PLD evaluations (about 3 s each)
def test_table_e_user_level_statement_of_an_example_level_run(tmp_path):
    from lightning_dp.accounting import group

    ledger = PrivacyLedger(delta=1e-5)
    from lightning_dp.accounting import PoissonGaussian

    ledger.record(PoissonGaussian(noise_multiplier=2.828, sample_rate=128 / 1257), count=300)
    assert group.group_rdp_user_epsilon(ledger, 10, 1e-5) == pytest.approx(110.7963813012941, rel=1e-12)
    assert group.group_rdp_user_epsilon(ledger, 1, 1e-5) == pytest.approx(2.985922185845464, rel=1e-12)

    owners = torch.arange(64) // 8  # 8 users of 8 examples, bounded to 2
    strategy = DPStrategy(noise_multiplier=16.0, seed=0, user_key=owners, max_examples_per_user=2)
    make_trainer(strategy, tmp_path, max_steps=2).fit(TinyModule(n=64, batch_size=4))
    assert strategy.engine.sampler.num_samples == 16  # the excess really dropped before sampling
    report = json.loads((tmp_path / "privacy_report.json").read_text())
    user_level = report["user_level"]
    assert user_level["enforced"] is True
    assert user_level["max_examples_per_user"] == 2
    assert user_level["epsilon_rdp_group"] == group.group_rdp_user_epsilon(strategy.ledger, 2, 1e-5)
    mog = group.mog_user_epsilon(16.0, 4 / 16, 2, 2, 1e-5)
    assert user_level["epsilon_pld_mog"] == mog
    assert user_level["epsilon"] == min(v for v in (mog, user_level["epsilon_rdp_group"]) if v is not None)


def test_the_digits_recipe_has_126_synthetic_users_of_consecutive_train_examples():
    """Spec §5.8: runs of 10 train indices, after a stable sort by label or a seeded shuffle."""
    from recipes import DigitsDataModule

    for users in ("label_sorted", "shuffled"):
        data = DigitsDataModule(flatten=True, users=users)
        data.setup("fit")
        assert data.train_set is not None
        ids = resolve_user_ids(data.train_set, "user_id")  # the attribute user_key="user_id" reads
        assert ids.num_users == 126
        assert sorted(torch.bincount(ids.user_of_example).tolist()) == [7] + [10] * 125
        labels = data.train_set.tensors[1]
        if users == "label_sorted":
            assert torch.all(labels[1:] >= labels[:-1])  # non-iid: mostly one digit per user
