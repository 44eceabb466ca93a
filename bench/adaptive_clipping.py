"""Can I skip tuning C? The clipping slots at their defaults against DP-SGD, a tuned C, a private search and Opacus.

At each ε of ``--epsilons`` (δ = 1e-5), ``--seeds`` seeds each, test accuracy mean ± std, on two tasks:

* ``digits``: the embedded default (configs/digits_dpsgd.yaml): logistic regression on scikit-learn's digits,
  1,257 training images, batch 128, SGD lr 1.0, 30 epochs (300 steps);
* ``mnist``: Tramèr & Boneh's CNN (tanh, 26,010 parameters) on a stated subset of MNIST: the first 6,000
  training images of the recipe's seeded split (5,000 held out for validation), the standard 10,000 test
  images, batch 256 (q = 0.0427), SGD with momentum 0.9 at lr 0.2 (DP-SGD's best at C = 1 and ε = 3 on the
  validation split among 0.05, 0.1, 0.2, 0.4: 79.2, 87.4, 90.8, 90.3 %, as a user tunes the learning rate
  first), 4 epochs (94 steps). Sized to keep the whole bench under an hour of one CPU core.

Methods, every one with the task's learning rate and optimizer:

* ``quantile``: ``QuantileClipping()`` (γ = 0.5, η = 0.2, C_0 = 0.1, σ_b = m/20; Andrew et al. 2021);
* ``auto``: ``AutoClipping()`` (r = 0.01, C = 1; Bu et al. 2023);
* ``dpsgd_c1``: DP-SGD at the library's default C = 1;
* ``dpsgd_tuned``: DP-SGD at the C of ``GRID`` that scores best on the validation split (one run per C at
  that ε, seed 100; the tuning runs are not charged to the budget, the usual convention: the honest price
  of that choice is the composition of all of them, stated beside the table);
* ``tune``: ``lightning_dp.tune`` over the same C grid (K ~ Poisson(5) trials, noisy validation accuracy,
  σ of each trial calibrated so that the WHOLE search costs the ε of the column; through the Trainer; on
  MNIST at ε = 3 only, to keep the bench's CPU time in bounds);
* ``opacus``: Opacus's ``AdaClipDPOptimizer`` (``make_private(clipping="adaptive")``) on the same model with
  the same defaults as ``quantile`` and the same σ (its count is not shifted by ½ and is divided by the
  realised batch size, so its accounting at that σ understates ε: the column is at the nominal ε).

Ours are driven through ``DPStrategy(...).engine`` without a Trainer (as bench/adaclip_mnist.py does; same
seed → same batches and noise); the search runs through the CLI and the Trainer, as a user runs it.

    OMP_NUM_THREADS=1 PYTHONPATH=. nice -n 15 .venv/bin/python bench/adaptive_clipping.py --log bench/adaptive_clipping.jsonl
    PYTHONPATH=. .venv/bin/python bench/adaptive_clipping.py --table bench/adaptive_clipping.jsonl
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json
import logging
import math
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_dp import AutoClipping, DPStrategy, QuantileClipping
from lightning_dp.slots import Clipping
from recipes.data import DigitsDataModule, MNISTDataModule
from recipes.models import logistic_regression, tramer_boneh_cnn

ROOT = Path(__file__).resolve().parents[1]
DELTA = 1e-5
EPSILONS = (1.0, 3.0, 8.0)
GRID = (0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
TUNING_SEED = 100
METHODS = ("quantile", "auto", "dpsgd_c1", "dpsgd_tuned", "tune", "opacus")
LABELS = {
    "quantile": "QuantileClipping() (defaults)",
    "auto": "AutoClipping() (defaults)",
    "dpsgd_c1": "DP-SGD, C = 1",
    "dpsgd_tuned": "DP-SGD, C tuned on validation",
    "tune": "lightning-dp tune over C (total ε)",
    "opacus": "Opacus AdaClipDPOptimizer (nominal ε)",
}


@dataclass(frozen=True)
class Task:
    name: str
    build: Callable[[], nn.Module]
    data: Callable[[str], Any]
    batch: int
    epochs: int
    lr: float
    momentum: float
    cli: Callable[[str, float], list[str]]
    """LightningCLI arguments of one trial at ε (for ``lightning_dp.tune``), given the MNIST root."""
    tune_epsilons: tuple[float, ...] = EPSILONS
    """The ε at which ``lightning_dp.tune`` runs (each search is K ≈ 5 Trainer fits)."""


def _digits_cli(root: str, eps: float) -> list[str]:
    del root
    return [
        "--config",
        str(ROOT / "configs/digits_dpsgd.yaml"),
        f"--trainer.strategy.init_args.target_epsilon={eps}",
    ]


def _mnist_cli(root: str, eps: float) -> list[str]:
    return [
        "--config", str(ROOT / "configs/mnist_dpsgd.yaml"), f"--trainer.strategy.init_args.target_epsilon={eps}",
        "--trainer.max_epochs=4", "--trainer.accelerator=cpu", "--model.init_args.lr=0.2",
        f"--data.init_args.root={root}", "--data.init_args.download=false", "--data.init_args.batch_size=256",
        "--data.init_args.train_size=6000", "--trainer.enable_checkpointing=false",
    ]  # fmt: skip


TASKS = {
    "digits": Task(
        "digits", lambda: logistic_regression(64, 10), lambda root: DigitsDataModule(batch_size=128, flatten=True),
        batch=128, epochs=30, lr=1.0, momentum=0.0, cli=_digits_cli,
    ),
    "mnist": Task(
        "mnist", lambda: tramer_boneh_cnn(activation="tanh"),
        lambda root: MNISTDataModule(root=root, batch_size=256, download=False, train_size=6000),
        batch=256, epochs=4, lr=0.2, momentum=0.9, cli=_mnist_cli, tune_epsilons=(3.0,),
    ),
}  # fmt: skip


def tensors(dataset: Dataset) -> tuple[Tensor, Tensor]:
    """The whole split as (inputs, labels)."""
    x, y = next(iter(DataLoader(dataset, batch_size=len(dataset))))  # type: ignore[arg-type]
    return x, y


def load(task: Task, root: str) -> dict[str, tuple[Tensor, Tensor]]:
    dm = task.data(root)
    dm.setup()
    return {"train": tensors(dm.train_set), "val": tensors(dm.val_set), "test": tensors(dm.test_set)}


@torch.no_grad()
def accuracy(model: nn.Module, data: tuple[Tensor, Tensor]) -> float:
    model.eval()
    return 100.0 * float((model(data[0]).argmax(1) == data[1]).float().mean())


def steps_of(task: Task, n: int) -> tuple[int, int]:
    """(batches per epoch, planned steps): the strategy's ⌈N/B⌉ per epoch."""
    per_epoch = math.ceil(n / task.batch)
    return per_epoch, per_epoch * task.epochs


