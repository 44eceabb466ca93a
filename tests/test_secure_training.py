"""Secure noise and public constants through the Trainer (issue #50): what ``DPStrategy(secure=True)`` and
``DPStrategy(dataset_size=N)`` release, price and report, and what they refuse."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import TinyModule, make_trainer
from neighbour import assert_neighbour_bound, neighbour_move, released_sum, tiny_data
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import (
    DPIS,
    AdaCliP,
    BandMF,
    CyclicPoisson,
    DiscreteGaussian,
    DPConfigurationError,
    DPStrategy,
    FixedSize,
    LineSearch,
    UserPoisson,
)
from lightning_dp.accounting import PrivacyLedger
from lightning_dp.accounting.discrete_gaussian import PoissonDiscreteGaussian
from lightning_dp.clipping import GridClipping, IntegerGrid
from lightning_dp.run.report import privacy_report


class Sized(TinyModule):
    """TinyModule on its first ``n`` examples (the real N), the rest of its settings unchanged."""

    def __init__(self, n: int) -> None:
        super().__init__(n=256)
        self.x, self.y = self.x[:n], self.y[:n]


def _fit(strategy: DPStrategy, module: TinyModule, **kwargs) -> DPStrategy:
    make_trainer(strategy, **kwargs).fit(module)
    return strategy


@pytest.fixture(scope="module")
def secure_run() -> tuple[DPStrategy, TinyModule, dict]:
    module = TinyModule()
    strategy = _fit(DPStrategy(target_epsilon=3.0, secure=True), module, max_epochs=2)
    return strategy, module, privacy_report(strategy)


def test_a_secure_run_trains_and_its_ledger_prices_the_discrete_gaussian(secure_run):
    strategy, module, _ = secure_run
    engine = strategy.engine
    assert type(engine.noise) is DiscreteGaussian
    assert type(engine.clipping) is GridClipping
    assert engine.steps == 16
    assert 2.5 < strategy.epsilon <= 3.0
    ((event, count),) = engine.ledger.history
    assert type(event) is PoissonDiscreteGaussian
    assert (count, event.ranks, event.dimension) == (16, 1, sum(p.numel() for p in module.parameters()))
    shadow = PrivacyLedger(1e-5)
    shadow.record(event, 16)
    assert shadow.epsilon() == strategy.epsilon
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_the_report_says_what_was_used(secure_run):
    strategy, _, report = secure_run
    mechanism = report["noise_mechanism"]
    assert "os.urandom" in mechanism["generator"]
    assert "symmetric noise" in mechanism["accounting"]
    assert mechanism["grid_dimension"] == strategy.engine.noise.grid.dimension
    assert 0 < mechanism["sampler_delta"] < 1e-12
    assert report["clipping"] == "GridClipping"
    assert report["released_constants"]["dataset_size"] == {
        "value": 256,
        "source": "the training set's real size (assumed public)",
        "declared_public": False,
    }
    assert "assumed public" in report["public_constants"]
    json.dumps(report)


class SharedLayer(TinyModule):
    """One Linear called twice in a forward: its per-example gradient is the sum of two calls' (the grid
    clipping must add them before the norm and the rounding)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = torch.nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(torch.tanh(self.shared(torch.tanh(self.shared(x)))))


def _fidelity_strategy(secure: bool) -> DPStrategy:
    return DPStrategy(noise_multiplier=0.0, max_grad_norm=1e3, secure=secure, seed=0)


@pytest.mark.parametrize("model", [TinyModule, SharedLayer])
def test_without_noise_the_secure_sum_is_the_float_sum_to_half_a_grid_step_per_example(model):
    """σ = 0, C far above every norm: the integers times γ are autograd's summed gradients (the float
    path's, which equal them), to the rounding of each example (≤ γ/2 a coordinate)."""
    module, n = model(), 8
    data = tiny_data(module, n)
    secure = released_sum(module, data, lambda: _fidelity_strategy(True))
    plain = released_sum(module, data, lambda: _fidelity_strategy(False))
    assert secure.sums is not None
    assert plain.sums is not None
    step = secure.strategy.engine.noise.grid.step(1e3)
    for ints, floats in zip(secure.sums, plain.sums, strict=True):
        assert torch.equal(ints, ints.round())
        assert float((ints * step - floats).abs().max()) <= n * step / 2 + 1e-5 * float(floats.abs().max())


@pytest.mark.parametrize("n", [8, 1024])
def test_one_example_moves_the_integer_sum_by_at_most_the_rounded_sensitivity(n):
    """The neighbour test at B = 8 and 1024."""
    module = TinyModule(n=1024)
    move = neighbour_move(
        module,
        tiny_data(module, n),
        lambda: DPStrategy(noise_multiplier=0.0, max_grad_norm=1e-2, secure=True, seed=0),
    )
    grid = IntegerGrid(1e-3)
    grid.setup(list(module.parameters()))
    assert move.sensitivity == grid.sensitivity
    assert_neighbour_bound(move)
    assert move.l2 > 0.99 * grid.unit  # the removed example was clipped: it moved the sum by about C/γ


def test_a_user_level_secure_run_clips_and_rounds_each_user():
    """Users of two rows each: each user's rows are summed before the clip and the rounding (UserPoisson)."""
    strategy = DPStrategy(
        noise_multiplier=1.0, secure=True, privacy_unit="user", user_key=lambda i: i // 2,
        examples_per_user=2, users_per_step=16,
    )  # fmt: skip
    _fit(strategy, TinyModule(), max_steps=2)
    assert type(strategy.engine.ledger.history[0][0]) is PoissonDiscreteGaussian
    assert strategy.engine.sampler.sample_rate == 16 / 128


