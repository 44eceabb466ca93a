"""``tune``: run the private search, keep its private state apart, release only the best trial with the whole search's ε."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightning_dp.accounting.ledger import PrivacyLedger
from lightning_dp.commands.tuning.planning import PlanFn, TuningPlan, override_args, plan
from lightning_dp.commands.tuning.reporting import (
    log_release_to_loggers,
    plot_tuning_epsilon,
    public_checkpoint,
    tuning_report,
)
from lightning_dp.commands.tuning.space import Score, SearchSpec, load_search
from lightning_dp.commands.tuning.trials import TrialRun, TrialRunner, check_realised, run_lightning_trial
from lightning_dp.core.errors import DPConfigurationError

_STATE_VERSION = 1


# ----------------------------------------------------------------------------------------------- tune
@dataclass
class TuningResult:
    """The public result: ε of the whole search, the selected overrides and score (None if nothing released)."""

    epsilon: float
    delta: float
    order: float
    selected: dict[str, Any] | None
    report_path: Path
    plot_path: Path
    checkpoint: Path | None


def _fingerprint(base_args: Sequence[str], spec: SearchSpec) -> str:
    """SHA-256 of the base args, the files they name (configs) and the search: a resume must match it (I9)."""
    digest = hashlib.sha256()
    for arg in base_args:
        digest.update(arg.encode())
        for part in (arg, arg.split("=", 1)[-1]):
            if os.path.isfile(part):
                digest.update(Path(part).read_bytes())
    search = {
        "candidates": spec.space.to_dict(),
        "repetitions": spec.repetitions.to_dict(),
        "score": vars(spec.score),
        "budget": [spec.target_epsilon, spec.delta],
    }
    digest.update(json.dumps(search, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def _write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (a crash leaves the old file or the new one, never half of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _new_state(spec: SearchSpec, fingerprint: str, seed: int | None) -> dict[str, Any]:
    """Draw K, θ_1..θ_K, the tie-breakers u_i and the score noises z_i, all before any trial (I1, I3)."""
    rng = np.random.default_rng(seed if seed is not None else int.from_bytes(os.urandom(16), "little"))
    k = spec.repetitions.sample(rng)
    return {
        "version": _STATE_VERSION,
        "fingerprint": fingerprint,
        "seed_given": seed is not None,
        "repetitions": spec.repetitions.to_dict(),
        "K": k,
        "thetas": [spec.space.sample(rng) for _ in range(k)],
        "u": [float(rng.uniform()) for _ in range(k)],
        "z": [float(rng.standard_normal()) for _ in range(k)],
        "trials": [{"status": "pending", "score": None, "checkpoint": None} for _ in range(k)],
    }


def _load_state(path: Path, fingerprint: str, spec: SearchSpec) -> dict[str, Any]:
    """The stored draws (the only source of K, θ, u, z, γ on resume); refuses a changed config or search."""
    with open(path) as f:
        state: dict[str, Any] = json.load(f)
    if state.get("version") != _STATE_VERSION or state.get("fingerprint") != fingerprint:
        raise DPConfigurationError(
            f"{path} was written for another config, search file or score; resuming with a changed setup would "
            "not be covered by the tuned ε. Restore the original files, or start a new search in a new --out_dir"
        )
    if float.fromhex(state["repetitions"]["gamma_hex"]) != spec.repetitions.gamma:
        raise DPConfigurationError(f"{path} stores another γ for K; start a new search in a new --out_dir")
    return state


def _select(state: Mapping[str, Any]) -> int | None:
    """Index of the maximum of (score, u) over the trials, failures and NaN scoring −∞ (I10); None if K = 0."""
    best: tuple[float, float] | None = None
    index = None
    for i, (trial, u) in enumerate(zip(state["trials"], state["u"], strict=True)):
        score = trial["score"]
        value = -math.inf if score is None or math.isnan(score) else float(score)
        if best is None or (value, u) > best:
            best, index = (value, u), i
    if index is None or best is None or best[0] == -math.inf:
        return None
    return index


def tune(
    base_args: Sequence[str],
    search: SearchSpec | str | os.PathLike[str] | Mapping[str, Any],
    *,
    out_dir: str | os.PathLike[str] = "runs/tune",
    resume: bool = False,
    seed: int | None = None,
    runner: TrialRunner | None = None,
    plan_fn: PlanFn | None = None,
    log_release: bool = True,
    ledger: str | os.PathLike[str] | None = None,
) -> TuningResult:
    """Run a private search and release only the best trial; returns ε of the whole search and the winner.

    Args:
        base_args: LightningCLI arguments of one trial (``["--config", "configs/digits_dpsgd.yaml"]``).
        search: the search: a YAML file, a dict or a :class:`SearchSpec` (docs/tuning.md, "The search file").
        out_dir: where the released model and report (``release/``) and the private state (``private/``)
            go (default ``"runs/tune"``).
        resume: finish the search stored in ``out_dir`` instead of starting one (default False).
        seed: for tests only: it makes K public (the report says ``seed_given``); default None (``os.urandom``).
        runner: replaces the Lightning trial (tests); default None.
        plan_fn: replaces the planner that prices each trial (tests); default None.
        log_release: send the search's ε and the selected setting to every logger of the base config
            (default True).
        ledger: a JSON file with a ``PrivacyLedger.state_dict()`` of earlier releases on the same data (other
            searches, retraining); the search is recorded into it once, and the report gives the ledger's
            total ε too. Default None.
    """
    spec = search if isinstance(search, SearchSpec) else load_search(search)
    tuning_plan = plan(base_args, spec, plan_fn=plan_fn)
    out = Path(out_dir)
    private, release = out / "private", out / "release"
    state_path = private / "state.json"
    state = _open_state(state_path, out, _fingerprint(base_args, spec), spec, seed, resume)
    run_trial = runner or run_lightning_trial
    for i, trial in enumerate(state["trials"]):
        if trial["status"] in ("done", "failed"):
            continue  # never rerun a finished trial (I9); a failed one still counts (I8)
        _run_one(run_trial, tuning_plan, state, i, base_args, private / f"trial_{i}", spec.score)
        _write_json(state_path, state)
    return _release(tuning_plan, state, release, log_release, base_args, ledger)


def _open_state(
    state_path: Path, out: Path, fingerprint: str, spec: SearchSpec, seed: int | None, resume: bool
) -> dict[str, Any]:
    """The search's private state: the stored one (``resume``), else a new draw of K and θ, written at once."""
    if resume:
        if not state_path.exists():
            raise DPConfigurationError(
                f"--resume: no search state at {state_path}; drop --resume to start one"
            )
        state = _load_state(state_path, fingerprint, spec)
        if seed is not None:
            warnings.warn("--seed is ignored on --resume: K and θ come from the stored state", stacklevel=3)
        return state
    if state_path.exists():
        raise DPConfigurationError(
            f"{out} already holds a search; pass --resume to finish it, or choose a new --out_dir (a new "
            "draw of K on the same data would be a second, separately priced search)"
        )
    if seed is not None:
        warnings.warn(
            "tune(seed=...) makes K and the hyperparameter draws reproducible, hence public: the tuned ε does "
            "not cover that. Use it for tests only",
            stacklevel=3,
        )
    state = _new_state(spec, fingerprint, seed)
    _write_json(state_path, state)
    return state


