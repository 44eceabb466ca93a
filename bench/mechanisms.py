"""Every mechanism at its defaults on a user's model: one argument swapped into a tuned DP-SGD config.

The user's model is an ordinary 64-64-10 tanh MLP on scikit-learn's digits (SGD, lr 1.0, batch 128,
20 epochs, ``target_epsilon=3``, C = 1). Each row swaps one argument of ``DPStrategy`` and keeps the
rest; the table prints test accuracy (mean ± std over seeds), the ε spent, and the run-time warnings
lightning-dp emitted (what it told the user to change). Nothing is tuned per mechanism.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/mechanisms.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

from lightning import Trainer, seed_everything

from lightning_dp import (
    AdaCliP,
    AdaptiveGD,
    DPStrategy,
    HeavyBall,
    LineSearch,
    Nesterov,
    NoiseDividing,
)
from recipes import DigitsDataModule, ImageClassifier

FULL_BATCH = -1  # marker: the batch is the whole train split (q = 1)

#: name -> (the DPStrategy arguments swapped in, batch size and epochs when they differ from the user's).
#: A row after a mechanism's default row applies the fix its run-time message names.
MECHANISMS: dict[str, tuple[Callable[[], dict[str, Any]], int | None, int | None]] = {
    "DP-SGD": (dict, None, None),
    "LineSearch()": (lambda: {"step": LineSearch()}, None, None),
    "AdaCliP()": (lambda: {"clipping": AdaCliP()}, None, None),
    "AdaCliP(h2=1e-2)": (lambda: {"clipping": AdaCliP(h2=1e-2)}, None, None),
    "HeavyBall(beta=0.9)": (lambda: {"step": HeavyBall(beta=0.9)}, None, None),
    "Nesterov(momentum=0.9)": (lambda: {"step": Nesterov(momentum=0.9)}, None, None),
    "Nesterov(0.9) + NoiseDividing()": (
        lambda: {"step": Nesterov(momentum=0.9), "noise": NoiseDividing()},
        None,
        None,
    ),
    "Nesterov(0.9) + NoiseDividing(uniform=True)": (
        lambda: {"step": Nesterov(momentum=0.9), "noise": NoiseDividing(uniform=True)},
        None,
        None,
    ),
    "AdaptiveGD()": (lambda: {"step": AdaptiveGD()}, None, None),
    "AdaptiveGD(), full batch, max_epochs=-1": (lambda: {"step": AdaptiveGD()}, FULL_BATCH, -1),
}


def run(name: str, seed: int, epsilon: float, epochs: int) -> tuple[float, float, list[str]]:
    """Test accuracy, ε spent and the distinct lightning-dp warnings of one run."""
    seed_everything(seed, verbose=False)
    arguments, batch_size, row_epochs = MECHANISMS[name]
    model = ImageClassifier(arch="mlp", hidden=[64], activation="tanh", in_features=64, lr=1.0)
    data = DigitsDataModule(batch_size=128, flatten=True)
    if batch_size == FULL_BATCH:  # the whole train split in every batch: q = 1
        data.setup("fit")
        data.batch_size = len(data.train_set)
    epochs = row_epochs if row_epochs is not None else epochs
    strategy = DPStrategy(target_epsilon=epsilon, delta=1e-5, max_grad_norm=1.0, seed=seed, **arguments())
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(
            strategy=strategy,
            accelerator="cpu",
            max_epochs=epochs,
            default_root_dir=root,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(model, data)
        accuracy = float(trainer.test(model, data, verbose=False)[0]["test_acc"])
    said = sorted({str(w.message)[:90] for w in caught if "lightning_dp" in str(w.filename)})
    return accuracy, strategy.epsilon, said


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--only", nargs="*", default=None, help="mechanism names to run (default: all)")
    args = parser.parse_args()
    names = args.only or list(MECHANISMS)
    print(f"digits 64-64-10 tanh MLP, SGD lr 1.0, batch 128, {args.epochs} epochs, target ε {args.epsilon}")
    print("| `DPStrategy(...)` | test accuracy | ε spent | what lightning-dp said |")
    print("|---|---|---|---|")
    for name in names:
        results = [run(name, seed, args.epsilon, args.epochs) for seed in args.seeds]
        accs = [r[0] for r in results]
        std = statistics.stdev(accs) if len(accs) > 1 else 0.0
        eps = max(r[1] for r in results)
        said = "; ".join(sorted({s for r in results for s in r[2]})) or "—"
        print(f"| {name} | {statistics.mean(accs):.3f} ± {std:.3f} | {eps:.3f} | {said} |", flush=True)


if __name__ == "__main__":
    main()
