"""DP accelerated steps (Kuru, Birbil, Gürbüzbalaban and Yıldırım 2020): DP-SHB, DP-NAG and DP-MASG.

All three only post-process the private gradient already in ``p.grad``, so they cost no privacy. They
take the parameters (and, unless ``lr`` is given, the step size) from the user's optimizer, whose own
update rule is not used; ``weight_decay`` of its param groups is added to the gradient after the noise
(data-independent, so free). Nesterov-type steps keep the look-ahead point z_t in the parameters (the
gradient is evaluated there) and x_t in their state; :meth:`Nesterov.finalize` writes x_T back at the
end of training. :meth:`noise_log_weights` gives the noise-dividing weights log a_{T,k} of the error
bound (spec §2.4, §2.6) that :class:`~lightning_dp.noise.noise_dividing.NoiseDividing` allocates from.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from lightning_dp.core.validation import number
from lightning_dp.slots import Step, StepContext

__all__ = ["HeavyBall", "MultiStageNesterov", "Nesterov", "masg_stage_lengths", "nag_momentum"]


def nag_momentum(lr: float, mu: float) -> float:
    """β = (1 − √(αμ)) / (1 + √(αμ)), the momentum of NAG for step α and strong convexity μ."""
    if not lr > 0 or not mu > 0:
        raise ValueError(f"lr and mu must be > 0, got lr={lr}, mu={mu}")
    root = math.sqrt(lr * mu)
    if root >= 1:
        raise ValueError(f"lr·mu must be < 1 for NAG, got {lr * mu}")
    return (1 - root) / (1 + root)


def masg_stage_lengths(kappa: float, horizon: int, p: int = 1, n1: int | None = None) -> list[int]:
    """Stage lengths of MASG (eq. 33): n_1, then 2^k ⌈√κ ln 2^{p+2}⌉ for k ≥ 2, the last truncated to T."""
    if not kappa >= 1:
        raise ValueError(f"kappa = L/mu must be ≥ 1, got {kappa}")
    first = n1 if n1 is not None else math.ceil(math.sqrt(kappa) * math.log(kappa))
    first = max(1, int(first))
    unit = math.ceil(math.sqrt(kappa) * (p + 2) * math.log(2))
    lengths: list[int] = []
    stage, total = 1, 0
    while total < horizon:
        length = first if stage == 1 else 2**stage * unit
        length = min(length, horizon - total)
        lengths.append(length)
        total += length
        stage += 1
    return lengths


StepSize = Literal["effective", "paper"]


class _MomentumStep(Step):
    """Shared plumbing: one state tensor per parameter (in the optimizer's order), lr and weight decay.

    ``step_size`` says what the optimizer's lr means when the step takes it from there (``lr=None``):
    ``"effective"`` (default) keeps it as the DP-SGD step a tuned config already has, so the paper's
    α = lr·(1 − β) and the long-run step α/(1 − β) equals lr; ``"paper"`` uses it as α, which moves
    1/(1 − β) times as far (10× at β = 0.9). An ``lr`` given to the step itself is always the paper's α.
    """

    tracks_parameters = True  # one momentum tensor per parameter

    def __init__(self, lr: float | None, step_size: StepSize = "effective") -> None:
        number(lr, "lr", owner=type(self).__name__, low=0, low_open=True, optional=True)
        if step_size not in ("effective", "paper"):
            raise ValueError(f"step_size must be 'effective' or 'paper', got {step_size!r}")
        self.lr = lr
        self.step_size: StepSize = step_size
        self.buffers: list[Tensor | None] = []
        self.steps_taken = 0

    def momentum_for_lr(self) -> float:
        """The β whose 1/(1 − β) the effective step divides out (the constant momentum of this step)."""
        return 0.0

    def _params(self, optimizer: torch.optim.Optimizer) -> Iterator[tuple[int, Tensor, float, Tensor]]:
        """(index, parameter, α, gradient with weight decay) for every parameter that has a gradient."""
        index = 0
        scale = 1.0 - self.momentum_for_lr() if self.step_size == "effective" else 1.0
        for group in optimizer.param_groups:
            lr = self.lr if self.lr is not None else float(group["lr"]) * scale
            decay = float(group.get("weight_decay", 0.0))
            for p in group["params"]:
                if len(self.buffers) <= index:
                    self.buffers.append(None)
                if p.grad is not None:
                    grad = p.grad.detach()
                    yield index, p, lr, grad + decay * p.detach() if decay else grad
                index += 1

    def _buffer(self, index: int, like: Tensor, init: Tensor) -> Tensor:
        buf = self.buffers[index]
        if buf is None:
            buf = init.detach().clone()
        elif buf.device != like.device:
            buf = buf.to(like.device)
        self.buffers[index] = buf
        return buf

    def state_dict(self) -> dict[str, Any]:
        return {"buffers": list(self.buffers), "steps_taken": self.steps_taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffers = list(state.get("buffers", []))
        self.steps_taken = int(state.get("steps_taken", 0))

    def noise_log_weights(self, horizon: int) -> np.ndarray | None:
        """log a_{T,k}, k = 1..T, of the error bound; None when the step has no such bound (uniform noise)."""
        del horizon
        return None


class HeavyBall(_MomentumStep):
    """DP-SHB: x_{t+1} = x_t − α g̃_t + β(x_t − x_{t−1}) (buffer form v = βv + g̃, x −= αv).

    Equivalently x_{t+1} = x_t − α/(1−β) ū_t with ū the exponential average of the noisy gradients
    (the paper's smoothing reading, spec §2.2). ``beta=0`` is plain DP-SGD. Noise is uniform (as DP-SGD).

    Args:
        beta: β, the momentum, in [0, 1) (default 0.9).
        lr: α, the paper's step size, in the parameters' units per unit of gradient; None (default): taken
            from the optimizer's lr, read as ``step_size`` says.
        step_size: what the optimizer's lr means when ``lr`` is None: ``"effective"`` (default) keeps it as
            the long-run DP-SGD step (α = lr·(1 − β)), ``"paper"`` uses it as α (moves 1/(1 − β) times as far).
    """

    def __init__(self, beta: float = 0.9, lr: float | None = None, step_size: StepSize = "effective") -> None:
        number(beta, "beta", owner="HeavyBall", low=0, high=1, high_open=True)
        super().__init__(lr, step_size)
        self.beta = beta

    def momentum_for_lr(self) -> float:
        return self.beta

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, ctx: StepContext) -> None:
        for index, p, lr, grad in self._params(optimizer):
            buf = self._buffer(index, p, torch.zeros_like(p, dtype=torch.float32))
            buf.mul_(self.beta).add_(grad.float())
            p.add_(buf.to(p.dtype), alpha=-lr)
        self.steps_taken += 1


class Nesterov(_MomentumStep):
    """DP-NAG: z_t = x_t + β(x_t − x_{t−1}), x_{t+1} = z_t − α g̃(z_t); the parameters hold z_t.

    ``momentum`` is β; or give ``lr`` and ``mu`` (strong convexity) and β = (1 − √(αμ))/(1 + √(αμ)).
    Its noise-dividing weights (Prop. 4.2) need only q = 2β/(1+β): a_{T,k} ∝ q^{T−k}.

    Args:
        momentum: β, in [0, 1); None (default): derived from ``lr`` and ``mu`` (then both are required).
        lr: α, the paper's step size; None (default): taken from the optimizer's lr, read as ``step_size``
            says.
        mu: μ, the strong-convexity constant of the loss (> 0), used only to derive β; default None.
        step_size: what the optimizer's lr means when ``lr`` is None: ``"effective"`` (default) keeps it as
            the long-run DP-SGD step (α = lr·(1 − β)), ``"paper"`` uses it as α.
    """

    def __init__(
        self,
        momentum: float | None = None,
        lr: float | None = None,
        mu: float | None = None,
        step_size: StepSize = "effective",
    ) -> None:
        super().__init__(lr, step_size)
        number(mu, "mu", owner=type(self).__name__, low=0, low_open=True, optional=True)
        number(momentum, "momentum", owner=type(self).__name__, low=0, high=1, high_open=True, optional=True)
        if momentum is None:
            if lr is None or mu is None:
                raise ValueError(
                    "Nesterov needs momentum=β, or lr and mu (then β = (1 − √(lr·mu))/(1 + √(lr·mu)))."
                )
            momentum = nag_momentum(lr, mu)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum

    def momentum_for_lr(self) -> float:
        return self.momentum

    def step_size_and_momentum(self, k: int, lr: float) -> tuple[float, float]:
        """(α of step k, β that forms the look-ahead for step k + 1); k is 0-based."""
        del k
        return lr, self.momentum

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, ctx: StepContext) -> None:
        for index, p, lr, grad in self._params(optimizer):
            x_prev = self._buffer(index, p, p)  # first step: x_{-1} = x_0 = z_0
            alpha, beta = self.step_size_and_momentum(ctx.step, lr)
            x_new = p - alpha * grad.to(p.dtype)
            p.copy_(x_new + beta * (x_new - x_prev))
            x_prev.copy_(x_new)
        self.steps_taken += 1

    @torch.no_grad()
    def finalize(self, optimizer: torch.optim.Optimizer) -> None:
        """Write x_T (the iterate the paper evaluates) into the parameters instead of the look-ahead z_T."""
        index = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                buf = self.buffers[index] if index < len(self.buffers) else None
                if buf is not None:
                    p.copy_(buf.to(p.device))
                index += 1

    def noise_log_weights(self, horizon: int) -> np.ndarray | None:
        q = 2 * self.momentum / (1 + self.momentum)
        return (horizon - np.arange(1, horizon + 1)) * math.log(q)


class MultiStageNesterov(Nesterov):
    """DP-MASG: NAG in stages of doubling length with step α/4^k from stage k ≥ 2 and momentum restarts.

    ``lr`` is the first stage's step α^{(1)} = c/L; ``mu`` and ``L`` the strong convexity and
    smoothness (κ = L/μ sets the stage lengths); ``p`` and ``n1`` as in MASG (n1 defaults to
    ⌈√κ ln κ⌉). At each stage start the look-ahead equals the iterate (z = x).

    Args:
        lr: α^{(1)} = c/L, the first stage's step size (> 0, required).
        mu: μ, the strong-convexity constant of the loss (> 0, required).
        L: the smoothness constant of the loss (≥ ``mu``, required).
        p: MASG's stage-length exponent p (integer ≥ 1, default 1).
        n1: the first stage's length in steps (default ⌈√κ ln κ⌉, κ = L/μ).
    """

    def __init__(self, lr: float, mu: float, L: float, p: int = 1, n1: int | None = None) -> None:
        for name, value in (("lr", lr), ("mu", mu), ("L", L)):
            number(value, name, owner="MultiStageNesterov", low=0, low_open=True)
        number(p, "p", owner="MultiStageNesterov", low=1, integer=True)
        number(n1, "n1", owner="MultiStageNesterov", low=1, integer=True, optional=True)
        if not L >= mu > 0:
            raise ValueError(f"need L ≥ mu > 0, got L={L}, mu={mu}")
        super().__init__(momentum=nag_momentum(lr, mu), lr=lr, mu=mu)
        self.mu, self.L, self.p, self.n1 = mu, L, p, n1
        self.kappa = L / mu
        self._stage_cache: tuple[int, np.ndarray] = (0, np.zeros(0, dtype=np.int64))

    def stages(self, horizon: int) -> np.ndarray:
        """Stage s_k (1-based) of steps k = 1..horizon."""
        if self._stage_cache[0] < horizon:
            lengths = masg_stage_lengths(self.kappa, max(horizon, 2 * self._stage_cache[0]), self.p, self.n1)
            self._stage_cache = (sum(lengths), np.repeat(np.arange(1, len(lengths) + 1), lengths))
        return self._stage_cache[1][:horizon]

    def stage_lr(self, stage: int | np.ndarray) -> Any:
        """α^{(s)}: lr in stage 1, lr/4^s from stage 2 on."""
        s = np.asarray(stage)
        return np.where(s == 1, self.lr, float(self.lr) / 4.0**s)  # type: ignore[arg-type]

    def step_size_and_momentum(self, k: int, lr: float) -> tuple[float, float]:
        stage_now, stage_next = (int(s) for s in self.stages(k + 2)[k : k + 2])
        alpha = float(self.stage_lr(stage_now))
        beta = 0.0 if stage_next != stage_now else nag_momentum(alpha, self.mu)
        return alpha, beta

    def noise_log_weights(self, horizon: int) -> np.ndarray | None:
        """log a_{T,k} of Thm 4.3: Σ_{i>k} log(1 − √(μα_i)) + log(α_k(1 + α_k L)) + (s_T − s_k) log 2."""
        stages = self.stages(horizon)
        alphas = self.stage_lr(stages).astype(np.float64)
        contraction = np.log1p(-np.sqrt(self.mu * alphas))
        after = np.concatenate([np.cumsum(contraction[::-1])[::-1][1:], [0.0]])  # Σ_{i=k+1}^{T}
        return after + np.log(alphas * (1 + alphas * self.L)) + (stages[-1] - stages) * math.log(2)

    def state_dict(self) -> dict[str, Any]:
        return dict(super().state_dict(), kappa=self.kappa, lr=self.lr)
