"""Step time and peak memory on the model zoo (tests/per_example/zoo.py): plain vs lightning-dp vs Opacus.

Each zoo model (tiny configurations, random weights) trains its own copy of the same initial model on
one fixed batch of ``--batch-size`` examples (zoo batches concatenated), in one process, on one CPU
thread. Variants run in interleaved rounds with the measuring helpers of ``bench/step_time.py``
(``run_step``, ``check_variant``, ``measure_peak``, ``schedule``), and the table reports medians:

* plain           forward (the zoo model returns its batch-mean loss), backward, ``optimizer.step()``
* lightning-dp    ``PrivateStepEngine`` (auto mode): forward, backward, ``privatize()``, ``apply_step``
* opacus hooks    ``PrivacyEngine().make_private(...)`` (Opacus's only mode for a model that computes
                  its own loss: ghost clipping needs the criterion outside the model); "n/a" with the
                  reason where Opacus refuses or fails on the model

``--realistic`` times the models of issue #31 at the widths users train instead
(``bench/realistic_models.py``: BERT and GPT-2 at d 256, ViT-S/8, ResNet-18 with GroupNorm and ConvNeXt-atto at
64 px, an LSTM(256), the bench MLP and CNN), each with its own batch; it prints each model's median
phases too, the load average, and keeps a slow variant to ``--budget`` seconds of timed steps (at least
``--min-rounds``), spread over the rounds so it stays interleaved.

Run from the repository root::

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/model_zoo.py [--models lstm,hf_bert] [--json out.json]
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/model_zoo.py --realistic --rounds 9 [--models bert,lstm]
"""

from __future__ import annotations

import os
import sys

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import copy
import gc
import hashlib
import json
import statistics
import time
import warnings
from typing import Any

import opacus
import torch
from opacus import PrivacyEngine
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from bench import step_time
from bench._harness import cpu_name
from bench.realistic_models import REALISTIC, Classify, RealisticModel
from bench.step_time import (
    LR,
    MAX_GRAD_NORM,
    SIGMA,
    Variant,
    _reason,
    check_variant,
    measure_peak,
    private_variant,
    run_step,
    schedule,
)
from lightning_dp.run.prepare import replace_batchnorm
from tests.per_example.zoo import ZOO, ZooModel

Batch = tuple[Tensor, ...]


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)


def build_plain(base: nn.Module, batch: Batch) -> Variant:
    model = copy.deepcopy(base)
    opt = _sgd(model)
    return Variant(
        "plain",
        [("fwd+bwd", lambda: model(*batch).backward()), ("update", opt.step)],
        zero=lambda: opt.zero_grad(set_to_none=True),
        params=[p for p in model.parameters() if p.requires_grad],
    )


def build_lightning_dp(base: nn.Module, batch: Batch) -> Variant:
    return private_variant(base, lambda model: lambda: model(*batch).backward(), len(batch[0]))


def build_opacus(base: nn.Module, batch: Batch) -> Variant:
    model = copy.deepcopy(base)
    loader = DataLoader(TensorDataset(*(t.cpu() for t in batch)), batch_size=len(batch[0]))
    gsm, dp_opt, _ = PrivacyEngine().make_private(
        module=model, optimizer=_sgd(model), data_loader=loader, noise_multiplier=SIGMA,
        max_grad_norm=MAX_GRAD_NORM, poisson_sampling=False,
    )  # fmt: skip
    return Variant(
        "opacus hooks",
        [("fwd+bwd", lambda: gsm(*batch).backward()), ("step", dp_opt.step)],
        zero=lambda: dp_opt.zero_grad(set_to_none=True),
        params=[p for p in model.parameters() if p.requires_grad],
    )


