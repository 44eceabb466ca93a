"""DPFSDPStrategy (``dp_fsdp``) on 2 CPU processes (gloo): every scenario of tests/fsdp_worker.py runs in one
launch; each test reads its records and compares with the single-process run it stands for."""

from __future__ import annotations

import json
import math

import pytest
import torch
from _worker import launch_ranks
from conftest import TinyModule, make_trainer
from fsdp_models import GPTModule, ShardedTiny
from neighbour import MOVE_RTOL
from tolerances import assert_close_scaled

from lightning_dp import (
    AdaCliP,
    BandMF,
    CyclicPoisson,
    DPConfigurationError,
    DPFSDPStrategy,
    DPStrategy,
    LineSearch,
)
from lightning_dp.accounting import compute_epsilon
from lightning_dp.sampling.dpis import DPIS
from lightning_dp.strategies.fsdp import ShardedParameters


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    ranks = launch_ranks("fsdp_worker.py", out)
    for rank in ranks:  # rank 1 kills itself in the last scenario
        assert rank.returncode in (0, -9), rank.stdout[-5000:]
    assert ranks[0].returncode == 0, ranks[0].stdout[-5000:]

    def load(name: str) -> list[dict]:
        return [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in (0, 1)]

    return out, load


def assert_weights_equal(got: dict, want: dict, dtype: torch.dtype, terms: int) -> None:
    """Equal up to the rounding of sums of ``terms`` values in ``dtype`` (the two runs add them in other orders)."""
    assert set(got) == set(want)
    for key, value in want.items():
        assert_close_scaled(got[key].to(value.dtype), value, dtype=dtype, terms=terms)


def test_two_ranks_equal_one_process_without_noise_or_clipping_fp64(fsdp_results):
    out, load = fsdp_results
    torch.manual_seed(0)
    single = ShardedTiny(n=64, batch_size=64, dtype=torch.float64)
    make_trainer(DPStrategy(noise_multiplier=0.0, max_grad_norm=math.inf, seed=0), max_epochs=5).fit(single)
    got = torch.load(out / "exact.pt", weights_only=True)
    assert_weights_equal(got, single.state_dict(), torch.float32, terms=64)  # the engine sums in fp32
    assert [r["batches"] for r in load("exact")] == [[32] * 5, [32] * 5]  # each rank: its own half


def test_a_binding_clip_with_adam_equals_one_process_and_each_rank_holds_half(fsdp_results):
    out, load = fsdp_results
    torch.manual_seed(0)
    single = ShardedTiny(n=64, batch_size=64, dtype=torch.float64, optimizer="adam", lr=0.01)
    make_trainer(DPStrategy(noise_multiplier=0.0, max_grad_norm=0.05, seed=0), max_epochs=3).fit(single)
    got = torch.load(out / "clipped.pt", weights_only=True)
    assert_weights_equal(got, single.state_dict(), torch.float32, terms=64)
    held = [r["held"] for r in load("clipped")]
    full = held[0]["full_params"]
    assert held[0]["params"] + held[1]["params"] == full  # every coordinate on exactly one rank
    assert max(h["params"] for h in held) <= math.ceil(full / 2) + 16  # ≈ 1/W (dimension-0 row rounding)
    assert [h["state"] for h in held] == [2 * h["params"] for h in held]  # Adam's two moments: the shard's


def test_each_rank_noises_its_own_shard_once_with_std_sigma_c_over_b(fsdp_results):
    _, load = fsdp_results
    expected = 2.0 * 3.0 / 40.0  # σC / B_logical: each coordinate noised once, by its owner
    for rank in load("noise"):
        assert rank["numel"] > 15_000
        assert abs(rank["std"] / expected - 1) < 0.04  # √2× if every rank noised everything, 0 if none did
    r0, r1 = load("noise")
    assert r0["head"] != r1["head"]  # each rank's own generator: different coordinates, different draws


def test_one_example_moves_the_released_sum_by_at_most_c(fsdp_results):
    _, load = fsdp_results
    for rank in load("neighbour"):
        assert 0 < rank["move"] <= 0.01 * (1 + MOVE_RTOL)


def test_epsilon_and_report_equal_one_process(fsdp_results, tmp_path):
    out, load = fsdp_results
    strategy = DPStrategy(noise_multiplier=1.0, seed=3)
    make_trainer(strategy, tmp_path=tmp_path, max_epochs=2).fit(TinyModule(n=128, batch_size=32))
    single = json.loads((tmp_path / "privacy_report.json").read_text())
    sharded = json.loads((out / "epsilon" / "privacy_report.json").read_text())
    for key in (
        "epsilon",
        "delta",
        "steps",
        "sample_rate",
        "noise_multiplier",
        "expected_batch_size",
        "dataset_size",
    ):
        assert sharded[key] == single[key], key
    assert [r["epsilon"] for r in load("epsilon")] == [strategy.epsilon] * 2


