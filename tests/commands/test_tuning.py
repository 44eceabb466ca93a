"""Private tuning (``lightning_dp/commands/tuning/``, issue #20): planning, and tune()'s invariants.

Invariant tests use stub trials (no training); one end-to-end test runs two very short digits fits. The
RepeatAndSelect bound that prices a search is tested in ``tests/accounting/test_repeat_select.py``.
"""

from __future__ import annotations

import io
import json
import math
import re
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_dp import DPConfigurationError
from lightning_dp.accounting import (
    DEFAULT_ORDERS,
    Gaussian,
    PoissonGaussian,
    PrivacyLedger,
    RepeatAndSelect,
    Repetitions,
    epsilon_from_rdp,
)
from lightning_dp.commands.tuning import (
    Score,
    TrialOutcome,
    TrialRun,
    calibrate_tuning,
    load_search,
    plan,
    tune,
)
from lightning_dp.commands.tuning.planning import TrialPlan
from tests.accounting.test_repeat_select import SIGMA, Q, digits_ledger, tuned

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ["--config", str(ROOT / "configs" / "digits_dpsgd.yaml")]


# -------------------------------------------------------------------------------------- T6: planning
def test_plan_batch_sizes_with_the_real_planner() -> None:
    """batch_size changes q: it is planned per choice, and the search is priced on the max curve."""
    search = {
        "repetitions": {"distribution": "poisson", "mean": 10},
        "candidates": {
            "data.init_args.batch_size": {"choice": [64, 128, 256]},
            "model.init_args.lr": [0.3, 1.0],
        },
        "score": {"source": "public"},
    }
    tuning_plan = plan([*DIGITS, "--trainer.strategy.init_args.noise_multiplier=2.828125"], search)
    assert tuning_plan.relevant_keys == ["data.init_args.batch_size"]
    rows = tuning_plan.per_candidate()
    np.testing.assert_allclose([r["epsilon"] for r in rows], [2.012931, 2.985761, 4.442525], atol=1e-6)
    assert [r["steps"] for r in rows] == [600, 300, 150]
    assert tuning_plan.epsilon == pytest.approx(9.421591, abs=1e-6)
    assert [r["sample_rate"] for r in rows] == pytest.approx([64 / 1257, 128 / 1257, 256 / 1257], rel=1e-15)


def _stub_planner(args: Any, score: Score) -> TrialPlan:
    """A planner without Lightning: 10 steps per epoch, max_epochs from the args (default 30), σ = 2.828125."""
    epochs = 30.0
    for arg in args:
        if arg.startswith("--trainer.max_epochs="):
            epochs = float(arg.split("=", 1)[1])
    return TrialPlan(Q, int(10 * epochs), SIGMA, 1e-5)


def test_continuous_key_that_changes_the_cost_is_refused() -> None:
    search = {
        "repetitions": {"distribution": "geometric", "mean": 5},
        "candidates": {"trainer.max_epochs": {"uniform": [10, 30]}},
    }
    with pytest.raises(
        DPConfigurationError,
        match=re.escape("key trainer.max_epochs changes the privacy cost; give it as a choice"),
    ):
        plan([], search, plan_fn=_stub_planner)
    search["candidates"] = {"trainer.max_epochs": {"choice": [10, 30]}}
    assert plan([], search, plan_fn=_stub_planner).relevant_keys == ["trainer.max_epochs"]


@pytest.mark.parametrize(
    ("reps", "sigma"),
    [
        (Repetitions.poisson(10), 5.699780),
        (Repetitions.logarithmic(10), 4.405527),
        (Repetitions.geometric(10), 5.205624),
    ],
)
def test_calibrate_tuning_meets_the_total(reps: Repetitions, sigma: float) -> None:
    trial = TrialPlan(Q, 300, SIGMA, 1e-5)
    sigmas, targets = calibrate_tuning(3.0, 1e-5, [trial], reps)
    assert 0.9999 * sigma <= sigmas[0] <= 1.02 * sigma
    eps = tuned(trial.history(sigmas[0]), reps)[0]
    assert 2.9 < eps <= 3.0
    assert epsilon_from_rdp(digits_ledger(sigmas[0]).rdp, DEFAULT_ORDERS, 1e-5)[0] <= targets[0]


