"""Which slot combinations the ledger can price: one table of mechanism kinds, checked at construction."""

from __future__ import annotations

from lightning_dp.errors import DPConfigurationError
from lightning_dp.slots import Clipping, Noise, Sampler


def check_mechanisms(sampler: Sampler, clipping: Clipping, noise: Noise, accountant: str) -> None:
    """Refuse slot combinations the ledger cannot price (e.g. Laplace noise with Poisson/RDP events).

    Slots declare ``mechanism`` ("gaussian" unless set): Laplace needs all of fixed-size sampling,
    L1 clipping, Laplace noise and the pure-ε accountant (basic composition); Gaussian needs none
    (its accountant is "rdp", "prv" or "pld").
    """
    kinds = {
        name: slot.mechanism
        for name, slot in (("sampler", sampler), ("clipping", clipping), ("noise", noise))
    }
    kinds["accountant"] = "laplace" if accountant == "pure" else "gaussian"
    if len(set(kinds.values())) > 1:
        described = ", ".join(f"{name}: {kind}" for name, kind in kinds.items())
        raise DPConfigurationError(
            f"These slots release different mechanisms ({described}), which the ledger cannot price together. "
            "Pure ε-DP Laplace steps (privacy='paper') need FixedSize(), L1Clipping(), a Laplace noise slot "
            "and accountant='pure'; Gaussian steps need none of these."
        )