def test_tiny_sample_rate_keeps_ranks_in_lock_step(fsdp_results):
    _, load = fsdp_results
    r0, r1 = load("tiny_q")
    assert r0["steps"] == r1["steps"] == 40
    assert (
        r0["epsilon"]
        == r1["epsilon"]
        == pytest.approx(compute_epsilon(noise_multiplier=1.0, sample_rate=0.01, steps=40, delta=1e-5))
    )
    assert r0["seen"] < 40
    assert r1["seen"] < 40
    assert r0["weights"] == r1["weights"]


def test_virtual_batching_equals_one_unsplit_process(fsdp_results):
    out, load = fsdp_results
    torch.manual_seed(0)
    single = ShardedTiny(n=64, batch_size=64)
    make_trainer(DPStrategy(noise_multiplier=0.0, max_grad_norm=0.1, seed=0), max_epochs=3).fit(single)
    got = torch.load(out / "virtual.pt", weights_only=True)
    assert_weights_equal(got, single.state_dict(), torch.float32, terms=64)
    assert [r["max_chunk"] for r in load("virtual")] == [5, 5]


def test_activation_checkpointing_equals_one_process_without_it(fsdp_results):
    out, _ = fsdp_results
    torch.manual_seed(0)
    single = ShardedTiny(n=64, batch_size=64)
    make_trainer(DPStrategy(noise_multiplier=0.0, max_grad_norm=0.1, seed=0), max_epochs=2).fit(single)
    got = torch.load(out / "checkpointed.pt", weights_only=True)
    assert_weights_equal(got, single.state_dict(), torch.float32, terms=64)


def test_user_level_dp_prices_users_like_one_process(fsdp_results):
    _, load = fsdp_results
    for rank in load("users"):
        assert (rank["unit"], rank["units"]) == ("user", 16)
        assert rank["sample_rate"] == 0.5  # q = B_u / U
        assert rank["epsilon"] == pytest.approx(
            compute_epsilon(noise_multiplier=1.0, sample_rate=0.5, steps=rank["steps"], delta=1e-5)
        )
    assert load("users")[0]["steps"] == load("users")[1]["steps"] > 0


def test_bf16_parameters_and_a_frozen_layer_keep_every_contribution_below_c(fsdp_results):
    _, load = fsdp_results
    for rank in load("bf16"):
        assert 0 < rank["max_contribution"] <= 0.05
        assert rank["dtypes"] == ["torch.bfloat16"]
        assert rank["trained"] == ["net.2.bias", "net.2.weight"]


def test_a_sharded_gpt2_with_tied_embeddings_trains_with_exact_per_example_gradients(fsdp_results):
    """C = 1e-3 clips every example: the step is Σ_i C·g_i/‖g_i‖, equal to one process only if each
    example's gradient (tied embedding included) is exact on its rank."""
    out, load = fsdp_results
    torch.manual_seed(0)
    single = GPTModule()
    make_trainer(DPStrategy(noise_multiplier=0.0, max_grad_norm=1e-3, seed=0), max_epochs=2).fit(single)
    got = torch.load(out / "gpt.pt", weights_only=True)
    want = {k: v for k, v in single.state_dict().items() if k in got}
    assert "net.lm_head.weight" not in got or torch.equal(
        got["net.lm_head.weight"], got["net.transformer.wte.weight"]
    )
    assert_weights_equal(got, want, torch.float32, terms=16)
    assert "fast" in load("gpt")[0]["paths"]


def test_sharded_checkpoints_resume_exactly(fsdp_results):
    out, load = fsdp_results
    for rank in load("resume"):
        assert rank["steps"] == 8
        assert rank["same_as_straight"]
        assert rank["epsilon"] == pytest.approx(
            compute_epsilon(noise_multiplier=1.0, sample_rate=0.25, steps=8, delta=1e-5)
        )
        assert {"__0_0.distcp", "__1_0.distcp", "meta.pt"} <= set(rank["files"])
    saved = torch.load(out / "ckpt" / "epoch=0-step=4.ckpt" / "meta.pt", weights_only=True)["lightning_dp"]
    assert saved["world_size"] == 2
    assert len(saved["ranks"]) == 2