def build_opacus_ghost(base: nn.Module, batch: Batch) -> Variant:
    """Opacus's ghost clipping (its two backward passes); it needs the criterion outside the model, so it
    runs only on a :class:`~bench.realistic_models.Classify` model's body."""
    if not isinstance(base, Classify):
        raise TypeError("ghost clipping needs the loss outside the model")
    model = copy.deepcopy(base.body)
    loader = DataLoader(TensorDataset(*(t.cpu() for t in batch)), batch_size=len(batch[0]))
    gsm, dp_opt, criterion, _ = PrivacyEngine().make_private(
        module=model, optimizer=_sgd(model), data_loader=loader, noise_multiplier=SIGMA,
        max_grad_norm=MAX_GRAD_NORM, poisson_sampling=False, grad_sample_mode="ghost",
        criterion=nn.CrossEntropyLoss(),
    )  # fmt: skip
    return Variant(
        "opacus ghost",
        [("fwd+bwd", lambda: criterion(gsm(*batch[:-1]), batch[-1]).backward()), ("step", dp_opt.step)],
        zero=lambda: dp_opt.zero_grad(set_to_none=True),
        params=[p for p in model.parameters() if p.requires_grad],
    )


BUILDERS = {
    "plain": build_plain,
    "lightning-dp": build_lightning_dp,
    "opacus hooks": build_opacus,
    "opacus ghost": build_opacus_ghost,
}


