"""Larger one-run privacy audits (Steinke, Nasr & Jagielski 2023) than CI can afford.

For each mechanism, claimed ε and canary kind: train a digits logistic regression with m canaries,
report the audited lower bound (mean ± std over seeds) next to the claimed ε, plus a run whose
noise is silently dropped (it must audit far above its claim).

    nice -n 10 python bench/audit.py --canaries 1000 --seeds 3
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from _harness import trainer_kwargs
from lightning.pytorch import Trainer

from lightning_dp import AdaCliP, ConstantNoise, DPStrategy
from lightning_dp.commands.audit import audit
from recipes import DigitsDataModule, ImageClassifier

MECHANISMS = {
    "dp-sgd": dict,
    "adaclip": lambda: {"clipping": AdaCliP(h1=1e-3, h2=1.0, init_std=0.1)},
}


class SilentNoise(ConstantNoise):
    """σ is priced but never added: the bug the audit must catch."""

    def add_noise(self, sums, std, generator):  # type: ignore[no-untyped-def]
        return sums


def one(mechanism: str, canary: str, epsilon: float, broken: bool, m: int, steps: int, seed: int) -> float:
    extra = MECHANISMS[mechanism]()
    if broken:
        extra["noise"] = SilentNoise()
    trainer = Trainer(
        **trainer_kwargs(strategy=DPStrategy(target_epsilon=epsilon, seed=seed, **extra), max_steps=steps)
    )
    torch.manual_seed(seed)
    model = ImageClassifier(arch="logreg", in_features=64, lr=8.0 if canary == "input" else 2.0)
    data = DigitsDataModule(batch_size=64, flatten=True)
    result = audit(trainer, model, data, canary=canary, num_canaries=m, seed=1000 + seed, write_report=False)
    return result.epsilon_lower_bound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--canaries", type=int, default=1000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0, 8.0])
    parser.add_argument("--mechanisms", nargs="+", default=sorted(MECHANISMS))
    parser.add_argument("--kinds", nargs="+", default=["gradient", "input"])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_dp").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    print(
        f"m = {args.canaries} canaries, 95% confidence, δ = 1e-5, {args.seeds} seeds, digits logreg, batch 64"
    )
    print(
        "| mechanism | canaries | steps | claimed ε | audited ε ≥ (mean ± std) | no-noise run audited ε ≥ |"
    )
    print("|---|---|---|---|---|---|")
    for mechanism in args.mechanisms:
        for kind in args.kinds:
            steps = 300 if kind == "input" else 100
            for eps in args.epsilons:
                start = time.time()
                ok = [one(mechanism, kind, eps, False, args.canaries, steps, s) for s in range(args.seeds)]
                bad = [one(mechanism, kind, eps, True, args.canaries, steps, s) for s in range(args.seeds)]
                std = statistics.stdev if args.seeds > 1 else lambda _: 0.0
                print(
                    f"| {mechanism} | {kind} | {steps} | {eps:g} | {statistics.mean(ok):.3f} ± {std(ok):.3f} "
                    f"| {statistics.mean(bad):.3f} ± {std(bad):.3f} |  <!-- {time.time() - start:.0f} s -->",
                    flush=True,
                )


if __name__ == "__main__":
    main()