def test_the_integer_sum_does_not_depend_on_the_chunking():
    """Exact int64 sums: the same integers whole or in chunks of 3 (the float path's differ in the last bits)."""
    module = TinyModule()
    data = tiny_data(module, 16)
    whole = released_sum(module, data, lambda: DPStrategy(noise_multiplier=0.0, secure=True, seed=0))
    chunked = released_sum(
        module,
        data,
        lambda: DPStrategy(noise_multiplier=0.0, secure=True, seed=0, max_physical_batch_size=3),
    )
    assert whole.sums is not None
    assert chunked.sums is not None
    assert all(torch.equal(a, b) for a, b in zip(whole.sums, chunked.sums, strict=True))


# -- public constants ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def declared_runs() -> list[DPStrategy]:
    """Two fits on data sets of different real size, both declaring dataset_size=256."""
    return [
        _fit(DPStrategy(target_epsilon=2.0, dataset_size=256, seed=n), Sized(n), max_epochs=2)
        for n in (200, 256)
    ]


def test_nothing_released_reads_the_real_size_once_it_is_declared(declared_runs):
    small, full = declared_runs
    for run in declared_runs:
        sampler = run.engine.sampler
        assert sampler.sample_rate == 32 / 256
        assert sampler.expected_batch_size == 32
        assert run.engine.steps == 2 * math.ceil(256 / 32)
    assert small.engine.noise.noise_multiplier(0) == full.engine.noise.noise_multiplier(0)
    assert small.epsilon == full.epsilon
    constants = privacy_report(small)["released_constants"]
    assert constants["dataset_size"] == {"value": 256, "source": "dataset_size=", "declared_public": True}
    assert all(entry["declared_public"] for entry in constants.values())
    assert privacy_report(small)["dataset_size"] == 256
    assert small.engine.sampler.num_samples == 200  # the sampler still draws from the real examples


def test_users_and_cyclic_groups_take_the_declared_size():
    users = UserPoisson(user_key=list(range(100)), examples_per_user=1, users_per_step=10)
    users.public_size = 400
    users.bind(100, 10)
    assert (users.sample_rate, users.batches_per_epoch(100, 10), users.expected_batch_size) == (
        10 / 400,
        40,
        10,
    )
    cyclic = CyclicPoisson(bands=4, seed=0)
    cyclic.public_size = 1000
    cyclic.bind(500, 10)
    assert cyclic.sample_rate == 10 * 4 / 1000
    strategy = DPStrategy(
        target_epsilon=2.0, sampler=CyclicPoisson(bands="auto"), noise=BandMF(), dataset_size=1000
    )
    assert strategy.engine.sampler.public_size == 1000


def test_declared_sizes_are_refused_where_the_guarantee_reads_the_real_one():
    with pytest.raises(DPConfigurationError, match="dataset_size=100 with sampler=FixedSize"):
        DPStrategy(noise_multiplier=1.0, sampler=FixedSize(), dataset_size=100)
    with pytest.raises(DPConfigurationError, match="dataset_size must be"):
        DPStrategy(noise_multiplier=1.0, dataset_size=0)
    strategy = DPStrategy(noise_multiplier=1.0, dataset_size=16)
    loader = DataLoader(TensorDataset(torch.randn(64, 10), torch.zeros(64).long()), batch_size=32)
    with pytest.raises(DPConfigurationError, match="as declared by dataset_size"):
        make_trainer(strategy, max_steps=1).fit(TinyModule(), train_dataloaders=loader)


# -- what secure noise refuses ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"clipping": AdaCliP()}, "cannot round another clipping"),
        ({"noise": BandMF()}, "secure noise is the discrete Gaussian"),
        ({"accountant": "prv"}, "priced by their RDP curve"),
        ({"sampler": DPIS()}, "Poisson-subsampled discrete Gaussian"),
        ({"step": LineSearch()}, "its own noise or ledger rule"),
        ({"max_grad_norm": math.inf, "noise_multiplier": 0.0}, "has no grid"),
    ],
)
def test_secure_noise_refuses_what_it_cannot_price(arguments, match):
    with pytest.raises(DPConfigurationError, match=match):
        DPStrategy(secure=True, **arguments)


def test_the_grid_clipping_needs_its_own_noise():
    with pytest.raises(DPConfigurationError, match="sharing one grid"):
        DPStrategy(noise_multiplier=1.0, clipping=GridClipping(IntegerGrid(1e-3)))
    strategy = DPStrategy(noise=DiscreteGaussian(1.0, rounding_slack=1e-2))  # the slot alone selects it
    assert type(strategy.engine.clipping) is GridClipping
    assert strategy.engine.clipping.grid is strategy.engine.noise.grid


def test_the_shares_are_priced_for_the_ranks_the_strategy_connects():
    strategy = DPStrategy(noise_multiplier=1.0, secure=True)
    engine = strategy.engine
    engine.connect(0, 4, lambda tensors: tensors)
    engine.noise.grid.dimension = 50
    event = engine.next_event()
    assert (event.ranks, event.share_scale) == (4, pytest.approx(engine.noise.grid.sensitivity / 2))


def test_a_resume_keeps_sigma_and_refuses_another_grid():
    saved = DiscreteGaussian(1.3, rounding_slack=1e-3).state_dict()
    resumed = DiscreteGaussian(rounding_slack=1e-3)
    resumed.load_state_dict(saved)
    assert resumed.sigma == 1.3
    with pytest.raises(ValueError, match="same grid"):
        DiscreteGaussian(rounding_slack=1e-2).load_state_dict(saved)