def test_calibrate_tuning_prices_the_score_release() -> None:
    """Budget mode at total 3, Poisson(3): the noisy validation count is part of every trial's curve."""
    sigmas, _ = calibrate_tuning(
        3.0, 1e-5, [TrialPlan(Q, 300, SIGMA, 1e-5)], Repetitions.poisson(3), score_event=Gaussian(10.0)
    )
    assert 0.9999 * 3.782988 <= sigmas[0] <= 1.02 * 3.782988
    assert (
        tuned([(PoissonGaussian(sigmas[0], Q), 300), (Gaussian(10.0), 1)], Repetitions.poisson(3))[0] <= 3.0
    )


def test_calibrate_tuning_refuses_an_impossible_plan() -> None:
    # a noiseless-enough score release alone costs more than the total
    with pytest.raises(DPConfigurationError, match="no per-trial budget meets total target_epsilon"):
        calibrate_tuning(
            0.5, 1e-5, [TrialPlan(Q, 300, SIGMA, 1e-5)], Repetitions.poisson(10), score_event=Gaussian(0.5)
        )


# ------------------------------------------------------------------------- T7/T8: invariants (stubs)
class StubRunner:
    """Records calls; returns a fixed count per call (or raises), and the planned RDP (or more)."""

    def __init__(
        self,
        counts: list[float] | None = None,
        fail_at: set[int] = frozenset(),
        overspend: bool = False,
        interrupt_after: int | None = None,
    ) -> None:
        self.calls: list[TrialRun] = []
        self.counts, self.fail_at, self.overspend, self.interrupt_after = (
            counts,
            fail_at,
            overspend,
            interrupt_after,
        )

    def __call__(self, run: TrialRun) -> TrialOutcome:
        if self.interrupt_after is not None and len(self.calls) == self.interrupt_after:
            raise KeyboardInterrupt
        i = len(self.calls)
        self.calls.append(run)
        if i in self.fail_at:
            raise RuntimeError("trial crashed")
        ledger = digits_ledger(SIGMA * (0.9 if self.overspend else 1.0))
        count = 50.0 if self.counts is None else self.counts[i % len(self.counts)]
        ckpt = run.directory / "model.ckpt"
        dp_state = {"version": 1, "steps": 300, "ledger": {}, "noise_generator": torch.ones(3), "slots": {}}
        torch.save({"state_dict": {"w": torch.full((2,), float(i))}, "lightning_dp": dp_state}, ckpt)
        return TrialOutcome(count, 100, ledger.rdp, ledger.orders, ckpt)


SEARCH = {
    "repetitions": {"distribution": "geometric", "mean": 4},
    "candidates": {"model.init_args.lr": {"log_uniform": [0.1, 3.0]}},
    "score": {"source": "public"},
}


def _seed_with(reps: Repetitions, accept: Any) -> int:
    """A seed whose first draw of K (the tuner's first draw) satisfies ``accept``."""
    return next(s for s in range(1000) if accept(reps.sample(np.random.default_rng(s))))


def _state(out: Path) -> dict[str, Any]:
    return json.loads((out / "private" / "state.json").read_text())


def _run(tmp_path: Path, runner: StubRunner, search: dict[str, Any] = SEARCH, **kw: Any) -> Any:
    kw.setdefault("out_dir", tmp_path / "tune")
    with pytest.warns(UserWarning, match="seed"):
        return tune([], search, runner=runner, plan_fn=_stub_planner, log_release=False, **kw)


def test_all_k_trials_run_and_the_report_hides_k(tmp_path: Path) -> None:
    reps = load_search(SEARCH).repetitions
    seed = _seed_with(reps, lambda k: k >= 3)
    runner = StubRunner(counts=[10.0, 90.0, 40.0], fail_at={0})
    result = _run(tmp_path, runner, seed=seed)
    state = _state(tmp_path / "tune")
    k = state["K"]
    assert len(runner.calls) == k >= 3  # no early stop, the crashed trial counted
    assert state["trials"][0]["status"] == "failed"
    best = max(range(1, k), key=lambda i: (state["trials"][i]["score"], state["u"][i]))
    assert result.selected["overrides"] == state["thetas"][best]
    assert result.selected["score"] == state["trials"][best]["score"]
    released = torch.load(result.checkpoint, weights_only=False)
    trained = torch.load(state["trials"][best]["checkpoint"], weights_only=False)
    torch.testing.assert_close(released["state_dict"], trained["state_dict"])
    assert sorted(released["lightning_dp"]) == ["ledger", "steps", "version"]  # no generator state (I13)
    text = result.report_path.read_text()
    report = json.loads(text)
    assert "K" not in report
    assert "trial_" not in text
    others = {state["trials"][i]["score"] for i in range(k) if i != best} - {
        None,
        report["selected"]["score"],
    }
    assert not any(re.search(re.escape(repr(s)), text) for s in others)
    assert report["epsilon"] == pytest.approx(tuned(digits_ledger().history, reps)[0], rel=1e-15)
    assert report["seed_given"] is True
    assert result.plot_path.stat().st_size > 0
    assert sorted(p.name for p in (tmp_path / "tune" / "release").iterdir()) == [
        "model.ckpt",
        "tuning_epsilon.png",
        "tuning_report.json",
    ]


