"""LineSearch's settings (``LineSearchConfig``, frozen) and what its checkpoints carry (``LineSearchState``).

The config's field names are the names the algorithm reads (``config.budget_increase`` is CHEB's ξ), so
nothing is renamed between the user's keywords, the YAML and the code; the state's fields are the keys of
``LineSearch.state_dict()``, unchanged from the layout before the state was a dataclass.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor

from lightning_dp.core import validation
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.core.validation import flag, number
from lightning_dp.steps.line_search.svt import SVTNoise

Accounting = Literal["safe", "paper"]
Mode = Literal["nn", "adaptive"]
BatchRule = Literal["fresh", "same"]

PAPER_ETA0 = 1.0
"""The paper's first candidate step size (adaptive mode's default, and NN mode's when C is infinite)."""


def eta0_for_clip(max_grad_norm: float) -> float:
    """NN mode's default first candidate, 1/C: the private gradient's signal part has norm at most C, so
    the largest candidate moves the weights about one unit along it whatever C is. Measured with
    bench/mechanisms.py (3 epochs, ε = 3, seed 0): on the MNIST CNN (C = 0.1) η0 = 1 reached 0.736 test
    accuracy, η0 = 4 0.910 and η0 = 1/C = 10 0.951, against DP-SGD's 0.847; on the digits MLP and the
    text GRU (C = 1) 1/C is the paper's η0 = 1, and η0 = 2 lost 3-16 points; with the paper's C = 3 it
    is 0.33, next to the 0.3 that bench/line_search_mnist.py found best."""
    return 1.0 / max_grad_norm if math.isfinite(max_grad_norm) and max_grad_norm > 0 else PAPER_ETA0


_POSITIVE: dict[str, Any] = {"low": 0, "low_open": True}
_UNIT: dict[str, Any] = {"low": 0, "high": 1, "low_open": True, "high_open": True}
_COUNT: dict[str, Any] = {"low": 1, "integer": True}
_BOUNDS: dict[str, dict[str, Any]] = {
    "loss_clip": {**_POSITIVE, "optional": True},
    "armijo": {**_UNIT, "optional": True},
    "beta": _UNIT,
    "max_it": _COUNT,
    "eta0": {**_POSITIVE, "optional": True},
    "reset_every": {"low": 0, "integer": True},
    "reset_factor": _POSITIVE,
    "grad_fraction": _UNIT,
    "planned_iterations": {**_COUNT, "optional": True},
    "budget_increase": {"low": 0},
    "angle_high": _POSITIVE,
    "angle_low": _POSITIVE,
    "angle_decay": {"low": 0, "high": 1},
    "clip_decay": {"low": 0},
    "weight_decay": {"low": 0},
    "max_cheb_per_step": _COUNT,
    "chunk_size": {**_COUNT, "optional": True},
}
"""Each numeric field's range, as :func:`~lightning_dp.core.validation.number` takes it."""
_CHOICES: dict[str, tuple[str, ...]] = {
    "mode": ("nn", "adaptive"),
    "noise": ("laplace", "gaussian"),
    "accounting": ("safe", "paper"),
    "line_search_batch": ("fresh", "same"),
}
_MODE_DEFAULTS = {"loss_clip": {"nn": 3.0, "adaptive": 1.0}, "armijo": {"nn": 0.001, "adaptive": 0.5}}
"""The fields whose default depends on the mode (None is filled in from here)."""


