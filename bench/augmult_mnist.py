"""MNIST CNN: augmentation multiplicity (De et al. 2022, §3.1) K = 1, 4, 16 vs plain DP-SGD at ε = 3.

Tramèr & Boneh's end-to-end CNN (tanh, C = 0.1, SGD) trained through the real Lightning Trainer with
``DPStrategy(target_epsilon=3, delta=1e-5, augmentation_multiplicity=K)`` (Poisson sampling, σ calibrated
to ε over the planned steps; ε does not depend on K). The train ``Dataset`` applies a random crop after
2-pixel padding (a shift of up to ±2 px each way, the De et al. style for small images; no flips, digits
are not mirror-symmetric), so the strategy's K calls per sampled index give K different views, and each
example's mean view gradient is clipped as one unit. Rows:

* ``DP-SGD (no aug)``: K = 1 on the unaugmented images, the plain DP-SGD reference;
* ``K=1 aug``, ``K=4 aug``, ``K=16 aug``: the augmented ``Dataset`` with K views per example.

Every run has the same σ, sampling rate, steps, batch and learning rate; a step of ``K`` costs about K
times a K = 1 step (``max_physical_batch_size`` bounds the rows per forward/backward). Test accuracy on the
10,000 MNIST test images after the last step, mean ± std over seeds, and the wall time of a fit.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/augmult_mnist.py --smoke        # 3 steps, one seed, ~30 s
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/augmult_mnist.py                # 3 seeds × 150 steps, ~25 min
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import datetime
import logging
import statistics
import subprocess
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _harness import cpu_name, fit_and_test
from lightning.pytorch import seed_everything
from torch.utils.data import Dataset

from lightning_dp import DPStrategy
from recipes import ImageClassifier, MNISTDataModule

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]
# (label, K, augmented)
RUNS = {
    "DP-SGD (no aug)": (1, False),
    "K=1 aug": (1, True),
    "K=4 aug": (4, True),
    "K=16 aug": (16, True),
}


class RandomCrop(Dataset):
    """``base``'s images padded by ``pad`` pixels of background and cropped back at a random offset.

    The draw happens in ``__getitem__`` (torch's global generator, seeded by ``seed_everything``), so each
    call gives a new view: what augmentation multiplicity needs from the ``Dataset``.
    """

    def __init__(self, base: Dataset, pad: int, background: float) -> None:
        self.base = base
        self.pad = pad
        self.background = background

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.base[index]
        h, w = x.shape[-2:]
        padded = F.pad(x, (self.pad,) * 4, value=self.background)
        i, j = torch.randint(0, 2 * self.pad + 1, (2,)).tolist()
        return padded[..., i : i + h, j : j + w], y


def run(
    label: str,
    seed: int,
    args: argparse.Namespace,
    data: MNISTDataModule,
    plain_set: Dataset,
    aug_set: Dataset,
) -> dict[str, Any]:
    """One fit and test; returns test accuracy, the ledger's ε, σ, the steps and the fit's wall time."""
    views, augmented = RUNS[label]
    data.train_set = aug_set if augmented else plain_set
    seed_everything(seed, verbose=False)
    model = ImageClassifier(
        arch="tramer_boneh_cnn", activation="tanh", optimizer="sgd", lr=args.lr, momentum=0.0
    )
    strategy = DPStrategy(
        target_epsilon=args.epsilon,
        delta=1e-5,
        max_grad_norm=args.clip,
        augmentation_multiplicity=views,
        max_physical_batch_size=args.max_physical_batch_size,
        seed=seed,
    )
    return fit_and_test(
        model, data, strategy, max_steps=args.steps, max_epochs=-1, limit_test_batches=args.limit_test_batches
    )


def mean_std(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{scale * mean:.{digits}f} ± {scale * std:.{digits}f}"


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        return out.stdout.strip() or "?"
    except OSError:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument(
        "--steps", type=int, default=150, help="optimizer steps per run (σ is calibrated to them)"
    )
    parser.add_argument("--batch-size", type=int, default=256, help="expected (Poisson) batch, in examples")
    parser.add_argument("--max-physical-batch-size", type=int, default=512, help="rows per forward/backward")
    parser.add_argument("--lr", type=float, default=2.0)
    parser.add_argument("--clip", type=float, default=0.1, help="C (Tramèr & Boneh: 0.1)")
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--pad", type=int, default=2, help="padding of the random crop, in pixels")
    parser.add_argument("--limit-test-batches", type=float, default=1.0)
    parser.add_argument(
        "--data", default=os.environ.get("LIGHTNING_DP_DATA", str(ROOT.parent / "shared" / "data"))
    )
    parser.add_argument(
        "--smoke", action="store_true", help="3 steps, one seed, 2 test batches: checks the script"
    )
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.seeds, args.limit_test_batches = 3, args.seeds[:1], 2
    torch.set_num_threads(1)
    data = MNISTDataModule(root=args.data, download=False, batch_size=args.batch_size)
    data.setup()
    plain_set = data.train_set
    assert plain_set is not None
    background = float(plain_set[0][0].min())  # a black pixel after the public normalisation
    aug_set = RandomCrop(plain_set, args.pad, background)
    n_train = len(plain_set)  # type: ignore[arg-type]
    started = datetime.datetime.now(datetime.timezone.utc)
    print(
        f"MNIST CNN (tramer_boneh_cnn, tanh), {n_train} train examples, expected batch {args.batch_size} "
        f"(q = {args.batch_size / n_train:.5f}), {args.steps} steps (≈ {args.steps * args.batch_size / n_train:.2f} "
        f"epochs), C = {args.clip}, SGD lr = {args.lr}, ε = {args.epsilon:g}, δ = 1e-5, "
        f"max_physical_batch_size = {args.max_physical_batch_size}, random crop pad {args.pad} px, "
        f"seeds {args.seeds}; commit {commit()}, {cpu_name()}, one thread, {started:%Y-%m-%d %H:%M} UTC",
        flush=True,
    )
    results: dict[str, list[dict[str, Any]]] = {}
    for seed in args.seeds:
        for label in args.runs:
            r = run(label, seed, args, data, plain_set, aug_set)
            results.setdefault(label, []).append(r)
            print(
                f"seed {seed} {label:16s} test acc {r['accuracy']:.4f} ledger ε={r['epsilon']:.4f} "
                f"σ={r['sigma']:.4f} steps {r['steps']} fit {r['wall']:.0f} s",
                flush=True,
            )
    print(
        "\n| run | K | augmentation | test accuracy % (mean ± std) | per seed | ε (ledger) | σ | fit wall time, s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label in args.runs:
        runs = results[label]
        views, augmented = RUNS[label]
        accs = [r["accuracy"] for r in runs]
        per_seed = ", ".join(f"{100 * a:.2f}" for a in accs)
        print(
            f"| {label} | {views} | {'crop ±' + str(args.pad) + ' px' if augmented else 'none'} "
            f"| {mean_std(accs, 100)} | {per_seed} | {max(r['epsilon'] for r in runs):.4f} "
            f"| {runs[0]['sigma']:.4f} | {mean_std([r['wall'] for r in runs], digits=0)} |"
        )
    elapsed = datetime.datetime.now(datetime.timezone.utc) - started
    print(f"\ntotal {elapsed.total_seconds() / 60:.1f} min")


if __name__ == "__main__":
    main()