def test_ties_are_broken_by_u_not_by_index(tmp_path: Path) -> None:
    reps = load_search(SEARCH).repetitions
    seed = _seed_with(reps, lambda k: k >= 3)
    result = _run(tmp_path, StubRunner(counts=[70.0]), seed=seed)
    state = _state(tmp_path / "tune")
    assert result.selected["overrides"] == state["thetas"][int(np.argmax(state["u"]))]


def test_k_zero_releases_nothing_but_charges(tmp_path: Path) -> None:
    search = {**SEARCH, "repetitions": {"distribution": "poisson", "mean": 1}}
    seed = _seed_with(Repetitions.poisson(1), lambda k: k == 0)
    runner = StubRunner()
    result = _run(tmp_path, runner, search=search, seed=seed)
    assert runner.calls == []
    assert result.selected is None
    assert result.checkpoint is None
    assert json.loads(result.report_path.read_text())["epsilon"] == pytest.approx(
        tuned(digits_ledger().history, Repetitions.poisson(1))[0], rel=1e-15
    )


def test_overspending_trial_stops_the_release(tmp_path: Path) -> None:
    seed = _seed_with(load_search(SEARCH).repetitions, lambda k: k >= 1)
    with pytest.raises(DPConfigurationError, match="spent more privacy than its plan"):
        _run(tmp_path, StubRunner(overspend=True), seed=seed)
    assert not (tmp_path / "tune" / "release").exists()


def test_resume_reuses_k_and_theta(tmp_path: Path) -> None:
    reps = load_search(SEARCH).repetitions
    seed = _seed_with(reps, lambda k: k >= 3)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, StubRunner(interrupt_after=2), seed=seed)
    before = _state(tmp_path / "tune")
    assert [t["status"] for t in before["trials"]][:3] == ["done", "done", "pending"]
    with pytest.raises(DPConfigurationError, match="already holds a search"):
        tune(
            [],
            SEARCH,
            runner=StubRunner(),
            plan_fn=_stub_planner,
            log_release=False,
            out_dir=tmp_path / "tune",
        )
    changed = {**SEARCH, "candidates": {"model.init_args.lr": {"log_uniform": [0.1, 5.0]}}}
    with pytest.raises(DPConfigurationError, match="another config, search file or score"):
        tune(
            [],
            changed,
            runner=StubRunner(),
            plan_fn=_stub_planner,
            log_release=False,
            out_dir=tmp_path / "tune",
            resume=True,
        )
    runner = StubRunner()
    result = _run(tmp_path, runner, seed=seed + 1, resume=True)  # a new seed is ignored
    after = _state(tmp_path / "tune")
    assert len(runner.calls) == before["K"] - 2
    assert (after["K"], after["thetas"], after["u"]) == (before["K"], before["thetas"], before["u"])
    assert after["trials"][:2] == before["trials"][:2]
    fresh = tune(
        [], SEARCH, runner=StubRunner(), plan_fn=_stub_planner, log_release=False, out_dir=tmp_path / "b"
    )
    assert result.epsilon == fresh.epsilon  # bit-identical: ε comes from the plan, not the trials


# ---------------------------------------------------------------------------------- T9: refusals
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"repetitions": {"mean": 10}}, "repetitions.distribution is required and has no default"),
        ({"repetitions": {"distribution": "poisson", "mean": 0.5}}, "needs mean >= 1"),
        ({"candidates": {"trainer.strategy.init_args.seed": [1, 2]}}, "fix the trials' noise seed"),
        ({"score": {"source": "train_loss"}}, "score source 'train_loss' is not covered"),
    ],
)
def test_search_refusals(change: dict[str, Any], message: str) -> None:
    with pytest.raises(DPConfigurationError, match=re.escape(message)):
        load_search({**SEARCH, **change})


