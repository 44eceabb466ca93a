"""The one-run privacy audit (Steinke, Nasr & Jagielski 2023): the bound, and audits of real runs.

Each mechanism must (a) audit at or below its claimed ε when it runs correctly and (b) audit far
above it when its noise is silently dropped. New mechanisms join by one line in ``MECHANISMS``.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from audits import audit_trainer, dropped_noise
from scipy import stats

from lightning_dp import DPIS, AdaCliP, DPStrategy, HeavyBall, LineSearch
from lightning_dp.commands.audit import audit
from lightning_dp.commands.audit_bound import default_guesses, epsilon_lower_bound, evaluate_guesses, p_value
from recipes import DigitsDataModule, ImageClassifier

ROOT = Path(__file__).resolve().parents[2]
CLAIMED = 1.0  # the target ε of every audited run

# name → extra DPStrategy arguments: every mechanism of the library passes its audit.
MECHANISMS: dict[str, Callable[[], dict[str, Any]]] = {
    "dp-sgd": dict,
    "adaclip": lambda: {"clipping": AdaCliP(h1=1e-3, h2=1.0, init_std=0.1)},
    "dpis": lambda: {"sampler": DPIS(k=3, seed=3, sigma_N=50, sigma_K=50)},
    "line-search": lambda: {"step": LineSearch(mode="nn")},
    "heavy-ball": lambda: {"step": HeavyBall(beta=0.5)},
}


# -- the bound ------------------------------------------------------------------------------------
@pytest.mark.parametrize("r", [10, 100, 1000])
@pytest.mark.parametrize("confidence", [0.95, 0.99])
def test_all_correct_guesses_give_the_closed_form(r, confidence):
    """δ = 0, r of r correct: P[W ≥ r] = p^r = 1 − confidence, so ε = log(p/(1−p)) with p = (1−c)^(1/r)."""
    p = (1 - confidence) ** (1 / r)
    assert epsilon_lower_bound(r, r, r, 0.0, confidence) == pytest.approx(math.log(p / (1 - p)), abs=1e-5)


def test_hand_computed_values():
    # 10 of 10 correct at 95 %: p = 0.05^0.1 = 0.741134, ε = log(0.741134/0.258866) = 1.05188.
    assert epsilon_lower_bound(10, 10, 10, 0.0, 0.95) == pytest.approx(1.05188, abs=1e-4)
    # At ε = 0 the guesses are fair coins: P[≥ 9 of 10] = 11/1024.
    assert p_value(10, 10, 9, 0.0, 0.0) == pytest.approx(11 / 1024)
    # 9 of 10 is below 95 % evidence only if 11/1024 ≥ 0.05; it is not, so some ε > 0 is rejected.
    assert epsilon_lower_bound(10, 10, 9, 0.0, 0.95) > 0
    # Half right is what chance gives: nothing is rejected.
    assert epsilon_lower_bound(1000, 1000, 500, 0.0, 0.95) == 0.0


def test_p_value_is_the_binomial_tail_plus_theorem_3s_delta_term():
    m, r, v, eps, delta = 1000, 200, 150, 1.0, 1e-5
    q = math.exp(eps) / (1 + math.exp(eps))
    tail = stats.binom.sf(v - 1, r, q)
    alpha = max(
        (stats.binom.cdf(v - 1, r, q) - stats.binom.cdf(v - 1 - i, r, q)) / i for i in range(1, v + 1)
    )
    assert p_value(m, r, v, eps, delta) == pytest.approx(tail + 2 * m * delta * alpha, rel=1e-9)
    assert p_value(m, r, v, eps, 0.0) == pytest.approx(tail, rel=1e-12)


def test_bound_grows_with_correct_guesses_and_shrinks_with_delta():
    bounds = [epsilon_lower_bound(1000, 200, v, 1e-5) for v in (120, 150, 180, 200)]
    assert bounds == sorted(bounds)
    assert bounds[0] > 0
    assert epsilon_lower_bound(1000, 200, 180, 1e-3) < epsilon_lower_bound(1000, 200, 180, 0.0)


def test_trying_several_guess_counts_pays_a_union_bound():
    included = torch.rand(256, generator=torch.Generator().manual_seed(0)) < 0.5
    scores = included.double()  # perfect separation
    eps_one, r, v = evaluate_guesses(scores, included, 0.0, 0.95, guesses=[(64, 64)])
    assert (r, v) == (128, 128)
    assert eps_one == pytest.approx(epsilon_lower_bound(256, 128, 128, 0.0, 0.95), abs=1e-5)
    eps_many, _, _ = evaluate_guesses(scores, included, 0.0, 0.95, guesses=[(64, 64), (8, 0)])
    assert eps_many == pytest.approx(epsilon_lower_bound(256, 128, 128, 0.0, 0.975), abs=1e-5)
    assert len(default_guesses(256)) == 8


# -- audits of real runs -------------------------------------------------------------------------------
def run_audit(
    mechanism: str, canary: str, broken: bool, tmp_path, steps: int = 100, lr: float = 2.0, **options: Any
):
    extra = MECHANISMS[mechanism]()
    strategy = DPStrategy(target_epsilon=CLAIMED, seed=0, **extra)
    trainer = audit_trainer(strategy, steps, tmp_path)
    torch.manual_seed(0)
    model = ImageClassifier(arch="logreg", in_features=64, lr=lr)
    with warnings.catch_warnings(), dropped_noise(broken):
        warnings.simplefilter("ignore")
        return audit(
            trainer,
            model,
            DigitsDataModule(batch_size=64, flatten=True),
            canary=canary,
            num_canaries=256,
            seed=1,
            **options,
        )


@pytest.mark.parametrize("canary", ["gradient", "input"])
@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_correct_run_audits_at_or_below_its_claim(mechanism, canary, tmp_path):
    result = run_audit(mechanism, canary, broken=False, tmp_path=tmp_path)
    assert result.claimed_epsilon == pytest.approx(CLAIMED, abs=0.01)
    assert result.epsilon_lower_bound <= result.claimed_epsilon
    assert result.passed
    report = json.loads((tmp_path / "privacy_report.json").read_text())
    assert report["audit"]["epsilon_lower_bound"] == result.epsilon_lower_bound
    assert report["audit"]["num_canaries"] == 256
    assert report["audit"]["canary"] == canary
    assert (tmp_path / "privacy_audit.png").stat().st_size > 0


@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_run_without_noise_audits_far_above_its_claim(mechanism, tmp_path):
    result = run_audit(mechanism, "gradient", broken=True, tmp_path=tmp_path)
    assert result.claimed_epsilon == pytest.approx(CLAIMED, abs=0.01)
    assert result.epsilon_lower_bound > 3 * result.claimed_epsilon, result
    assert not result.passed


# The black-box canaries need a large learning rate to leave a trace; the line search picks its own
# step sizes (at most η0 = 1), so without noise it is caught by the white-box audit only.
BLACK_BOX = sorted(set(MECHANISMS) - {"line-search"})


@pytest.mark.parametrize("mechanism", BLACK_BOX)
def test_run_without_noise_fails_the_black_box_audit(mechanism, tmp_path):
    """Black-box canaries only act through training, so they need more steps and still see less."""
    result = run_audit(mechanism, "input", broken=True, tmp_path=tmp_path, steps=300, lr=8.0)
    assert result.claimed_epsilon == pytest.approx(CLAIMED, abs=0.01)
    assert result.epsilon_lower_bound > result.claimed_epsilon, result
    assert not result.passed


def test_canaries_on_model_coordinates_see_the_missing_noise_through_real_gradients(tmp_path):
    """placement='model': the real gradients on the canary coordinates blur the scores (weaker)."""
    broken = run_audit("dp-sgd", "gradient", broken=True, tmp_path=tmp_path, placement="model")
    correct = run_audit("dp-sgd", "gradient", broken=False, tmp_path=tmp_path, placement="model")
    assert broken.epsilon_lower_bound > 0.25
    assert correct.epsilon_lower_bound <= correct.claimed_epsilon


def test_cli_audit_exits_1_when_the_noise_is_missing(tmp_path, capsys):
    from lightning_dp.commands.cli import main

    args = ["audit", "--config", str(ROOT / "configs" / "digits_dpsgd.yaml"), "--trainer.max_epochs", "4"]
    args += ["--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"]
    args += ["--trainer.strategy.init_args.noise", "audits.SilentNoise", "--audit_seed", "0"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    assert "lightning-dp audit: claimed ε = 2.9" in out
    assert "FAILED: the run leaks more than claimed" in out
    (report,) = tmp_path.rglob("privacy_report.json")
    audit_field = json.loads(report.read_text())["audit"]
    assert audit_field["passed"] is False
    assert audit_field["epsilon_lower_bound"] > audit_field["claimed_epsilon"]
