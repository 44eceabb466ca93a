"""LineSearch's config and state (``lightning_dp/steps/line_search/config.py``): ``LineSearchConfig`` and
``LineSearchState``.

LineSearch's keywords, its frozen ``LineSearchConfig`` and LightningCLI YAML build the same step; its state
round-trips, old layout too.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import TinyModule, make_trainer

from lightning_dp import DPConfigurationError, DPStrategy, LineSearch, LineSearchConfig, Step
from lightning_dp.steps.line_search import LineSearchState

# -- LineSearch: keywords, config, YAML -------------------------------------------------------------------------
SETTINGS = {"mode": "adaptive", "budget_increase": 0.5, "angle_high": 1.3, "clip_decay": 0.1, "eta0": 2.0}


def test_line_search_keywords_and_config_are_one_list_with_the_algorithm_s_names():
    import dataclasses
    import inspect

    fields = {f.name: f.default for f in dataclasses.fields(LineSearchConfig)}
    parameters = {p.name: p.default for p in inspect.signature(LineSearch).parameters.values()}
    assert parameters == fields
    step = LineSearch(**SETTINGS)
    assert step.config == LineSearchConfig(**SETTINGS) == LineSearch.from_config(step.config).config
    assert step.config.budget_increase == 0.5
    assert step.config.angle_high == 1.3
    assert not any(hasattr(step, old) for old in ("xi", "phi_max", "phi_min", "psi", "zeta", "mode"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.config.beta = 0.5  # type: ignore[misc]


def test_line_search_config_fills_the_mode_defaults_and_validates_as_the_keywords_did():
    assert (LineSearchConfig().loss_clip, LineSearchConfig().armijo) == (3.0, 0.001)
    assert (LineSearchConfig(mode="adaptive").loss_clip, LineSearchConfig(mode="adaptive").armijo) == (
        1.0,
        0.5,
    )
    assert LineSearch(mode="adaptive").eta0 == 1.0
    assert LineSearch().eta0 is None
    for build in (LineSearch, LineSearchConfig):
        with pytest.raises(
            DPConfigurationError, match=r"^LineSearch: budget_increase must be ≥ 0, got -1\.0"
        ):
            build(budget_increase=-1.0)
        with pytest.raises(DPConfigurationError, match="line_search_batch='fresh'"):
            build(mode="adaptive", line_search_batch="same")


def test_line_search_from_yaml_is_the_keywords_step(tmp_path):
    from jsonargparse import ArgumentParser

    path = tmp_path / "step.yaml"
    path.write_text(
        "step:\n  class_path: lightning_dp.LineSearch\n  init_args:\n"
        + "".join(f"    {k}: {v}\n" for k, v in SETTINGS.items())
    )
    parser = ArgumentParser()
    parser.add_argument("--config", action="config")
    parser.add_argument("--step", type=Step)
    step = parser.instantiate(parser.parse_args(["--config", str(path)])).step
    assert isinstance(step, LineSearch)
    assert step.config == LineSearchConfig(**SETTINGS)


def test_ranks_compare_the_line_search_config_field_by_field():
    """DDP refuses ranks whose slots differ: the frozen config's fields are compared, as the attributes were."""
    from lightning_dp.strategies.ddp import find_disagreement, slot_settings

    ours, theirs = slot_settings(LineSearch(**SETTINGS)), slot_settings(LineSearch(**SETTINGS))
    assert find_disagreement([ours, theirs]) is None
    assert ours["config.budget_increase"] == 0.5
    assert ours["state.eta0"] == 2.0
    other = slot_settings(LineSearch(**{**SETTINGS, "budget_increase": 0.4}))
    assert find_disagreement([ours, other]) == (1, "config.budget_increase", 0.4, 0.5)


class LossModule(TinyModule):
    def dp_per_sample_loss(self, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y, reduction="none")


def _fit_line_search(step: LineSearch, batch: int) -> tuple[list[torch.Tensor], LineSearch]:
    torch.manual_seed(0)
    module = LossModule(n=2 * batch, batch_size=batch)
    strategy = DPStrategy(noise_multiplier=1.0, step=step, seed=0)
    make_trainer(strategy, max_steps=2).fit(module)
    return [p.detach().clone() for p in module.parameters()], step


@pytest.mark.parametrize("batch", [8, 1024])
def test_line_search_from_config_trains_as_from_keywords(batch):
    settings = {"seed": 1, "max_it": 4}
    by_keywords, first = _fit_line_search(LineSearch(**settings), batch)
    by_config, second = _fit_line_search(LineSearch.from_config(LineSearchConfig(**settings)), batch)
    assert all(torch.equal(a, b) for a, b in zip(by_keywords, by_config, strict=True))
    assert first.stats == second.stats
    assert first.stats["searches"] == 2


# -- LineSearch: the state ---------------------------------------------------------------------------------------
OLD_KEYS = {
    "rho_grad", "search_budget", "c_obj", "c_grad", "eta0", "accepted", "iteration", "theta_bar", "d_prev",
    "stats", "last", "generators",
}  # fmt: skip


def test_line_search_state_round_trips_and_keeps_the_checkpoint_keys():
    _, step = _fit_line_search(LineSearch(seed=1, max_it=4), 8)
    saved = step.state_dict()
    assert set(saved) == OLD_KEYS
    resumed = LineSearch(seed=1, max_it=4)
    resumed.load_state_dict(saved)
    again = resumed.state_dict()
    assert again.keys() == saved.keys()
    for key in OLD_KEYS - {"d_prev", "generators"}:
        assert again[key] == saved[key], key
    assert all(torch.equal(a, b) for a, b in zip(again["d_prev"], saved["d_prev"], strict=True))
    assert isinstance(resumed.state, LineSearchState)
    assert resumed.state.iteration == 2


def test_an_old_line_search_checkpoint_resumes():
    """The layout written before the state was a dataclass: no generators, a counter added since missing."""
    old = {
        "rho_grad": 0.4, "search_budget": 0.2, "c_obj": 3, "c_grad": 1.0, "eta0": 1, "accepted": [0.5],
        "iteration": 7, "theta_bar": 80, "d_prev": None, "last": {"eta": 0.5, "index": 2},
        "stats": {"searches": 7, "failures": 1, "at_eta0": 2, "cheb": 0, "rho_raises": 0, "search_raises": 0},
    }  # fmt: skip
    step = LineSearch()
    step.load_state_dict(old)
    assert step.state == LineSearchState(
        c_obj=3.0, eta0=1.0, rho_grad=0.4, search_budget=0.2, c_grad=1.0, accepted=[0.5], iteration=7,
        theta_bar=80.0, stats={**old["stats"], "clip_shrinks": 0}, last={"eta": 0.5, "index": 2},
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert step.metrics()["ls/searches"] == 7.0