def test_a_declared_dataset_size_fixes_the_trials_rate_and_steps() -> None:
    """dataset_size=: the tuner plans q = B/N_pub and ⌈N_pub/B⌉ steps an epoch, never the real N (1257)."""
    from lightning_dp.commands.tuning.planning import plan_from_args

    real = plan_from_args(DIGITS, Score("public"))
    for declared in (600, 5000):
        plan = plan_from_args(
            [*DIGITS, f"--trainer.strategy.init_args.dataset_size={declared}"], Score("public")
        )
        assert plan.sample_rate == pytest.approx(real.sample_rate * 1257 / declared)
        assert plan.steps == real.steps // math.ceil(1257 / 128) * math.ceil(declared / 128)


def test_monitor_callbacks_and_prv_are_refused_and_cli_plan_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lightning_dp.commands.cli import main
    from lightning_dp.commands.tuning.planning import plan_from_args

    args = [*DIGITS, "--trainer.callbacks+=EarlyStopping", "--trainer.callbacks.monitor=val_acc"]
    with pytest.raises(DPConfigurationError, match="monitor a metric of private data"):
        plan_from_args(args, Score("private_validation"))
    with pytest.raises(
        DPConfigurationError, match=re.escape("set trainer.strategy.init_args.accountant: rdp")
    ):
        plan_from_args([*DIGITS, "--trainer.strategy.init_args.accountant=prv"], Score("public"))
    search = ROOT / "configs" / "digits_tune_search.yaml"
    out = io.StringIO()
    with redirect_stdout(out):
        main(["tune", *DIGITS, "--search", str(search), "--plan_only"])
    text = out.getvalue()
    configured = re.search(r"poisson: ([0-9.]+)  <- configured", text)
    assert configured is not None
    assert float(configured.group(1)) <= 3.0


# ------------------------------------------------------------------------------- T10: end to end
def test_tune_end_to_end_on_digits(tmp_path: Path) -> None:
    """Two-epoch digits trials: every trial is a real DPStrategy fit whose ledger matches the plan."""
    search = {
        "repetitions": {"distribution": "poisson", "mean": 2},
        "candidates": {"model.init_args.lr": {"choice": [0.3, 1.0]}},
        "score": {"source": "private_validation", "noise_multiplier": 10.0},
    }
    seed = _seed_with(Repetitions.poisson(2), lambda k: k == 2)
    base = [
        *DIGITS,
        "--trainer.max_epochs=2",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}",
    ]
    with pytest.warns(UserWarning, match="seed"):
        result = tune(base, search, out_dir=tmp_path / "tune", seed=seed)
    state = _state(tmp_path / "tune")
    assert sorted(p.name for p in (tmp_path / "tune" / "private").glob("trial_*")) == ["trial_0", "trial_1"]
    assert all(t["status"] == "done" for t in state["trials"])
    (row,) = json.loads(result.report_path.read_text())["per_candidate"]
    assert row["steps"] == 20
    history = [(PoissonGaussian(row["noise_multiplier"], Q), 20), (Gaussian(10.0), 1)]
    assert result.epsilon == pytest.approx(tuned(history, Repetitions.poisson(2))[0], rel=1e-12)
    best = max(range(2), key=lambda i: (state["trials"][i]["score"], state["u"][i]))
    assert result.selected["overrides"] == state["thetas"][best]
    checkpoint = torch.load(result.checkpoint, weights_only=False)
    assert "state_dict" in checkpoint
    assert "noise_generator" not in checkpoint["lightning_dp"]
    assert b"trial_" not in result.checkpoint.read_bytes()
    logged = list((tmp_path / "logs").rglob("metrics.csv"))
    assert len(logged) == 1
    assert "tune/epsilon" in logged[0].read_text()


def test_search_is_recorded_once_in_the_project_ledger(tmp_path: Path) -> None:
    path = tmp_path / "ledger.json"
    path.write_text(json.dumps(digits_ledger().state_dict()))  # an earlier release on the same data
    seed = _seed_with(load_search(SEARCH).repetitions, lambda k: k >= 1)
    result = _run(tmp_path, StubRunner(), seed=seed, ledger=path)
    expected = PrivacyLedger(1e-5)
    expected.record(PoissonGaussian(SIGMA, Q), 300)
    expected.record(RepeatAndSelect.of([digits_ledger().history], load_search(SEARCH).repetitions))
    report = json.loads(result.report_path.read_text())
    assert report["ledger_epsilon"] == pytest.approx(expected.epsilon(), rel=1e-12)
    assert report["ledger_epsilon"] > report["epsilon"]
    again = _run(tmp_path, StubRunner(), seed=seed, ledger=path, resume=True)  # no second record on resume
    assert json.loads(again.report_path.read_text())["ledger_epsilon"] == report["ledger_epsilon"]