def _load() -> str:
    """The 1, 5 and 15 minute load averages (the CPU is shared: a figure to read the table by)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def zoo_batch(entry: ZooModel, size: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    parts = [entry.batch(g) for _ in range(-(-size // len(entry.batch(torch.Generator())[0])))]
    return tuple(torch.cat(ts)[:size] for ts in zip(*parts, strict=True))


def bench_entry(entry: ZooModel | RealisticModel, args: argparse.Namespace) -> list[Variant]:
    torch.manual_seed(0)
    base = entry.build()
    if entry.on_batchnorm == "replace":
        replace_batchnorm(base)
    base.train()
    if isinstance(entry, RealisticModel):
        batch = entry.batch(torch.Generator().manual_seed(0))
    else:
        batch = zoo_batch(entry, args.batch_size)
    device = torch.device("cpu")
    variants = []
    for name in args.variants.split(","):
        build = BUILDERS[name]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                v = build(base, batch)
                check_variant(v, device)
        except Exception as err:  # a library that does not support this model: report, don't crash
            v = Variant(name, error=_reason(err))
        variants.append(v)
    live = [v for v in variants if v.error is None]
    plan = {}
    for v in live:
        times = [run_step(v, device, record=False) for _ in range(args.warmup)] or [0.0]
        count = min(args.rounds, max(args.min_rounds, int(args.budget / max(min(times), 1e-9))))
        plan[v.name] = schedule(args.rounds, count)
    gc.collect()
    gc.disable()
    try:
        for r in range(args.rounds):
            for v in live[r % len(live) :] + live[: r % len(live)]:
                if v.error is None and r in plan[v.name]:
                    try:
                        run_step(v, device, record=True)
                    except Exception as err:
                        v.error = _reason(err)
            gc.collect()
    finally:
        gc.enable()
    for v in live:
        v.rounds = len(v.times)
        if v.error is None and args.memory:
            v.peak_bytes = measure_peak(v, device)
    return variants


def rows(entry: ZooModel | RealisticModel, variants: list[Variant]) -> list[dict[str, Any]]:
    plain = next((v for v in variants if v.name == "plain" and v.times), None)
    plain_ms = statistics.median(plain.times) * 1e3 if plain else None
    plain_mb = plain.peak_bytes / 2**20 if plain and plain.peak_bytes else None
    out = []
    for v in variants:
        row: dict[str, Any] = {"model": entry.name, "variant": v.name}
        if v.error is not None or not v.times:
            row["error"] = v.error or "no timed rounds"
        else:
            ms = statistics.median(v.times) * 1e3
            mb = v.peak_bytes / 2**20 if v.peak_bytes is not None else None
            row.update(
                median_ms=ms,
                ratio=ms / plain_ms if plain_ms else None,
                peak_mb=mb,
                mem_ratio=mb / plain_mb if mb is not None and plain_mb else None,
                phases_ms={k: statistics.median(t) * 1e3 for k, t in v.phase_times.items()},
                rounds=len(v.times),
                paths=v.paths or None,
                conv_methods=_conv_methods(v),
            )
        out.append(row)
    return out


def _conv_methods(v: Variant) -> str | None:
    """lightning-dp's convolution methods (``conv_tuner.report()``): how many shapes, and a digest that two
    runs can compare (the methods are a function of the shapes, so it must not change between runs)."""
    grads = v.engine.grads if v.engine is not None else None
    if grads is None or not grads.conv_tuner.choices:
        return None
    text = json.dumps(grads.conv_tuner.report(), sort_keys=True)
    return f"{len(grads.conv_tuner.choices)} shapes, digest {hashlib.sha1(text.encode()).hexdigest()[:10]}"


def print_rows(table: list[dict[str, Any]], verbose: bool = False) -> None:
    print(f"{'model':<32}{'variant':<15}{'median ms':>10}{'× plain':>9}{'peak MB':>9}{'mem ×':>7}")
    for row in table:
        if "error" in row:
            print(f"{row['model']:<32}{row['variant']:<15}  n/a ({row['error']})")
            continue
        ratio = f"{row['ratio']:.2f}" if row["ratio"] else "n/a"
        mem = f"{row['mem_ratio']:.2f}" if row["mem_ratio"] else "n/a"
        peak = f"{row['peak_mb']:.2f}" if row["peak_mb"] is not None else "n/a"
        print(f"{row['model']:<32}{row['variant']:<15}{row['median_ms']:>10.2f}{ratio:>9}{peak:>9}{mem:>7}")
        if row.get("paths"):
            print(f"{'':<47}{row['paths']}")
        if row.get("conv_methods"):
            print(f"{'':<47}conv methods: {row['conv_methods']}")
        if row.get("phases_ms") and verbose:
            phases = ", ".join(f"{k} {v:.1f}" for k, v in row["phases_ms"].items())
            print(f"{'':<47}phases ms: {phases} (n={row['rounds']})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default=None, help="comma-separated model names (default: all)")
    parser.add_argument("--realistic", action="store_true", help="issue #31's models at realistic widths")
    parser.add_argument("--batch-size", type=int, default=32, help="the zoo's batch (not --realistic)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget", type=float, default=1e9, help="timed seconds per variant at most")
    parser.add_argument("--min-rounds", type=int, default=5)
    parser.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall",
        help="wall time, or the process's CPU time (all its threads; less inflated on a busy machine)",
    )  # fmt: skip
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak memory step")
    parser.add_argument(
        "--variants",
        default=None,
        help="comma-separated variants (default: all; the zoo: all but opacus ghost)",
    )
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.variants is None:
        args.variants = ",".join(v for v in BUILDERS if args.realistic or v != "opacus ghost")
    torch.set_num_threads(1)
    if args.clock == "cpu":
        step_time.CLOCK = time.process_time
    zoo: list[ZooModel] | list[RealisticModel] = REALISTIC if args.realistic else ZOO
    names = args.models.split(",") if args.models else [e.name for e in zoo]
    unknown = set(names) - {e.name for e in zoo}
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; choose from {[e.name for e in zoo]}")
    print(f"torch {torch.__version__}, opacus {opacus.__version__}, CPU {cpu_name()}, 1 thread; "
          f"{args.clock} clock; load average before: {_load()}")  # fmt: skip
    table: list[dict[str, Any]] = []
    for entry in (e for e in zoo if e.name in names):
        table.extend(rows(entry, bench_entry(entry, args)))
        if args.realistic:  # one model at a time: the long runs show progress
            print_rows(table[-len(args.variants.split(",")) :], verbose=True)
            print(f"  (load average: {_load()})", flush=True)
    print(f"load average after: {_load()}")
    print_rows(table, verbose=args.realistic)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