@dataclass(frozen=True)
class LineSearchConfig:
    """How a :class:`~lightning_dp.LineSearch` searches and what it may spend; validated once, frozen.

    ``LineSearch(**fields)`` and ``LineSearch.from_config(LineSearchConfig(**fields))`` build the same step.

    Args:
        mode: ``"nn"`` (Sec. 5.7: fixed per-iteration budget split ``grad_fraction`` / rest between the
            gradient and one search; a failed search takes the smallest step) or ``"adaptive"`` (Alg. 2:
            a failed search calls CHEB, which draws a second gradient and raises ρ_grad or the search
            budget by (1+ξ), and retries).
        noise: ``"laplace"`` (pure-DP SVT; default, the tighter one) or ``"gaussian"`` SVT.
        accounting: ``"safe"`` (default: proven bounds, see docs/mechanisms.md) or ``"paper"`` (Thms 2/3,
            Lemma 4 without the minimum, one batch per iteration, ln(1/δ) filter; reproduction only).
        line_search_batch: ``"fresh"`` (every data access draws its own Poisson batch; default) or
            ``"same"`` (the search reads the gradient's batch: priced jointly in NN mode; in adaptive
            mode only with ``accounting="paper"``).
        loss_clip: C_obj; each per-example loss is clamped to [0, C_obj]. Default (None, filled in at
            construction) 3 in NN mode, 1 in adaptive mode.
        armijo: the sufficient-decrease constant c. Default (None, filled in) 0.001 (NN), 0.5 (adaptive).
        beta: β, the ratio between successive candidate step sizes η0·β^i (default 0.8).
        max_it: the number of candidates, i < max_it (default 10).
        eta0: η0, the largest candidate step size. None (default): in NN mode 1/C (C = ``max_grad_norm``,
            known when the strategy is built), so the largest candidate moves the weights about one unit
            along the clipped gradient whatever C is; in adaptive mode the paper's 1.
        reset_every: τ, in iterations: every τ iterations η0 ← min(ς·max accepted η, η0) (default 10).
        reset_factor: ς of that reset (default 1.2).
        eta0_growth: drop the min of that reset, so η0 may grow (default False).
        grad_fraction: NN mode: share of the per-iteration zCDP budget spent on the gradient.
        planned_iterations: adaptive mode: the planner sizes ε_iter so this many nominal iterations use
            the budget (default 50, the paper's heuristic); NN mode: default the Trainer's planned steps.
        budget_increase: CHEB's ξ: a failed search raises ρ_grad or the search budget by (1+ξ) (default 0.3).
        angle_high: CHEB's φ_max (default 1.1).
        angle_low: CHEB's φ_min (default 0.5).
        angle_decay: ψ, the EMA factor of CHEB's angle (default 0.8).
        adapt_clip: DP-BLSGD-AC: shrink C_grad and C_obj by (1−ζ) when CHEB raises ρ_grad (default False).
        clip_decay: ζ of that shrink (default 0.05).
        weight_decay: μ of the data-independent regulariser (μ/2)‖w‖² added to the objective.
        max_cheb_per_step: adaptive mode: at most this many CHEB rounds per iteration (compute cap; a
            decision on released values only, so it changes no privacy cost).
        seed: seeds the SVT noise and the extra Poisson batches (default: ``os.urandom``).
        chunk_size: evaluate the candidates on at most this many examples per forward.
    """

    mode: Mode = "nn"
    noise: SVTNoise = "laplace"
    accounting: Accounting = "safe"
    line_search_batch: BatchRule = "fresh"
    loss_clip: float | None = None
    armijo: float | None = None
    beta: float = 0.8
    max_it: int = 10
    eta0: float | None = None
    reset_every: int = 10
    reset_factor: float = 1.2
    eta0_growth: bool = False
    grad_fraction: float = 0.9
    planned_iterations: int | None = None
    budget_increase: float = 0.3
    angle_high: float = 1.1
    angle_low: float = 0.5
    angle_decay: float = 0.8
    adapt_clip: bool = False
    clip_decay: float = 0.05
    weight_decay: float = 0.0
    max_cheb_per_step: int = 20
    seed: int | None = None
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        _check_choices(self)
        for name, bounds in _BOUNDS.items():
            value = number(getattr(self, name), name, owner="LineSearch", **bounds)
            if value is not None:  # one numeric type per field: ints stay ints, the rest become floats
                object.__setattr__(self, name, int(value) if bounds.get("integer") else float(value))
        for name in ("eta0_growth", "adapt_clip"):
            flag(getattr(self, name), name, owner="LineSearch")
        validation.seed(self.seed, owner="LineSearch")
        for name, by_mode in _MODE_DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, by_mode[self.mode])

    @property
    def first_eta0(self) -> float | None:
        """The first candidate before the plan knows C: the one given, the paper's in adaptive mode, else
        None (NN mode's 1/C, set by ``plan``)."""
        if self.eta0 is not None:
            return self.eta0
        return PAPER_ETA0 if self.mode == "adaptive" else None

    def options(self) -> dict[str, Any]:
        """The fields as ``LineSearch``'s keywords."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _check_choices(config: LineSearchConfig) -> None:
    """The four switches, and the one combination no theorem prices."""
    if config.mode not in _CHOICES["mode"]:
        raise DPConfigurationError(f"LineSearch mode must be 'nn' or 'adaptive', got {config.mode!r}.")
    if config.noise not in _CHOICES["noise"]:
        raise DPConfigurationError(f"LineSearch noise must be 'laplace' or 'gaussian', got {config.noise!r}.")
    if config.accounting not in _CHOICES["accounting"]:
        raise DPConfigurationError(
            f"LineSearch accounting must be 'safe' or 'paper', got {config.accounting!r}."
        )
    if config.line_search_batch not in _CHOICES["line_search_batch"]:
        raise DPConfigurationError(
            f"line_search_batch must be 'fresh' or 'same', got {config.line_search_batch!r}."
        )
    if config.line_search_batch == "same" and config.mode == "adaptive" and config.accounting == "safe":
        raise DPConfigurationError(
            "LineSearch(mode='adaptive', line_search_batch='same') retries the search on the gradient's "
            "batch an adaptive number of times; no theorem prices that jointly. Use "
            "line_search_batch='fresh' (default), or accounting='paper' to reproduce the paper."
        )


STATS = ("searches", "failures", "at_eta0", "cheb", "rho_raises", "search_raises", "clip_shrinks")
"""The counters of ``LineSearchState.stats`` (logged as ``ls/<name>``)."""


@dataclass
class LineSearchState:
    """What a LineSearch carries from step to step and a checkpoint restores: the budgets, the clip
    bounds, η0 and the accepted steps, CHEB's angle and previous direction, the counters."""

    c_obj: float
    """C_obj, the loss clip (``loss_clip``, shrunk by DP-BLSGD-AC)."""
    eta0: float | None
    """The first candidate; None until ``plan`` knows C (NN mode's default, 1/C)."""
    rho_grad: float | None = None
    search_budget: float | None = None
    """ε_BT (Laplace SVT) or ρ_BT (Gaussian SVT)."""
    c_grad: float | None = None
    """C_grad, the gradient's clip bound (``max_grad_norm``, shrunk by DP-BLSGD-AC); None before ``plan``."""
    accepted: list[float] = dataclasses.field(default_factory=list)
    """The step sizes accepted since η0 was last reset."""
    iteration: int = 0
    theta_bar: float = 90.0
    """CHEB's exponential moving average of the angle between successive directions, in degrees."""
    d_prev: list[Tensor] | None = None
    stats: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(STATS, 0))
    last: dict[str, float] = dataclasses.field(default_factory=lambda: {"eta": 0.0, "index": 0})
    """The last search's accepted step size and its index (0: failed)."""

    @classmethod
    def initial(cls, config: LineSearchConfig) -> LineSearchState:
        """The state before the first step."""
        assert config.loss_clip is not None  # filled in from the mode
        return cls(c_obj=config.loss_clip, eta0=config.first_eta0)

    def to_dict(self) -> dict[str, Any]:
        """Plain values and CPU tensors, under the field names (the checkpoint's keys)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["accepted"], out["stats"], out["last"] = list(self.accepted), dict(self.stats), dict(self.last)
        if self.d_prev is not None:
            out["d_prev"] = [g.detach().cpu().clone() for g in self.d_prev]
        return out

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> LineSearchState:
        """A state from ``to_dict``'s keys; counters a checkpoint lacks start at 0, keys it adds are ignored."""
        return cls(
            c_obj=float(saved["c_obj"]),
            eta0=None if saved["eta0"] is None else float(saved["eta0"]),
            rho_grad=saved["rho_grad"],
            search_budget=saved["search_budget"],
            c_grad=saved["c_grad"],
            accepted=list(saved["accepted"]),
            iteration=int(saved["iteration"]),
            theta_bar=float(saved["theta_bar"]),
            d_prev=saved["d_prev"],
            stats={**dict.fromkeys(STATS, 0), **saved["stats"]},
            last=dict(saved["last"]),
        )
