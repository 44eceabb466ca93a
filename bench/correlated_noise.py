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
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/correlated_noise.py --noise-cost   # the draw alone, side by side
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


def noise_cost(sizes: list[int], bands: list[int], steps: int = 30) -> None:
    """Seconds per step of drawing and adding the noise alone: BandMF(b) and BLT against DP-SGD's draw."""
    import torch

    from lightning_dp import ConstantNoise

    torch.set_num_threads(1)
    print(
        "| parameters d | DP-SGD draw (ms) | " + " | ".join(f"BandMF b={b}" for b in bands) + " | BLT m=2 |"
    )
    print("|---|---|" + "---|" * (len(bands) + 1))
    for d in sizes:

        def timed(noise: Any, d: int = d) -> float:
            sums = [torch.zeros(d)]
            generator = torch.Generator().manual_seed(0)
            noise.add_noise(sums, 1.0, generator)  # allocate the buffers
            start = time.perf_counter()
            for _ in range(steps):
                noise.add_noise(sums, 1.0, generator)
            return (time.perf_counter() - start) / steps

        base = timed(ConstantNoise(1.0))
        cells = []
        for b in [*bands, 0]:
            sampler = CyclicPoisson(b if b else 4, seed=0)
            sampler.bind(10**6, 10)
            sampler.horizon = 1000
            noise = (
                BandMF(1.0, coefficients=[1.0 / (j + 1) for j in range(b)])
                if b
                else BLT(1.0, [0.9, 0.5], [0.3, 0.1])
            )
            noise.link_sampler(sampler)
            noise.setup([torch.zeros(d)])
            cells.append(f"×{timed(noise) / base:.2f}")
        print(f"| {d:,} | {base * 1e3:.2f} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mnist_cnn"], choices=list(MODELS))
    parser.add_argument("--eps", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=None, help="override every model's epochs")
    parser.add_argument("--rows", nargs="+", default=["DP-SGD", "BandMF"], choices=list(ROWS))
    parser.add_argument("--noise-cost", action="store_true", help="time the noise draw alone (no training)")
    args = parser.parse_args()
    if args.noise_cost:
        noise_cost([26_010, 1_000_000, 10_000_000], [2, 4, 16, 64])
        return
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
