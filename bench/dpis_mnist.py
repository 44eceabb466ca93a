"""DPIS vs DP-SGD on MNIST ScatterNet features (Tramèr & Boneh's CNN), next to the DPIS paper's Table 3.

Both methods train the same model on the same cached features (``recipes.scatternet``), with the same
batch, learning rate, clip bound and number of epochs, calibrated to the same (ε, δ = 1e-5); only the
sampler differs (``Poisson`` vs ``DPIS``). Test accuracy on the 10,000 test images, mean ± std over
seeds. The per-step cost of DPIS relative to a DP-SGD step is the ratio of training wall time per
step, averaged over whole epochs (so it includes DPIS's epoch-start norm pass and σ scheduler).

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/dpis_mnist.py --root ../shared/data            # full grid
    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/dpis_mnist.py --epsilons 1 --seeds 0 --epochs 2 # quick
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from _harness import trainer_kwargs
from lightning.pytorch import Trainer, seed_everything

from lightning_dp import DPIS, DPStrategy, Poisson, PrivacyCallback
from recipes import ImageClassifier, ScatterNetDataModule

PAPER_DPIS = {0.5: 96.8, 1.0: 97.7, 2.0: 98.6, 3.0: 98.8, 4.0: 98.9}
PAPER_HF = {0.5: 96.1, 1.0: 97.2, 2.0: 98.3, 3.0: 98.4, 4.0: 98.5}  # DP-SGD on the same features


def run_one(
    method: str, epsilon: float, seed: int, args: argparse.Namespace, data: ScatterNetDataModule
) -> dict:
    seed_everything(seed, verbose=False)
    model = ImageClassifier(
        arch="scatternet_cnn", in_features=81, activation="tanh", lr=args.lr, momentum=0.9, optimizer="sgd"
    )
    sampler = DPIS(k=args.k, a_E=args.a_E, seed=seed) if method == "dpis" else Poisson(seed=seed)
    strategy = DPStrategy(
        target_epsilon=epsilon, delta=1e-5, max_grad_norm=args.clip, sampler=sampler, seed=seed
    )
    epochs = epochs_for(epsilon, args)
    trainer = Trainer(
        **trainer_kwargs(
            max_epochs=epochs,
            strategy=strategy,
            callbacks=[PrivacyCallback(report=False)],
        )
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - start
    model.eval()
    x, y = data.test_set.tensors  # type: ignore[union-attr]
    with torch.no_grad():
        correct = sum(
            int((model(x[i : i + 2000]).argmax(1) == y[i : i + 2000]).sum()) for i in range(0, len(y), 2000)
        )
    out = {
        "method": method,
        "epsilon": epsilon,
        "seed": seed,
        "accuracy": 100.0 * correct / len(y),
        "spent_epsilon": strategy.epsilon,
        "steps": strategy.engine.steps,
        "seconds": seconds,
        "seconds_per_step": seconds / max(1, strategy.engine.steps),
        "config": {
            "epochs": epochs,
            "batch_size": data.batch_size,
            "lr": args.lr,
            "clip": args.clip,
            "k": args.k,
            "a_E": args.a_E,
        },
    }
    if method == "dpis":
        epochs = strategy.engine.sampler.epochs
        out["sigma_g"] = [round(e.sigma_g, 4) for e in epochs]
        out["r"] = [round(e.r, 4) for e in epochs]
    print(json.dumps(out), flush=True)
    return out


def epochs_for(epsilon: float, args: argparse.Namespace) -> int:
    """--epochs, or the count --epochs-for gives this ε."""
    table = {float(e): int(n) for e, n in (item.split(":") for item in args.epochs_for)}
    return table.get(epsilon, args.epochs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", default="data", help="MNIST folder (torchvision layout or MNIST/raw/*.gz)")
    parser.add_argument("--download", action="store_true")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=["dpsgd", "dpis"], choices=["dpsgd", "dpis"])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument(
        "--epochs-for",
        nargs="+",
        default=[],
        metavar="EPS:EPOCHS",
        help="per-ε epoch counts overriding --epochs, e.g. 0.5:10 4:30 (the paper tunes epochs per ε)",
    )
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2.0)
    parser.add_argument("--clip", type=float, default=0.1)
    parser.add_argument("--k", type=float, default=3)
    parser.add_argument("--a-E", dest="a_E", type=float, default=0.8)
    parser.add_argument("--json", help="append one JSON line per run to this file")
    parser.add_argument("--summarize", help="print the table from a --json file instead of training")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    results = []
    if args.summarize:  # only print the table of earlier runs (one JSON line each)
        seen: dict[tuple, dict] = {}
        with open(args.summarize) as fh:
            for line in filter(str.strip, fh):  # a repeated (method, ε, seed) counts once
                run = json.loads(line)
                seen.setdefault((run["method"], run["epsilon"], run["seed"]), run)
        results = list(seen.values())
        args.epsilons = sorted({r["epsilon"] for r in results})
        args.seeds = sorted({r["seed"] for r in results})
        for key, value in results[0].get("config", {}).items():
            setattr(args, key, value)
        args.batch_size = results[0].get("config", {}).get("batch_size", args.batch_size)
    else:
        data = ScatterNetDataModule(
            "mnist", root=args.root, download=args.download, batch_size=args.batch_size
        )
        data.setup()
        for seed in args.seeds:  # seed outermost: an interrupted grid still covers every ε
            for epsilon in args.epsilons:
                for method in args.methods:
                    result = run_one(method, epsilon, seed, args, data)
                    results.append(result)
                    if args.json:
                        with open(args.json, "a") as fh:
                            fh.write(json.dumps(result) + "\n")

    def epochs_of(epsilon: float) -> str:
        runs = {r["config"]["epochs"] for r in results if r["epsilon"] == epsilon and "config" in r}
        return ",".join(map(str, sorted(runs))) or str(epochs_for(epsilon, args))

    def cell(method: str, epsilon: float) -> str:
        accs = [r["accuracy"] for r in results if r["method"] == method and r["epsilon"] == epsilon]
        if not accs:
            return "-"
        std = statistics.stdev(accs) if len(accs) > 1 else 0.0
        return f"{statistics.mean(accs):.2f} ± {std:.2f} (n={len(accs)})"

    print(
        f"\nMNIST ScatterNet+CNN, b={args.batch_size}, C={args.clip}, lr={args.lr}, "
        f"k={args.k:g}, a_E={args.a_E:g}, seeds={args.seeds}, δ=1e-5"
    )
    print(
        f"{'ε':>5} | {'epochs':>6} | {'DPIS (ours)':>20} | {'DPIS (paper)':>12} | {'DP-SGD (ours)':>20} | "
        f"{'DP-SGD-HF (paper)':>17}"
    )
    for epsilon in args.epsilons:
        print(
            f"{epsilon:>5g} | {epochs_of(epsilon):>6} | {cell('dpis', epsilon):>20} | {PAPER_DPIS.get(epsilon, float('nan')):>12.1f} | "
            f"{cell('dpsgd', epsilon):>20} | {PAPER_HF.get(epsilon, float('nan')):>17.1f}"
        )
    per_step = {m: [r["seconds_per_step"] for r in results if r["method"] == m] for m in ("dpsgd", "dpis")}
    pairs = {(r["epsilon"], r["seed"]): {} for r in results}
    for r in results:
        pairs[(r["epsilon"], r["seed"])][r["method"]] = r["seconds_per_step"]
    ratios = [p["dpis"] / p["dpsgd"] for p in pairs.values() if len(p) == 2]
    if ratios:
        print(
            f"DPIS/DP-SGD time per step, paired (same ε and seed): median {statistics.median(ratios):.2f}x, "
            f"range {min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)} pairs"
        )
    if all(per_step.get(m) for m in ("dpis", "dpsgd")):
        ratio = statistics.mean(per_step["dpis"]) / statistics.mean(per_step["dpsgd"])
        print(
            f"\nwall time per step (mean over runs, whole epochs incl. DPIS's norm pass and scheduler): "
            f"DP-SGD {1e3 * statistics.mean(per_step['dpsgd']):.1f} ms, DPIS {1e3 * statistics.mean(per_step['dpis']):.1f} ms "
            f"-> DPIS/DP-SGD = {ratio:.2f}x (paper's scheme: about (k+1)x = {args.k + 1:g}x)"
        )


if __name__ == "__main__":
    sys.exit(main())
