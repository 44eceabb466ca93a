"""The cost of recording a privacy event when σ changes every step, and the ε it reports vs the exact path.

Records ``--steps`` DP-SGD steps whose noise multiplier decays every step (a NoiseDividing-like
schedule) into a ``PrivacyLedger`` the way the engine does (check-before-spend, then read ε), and
prints the time per event and the final ε. The exact path sums each step's exact RDP (the vectorised
series, one evaluation per distinct σ) and converts once; the old path (Opacus's ``compute_rdp`` per
new event) is timed on ``--old-events`` events.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/accounting_cost.py             # ~5 min on 1 core
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/accounting_cost.py --steps 10000
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from opacus.accountants.analysis.rdp import compute_rdp

from lightning_dp.accounting import DEFAULT_ORDERS, PoissonGaussian, PrivacyLedger, epsilon_from_rdp
from lightning_dp.accounting.sgm import sgm_rdp


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--sigma-start", type=float, default=2.0)
    parser.add_argument("--sigma-end", type=float, default=0.8)
    parser.add_argument("--sample-rate", type=float, default=256 / 60_000)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--old-events", type=int, default=50)
    parser.add_argument("--no-exact", action="store_true", help="skip the exact path (minutes)")
    args = parser.parse_args()

    q = args.sample_rate
    sigmas = np.geomspace(args.sigma_start, args.sigma_end, args.steps)
    ledger = PrivacyLedger(args.delta)
    start = time.process_time()
    for sigma in sigmas:
        ledger.spend(PoissonGaussian(float(sigma), q), target_epsilon=float("inf"))
        ledger.epsilon()
    per_event = (time.process_time() - start) / args.steps
    fast_eps, order = ledger.epsilon_and_order()
    print(f"schedule: σ {args.sigma_start} → {args.sigma_end} (geometric, new σ every step), q = {q:.5g}, ")
    print(f"          {args.steps} steps, δ = {args.delta:g}, {len(DEFAULT_ORDERS)} orders")
    print(
        f"ledger:   {per_event * 1e3:.4f} ms per event (spend + ε read, CPU time), ε = {fast_eps:.6f} (α = {order:g})"
    )

    start = time.process_time()
    for sigma in sigmas[: args.old_events]:
        compute_rdp(q=q, noise_multiplier=float(sigma) * 1.0001, steps=1, orders=list(DEFAULT_ORDERS))
    old = (time.process_time() - start) / max(1, args.old_events)
    print(f"old path: {old * 1e3:.2f} ms per new event (Opacus compute_rdp over the same orders)")

    if args.no_exact:
        return
    start = time.process_time()
    orders = tuple(DEFAULT_ORDERS)
    total = np.zeros(len(orders))
    for sigma in sigmas:
        total += sgm_rdp(float(sigma), q, orders)
    exact_eps, exact_order = epsilon_from_rdp(total, orders, args.delta)
    exact_time = time.process_time() - start
    print(
        f"exact:    ε = {exact_eps:.6f} (α = {exact_order:g}), {exact_time / args.steps * 1e3:.3f} ms per event; "
        f"ledger / exact = {fast_eps / exact_eps:.5f}"
    )


if __name__ == "__main__":
    main()
