"""Calibrate the convolution cost model (``lightning_dp/per_example/kernels/conv_autotune.py``) and measure
how far its choices are from the fastest method.

For every convolution of the benchmark models (WRN-16-4, timm ResNet-18 with GroupNorm and ConvNeXt-atto
at 32 and 64 px, the MNIST CNN, ResNet-20; the core convolution where offsets are dead), every norm method
and every clipped-sum method (those within 10× the fewest multiply-adds of their kind) is timed on random inputs of ``--batch`` examples: this thread's CPU time,
the best of ``--repeats`` after a warm-up, fp32. Then, per method, the coefficients of the model's
features (``conv_autotune.features``) are fitted by non-negative least squares on the relative error, and
for each shape the method the model picks among those the memory budget allows is compared with the
fastest allowed one: the "regret" (picked time / fastest time). ``--fit`` prints the fitted table in the
form of ``CPU_COSTS``; the regret is reported for the shipped table and for the fitted one.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/conv_costs.py --json /tmp/conv_costs.json --fit
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/conv_costs.py --load /tmp/conv_costs.json --fit
"""

from __future__ import annotations

import os
import sys

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import functools
import json
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from scipy.optimize import nnls
from torch import nn

from bench._harness import cpu_name
from bench.step_time import resnet20
from bench.wide_resnet import wide_resnet
from lightning_dp.per_example.kernels import conv_autotune as tune
from lightning_dp.per_example.kernels.conv_methods import (
    CONV_METHODS,
    CONV_NORMS,
    CONV_SUMS,
    SUM_METHODS,
    live_taps,
)
from lightning_dp.per_example.precision import ieee_fp32
from recipes.models import tramer_boneh_cnn


def _models() -> list[tuple[nn.Module, tuple[int, ...]]]:
    import timm

    def gn(channels: int, **kwargs: Any) -> nn.Module:
        return nn.GroupNorm(32, channels)

    nets = [(wide_resnet(16, 4), (3, 32, 32)), (tramer_boneh_cnn(), (1, 28, 28)), (resnet20(), (3, 32, 32))]
    for size in (32, 64):
        nets.append((timm.create_model("resnet18", num_classes=10, norm_layer=gn), (3, size, size)))
        nets.append((timm.create_model("convnext_atto", num_classes=10), (3, size, size)))
    return nets


def conv_shapes() -> list[tuple[nn.Module, tuple[int, ...], tuple[int, ...]]]:
    """(convolution, input shape, output shape) without the batch, each distinct shape key once."""
    seen: dict[tuple[Any, ...], tuple[nn.Module, tuple[int, ...], tuple[int, ...]]] = {}
    for model, shape in _models():
        found: list[tuple[nn.Module, tuple[int, ...], tuple[int, ...]]] = []

        def keep(m: nn.Module, i: Any, o: Any, found: list[Any] = found) -> None:
            found.append((m, tuple(i[0].shape[1:]), tuple(o.shape[1:])))

        hooks = [
            m.register_forward_hook(keep) for m in model.modules() if isinstance(m, nn.Conv1d | nn.Conv2d)
        ]
        with torch.no_grad():
            model(torch.randn(1, *shape))
        for h in hooks:
            h.remove()
        for layer, x_shape, y_shape in found:
            seen.setdefault(tune._shape_key(layer, torch.empty(1, *x_shape)), (layer, x_shape, y_shape))
    return list(seen.values())


def _best_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return best


