"""MNIST CNN: heavy ball (DP-SHB, ``HeavyBall(beta)``) vs plain DP-SGD at target ε, δ = 1e-5.

Tramèr & Boneh's end-to-end CNN (tanh, C = 0.1) trained through the real Lightning Trainer with
``DPStrategy`` (Poisson sampling, σ calibrated to the target ε over the planned steps). Three methods:

* DP-SGD: the default ``Step`` on ``torch.optim.SGD(lr, momentum=0)``;
* HB same effective step: ``HeavyBall(beta)`` with lr·(1 − β), i.e. the same effective step
  lr/(1 − β) as DP-SGD's lr (the smoothing reading of spec §2.2: same step, averaged noise);
* HB same lr: ``HeavyBall(beta)`` with DP-SGD's lr (effective step lr/(1 − β), 1/(1 − β) larger);
* DP-SGD lr/(1−β): plain DP-SGD at HB-same-lr's effective step, to separate "momentum" from "larger step".

Test accuracy on the 10,000 MNIST test images after the last epoch; ε is read from the ledger.

    OMP_NUM_THREADS=1 PYTHONPATH=. nice -n 5 .venv/bin/python bench/heavy_ball_mnist.py --seeds 0 1
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from _harness import fit_and_test
from lightning.pytorch import seed_everything

from lightning_dp import DPStrategy, HeavyBall
from recipes import ImageClassifier, MNISTDataModule

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]
METHODS = ("DP-SGD", "HB same effective step", "HB same lr", "DP-SGD lr/(1−β)")


def method_lr(method: str, args: argparse.Namespace) -> float:
    """The optimizer's lr of a method (HeavyBall reads it from there)."""
    if method == "HB same effective step":
        return float(args.lr * (1 - args.beta))
    if method == "DP-SGD lr/(1−β)":
        return float(args.lr / (1 - args.beta))
    return float(args.lr)


def run(
    method: str, epsilon: float, seed: int, args: argparse.Namespace, data: MNISTDataModule
) -> dict[str, Any]:
    """One training run; returns test accuracy, the ledger's final ε and the wall time."""
    seed_everything(seed, verbose=False)
    lr = method_lr(method, args)
    model = ImageClassifier(arch="tramer_boneh_cnn", activation="tanh", optimizer="sgd", lr=lr, momentum=0.0)
    step = (
        None if method.startswith("DP-SGD") else HeavyBall(beta=args.beta, step_size="paper")
    )  # α = the optimizer lr
    strategy = DPStrategy(target_epsilon=epsilon, delta=1e-5, max_grad_norm=args.clip, step=step, seed=seed)
    return fit_and_test(model, data, strategy, max_epochs=args.epochs)


def fmt(values: list[float]) -> str:
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * mean:.2f} ± {100 * std:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2.0, help="DP-SGD's lr (HB uses lr·(1−β) or lr)")
    parser.add_argument("--beta", type=float, default=0.9)
    parser.add_argument("--clip", type=float, default=0.1, help="C (Tramèr & Boneh: 0.1)")
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = MNISTDataModule(root=args.data, download=False, batch_size=args.batch_size)
    results: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for seed in args.seeds:
        for epsilon in args.epsilons:
            for method in args.methods:
                r = run(method, epsilon, seed, args, data)
                results.setdefault((method, epsilon), []).append(r)
                print(
                    f"seed {seed} ε={epsilon:g} {method:22s} test acc {r['accuracy']:.4f} "
                    f"ledger ε={r['epsilon']:.4f} σ={r['sigma']:.3f} steps {r['steps']} ({r['wall']:.0f} s)",
                    flush=True,
                )
    print(
        f"\nMNIST CNN (tramer_boneh_cnn, tanh), batch {args.batch_size}, {args.epochs} epochs, C = {args.clip}, "
        f"DP-SGD lr = {args.lr}, β = {args.beta}, δ = 1e-5, seeds {args.seeds}"
    )
    print(
        "| target ε | method | lr | effective step lr/(1−β) | test accuracy % (mean ± std) | final ε (ledger) | σ |"
    )
    print("|---|---|---|---|---|---|---|")
    for epsilon in args.epsilons:
        for method in args.methods:
            runs = results[(method, epsilon)]
            lr = method_lr(method, args)
            eff = lr if method.startswith("DP-SGD") else lr / (1 - args.beta)
            eps = max(r["epsilon"] for r in runs)
            print(
                f"| {epsilon:g} | {method} | {lr:g} | {eff:g} | {fmt([r['accuracy'] for r in runs])} "
                f"| {eps:.4f} | {runs[0]['sigma']:.3f} |"
            )


if __name__ == "__main__":
    main()
