"""Each mechanism at its defaults, swapped into a DP-SGD config on the digits MLP at ε = 3, is within 2
points of DP-SGD's test accuracy or tells the user at run time what to change (issue #21).

A small configuration of docs/results.md's table (tests/mechanism_runs.py, bench/mechanisms.py): 12 epochs
instead of 20, mean over 3 seeds, every mechanism on the same seeds as DP-SGD, at DP-SGD's tuned lr for
ε = 3 (0.5). At 20 epochs (2026-11-27) AdaCliP, HeavyBall and Nesterov are within 0.2 points of DP-SGD
there; LineSearch is 3 points below and warns that its gradients get 1.32× DP-SGD's σ; Nesterov +
NoiseDividing is 3.7 points below and warns about its σ spread; AdaptiveGD reaches 19 % and warns that
the Trainer stopped it with budget left.
"""

from __future__ import annotations

import statistics

import pytest
from mechanism_runs import run

SEEDS = (0, 1, 2)
EPOCHS = 12
EPSILON = 3.0
WITHIN = 0.02


@pytest.fixture(scope="module")
def dp_sgd_accuracy() -> float:
    return statistics.mean(run("digits", "DP-SGD", seed, EPSILON, EPOCHS).accuracy for seed in SEEDS)


@pytest.mark.parametrize(
    "mechanism",
    [
        "LineSearch()",
        "AdaCliP()",
        "HeavyBall(beta=0.9)",
        "Nesterov(momentum=0.9)",
        "Nesterov(0.9) + NoiseDividing()",
    ],
)
def test_each_mechanism_at_its_defaults_is_within_two_points_or_says_what_to_change(
    mechanism, dp_sgd_accuracy
):
    results = [run("digits", mechanism, seed, EPSILON, EPOCHS) for seed in SEEDS]
    accuracy = statistics.mean(r.accuracy for r in results)
    said = sorted({s for r in results for s in r.said})
    assert all(r.epsilon <= EPSILON for r in results)
    assert accuracy >= dp_sgd_accuracy - WITHIN or said, (
        f"{mechanism}: accuracy {accuracy:.3f} vs DP-SGD {dp_sgd_accuracy:.3f}, and no run-time message"
    )


def test_adaptive_gd_on_the_users_minibatch_config_says_what_to_change():
    """DP-AGD is far below DP-SGD here (it spends its budget by itself and suits full batches): the run
    must say so and name the settings to change."""
    result = run("digits", "AdaptiveGD()", 0, EPSILON, 3)
    said = " ".join(result.said)  # each message's first 90 characters
    assert "as if it read the whole data set" in said  # minibatches buy no amplification: use the full batch
    assert "max_epochs=3 sto" in said  # the Trainer stopped it with budget left: let the budget be the stop
