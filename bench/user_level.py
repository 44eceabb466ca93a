"""User-level DP on the digits: user-level sampling (ULS) vs example-level DP-SGD read per user (ELS) vs the
example-level demo, all at user-level ε = 3 where a user-level ε exists (spec §5.8, docs/user-level.md).

    PYTHONPATH=. python bench/user_level.py --seeds 3

scikit-learn's digits train split (N = 1,257) with synthetic users, consecutive runs of 10 train examples
(U = 126): ``label_sorted`` users (mostly one digit each, non-iid) and ``shuffled`` users (iid). Logistic
regression with the demo's learning rate, 300 steps, about 130 rows a step in every run:

* **ULS**: ``privacy_unit="user"``, k = 10 examples per user, B_u = 13 users a step, σ calibrated for
  user-level ε = 3 (2.859375, spec Table B);
* **ELS**: example-level Poisson, q = 128/1257, with the enforced bound ``max_examples_per_user=10`` and
  σ = 24.6484375 (spec Table E3: user-level ε ≈ 2.998 by the MoG PLD bound);
* **reference**: the example-level demo (example ε ≈ 2.99, σ ≈ 2.828), whose user-level ε at k = 10 is printed.

Prints per run the test accuracy (mean ± std over seeds, and the ratio to the reference), σ, the example- or
user-level ε from the ledger and the user-level ε statement. The seed fixes the initialisation, the sampling
and the noise (a benchmark, not a private release).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _harness import trainer_kwargs  # noqa: E402

STEPS, DELTA, K = 300, 1e-5, 10
ELS_SIGMA = 24.6484375  # spec Table E3: MoG PLD user-level ε ≈ 2.998 at k = 10 (v1 has no ELS target)


def strategy_for(run: str, seed: int) -> Any:
    from lightning_dp import DPStrategy, UserBound, UserPoisson

    if run == "ULS":
        users = UserPoisson(user_key="user_id", examples_per_user=K, users_per_step=13, seed=seed)
        return DPStrategy(target_epsilon=3.0, delta=DELTA, sampler=users, seed=seed)
    if run == "ELS":
        bound = UserBound(user_key="user_id", max_examples_per_user=K)
        return DPStrategy(noise_multiplier=ELS_SIGMA, delta=DELTA, user_bound=bound, seed=seed)
    return DPStrategy(target_epsilon=3.0, delta=DELTA, seed=seed)


def one_run(run: str, users: str, seed: int) -> dict[str, Any]:
    """Train one run for STEPS steps; its test accuracy, σ and ledger ε (user-level for ULS)."""
    from lightning import Trainer, seed_everything

    from lightning_dp import PrivacyCallback
    from recipes import DigitsDataModule, ImageClassifier

    seed_everything(seed, verbose=False)
    batch = 130 if run == "ULS" else 128
    data = DigitsDataModule(batch_size=batch, flatten=True, users=users)
    model = ImageClassifier(arch="logreg", in_features=64, lr=1.0, momentum=0.0, optimizer="sgd")
    strategy = strategy_for(run, seed)
    # the user-level statement is computed once per (σ, q, T) below, not in every run's report
    trainer = Trainer(strategy=strategy, max_steps=STEPS, max_epochs=-1,
                      callbacks=[PrivacyCallback(report=False)], **trainer_kwargs())  # fmt: skip
    trainer.fit(model, datamodule=data)
    tested = trainer.test(model, datamodule=data, verbose=False)[0]
    sampler = strategy.engine.sampler
    return {
        "accuracy": float(tested.get("test_acc", tested.get("test_accuracy", float("nan")))),
        "sigma": float(strategy.engine.last_noise_multiplier() or 0.0),
        "epsilon": strategy.epsilon,
        "sample_rate": sampler.sample_rate,
        "steps": strategy.engine.steps,
    }


def user_level_line(run: str, result: dict[str, Any]) -> str:
    """The user-level ε of the run: the ledger's for ULS, the group bounds at k = 10 for the others."""
    if run == "ULS":
        return f"{result['epsilon']:.4f} (RDP, exact)"
    from lightning_dp.accounting import PoissonGaussian, PrivacyLedger
    from lightning_dp.accounting.group import group_rdp_user_epsilon, mog_user_epsilon

    ledger = PrivacyLedger(delta=DELTA)
    ledger.record(PoissonGaussian(result["sigma"], result["sample_rate"]), count=result["steps"])
    mog = mog_user_epsilon(result["sigma"], result["sample_rate"], K, result["steps"], DELTA)
    group = group_rdp_user_epsilon(ledger, K, DELTA)
    return f"{'n/a' if mog is None else f'{mog:.4f}'} (MoG PLD), {group:.4f} (RDP group)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--users", nargs="+", default=["shuffled", "label_sorted"])
    parser.add_argument("--runs", nargs="+", default=["reference", "ULS", "ELS"])
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    print(f"digits, U = 126 synthetic users of 10, {STEPS} steps, δ = {DELTA:g}, {args.seeds} seeds")
    print(
        f"{'users':<13} {'run':<10} {'test accuracy':>16} {'× ref':>6} {'σ':>9} {'ledger ε':>9}  user-level ε"
    )
    for users in args.users:
        reference = None
        for run in args.runs:
            results = [one_run(run, users, seed) for seed in range(args.seeds)]
            accuracies = [r["accuracy"] for r in results]
            mean = statistics.fmean(accuracies)
            spread = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
            if run == "reference":
                reference = mean
            ratio = f"{mean / reference:.2f}" if reference else "—"
            first = results[0]
            print(
                f"{users:<13} {run:<10} {mean:>9.4f} ± {spread:.4f} {ratio:>6} {first['sigma']:>9.4f} "
                f"{first['epsilon']:>9.4f}  {user_level_line(run, first)}",
                flush=True,
            )


if __name__ == "__main__":
    main()
