"""MNIST CNN: iterations to reach a test accuracy for DP line search (DP-BLSGD, NN mode) vs DP-SGD vs DP-Adam.

Equal per-iteration privacy as in the paper (Sec. 5.7): every method gets the same noise multiplier z,
i.e. ρ_iter = 1/(2z²) per iteration; DP-SGD/DP-Adam spend it on the gradient, the line search splits it
90/10 between its gradient and one Laplace SVT search on its own Poisson batch. Test accuracy is measured
on the whole MNIST test set every ``--eval-every`` steps; a run stops when it reaches ``--target`` or
``--max-steps``. Also reported: ε (δ = 1e-5) at the step the target was reached, and the mean wall time
of a training step relative to DP-SGD's (the extra forwards of the search).

    OMP_NUM_THREADS=1 PYTHONPATH=. nice -n 10 .venv/bin/python bench/line_search_mnist.py --seeds 0 1
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from _harness import trainer_kwargs
from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_dp import DPStrategy, LineSearch
from recipes import ImageClassifier, MNISTDataModule

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]
METHODS = ("line search", "DP-SGD", "DP-Adam")


class Probe(Callback):
    """Test accuracy every ``every`` steps (stop at ``target``) and the wall time of each training step."""

    def __init__(self, test: tuple[torch.Tensor, torch.Tensor], every: int, target: float) -> None:
        self.x, self.y = test
        self.every, self.target = every, target
        self.reached: int | None = None
        self.curve: list[tuple[int, float]] = []
        self.step_times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.step_times.append(time.perf_counter() - self._start)
        step = trainer.strategy.engine.steps
        if step % self.every:
            return
        was_training = pl_module.training
        pl_module.eval()
        with torch.no_grad():
            correct = sum(
                int((pl_module(self.x[i : i + 2000]).argmax(1) == self.y[i : i + 2000]).sum())
                for i in range(0, len(self.y), 2000)
            )
        pl_module.train(was_training)
        accuracy = correct / len(self.y)
        self.curve.append((step, accuracy))
        print(f"  step {step}: test accuracy {accuracy:.4f}", flush=True)
        if accuracy >= self.target and self.reached is None:
            self.reached = step
            trainer.should_stop = True


def run(method: str, seed: int, args: argparse.Namespace, data: MNISTDataModule) -> dict[str, Any]:
    seed_everything(seed, verbose=False)
    if method == "DP-Adam":
        model = ImageClassifier(arch="tramer_boneh_cnn", activation="tanh", optimizer="adam", lr=1e-3)
    else:
        model = ImageClassifier(arch="tramer_boneh_cnn", activation="tanh", optimizer="sgd", lr=args.sgd_lr)
    step = None
    if method == "line search":
        step = LineSearch(mode="nn", seed=seed, eta0=args.ls_eta0, grad_fraction=args.ls_grad_fraction)
    strategy = DPStrategy(
        noise_multiplier=args.noise_multiplier,
        target_epsilon=args.budget,
        delta=1e-5,
        max_grad_norm=args.clip,
        step=step,
        seed=seed,
    )
    assert data.test_set is not None
    test_x = torch.stack([data.test_set[i][0] for i in range(len(data.test_set))])  # type: ignore[arg-type]
    test_y = torch.tensor([int(data.test_set[i][1]) for i in range(len(data.test_set))])  # type: ignore[arg-type]
    probe = Probe((test_x, test_y), args.eval_every, args.target)
    trainer = Trainer(
        **trainer_kwargs(
            strategy=strategy,
            max_steps=args.max_steps,
            max_epochs=-1,
            callbacks=[probe],
        )
    )
    trainer.fit(model, datamodule=data)
    times = probe.step_times[5:] or probe.step_times  # skip warm-up
    reached_eps = None
    if probe.reached is not None:
        reached_eps = strategy.epsilon
    return {
        "reached": probe.reached,
        "epsilon": reached_eps if reached_eps is not None else strategy.epsilon,
        "final_accuracy": probe.curve[-1][1] if probe.curve else math.nan,
        "step_time": statistics.median(times),
        "steps": strategy.engine.steps,
        "searches": step.stats if step is not None else None,
    }


def fmt(values: list[float]) -> str:
    if not values:
        return "n/a"
    mean = statistics.fmean(values)
    std = statistics.pstdev(values) if len(values) > 1 else 0.0
    return f"{mean:.0f} ± {std:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--noise-multiplier", type=float, default=1.0, help="z: ρ_iter = 1/(2z²)")
    parser.add_argument("--budget", type=float, default=None, help="optional ε stop (δ = 1e-5)")
    parser.add_argument("--clip", type=float, default=3.0, help="C_grad (the paper: 3)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--sgd-lr", type=float, default=0.2, help="DP-SGD's lr (the paper: 0.2)")
    parser.add_argument("--ls-eta0", type=float, default=1.0, help="line search: first candidate η0")
    parser.add_argument(
        "--ls-grad-fraction", type=float, default=0.9, help="line search: gradient share of ρ_iter"
    )
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--max-steps", type=int, default=1500)
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = MNISTDataModule(root=args.data, download=False, batch_size=args.batch_size)
    data.prepare_data()
    data.setup("fit")
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in args.methods}
    for seed in args.seeds:
        for method in args.methods:
            r = run(method, seed, args, data)
            results[method].append(r)
            print(
                f"seed {seed} {method:12s} reached {args.target:.0%} at step {r['reached']} "
                f"(ε={r['epsilon']:.3f}), last accuracy {r['final_accuracy']:.4f}, "
                f"step {1000 * r['step_time']:.1f} ms",
                flush=True,
            )
    print(
        f"\nMNIST CNN (tramer_boneh_cnn, tanh), batch {args.batch_size}, z = {args.noise_multiplier}, "
        f"C = {args.clip}, δ = 1e-5, seeds {args.seeds}, max {args.max_steps} steps"
    )
    print(
        f"| method | steps to {args.target:.0%} (mean ± std) | reached | ε at that step | step time × DP-SGD |"
    )
    print("|---|---|---|---|---|")
    base = (
        statistics.fmean(r["step_time"] for r in results.get("DP-SGD", [])) if "DP-SGD" in results else None
    )
    for method, runs in results.items():
        reached = [float(r["reached"]) for r in runs if r["reached"] is not None]
        eps = [r["epsilon"] for r in runs if r["reached"] is not None]
        ratio = statistics.fmean(r["step_time"] for r in runs) / base if base else math.nan
        eps_text = f"{statistics.fmean(eps):.3f}" if eps else "n/a"
        print(f"| {method} | {fmt(reached)} | {len(reached)}/{len(runs)} | {eps_text} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
