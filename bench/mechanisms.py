"""Every mechanism at its defaults on a user's model: one argument swapped into a tuned DP-SGD config.

Models (tests/mechanism_runs.py): the digits 64-64-10 tanh MLP (SGD, batch 128, 20 epochs, C = 1),
Tramèr & Boneh's MNIST CNN (SGD, batch 512, C = 0.1, 3 epochs here: a CPU budget, not the paper's 40)
and a text model (Embedding → GRU → Linear on recipes/text.py's sequence-direction task, SGD, batch 128,
15 epochs). The learning rate is DP-SGD's best at each ε (``mechanism_runs.TUNED_LR``; ``--lr`` overrides
it, which is how it was tuned: ``--only DP-SGD --lr 0.5``). Each row swaps one argument of ``DPStrategy``
and keeps the rest; the table prints test accuracy (mean ± std over seeds), the ε spent, and the
run-time warnings lightning-dp emitted (what it told the user to change). Nothing is tuned per mechanism.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/mechanisms.py --models digits --eps 1 3 --seeds 0 1 2
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/mechanisms.py --models text mnist_cnn --seeds 0
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from mechanism_runs import MECHANISMS, MODELS, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--eps", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=None, help="override every model's epochs")
    parser.add_argument("--lr", type=float, default=None, help="override the tuned learning rate")
    parser.add_argument("--only", nargs="*", default=None, help="mechanism names to run (default: all)")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    names = args.only or list(MECHANISMS)
    for model in args.models:
        for epsilon in args.eps:
            epochs = args.epochs or MODELS[model].epochs
            lr = args.lr if args.lr is not None else MODELS[model].lr(epsilon)
            print(f"\n{model}, {epochs} epochs, lr {lr:g}, target ε {epsilon:g}, seeds {args.seeds}")
            print("| `DPStrategy(...)` | test accuracy | ε spent | what lightning-dp said |")
            print("|---|---|---|---|")
            for name in names:
                results = [run(model, name, seed, epsilon, args.epochs, lr) for seed in args.seeds]
                accs = [r.accuracy for r in results]
                std = statistics.stdev(accs) if len(accs) > 1 else 0.0
                eps = max(r.epsilon for r in results)
                said = "; ".join(sorted({s for r in results for s in r.said})) or "—"
                print(
                    f"| {name} | {statistics.mean(accs):.3f} ± {std:.3f} | {eps:.3f} | {said} |", flush=True
                )


if __name__ == "__main__":
    main()
