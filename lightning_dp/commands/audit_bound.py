"""The bound of a one-run privacy audit (Steinke, Nasr & Jagielski, NeurIPS 2023, Theorem 3): under (ε, δ)-DP
the number of correct guesses about m canaries is dominated by Binomial(r, e^ε/(1+e^ε)) up to a δ term, so a
count too large for an ε at the stated confidence rejects that ε; the largest rejected ε is an empirical lower
bound. :mod:`.audit` trains with the canaries and scores them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from scipy import stats
from torch import Tensor


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Upper bound on P[≥ v of r guesses correct] for an (ε, δ)-DP run with m canaries (Theorem 3).

    P[W ≥ v] + 2mδ · max_{i=1..v} P[v−i ≤ W < v] / i with W ~ Binomial(r, e^ε/(1+e^ε)).
    """
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 ≤ v ≤ r ≤ m, got v={v}, r={r}, m={m}")
    q = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(stats.binom.sf(v - 1, r, q))
    if delta == 0 or v == 0:
        return min(1.0, tail)
    i = np.arange(1, v + 1)
    window = np.cumsum(stats.binom.pmf(v - i, r, q))  # P[v−i ≤ W < v] for i = 1..v
    return min(1.0, tail + 2.0 * m * delta * float((window / i).max()))


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float = 0.95) -> float:
    """Largest ε that ``v`` correct of ``r`` guesses rejects at ``confidence`` (0 when none is rejected).

    The p-value grows with ε, so bisection on [0, ε_max] finds the boundary to 1e-6.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    alpha = 1.0 - confidence
    if r == 0 or p_value(m, r, v, 0.0, delta) >= alpha:
        return 0.0
    high = 1.0
    while p_value(m, r, v, high, delta) < alpha:
        high *= 2.0
        if high > 1e3:  # only reachable with δ = 0 and absurd counts; the bound is then vacuous
            return high
    low = 0.0
    while high - low > 1e-6:
        mid = (low + high) / 2
        if p_value(m, r, v, mid, delta) < alpha:
            low = mid
        else:
            high = mid
    return low


def default_guesses(m: int) -> list[tuple[int, int]]:
    """(k₊, k₋) pairs tried by default: top-only and symmetric, at 1/16 … 1/2 of the canaries."""
    ks = sorted({max(1, m // d) for d in (16, 8, 4, 2)})
    return [(k, 0) for k in ks] + [(k, k) for k in ks]


def evaluate_guesses(
    scores: Tensor,
    included: Tensor,
    delta: float,
    confidence: float = 0.95,
    guesses: Sequence[tuple[int, int]] | None = None,
) -> tuple[float, int, int]:
    """Best (ε lower bound, guesses, correct) over the (k₊, k₋) choices, each at (1−confidence)/len.

    Trying several k and keeping the best is paid for by a union bound, so the result still holds
    at ``confidence``.
    """
    m = int(scores.numel())
    candidates = list(guesses) if guesses is not None else default_guesses(m)
    per_test = 1.0 - (1.0 - confidence) / len(candidates)
    order = torch.argsort(scores.double(), descending=True, stable=True)
    ranked = included[order].bool()
    best = (0.0, 0, 0)
    for k_plus, k_minus in candidates:
        if k_plus < 0 or k_minus < 0 or k_plus + k_minus > m:
            raise ValueError(f"guess counts ({k_plus}, {k_minus}) do not fit {m} canaries")
        correct = int(ranked[:k_plus].sum()) + int((~ranked[m - k_minus :]).sum() if k_minus else 0)
        r = k_plus + k_minus
        eps = epsilon_lower_bound(m, r, correct, delta, per_test)
        if eps > best[0] or best[1] == 0:
            best = (eps, r, correct)
    return best
