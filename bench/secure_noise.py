"""What secure noise costs on this CPU (issue #50): the discrete Gaussian sampler against the float path's
``torch.randn``, side by side, and the noise's share of a step as the model grows.

The sampler (``CKSSampler``) draws every bit from ``os.urandom`` and about 2.4 candidates of four 63-bit
words per value, so its rate is bounded by the kernel's CSPRNG throughput (printed too). The per-step cost
of ``secure=True`` on the bench MLP, CNN and a transformer is ``bench/step_time.py``'s
``lightning-dp secure`` variant (see bench/README.md for the command); the accuracy at the same ε is
``bench/mechanisms.py --only DP-SGD secure=True``.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/secure_noise.py [--values 1048576] [--repeats 5]
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import statistics
import time

import torch
from _harness import cpu_name

from lightning_dp.noise.discrete_gaussian import CKSSampler


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", type=int, default=1 << 20, help="values per draw")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n, repeats = args.values, args.repeats
    print(
        f"secure_noise: CPU {cpu_name()}, torch {torch.__version__}, 1 thread, {n} values per draw, median of {repeats}"
    )
    urandom = median_seconds(lambda: os.urandom(32 * n), repeats)
    print(f"os.urandom: {32 * n / urandom / 1e6:.0f} MB/s (a value needs ~{32 / 0.42:.0f} bytes)")
    randn = median_seconds(lambda: torch.randn(n), repeats)
    print("\n| sampler | σ₀ (grid units) | candidates per value | values/s | time per value vs float randn |")
    print("|---|---|---|---|---|")
    print(f"| float `torch.randn` (fp32) | — | — | {n / randn / 1e6:.1f} M | 1.0× |")
    rates = {}
    for scale in (10.0, 1e5, 1e9):
        sampler = CKSSampler(scale)
        seconds = median_seconds(lambda s=sampler: s.sample(n), repeats)
        rates[scale] = n / seconds
        per = sampler.candidates(n) / n
        print(
            f"| discrete Gaussian (CKS, os.urandom) | {scale:g} | {per:.2f} | {n / seconds / 1e6:.2f} M | {seconds / randn:.0f}× |"
        )
    rate = rates[1e5]
    print("\nThe noise of one step alone (d coordinates, one rank), at the σ₀ = 1e5 rate:")
    print("| d | float randn | discrete Gaussian |")
    print("|---|---|---|")
    for d in (26_010, 795_010, 10**7, 10**8):
        print(f"| {d:,} | {d / (n / randn) * 1e3:.1f} ms | {d / rate:.2f} s |")


if __name__ == "__main__":
    main()
