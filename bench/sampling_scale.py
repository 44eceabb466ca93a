"""Time and peak memory of one sampled Poisson batch as the data set grows (issue #41).

For N = 10⁴ … 10⁹ examples and expected batches B = 256 and 4096 it times the batches that
``Poisson().batch_sampler`` yields (the index list the DataLoader gets: draw and ``tolist``), against the
O(N) sampler lightning-dp used before (``torch.arange(N)`` kept for the epoch, ``torch.rand(N) < q`` every
step), kept here as the reference. Each (sampler, N, B) runs in its own process on one thread: the time is
the median over the batches, the memory the growth of the process's peak resident set from just before
the sampler is built to after the last batch (what the sampler keeps for the epoch plus what a step
allocates). The old sampler is skipped where it would need more than ``--old-limit-gb`` (13 bytes per
example: the int64 indices, the float32 uniforms and the mask).

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/sampling_scale.py            # ~2 min on 1 core
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/sampling_scale.py --sizes 1e6 1e9 --batches 4096
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

OLD_BYTES_PER_EXAMPLE = 13


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def child(impl: str, n: int, batch: int, seconds: float) -> dict[str, float]:
    """Time the batches of one sampler in this process; returns the median, the p90 and the peak growth."""
    import torch

    from lightning_dp import Poisson

    torch.set_num_threads(1)
    torch.rand(1000).sort()  # load the kernels before the memory baseline
    before = _peak_rss_bytes()
    if impl == "new":
        sampler = Poisson(seed=0)
        sampler.bind(n, batch)
        batches = iter(sampler.batch_sampler(10**9))
    else:
        batches = _old_batches(n, batch / n, torch.Generator().manual_seed(0))
    next(batches)  # the first batch: set-up costs are not a step's
    times: list[float] = []
    budget = time.perf_counter() + seconds
    while len(times) < 5 or (time.perf_counter() < budget and len(times) < 2000):
        start = time.perf_counter()
        next(batches)
        times.append(time.perf_counter() - start)
    times.sort()
    return {
        "median_ms": 1e3 * times[len(times) // 2],
        "p90_ms": 1e3 * times[int(0.9 * (len(times) - 1))],
        "peak_mb": (_peak_rss_bytes() - before) / 2**20,
        "batches": len(times),
    }


def _old_batches(n: int, rate: float, generator):  # the O(N) reference: before issue #41
    import torch

    indices = torch.arange(n)  # kept for the epoch
    while True:
        mask = torch.rand(n, generator=generator) < rate
        yield indices[mask].tolist()


def run(impl: str, n: int, batch: int, seconds: float) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    args = [sys.executable, __file__, "--child", impl, str(n), str(batch), str(seconds)]
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e4, 1e5, 1e6, 1e7, 1e8, 1e9])
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--seconds", type=float, default=1.5, help="time spent per (sampler, N, B)")
    parser.add_argument("--old-limit-gb", type=float, default=4.0)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        impl, n, batch, seconds = args.child
        print(json.dumps(child(impl, int(n), int(batch), float(seconds))))
        return

    from _harness import cpu_name

    print(f"CPU: {cpu_name()}, one thread; median time per sampled batch (p90), peak memory growth\n")
    print("| N | B | old: ms / batch | new: ms / batch | old / new | old: peak MB | new: peak MB |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        for size in args.sizes:
            n = int(size)
            if batch > n:
                continue
            new = run("new", n, batch, args.seconds)
            new_cell = f"{new['median_ms']:.3f} ({new['p90_ms']:.3f})"
            if OLD_BYTES_PER_EXAMPLE * n > args.old_limit_gb * 2**30:
                old_cell, ratio, old_mb = f"skipped (> {args.old_limit_gb:g} GB)", "", "—"
            else:
                old = run("old", n, batch, args.seconds)
                old_cell = f"{old['median_ms']:.3f} ({old['p90_ms']:.3f})"
                ratio = f"×{old['median_ms'] / new['median_ms']:.1f}"
                old_mb = f"{old['peak_mb']:.1f}"
            power = len(str(n)) - 1
            label = f"10^{power}" if 10**power == n else str(n)
            print(
                f"| {label} | {batch} | {old_cell} | {new_cell} | {ratio} | {old_mb} | {new['peak_mb']:.1f} |"
            )
            sys.stdout.flush()


if __name__ == "__main__":
    main()