def train_ours(
    task: Task, clipping: Clipping | None, clip: float, eps: float, seed: int, train: Any
) -> nn.Module:
    """The strategy's engine and slots, without a Trainer: Poisson batches, calibrated σ, the task's SGD."""
    torch.manual_seed(seed)
    model = task.build()
    strategy = DPStrategy(target_epsilon=eps, delta=DELTA, max_grad_norm=clip, clipping=clipping, seed=seed)
    engine = strategy.engine
    engine.attach(model)
    x, y = train
    engine.sampler.bind(len(y), task.batch)
    per_epoch, steps = steps_of(task, len(y))
    engine.noise.calibrate(eps, DELTA, engine.sampler, steps, engine.accountant)
    optimizer = torch.optim.SGD(model.parameters(), lr=task.lr, momentum=task.momentum)
    model.train()
    for _ in range(task.epochs):
        for idx in engine.sampler.batch_sampler(per_epoch):
            optimizer.zero_grad(set_to_none=True)
            if idx:
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                engine.privatize()
            else:  # an empty Poisson batch releases pure noise, as in the Trainer
                engine.noise_only_step()
            engine.apply_step(optimizer)
    engine.detach()
    assert engine.ledger.epsilon() <= eps * (1 + 1e-9), "the planned steps spend at most ε"
    return model


def sigma_for(task: Task, eps: float, n: int) -> float:
    """DP-SGD's calibrated σ for this task at ε (what the quantile run calls the combined z)."""
    strategy = DPStrategy(target_epsilon=eps, delta=DELTA)
    engine = strategy.engine
    engine.sampler.bind(n, task.batch)
    engine.noise.calibrate(eps, DELTA, engine.sampler, steps_of(task, n)[1], engine.accountant)
    return float(engine.noise.noise_multiplier(0))


