"""Kuru et al. (2020) Figs. 3-4: final F(x_T) − F* of DP-GD, DP-HB, DP-NAG, DP-MASG and the -opt variants.

L2-regularised logistic regression on the paper's synthetic data (n = 10⁵, d = 20, ``recipes.accelerated``),
ε = 1, T ∈ {100, 200, 500, 1000}, c ∈ {0.1, 1} (α = c/L), full batch and m = 10³, in both privacy modes:

* ``paper``:        pure ε-DP: ``FixedSize`` sampling without replacement, ``L1Clipping`` (C1 = 20, so
                    S1 = 40), ``NoiseDividing(privacy="paper")`` (Laplace of *scale* b), ``accountant="pure"``.
* ``gaussian_rdp``: (ε = 1, δ = 1e-6): ``Poisson`` sampling, ``FlatClipping`` (C2 = √20, the L2 bound of a
                    per-example gradient, so nothing is clipped in either mode), Gaussian noise with
                    σ_k from ``NoiseDividing()`` (a^{-1/4} shape, bisection on the RDP ledger).

Methods: DP-GD = ``HeavyBall(beta=0)``, DP-HB = ``HeavyBall(β_NAG)``, DP-NAG = ``Nesterov``, DP-MASG =
``MultiStageNesterov`` (p = 1, n_1 = ⌈√κ ln κ⌉), all with uniform budgets; DP-NAG-opt and DP-MASG-opt add
noise dividing and run T* ≤ T steps chosen by ``select_horizon`` (eq. 32, the paper's constants, E_0 = 10).

Every step is the library's own: a :class:`~lightning_dp.engine.PrivateStepEngine` holding the slot
objects and the ledger runs forward, backward, ``privatize()`` (clip, price, noise) and the step slot,
without a Trainer (a Trainer adds ~1 ms of overhead per step and nothing private). β for DP-HB and
DP-NAG is the NAG momentum (1 − √(αμ))/(1 + √(αμ)), as the authors' code.

Run from the repository root (``--workers`` processes split the cells; the runs of a cell share its
calibrated schedule)::

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/accelerated.py --runs 20 --workers 2
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import functools
import itertools
import json
import math
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_dp import (
    FixedSize,
    FlatClipping,
    HeavyBall,
    L1Clipping,
    MultiStageNesterov,
    Nesterov,
    NoiseDividing,
    Poisson,
)
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.noise.noise_dividing import select_horizon
from lightning_dp.steps.dp_accelerated import nag_momentum
from recipes.accelerated import LogRegProblem, paper_logreg_problem

METHODS = ("DP-GD", "DP-HB", "DP-NAG", "DP-MASG", "DP-NAG-opt", "DP-MASG-opt")
HORIZONS = (100, 200, 500, 1000)
E0, EPSILON, DELTA = 10.0, 1.0, 1e-6

#: The spec's readings (±30 %, log scale) of the paper's figures (authors' runs, Laplace with std b).
#: Fig. 3 is full batch, Fig. 4 m = 10³; None where the spec gives no reading.
PAPER: dict[tuple[str, float, str], tuple[float | None, ...]] = {
    ("full", 1.0, "DP-GD"): (10, 2, 0.04, 0.15),
    ("full", 1.0, "DP-NAG"): (0.015, 0.04, 0.3, 1.5),
    ("full", 1.0, "DP-HB"): (0.012, 0.045, 0.35, 1.5),
    ("full", 1.0, "DP-MASG"): (0.015, 0.015, 0.04, 0.07),
    ("full", 1.0, "DP-NAG-opt"): (0.006, 0.007, 0.007, 0.007),
    ("full", 1.0, "DP-MASG-opt"): (0.006, 0.006, 0.006, 0.006),
    ("full", 0.1, "DP-GD"): (25, 22, 18, 13),
    ("full", 0.1, "DP-NAG"): (3, 0.05, 0.1, 0.4),
    ("full", 0.1, "DP-HB"): (3, 0.05, 0.1, 0.4),
    ("full", 0.1, "DP-MASG"): (5, 3, 2, 1.2),
    ("full", 0.1, "DP-NAG-opt"): (3, 0.05, 0.02, 0.02),
    ("full", 0.1, "DP-MASG-opt"): (5, 5, 5, 5),
    ("m=1e3", 1.0, "DP-GD"): (None, None, 0.05, 0.17),
    ("m=1e3", 1.0, "DP-NAG"): (0.025, 0.09, 0.4, 1.6),
    ("m=1e3", 1.0, "DP-HB"): (0.025, 0.07, 0.4, 1.5),
    ("m=1e3", 1.0, "DP-MASG"): (0.025, 0.025, 0.05, 0.08),
    ("m=1e3", 1.0, "DP-NAG-opt"): (0.015, 0.015, 0.015, 0.015),
    ("m=1e3", 1.0, "DP-MASG-opt"): (0.012, 0.012, 0.012, 0.012),
    ("m=1e3", 0.1, "DP-GD"): (None, None, None, 13),
    ("m=1e3", 0.1, "DP-NAG"): (None, None, 0.12, 0.45),
    ("m=1e3", 0.1, "DP-HB"): (None, None, 0.12, 0.45),
    ("m=1e3", 0.1, "DP-MASG"): (None, None, None, 1.2),
    ("m=1e3", 0.1, "DP-NAG-opt"): (None, None, 0.025, 0.025),
    ("m=1e3", 0.1, "DP-MASG-opt"): (5, 5, 5, 5),
}


class LogReg(nn.Module):
    """x as a bias-free linear layer; the loss is the batch mean of softplus(−z uᵀx)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.net = nn.Linear(d, 1, bias=False)
        nn.init.constant_(self.net.weight, 10.0)


