"""Empirical privacy audit from one training run (Steinke, Nasr & Jagielski, NeurIPS 2023).

m canaries are each included independently with probability 1/2; after training the auditor scores
them, guesses the k₊ highest as included and the k₋ lowest as excluded (abstaining on the rest), and
counts the correct guesses. Under (ε, δ)-DP the number of correct guesses is stochastically dominated
by Binomial(r, e^ε/(1+e^ε)) up to a δ term (their Theorem 3), so a count that is too large for an ε at
the stated confidence rejects that ε: the largest rejected ε is an empirical *lower* bound.

Two kinds of canary:

* ``"gradient"`` (white-box): each included canary is Poisson-sampled at the sampler's rate at every
  step, like a real example, and then contributes a vector of norm equal to the clipping sensitivity
  to the sum the noise is added to. By default (``placement="isolated"``) canary i owns coordinate i
  of an extra block released with the step, so real gradients do not blur the scores; with
  ``placement="model"`` it owns one random coordinate of the model's gradient instead. The score is
  the sum over steps of the released (noisy) coordinate. This checks the noise and its pricing.
* ``"input"`` (black-box): m random out-of-distribution inputs with random labels; the included ones
  are appended to the training set and go through the real sampler and clipping. The score is the
  logit margin of the canary's label under the final model (classifiers with ``forward`` → logits and
  ``(x, y)`` batches), minus its margin under the initial weights.

On a user-level run (``privacy_unit="user"``) the canaries are users and the claim is the ledger's
user-level ε: a gradient canary is Poisson-sampled at the user rate q_u and adds one unit's sensitivity; an
input canary is a canary user with k examples (the canary input and small perturbations of it, one label, a
fresh user id), sampled, grouped and clipped by the run's own ``UserPoisson`` and scored by its mean margin.

A lower bound that stays below the claimed ε is what a correct implementation must show; it is not a
proof of privacy (see docs/audit.md). The bound itself (Theorem 3, the guesses) is :mod:`.audit_bound`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset, TensorDataset

from lightning_dp.commands.audit_bound import default_guesses, epsilon_lower_bound, evaluate_guesses, p_value
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.core.rng import make_generator
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.sampling.user_ids import resolve_user_ids, with_new_users
from lightning_dp.slots import StepContext
from lightning_dp.slots.release import ReleaseHook

__all__ = [
    "AUDIT_PLOT_NAME",
    "JITTER",
    "AuditResult",
    "CanaryKind",
    "GradientCanaries",
    "Placement",
    "audit",
    "canary_scores",
    "default_guesses",
    "epsilon_lower_bound",
    "evaluate_guesses",
    "logit_margins",
    "make_input_canaries",
    "p_value",
    "plot_audit",
]

CanaryKind = Literal["gradient", "input"]
Placement = Literal["isolated", "model"]
AUDIT_PLOT_NAME = "privacy_audit.png"
JITTER = 0.25
"""How far a canary user's examples lie from its direction, relative to the direction's length."""


@dataclass
class AuditResult:
    """What the audit found; ``epsilon_lower_bound`` holds at ``confidence`` (Bonferroni over guesses).

    Attributes:
        claimed_epsilon: the ε the run's ledger reports.
        epsilon_lower_bound: the empirical lower bound on ε; above ``claimed_epsilon`` means a bug (or, with
            probability at most 1 − ``confidence``, bad luck).
        confidence: the probability with which the lower bound holds.
        delta: the run's δ.
        canary: ``"gradient"`` or ``"input"``, the kind of canary audited.
        privacy_unit: ``"example"`` or ``"user"``: what one canary is, and what the claimed ε protects.
        examples_per_canary: input canaries: the examples each canary holds (k for a canary user, else 1);
            None for gradient canaries (each adds one unit's sensitivity, whatever the unit).
        num_canaries: r, the number of canaries; ``num_included`` of them were in the training set.
        num_included: how many canaries were included (each with probability 1/2).
        num_guesses: how many canaries the best (k₊, k₋) guessed (the rest abstained).
        num_correct: how many of those guesses were correct.
        guesses_tried: every (k₊, k₋) tried; the confidence is split between them.
        steps: the private steps the run took.
        scores: each canary's score (higher: more likely included).
        included: whether each canary was included.
    """

    claimed_epsilon: float
    epsilon_lower_bound: float
    confidence: float
    delta: float
    canary: str
    privacy_unit: str
    examples_per_canary: int | None
    num_canaries: int
    num_included: int
    num_guesses: int
    num_correct: int
    guesses_tried: list[tuple[int, int]]
    steps: int
    scores: list[float] = field(repr=False)
    included: list[bool] = field(repr=False)

    @property
    def passed(self) -> bool:
        """The audit found no evidence against the claim (it never proves the claim)."""
        return self.epsilon_lower_bound <= self.claimed_epsilon

    def summary(self) -> dict[str, Any]:
        """JSON-able figures without the per-canary arrays (what the privacy report stores)."""
        data = asdict(self)
        del data["scores"], data["included"]
        data["guesses_tried"] = [list(g) for g in self.guesses_tried]
        data["passed"] = self.passed
        return data


# -- white-box canaries -------------------------------------------------------------------------------
class GradientCanaries(ReleaseHook):
    """Canary gradients of norm = the clipping sensitivity, Poisson-sampled like a real unit (an example,
    or on a user-level run a user: the sampler's rate is then q_u, and the sensitivity one user's)."""

    def __init__(
        self,
        engine: PrivateStepEngine,
        included: Tensor,
        seed: int | None = None,
        placement: Placement = "isolated",
    ) -> None:
        if placement not in ("isolated", "model"):
            raise ValueError(f"placement must be 'isolated' or 'model', got {placement!r}")
        self.engine, self.placement = engine, placement
        self.included = included.bool().cpu()
        self.m = int(self.included.numel())
        self.scores = torch.zeros(self.m, dtype=torch.float64)
        self.generator = make_generator(seed, stream="audit/canary-sampling")
        self._coords_generator = make_generator(seed, stream="audit/canary-coordinates")
        self.coordinates: Tensor | None = None  # flat model coordinates (placement="model")

    def _flat_coordinates(self, sums: list[Tensor]) -> Tensor:
        if self.coordinates is None:
            total = sum(s.numel() for s in sums)
            if total < self.m:
                raise ValueError(
                    f"placement='model' needs ≤ {total} canaries (one coordinate each), got {self.m}"
                )
            self.coordinates = torch.randperm(total, generator=self._coords_generator)[: self.m]
        return self.coordinates

    def before_noise(self, sums: list[Tensor], ctx: StepContext) -> list[Tensor]:
        rate = self.engine.sampler.sample_rate
        sampled = self.included & (torch.rand(self.m, generator=self.generator) < rate)
        if self.engine.rank != 0:  # canaries live on rank 0; the others keep the shapes aligned
            sampled = torch.zeros_like(sampled)
        ctx.batch_size += int(sampled.sum())
        device = sums[0].device
        contribution = sampled.to(device=device, dtype=torch.float32) * self.engine.clipping.sensitivity(ctx)
        if self.placement == "isolated":
            return [*sums, contribution]
        flat = torch.cat([s.reshape(-1) for s in sums])
        flat[self._flat_coordinates(sums).to(device)] += contribution
        return _unflatten(flat, sums)

    def after_release(self, noisy: list[Tensor], ctx: StepContext) -> list[Tensor]:
        if self.placement == "isolated":
            self.scores += noisy[-1].detach().double().cpu()
            return noisy[:-1]
        flat = torch.cat([s.reshape(-1) for s in noisy])
        self.scores += flat[self._flat_coordinates(noisy).to(flat.device)].detach().double().cpu()
        return noisy


def _unflatten(flat: Tensor, like: list[Tensor]) -> list[Tensor]:
    out, start = [], 0
    for t in like:
        out.append(flat[start : start + t.numel()].view_as(t))
        start += t.numel()
    return out


# -- black-box canaries -----------------------------------------------------------------------------
def make_input_canaries(
    dataset: Dataset, num_canaries: int, num_classes: int, seed: int | None, examples_per_canary: int = 1
) -> TensorDataset:
    """Out-of-distribution inputs with random labels, in the directions the data barely varies along.

    Each canary is the data mean plus a random vector in the span of the lower half of the principal
    directions of (a sample of) the inputs, scaled to the data's typical distance from its mean: real
    examples hardly move the model along those directions, so a canary's own influence stands out.
    With ``examples_per_canary`` = k > 1 (a canary user) canary i is rows i·k … i·k + k − 1: its direction
    plus small independent perturbations in the same span (each row its own input), all with its label.
    """
    g = make_generator(seed, stream="audit/input-canaries")
    n = len(dataset)  # type: ignore[arg-type]
    probe = torch.randperm(n, generator=g)[: min(n, 1024)]
    xs = torch.stack([torch.as_tensor(dataset[int(i)][0]).float() for i in probe])
    shape = xs.shape[1:]
    flat = xs.reshape(len(xs), -1).double()
    mean = flat.mean(0)
    centred = flat - mean
    _, _, vh = torch.linalg.svd(centred, full_matrices=True)
    low = vh[vh.shape[0] // 2 :]  # the lower half of the principal directions (incl. the null space)
    radius = centred.norm(dim=1).median()
    noise = torch.randn((num_canaries, low.shape[0]), generator=g, dtype=torch.float64)
    y = torch.randint(num_classes, (num_canaries,), generator=g)
    k = examples_per_canary
    if k > 1:  # one canary user: k rows around its direction, JITTER of its length apart
        jitter = torch.randn((num_canaries, k, low.shape[0]), generator=g, dtype=torch.float64)
        scale = JITTER * noise.norm(dim=1, keepdim=True) / math.sqrt(low.shape[0])
        noise = (noise[:, None] + scale[:, None] * jitter).reshape(num_canaries * k, -1)
        y = y.repeat_interleave(k)
    direction = noise @ low
    x = mean + radius * direction / direction.norm(dim=1, keepdim=True)
    return TensorDataset(x.float().reshape(len(x), *shape), y)


@torch.no_grad()
def logit_margins(model: torch.nn.Module, canaries: TensorDataset) -> Tensor:
    """logit[label] − max other logit for each canary: high when the model memorised it."""
    was_training = model.training
    model.eval()
    x, y = canaries.tensors
    device = next(model.parameters()).device
    logits = model(x.to(device)).float().cpu()
    model.train(was_training)
    own = logits.gather(1, y[:, None]).squeeze(1)
    others = logits.scatter(1, y[:, None], float("-inf")).max(1).values
    return own - others


# -- the entry point ---------------------------------------------------------------------------------
def audit(
    trainer: Any,
    model: Any,
    datamodule: Any = None,
    *,
    canary: CanaryKind = "gradient",
    num_canaries: int = 256,
    confidence: float = 0.95,
    guesses: Sequence[tuple[int, int]] | None = None,
    placement: Placement = "isolated",
    examples_per_canary: int | None = None,
    seed: int | None = None,
    write_report: bool = True,
) -> AuditResult:
    """Train ``model`` once with canaries under ``trainer`` (a DP strategy) and audit the claimed ε.

    ``seed`` fixes which canaries are included (and the canaries themselves); by default it comes
    from ``os.urandom``. The result is also written into ``privacy_report.json`` (field ``"audit"``)
    next to a ``privacy_audit.png`` score plot, when the run writes a report.

    On a user-level run the canaries are users and the claim is the user-level ε (``docs/audit.md``).

    Args:
        trainer: a ``Trainer`` whose strategy is a DP strategy; it runs the fit.
        model: the LightningModule to train.
        datamodule: its data, when ``model`` does not bring its own train loader (default None).
        canary: ``"gradient"`` (default, white-box: a vector of norm equal to the clipping sensitivity added
            to the released sum when the canary is sampled) or ``"input"`` (black-box: an out-of-distribution
            example appended to the training set, scored on the final model).
        num_canaries: r, the number of canaries (≥ 2, default 256); each is included with probability 1/2.
        confidence: the probability with which the lower bound holds (default 0.95).
        guesses: the (k₊, k₋) pairs to try: guess the k₊ highest scores included and the k₋ lowest excluded;
            None (default): 8 choices, the confidence split between them.
        placement: gradient canaries only: ``"isolated"`` (default: each owns a coordinate of an extra
            released block) or ``"model"`` (each owns a random coordinate of the model's gradient; weaker).
        examples_per_canary: input canaries only: k, the examples of each canary user (default None: the run's
            ``examples_per_user`` on a user-level run, 1 otherwise); more than 1 needs a user-level run.
        seed: fixes the canaries and which are included (default None: ``os.urandom``).
        write_report: add the result to ``privacy_report.json`` and plot ``privacy_audit.png`` (default True).
    """
    from lightning_dp.run.callbacks import dp_strategy_of

    if canary not in ("gradient", "input"):
        raise ValueError(f"canary must be 'gradient' or 'input', got {canary!r}")
    if num_canaries < 2:
        raise ValueError(f"num_canaries must be ≥ 2, got {num_canaries}")
    strategy = dp_strategy_of(trainer)
    engine = strategy.engine
    user_level = engine.sampler.unit == "user"
    per_canary = _examples_per_canary(canary, examples_per_canary, engine, user_level)
    included = torch.rand(num_canaries, generator=make_generator(seed, stream="audit/included")) < 0.5
    if canary == "gradient":
        scores = _fit_with_gradient_canaries(trainer, model, datamodule, engine, included, seed, placement)
    else:
        scores = _fit_with_input_canaries(
            trainer, model, datamodule, strategy, included, seed, per_canary or 1
        )
    result = _judge(strategy, scores, included, canary, per_canary, confidence, guesses)
    if write_report:
        _write_to_report(trainer, result)
    return result


def _judge(
    strategy: Any,
    scores: Tensor,
    included: Tensor,
    canary: CanaryKind,
    per_canary: int | None,
    confidence: float,
    guesses: Sequence[tuple[int, int]] | None,
) -> AuditResult:
    """The best guesses' lower bound on ε from the canaries' scores, against the ε the run's ledger claims."""
    engine = strategy.engine
    num_canaries = int(included.numel())
    eps, r, v = evaluate_guesses(scores, included, engine.delta, confidence, guesses)
    return AuditResult(
        claimed_epsilon=float(engine.ledger.epsilon()),
        epsilon_lower_bound=eps,
        confidence=confidence,
        delta=engine.delta,
        canary=canary,
        privacy_unit=_unit_kind(strategy),
        examples_per_canary=per_canary,
        num_canaries=num_canaries,
        num_included=int(included.sum()),
        num_guesses=r,
        num_correct=v,
        guesses_tried=list(guesses) if guesses is not None else default_guesses(num_canaries),
        steps=engine.steps,
        scores=[float(s) for s in scores],
        included=[bool(b) for b in included],
    )


def _fit_with_gradient_canaries(
    trainer: Any,
    model: Any,
    datamodule: Any,
    engine: PrivateStepEngine,
    included: Tensor,
    seed: int | None,
    placement: Placement,
) -> Tensor:
    """Fit with the gradient canaries on the engine's releases; each canary's score (its released coordinate,
    summed over the steps)."""
    if engine.noise.correlated:
        raise DPConfigurationError(
            f"The gradient canaries are Poisson-sampled at every step and scored as i.i.d. noise, but "
            f"{engine.noise.name}'s noise is correlated across steps and its examples join one step in b: the "
            "audit would test another mechanism. Audit this run with canary='input' (the canaries then go "
            "through the real sampler and noise)."
        )
    hook = GradientCanaries(engine, included, seed=seed, placement=placement)
    engine.release_hooks.append(hook)
    try:
        trainer.fit(model, datamodule=datamodule)
    finally:
        engine.release_hooks.remove(hook)
    return hook.scores


def _fit_with_input_canaries(
    trainer: Any, model: Any, datamodule: Any, strategy: Any, included: Tensor, seed: int | None, k: int
) -> Tensor:
    """Fit on the training set with the included input canaries (``k`` examples each) appended; each canary's
    score (its margin on the final model less its margin on the initial weights)."""
    loader = _train_loader(model, datamodule)
    with torch.no_grad():
        num_classes = int(model(torch.as_tensor(loader.dataset[0][0])[None].float()).shape[-1])
    canaries = make_input_canaries(loader.dataset, int(included.numel()), num_classes, seed, k)
    before = canary_scores(model, canaries, k)  # initial weights: fixed before seeing data
    rows = [int(i) * k + j for i in torch.nonzero(included).flatten() for j in range(k)]
    train: DataLoader[Any] = DataLoader(
        ConcatDataset([loader.dataset, Subset(canaries, rows)]),
        batch_size=loader.batch_size,
        collate_fn=loader.collate_fn,
    )
    with _canary_users(strategy, loader.dataset, [k] * int(included.sum())):
        trainer.fit(model, train_dataloaders=train)
    return canary_scores(model, canaries, k) - before


def _write_to_report(trainer: Any, result: AuditResult) -> None:
    """Add the result to the run's ``privacy_report.json`` and plot its scores beside it (rank 0, when the run
    writes a report)."""
    from lightning_dp.run.callbacks import PrivacyCallback

    callback = next((c for c in trainer.callbacks if isinstance(c, PrivacyCallback)), None)
    if callback is not None and callback.report_path and trainer.is_global_zero:
        from lightning_dp.run.report import add_audit

        directory = os.path.dirname(callback.report_path)
        add_audit(callback.report_path, result.summary())
        plot_audit(result, os.path.join(directory, AUDIT_PLOT_NAME))


def _unit_kind(strategy: Any) -> str:
    """What the claimed ε protects: the fit's privacy unit ("example" or "user")."""
    unit = getattr(strategy, "privacy_unit", None)
    return str(unit.kind) if unit is not None else str(strategy.engine.sampler.unit)


def _examples_per_canary(
    canary: CanaryKind, examples_per_canary: int | None, engine: PrivateStepEngine, user_level: bool
) -> int | None:
    """k for input canaries: the given one, else the run's ``examples_per_user`` (user-level) or 1."""
    if canary == "gradient":
        if examples_per_canary is not None:
            raise ValueError(
                "examples_per_canary applies to canary='input': a gradient canary adds one unit's sensitivity "
                "after the clipping, whatever the unit holds."
            )
        return None
    if examples_per_canary is None:
        return int(getattr(engine.sampler, "examples_per_user", 1)) if user_level else 1
    if (
        isinstance(examples_per_canary, bool)
        or not isinstance(examples_per_canary, int)
        or examples_per_canary < 1
    ):
        raise ValueError(f"examples_per_canary must be an integer ≥ 1, got {examples_per_canary!r}")
    if examples_per_canary > 1 and not user_level:
        raise DPConfigurationError(
            f"examples_per_canary={examples_per_canary} makes each canary a group of {examples_per_canary} "
            "examples, but this run protects one example: its ε says nothing about groups, so the audit would "
            "fail a correct run. Use examples_per_canary=1 here, or train (and audit) at user level (sampler=UserPoisson(...))."
        )
    return examples_per_canary


@contextmanager
def _canary_users(strategy: Any, dataset: Any, sizes: list[int]) -> Iterator[None]:
    """For the fit inside: the real examples keep their users and each canary is a new user (``sizes[j]``
    examples of canary user j, appended after the real data). Nothing to do for a run without users."""
    from lightning_dp.strategies import privacy_unit_setup

    key = privacy_unit_setup.user_key_of(strategy)
    if key is None:
        yield
        return
    extended = with_new_users(resolve_user_ids(dataset, key, owner="audit"), sizes)
    with privacy_unit_setup.users_from(strategy, extended):
        yield


def canary_scores(model: torch.nn.Module, canaries: TensorDataset, examples_per_canary: int) -> Tensor:
    """Each canary's score: the mean logit margin over its examples (one, or a canary user's k)."""
    margins = logit_margins(model, canaries).double()
    return margins.view(-1, examples_per_canary).mean(1)


def _train_loader(model: Any, datamodule: Any) -> DataLoader:
    source = datamodule if datamodule is not None else model
    if datamodule is not None:
        datamodule.prepare_data()
        datamodule.setup("fit")
    loader = source.train_dataloader()
    if not isinstance(loader, DataLoader) or loader.batch_size is None:
        raise ValueError("canary='input' needs a train DataLoader over a map-style dataset with a batch_size")
    return loader


def plot_audit(result: AuditResult, path: str) -> None:
    """Histogram of canary scores, included against excluded, with claimed and audited ε in the title."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    scores = torch.tensor(result.scores)
    mask = torch.tensor(result.included)
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    bins = torch.linspace(float(scores.min()), float(scores.max()) + 1e-9, 31).tolist()
    ax.hist(scores[mask].tolist(), bins=bins, alpha=0.6, label=f"included ({int(mask.sum())})")
    ax.hist(scores[~mask].tolist(), bins=bins, alpha=0.6, label=f"excluded ({int((~mask).sum())})")
    ax.set_xlabel(f"canary score ({result.canary})")
    ax.set_ylabel("canaries")
    ax.set_title(
        f"claimed ε={result.claimed_epsilon:.3g}, audited ε ≥ {result.epsilon_lower_bound:.3g} "
        f"({result.confidence:.0%})",
        fontsize=9,
    )
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
