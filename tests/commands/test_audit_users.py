"""User-level audits (issue #38): on a user-level run the canaries are users and the claim is the ledger's
user-level ε (``docs/audit.md``, "Auditing a user-level run").

A correct user-level run audits at or below its claim with both kinds of canary; a run without noise audits
far above it; and two planted bugs of user-level DP are caught, each by the canary kind that can see it, while
the same run with the bug fixed passes: a ledger that prices users at the example rate (white-box gradient
canaries), and a user's examples clipped one by one, k·C instead of C (black-box canary users of k examples).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from audits import audit_trainer, dropped_noise
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy, PrivacyCallback, UserPoisson
from lightning_dp.accounting import PoissonGaussian, compute_epsilon
from lightning_dp.commands.audit import audit, make_input_canaries
from lightning_dp.core.batches import IndicesWithInfo, UnitInfo
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.sampling.user_ids import UserIds, resolve_user_ids, with_new_users
from recipes import DigitsDataModule, ImageClassifier

ROOT = Path(__file__).resolve().parents[2]
CLAIMED = 1.0
K, USERS_PER_STEP, NUM_USERS = 10, 13, 126  # configs/digits_users.yaml: 126 synthetic users of 10 digits


def digits_users_audit(canary: str, tmp_path, *, broken: bool = False, steps: int = 100, **strategy: Any):
    """Audit a user-level run on the digits with users (``configs/digits_users.yaml``'s users and k)."""
    arguments = dict(
        target_epsilon=CLAIMED, seed=0, privacy_unit="user", user_key="user_id", examples_per_user=K,
        users_per_step=USERS_PER_STEP,
    )  # fmt: skip
    dp = DPStrategy(**{**arguments, **strategy})
    torch.manual_seed(0)
    model = ImageClassifier(arch="logreg", in_features=64, lr=2.0)
    data = DigitsDataModule(batch_size=K * USERS_PER_STEP, flatten=True, users="shuffled")
    with warnings.catch_warnings(), dropped_noise(broken):
        warnings.simplefilter("ignore")
        result = audit(
            audit_trainer(dp, steps, tmp_path), model, data, canary=canary, num_canaries=256, seed=1
        )
    return result, dp


# -- correct runs pass, a run without noise fails -------------------------------------------------------------
def test_gradient_canaries_are_users_sampled_at_the_user_rate(tmp_path):
    """White-box: the claim is the ledger's user-level ε (q_u = B_u / U), and the report says so."""
    result, dp = digits_users_audit("gradient", tmp_path)
    assert dp.engine.sampler.sample_rate == USERS_PER_STEP / NUM_USERS  # the rate the canaries are drawn at
    user_level = compute_epsilon(
        noise_multiplier=dp.engine.last_noise_multiplier(), sample_rate=USERS_PER_STEP / NUM_USERS,
        steps=result.steps, delta=1e-5,
    )  # fmt: skip
    assert (
        result.claimed_epsilon == pytest.approx(user_level, rel=1e-9) == pytest.approx(dp.epsilon, rel=1e-12)
    )
    assert result.claimed_epsilon == pytest.approx(CLAIMED, abs=0.01)
    assert (result.privacy_unit, result.examples_per_canary) == ("user", None)
    assert result.epsilon_lower_bound <= result.claimed_epsilon
    assert result.passed
    report = json.loads((tmp_path / "privacy_report.json").read_text())
    assert report["privacy_unit"] == "user"
    assert report["audit"]["privacy_unit"] == "user"
    assert report["audit"]["epsilon_lower_bound"] == result.epsilon_lower_bound


def test_input_canaries_are_new_users_of_k_examples(tmp_path):
    """Black-box: each included canary joins the training set as one new user holding k examples."""
    result, dp = digits_users_audit("input", tmp_path)
    assert (result.privacy_unit, result.examples_per_canary) == ("user", K)
    assert dp.privacy_unit.num_units == NUM_USERS + result.num_included  # canary users: fresh ids, one each
    assert result.claimed_epsilon == pytest.approx(dp.epsilon, rel=1e-12)
    assert result.claimed_epsilon == pytest.approx(CLAIMED, abs=0.01)
    assert result.epsilon_lower_bound <= result.claimed_epsilon
    assert result.passed
    assert dp.engine.sampler.user_key == "user_id"  # the run's own key is back after the audit's fit


def test_user_level_run_without_noise_audits_far_above_its_claim(tmp_path):
    result, _ = digits_users_audit("gradient", tmp_path, broken=True)
    assert result.claimed_epsilon == pytest.approx(CLAIMED, abs=0.01)
    assert result.epsilon_lower_bound > 3 * result.claimed_epsilon, result
    assert not result.passed


def test_users_with_augmentation_multiplicity_audit_below_their_claim(tmp_path):
    """Canary users of k examples, each fetched as K views and clipped with their user as one unit."""
    result, dp = digits_users_audit("input", tmp_path, steps=60, augmentation_multiplicity=2)
    assert dp.privacy_unit.augmentation_multiplicity == 2
    assert (result.privacy_unit, result.examples_per_canary) == ("user", K)
    assert result.epsilon_lower_bound <= result.claimed_epsilon == pytest.approx(CLAIMED, abs=0.01)


def test_example_level_run_with_a_contribution_bound_audits_canaries_as_examples(tmp_path):
    """``max_examples_per_user`` reads user ids on the audit's training set too: each canary is one example
    of its own new user, and the claim stays the example-level ε."""
    dp = DPStrategy(target_epsilon=CLAIMED, seed=0, user_key="user_id", max_examples_per_user=5)
    torch.manual_seed(0)
    model = ImageClassifier(arch="logreg", in_features=64, lr=2.0)
    data = DigitsDataModule(batch_size=64, flatten=True, users="shuffled")
    no_report = [PrivacyCallback(report=False)]  # its user-level statement (MoG PLD) takes half a minute
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = audit_trainer(dp, 60, tmp_path, callbacks=no_report)
        result = audit(trainer, model, data, canary="input", num_canaries=128, seed=1)
    assert (result.privacy_unit, result.examples_per_canary) == ("example", 1)
    assert result.epsilon_lower_bound <= result.claimed_epsilon == pytest.approx(CLAIMED, abs=0.01)
    assert (
        dp.privacy_unit.num_units == 5 * NUM_USERS + result.num_included
    )  # 126 users capped at 5, + canaries


# -- planted bugs --------------------------------------------------------------------------------------------
class ExampleRateLedger(UserPoisson):
    """Planted bug (spec P1): users are drawn at q_u = B_u / U, but each step is priced at B_u / N, the rate
    over examples: the ledger claims a far smaller ε than the run spends."""

    def event(self, noise_multiplier: float) -> PoissonGaussian:
        assert self.users is not None
        examples = len(self.users.user_of_example)
        return PoissonGaussian(noise_multiplier=noise_multiplier, sample_rate=self.users_per_step / examples)


@pytest.mark.parametrize("sampler", [ExampleRateLedger, UserPoisson], ids=["bug", "fixed"])
def test_a_ledger_priced_at_the_example_rate_fails_the_audit(sampler, tmp_path):
    """White-box canaries are drawn at the rate the users are: the understated claim is rejected."""
    users = sampler(user_key="user_id", examples_per_user=2, users_per_step=63, seed=0)
    dp = DPStrategy(target_epsilon=8.0, seed=0, sampler=users)
    torch.manual_seed(0)
    model = ImageClassifier(arch="logreg", in_features=64, lr=2.0)
    data = DigitsDataModule(batch_size=126, flatten=True, users="shuffled")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = audit(
            audit_trainer(dp, 100, tmp_path), model, data, num_canaries=256, seed=1, write_report=False
        )
    if sampler is ExampleRateLedger:
        assert result.claimed_epsilon < 1.0 < result.epsilon_lower_bound, result
        assert not result.passed
    else:
        assert result.claimed_epsilon == pytest.approx(8.0, abs=0.1)
        assert result.passed


class RowClipping(UserPoisson):
    """Planted bug (spec P2): users are sampled, but the batch says each row is its own unit, so a sampled
    user's k examples are clipped one by one and summed: k·C instead of C."""

    def draw(self) -> IndicesWithInfo:
        rows = list(super().draw())
        return IndicesWithInfo(rows, UnitInfo(torch.arange(len(rows)), "sum"))


class LowRankUsers(LightningModule):
    """A linear classifier over data in a 16-dimensional subspace of R^256, 50 users of 8 examples: canaries
    in the other directions are moved by their own gradients only (the black-box audit's best case)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(256, 4)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(400, 16, generator=g) @ torch.randn(16, 256, generator=g) / 4
        y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
        return DataLoader(TensorDataset(x, y), batch_size=64)


@pytest.mark.parametrize("sampler", [RowClipping, UserPoisson], ids=["bug", "fixed"])
def test_a_users_examples_clipped_one_by_one_fail_the_black_box_audit(sampler, tmp_path):
    """Canary users of 32 examples: clipped one by one each pushes 32·C a step and is told apart."""
    users = sampler(user_key=torch.arange(400) // 8, examples_per_user=32, users_per_step=8, seed=0)
    dp = DPStrategy(target_epsilon=CLAIMED, seed=0, sampler=users)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = audit(
            audit_trainer(dp, 100, tmp_path), LowRankUsers(), canary="input", num_canaries=128, seed=1,
            write_report=False,
        )  # fmt: skip
    assert (result.privacy_unit, result.examples_per_canary) == ("user", 32)
    assert result.claimed_epsilon == pytest.approx(CLAIMED, abs=0.01)
    if sampler is RowClipping:
        assert result.epsilon_lower_bound > result.claimed_epsilon, result
    else:
        assert result.passed


USER_KEYS = {
    "names from a function": lambda i: f"user-{i // 8}",
    "float ids": [float(i // 8) for i in range(400)],
    "int tensor": torch.arange(400) // 8 * 7 + 3,
}


@pytest.mark.parametrize("key", list(USER_KEYS.values()), ids=list(USER_KEYS))
def test_canary_users_join_a_run_whatever_its_user_ids_are(key, tmp_path):
    """Any user_key (with a cap and cyclic selection too): the real users keep theirs, each canary is new."""
    dp = DPStrategy(
        target_epsilon=CLAIMED, seed=0, privacy_unit="user", user_key=key, examples_per_user=4, users_per_step=8,
        unit_selection="cycle", max_examples_per_user=6,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = audit(
            audit_trainer(dp, 20, tmp_path), LowRankUsers(), canary="input", num_canaries=64, seed=1
        )
    assert (result.privacy_unit, result.examples_per_canary) == ("user", 4)
    assert dp.privacy_unit.num_units == 50 + result.num_included
    assert dp.engine.sampler.user_key is key
    assert result.passed


# -- the pieces --------------------------------------------------------------------------------------------
def test_new_users_get_fresh_ids_and_existing_users_keep_theirs():
    ints = resolve_user_ids(range(5), torch.tensor([7, 3, 7, 9, 3]))
    key = with_new_users(ints, [2, 1])
    assert torch.equal(torch.as_tensor(key), torch.tensor([7, 3, 7, 9, 3, 10, 10, 11]))
    names = UserIds(torch.tensor([0, 1, 0]), ["lightning-dp-new-user-0", "bob"])
    key = with_new_users(names, [1, 2])
    assert key[:3] == ["lightning-dp-new-user-0", "bob", "lightning-dp-new-user-0"]
    assert key[3] not in ("lightning-dp-new-user-0", "bob")
    assert key[4] == key[5] != key[3]
    extended = resolve_user_ids(range(6), key)
    assert extended.num_users == 4  # two existing users, two new ones


def test_a_canary_user_holds_k_distinct_examples_with_one_label():
    data = TensorDataset(torch.randn(300, 20, generator=torch.Generator().manual_seed(0)))
    single = make_input_canaries(data, 6, 3, seed=0)
    users = make_input_canaries(data, 6, 3, seed=0, examples_per_canary=4)
    x, y = users.tensors
    assert x.shape == (24, 20)
    assert torch.equal(y, single.tensors[1].repeat_interleave(4))
    rows = x.view(6, 4, 20)
    spread = (rows - rows.mean(1, keepdim=True)).norm(dim=2)
    between = (rows.mean(1)[:, None] - rows.mean(1)[None]).norm(dim=2)
    assert bool((spread > 0).all())  # k different inputs
    assert float(spread.max()) < float(
        between[~torch.eye(6, dtype=torch.bool)].min()
    )  # closer than other canaries


def test_canary_users_need_a_user_level_run(tiny, tmp_path):
    trainer = audit_trainer(DPStrategy(target_epsilon=1.0), 1, tmp_path)
    with pytest.raises(DPConfigurationError, match="examples_per_canary=4 makes each canary a group"):
        audit(trainer, tiny, canary="input", examples_per_canary=4)
    with pytest.raises(ValueError, match="examples_per_canary applies to canary='input'"):
        audit(trainer, tiny, canary="gradient", examples_per_canary=1)


def test_cli_audit_says_per_user(tmp_path, capsys):
    from lightning_dp.commands.cli import main

    args = ["audit", "--config", str(ROOT / "configs" / "digits_users.yaml"), "--trainer.max_epochs", "4"]
    args += ["--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"]
    main([*args, "--audit_seed", "0"])
    out = capsys.readouterr().out
    assert "lightning-dp audit: claimed ε = 2.9" in out
    assert " per user, audited ε ≥ " in out
    assert "256 gradient canary users): no evidence against the claim" in out
    (report,) = tmp_path.rglob("privacy_report.json")
    summary = json.loads(report.read_text())["audit"]
    assert summary["privacy_unit"] == "user"
    assert summary["passed"] is True