def _run_one(
    run_trial: TrialRunner,
    tuning_plan: TuningPlan,
    state: dict[str, Any],
    i: int,
    base_args: Sequence[str],
    directory: Path,
    score: Score,
) -> None:
    """Run trial ``i`` in a fresh ``directory`` and record its outcome in ``state`` (a crash scores −∞)."""
    trial, theta = state["trials"][i], state["thetas"][i]
    if directory.exists():
        shutil.rmtree(directory)  # an interrupted trial restarts from scratch with the same θ
    directory.mkdir(parents=True)
    overrides = tuning_plan.trial_overrides(theta)
    args = [
        *base_args,
        *override_args(overrides),
        *(["--trainer.limit_val_batches=0"] if score.private else []),
        "--trainer.enable_progress_bar=false",  # one bar per trial on the console would count K
        f"--trainer.default_root_dir={directory}",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.init_args.save_dir={directory}",
    ]
    index = tuning_plan.combination_of(theta)
    planned = tuning_plan.trials[index].history(tuning_plan.sigmas[index])
    try:
        outcome = run_trial(TrialRun(args, directory, score))
    except DPConfigurationError:
        raise
    except Exception as err:  # a crashed trial counts as one of the K and scores −∞ (I8)
        trial.update(status="failed", score=None, error=f"{type(err).__name__}: {err}")
    else:
        check_realised(outcome, planned)
        noisy = outcome.correct + (score.noise_multiplier * state["z"][i] if score.private else 0.0)
        trial.update(
            status="done",
            score=noisy / max(outcome.n, 1),
            checkpoint=None if outcome.checkpoint is None else str(outcome.checkpoint),
        )


def _release(
    tuning_plan: TuningPlan,
    state: dict[str, Any],
    release: Path,
    log_release: bool,
    base_args: Sequence[str],
    ledger_path: str | os.PathLike[str] | None = None,
) -> TuningResult:
    """Write the public report and plot, copy the winner's checkpoint, log ε to the user's loggers."""
    release.mkdir(parents=True, exist_ok=True)
    ledger = tuning_plan.ledger()
    epsilon, order = ledger.epsilon_and_order()
    winner = _select(state)
    selected = None
    checkpoint = None
    if winner is not None:
        trial = state["trials"][winner]
        if trial["checkpoint"]:
            checkpoint = release / "model.ckpt"
            public_checkpoint(Path(trial["checkpoint"]), checkpoint)
        selected = {
            "overrides": state["thetas"][winner],
            "score": trial["score"],
            "checkpoint": None if checkpoint is None else checkpoint.name,
        }
    report = tuning_report(tuning_plan, selected, seed_given=bool(state["seed_given"]))
    if ledger_path is not None:
        report["ledger_epsilon"] = _record_in_ledger(tuning_plan, state, Path(ledger_path))
        _write_json(release.parent / "private" / "state.json", state)
    report_path = release / "tuning_report.json"
    _write_json(report_path, report)
    plot_path = release / "tuning_epsilon.png"
    plot_tuning_epsilon(tuning_plan, plot_path)
    if log_release:
        log_release_to_loggers(base_args, report)
    return TuningResult(
        epsilon, tuning_plan.delta, float(order or math.nan), selected, report_path, plot_path, checkpoint
    )


def _record_in_ledger(tuning_plan: TuningPlan, state: dict[str, Any], path: Path) -> float:
    """Record the search in the project ledger at ``path`` (once, even across resumes); its ε at the plan's δ."""
    ledger = PrivacyLedger(tuning_plan.delta)
    if path.exists():
        with open(path) as f:
            ledger.load_state_dict(json.load(f))
    if not state.get("recorded_in_ledger"):
        ledger.record(tuning_plan.event())
        _write_json(path, ledger.state_dict())
        state["recorded_in_ledger"] = True
    return ledger.epsilon()


#: The DP state a released checkpoint keeps: the ledger and step count are data-independent. The noise and
#: sampling generator states are not released: Mersenne Twister can be run backwards, so a generator's
#: final state would give away every noise draw of the trial.