def test_a_step_holds_only_the_units_it_is_in_and_sums_one_unit_at_a_time(fsdp_results):
    """FSDP2 gathers each unit for its forward and backward only: the full-size parameters alive at once
    stay within two units (the one computing and the one prefetched), and the clipped sum is formed and
    reduce-scattered one unit at a time, never the whole model's at once."""
    _, load = fsdp_results
    for rank in load("peak"):
        assert (rank["units"], rank["steps"]) == (8, 3)
        assert 0 < rank["params"] <= 2 * rank["unit"] < rank["full"] / 2
        assert 0 < rank["sums"] <= rank["unit"]


@pytest.mark.parametrize(
    ("name", "n", "chunk", "check", "placeholders"),
    [("empty", 1, None, True, 3), ("chunks", 3, 1, True, 3), ("checked", 3, None, "every_step", 6)],
)
def test_a_rank_with_an_empty_batch_fewer_chunks_or_no_check_runs_placeholders_and_equals_one_process(
    fsdp_results, name, n, chunk, check, placeholders
):
    """Rank 1 has no example (``empty``), one chunk fewer (``chunks``) or one example the mixing check cannot
    vary while rank 0 checks its two (``checked``: two dry passes a step): it answers with placeholder passes."""
    out, load = fsdp_results
    torch.manual_seed(0)
    single = ShardedTiny(n=n, batch_size=n, dtype=torch.float64)
    strategy = DPStrategy(
        noise_multiplier=0.0,
        max_grad_norm=math.inf,
        seed=0,
        max_physical_batch_size=chunk,
        check_sensitivity=check,
    )
    make_trainer(strategy, max_epochs=3).fit(single)
    got = torch.load(out / f"{name}.pt", weights_only=True)
    assert_weights_equal(got, single.state_dict(), torch.float32, terms=n)
    r0, r1 = load(name)
    assert r0["steps"] == r1["steps"] == 3
    assert r0["passes"] == r1["passes"]  # the same passes on both ranks: FSDP2's collectives all met
    assert (r0["placeholders"], r1["placeholders"]) == (0, placeholders)


@pytest.mark.parametrize("name", ["empty", "chunks", "checked"])
def test_sync_dist_logs_meet_on_a_rank_of_placeholder_passes_and_average_the_ranks_with_data(
    fsdp_results, name
):
    """The step logs with ``sync_dist=True`` (issue #48): rank 1's placeholder passes (no example, or one chunk
    fewer) make the same all-reduce and count for nothing, so both log rank 0's value, or the mean of both."""
    from sync_logs import check_synced

    _, load = fsdp_results
    ranks = load(name)
    partial = check_synced(ranks)
    assert partial == (3 if name == "empty" else 0)


class _RankZeroOnlyInStep2(ShardedTiny):
    """One process standing for the sharded run below: a summed loss whose second step counts only the
    examples rank 0 owns (index ≡ 0 mod 2); the others are in the batch with gradient 0."""

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        losses = torch.nn.functional.cross_entropy(self(x), y, reduction="none")
        return (losses * ((index % 2 == 0) | (batch_idx != 1))).sum()

    def train_dataloader(self):
        from torch.utils.data import DataLoader, TensorDataset

        return DataLoader(
            TensorDataset(self.x, self.y, torch.arange(len(self.x))), batch_size=self.batch_size
        )


def test_a_training_step_without_loss_on_one_rank_adds_nothing_there_and_keeps_both_in_step(fsdp_results):
    """Rank 1's second step returns None after its forward: that step releases rank 0's examples alone (as one
    process whose loss leaves rank 1's out), the next one both halves again, and no rank waits for the other."""
    out, load = fsdp_results
    torch.manual_seed(0)
    single = _RankZeroOnlyInStep2(n=64, batch_size=64, dtype=torch.float64)
    strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=math.inf, seed=0, loss_reduction="sum")
    make_trainer(strategy, max_epochs=3).fit(single)
    got = torch.load(out / "noloss.pt", weights_only=True)
    assert_weights_equal(got, single.state_dict(), torch.float32, terms=64)
    r0, r1 = load("noloss")
    assert r0["steps"] == r1["steps"] == 3
    assert r0["passes"] == r1["passes"]


def test_one_process_dp_fsdp_equals_dp_strategy():
    """W = 1 (in this process): FSDP2 still gathers and reshards each unit per pass (the root one stays
    gathered after a forward-only pass unless resharded), and the result is DPStrategy's."""
    import torch.distributed as dist

    torch.manual_seed(0)
    single = ShardedTiny(n=32, batch_size=16, dtype=torch.float64)
    make_trainer(DPStrategy(noise_multiplier=0.0, max_grad_norm=0.1, seed=0), max_epochs=2).fit(single)
    torch.manual_seed(0)
    sharded = ShardedTiny(n=32, batch_size=16, dtype=torch.float64)
    try:
        strategy = DPFSDPStrategy(noise_multiplier=0.0, max_grad_norm=0.1, seed=0)
        make_trainer(strategy, devices=1, max_epochs=2).fit(sharded)
        got = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert_weights_equal(got, single.state_dict(), torch.float32, terms=16)
    assert strategy.engine.steps == 4


