"""What BandMF and BLT share: σ, the link to the cyclic sampler, the online noise draw and its state rules.

A correlated noise slot adds σ·C_clip·κ·z_t with z = C⁻¹w, w_t ~ N(0, I) i.i.d., computed online from a
few parameter-sized buffers per tensor (the subclass's recursion, ``_correlate``). The buffers hold past
noise, so they never enter a checkpoint or a pickle of the slot: a resume (or an unpickled copy) starts
them at zero, which turns C into blockdiag(C_s, C_{T−s}) and keeps the bound (spec §4.4). Under DDP each rank runs its own recursion on
its share w/√W: the recursion is linear, so the sum over ranks is the single-process noise (spec §1.5).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_dp.accounting import calibrate_noise
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.core.validation import number
from lightning_dp.noise.constant import FixedSigma
from lightning_dp.slots import NOISE_SLICE, Sampler

__all__ = ["CONVENTION", "CorrelatedNoise", "coefficient_list"]

CONVENTION = "relative to unit max column norm"


class CorrelatedNoise(FixedSigma):
    """Base of the matrix-factorization noise slots: a constant σ and an online recursion over buffers."""

    correlated = True
    refuses_user_level = "correlated noise needs cyclic participation over users (v1.1)"

    def __init__(self, noise_multiplier: float | None = None) -> None:
        number(noise_multiplier, "noise_multiplier", owner=self.name, low=0, optional=True)
        self.sigma = noise_multiplier
        self.sampler: Sampler | None = None
        self.param_shapes: list[tuple[int, ...]] | None = None
        self.buffers: list[Tensor] | None = None
        """Per tensor, the recursion's past noise ([buffers, numel], fp32): never saved."""
        self.local_step = 0
        """Steps since the buffers were last zero (the start, or a resume)."""
        self.steps_taken = 0
        self.resets: list[int] = []
        self.dpsgd_sigma: float | None = None
        """DP-SGD's σ at the same ε, steps and batch (set when calibrated): the predicted error's baseline."""

    # -- wiring -----------------------------------------------------------------------------------
    def link_sampler(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def setup(self, params: Sequence[Tensor]) -> None:
        self.param_shapes = [tuple(p.shape) for p in params]

    @property
    def num_params(self) -> int:
        return sum(math.prod(shape) for shape in self.param_shapes or [])

    def _sampler(self) -> Sampler:
        assert self.sampler is not None, "the engine links the sampler first"
        return self.sampler

    def _bands(self) -> int:
        bands = self._sampler().bands
        if not isinstance(bands, int):
            raise RuntimeError(f"{self.name}: the sampler's bands are not chosen yet")
        return bands

    def _horizon(self) -> int:
        horizon = self._sampler().horizon
        if horizon is None:
            raise DPConfigurationError(
                f"{self.name} fits its noise to the planned number of steps, which this run does not know: set "
                "max_epochs or max_steps."
            )
        return horizon

    # -- σ ------------------------------------------------------------------------------------------
    def _dpsgd_reference(self, epsilon: float, steps: int, delta: float, accountant: str) -> float | None:
        """σ of DP-SGD (Poisson at B/N, ``steps`` steps) at ``epsilon``: the baseline of the predicted error."""
        sampler = self._sampler()
        rate = sampler.expected_batch_size / sampler.size_for_releases
        try:
            return calibrate_noise(
                target_epsilon=epsilon,
                delta=delta,
                sample_rate=rate,
                steps=steps,
                accountant=accountant,
            )  # the σ a ConstantNoise run would get (same tolerance), so b = 1 predicts exactly 1.0
        except ValueError:
            return None

    # -- the draw -----------------------------------------------------------------------------------
    def _scale(self) -> float:
        """κ, the max column norm the noise is multiplied by (1 for BandMF's normalised coefficients)."""
        return 1.0

    def _buffer_count(self) -> int:
        raise NotImplementedError

    def _correlate(self, index: int, part: slice, w: Tensor) -> Tensor:
        """z_t for one slice of tensor ``index`` from its draw w_t; updates that slice of the buffers."""
        raise NotImplementedError

    def _begin_step(self) -> None:
        """Per-step set-up of the recursion (BandMF's ring weights); default nothing."""

    def add_noise(self, sums: list[Tensor], std: float, generator: torch.Generator) -> list[Tensor]:
        """Add std·κ·z_t, z = C⁻¹w, to the gradient sums (one call per private step, in place)."""
        shapes = [tuple(s.shape) for s in sums]
        if self.param_shapes is not None and shapes != self.param_shapes:
            raise DPConfigurationError(
                f"{self.name} keeps its correlated noise per parameter, but this release has tensors of shapes "
                f"{shapes[: len(self.param_shapes) + 2]} instead of the parameters' {self.param_shapes}: a release "
                "other than the gradient (a statistic, an audit's gradient canaries) would advance the recursion. "
                "Correlated noise adds noise to the private gradient only."
            )
        count = self._buffer_count()
        if self.buffers is None:
            self.buffers = [
                torch.zeros((count, s.numel()), dtype=torch.float32, device=s.device) for s in sums
            ]
        self._begin_step()
        scale = std * self._scale()
        for index, s in enumerate(sums):
            flat = s.view(-1) if s.is_contiguous() else s.reshape(-1)
            for start in range(0, flat.numel(), NOISE_SLICE):
                part = slice(start, min(start + NOISE_SLICE, flat.numel()))
                w = torch.randn(
                    part.stop - part.start, generator=generator, device=s.device, dtype=torch.float32
                )
                z = self._correlate(index, part, w)
                if scale != 0.0:
                    flat[part].add_(z.to(s.dtype), alpha=scale)
            if not s.is_contiguous():
                s.copy_(flat.view_as(s))
        self.local_step += 1
        self.steps_taken += 1
        return sums

    # -- state --------------------------------------------------------------------------------------
    def _strategy_state(self) -> dict[str, Any]:
        """The public description of the strategy (coefficients, θ/ω) that a resume must match."""
        raise NotImplementedError

    def _load_strategy(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """σ, the strategy and the step count: never the buffers, which hold past noise (spec §4.4)."""
        return {
            "sigma": self.sigma,
            "steps_taken": self.steps_taken,
            "resets": list(self.resets),
            **self._strategy_state(),
        }

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a spawn launcher, ``torch.save`` of the strategy, a cache) without the buffers, which hold
        past noise: a copy that adds noise restarts the recursion from zero, as a resume does (spec §4.4)."""
        state = dict(self.__dict__)
        if self.buffers is not None:
            state["resets"] = [*self.resets, self.steps_taken]
        state["buffers"], state["local_step"] = None, 0
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("sigma")
        if self.sigma is None:
            self.sigma = saved
        elif saved is not None and not math.isclose(saved, self.sigma, rel_tol=1e-12):
            raise ValueError(
                f"The checkpoint was trained with {self.name} at noise_multiplier={saved}, this run uses "
                f"{self.sigma}: the correlated noise of a run has one σ. Resume with the same noise_multiplier "
                "(or none, to take the checkpoint's)."
            )
        self._load_strategy(state)
        self.steps_taken = int(state.get("steps_taken", 0))
        self.resets = [int(s) for s in state.get("resets", [])]
        self.buffers, self.local_step = None, 0
        if self.steps_taken > 0:
            self.resets.append(self.steps_taken)
            warnings.warn(
                f"{self.name}: resuming at step {self.steps_taken} restarts the correlated noise from zero (the "
                "noise buffers hold past noise and are never written to checkpoints). The privacy bound is "
                "unchanged; the noise of the resumed part is correlated only within it.",
                stacklevel=2,
            )

    def resume_at(self, steps: int) -> None:
        """An interrupted step may have drawn its noise before the engine counted it: count released steps."""
        self.steps_taken = min(self.steps_taken, steps)
        if self.resets and self.resets[-1] > steps:
            self.resets[-1] = steps

    # -- reporting ----------------------------------------------------------------------------------
    def _predicted_ratio(self, rmse: float, steps: int) -> float | None:
        if self.dpsgd_sigma is None:
            return None
        return rmse / (self.dpsgd_sigma * math.sqrt((steps + 1) / 2.0))

    @staticmethod
    def _row_norms(inverse: np.ndarray) -> dict[str, float]:
        factors = np.sqrt(np.cumsum(inverse**2))
        return {"first_step": float(factors[0]), "last_step": float(factors[-1])}


def coefficient_list(values: Any) -> list[float]:
    """Plain floats (a checkpoint must load with ``weights_only=True``)."""
    return [float(v) for v in np.asarray(values, dtype=np.float64).ravel()]
