"""The privacy state in a Lightning checkpoint: saved beside the weights, checked and restored on resume.

Rank 0's ledger and every rank's own sampling and noise streams are stored under ``CHECKPOINT_KEY``; a
resume must continue the same run (same processes, data set and batch size) or it is refused, because a
ledger restarted or continued on other data would report less ε than was spent. The file-level parts
(atomic writes, damaged-file diagnosis) are in ``lightning_dp/run/checkpointing.py``.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer

from lightning_dp.accounting import PrivacyEvent, PrivacyLedger
from lightning_dp.core.errors import DPConfigurationError
from lightning_dp.engine import PrivateStepEngine
from lightning_dp.run.checkpointing import (
    check_privacy_state,
    check_resumed_counts,
    does_not_add_up,
    loop_global_step,
    step_in_flight,
)
from lightning_dp.run.prepare import MODEL_HISTORY_ATTR
from lightning_dp.slots import Sampler, Step

CHECKPOINT_KEY = "lightning_dp"


@dataclass
class ModelHistory:
    """Every release a model's weights have had, carried on the LightningModule (``lightning_dp_history``),
    so that a later fit by another strategy continues its ledger instead of restarting ε at zero."""

    ledger: dict[str, Any]
    """``PrivacyLedger.state_dict()`` of every release so far (its events, δ and accountant)."""
    num_samples: int | None
    """N of the training set those releases were made on."""
    owner: int | None = None
    """``id`` of the engine that wrote it in this process (None: read from a checkpoint)."""

    @property
    def delta(self) -> float:
        return float(self.ledger["delta"])

    def events(self) -> list[tuple[PrivacyEvent, int]]:
        return [(PrivacyEvent.from_dict(e["event"]), int(e["count"])) for e in self.ledger["history"]]

    def ledger_of_events(self) -> PrivacyLedger:
        """These releases in a ledger of their δ and accountant."""
        ledger = PrivacyLedger(delta=self.delta, accountant=self.ledger["accountant"])
        for event, count in self.events():
            ledger.record(event, count)
        return ledger

    def epsilon(self) -> float:
        """ε of these releases at their δ, with their accountant."""
        return float(self.ledger_of_events().epsilon())

    @classmethod
    def from_checkpoint(cls, checkpoint: dict[str, Any]) -> ModelHistory | None:
        """The history a checkpoint DPStrategy wrote holds (rank 0's ledger and N); None without one."""
        state = checkpoint.get(CHECKPOINT_KEY)
        if not isinstance(state, dict) or not isinstance(state.get("ledger"), dict):
            return None
        sampler = state.get("slots", {}).get("sampler", {}).get("state", {})
        n = sampler.get("num_samples") if isinstance(sampler, dict) else None
        return cls(ledger=state["ledger"], num_samples=int(n) if n else None)


def record_model_history(engine: PrivateStepEngine, module: Any) -> None:
    """Leave the engine's ledger (every release the model has had) on ``module`` for a later strategy."""
    if module is not None and engine.ledger.steps > engine.prior_events:  # it released something itself
        n = engine.sampler.size_for_releases or None
        setattr(module, MODEL_HISTORY_ATTR, ModelHistory(engine.ledger.state_dict(), n, owner=id(engine)))


def model_history(engine: PrivateStepEngine, module: Any) -> ModelHistory | None:
    """The privacy history ``module`` carries from another strategy (None: none, or this engine's own)."""
    history = getattr(module, MODEL_HISTORY_ATTR, None)
    if isinstance(history, dict):  # a checkpoint's privacy state (lightning_dp.load_from_checkpoint)
        history = ModelHistory.from_checkpoint({CHECKPOINT_KEY: history})
    if not isinstance(history, ModelHistory) or history.owner == id(engine) or not history.ledger["history"]:
        return None
    return history


def _continue_model_history(engine: PrivateStepEngine, history: ModelHistory) -> None:
    """A model privately trained before (by another strategy): its releases open this engine's ledger, or
    the fit is refused naming why the two cannot be added up."""
    if engine.prior_events and history.ledger_of_events().continues(engine.ledger.history):
        return  # this engine already opened its ledger with them (an earlier fit of it released nothing)
    earlier = f"This model was trained privately before ({history.epsilon():.4g} ε at δ={history.delta:g})"
    if engine.ledger.steps:
        raise DPConfigurationError(
            f"{earlier}, and this strategy has already trained another model: one ledger cannot hold both "
            "histories. Fit this model with a new DPStrategy; it continues the model's ledger."
        )
    if history.delta != engine.delta:
        raise DPConfigurationError(
            f"{earlier}, and this strategy uses delta={engine.delta:g}: ε adds up over a model's releases only "
            f"at one δ. Use delta={history.delta:g}, or train a fresh copy of the model (one never trained "
            "on this data) if its earlier releases must not count."
        )
    try:
        for event, count in history.events():
            engine.ledger.record(event, count)
    except ValueError as err:
        raise DPConfigurationError(
            f"{earlier}, and this strategy's ledger ({engine.accountant}) cannot price those releases: {err}. "
            "Use the accountant of the earlier fits."
        ) from err
    engine.carry_prior(engine.ledger.steps, history.num_samples)
    warnings.warn(
        f"lightning-dp: t{earlier[1:]}: {engine.prior_events} ledger events. Its ledger "
        f"continues from them, so ε and the report count every release the model has had"
        + (
            f", and target_epsilon={engine.target_epsilon:g} includes them." if engine.target_epsilon else "."
        ),
        stacklevel=3,
    )


def _check_prior_data(engine: PrivateStepEngine, public_changes: bool) -> None:
    """The earlier releases of the model must have been made on the same N (unless changes are public)."""
    before, n = engine.prior_num_samples, engine.sampler.size_for_releases
    if before is None or public_changes or before == n:
        return
    raise DPConfigurationError(
        f"This model was trained privately before on {_units(engine.sampler, before, ' examples')}; this fit "
        f"has {_units(engine.sampler, n)}. The ledger "
        "cannot continue across a different data set: the earlier releases' q and the examples they cover "
        "differ. Fit on the same training set, declare the change public with Checks(data_changes='public') (ε "
        "then adds up over both), or train a fresh copy of the model."
    )


class ResumeWindow:
    """From the start of a resume's restore until the train loader is bound (the resume is then complete), a
    checkpoint written (an interrupt, ``OnExceptionCheckpoint``) is the checkpoint being restored, not the
    half-restored state: a ledger partly reloaded, the loops not yet restored, the weights not yet loaded."""

    def __init__(self) -> None:
        self.path: Any = None
        self.weights_only: bool | None = None
        self.checkpoint: dict[str, Any] | None = None

    def begin(self, path: Any, weights_only: bool | None, fitting: bool) -> None:
        """A checkpoint is about to be read (a fit's resume opens the window; validate or test does not)."""
        self.path, self.weights_only, self.checkpoint = (path if fitting else None), weights_only, None

    def loaded(self, checkpoint: dict[str, Any]) -> None:
        self.checkpoint = dict(checkpoint)

    def end(self) -> None:
        self.path, self.checkpoint = None, None

    def restoring(self, load: Any) -> dict[str, Any] | None:
        """The checkpoint being restored (read again with ``load(path, weights_only)`` if the interrupt came
        while it was being read); None outside a resume, or when it cannot be read (nothing was restored)."""
        if self.path is not None and self.checkpoint is None:
            try:
                self.checkpoint = dict(load(self.path, weights_only=self.weights_only))
            except Exception:
                self.end()
        return self.checkpoint


@dataclass
class StepCounts:
    """How the engine's private steps and Lightning's optimizer steps (``global_step``) differ, counted as
    it happens, so that a run's own checkpoints always pass the resume check
    ``private steps − steps_outside_loop + silent_steps == global_step``."""

    silent_steps: int = 0
    """Optimizer steps Lightning counted that released nothing: batches the budget could not pay for
    under automatic optimization (forced by ``min_steps``/``min_epochs``, or a spent run resumed)."""
    steps_outside_loop: int = 0
    """Private steps Lightning's loop did not count: an empty batch's noise-only release under manual
    optimization (the user's optimizer steps are not called), and steps of earlier fits on another Trainer."""
    interrupted_steps: int = 0
    """Steps a checkpoint written in their middle (an interrupt, ``OnExceptionCheckpoint``) left unfinished,
    run again after the resume: what each had recorded stays (its ledger event, the slots' counters), so the
    ledger may hold an event and a slot a step more than the engine for each."""
    resumed_from: Any = None
    """The checkpoint this fit resumed from (None: a fresh fit)."""
    window: ResumeWindow = field(default_factory=ResumeWindow)
    """What a checkpoint written while this fit's resume restores holds (the checkpoint restored)."""
    model_history: Any = None
    """The fitted module's privacy history from another strategy (a :class:`ModelHistory`), continued at
    the first bind unless a checkpoint's weights and ledger replace it (``ckpt_path``)."""

    def start_fit(self, engine: PrivateStepEngine, trainer: Trainer) -> None:
        """A fit starts: steps this engine took before it (an earlier fit, another Trainer) are outside its loop."""
        self.resumed_from = None
        self.window.end()
        self.steps_outside_loop = engine.steps + self.silent_steps - trainer.global_step

    def released_nothing(self, module: LightningModule) -> None:
        """A sampled batch that releases nothing: Lightning still steps the optimizer under automatic optimization."""
        self.silent_steps += int(module.automatic_optimization)

    def noise_only(self, module: LightningModule) -> None:
        """An empty batch's noise-only release: under manual optimization no user optimizer step counts it."""
        self.steps_outside_loop += int(not module.automatic_optimization)

    def resume_in_flight(self, steps: int, global_step: int) -> None:
        """A checkpoint written inside a step was restored: the loop runs that step again, so a release it
        made counts as a private step outside the loop (a step that released nothing is not counted twice)."""
        ahead = steps - self.steps_outside_loop + self.silent_steps - global_step
        if ahead > 0:
            outside = min(steps, self.steps_outside_loop + ahead)
            self.silent_steps -= ahead - (outside - self.steps_outside_loop)
            self.steps_outside_loop = outside
        self.interrupted_steps += 1

    def state_dict(self) -> dict[str, int]:
        return {
            "silent_steps": self.silent_steps,
            "steps_outside_loop": self.steps_outside_loop,
            "interrupted_steps": self.interrupted_steps,
        }

    def load_state_dict(self, state: dict[str, Any], path: Any) -> None:
        self.silent_steps = int(state.get("silent_steps", 0))
        self.steps_outside_loop = int(state.get("steps_outside_loop", 0))
        self.interrupted_steps = int(state.get("interrupted_steps", 0))
        self.resumed_from = path


def gather_dp_state(engine: PrivateStepEngine, world_size: int, counts: StepCounts) -> dict[str, Any]:
    """Rank 0's privacy state plus every rank's own (its sampling and noise streams differ)."""
    state = dict(engine.state_dict(), **counts.state_dict())
    states: list[Any] = [state]
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        states = [None] * world_size
        dist.all_gather_object(states, state)
    return dict(states[0], ranks=states, world_size=world_size)


def _rank_dp_state(state: dict[str, Any], world_size: int, rank: int) -> dict[str, Any]:
    saved_world = state.get("world_size", 1)
    if saved_world != world_size:
        raise DPConfigurationError(
            f"The checkpoint was written by {saved_world} processes, this run has {world_size}. Each "
            "rank's sampling and noise streams are in the checkpoint and cannot be re-split; resume with "
            f"the same number of devices × nodes ({saved_world})."
        )
    ranks = state.get("ranks")
    return ranks[rank] if ranks else state


def restore_dp_state(
    engine: PrivateStepEngine,
    checkpoint: dict[str, Any],
    path: Any,
    world_size: int,
    rank: int,
    counts: StepCounts,
) -> None:
    """Load this rank's privacy state into ``engine``, refusing a checkpoint that would under-report ε
    or lower the ledger this process already holds."""
    state = checkpoint.get(CHECKPOINT_KEY)
    if state is None:
        raise DPConfigurationError(
            f"The checkpoint {path} has no privacy state (ledger, sampler and noise streams), "
            "so resuming would restart ε at zero. Resume only from checkpoints written by DPStrategy; "
            "to start DP training from non-private weights, load them into the module and call fit "
            "without ckpt_path."
        )
    counts.window.loaded(checkpoint)
    rank_state = _rank_dp_state(state, world_size, rank)
    check_privacy_state(rank_state, path)
    try:
        engine.ledger.check_continued_by(rank_state["ledger"])
    except ValueError as err:
        raise DPConfigurationError(_lowering_message(path, err)) from err
    try:
        engine.load_state_dict(rank_state)
    except ValueError as err:
        raise DPConfigurationError(str(err)) from err
    counts.load_state_dict(rank_state, path)
    counts.model_history = None  # the checkpoint's weights replace the module's, and its ledger is theirs
    in_flight = step_in_flight(checkpoint)
    check_resumed_counts(engine, rank_state, checkpoint, path, counts, in_flight)
    if in_flight:
        loop_steps = loop_global_step(checkpoint)
        counts.resume_in_flight(engine.steps, loop_steps if loop_steps is not None else engine.steps)
        engine.resume_inside_step()
        warnings.warn(IN_FLIGHT_WARNING.format(path=path), stacklevel=2)


IN_FLIGHT_WARNING = (
    "lightning-dp: the checkpoint {path} was written in the middle of a training step (an interrupt or an "
    "exception, e.g. by OnExceptionCheckpoint). Lightning runs that step again; whatever it had recorded is "
    "kept, so ε counts a release it may have made although its update never reached the weights."
)


def _lowering_message(path: Any, err: ValueError) -> str:
    return (
        f"Restoring the checkpoint {path} would lower this strategy's privacy ledger: {err}. Releases this "
        "process already made stay spent (a tuner or callback that trains, then restores the initial weights, "
        "does this). Resume with a new DPStrategy; the ε of the two runs then adds up."
    )


def check_resumed_data(engine: PrivateStepEngine, counts: StepCounts, public_changes: bool) -> None:
    """Once the sampler is bound: a resumed run must sample from the same N with the same q as the run it
    continues (unless the user declared data changes public), and its ledger must hold the events the
    restored slots make."""
    if counts.model_history is not None:
        _continue_model_history(engine, counts.model_history)
        counts.model_history = None
    _check_prior_data(engine, public_changes)
    path, counts.resumed_from = counts.resumed_from, None  # checked at the first bind after the resume
    if path is None:
        return
    if not public_changes:
        _check_same_shape(engine.sampler)
    problems = gradient_event_problems(engine, not public_changes, counts.interrupted_steps)
    if problems:
        raise DPConfigurationError(does_not_add_up(path, problems))


def gradient_event_problems(
    engine: PrivateStepEngine, exact_rate: bool = True, interrupted: int = 0
) -> list[str]:
    """Where the ledger's gradient events disagree with the restored sampler's q, noise slot's σ and the steps.

    Checked where one event per step follows from the slots alone: a constant σ, a sampler that does not
    schedule its own σ and a step slot that prices a gradient as the sampler's event (DP-SGD and the
    momentum steps, with any clipping). Other mechanisms' events depend on their own adaptive state, and
    only the counts are checked. ``exact_rate=False`` (data changes declared public) lets q vary.
    ``interrupted``: steps stopped in their middle and run again (``StepCounts.interrupted_steps``), each of
    which may have left one more event than the steps.
    """
    sampler, noise, step = engine.sampler, engine.noise, engine.step_slot
    if sampler.schedules_noise or not noise.is_constant or not noise.is_set:
        return []
    if type(step).gradient_event is not Step.gradient_event:
        return []
    expected = step.gradient_event(sampler, noise.noise_multiplier(engine.steps))

    def key(event: PrivacyEvent) -> object:  # what must match: the whole event, or σ alone when q may vary
        return event if exact_rate else (event.kind, event.to_dict().get("noise_multiplier"))

    own = _after(
        engine.ledger.history, engine.prior_events
    )  # the model's earlier releases are not these steps
    history = [(event, count) for event, count in own if event.kind == expected.kind]
    same = sum(count for event, count in history if key(event) == key(expected))
    others: Counter[PrivacyEvent] = Counter()
    for event, count in history:
        if key(event) != key(expected):
            others[event] += count
    problems = [
        f"its ledger holds {count} × {event!r}, but the restored {sampler.name} and {noise.name} make "
        f"{expected!r} at every step"
        for event, count in others.items()
    ]
    if not engine.steps <= same <= engine.steps + interrupted:
        problems.append(f"its ledger holds {same} × {expected!r} for {engine.steps} private steps")
    return problems


def _after(history: list[tuple[PrivacyEvent, int]], skip: int) -> list[tuple[PrivacyEvent, int]]:
    """A run-length history without its first ``skip`` events."""
    out = []
    for event, count in history:
        dropped = min(skip, count)
        skip -= dropped
        if count > dropped:
            out.append((event, count - dropped))
    return out


def _check_same_shape(sampler: Sampler) -> None:
    saved_n, saved_q = sampler.restored_shape
    if (
        not saved_n
        or saved_q is None
        or (saved_n, saved_q) == (sampler.size_for_releases, sampler.sample_rate)
    ):
        return  # (N = 0: written before the sampler was bound, e.g. interrupted in a fresh fit's set-up)
    raise DPConfigurationError(
        f"The checkpoint was trained on {_units(sampler, saved_n)} with sample rate {saved_q:.6g}; this run "
        f"has {_units(sampler, sampler.size_for_releases)}, rate {sampler.sample_rate:.6g}. The ledger cannot "
        "continue across a "
        f"different data set or batch size: {_shape_change(saved_n, saved_q, sampler)} Resume with the "
        "same training set and batch_size, or start a new run without ckpt_path (its ε then adds to "
        "the first run's)."
    )


def _shape_change(saved_n: int, saved_q: float, sampler: Sampler) -> str:
    """One sentence on what changed between the checkpoint's data and this run's, and what it does to q."""
    n, q = sampler.size_for_releases, sampler.sample_rate
    users = sampler.unit == "user"
    if n == saved_n:
        setting = "users_per_step" if users else "batch_size"
        return (
            f"the data set has the same {'U' if users else 'N'}, but {setting} changed q from {saved_q:.6g} "
            f"to {q:.6g}."
        )
    change = "shrank" if n < saved_n else "grew"
    return (
        f"the training set {change} from {saved_n} to {n} {'users' if users else 'examples'} (by "
        f"{abs(n - saved_n)}), which changed q from {saved_q:.6g} to {q:.6g}."
    )


def _units(sampler: Sampler, count: int, examples: str = "") -> str:
    """A count of the ledger's privacy units as a refusal names it: "N=211" (+ ``examples``) or "U=71 users"."""
    return f"U={count} users" if sampler.unit == "user" else f"N={count}{examples}"
