"""Correlated noise against DP-SGD on a user's model: same ε, same steps, same batch, several seeds.

Each row swaps the sampler and noise slots of the tuned DP-SGD config (``tests/mechanism_runs.py``:
Tramèr & Boneh's MNIST CNN, plain SGD at DP-SGD's tuned lr, batch 512, C = 0.1, 3 epochs: a CPU budget,
not the paper's 40; or the digits MLP) for ``CyclicPoisson(bands="auto") + BandMF()`` (or BLT), nothing
else. It prints test accuracy (mean ± std over seeds), the ε spent, the b that "auto" chose with the
predicted prefix-sum RMSE ratio to DP-SGD, the measured one-run wall time as a ratio to DP-SGD's, and the
run-time warnings.

    LIGHTNING_DP_DATA=../shared/data OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/correlated_noise.py \
        --models mnist_cnn --eps 1 3 --seeds 0 1 2
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/correlated_noise.py --models digits --eps 1 3 --rows DP-SGD BandMF BLT
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from mechanism_runs import MECHANISMS, MODELS, run

from lightning_dp import BLT, BandMF, CyclicPoisson

SEED = [0]
MADE: list[Any] = []


def _slots(noise_class: type) -> Any:
    def arguments(lr: float) -> dict[str, Any]:
        del lr
        sampler, noise = CyclicPoisson(bands="auto", seed=SEED[0]), noise_class()
        MADE.append(noise)
        return {"sampler": sampler, "noise": noise}

    return arguments


ROWS = {
    "DP-SGD": "DP-SGD",
    "BandMF": "CyclicPoisson(bands='auto') + BandMF()",
    "BLT": "CyclicPoisson(bands='auto') + BLT()",
}
MECHANISMS[ROWS["BandMF"]] = (_slots(BandMF), None, None)
MECHANISMS[ROWS["BLT"]] = (_slots(BLT), None, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mnist_cnn"], choices=list(MODELS))
    parser.add_argument("--eps", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=None, help="override every model's epochs")
    parser.add_argument("--rows", nargs="+", default=["DP-SGD", "BandMF"], choices=list(ROWS))
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    for model in args.models:
        for epsilon in args.eps:
            epochs = args.epochs or MODELS[model].epochs
            lr = MODELS[model].lr(epsilon)
            print(
                f"\n{model}, {epochs} epochs, lr {lr:g}, target ε {epsilon:g}, seeds {args.seeds}", flush=True
            )
            table = []
            base_time = None
            for row in args.rows:
                accs, eps, seconds, notes, said = [], [], [], set(), set()
                for seed in args.seeds:
                    SEED[0] = seed
                    MADE.clear()
                    start = time.perf_counter()
                    result = run(model, ROWS[row], seed, epsilon, args.epochs, lr)
                    seconds.append(time.perf_counter() - start)
                    accs.append(result.accuracy)
                    eps.append(result.epsilon)
                    said |= set(result.said)
                    if MADE:
                        report = MADE[-1].report()
                        ratio = report["predicted_rmse_vs_dpsgd"]
                        notes.add(f"b={report['bands']}, predicted RMSE {ratio:.3f}×")
                    print(f"  {row} seed {seed}: {result.accuracy:.4f}, ε {result.epsilon:.4f}, "
                          f"{seconds[-1]:.0f} s {sorted(notes)}", flush=True)  # fmt: skip
                mean_time = statistics.mean(seconds)
                base_time = base_time or mean_time
                std = statistics.stdev(accs) if len(accs) > 1 else 0.0
                table.append(
                    f"| {ROWS[row]} | {statistics.mean(accs):.3f} ± {std:.3f} | {max(eps):.3f} | "
                    f"{'; '.join(sorted(notes)) or '—'} | ×{mean_time / base_time:.2f} | {'; '.join(sorted(said)) or '—'} |"
                )
            print("| `DPStrategy(...)` | test accuracy | ε spent | b (auto), predicted RMSE vs DP-SGD | "
                  "wall time vs DP-SGD | what lightning-dp said |")  # fmt: skip
            print("|---|---|---|---|---|---|")
            print("\n".join(table), flush=True)


if __name__ == "__main__":
    main()
