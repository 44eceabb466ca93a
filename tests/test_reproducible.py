"""A seeded run repeats bit for bit, whichever steps the run-time checks happen to dry-run.

The mixing check runs on the first batch and then on batches chosen by a time budget, so which steps it
checks varies from run to run. Its dry passes must leave no trace (module, optimizer, global RNG, the
slots' generators, the noise drawn ahead), or the trajectory would depend on timing.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import TinyModule, make_trainer
from torch import nn

from lightning_dp import DPStrategy, LineSearch
from lightning_dp.checks.mixing import MixingCheck


class DropoutModule(TinyModule):
    """Draws from the global RNG in every forward (dropout), keeps Adam state, has the loss probe."""

    def __init__(self) -> None:
        super().__init__(n=96, batch_size=16, optimizer="adam", lr=0.05)
        self.net = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Dropout(0.25), nn.Linear(16, 3))

    def dp_per_sample_loss(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y, reduction="none")


def _seeded_run(step_kind: str, schedule, monkeypatch, setting=True):
    """One seeded fit; ``schedule``: which calls of the mixing check's ``due`` say yes (after the first
    batch, which every run checks)."""
    calls = itertools.count()
    original = MixingCheck.due

    def forced_due(self: MixingCheck) -> bool:
        wanted = original(self) if self.due_next or not self.enabled else next(calls) in schedule
        return wanted and self.enabled

    monkeypatch.setattr(MixingCheck, "due", forced_due)
    with torch.random.fork_rng():
        torch.manual_seed(0)  # the model's initial weights are the user's to seed (seed= covers the DP draws)
        module = DropoutModule()
        step = {
            "dp_sgd": None,
            "line_search": LineSearch(mode="nn", seed=1),
            "adaptive": LineSearch(mode="adaptive", max_it=2, adapt_clip=True, seed=2, planned_iterations=6),
        }[step_kind]
        strategy = DPStrategy(
            target_epsilon=8.0, delta=1e-5, seed=0, max_grad_norm=1.0, check_sensitivity=setting, step=step
        )
        make_trainer(strategy, max_epochs=1).fit(module)
        rng_after = torch.random.get_rng_state()
    engine = strategy.engine
    return {
        "weights": [p.detach().clone() for p in module.parameters()],
        "adam": [s["exp_avg"].clone() for s in module.trainer.optimizers[0].state.values()],
        "ledger": [(event, n) for event, n in engine.ledger.history],
        "epsilon": engine.ledger.epsilon(),
        "steps": engine.steps,
        "noise_state": engine.state_dict()["noise_generator"],
        "step_stats": None if step is None else dict(step.stats),
        "rng": rng_after,
        "checked": list(strategy.checks.mixing.checked_steps) if setting else [],
    }


def _assert_same(a, b):
    assert a["steps"] == b["steps"] > 1
    for x, y in zip(a["weights"] + a["adam"], b["weights"] + b["adam"], strict=True):
        assert torch.equal(x, y)  # bit for bit: the same seed must give the same model
    assert a["ledger"] == b["ledger"]
    assert a["epsilon"] == b["epsilon"]
    assert a["step_stats"] == b["step_stats"]
    assert torch.equal(a["noise_state"], b["noise_state"])
    assert torch.equal(a["rng"], b["rng"])


@pytest.mark.parametrize("step_kind", ["dp_sgd", "line_search", "adaptive"])
def test_seeded_run_repeats_whichever_steps_the_checks_dry_run(step_kind, monkeypatch):
    every = _seeded_run(step_kind, set(range(100)), monkeypatch)
    sparse = _seeded_run(step_kind, {1, 3}, monkeypatch)
    assert len(every["checked"]) == every["steps"]  # every step's batch was dry-run before its release
    assert sparse["checked"] != every["checked"]  # ... and here only some: the checks ran at other moments
    _assert_same(every, sparse)
    _assert_same(every, _seeded_run(step_kind, set(), monkeypatch, setting=False))  # as without the checks
