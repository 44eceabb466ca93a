"""Kept for users' imports: re-exports :mod:`lightning_dp.commands.tuning`, this module's new home."""

from lightning_dp.commands.tuning import (
    Choice,
    LogUniform,
    Repetitions,
    Score,
    SearchSpace,
    SearchSpec,
    TrialOutcome,
    TrialRun,
    TuningPlan,
    TuningResult,
    Uniform,
    calibrate_tuning,
    load_search,
    plan,
    plan_summary,
    tune,
)

__all__ = [
    "Choice",
    "LogUniform",
    "Repetitions",
    "Score",
    "SearchSpace",
    "SearchSpec",
    "TrialOutcome",
    "TrialRun",
    "TuningPlan",
    "TuningResult",
    "Uniform",
    "calibrate_tuning",
    "load_search",
    "plan",
    "plan_summary",
    "tune",
]