def train_opacus(task: Task, eps: float, seed: int, train: Any) -> nn.Module:
    """Opacus's AdaClipDPOptimizer with QuantileClipping's defaults and DP-SGD's σ at ε."""
    from opacus import PrivacyEngine

    torch.manual_seed(seed)
    model = task.build()
    optimizer = torch.optim.SGD(model.parameters(), lr=task.lr, momentum=task.momentum)
    x, y = train
    loader = DataLoader(TensorDataset(x, y), batch_size=task.batch)
    private, optimizer, loader = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma_for(task, eps, len(y)),
        max_grad_norm=0.1, poisson_sampling=True, clipping="adaptive", target_unclipped_quantile=0.5,
        clipbound_learning_rate=0.2, max_clipbound=1e6, min_clipbound=1e-6, unclipped_num_std=task.batch / 20,
    )  # fmt: skip
    private.train()
    for _ in range(task.epochs):
        for xb, yb in loader:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(private(xb), yb).backward()
            optimizer.step()
    return private._module


def run_tune(
    task: Task, eps: float, seed: int, root: str, data: dict[str, Any]
) -> tuple[float, dict[str, Any]]:
    """``lightning_dp.tune`` over the C grid at total ε; (test accuracy of the released model, what was chosen)."""
    import lightning_dp
    from recipes import ImageClassifier

    search = {
        "repetitions": {"distribution": "poisson", "mean": 5},
        "candidates": {"trainer.strategy.init_args.max_grad_norm": {"choice": list(GRID)}},
        "score": {"source": "private_validation", "metric": "accuracy", "noise_multiplier": 10.0},
        "budget": {"target_epsilon": eps, "delta": DELTA},
    }
    quiet = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = [*task.cli(root, eps), *quiet, f"--trainer.logger.init_args.save_dir={tmp}/logs"]
        result = lightning_dp.tune(args, search, out_dir=Path(tmp) / "tune", seed=seed)
        if result.checkpoint is None:
            return math.nan, {"search_epsilon": result.epsilon}
        model = ImageClassifier.load_from_checkpoint(result.checkpoint, weights_only=False)
    assert result.selected is not None
    return accuracy(model, data["test"]), {"search_epsilon": result.epsilon, **result.selected["overrides"]}


# -- the phases --------------------------------------------------------------------------------------------


class Runs:
    """Every run as a row (task, method, ε, seed, C, accuracy, CPU seconds), appended to ``log`` as it ends;
    rows already in the log are not run again (an interrupted bench resumes)."""

    def __init__(self, log: str | None) -> None:
        self.log = Path(log) if log else None
        self.rows: list[dict] = []
        if self.log is not None and self.log.exists():
            self.rows = [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]

    def get(self, key: tuple) -> dict | None:
        return next(
            (r for r in self.rows if (r["task"], r["method"], r["epsilon"], r["seed"], r["clip"]) == key),
            None,
        )

    def run(self, key: tuple, train: Callable[[], tuple[float, dict[str, Any]]]) -> dict:
        row = self.get(key)
        if row is not None:
            return row
        start = time.process_time()
        acc, extra = train()
        task, method, eps, seed, clip = key
        row = {
            "task": task,
            "method": method,
            "epsilon": eps,
            "seed": seed,
            "clip": clip,
            "acc": acc,
            **extra,
        }
        row["cpu_s"] = time.process_time() - start
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        if self.log is not None:
            with self.log.open("a") as f:
                f.write(json.dumps(row) + "\n")
        return row


def tuned_clip(task: Task, eps: float, data: dict[str, Any], runs: Runs) -> float:
    """The grid's C with the best validation accuracy at ε (one run per C, seed TUNING_SEED)."""
    scores = []
    for clip in GRID:
        row = runs.run(
            (task.name, "grid", eps, TUNING_SEED, clip),
            lambda clip=clip: (
                accuracy(train_ours(task, None, clip, eps, TUNING_SEED, data["train"]), data["val"]),
                {},
            ),
        )
        scores.append((row["acc"], clip))
    return max(scores)[1]


def one_run(task: Task, method: str, eps: float, seed: int, clip: float, root: str, data: dict) -> Callable:
    """What ``Runs.run`` calls for one method: (test accuracy, extra fields of the row)."""
    if method == "tune":
        return lambda: run_tune(task, eps, seed, root, data)
    if method == "opacus":
        return lambda: (accuracy(train_opacus(task, eps, seed, data["train"]), data["test"]), {})
    clipping = {"quantile": QuantileClipping, "auto": AutoClipping}.get(method)
    return lambda: (
        accuracy(
            train_ours(task, clipping() if clipping else None, clip, eps, seed, data["train"]), data["test"]
        ),
        {},
    )