def make_step(method: str, alpha: float, problem: LogRegProblem) -> Any:
    beta = nag_momentum(alpha, problem.mu)
    if method == "DP-GD":
        return HeavyBall(beta=0.0)
    if method == "DP-HB":
        return HeavyBall(beta=beta, step_size="paper")  # the optimizer lr is the paper's α
    if method in ("DP-NAG", "DP-NAG-opt"):
        return Nesterov(momentum=beta, step_size="paper")
    return MultiStageNesterov(lr=alpha, mu=problem.mu, L=problem.smoothness)


def horizon(method: str, max_t: int, alpha: float, problem: LogRegProblem) -> int:
    """T* of eq. 32 for the -opt variants (the full-batch bound, as the authors' code), else T."""
    if not method.endswith("-opt"):
        return max_t
    step = make_step(method, alpha, problem)
    big_l = problem.smoothness
    if isinstance(step, MultiStageNesterov):
        weights: Callable[[int], np.ndarray] = step.noise_log_weights  # includes α_k(1 + α_k L)

        def log_a0(t: int) -> float:
            stages = step.stages(t)
            alphas = step.stage_lr(stages).astype(np.float64)
            return float(np.log1p(-np.sqrt(problem.mu * alphas)).sum() + (stages[-1] - 1) * math.log(2))
    else:
        log_q = math.log1p(-math.sqrt(alpha * problem.mu))
        const = math.log(alpha * (1 + alpha * big_l))

        def weights(t: int) -> np.ndarray:
            return (t - np.arange(1, t + 1)) * log_q + const

        def log_a0(t: int) -> float:
            return t * log_q

    n = len(problem.labels)
    return select_horizon(weights, log_a0, max_t, E0, problem.dim, 40.0, n, EPSILON)


def run_cell(
    problem: LogRegProblem, mode: str, batch: int, c: float, method: str, max_t: int, runs: int, seed: int
) -> dict[str, Any]:
    """``runs`` independent runs of one (mode, batch, c, method, T) cell; final gaps and the ledger's ε."""
    alpha = c / problem.smoothness
    steps = horizon(method, max_t, alpha, problem)
    n, d = problem.features.shape
    features, labels = problem.features.float(), problem.labels.float()
    gaps, epsilons, seconds = [], [], []
    sigmas: list[float] | None = None
    for run in range(runs):
        start = time.perf_counter()
        run_seed = seed + 1000 * run
        paper = mode == "paper"
        noise = NoiseDividing(
            privacy="paper" if paper else "gaussian_rdp", uniform=not method.endswith("-opt")
        )
        engine = PrivateStepEngine(
            sampler=FixedSize(seed=run_seed) if paper else Poisson(seed=run_seed),
            clipping=L1Clipping() if paper else FlatClipping(),
            noise=noise,
            step=make_step(method, alpha, problem),
            max_grad_norm=20.0 if paper else math.sqrt(d),
            delta=DELTA,
            target_epsilon=EPSILON,
            accountant="pure" if paper else "rdp",
            loss_reduction="mean",
            seed=run_seed,
        )
        model = LogReg(d)
        engine.attach(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=alpha, weight_decay=2 * problem.lam)
        engine.sampler.bind(n, batch)
        if sigmas is None:
            noise.calibrate(EPSILON, DELTA, engine.sampler, steps, engine.accountant)
            sigmas = noise.sigmas
        else:  # the schedule is deterministic given the cell: reuse it (calibration is the slow part)
            noise.sigmas, noise.horizon = list(sigmas), steps
        batches = iter(engine.sampler.batch_sampler(steps))
        for _ in range(steps):
            if batch == n:  # q = 1 (Poisson) or an n-subset of n (fixed size): every example, every step
                u, z = features, labels
            else:
                sampler = engine.sampler
                drawn = sampler.sample_indices() if isinstance(sampler, FixedSize) else next(batches)
                index = torch.as_tensor(drawn, dtype=torch.long)
                u, z = features[index], labels[index]
            loss = nn.functional.softplus(-z * model.net(u).squeeze(1)).mean()
            loss.backward()
            engine.privatize()
            engine.apply_step(optimizer)
            optimizer.zero_grad()
        finalize = getattr(engine.step_slot, "finalize", None)
        if callable(finalize):
            finalize(optimizer)
        gaps.append(problem.objective(model.net.weight.detach().double()) - problem.f_star)
        epsilons.append(engine.ledger.epsilon())
        seconds.append(time.perf_counter() - start)
        engine.detach()
    return {
        "mode": mode,
        "batch": batch,
        "c": c,
        "method": method,
        "T": max_t,
        "steps": steps,
        "gaps": gaps,
        "epsilon_max": max(epsilons),
        "seconds": sum(seconds),
    }