def measure(batch: int, repeats: int, every: bool = False) -> list[dict[str, Any]]:
    """Every method's time per example on every shape (the norm methods the memory budget allows, or all
    with ``every``; hopeless ones skipped), with what the model and the memory budget need to know."""
    records = []
    for layer, x_shape, y_shape in conv_shapes():
        g = torch.Generator().manual_seed(0)
        x, d = torch.randn(batch, *x_shape, generator=g), torch.randn(batch, *y_shape, generator=g)
        w = torch.rand(batch, generator=g) + 0.5
        live = live_taps(layer, x, d)
        core, cx = (layer, x) if live is None else (live.core, live.input(x))
        allowed = tune._candidates(layer, core, x, d, live is not None)
        record: dict[str, Any] = {"layer": repr(layer), "x": list(x_shape), "y": list(y_shape), "batch": batch,
                                  "cropped": live is not None, "allowed": allowed, "norms": {}, "sums": {}}  # fmt: skip
        runs: dict[str, Callable[[], Any]] = {
            **{m: functools.partial(CONV_NORMS[m], core, cx, d) for m in CONV_METHODS},
            **{m: functools.partial(CONV_SUMS[m], core, cx, d, w) for m in SUM_METHODS},
        }
        for kind, methods in (("norms", CONV_METHODS), ("sums", SUM_METHODS)):
            macs = {m: tune.features(m, core, cx.shape[1:], d.shape[1:])[0] for m in methods}
            for m in methods:
                # hopeless: 10× the work, or a correlation repeating the output gradients per input channel
                hopeless = macs[m] > 10 * min(macs.values()) or (
                    "correlate" in m and core.in_channels // core.groups > 8
                )
                if not hopeless and (kind == "sums" or every or m in allowed):
                    with ieee_fp32():
                        record[kind][m] = _best_time(runs[m], repeats) / batch
        record["features"] = {
            m: tune.features(m, core, cx.shape[1:], d.shape[1:]) for m in (*CONV_METHODS, *SUM_METHODS)
        }
        print(f"  {record['layer'][:70]} on {x_shape}: " + ", ".join(
            f"{m} {t * batch * 1e3:.1f}" for m, t in sorted({**record["norms"], **record["sums"]}.items())
        ) + " ms", flush=True)  # fmt: skip
        records.append(record)
    return records


def fit(records: list[dict[str, Any]]) -> dict[str, tuple[float, ...]]:
    """Per method, the non-negative coefficients minimising the relative error of the predicted times."""
    table = {}
    for method in (*CONV_METHODS, *SUM_METHODS):
        kind = "sums" if method in SUM_METHODS else "norms"
        rows = [(r["features"][method], r[kind][method]) for r in records if method in r[kind]]
        A = np.array([f for f, _ in rows], float)
        t = np.array([v for _, v in rows])
        coef, _ = nnls(A / t[:, None], np.ones(len(t)))
        table[method] = tuple(float(f"{c:.3g}") for c in coef)
        err = np.abs(A @ coef / t - 1)
        print(
            f"  {method:18s} {len(rows):3d} shapes, relative error median {np.median(err):.2f}, p90 {np.quantile(err, 0.9):.2f}"
        )
    return table


def regret(records: list[dict[str, Any]], table: dict[str, tuple[float, ...]]) -> dict[str, list[float]]:
    """Per kind, for each shape, the time of the model's pick over the fastest allowed method's."""
    out: dict[str, list[float]] = {"norms": [], "sums": []}
    for r in records:
        for kind, allowed in (("norms", r["allowed"]), ("sums", list(SUM_METHODS))):
            timed = {m: t for m, t in r[kind].items() if m in allowed}
            if not timed:
                continue
            cost = {
                m: math.fsum(c * f for c, f in zip(table[m], r["features"][m], strict=True)) for m in allowed
            }
            pick = min(allowed, key=lambda m: (cost[m], allowed.index(m)))
            out[kind].append(timed.get(pick, math.inf) / min(timed.values()))
    return out


def _summary(name: str, values: dict[str, list[float]]) -> None:
    for kind, ratios in values.items():
        finite = [v for v in ratios if math.isfinite(v)]
        worst = max(ratios) if ratios else math.nan
        print(f"  {name} {kind}: {len(ratios)} shapes, regret median {statistics.median(finite):.3f}, "
              f"mean {statistics.fmean(finite):.3f}, within 10 % on {sum(v <= 1.1 for v in ratios)}, "
              f"worst {worst:.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the measurements here")
    parser.add_argument("--load", help="read measurements written by --json instead of measuring")
    parser.add_argument("--fit", action="store_true", help="fit and print a new coefficient table")
    parser.add_argument(
        "--all", action="store_true", help="time the norm methods beyond the memory budget too"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"conv_costs: torch {torch.__version__}, CPU {cpu_name()}, 1 thread, batch {args.batch}")
    if args.load:
        with open(args.load) as f:
            records = json.load(f)
    else:
        records = measure(args.batch, args.repeats, args.all)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f)
    _summary("shipped CPU_COSTS", regret(records, tune.CPU_COSTS))
    if args.fit:
        table = fit(records)
        _summary("fitted", regret(records, table))
        print("CPU_COSTS = {")
        for method, coef in table.items():
            print(f'    "{method}": ({", ".join(f"{c:.3g}" for c in coef)}),')
        print("}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
