"""What the run-time checks cost: whole fits with the checks off, at their default, every step, and with
isolated examples, interleaved, on the same models and data (issue #28: default overhead ≤ 5 %; issue #36:
the stronger check, which changes half the batch and compares by value, at B = 8, 256 and 1024).

Each row times a fit of ``--steps`` steps (set-up included, so the first batch's check and the structure
probe are counted), repeated ``--repeats`` times with the settings interleaved; the table gives the median
fit time, its ratio to the checks-off fit, the share of the fit spent inside the checks (timed directly:
fit times move by a few % between identical runs on a shared machine), and how many batches the mixing
check looked at. Isolation is not a check: its cost is the ratio.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/check_overhead.py            # ~6 min on 2 CPU cores
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/check_overhead.py --quick    # ~2 min
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/check_overhead.py --models "MLP B=8" \
        "MLP 784-1000-10" "MLP B=1024" --settings off "every step"                  # by batch size
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bench._harness import cpu_name, trainer_kwargs
from lightning_dp import Checks, DPStrategy
from lightning_dp.checks import RunChecks
from lightning_dp.per_example.capture import GradientCapture

UNTRACED = "untraced"

SETTINGS: dict[str, dict[str, Any]] = {
    "off": {"checks": Checks(sensitivity=False)},
    "default (sampled, 5 %)": {},
    "every step": {"checks": Checks(sensitivity="every_step")},
    "isolate_examples": {"checks": Checks(isolate_examples=True, sensitivity=False)},
    "default, untraced": {UNTRACED: True},
}
"""``UNTRACED``: the default with the step's tensor operations not traced (issue #46's ``per_example.uses``),
to measure what the tracing costs; not a user setting (untraced, uses outside the layers are refused)."""


class Model(LightningModule):
    def __init__(self, net: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> None:
        super().__init__()
        self.net, self.x, self.y, self.batch_size = net, x, y, batch_size

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)


def mlp(batch_size: int = 256, n: int = 4096) -> Model:
    """The bench MLP: 784-1000-10, batch 256 (or ``batch_size``), on ``n`` examples (16 batches an epoch;
    ``n`` = 60000: MNIST's 234, where the first batch of every epoch is checked about as often as the
    budget checks others)."""
    g = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Linear(784, 1000), nn.ReLU(), nn.Linear(1000, 10))
    return Model(net, torch.randn(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g), batch_size)


def cnn() -> Model:
    """Tramèr & Boneh's MNIST CNN (tanh, GroupNorm-free), batch 256."""
    g = torch.Generator().manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 16, 8, 2, padding=3), nn.Tanh(), nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, 2), nn.Tanh(), nn.MaxPool2d(2, 1),
        nn.Flatten(), nn.Linear(32 * 16, 32), nn.Tanh(), nn.Linear(32, 10),
    )  # fmt: skip
    return Model(
        net, torch.randn(4096, 1, 28, 28, generator=g), torch.randint(0, 10, (4096,), generator=g), 256
    )


def transformer() -> Model:
    """A 2-layer nn.TransformerEncoder classifier (d = 64, dropout 0.1) over 32 tokens, batch 64."""
    g = torch.Generator().manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(100, 64)
            layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(64, 10)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(self.embed(ids)).mean(1))

    return Model(
        Net(), torch.randint(0, 100, (2048, 32), generator=g), torch.randint(0, 10, (2048,), generator=g), 64
    )


MODELS: dict[str, Callable[[], Model]] = {
    "MLP 784-1000-10": mlp,
    "MNIST CNN": cnn,
    "Transformer d=64": transformer,
    "MLP B=8": lambda: mlp(8),
    "MLP B=1024": lambda: mlp(1024),
    "MLP N=60000": lambda: mlp(256, 60000),
}


_inside = [0.0]


def _timed(function: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        begin = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            _inside[0] += time.perf_counter() - begin

    return timed


# The time spent inside the checks, read directly (fit times differ by a few % between identical runs on a
# shared machine): every moment of lightning_dp/checks, the structure probe included.
RunChecks.before_user_code = _timed(RunChecks.before_user_code)  # type: ignore[method-assign]
RunChecks.before_release = _timed(RunChecks.before_release)  # type: ignore[method-assign]
RunChecks.after_step = _timed(RunChecks.after_step)  # type: ignore[method-assign]


def fit_seconds(build: Callable[[], Model], setting: dict[str, Any], steps: int) -> tuple[float, float, int]:
    """(fit seconds, seconds inside the checks, batches the mixing check looked at)."""
    seed_everything(0, verbose=False)
    module = build()
    setting = dict(setting)
    untraced = setting.pop(UNTRACED, False)
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, **setting)
    trainer = Trainer(strategy=strategy, max_steps=steps, **trainer_kwargs())
    _inside[0] = 0.0
    traced = GradientCapture.tracing
    if untraced:
        GradientCapture.tracing = lambda self: contextlib.nullcontext()  # type: ignore[method-assign]
    begin = time.perf_counter()
    try:
        trainer.fit(module)
    finally:
        GradientCapture.tracing = traced  # type: ignore[method-assign]
    return time.perf_counter() - begin, _inside[0], len(strategy.checks.mixing.checked_steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", nargs="*", default=list(MODELS)[:3])
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS))
    parser.add_argument("--quick", action="store_true", help="30 steps, 1 repeat, without isolation")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 30, 1
        args.settings = [s for s in args.settings if s != "isolate_examples"]
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_dp").setLevel(logging.ERROR)
    print(
        f"# {cpu_name()}, torch {torch.__version__}, {args.steps} steps a fit, {args.repeats} repeats, interleaved"
    )
    print("| model | checks | fit (s, median) | × off | time inside the checks | batches checked |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        times: dict[str, list[float]] = {s: [] for s in args.settings}
        shares: dict[str, list[float]] = {s: [] for s in args.settings}
        checked: dict[str, int] = {}
        for _ in range(args.repeats):
            for setting in args.settings:
                seconds, inside, count = fit_seconds(MODELS[name], SETTINGS[setting], args.steps)
                times[setting].append(seconds)
                shares[setting].append(inside / seconds)
                checked[setting] = count
        base = statistics.median(times["off"]) if "off" in times else float("nan")
        for setting in args.settings:
            median = statistics.median(times[setting])
            share = statistics.median(shares[setting])
            print(
                f"| {name} | {setting} | {median:.2f} | {median / base:.3f} | {share:.1%} | {checked[setting]} |"
            )


if __name__ == "__main__":
    main()