def test_resume_on_another_world_size_is_refused(fsdp_results):
    import torch.distributed as dist

    out, _ = fsdp_results
    trainer = make_trainer(DPFSDPStrategy(noise_multiplier=1.0, seed=7), devices=1, max_steps=8)
    try:
        with pytest.raises(DPConfigurationError, match="written by 2 processes"):
            trainer.fit(
                ShardedTiny(n=128, batch_size=32), ckpt_path=str(out / "ckpt" / "epoch=0-step=4.ckpt")
            )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_check_refusing_on_one_rank_stops_both_before_the_release(fsdp_results):
    _, load = fsdp_results
    r0, r1 = load("mixing")
    assert "Sensitivity check failed" in r1["refusal"]
    assert r0["refusal"].startswith("Rank 1 refused this step before its release: Sensitivity check failed")
    assert r0["steps"] == r1["steps"] == 0


def test_a_rank_that_dies_fails_the_other_cleanly(fsdp_results):
    out, _ = fsdp_results
    record = json.loads((out / "dies.rank0.json").read_text())
    assert record["failure"]  # rank 0's next collective raised (the worker ran to its end: no hang)
    assert not (out / "dies.rank1.json").exists()


# -- in-process: refusals before any process starts --------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"clipping": AdaCliP()}, "clipping=AdaCliP"),
        ({"sampler": CyclicPoisson(4), "noise": BandMF(noise_multiplier=1.0)}, "noise=BandMF"),
        ({"step": LineSearch()}, "step=LineSearch"),
        ({"sampler": DPIS(), "noise_multiplier": 1.0}, "sampler=DPIS"),
    ],
)
def test_slots_that_need_the_full_parameters_are_refused_by_name(kwargs, named):
    with pytest.raises(DPConfigurationError, match=named):
        DPFSDPStrategy(**kwargs)


class _RecordingSink:
    """A sum sink that keeps each part's sums (doubled, as a stand-in for a reduce-scatter) and notes, at each
    hand-over, which layers' per-example terms were already spent."""

    def __init__(self, grads, parts) -> None:
        self.grads, self.parts, self.spent = grads, parts, []

    def groups(self, params):
        return [[p for p in part if p in set(params)] for part in self.parts]

    def take(self, params, sums):
        self.spent.append([record.spent for record in self.grads.rows._records])
        return [2 * s for s in sums]


def test_a_sum_sink_forms_the_clipped_sum_one_fsdp_unit_at_a_time():
    """The per-example gradients' weighted sum through dp_fsdp's sink: each unit's sums are formed when its
    turn comes (the later units' per-example terms still unspent) and handed over at once; the values are
    those of the whole sum (here over privacy units of two rows)."""
    from lightning_dp.per_example import GradientCapture

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    capture = GradientCapture(net)
    x = torch.randn(8, 4)
    net(x).square().mean().backward()
    rows, _ = capture.collect()
    units = rows.grouped(torch.arange(8) // 2)
    weights = torch.rand(4)
    want = units.weighted_sum(weights)
    first, last = list(net[0].parameters()), list(net[2].parameters())
    units.sink = sink = _RecordingSink(units, [last, first])  # the backward's order: the last unit first
    units.release_on_sum = True
    got = units.weighted_sum(weights)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, 2 * w)
    # records in backward order (the last layer's first): the first layer's terms were summed only at its turn
    assert sink.spent == [[True, False], [True, True]]


def test_a_model_without_fully_shard_is_refused():
    with pytest.raises(DPConfigurationError, match="found no module sharded with fully_shard"):
        ShardedParameters(TinyModule(), world_size=2, rank=0)


def test_dp_fsdp_is_registered_and_takes_the_privacy_arguments_from_yaml():
    from jsonargparse import ArgumentParser
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_dp.strategies.config import PrivacyConfig

    assert StrategyRegistry["dp_fsdp"]["strategy"] is DPFSDPStrategy
    parser = ArgumentParser()
    parser.add_class_arguments(DPFSDPStrategy, "strategy")
    names = {
        action.dest.split(".", 1)[1] for action in parser._actions if action.dest.startswith("strategy.")
    }
    assert set(PrivacyConfig.parameters()) <= names
    assert DPFSDPStrategy(target_epsilon=2.0, max_grad_norm=0.5).config == PrivacyConfig(
        target_epsilon=2.0, max_grad_norm=0.5, owner="DPFSDPStrategy"
    )
