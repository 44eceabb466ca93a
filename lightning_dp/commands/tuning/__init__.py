"""Private hyperparameter tuning: best of a secret random number K of DP trials, priced as one ledger event.

``tune(base_args, "search.yaml")`` draws K (Poisson, logarithmic, geometric or truncated negative
binomial; :mod:`lightning_dp.accounting.repeat_select`) and K hyperparameter settings i.i.d. from a fixed
search space, all from an ``os.urandom`` generator and before any trial. Every trial is an ordinary
``DPStrategy`` fit, scored by a noisy count; only the best trial's model, score and hyperparameters are
released, with the ε of the WHOLE search (PS22 Thm 2 or 6 on the planned trial curve) in a public report.
K, the number of trials, the other trials and their scores stay in ``<out_dir>/private`` (not for
release). What is and is not covered: docs/tuning.md.

Modules: ``space`` (search space, score, YAML), ``planning`` (events and ε before any trial), ``trials`` (one
DP fit and its noisy score), ``search`` (``tune``), ``reporting`` (what is released).
"""

from __future__ import annotations

from lightning_dp.accounting.repeat_select import Repetitions
from lightning_dp.commands.tuning.planning import TuningPlan, calibrate_tuning, plan
from lightning_dp.commands.tuning.reporting import plan_summary
from lightning_dp.commands.tuning.search import TuningResult, tune
from lightning_dp.commands.tuning.space import (
    Choice,
    LogUniform,
    Score,
    SearchSpace,
    SearchSpec,
    Uniform,
    load_search,
)
from lightning_dp.commands.tuning.trials import TrialOutcome, TrialRun

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