@functools.cache
def _problem() -> LogRegProblem:
    return paper_logreg_problem()


def _work(cell: tuple[str, int, float, str, int, int, int]) -> dict[str, Any]:
    torch.set_num_threads(1)
    return run_cell(_problem(), *cell)


def _fmt(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.3g}"


def print_tables(results: list[dict[str, Any]], n: int) -> None:
    by_key = {(r["mode"], r["batch"], r["c"], r["method"], r["T"]): r for r in results}
    batches = sorted({r["batch"] for r in results}, reverse=True)
    for batch, c in itertools.product(batches, sorted({r["c"] for r in results}, reverse=True)):
        label = "full" if batch == n else f"m=1e{round(math.log10(batch))}"
        print(f"\n### {label}, c = {c:g}: mean ± std of F(x_T) − F* over runs; paper's reading in [ ]\n")
        horizons = sorted({r["T"] for r in results})
        print("| mode | method | " + " | ".join(f"T={t}" for t in horizons) + " |")
        print("| --- | --- | " + " | ".join("---" for _ in horizons) + " |")
        for mode in ("paper", "gaussian_rdp"):
            for method in METHODS:
                cells = []
                for i, t in enumerate(horizons):
                    r = by_key.get((mode, batch, c, method, t))
                    if r is None:
                        cells.append("")
                        continue
                    mean = statistics.fmean(r["gaps"])
                    std = statistics.stdev(r["gaps"]) if len(r["gaps"]) > 1 else 0.0
                    text = f"{_fmt(mean)} ± {_fmt(std)}"
                    if r["steps"] != t:
                        text += f" (T*={r['steps']})"
                    reading = PAPER.get((label, c, method))
                    if mode == "paper" and reading is not None and HORIZONS.index(t) < len(reading):
                        text += f" [{_fmt(reading[HORIZONS.index(t)])}]"
                    cells.append(text)
                    del i
                print(f"| {mode} | {method} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--modes", default="paper,gaussian_rdp")
    parser.add_argument("--batches", default="100000,1000")
    parser.add_argument("--cs", default="1,0.1")
    parser.add_argument("--horizons", default="100,200,500,1000")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cells = [
        (mode, int(b), float(c), method, int(t), args.runs, args.seed)
        for mode in args.modes.split(",")
        for b in args.batches.split(",")
        for c in args.cs.split(",")
        for method in args.methods.split(",")
        for t in args.horizons.split(",")
    ]
    # Longest cells first so the pool's tail is short.
    cells.sort(key=lambda cell: -cell[4] * (1 + (cell[0] == "gaussian_rdp" and cell[3].endswith("-opt"))))
    start = time.perf_counter()
    problem = _problem()
    print(
        f"data: n={len(problem.labels)}, d={problem.dim}, L={problem.smoothness:.4f}, κ={problem.kappa:.2f}, "
        f"F(x0)−F*={problem.objective(torch.full((problem.dim,), 10.0)) - problem.f_star:.3f}; "
        f"{len(cells)} cells × {args.runs} runs, {args.workers} workers",
        flush=True,
    )
    results = []
    if args.workers > 1:
        with mp.get_context("fork").Pool(args.workers) as pool:
            for r in pool.imap_unordered(_work, cells):
                results.append(r)
                print(
                    f"  done {len(results)}/{len(cells)} {r['mode']} b={r['batch']} c={r['c']} {r['method']} "
                    f"T={r['T']} ({r['seconds']:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
    else:
        for cell in cells:
            results.append(_work(cell))
    print(
        f"wall time {time.perf_counter() - start:.0f} s; largest ledger ε over all runs: "
        f"{max(r['epsilon_max'] for r in results):.12f} (target {EPSILON})"
    )
    print_tables(results, len(problem.labels))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
