"""One Poisson draw over a population: every member joins independently with probability ``rate``.

The single primitive every Poisson-type sampler draws with (examples, a cyclic group, users), so the
cost of a step is that of this function: O(expected batch) time and memory, whatever the population.
A Bernoulli(rate) subset of ``range(n)`` has the law of: a size K ~ Binomial(n, rate) (``torch.binomial``'s
inversion or BTRS rejection, in float64), then K distinct members uniformly at random without replacement
(exactly uniform integers from 62 random bits, repeats drawn again). ``torch.binomial`` is trusted only up
to n = 2³² (``BINOMIAL_MAX``): its rounding grows with n. Above it, every member's Bernoulli(rate) is
read off Poisson hits (``_poisson_hits``), whose one random count has the mean of the batch, not n.
At rate ≥ 1/4 the population is at most four times the expected batch, and one uniform per member is
cheaper. Every random number comes from the caller's generator, so a sampler's stream stays its own.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

DENSE_RATE = 0.25
"""From this rate on, one float64 uniform per member (O(n) = O(4·rate·n)) replaces the sparse draw."""

_BITS = 2**62  # torch.randint over a power-of-two range ≥ 2³² takes a 64-bit draw modulo it: exact

MAX_POPULATION = _BITS
"""The largest population drawn from exactly: a member's position is drawn from 62 uniform random bits."""

BINOMIAL_MAX = 2**32
"""The largest population whose batch size ``torch.binomial`` draws. Its BTRS acceptance test multiplies
log((n−m+1)/(n−k+1)) by n + 1, so the log-acceptance is off by about n·2⁻⁵³: below 5·10⁻⁷ up to here,
while at n = 10¹⁵ the sizes are visibly biased (mean 90.13 for 90 over 2·10⁶ draws, χ² p ≈ 0)."""


def _empty() -> Tensor:
    return torch.zeros(0, dtype=torch.long)


def check_population(population: int) -> None:
    """Refuse (``ValueError``; samplers call it when bound) a population the draws cannot sample exactly."""
    if population > MAX_POPULATION:
        raise ValueError(
            f"The training set has {population} examples, more than the 2**62 a sampler draws from exactly: "
            "each member's position is drawn from 62 uniform random bits. Train on at most 2**62 examples."
        )


def uniform_below(bound: int, size: int, generator: torch.Generator) -> Tensor:
    """``size`` independent int64 draws, each exactly uniform on ``range(bound)`` (rejection, no modulo bias).

    ``torch.randint(bound)`` reduces a 32-bit draw modulo ``bound`` below 2³², which favours small values
    by up to bound/2³² (25 % at 10⁹); here 62 uniform bits are kept only below a multiple of ``bound``.
    """
    limit = (_BITS // bound) * bound
    out: list[Tensor] = []
    missing = size
    while missing > 0:
        bits = torch.randint(0, _BITS, (missing,), generator=generator, dtype=torch.long)
        if int(bits.max()) >= limit:  # probability below bound/2⁶² per draw
            bits = bits[bits < limit]
        out.append(bits.remainder_(bound))
        missing -= len(bits)
    return out[0] if len(out) == 1 else torch.cat(out)


def uniform_subset(population: int, size: int, generator: torch.Generator) -> Tensor:
    """A uniformly random ``size``-subset of ``range(population)``, sorted int64, in O(size) time and memory.

    Draws the missing count of uniform members and keeps the distinct ones until ``size`` are held: the
    procedure treats every member alike, so every subset of that size is equally likely. Above half the
    population it draws the complement instead (then O(population) = O(size)).
    """
    check_population(population)
    if not 0 <= size <= population:
        raise ValueError(f"cannot draw {size} distinct members from a population of {population}.")
    if size == 0:
        return _empty()
    if 2 * size > population:
        keep = torch.ones(population, dtype=torch.bool)
        keep[uniform_subset(population, population - size, generator)] = False
        return torch.nonzero(keep, as_tuple=False).flatten()
    chosen = np.zeros(0, dtype=np.int64)
    while len(chosen) < size:
        fresh = uniform_below(population, size - len(chosen), generator).numpy()
        chosen = _sorted_distinct(np.concatenate([chosen, fresh]))
    return torch.from_numpy(chosen)


def _sorted_distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values, sorted (numpy's sort is ~10x faster than torch's or ``np.unique`` on a few thousand)."""
    values = np.sort(values)
    repeated = values[1:] == values[:-1]
    return values[np.concatenate([[True], ~repeated])] if repeated.any() else values


def poisson_subset(population: int, rate: float, generator: torch.Generator) -> Tensor:
    """Sorted distinct int64 positions in ``range(population)``, each included independently w.p. ``rate``.

    O(rate·population) time and memory: nothing of size ``population`` is allocated below rate 1/4.
    """
    population, rate = int(population), float(rate)
    if rate != rate:
        raise ValueError("the sample rate is NaN: it must be a probability in [0, 1].")
    if population <= 0 or rate <= 0.0:
        return _empty()
    if rate >= 1.0:
        return torch.arange(population)
    check_population(population)
    if population > BINOMIAL_MAX:
        return _poisson_hits(population, rate, generator)
    if rate >= DENSE_RATE:
        mask = torch.rand(population, generator=generator, dtype=torch.float64) < rate
        return torch.nonzero(mask, as_tuple=False).flatten()
    count = torch.binomial(
        torch.tensor(float(population), dtype=torch.float64),
        torch.tensor(float(rate), dtype=torch.float64),
        generator=generator,
    )
    return uniform_subset(population, int(count), generator)


def _poisson_hits(population: int, rate: float, generator: torch.Generator) -> Tensor:
    """Bernoulli(rate) members of a population too large for ``torch.binomial``, exactly.

    M ~ Poisson(−n·log(1 − rate)) hits, each on a uniform member: every member then gets an independent
    Poisson(−log(1 − rate)) number of hits (Poisson splitting), so it is hit at least once, and joins,
    independently with probability 1 − (1 − rate) = rate. The one random count has the batch's mean, so
    its float64 draw does not degrade with n; repeated hits are kept once.
    """
    mean = -float(population) * math.log1p(-rate)
    hits = int(torch.poisson(torch.tensor([mean], dtype=torch.float64), generator=generator))
    if hits == 0:
        return _empty()
    return torch.from_numpy(_sorted_distinct(uniform_below(population, hits, generator).numpy()))


def share_size(population: int, rank: int, world_size: int) -> int:
    """How many of ``range(population)`` are ≡ ``rank`` (mod ``world_size``): one rank's share."""
    return len(range(rank, population, world_size))


def poisson_share(
    population: int, rate: float, generator: torch.Generator, rank: int = 0, world_size: int = 1
) -> Tensor:
    """:func:`poisson_subset` over one rank's share, the members ≡ ``rank`` (mod ``world_size``), as sorted
    indices into ``range(population)``; the union of every rank's draw is one Poisson draw over them all."""
    positions = poisson_subset(share_size(population, rank, world_size), rate, generator)
    return positions if world_size == 1 else positions * world_size + rank
