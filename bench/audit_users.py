"""The white-box audit of user-level runs (canary users) against the same audit of example-level runs.

    PYTHONPATH=. python bench/audit_users.py --canaries 1000 --seeds 3

scikit-learn's digits with synthetic users as ``configs/digits_users.yaml`` (126 users of 10 consecutive
train examples, shuffled), logistic regression, 300 steps, δ = 1e-5, 95 % confidence:

* **user-level**: ``privacy_unit="user"``, k = 10 examples per user, B_u = 13 users a step (q_u = 13/126);
  each gradient canary is a user, Poisson-sampled at q_u, adding one user's sensitivity C; the claim is
  the ledger's user-level ε;
* **example-level**: DP-SGD, batch 128 of N = 1,257 (q = 128/1257, about q_u), at the same claimed ε;
* **user-level, bug** (``--bug``, on by default): the user-level run with a planted bug, its ledger pricing
  each step at B_u / N (the rate over examples, spec pitfall P1) while users are drawn at q_u: it claims
  far less than it spends, and is caught where the audited bound exceeds that claim.

For each target ε: the ledger's claim, the audited lower bound, mean ± std over seeds (strategy seeds 0…,
canary seeds 1000…), its ratio to the claim, and in how many seeds the audit failed the run (bound > claim). The seed fixes the initialisation, sampling, noise and canaries (a benchmark).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from _harness import trainer_kwargs
from lightning.pytorch import Trainer

from lightning_dp import DPStrategy, PrivacyCallback, UserPoisson
from lightning_dp.accounting import PoissonGaussian
from lightning_dp.commands.audit import audit
from recipes import DigitsDataModule, ImageClassifier

STEPS, DELTA, K, USERS_PER_STEP = 300, 1e-5, 10, 13


class ExampleRateLedger(UserPoisson):
    """The planted bug: users drawn at q_u = B_u / U, each step priced at B_u / N (over examples)."""

    def event(self, noise_multiplier: float) -> PoissonGaussian:
        assert self.users is not None
        rate = self.users_per_step / len(self.users.user_of_example)
        return PoissonGaussian(noise_multiplier=noise_multiplier, sample_rate=rate)


def strategy_for(run: str, epsilon: float, seed: int) -> DPStrategy:
    if run == "user, bug":
        sampler = ExampleRateLedger(
            user_key="user_id", examples_per_user=K, users_per_step=USERS_PER_STEP, seed=seed
        )
        return DPStrategy(target_epsilon=epsilon, delta=DELTA, sampler=sampler, seed=seed)
    if run == "user":
        users = UserPoisson(user_key="user_id", examples_per_user=K, users_per_step=USERS_PER_STEP, seed=seed)
        return DPStrategy(target_epsilon=epsilon, delta=DELTA, sampler=users, seed=seed)
    return DPStrategy(target_epsilon=epsilon, delta=DELTA, seed=seed)


def one(run: str, epsilon: float, m: int, seed: int) -> dict[str, Any]:
    """One audited run: the claimed ε (the ledger's, per user or per example) and the audited lower bound."""
    strategy = strategy_for(run, epsilon, seed)
    unit = run.split(",")[0]
    trainer = Trainer(
        **trainer_kwargs(strategy=strategy, max_steps=STEPS, callbacks=[PrivacyCallback(report=False)])
    )
    torch.manual_seed(seed)
    model = ImageClassifier(arch="logreg", in_features=64, lr=1.0, momentum=0.0, optimizer="sgd")
    batch = K * USERS_PER_STEP if unit == "user" else 128
    data = DigitsDataModule(batch_size=batch, flatten=True, users="shuffled")
    result = audit(trainer, model, data, num_canaries=m, seed=1000 + seed, write_report=False)
    assert result.privacy_unit == unit
    return {
        "claimed": result.claimed_epsilon,
        "bound": result.epsilon_lower_bound,
        "q": strategy.engine.sampler.sample_rate,
        "sigma": strategy.engine.last_noise_multiplier(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--canaries", type=int, default=1000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--bug", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning_dp"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    print(
        f"digits, 126 users of 10 (shuffled), {STEPS} steps, δ = {DELTA:g}, m = {args.canaries} white-box "
        f"canaries, 95% confidence, {args.seeds} seeds"
    )
    print(
        "| run | q | σ | target ε | claimed ε | audited ε ≥ (mean ± std) | max over seeds | audited / claimed "
        "| seeds failed |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    std = statistics.stdev if args.seeds > 1 else (lambda _: 0.0)
    for epsilon in args.epsilons:
        for run in ("user", "example", "user, bug")[: 3 if args.bug else 2]:
            start = time.time()
            runs = [one(run, epsilon, args.canaries, seed) for seed in range(args.seeds)]
            bounds = [r["bound"] for r in runs]
            claimed = statistics.mean(r["claimed"] for r in runs)
            failed = sum(r["bound"] > r["claimed"] for r in runs)
            print(
                f"| {run} | {runs[0]['q']:.4f} | {runs[0]['sigma']:.3f} | {epsilon:g} | {claimed:.3f} | "
                f"{statistics.mean(bounds):.3f} ± {std(bounds):.3f} | {max(bounds):.3f} | "
                f"{statistics.mean(bounds) / claimed:.2f} | {failed}/{len(runs)} |  <!-- {time.time() - start:.0f} s -->",
                flush=True,
            )


if __name__ == "__main__":
    main()