def run(args: argparse.Namespace) -> list[dict]:
    runs = Runs(args.log)
    for name in args.tasks:
        task = TASKS[name]
        data = load(task, args.root)
        for eps in args.epsilons:
            tuned = tuned_clip(task, eps, data, runs) if "dpsgd_tuned" in args.methods else 1.0
            for seed in range(args.seeds):
                for method in args.methods:
                    if method == "tune" and eps not in task.tune_epsilons:
                        continue
                    clip = tuned if method == "dpsgd_tuned" else 1.0
                    runs.run(
                        (name, method, eps, seed, clip),
                        one_run(task, method, eps, seed, clip, args.root, data),
                    )
    return runs.rows


# -- the table ---------------------------------------------------------------------------------------------------


def cell(values: list[float]) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.2f} ± {sd:.2f}"


def print_table(rows: list[dict]) -> None:
    """Per task: accuracy per method and ε, the gap of each default to the tuned C, the C chosen and the cost."""
    for name in dict.fromkeys(r["task"] for r in rows):
        task_rows = [r for r in rows if r["task"] == name]
        eps_list = sorted({r["epsilon"] for r in task_rows})
        seeds = len({r["seed"] for r in task_rows if r["method"] != "grid"})
        print(f"\n{name}: test accuracy % (mean ± std over {seeds} seeds), δ = {DELTA:g}")
        print("| method | " + " | ".join(f"ε = {e:g}" for e in eps_list) + " |")
        print("|---|" + "---|" * len(eps_list))
        means: dict[str, list[float]] = {}
        for method in METHODS:
            accs = [
                [r["acc"] for r in task_rows if r["method"] == method and r["epsilon"] == e] for e in eps_list
            ]
            if not any(accs):
                continue
            means[method] = [statistics.mean(a) if a else math.nan for a in accs]
            print(f"| {LABELS[method]} | " + " | ".join(cell(a) for a in accs) + " |")
        if "dpsgd_tuned" in means:
            for method in ("quantile", "auto", "dpsgd_c1", "tune", "opacus"):
                if method in means:
                    pairs = zip(means[method], means["dpsgd_tuned"], strict=True)
                    gap = ["n/a" if math.isnan(a - t) else f"{a - t:+.2f}" for a, t in pairs]
                    print(f"| {LABELS[method]} − tuned C | " + " | ".join(gap) + " |")
        chosen = [
            next(
                (r["clip"] for r in task_rows if r["method"] == "dpsgd_tuned" and r["epsilon"] == e), math.nan
            )
            for e in eps_list
        ]
        print("| C chosen on validation | " + " | ".join(f"{c:g}" for c in chosen) + " |")
        grid = [r for r in task_rows if r["method"] == "grid"]
        ours = [r for r in task_rows if r["method"] in ("quantile", "auto", "dpsgd_c1")]
        if grid and ours:
            per_run = statistics.mean(r["cpu_s"] for r in ours)
            print(
                f"tuning cost of the C grid {list(GRID)}: {len(GRID)} runs at each ε (≈ {len(GRID)}× the compute, "
                f"{len(GRID) * per_run:.0f} CPU s; and {len(GRID)} releases at ε each, not charged above)"
            )
        tuned = [r for r in task_rows if r["method"] == "tune"]
        if tuned:
            print(
                f"lightning-dp tune: {statistics.mean(r['cpu_s'] for r in tuned):.0f} CPU s per search (K ~ Poisson(5))"
            )
        print(f"CPU seconds in all: {sum(r['cpu_s'] for r in task_rows):.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--epsilons", nargs="+", type=float, default=list(EPSILONS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument(
        "--root", default=str(ROOT.parent / "shared" / "data"), help="the folder with MNIST/raw"
    )
    parser.add_argument(
        "--log", default=None, help="append every run here (JSON lines); runs already there are skipped"
    )
    parser.add_argument("--table", nargs="*", default=None, help="only print the table of these logs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_dp", "opacus"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if args.table is not None:
        rows = [json.loads(line) for path in args.table for line in Path(path).read_text().splitlines()]
    else:
        rows = run(args)
    print_table(rows)


if __name__ == "__main__":
    main()
