"""Private tuning on the embedded default: tuned at total ε = 3 vs the untuned default at ε = 3 vs naive composition.

    PYTHONPATH=. python bench/tuning_digits.py --seeds 3

Three ways to spend ε = 3 (δ = 1e-5) on scikit-learn's digits (configs/digits_dpsgd.yaml, logistic regression):

* **default**: one run with the config's learning rate 1.0 and clipping bound 1.0 at ε = 3;
* **tuned**: ``lightning_dp.tune`` with configs/digits_tune_search.yaml (lr log-uniform in [0.1, 4], clip in
  {0.25, 0.5, 1, 2}, K ~ Poisson(5), noisy validation accuracy with σ = 10), σ of each trial calibrated so the
  WHOLE search costs ε ≤ 3 (PS22 Thm 6);
* **naive**: the same number of trials on average (5), fixed and public, drawn from the same space, each
  trial and its noisy score priced by plain composition (σ calibrated so that 5 of them cost ε ≤ 3).

Prints the test accuracy of the released model for each, per seed and on average, and the σ each uses.
The seed fixes K and the draws of θ (a benchmark, not a private release); the DP noise is os.urandom.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--config", str(ROOT / "configs" / "digits_dpsgd.yaml")]
SEARCH = ROOT / "configs" / "digits_tune_search.yaml"
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


def test_accuracy(model: Any, datamodule: Any) -> float:
    """Accuracy of ``model`` on the digits test split (held out from training and from the tuner's score)."""
    from lightning_dp.commands.tuning.trials import count_correct

    datamodule.setup("test")
    correct, n = count_correct(model, datamodule.test_dataloader())
    return correct / n


def fit(args: list[str], directory: Path) -> tuple[Any, Any]:
    """One ordinary DPStrategy fit of the base config plus ``args``; returns (model, datamodule)."""
    from lightning_dp.commands.tuning.planning import instantiate_cli

    cli = instantiate_cli(
        [*BASE, *QUIET, *args, "--trainer.logger=false", f"--trainer.default_root_dir={directory}"]
    )
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli.model, cli.datamodule


def run_default(directory: Path) -> float:
    model, datamodule = fit([], directory)
    return test_accuracy(model, datamodule)


def run_tuned(seed: int, directory: Path, search: Path) -> tuple[float, float, dict[str, Any]]:
    """tune() at total ε = 3; returns (test accuracy of the released model, ε of the search, selected θ)."""
    import lightning_dp
    from recipes import DigitsDataModule, ImageClassifier

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = lightning_dp.tune(
            [*BASE, *QUIET, f"--trainer.logger.init_args.save_dir={directory / 'logs'}"],
            search,
            out_dir=directory / "tune",
            seed=seed,
        )
    if result.checkpoint is None:
        return math.nan, result.epsilon, {}
    model = ImageClassifier.load_from_checkpoint(result.checkpoint, weights_only=False)
    datamodule = DigitsDataModule(batch_size=128, flatten=True)
    assert result.selected is not None
    return test_accuracy(model, datamodule), result.epsilon, result.selected["overrides"]


def naive_sigma(trials: int, q: float, steps: int, score_sigma: float, target: float, delta: float) -> float:
    """Smallest σ (1e-3 rel.) with ``trials`` × (steps PoissonGaussian(σ, q) + one Gaussian(score_sigma)) ≤ target."""
    from lightning_dp.accounting import Gaussian, PoissonGaussian, PrivacyLedger

    def eps(sigma: float) -> float:
        ledger = PrivacyLedger(delta)
        for _ in range(trials):
            ledger.record(PoissonGaussian(sigma, q), steps)
            ledger.record(Gaussian(score_sigma))
        return ledger.epsilon()

    lo, hi = 0.5, 64.0
    while hi - lo > 1e-3 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if eps(mid) <= target else (mid, hi)
    return hi


def run_naive(seed: int, trials: int, sigma: float, directory: Path, search: Path) -> float:
    """``trials`` public trials from the same space at σ, noisy validation score, best released."""
    from lightning_dp.commands.tuning import load_search
    from lightning_dp.commands.tuning.planning import override_args
    from lightning_dp.commands.tuning.trials import count_correct

    spec = load_search(search)
    rng = np.random.default_rng(10_000 + seed)
    best: tuple[float, Any, Any] | None = None
    for i in range(trials):
        theta = spec.space.sample(rng)
        model, datamodule = fit(
            [*override_args(theta), f"--trainer.strategy.init_args.noise_multiplier={sigma}"],
            directory / f"n{i}",
        )
        correct, n = count_correct(model, datamodule.val_dataloader())
        score = (correct + spec.score.noise_multiplier * rng.standard_normal()) / n
        if best is None or score > best[0]:
            best = (score, model, datamodule)
    assert best is not None
    return test_accuracy(best[1], best[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument(
        "--search", type=Path, default=SEARCH, help="the search file (default: the shipped one)"
    )
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    from lightning_dp.commands.tuning import load_search, plan

    spec = load_search(args.search)
    tuning_plan = plan([*BASE], spec)
    (row,) = tuning_plan.per_candidate()
    trials = round(spec.repetitions.mean)
    sigma_naive = naive_sigma(
        trials, row["sample_rate"], row["steps"], spec.score.noise_multiplier, 3.0, tuning_plan.delta
    )
    print(f"tuned: σ = {row['noise_multiplier']:.4f} per trial, ε of the search = {tuning_plan.epsilon:.4f}")
    print(f"naive composition of {trials} trials: σ = {sigma_naive:.4f} per trial; default: σ = 2.8281")
    rows: dict[str, list[float]] = {"default": [], "tuned": [], "naive": []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            directory = Path(tmp) / f"seed{seed}"
            rows["default"].append(run_default(directory / "default"))
            acc, eps, theta = run_tuned(seed, directory, args.search)
            rows["tuned"].append(acc)
            rows["naive"].append(run_naive(seed, trials, sigma_naive, directory / "naive", args.search))
            print(
                f"seed {seed}: default {rows['default'][-1]:.4f}, tuned {acc:.4f} (ε = {eps:.4f}, θ = {theta}), "
                f"naive {rows['naive'][-1]:.4f}",
                flush=True,
            )
    for name, values in rows.items():
        print(
            f"{name:8s} test accuracy at ε = 3: mean {np.nanmean(values):.4f} over {len(values)} seeds {values}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
